"""Helpers shared by inference/chatbot.py, inference/prompt_eval.py and applications/e2e_rlhf.py.

Loading a trained model folder (or a config.json for random weights), DS-Chat's
"\\n\\nHuman: ...\\n\\nAssistant:" framing, batched greedy/sampled generation with left
padding, and reward scoring of generated answers the way step 3 scores them (prompt ids +
answer ids up to and including the first eos, score at the last real token).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from dschat.utils.errors import UserInputError

HUMAN, ASSISTANT = "\n\nHuman:", "\n\nAssistant:"


def frame_prompt(text: str) -> str:
    """A user question in the training data's frame; already framed prompts pass through."""
    if "Assistant:" in text:
        return text
    return f"{HUMAN} {text.strip()}{ASSISTANT}"


def pick_device(device: str | None) -> torch.device:
    """--device: an explicit choice, else the first GPU when there is one, else the CPU."""
    if device:
        if device.startswith("cuda") and not torch.cuda.is_available():
            raise UserInputError(f"--device {device}: no CUDA device on this machine")
        return torch.device(device)
    return torch.device("cuda:0" if torch.cuda.is_available() else "cpu")


def pick_dtype(dtype: str | None, device: torch.device) -> torch.dtype:
    """--dtype: fp32/fp16/bf16; default bf16 on a GPU, fp32 on the CPU."""
    names = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
    if dtype is None:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in names:
        raise UserInputError(f"--dtype {dtype}: expected one of {sorted(names)}")
    return names[dtype]


def load_causal_lm(path: str, device: torch.device, dtype: torch.dtype, flag: str = "--path"):
    """(model, tokenizer) of a step-1 / step-3 actor folder, a hub name, or a config.json
    (seeded random weights, for smoke tests); the model is in eval mode on `device`."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from dschat.models.model_utils import create_hf_model, has_weights, load_tokenizer

    hf_logging.disable_progress_bar()  # a "Loading weights" bar per model clutters chat and tables

    p = Path(path)
    if p.exists() and p.is_dir() and (p / "reward_model.json").exists():
        raise UserInputError(f"{flag} {path} is a reward model (step-2 output); pass a causal LM "
                             "(step-1 output or step-3 actor/)")
    if not p.exists() and path.startswith((".", "/", "~")):
        raise UserInputError(f"{flag} {path}: no such file or folder")
    tokenizer = load_tokenizer(path)
    if p.suffix == ".json" or (p.is_dir() and not has_weights(p)):
        model = create_hf_model(path, tokenizer)
    else:
        try:
            model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        except (OSError, ValueError) as e:
            raise UserInputError(f"{flag} {path}: cannot load a model ({str(e).splitlines()[0][:200]})") from None
    return model.to(device=device, dtype=dtype).eval(), tokenizer


def load_reward(path: str, device: torch.device, dtype: torch.dtype, flag: str = "--reward_model"):
    """(reward model, tokenizer) of a step-2 output folder, in eval mode on `device`."""
    from dschat.models.model_utils import load_tokenizer
    from dschat.models.reward_model import load_reward_model

    tokenizer = load_tokenizer(path)
    model = load_reward_model(path, tokenizer, flag=flag)
    return model.to(device=device, dtype=dtype).eval(), tokenizer


@dataclass
class Sampling:
    """Decoding settings: greedy unless a temperature, top_p or top_k is given."""
    max_new_tokens: int = 128
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    repetition_penalty: float | None = None

    @property
    def do_sample(self) -> bool:
        return any(v is not None for v in (self.temperature, self.top_p, self.top_k))

    def generate_kwargs(self, tokenizer) -> dict:
        kw = dict(max_new_tokens=self.max_new_tokens, do_sample=self.do_sample, num_beams=1,
                  eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
        if self.do_sample:
            kw.update(temperature=self.temperature if self.temperature is not None else 1.0,
                      top_p=self.top_p if self.top_p is not None else 1.0,
                      top_k=self.top_k if self.top_k is not None else 0)
        if self.repetition_penalty:
            kw["repetition_penalty"] = self.repetition_penalty
        return kw


def chat_format(tokenizer, chat_template: str = "auto", stop_strings=None):
    """The ChatFormat of step 3 for this tokenizer (see dschat.data.chat)."""
    from dschat.data.chat import ChatFormat
    from dschat.data.tokenize import end_of_conversation_text
    return ChatFormat(tokenizer, chat_template, end_of_conversation_text(tokenizer, None), stop_strings)


@torch.no_grad()
def generate_answers(model, tokenizer, prompts: list[str], sampling: Sampling, *,
                     batch_size: int = 16, max_prompt_len: int | None = None, seed: int = 1234,
                     chat=None):
    """Answers to framed `prompts`: a list of (prompt_ids, answer_ids, answer_text).

    Prompts are rendered as step 3 renders them (`chat`, default: the tokenizer's chat
    template when it has one), tokenised alone and left-padded per batch; a prompt longer
    than `max_prompt_len` keeps its last tokens. Answers end as step 3's do: at eos or the
    end-of-turn token (kept), or before a stop string.
    """
    from transformers import GenerationConfig

    chat = chat or chat_format(tokenizer)
    device = next(model.parameters()).device
    torch.manual_seed(seed)
    config = GenerationConfig(**{**sampling.generate_kwargs(tokenizer), "eos_token_id": list(chat.stop_token_ids)})
    out = []
    for start in range(0, len(prompts), batch_size):
        chunk = prompts[start:start + batch_size]
        ids = [tokenizer(chat.prompt(p), add_special_tokens=chat.add_special_tokens)["input_ids"] for p in chunk]
        if max_prompt_len:
            ids = [x[-max_prompt_len:] for x in ids]
        width = max(len(x) for x in ids)
        pad = tokenizer.pad_token_id
        input_ids = torch.tensor([[pad] * (width - len(x)) + x for x in ids], device=device)
        mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in ids], device=device)
        seq = model.generate(input_ids=input_ids, attention_mask=mask, generation_config=config)
        for row, prompt_ids in zip(seq[:, width:].tolist(), ids):
            answer = row[:chat.answer_length(row, pad)]
            out.append((prompt_ids, answer, tokenizer.decode(answer, skip_special_tokens=True)))
    return out


@torch.no_grad()
def reward_scores(reward_model, pairs: list[tuple[list[int], list[int]]], pad_id: int,
                  batch_size: int = 16) -> list[float]:
    """Reward of each (prompt_ids, answer_ids): the value at the last real token, as in step 3."""
    device = next(reward_model.parameters()).device
    scores = []
    for start in range(0, len(pairs), batch_size):
        seqs = [p + a for p, a in pairs[start:start + batch_size]]
        width = max(len(s) for s in seqs)
        ids = torch.tensor([s + [pad_id] * (width - len(s)) for s in seqs], device=device)
        mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in seqs], device=device)
        out = reward_model.forward_value(ids, mask)
        scores += [float(x) for x in out["chosen_end_scores"]]
    return scores


@torch.no_grad()
def answer_logprobs(model, pairs: list[tuple[list[int], list[int]]], pad_id: int,
                    batch_size: int = 16) -> list[float]:
    """Sum of log p(answer token | everything before it) of each (prompt_ids, answer_ids)."""
    from dschat.utils.tensor_ops import gather_log_probs

    device = next(model.parameters()).device
    out = []
    for start in range(0, len(pairs), batch_size):
        chunk = pairs[start:start + batch_size]
        seqs = [p + a for p, a in chunk]
        width = max(len(s) for s in seqs)
        ids = torch.tensor([s + [pad_id] * (width - len(s)) for s in seqs], device=device)
        mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in seqs], device=device)
        logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1].float()
        logp = gather_log_probs(logits, ids[:, 1:])
        for row, (p, a) in zip(logp, chunk):
            out.append(float(row[len(p) - 1:len(p) - 1 + len(a)].sum()))
    return out


def read_prompts(path: str) -> list[dict]:
    """Rows of a prompt file: JSONL with `prompt` (and optional `chosen`/`reference`),
    or plain text with one prompt per line. Prompts are framed as in the training data."""
    p = Path(path)
    if not p.is_file():
        raise UserInputError(f"--prompts {path}: no such file")
    rows = []
    with open(p, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            if p.suffix in (".jsonl", ".json") or line.lstrip().startswith("{"):
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as e:
                    raise UserInputError(f"--prompts {path} line {n}: not JSON ({e})") from None
                if not isinstance(record, dict) or not isinstance(record.get("prompt"), str):
                    raise UserInputError(f"--prompts {path} line {n}: needs a string 'prompt' field")
                rows.append({"prompt": frame_prompt(record["prompt"]),
                             "reference": record.get("reference", record.get("chosen"))})
            else:
                rows.append({"prompt": frame_prompt(line.rstrip("\n")), "reference": None})
    if not rows:
        raise UserInputError(f"--prompts {path}: no prompts in the file")
    return rows


def heldout_prompts(data_path: list[str], data_split: str, seed: int, limit: int) -> list[dict]:
    """Up to `limit` prompts no step trained on: the eval rows of step 3's share of the data
    under --data_split/--seed, topped up from steps 2 and 1's eval rows when it has fewer.
    Each row says which step's eval share it came from (`source`)."""
    from dschat.data.datasets import blend_rows

    rows, seen = [], set()
    for phase in (3, 2, 1):
        if len(rows) >= limit:
            break
        try:
            _, evals = blend_rows(data_path, data_split, phase, seed)
        except UserInputError:
            continue  # this step gets no rows under --data_split
        for r in evals:
            if r.prompt not in seen and len(rows) < limit:
                seen.add(r.prompt)
                rows.append({"prompt": r.prompt, "reference": r.chosen, "source": f"step{phase}-eval"})
    return rows

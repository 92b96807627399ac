#!/usr/bin/env python
"""Chat with a trained model, several turns, tokens printed as they are generated.

    python inference/chatbot.py --path output/e2e-demo/step3/actor
    python inference/chatbot.py --path out/step3/actor --temperature 0.7 --top_p 0.9 --max_new_tokens 256
    printf 'What is 2 plus 3?\\nAnd 4 times 5?\\n' | python inference/chatbot.py --path ...   # not a terminal

The conversation is framed as the training data is: the tokenizer's chat template when it
has one (--chat_template auto), else DS-Chat's "\\n\\nHuman: <you>\\n\\nAssistant:<model>";
earlier turns are kept as history (the oldest are dropped when the prompt would exceed
--max_history_tokens). An answer ends at eos, the template's end-of-turn token, or where
the model starts a new "Human:"/"Assistant:" turn itself. Commands: `clear` starts
a new conversation, `quit` (or end of input) leaves. When stdin is not a terminal each
line is one turn, echoed after "Human:", so transcripts read like a session.
"""
import argparse
import sys

import torch

from dschat.utils.errors import UserInputError
from dschat.utils.run import main_guard
from inference.common import ASSISTANT, HUMAN, Sampling, chat_format, load_causal_lm, pick_device, pick_dtype

MARKERS = (HUMAN, ASSISTANT, "\nHuman:", "\nAssistant:")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--path", required=True,
                   help="A causal-LM folder: step-1 output, step-3 actor/, or a hub name "
                        "(a config.json: random weights).")
    p.add_argument("--max_new_tokens", type=int, default=128, help="Answer tokens at most per turn.")
    p.add_argument("--temperature", type=float, default=None, help="Sample at this temperature (default: greedy).")
    p.add_argument("--top_p", type=float, default=None, help="Nucleus sampling.")
    p.add_argument("--top_k", type=int, default=None, help="Top-k sampling.")
    p.add_argument("--repetition_penalty", type=float, default=None, help="HF repetition penalty (e.g. 1.2).")
    p.add_argument("--max_history_tokens", type=int, default=None,
                   help="Prompt budget incl. history (default: the model's context minus --max_new_tokens, "
                        "at most 2048).")
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (default: cuda:0 if present, else cpu).")
    p.add_argument("--dtype", default=None, choices=("fp32", "fp16", "bf16"),
                   help="Model precision (default: bf16 on GPU, fp32 on CPU).")
    p.add_argument("--seed", type=int, default=1234, help="Sampling seed.")
    p.add_argument("--chat_template", default="auto", choices=("auto", "none"),
                   help="auto: the tokenizer's chat template when it has one; none: DS-Chat's raw text.")
    return p.parse_args(argv)


def validate(args) -> None:
    problems = []
    if args.max_new_tokens < 1:
        problems.append(f"--max_new_tokens must be >= 1, got {args.max_new_tokens}")
    if args.temperature is not None and args.temperature <= 0:
        problems.append(f"--temperature must be > 0, got {args.temperature} (leave it out for greedy decoding)")
    if args.top_p is not None and not 0 < args.top_p <= 1:
        problems.append(f"--top_p must be in (0, 1], got {args.top_p}")
    if args.top_k is not None and args.top_k < 1:
        problems.append(f"--top_k must be >= 1, got {args.top_k}")
    if problems:
        raise UserInputError("; ".join(problems))


def cut_marker(text: str) -> tuple[str, bool]:
    """`text` up to the first turn marker the model wrote itself, and whether there was one."""
    hits = [text.find(m) for m in MARKERS if m in text]
    if not hits:
        return text, False
    return text[:min(hits)], True


def held_back(text: str) -> int:
    """Length of the tail of `text` that could be the start of a turn marker (not printed yet)."""
    for n in range(min(len(text), max(len(m) for m in MARKERS)), 0, -1):
        if any(m.startswith(text[-n:]) for m in MARKERS):
            return n
    return 0


class TurnPrinter:
    """Prints streamed answer text at once, except a tail that may become a turn marker."""

    def __init__(self, out=sys.stdout):
        self.out = out
        self.text = ""
        self.printed = 0
        self.stopped = False

    def feed(self, chunk: str, final: bool = False) -> None:
        if self.stopped:
            return
        self.text += chunk
        visible, self.stopped = cut_marker(self.text)
        end = len(visible) if (self.stopped or final) else len(visible) - held_back(visible)
        if end > self.printed:
            self.out.write(visible[self.printed:end])
            self.out.flush()
            self.printed = end

    def answer(self) -> str:
        return cut_marker(self.text)[0]


def make_streamer(tokenizer, printer: TurnPrinter):
    """A transformers TextStreamer that hands decoded text to `printer` as it is finalised."""
    from transformers import TextStreamer

    class _Streamer(TextStreamer):
        def on_finalized_text(self, text: str, stream_end: bool = False):
            printer.feed(text, final=stream_end)

    return _Streamer(tokenizer, skip_prompt=True, skip_special_tokens=True)


def make_stopper(tokenizer, prompt_len: int):
    """Stop generating once the answer contains a turn marker (the model started a new turn)."""
    from transformers import StoppingCriteria, StoppingCriteriaList

    class _Stop(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            tail = tokenizer.decode(input_ids[0, prompt_len:][-12:], skip_special_tokens=True)
            return torch.tensor([any(m in tail for m in MARKERS)], device=input_ids.device)

    return StoppingCriteriaList([_Stop()])


class Chat:
    """One conversation with a model: history, prompt building, streamed generation."""

    def __init__(self, model, tokenizer, sampling: Sampling, max_history_tokens: int, seed: int,
                 chat_template: str = "auto"):
        self.model, self.tokenizer, self.sampling = model, tokenizer, sampling
        self.chat = chat_format(tokenizer, chat_template)
        self.max_history_tokens = max_history_tokens
        self.seed = seed
        self.history: list[tuple[str, str]] = []

    def prompt_ids(self, question: str) -> list[int]:
        """History + the new question, dropping the oldest turns until it fits the budget."""
        turns = self.history + [(question, None)]
        while True:
            text = "".join(f"{HUMAN} {q}{ASSISTANT}" + (a if a is not None else "") for q, a in turns)
            ids = self.tokenizer(self.chat.prompt(text), add_special_tokens=False)["input_ids"]
            if len(ids) <= self.max_history_tokens or len(turns) == 1:
                return ids[-self.max_history_tokens:]
            turns = turns[1:]

    @torch.no_grad()
    def reply(self, question: str, out=sys.stdout) -> str:
        """Generate the answer to `question`, printing it as it comes; remember the turn."""
        from transformers import GenerationConfig

        ids = self.prompt_ids(question)
        device = next(self.model.parameters()).device
        input_ids = torch.tensor([ids], device=device)
        printer = TurnPrinter(out)
        torch.manual_seed(self.seed + len(self.history))
        self.model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                            generation_config=GenerationConfig(**{**self.sampling.generate_kwargs(self.tokenizer),
                                                                  "eos_token_id": list(self.chat.stop_token_ids)}),
                            streamer=make_streamer(self.tokenizer, printer),
                            stopping_criteria=make_stopper(self.tokenizer, len(ids)))
        printer.feed("", final=True)
        answer = printer.answer()
        if not answer.startswith(" "):
            answer = " " + answer  # answers in the training data start with a space
        self.history.append((question, answer.rstrip()))
        return answer.strip()


def context_budget(model, max_new_tokens: int, requested) -> int:
    if requested:
        return requested
    limit = getattr(model.config, "max_position_embeddings", None) or 2048
    return max(16, min(limit, 2048) - max_new_tokens)


def read_turns(interactive: bool):
    """Lines typed at a "Human: " prompt, or read from a pipe (echoed)."""
    while True:
        try:
            line = input("\nHuman: ") if interactive else sys.stdin.readline()
        except (EOFError, KeyboardInterrupt):
            return
        if not interactive:
            if not line:
                return
            line = line.rstrip("\n")
            print(f"\nHuman: {line}")
        yield line.strip()


def main(argv=None):
    args = parse_args(argv)
    validate(args)
    device = pick_device(args.device)
    model, tokenizer = load_causal_lm(args.path, device, pick_dtype(args.dtype, device))
    sampling = Sampling(args.max_new_tokens, args.temperature, args.top_p, args.top_k, args.repetition_penalty)
    chat = Chat(model, tokenizer, sampling, context_budget(model, args.max_new_tokens, args.max_history_tokens),
                args.seed, args.chat_template)
    params = sum(p.numel() for p in model.parameters()) / 1e6
    decoding = "greedy" if not sampling.do_sample else (
        f"sampling (temperature {args.temperature}, top_p {args.top_p}, top_k {args.top_k})")
    print(f"Chatting with {args.path} ({model.config.model_type}, {params:.1f}M parameters) on {device}, {decoding}.\n"
          "Type 'clear' to start a new conversation, 'quit' to leave.", flush=True)
    interactive = sys.stdin.isatty()
    for question in read_turns(interactive):
        if not question:
            continue
        if question.lower() in ("quit", "exit"):
            break
        if question.lower() == "clear":
            chat.history.clear()
            print("(conversation cleared)", flush=True)
            continue
        print("Assistant:", end="", flush=True)
        chat.reply(question)
        print(flush=True)
    print("bye", flush=True)


if __name__ == "__main__":
    main_guard(main)

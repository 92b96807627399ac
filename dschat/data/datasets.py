"""The datasets of the three steps and of ptx data, built from sources and cached.

    create_prompt_dataset(...)       -> (train, eval) for step 1 (SFT), 2 (reward) or 3 (PPO)
    create_unsupervised_dataset(...) -> blocks of text for the PPO ptx loss

Step 1 items: input_ids / attention_mask / labels, prompt + chosen + end-of-conversation
text, right-padded to max_seq_len (labels -100 on padding). Step 2 items: chosen_* and
rejected_* tokenised the same way. Step 3 items: the prompt ids alone, unpadded (the
collator left-pads); prompts longer than the limit are dropped, not truncated.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional, Sequence

import torch
from torch.utils.data import Dataset

from dschat.data import formats as F
from dschat.data.cache import build_once, cache_key, tokenizer_fingerprint
from dschat.data.chat import ChatFormat
from dschat.data.sources import Source, fingerprint, iter_entries, load_source, resolve_entry
from dschat.data.split import chunk_indices, parse_data_split, permutation, take, train_eval_indices
from dschat.data.tokenize import (
    encode,
    end_of_conversation_text,
    pack,
    packed_item,
    packed_len,
    pad_right,
    pad_token_id,
    truncate,
)
from dschat.utils.errors import UserInputError
from dschat.utils.logging import get_logger

logger = get_logger("dschat.data")

SPLITS = ("train", "eval")
PHASE_FIELDS = {1: ("input",), 2: ("chosen", "rejected"), 3: ("prompt",)}


# ----------------------------------------------------------------------------- datasets
class PromptDataset(Dataset):
    """Tokenised rows of one step. Stored unpadded; items are built (padded) on access."""

    def __init__(self, train_phase: int, store: dict[str, dict], max_seq_len: int,
                 pad_token_id: int):
        self.train_phase = train_phase
        self.store = store
        self.max_seq_len = max_seq_len
        self.pad_token_id = pad_token_id

    def __len__(self) -> int:
        return packed_len(next(iter(self.store.values())))

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if self.train_phase == 1:
            ids, mask = pad_right(packed_item(self.store["input"], index), self.max_seq_len,
                                  self.pad_token_id)
            return {"input_ids": ids, "attention_mask": mask,
                    "labels": ids.masked_fill(mask == 0, -100)}
        if self.train_phase == 2:
            item = {}
            for side in ("chosen", "rejected"):
                ids, mask = pad_right(packed_item(self.store[side], index), self.max_seq_len,
                                      self.pad_token_id)
                item[f"{side}_input_ids"], item[f"{side}_attention_mask"] = ids, mask
            return item
        item = {"prompt_input_ids": packed_item(self.store["prompt"], index)}
        if "fields" in self.store:  # the row's other columns, for --reward_fn
            item["fields"] = self.store["fields"][index] or {}
        return item


class BlockDataset(Dataset):
    """Fixed-length blocks of concatenated text (ptx data): input_ids = labels, mask all 1."""

    def __init__(self, tokens: torch.Tensor, block_size: int):
        self.tokens = tokens
        self.block_size = block_size

    def __len__(self) -> int:
        return self.tokens.numel() // self.block_size

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if not 0 <= index < len(self):
            raise IndexError(index)
        start = index * self.block_size
        ids = self.tokens[start:start + self.block_size].long()
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


# ----------------------------------------------------------------------------- rows
def _check_kind(source: Source, phase: int, flag: str) -> None:
    """Step 2 needs pairs; text-only data is ptx data only."""
    if phase in F.KIND_PHASES[source.kind]:
        return
    if source.kind == F.SFT:
        raise UserInputError(
            f"{flag} {source.entry}: has prompt+response rows with no rejected answer; "
            f"usable in steps 1 and 3, not step {phase} (which needs chosen and rejected)")
    raise UserInputError(
        f"{flag} {source.entry}: has only text rows; that is ptx data for "
        f"--unsupervised_dataset_name, not step {phase} data")


def _train_eval(source: Source, seed: int) -> tuple[list, list]:
    """The source's train and eval rows; a train-only source is first cut 9:1."""
    if source.eval is not None:
        return source.train, source.eval
    train_idx, eval_idx = train_eval_indices(len(source.train), seed)
    return take(source.train, train_idx), take(source.train, eval_idx)


def phase_rows(source: Source, data_split: str, phase: int, seed: int) -> tuple[list, list]:
    """The (train, eval) rows of `source` that step `phase` uses under --data_split."""
    fractions = parse_data_split(data_split)
    train, evals = _train_eval(source, seed)
    chunk_train = take(train, chunk_indices(len(train), fractions, phase - 1, seed))
    chunk_eval = take(evals, chunk_indices(len(evals), fractions, phase - 1, seed))
    if not chunk_train:
        raise UserInputError(
            f"--data_split {data_split}: step {phase} gets no rows of --data_path "
            f"{source.entry} ({len(train)} train rows, step {phase}'s share "
            f"{fractions[phase - 1]:.0%})")
    return chunk_train, chunk_eval


def _shuffled(rows: list, seed: int) -> list:
    return take(rows, permutation(len(rows), seed))


def blend_rows(data_path: Sequence[str], data_split: str, phase: int, seed: int,
               sft_only_data_path: Sequence[str] = ()) -> tuple[list, list]:
    """Rows of every --data_path entry for this step, concatenated and shuffled (seeded);
    in step 1 the --sft_only_data_path datasets are added whole."""
    train, evals = [], []
    for entry in data_path:
        source = load_source(entry, "--data_path")
        _check_kind(source, phase, "--data_path")
        tr, ev = phase_rows(source, data_split, phase, seed)
        formats = ", ".join(sorted(set(source.formats)))
        logger.info(f"--data_path {entry}: {source.kind} rows ({formats}); step {phase} takes "
                    f"{len(tr)} train / {len(ev)} eval rows")
        train += tr
        evals += ev
    train, evals = _shuffled(train, seed), _shuffled(evals, seed)
    if phase == 1 and sft_only_data_path:
        for entry in sft_only_data_path:
            source = load_source(entry, "--sft_only_data_path")
            _check_kind(source, 1, "--sft_only_data_path")
            tr, ev = _train_eval(source, seed)
            logger.info(f"--sft_only_data_path {entry}: all {len(tr)} train / {len(ev)} "
                        f"eval rows")
            train += tr
            evals += ev
        train, evals = _shuffled(train, seed), _shuffled(evals, seed)
    return train, evals


# ----------------------------------------------------------------------------- tokenise
def _tokenize_phase1(rows, chat, max_len, eot, side, stats):
    seqs = encode(chat.tokenizer, [chat.conversation(r.prompt, r.chosen, eot) for r in rows],
                  chat.add_special_tokens)
    stats["truncated"] = sum(len(s) > max_len for s in seqs)
    return {"input": pack([truncate(s, max_len, side) for s in seqs])}


def _tokenize_phase2(rows, chat, max_len, eot, side, stats):
    distinct = [r for r in rows if r.chosen != r.rejected]
    stats["identical_pairs"] = len(rows) - len(distinct)
    chosen = encode(chat.tokenizer, [chat.conversation(r.prompt, r.chosen, eot) for r in distinct],
                    chat.add_special_tokens)
    rejected = encode(chat.tokenizer, [chat.conversation(r.prompt, r.rejected, eot) for r in distinct],
                      chat.add_special_tokens)
    stats["truncated"] = sum(len(c) > max_len or len(r) > max_len
                             for c, r in zip(chosen, rejected))
    chosen = [truncate(s, max_len, side) for s in chosen]
    rejected = [truncate(s, max_len, side) for s in rejected]
    # Pairs that only differ beyond max_seq_len give the reward loss nothing to compare.
    keep = [i for i, (c, r) in enumerate(zip(chosen, rejected)) if c != r]
    stats["identical_after_truncation"] = len(chosen) - len(keep)
    return {"chosen": pack([chosen[i] for i in keep]),
            "rejected": pack([rejected[i] for i in keep])}


def _tokenize_phase3(rows, chat, max_len, eot, side, stats, row_fields=False):
    prompts = encode(chat.tokenizer, [chat.prompt(r.prompt) for r in rows], chat.add_special_tokens)
    fitting = [i for i, p in enumerate(prompts) if len(p) <= max_len]
    stats["too_long_prompts"] = len(prompts) - len(fitting)
    stats["shortest_prompt"] = min((len(p) for p in prompts), default=0)
    out = {"prompt": pack([prompts[i] for i in fitting])}
    if row_fields:  # one small dict (or None) per kept prompt: the row's extra columns
        out["fields"] = [rows[i].fields for i in fitting]
    return out


_TOKENIZERS = {1: _tokenize_phase1, 2: _tokenize_phase2, 3: _tokenize_phase3}


def _log_drops(split: str, phase: int, max_len: int, stats: dict) -> None:
    flag = "--max_prompt_seq_len" if phase == 3 else "--max_seq_len"
    notes = {"identical_pairs": "pairs with chosen == rejected skipped",
             "identical_after_truncation": f"pairs identical within {flag} {max_len} skipped",
             "too_long_prompts": f"prompts longer than {flag} {max_len} dropped",
             "truncated": f"rows truncated to {flag} {max_len}"}
    for key, note in notes.items():
        if stats.get(key):
            (logger.warning if key != "truncated" else logger.info)(
                f"step {phase} {split}: {stats[key]} {note}")


def _build_prompt_payload(data_path, data_split, phase, seed, chat, max_seq_len, eot,
                          sft_only_data_path, row_fields=False):
    train, evals = blend_rows(data_path, data_split, phase, seed, sft_only_data_path)
    side = getattr(chat.tokenizer, "truncation_side", "right")
    splits, meta = {}, {"train_phase": phase, "max_seq_len": max_seq_len, "stats": {}}
    for split, rows in (("train", train), ("eval", evals)):
        stats = {"rows": len(rows)}
        extra = {"row_fields": True} if row_fields else {}
        splits[split] = _TOKENIZERS[phase](rows, chat, max_seq_len, eot, side, stats, **extra)
        stats["items"] = packed_len(next(iter(splits[split].values())))
        meta["stats"][split] = stats
        _log_drops(split, phase, max_seq_len, stats)
    train_stats = meta["stats"]["train"]
    if phase == 3 and train_stats["items"] == 0:
        raise UserInputError(
            f"no prompt in {', '.join(data_path)} fits --max_prompt_seq_len {max_seq_len} "
            f"(shortest is {train_stats['shortest_prompt']} tokens)")
    if train_stats["items"] == 0:
        raise UserInputError(f"step {phase}: no usable training example in "
                             f"{', '.join(data_path)} (see the warnings above)")
    if meta["stats"]["eval"]["items"] == 0:
        logger.warning(f"step {phase}: the eval split is empty")
    return splits, meta


# ----------------------------------------------------------------------------- public API
def _entries(value) -> list[str]:
    return list(iter_entries(value or ()))


def _validate_common(train_phase: int, max_seq_len: int) -> None:
    if train_phase not in (1, 2, 3):
        raise UserInputError(f"train_phase must be 1, 2 or 3, got {train_phase!r}")
    flag = "--max_prompt_seq_len" if train_phase == 3 else "--max_seq_len"
    if not isinstance(max_seq_len, int) or max_seq_len <= 0:
        raise UserInputError(f"{flag} must be a positive integer, got {max_seq_len!r}")


def prompt_cache_dir(data_path, data_split: str, output_path: str, train_phase: int, seed: int,
                     tokenizer, max_seq_len: int, end_of_conversation_token=None,
                     sft_only_data_path=(), chat_template: str = "none", row_fields: bool = False) -> Path:
    """The cache folder `create_prompt_dataset` uses for these arguments."""
    data_path, sft_only = _entries(data_path), _entries(sft_only_data_path)
    fractions = parse_data_split(data_split)
    parts = {
        "what": "prompt", "train_phase": train_phase, "seed": seed,
        "data_split": [round(x, 12) for x in fractions], "max_seq_len": max_seq_len,
        "data_path": [fingerprint(resolve_entry(e, "--data_path")) for e in data_path],
        "tokenizer": tokenizer_fingerprint(tokenizer), "pad_id": pad_token_id(tokenizer),
    }
    chat = ChatFormat(tokenizer, chat_template).fingerprint
    if chat != "none":  # raw-text caches keep the keys they always had
        parts["chat"] = chat
    if train_phase == 3 and row_fields:  # caches without fields keep the keys they always had
        parts["row_fields"] = True
    if train_phase in (1, 2):
        parts["eot"] = end_of_conversation_text(tokenizer, end_of_conversation_token)
    if train_phase == 1:
        parts["sft_only_data_path"] = [fingerprint(resolve_entry(e, "--sft_only_data_path"))
                                       for e in sft_only]
    return Path(output_path) / cache_key(parts)


def create_prompt_dataset(local_rank: int, data_path: list[str], data_split: str,
                          output_path: str, train_phase: int, seed: int, tokenizer,
                          max_seq_len: int, end_of_conversation_token: Optional[str] = None,
                          sft_only_data_path: list[str] = (), reload: bool = False,
                          chat_template: str = "none", row_fields: bool = False
                          ) -> tuple[PromptDataset, PromptDataset]:
    """(train, eval) datasets of step `train_phase`, built once on local rank 0 and cached.

    Step 3: `max_seq_len` is the maximum prompt length (--max_prompt_seq_len); longer
    prompts are dropped. `chat_template` "auto" renders rows with the tokenizer's chat
    template when it has one (dschat.data.chat); "none" keeps DS-Chat's raw text.
    `row_fields` (step 3): items also carry "fields", the row's other scalar columns (e.g.
    a reference "answer"), which the collator passes on for --reward_fn.
    """
    _validate_common(train_phase, max_seq_len)
    data_path, sft_only = _entries(data_path), _entries(sft_only_data_path)
    if not data_path and not (train_phase == 1 and sft_only):
        raise UserInputError("--data_path: no dataset given")
    eot = end_of_conversation_text(tokenizer, end_of_conversation_token)
    pad_id = pad_token_id(tokenizer)
    folder = prompt_cache_dir(data_path, data_split, output_path, train_phase, seed, tokenizer,
                              max_seq_len, end_of_conversation_token, sft_only, chat_template,
                              row_fields and train_phase == 3)
    chat = ChatFormat(tokenizer, chat_template, eot)
    logger.info(f"step {train_phase} data: conversations as {chat.describe()}")

    def build():
        return _build_prompt_payload(data_path, data_split, train_phase, seed, chat,
                                     max_seq_len, eot, sft_only if train_phase == 1 else (),
                                     row_fields and train_phase == 3)

    splits, meta = build_once(folder, build, local_rank, reload, SPLITS)
    datasets = tuple(PromptDataset(train_phase, splits[s], max_seq_len, pad_id) for s in SPLITS)
    for ds in datasets:
        ds.cache_dir, ds.stats = folder, meta["stats"]
    return datasets


def _build_unsupervised_payload(entries, config_name, tokenizer, block_size, seed):
    docs = []
    for entry in entries:
        source = load_source(entry, "--unsupervised_dataset_name", config_name)
        docs += [row.as_text() for row in source.train]
        logger.info(f"--unsupervised_dataset_name {entry}: {len(source.train)} documents")
    docs = _shuffled(docs, seed)
    eos = tokenizer.eos_token_id
    # Documents are separated by eos so the LM loss never runs across a document boundary
    # unannounced.
    seqs = [ids + [eos] if eos is not None else ids for ids in encode(tokenizer, docs)]
    total = sum(map(len, seqs))
    blocks = total // block_size
    if blocks == 0:
        raise UserInputError(f"--unsupervised_dataset_name {', '.join(entries)}: "
                             f"{total} tokens in all, less than one block of {block_size}")
    tokens = pack(seqs)["tokens"][:blocks * block_size]
    meta = {"stats": {"documents": len(docs), "tokens": total, "blocks": blocks}}
    return {"train": {"tokens": tokens.clone()}}, meta


def create_unsupervised_dataset(names_or_paths: list[str], config_name: Optional[str], tokenizer,
                                block_size: int, output_path: str, seed: int,
                                local_rank: int, reload: bool = False) -> BlockDataset:
    """Blocks of `block_size` tokens from the concatenated text of ptx data (cached).

    Entries are anything `--data_path` takes (a hub name is loaded with `config_name`);
    `text` rows are used as they are, prompt/answer rows as prompt + chosen.
    """
    entries = _entries(names_or_paths)
    if not entries:
        raise UserInputError("--unsupervised_dataset_name: no dataset given")
    if not isinstance(block_size, int) or block_size <= 0:
        raise UserInputError(f"block size must be a positive integer, got {block_size!r}")
    parts = {"what": "unsupervised", "block_size": block_size, "seed": seed,
             "config_name": config_name, "tokenizer": tokenizer_fingerprint(tokenizer),
             "data": [fingerprint(resolve_entry(e, "--unsupervised_dataset_name", config_name))
                      for e in entries]}
    folder = Path(output_path) / cache_key(parts)
    splits, meta = build_once(
        folder, lambda: _build_unsupervised_payload(entries, config_name, tokenizer, block_size,
                                                    seed),
        local_rank, reload, ("train",))
    dataset = BlockDataset(splits["train"]["tokens"], block_size)
    dataset.cache_dir, dataset.stats = folder, meta["stats"]
    return dataset

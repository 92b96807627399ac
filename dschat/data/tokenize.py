"""Tokenisation helpers and the packed (ragged) token store used by the datasets and cache.

Sequences are stored unpadded: one flat int32 tensor of tokens plus int64 offsets. Padding
happens per item, so caches stay small and padding never has to be guessed from ids.
"""
from __future__ import annotations

import itertools
from typing import Optional, Sequence

import numpy as np
import torch

from dschat.utils.errors import UserInputError
from dschat.utils.logging import get_logger

logger = get_logger("dschat.data")

ENCODE_BATCH = 1024


def encode(tokenizer, texts: Sequence[str], add_special_tokens: bool = True) -> list[list[int]]:
    """Token ids of each text, untruncated, with the tokenizer's own special tokens.

    `add_special_tokens=True` as upstream, so tokenizers that prepend bos (LLaMA, OPT) keep
    doing it; the bundled tokenizer adds nothing. Text rendered by a chat template already
    holds them (False).
    """
    out: list[list[int]] = []
    for start in range(0, len(texts), ENCODE_BATCH):
        batch = list(texts[start:start + ENCODE_BATCH])
        # verbose=False: no "sequence longer than model_max_length" warning; we cut ourselves.
        out.extend(tokenizer(batch, add_special_tokens=add_special_tokens, verbose=False)["input_ids"])
    return out


def truncate(ids: list[int], max_len: int, side: str = "right") -> list[int]:
    """At most `max_len` ids, cut on `side` (the tokenizer's truncation_side)."""
    if len(ids) <= max_len:
        return ids
    return ids[-max_len:] if side == "left" else ids[:max_len]


def pack(seqs: Sequence[Sequence[int]]) -> dict[str, torch.Tensor]:
    """Ragged sequences -> {"tokens": flat int32, "offsets": int64 [n + 1]}."""
    lengths = torch.tensor([len(s) for s in seqs], dtype=torch.int64)
    offsets = torch.zeros(len(seqs) + 1, dtype=torch.int64)
    torch.cumsum(lengths, 0, out=offsets[1:])
    flat = np.fromiter(itertools.chain.from_iterable(seqs), dtype=np.int32,
                       count=int(lengths.sum()))
    return {"tokens": torch.from_numpy(flat), "offsets": offsets}


def packed_len(packed: dict[str, torch.Tensor]) -> int:
    return packed["offsets"].numel() - 1


def packed_item(packed: dict[str, torch.Tensor], index: int) -> torch.Tensor:
    """Sequence `index` of a packed store as a 1-D LongTensor."""
    offsets = packed["offsets"]
    return packed["tokens"][offsets[index]:offsets[index + 1]].long()


def pad_right(ids: torch.Tensor, length: int, pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids right-padded to `length`, attention mask) as LongTensors."""
    n = ids.numel()
    out = torch.full((length,), pad_id, dtype=torch.long)
    out[:n] = ids
    mask = torch.zeros(length, dtype=torch.long)
    mask[:n] = 1
    return out, mask


def pad_left(ids: torch.Tensor, length: int, pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids left-padded to `length`, attention mask) as LongTensors."""
    n = ids.numel()
    out = torch.full((length,), pad_id, dtype=torch.long)
    mask = torch.zeros(length, dtype=torch.long)
    if n:
        out[length - n:] = ids
        mask[length - n:] = 1
    return out, mask


def pad_token_id(tokenizer) -> int:
    """The tokenizer's pad id; its eos id when it has no pad token (LLaMA, GPT-2 style)."""
    if tokenizer.pad_token_id is not None:
        return int(tokenizer.pad_token_id)
    if tokenizer.eos_token_id is not None:
        logger.warning("tokenizer has no pad token; padding with its eos token id "
                       f"{tokenizer.eos_token_id}")
        return int(tokenizer.eos_token_id)
    raise UserInputError("the tokenizer has neither a pad token nor an eos token; set "
                         "tokenizer.pad_token before building the datasets")


def end_of_conversation_text(tokenizer, end_of_conversation_token: Optional[str]) -> str:
    """Text appended to every conversation in steps 1-2: the given token, else eos."""
    if end_of_conversation_token:
        return end_of_conversation_token
    if tokenizer.eos_token:
        return tokenizer.eos_token
    logger.warning("tokenizer has no eos token and no --eot_token was given: conversations "
                   "get no end marker")
    return ""

"""On-disk cache of tokenised datasets, keyed by everything that changes the result.

Layout: `<output_path>/<sha256 key>/{train.pt, eval.pt, meta.json}`. Local rank 0 builds
it while the other ranks wait at a barrier, then every rank loads it. The folder is
written under a temporary name and renamed into place, so a half-written cache (a crash,
a kill, a second node racing on a shared disk) is never loaded.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable

import torch

from dschat.utils import dist
from dschat.utils.logging import get_logger

logger = get_logger("dschat.data")

# Bump when tokenisation, splitting or the stored layout changes: old caches then miss.
FORMAT_VERSION = 1
META_FILE = "meta.json"
_SPECIAL_ATTRS = ("bos_token", "eos_token", "pad_token", "unk_token", "sep_token",
                  "cls_token", "mask_token")


def tokenizer_fingerprint(tokenizer) -> str:
    """sha256 of what decides how `tokenizer` encodes text (vocab, merges, specials)."""
    h = hashlib.sha256()
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        spec = json.loads(backend.to_str())
        # Truncation / padding state is mutated by calls; it does not change the encoding.
        spec.pop("truncation", None)
        spec.pop("padding", None)
        h.update(json.dumps(spec, sort_keys=True).encode())
    else:
        h.update(json.dumps(sorted(tokenizer.get_vocab().items())).encode())
    extra = {name: str(getattr(tokenizer, name, None)) for name in _SPECIAL_ATTRS}
    extra.update(cls=type(tokenizer).__name__,
                 truncation_side=getattr(tokenizer, "truncation_side", None),
                 additional=sorted(map(str, getattr(tokenizer, "all_special_tokens", []))),
                 # Catches automatic bos/eos insertion, whatever the tokenizer's mechanism.
                 probe=list(tokenizer("Hello world")["input_ids"]))
    h.update(json.dumps(extra, sort_keys=True).encode())
    return h.hexdigest()


def cache_key(parts: dict) -> str:
    """sha256 of the JSON of `parts` (plus the format version)."""
    text = json.dumps({"format_version": FORMAT_VERSION, **parts}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def is_complete(folder: Path) -> bool:
    return (Path(folder) / META_FILE).is_file()


def save_atomic(folder: Path, splits: dict[str, dict], meta: dict) -> None:
    """Write {split: {name: tensor}} and meta into `folder`, appearing all at once."""
    folder = Path(folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.tmp-", dir=folder.parent))
    try:
        for name, tensors in splits.items():
            torch.save(tensors, tmp / f"{name}.pt")
        with open(tmp / META_FILE, "w", encoding="utf-8") as f:
            json.dump(meta, f, indent=2, sort_keys=True, default=str)
        old = None
        if folder.exists():  # reload=True: move the old cache aside, then swap in the new
            old = Path(tempfile.mkdtemp(prefix=f".{folder.name}.old-", dir=folder.parent))
            os.rename(folder, old / "cache")
        try:
            os.rename(tmp, folder)
        except OSError:
            if not is_complete(folder):  # someone else's finished cache is just as good
                raise
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def load(folder: Path, split_names) -> tuple[dict[str, dict], dict]:
    """({split: {name: tensor}}, meta) from a complete cache folder."""
    folder = Path(folder)
    with open(folder / META_FILE, encoding="utf-8") as f:
        meta = json.load(f)
    splits = {name: torch.load(folder / f"{name}.pt", weights_only=True) for name in split_names}
    return splits, meta


def build_once(folder: Path, build: Callable[[], tuple[dict, dict]], local_rank: int,
               reload: bool, split_names) -> tuple[dict[str, dict], dict]:
    """Build the cache on local rank 0 (unless present), wait at a barrier, load everywhere.

    An error while building is re-raised on the building rank after it reaches the barrier,
    so the other ranks fail with a pointer to it instead of hanging.
    """
    folder = Path(folder)
    error = None
    if local_rank <= 0 and (reload or not is_complete(folder)):
        try:
            splits, meta = build()
            save_atomic(folder, splits, meta)
            logger.info(f"data cache written: {folder}")
        except BaseException as err:  # re-raised below, after the barrier
            error = err
    dist.barrier()
    if error is not None:
        raise error
    if not is_complete(folder):
        raise RuntimeError(f"data cache {folder} is missing: local rank 0 failed to build "
                           f"it (see its error)")
    return load(folder, split_names)

"""The decode linears' per-shape race winners kept on disk, so that a second process on the
same machine skips the race (timing each candidate kernel takes most of the fast path's
first call).

One JSON file per identity (GPU model, compute capability, SM count, torch / CUDA / Triton
versions, a hash of the kernels' source and the launch options the timings depend on),
named by the identity's hash:

    {"identity": {...}, "choices": {"<shape key>": ["<winner name>", <config or null>]}}

Nothing in it is trusted: a file that does not parse, holds another identity or entries of
the wrong form is ignored (logged once) and rewritten by the next race; the caller checks
each entry against the candidates it would race. Writes are atomic (temporary file +
rename) and merge with what other processes wrote meanwhile, last writer winning per key.

Folder: $DSCHAT_KERNEL_CACHE_DIR, else $XDG_CACHE_HOME/dschat/kernels, else
~/.cache/dschat/kernels; DSCHAT_KERNEL_CACHE_DIR="" turns the cache off.
"""
from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Optional

from dschat.utils.logging import get_logger

logger = get_logger(__name__)

ENV = "DSCHAT_KERNEL_CACHE_DIR"


def cache_folder() -> Optional[Path]:
    """The cache folder, or None when DSCHAT_KERNEL_CACHE_DIR is set empty."""
    env = os.environ.get(ENV)
    if env is not None:
        return Path(env) if env.strip() else None
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "dschat" / "kernels"


def _valid_config(cfg) -> bool:
    return cfg is None or (isinstance(cfg, list) and 0 < len(cfg) <= 8
                           and all(isinstance(v, (int, str)) and not isinstance(v, bool) for v in cfg))


class RaceCache:
    """Race winners of one identity: `get(key)` -> (name, config) or None, `put(key, name, config)`.
    Keys are tuples of str / int / bool / float (their repr is the JSON key); configs tuples
    of int / str, or None for cuBLAS."""

    def __init__(self, folder: Path, identity: dict):
        self.identity = identity
        digest = hashlib.sha1(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]
        self.path = Path(folder) / f"decode_linear-{digest}.json"
        self._choices: Optional[dict] = None

    def _read(self) -> dict:
        try:
            data = json.loads(self.path.read_text())
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as exc:
            logger.warning("kernel cache %s is unreadable (%s): ignored, the race runs again", self.path, exc)
            return {}
        if not isinstance(data, dict) or data.get("identity") != self.identity \
                or not isinstance(data.get("choices"), dict):
            logger.warning("kernel cache %s is stale or malformed: ignored, the race runs again", self.path)
            return {}
        good = {k: v for k, v in data["choices"].items()
                if isinstance(v, list) and len(v) == 2 and isinstance(v[0], str) and _valid_config(v[1])}
        if len(good) != len(data["choices"]):
            logger.warning("kernel cache %s: %d malformed entries ignored", self.path,
                           len(data["choices"]) - len(good))
        return good

    def get(self, key: tuple) -> Optional[tuple]:
        if self._choices is None:
            self._choices = self._read()
        entry = self._choices.get(repr(key))
        if entry is None:
            return None
        name, cfg = entry
        return name, None if cfg is None else tuple(cfg)

    def put(self, key: tuple, name: str, cfg: Optional[tuple]) -> None:
        entry = [name, None if cfg is None else list(cfg)]
        choices = self._read()
        choices[repr(key)] = entry
        self._choices = choices
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=self.path.name, suffix=".tmp")
        except OSError as exc:          # a read-only home: the run goes on uncached
            logger.warning("kernel cache %s not written (%s)", self.path, exc)
            return
        try:
            with os.fdopen(fd, "w") as f:
                json.dump({"identity": self.identity, "choices": choices}, f, indent=0, sort_keys=True)
            os.replace(tmp, self.path)
        except OSError as exc:          # a full disk
            logger.warning("kernel cache %s not written (%s)", self.path, exc)
            Path(tmp).unlink(missing_ok=True)

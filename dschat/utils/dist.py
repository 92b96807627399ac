"""Thin torch.distributed helpers that are no-ops in a single process.

The only module outside `dschat/engine/` allowed to touch `torch.distributed`
(docs/CONVENTIONS.md), so data code and tests can run without a process group.
"""
from __future__ import annotations

import os


def _dist():
    import torch.distributed as dist
    return dist


def is_initialized() -> bool:
    """Whether a default process group exists."""
    dist = _dist()
    return dist.is_available() and dist.is_initialized()


def get_rank() -> int:
    """Global rank (0 without a process group)."""
    return _dist().get_rank() if is_initialized() else 0


def get_world_size() -> int:
    """World size (1 without a process group)."""
    return _dist().get_world_size() if is_initialized() else 1


def get_local_rank() -> int:
    """Rank within the node, from the launcher's LOCAL_RANK (0 when unset)."""
    return int(os.environ.get("LOCAL_RANK", "0"))


def barrier() -> None:
    """Wait for every rank; does nothing without a process group."""
    if is_initialized():
        _dist().barrier()


def broadcast_object(obj, src: int = 0):
    """`obj` from rank `src` on every rank (returned unchanged without a process group)."""
    if not is_initialized():
        return obj
    holder = [obj]
    _dist().broadcast_object_list(holder, src=src)
    return holder[0]


def all_gather_object(obj) -> list:
    """Every rank's `obj`, in rank order (`[obj]` without a process group)."""
    if not is_initialized():
        return [obj]
    out = [None] * get_world_size()
    _dist().all_gather_object(out, obj)
    return out

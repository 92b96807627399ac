"""Rank-0 printing and a module logger that never imports torch.distributed directly."""
import logging
import os
import sys


def global_rank() -> int:
    return int(os.environ.get("RANK", "0"))


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


def is_rank_0() -> bool:
    return global_rank() == 0


def print_rank_0(msg, *, force: bool = False) -> None:
    if force or is_rank_0():
        print(msg, flush=True)


def get_logger(name: str) -> logging.Logger:
    logger = logging.getLogger(name)
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stdout)
        handler.setFormatter(logging.Formatter(f"[rank{global_rank()}] %(levelname)s %(name)s: %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False
    return logger

"""Run bookkeeping shared by the entry points: seeding, resolved config, output folders."""
from __future__ import annotations

import json
import os
import random
import sys
from pathlib import Path

import numpy as np
import torch

from dschat.utils import dist
from dschat.utils.errors import FinalSaveFailed, TrainingHalted, UserInputError


def set_seed(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)


def resolved_config(args, **extra) -> dict:
    """Everything that defines the run: flags after defaults, plus DeepSpeed configs etc."""
    return {"argv": sys.argv, "args": vars(args), **extra}


def save_json(payload: dict, path: str | Path) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    with open(tmp, "w") as f:
        json.dump(payload, f, indent=2, sort_keys=True, default=str)
    os.replace(tmp, path)


def resolve_under(output_dir: str, path: str) -> str:
    """Relative logging paths live under --output_dir."""
    return path if os.path.isabs(path) else os.path.join(output_dir, path)


def main_guard(main, hard_exit: bool | None = None):
    """Run `main`: bad user input becomes one line on stderr and exit code 2; a run that
    halted on purpose (`TrainingHalted`) prints its reason and exits 3; a final save that
    failed after the trained state was checkpointed (`FinalSaveFailed`) exits 4.

    A process that started a process group leaves through `os._exit` once `main` is done
    and its outputs are flushed: with torch 2.13 + gloo on loaded CPUs a rank sometimes died
    with SIGABRT ("terminate called without an active exception") inside C++ static
    destruction after all its work was saved, and the launcher then reported a failed run.
    Nothing of ours runs after `main` returns, so skipping interpreter teardown loses nothing
    (every metrics sink is closed by `main`; Python `logging` is shut down here).
    `hard_exit=False` keeps the normal teardown (for entry points that never start one).
    """
    code = 0
    try:
        result = main()
        code = result if isinstance(result, int) else 0
    except UserInputError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        code = 2
    except TrainingHalted as e:
        print(f"halted: {e}", file=sys.stderr, flush=True)
        code = 3
    except FinalSaveFailed as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        code = 4
    if hard_exit is None:
        hard_exit = dist.is_initialized()
    if not hard_exit:
        sys.exit(code)
    _exit_now(code)


def _exit_now(code: int) -> None:
    import logging

    dist.shutdown_distributed()
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)

"""Run bookkeeping shared by the entry points: seeding, resolved config, output folders."""
from __future__ import annotations

import json
import os
import random
import sys
from pathlib import Path

import numpy as np
import torch

from dschat.utils.errors import TrainingHalted, UserInputError


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


def main_guard(main):
    """Run `main`: bad user input becomes one line on stderr and exit code 2; a run that
    halted on purpose (`TrainingHalted`) prints its reason and exits 3."""
    try:
        return main()
    except UserInputError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        sys.exit(2)
    except TrainingHalted as e:
        print(f"halted: {e}", file=sys.stderr, flush=True)
        sys.exit(3)

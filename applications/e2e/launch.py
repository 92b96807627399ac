"""Launching the steps: the deepspeed launcher command, the child environment, logged runs,
and what an earlier run left (timings, checkpoints, flags it was trained with)."""
from __future__ import annotations

import json
import os
import shlex
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

from applications.e2e.plan import Step
from applications.e2e.presets import REPO
from dschat.utils.errors import UserInputError


def pick_deployment(requested: str | None, hostfile: str | None) -> str:
    """--deployment-type, else: a hostfile -> multi_node; no GPU -> cpu; 1 GPU -> single_gpu; else single_node."""
    if requested:
        return requested
    if hostfile:
        return "multi_node"
    gpus = visible_gpus()
    return "cpu" if gpus == 0 else "single_gpu" if gpus == 1 else "single_node"


def visible_gpus() -> int:
    try:
        import torch
        return torch.cuda.device_count()
    except Exception:  # noqa: BLE001 - a broken CUDA install counts as no GPU
        return 0


def launcher_argv(args, deployment: str, num_gpus: int) -> list[str]:
    """`deepspeed --num_gpus N --master_port P` (or --hostfile H), as scripts/common.sh launches."""
    exe = shutil.which("deepspeed")
    argv = [exe] if exe else [sys.executable, "-m", "deepspeed.launcher.runner"]
    if args.hostfile:
        argv += ["--hostfile", args.hostfile]
        if args.num_gpus:
            argv += ["--num_gpus", str(args.num_gpus)]
        if args.num_nodes:
            argv += ["--num_nodes", str(args.num_nodes)]
    else:
        argv += ["--num_gpus", str(num_gpus)]
    argv += ["--master_port", str(args.master_port or free_port())]
    return argv + shlex.split(args.launcher_args or "")


def hostfile_slots(path: str, num_nodes: int | None = None, per_node: int | None = None) -> int:
    """Processes a DeepSpeed hostfile gives ('host slots=N' lines, '#' comments): the slots of
    its first `num_nodes` hosts, each capped at `per_node` (the launcher's --num_gpus)."""
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as e:
        raise UserInputError(f"--hostfile {path}: {e.strerror}") from None
    slots = []
    for line in lines:
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        parts = line.split()
        if len(parts) < 2 or not parts[1].startswith("slots=") or not parts[1][6:].isdigit():
            raise UserInputError(f"--hostfile {path}: bad line {line!r} (expected 'hostname slots=N')")
        slots.append(int(parts[1][6:]))
    if not slots:
        raise UserInputError(f"--hostfile {path}: no hosts in it")
    slots = slots[:num_nodes] if num_nodes else slots
    return sum(min(n, per_node) if per_node else n for n in slots)


def previous_timings(out: Path) -> dict:
    """Step wall times of an earlier report in `out`, kept for the steps this run skips."""
    try:
        seconds = json.loads((out / "report.json").read_text()).get("seconds", {})
    except (OSError, json.JSONDecodeError):
        return {}
    return {k: v for k, v in seconds.items() if k.startswith("step")}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_env(deployment: str) -> dict:
    """Offline by default (as scripts/common.sh); one thread per rank on CPU."""
    env = dict(os.environ)
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("HF_DATASETS_OFFLINE", "1")
    env.setdefault("WANDB_MODE", "offline")
    env["TOKENIZERS_PARALLELISM"] = "false"
    env["PYTHONUNBUFFERED"] = "1"
    if deployment == "cpu":
        env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def run_logged(cmd: list[str], log_path: Path, env: dict) -> int:
    """Run `cmd` in the repository root, streaming its output to the terminal and to a log."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        log.write(f"\n$ {shlex.join(cmd)}\n".encode())
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        while True:
            chunk = proc.stdout.read1(65536) if hasattr(proc.stdout, "read1") else proc.stdout.read(4096)
            if not chunk:
                break
            sys.stdout.buffer.write(chunk)
            sys.stdout.flush()
            log.write(chunk)
        return proc.wait()


def wait_complete(step: Step, seconds: int) -> bool:
    """Whether the step's files appear within `seconds` (rank 0 of another node may still be writing)."""
    deadline = time.time() + seconds
    while not step.complete():
        if time.time() >= deadline:
            return False
        time.sleep(2)
    return True


def latest_checkpoint(step_dir: Path):
    """The newest complete resumable checkpoint a crashed run left in `step_dir`, if any."""
    from dschat.utils.checkpoint import latest_checkpoint as latest
    return latest(step_dir) if (step_dir / "checkpoints").is_dir() else None


def differing_flags(step: Step) -> list[str]:
    """Flags of the finished run (its training_config.json) that differ from this plan."""
    cfg = step.out / "training_config.json"
    if not cfg.exists():
        return []
    try:
        done = json.loads(cfg.read_text()).get("args", {})
    except (OSError, json.JSONDecodeError):
        return []
    diffs = []
    for key, value in step.flags.items():
        if key in done and value is not None and not isinstance(value, bool) and key != "data_output_path":
            if str(done[key]) != str(value) and not (isinstance(value, list) and done[key] == value):
                diffs.append(f"--{key} {done[key]} (now {value})")
    return diffs


def gpu_count(args, row: dict, deployment: str) -> int:
    """Processes per node: --num-gpus, else the row's count (capped to the visible GPUs)."""
    if args.num_gpus:
        return args.num_gpus
    if deployment == "cpu":
        return row["num_gpus"]
    if deployment == "multi_node":
        return 0  # the hostfile decides
    visible = visible_gpus()
    if deployment == "single_node" and visible and visible < row["num_gpus"]:
        print(f"note: the preset row is sized for {row['num_gpus']} GPUs; this node has {visible}: using "
              f"{visible} (more memory per GPU: check the estimate, or pass --low-memory)", flush=True)
        return visible
    return row["num_gpus"]

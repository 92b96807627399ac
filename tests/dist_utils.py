"""Launch real multi-process DeepSpeed runs on CPU (gloo/shm) from tests."""
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_env() -> dict:
    env = dict(os.environ)
    env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               OMP_NUM_THREADS="1", WANDB_MODE="offline", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def run_deepspeed(script, args=(), num_gpus: int = 2, timeout: int = 600, check: bool = True):
    """`deepspeed --num_gpus N script args` on CPU; raises with the output on failure."""
    launcher = shutil.which("deepspeed")
    port = free_port()
    cmd = ([launcher] if launcher else [sys.executable, "-m", "deepspeed.launcher.runner"])
    cmd += ["--num_gpus", str(num_gpus), "--master_port", str(port), str(script)]
    cmd += [str(a) for a in args]
    try:
        proc = subprocess.run(cmd, cwd=REPO, env=test_env(), capture_output=True, text=True,
                              timeout=timeout)
    finally:
        remove_shm_buffers(port)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({proc.returncode}):\n"
                             f"{proc.stdout[-6000:]}\n{proc.stderr[-6000:]}")
    return proc


def remove_shm_buffers(port: int) -> None:
    """DeepSpeed's CPU comm op leaves ~64 MiB per rank in /dev/shm; a killed rank cannot
    unlink its own at exit (dschat.utils.dist does it for clean exits)."""
    shm = Path("/dev/shm")
    if shm.is_dir():
        for f in shm.glob(f"deepspeed_allreduce_buffer_*_{port}_*"):
            f.unlink(missing_ok=True)


def run_python(script, args=(), timeout: int = 600, check: bool = True):
    cmd = [sys.executable, str(script)] + [str(a) for a in args]
    proc = subprocess.run(cmd, cwd=REPO, env=test_env(), capture_output=True, text=True,
                          timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({proc.returncode}):\n"
                             f"{proc.stdout[-6000:]}\n{proc.stderr[-6000:]}")
    return proc

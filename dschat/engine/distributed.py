"""Process-group setup and the few collectives the entry points need."""
from __future__ import annotations

import atexit
import os

import torch


def init_distributed(local_rank: int = -1) -> torch.device:
    """Start (or join) the process group through DeepSpeed; return this rank's device.

    Works under the `deepspeed` launcher, `torchrun`, and as a single plain process
    (world size 1). On machines without GPUs DeepSpeed's CPU accelerator uses gloo.
    """
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    if local_rank < 0:
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    os.environ.setdefault("LOCAL_RANK", str(local_rank))
    if "RANK" not in os.environ:  # plain `python main.py`: a world of one
        os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=os.environ.get("MASTER_PORT", "29511"))
    accel = get_accelerator()
    if accel.device_name() == "cuda":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device(accel.device_name())
    deepspeed.init_distributed(dist_backend=None if accel.device_name() == "cuda" else "gloo")
    atexit.register(shutdown_distributed)
    return device


def shutdown_distributed() -> None:
    """Tear the process group down before the interpreter does (registered at exit).

    Left to interpreter teardown, gloo's worker threads are sometimes destroyed while
    still joinable and the rank dies with "terminate called without an active exception"
    (SIGABRT) after its work is done; seen on 2 loaded CPU cores with torch 2.13.
    """
    port, this_rank = os.environ.get("MASTER_PORT", ""), os.environ.get("RANK", "")
    try:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    except Exception:  # noqa: BLE001 - best effort at exit; the work is already done
        pass
    _unlink_cpu_shm_buffers(port, this_rank)


SHM_DIR = "/dev/shm"


def _unlink_cpu_shm_buffers(port: str, this_rank: str) -> None:
    """Remove this rank's shared-memory all-reduce buffer of DeepSpeed's CPU comm op.

    DeepSpeed (0.19.8) leaves one ~64 MiB `deepspeed_allreduce_buffer_*_<addr>_<port>_<rank>`
    file in /dev/shm per rank and launch and never unlinks it, so repeated CPU runs fill
    /dev/shm until processes are killed. Unlinking at exit frees it (the mapping itself
    goes away with the process).
    """
    try:
        for name in os.listdir(SHM_DIR):
            if name.startswith("deepspeed_allreduce_buffer_") and name.endswith(f"_{port}_{this_rank}"):
                os.unlink(os.path.join(SHM_DIR, name))
    except OSError:
        pass


def world_size() -> int:
    return torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1


def rank() -> int:
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


def barrier() -> None:
    if torch.distributed.is_initialized():
        torch.distributed.barrier()


def _reduce_device(value: torch.Tensor) -> torch.device:
    """Where `value` can be reduced: NCCL takes CUDA tensors only, so a CPU value (a count
    made on the host) goes through this rank's GPU and comes back."""
    if value.device.type == "cpu" and torch.distributed.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return value.device


def all_reduce_mean(value: torch.Tensor) -> torch.Tensor:
    """Mean over ranks (a new tensor on the input's device; the input is left unchanged)."""
    out = value.detach().clone().float()
    if torch.distributed.is_initialized():
        out = out.to(_reduce_device(out))
        torch.distributed.all_reduce(out)
        out = (out / torch.distributed.get_world_size()).to(value.device)
    return out


def all_reduce_sum(value: torch.Tensor) -> torch.Tensor:
    """Sum over ranks (a new tensor on the input's device; the input is left unchanged)."""
    out = value.detach().clone()
    if torch.distributed.is_initialized():
        out = out.to(_reduce_device(out))
        torch.distributed.all_reduce(out)
        out = out.to(value.device)
    return out


def peak_memory_gib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2 ** 30
    try:
        import resource
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20  # KiB -> GiB
    except ImportError:
        return float("nan")

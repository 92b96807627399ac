"""torch.distributed in one place: process-group setup and teardown, rank / world size,
barrier, object and tensor collectives. Every helper is a no-op (or the identity) in a
single process without a process group, so data code and tests run without one.

The ground floor of dschat's layers (docs/ARCHITECTURE.md): the one module outside
`dschat/engine/` allowed to touch `torch.distributed` (docs/CONVENTIONS.md).
"""
from __future__ import annotations

import atexit
import os

import torch


def _dist():
    import torch.distributed as dist
    return dist


def is_initialized() -> bool:
    """Whether a default process group exists."""
    dist = _dist()
    return dist.is_available() and dist.is_initialized()


def active():
    """`torch.distributed` when a default process group exists, else None."""
    return _dist() if is_initialized() else None


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


# ------------------------------------------------------------ setup and teardown

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
        if is_initialized():
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


# ------------------------------------------------------------ tensor collectives

def _reduce_device(value: torch.Tensor) -> torch.device:
    """Where `value` can be reduced: NCCL takes CUDA tensors only, so a CPU value (a count
    made on the host) goes through this rank's GPU and comes back."""
    if value.device.type == "cpu" and torch.distributed.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return value.device


def all_reduce_mean(value: torch.Tensor) -> torch.Tensor:
    """Mean over ranks (a new tensor on the input's device; the input is left unchanged)."""
    out = value.detach().clone().float()
    if is_initialized():
        out = out.to(_reduce_device(out))
        torch.distributed.all_reduce(out)
        out = (out / torch.distributed.get_world_size()).to(value.device)
    return out


def all_reduce_sum(value: torch.Tensor) -> torch.Tensor:
    """Sum over ranks (a new tensor on the input's device; the input is left unchanged)."""
    out = value.detach().clone()
    if is_initialized():
        out = out.to(_reduce_device(out))
        torch.distributed.all_reduce(out)
        out = out.to(value.device)
    return out


def all_reduce_max(value: torch.Tensor) -> torch.Tensor:
    """Max over ranks, in fp32 (a new tensor on the input's device; the input is left unchanged)."""
    out = value.detach().clone().float()
    if is_initialized():
        out = out.to(_reduce_device(out))
        torch.distributed.all_reduce(out, op=torch.distributed.ReduceOp.MAX)
        out = out.to(value.device)
    return out


_PEAK_BEFORE_RESET: dict = {}   # CUDA device index -> the most bytes allocated before the last reset_peak_memory
_RESERVED_BEFORE_RESET: dict = {}   # ... and the most bytes the caching allocator held from the driver
_FLUSHES_SEEN: dict = {}        # CUDA device index -> the allocator's cache flushes already reported


def _cuda_index(device) -> int:
    device = torch.device(device)
    return device.index if device.index is not None else torch.cuda.current_device()


def reset_peak_memory(device: torch.device) -> None:
    """Restart CUDA's peak-allocated counter (the peak of one phase, dschat/utils/phases.py)
    while `peak_memory_gib` still reports the run's peak."""
    index = _cuda_index(device)
    _PEAK_BEFORE_RESET[index] = max(_PEAK_BEFORE_RESET.get(index, 0), torch.cuda.max_memory_allocated(device))
    _RESERVED_BEFORE_RESET[index] = max(_RESERVED_BEFORE_RESET.get(index, 0), torch.cuda.max_memory_reserved(device))
    torch.cuda.reset_peak_memory_stats(device)


def peak_memory_gib(device: torch.device) -> float:
    """The most memory allocated so far in the run: CUDA's allocator on GPU (across
    `reset_peak_memory` calls), the process's peak resident set on CPU."""
    if device.type == "cuda":
        return max(_PEAK_BEFORE_RESET.get(_cuda_index(device), 0), torch.cuda.max_memory_allocated(device)) / 2 ** 30
    return host_peak_gib()


def allocator_metrics(device: torch.device) -> dict:
    """CUDA's caching allocator (nothing on CPU): `memory/reserved_peak_gib`, the most memory
    it held from the driver so far in the run (what the GPU must have; at least the allocated
    peak), and `memory/allocator_flushes`, how often since the last call an allocation found
    no free cached block, returned every cached block to the driver and retried. Each flush
    synchronizes the device and costs milliseconds; DeepSpeed's ZeRO-3 warns of them too."""
    if device.type != "cuda":
        return {}
    index = _cuda_index(device)
    flushes = torch.cuda.memory_stats(device).get("num_alloc_retries", 0)
    new, _FLUSHES_SEEN[index] = flushes - _FLUSHES_SEEN.get(index, 0), flushes
    reserved = max(_RESERVED_BEFORE_RESET.get(index, 0), torch.cuda.max_memory_reserved(device))
    return {"memory/reserved_peak_gib": reserved / 2 ** 30, "memory/allocator_flushes": new}


def host_available_bytes() -> int | None:
    """Host memory the kernel can still give this node's processes (MemAvailable), None where
    unknown. DSCHAT_TEST_HOST_AVAILABLE_GIB stands in for it (tests only)."""
    forced = os.environ.get("DSCHAT_TEST_HOST_AVAILABLE_GIB")
    if forced:
        return int(float(forced) * 2 ** 30)
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def host_peak_gib() -> float:
    """This process's peak resident set in host memory (what offloaded optimizer states cost)."""
    try:
        import resource
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20  # KiB -> GiB
    except ImportError:
        return float("nan")

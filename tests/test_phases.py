"""dschat/utils/phases.py: per-phase seconds (summed over repeats) and, on CUDA, peak memory
(the largest over repeats; an outer phase's peak includes its inner ones'), while
`dist.peak_memory_gib` keeps the run's peak across the phases' counter restarts."""
import os
import time

import pytest
import torch

from dschat.utils import dist
from dschat.utils.phases import PhaseTimer


def test_phases_sum_their_seconds_and_record_no_memory_on_cpu():
    timer = PhaseTimer(torch.device("cpu"))
    for _ in range(2):
        with timer.phase("a"):
            time.sleep(0.02)
    with timer.phase("b"):
        with timer.phase("c"):       # nested: both count it
            time.sleep(0.01)
    with pytest.raises(RuntimeError):
        with timer.phase("d"):       # a phase that raises is still recorded, and the error goes on
            raise RuntimeError("boom")
    m = timer.metrics()
    assert set(m) == {"time/a_s", "time/b_s", "time/c_s", "time/d_s"}      # seconds only on CPU
    assert 0.04 <= m["time/a_s"] < 1.0
    assert m["time/b_s"] >= m["time/c_s"] >= 0.01 and m["time/d_s"] >= 0
    timer.reset()
    assert timer.metrics() == {}
    with timer.phase("a"):
        pass
    assert list(timer.metrics()) == ["time/a_s"] and timer.metrics()["time/a_s"] < 0.02


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_phase_peaks_on_cuda():
    device = torch.device("cuda", torch.cuda.current_device())
    mib = 2 ** 20
    big = torch.empty(512 * mib, dtype=torch.uint8, device=device)      # the run's peak so far
    del big
    timer = PhaseTimer(device)
    base = torch.cuda.memory_allocated(device)
    for size in (64, 128):                                                  # the larger repeat counts
        with timer.phase("alloc"):
            x = torch.empty(size * mib, dtype=torch.uint8, device=device)
            del x
    with timer.phase("outer"):
        with timer.phase("inner"):
            y = torch.empty(32 * mib, dtype=torch.uint8, device=device)
            del y
        with timer.phase("small"):
            pass
    m = timer.metrics()
    gib = lambda key: m[key] * 2 ** 30  # noqa: E731
    assert base + 128 * mib <= gib("memory/alloc_peak_gib") < base + 129 * mib
    assert base + 32 * mib <= gib("memory/inner_peak_gib") < base + 33 * mib
    assert gib("memory/outer_peak_gib") >= gib("memory/inner_peak_gib")        # the inner phase is in the outer
    assert gib("memory/small_peak_gib") < base + mib
    assert all(m[f"time/{p}_s"] >= 0 for p in ("alloc", "outer", "inner", "small"))
    # the phases restarted CUDA's peak counter; the run's peak (the 512 MiB) is kept
    assert dist.peak_memory_gib(device) * 2 ** 30 >= 512 * mib


def test_profiled_step_on_cpu_says_memory_snapshots_need_cuda(tmp_path, capsys):
    from dschat.utils.profiling import StepProfiler
    prof = StepProfiler(2, str(tmp_path), 0, torch.device("cpu"))
    for step in (1, 2, 3):
        prof.begin(step)
        torch.ones(8, 8) @ torch.ones(8, 8)
        assert (prof.end(step) is not None) == (step == 2)
    out = capsys.readouterr().out
    assert out.count("memory snapshots need CUDA") == 1, out
    assert prof.snapshot is None and (tmp_path / "step_2.txt").exists()
    assert not list(tmp_path.glob("*.pickle"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_profiled_step_writes_a_memory_snapshot_on_cuda(tmp_path):
    import pickle

    from dschat.utils.profiling import StepProfiler
    device = torch.device("cuda", torch.cuda.current_device())
    prof = StepProfiler(2, str(tmp_path), 0, device)
    for step in (1, 2, 3):
        prof.begin(step)
        x = torch.randn(1000, 1000, device=device)
        (x @ x).sum().item()
        prof.end(step)
    assert prof.snapshot == str(tmp_path / "memory_snapshot_step2.pickle")
    assert [p.name for p in tmp_path.glob("*.pickle")] == ["memory_snapshot_step2.pickle"]
    with open(prof.snapshot, "rb") as f:
        snapshot = pickle.load(f)
    # the step's allocations are in the trace (a 1000 x 1000 fp32 tensor: 4,000,000 bytes)
    events = [e for trace in snapshot["device_traces"] for e in trace]
    assert any(e["action"] == "alloc" and e["size"] >= 4_000_000 for e in events), len(events)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_phases_take_the_gpu_time_of_their_work_without_synchronizing():
    """A phase's seconds are the GPU time of what was queued in it (CUDA events), read at
    `metrics()`: the host leaves the phase before the GPU is done with it."""
    device = torch.device("cuda", torch.cuda.current_device())
    timer = PhaseTimer(device)
    with PhaseTimer(device).phase("warm-up"):  # the first launch and event of a process load
        torch.cuda._sleep(1)                  # their modules: host time that is not the phase's
    torch.cuda.synchronize(device)
    host = time.perf_counter()
    with timer.phase("spin"):
        torch.cuda._sleep(200_000_000)       # ~0.1 s of GPU cycles, queued at once
    with timer.phase("nothing"):
        pass
    host = time.perf_counter() - host
    m = timer.metrics()                      # waits for the events
    assert m["time/spin_s"] > 5 * host, (m, host)   # GPU time, not the host's queueing time
    assert m["time/nothing_s"] < m["time/spin_s"] / 10
    synced = PhaseTimer(device, sync=True)
    with synced.phase("spin"):
        torch.cuda._sleep(200_000_000)
    assert synced.metrics()["time/spin_s"] == pytest.approx(m["time/spin_s"], rel=0.5)


def test_allocator_metrics_are_cuda_only():
    assert dist.allocator_metrics(torch.device("cpu")) == {}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_allocator_metrics_count_flushes_per_call_and_keep_the_reserved_peak():
    """A request that finds no cached block and no driver memory returns every cached block
    to the driver and is retried: one flush; the next call reports only flushes after it.
    The reserved peak outlives the phases' counter restarts, like the allocated one."""
    device = torch.device("cuda", torch.cuda.current_device())
    mib = 2 ** 20
    dist.allocator_metrics(device)                   # flushes before this test are not its own
    # cached blocks to flush: 64 MiB in the large pool and 16 MiB in the small one, freed
    kept = [torch.empty(64 * mib, dtype=torch.uint8, device=device),
            *[torch.empty(512 * 1024, dtype=torch.uint8, device=device) for _ in range(32)]]
    del kept
    cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    assert cached >= 80 * mib
    # more than the device has: cudaMalloc fails, no cached block is large enough, so the
    # allocator frees its whole cache and retries before it raises (a deterministic flush;
    # a request sized to just fit depends on what the driver and other tests left free)
    _, total = torch.cuda.mem_get_info(device)
    with pytest.raises(torch.OutOfMemoryError):
        torch.empty(total + 1024 * mib, dtype=torch.uint8, device=device)
    m = dist.allocator_metrics(device)
    stats = torch.cuda.memory_stats(device)
    assert m["memory/allocator_flushes"] >= 1, (   # what the allocator did instead
        torch.cuda.get_allocator_backend(), os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
        {k: v for k, v in stats.items() if k.startswith(("num_", "segment.all", "reserved_bytes.all"))})
    assert torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device) < cached  # flushed
    big = torch.empty(256 * mib, dtype=torch.uint8, device=device)
    m = dist.allocator_metrics(device)
    assert m["memory/allocator_flushes"] == 0       # only the flushes since the last call
    assert m["memory/reserved_peak_gib"] * 2 ** 30 >= torch.cuda.memory_allocated(device)
    dist.reset_peak_memory(device)
    del big
    torch.cuda.empty_cache()
    after = dist.allocator_metrics(device)
    assert after["memory/allocator_flushes"] == 0
    assert after["memory/reserved_peak_gib"] >= m["memory/reserved_peak_gib"]

"""Seconds and peak memory of each phase of a step (step 3's `time/<phase>_s` and
`memory/<phase>_peak_gib`).

    timer = PhaseTimer(device)
    timer.reset()                      # at the step's start
    with timer.phase("actor_fwd"):
        ...
    record.update(timer.metrics())     # {"time/actor_fwd_s": ..., "memory/actor_fwd_peak_gib": ...}

A phase entered several times in one step (PPO micro-batches and epochs, --filter_groups'
extra rollouts) sums its seconds and keeps the largest of its peaks.

On CUDA a phase's seconds are GPU time: CUDA events recorded on the current stream at its
entry and exit, read when `metrics()` is called (one wait for the step's last event). A
phase therefore takes the GPU work queued inside it, and the host never waits at a phase
boundary: synchronizing there (`sync=True`, the timer's earlier behaviour) left the GPU
idle while the host queued the next phase's first kernels, a dozen times a step. Its peak
is the most memory allocated at any moment inside it (CUDA's peak counter restarted at
entry, read at exit; the caching allocator counts at the host's call, so no
synchronization is needed; `dist.reset_peak_memory` keeps the run's peak for
`memory/peak_gib`). A phase nested in another counts towards the outer one's peak too.

On CPU a phase records seconds only: no memory key at all (a process's peak resident
memory cannot be restarted per phase, so no number for a phase would be the phase's).
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Iterator, Optional

import torch

from dschat.utils import dist


class PhaseTimer:
    """Accumulates the phases of one step; `metrics()` reads them, `reset()` starts a step."""

    def __init__(self, device: Optional[torch.device] = None, sync: bool = False):
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.cuda = self.device.type == "cuda"
        self.sync = sync
        self.seconds: dict[str, float] = {}
        self.peak_bytes: dict[str, int] = {}
        self._open: list[list] = []        # [name, the most bytes seen so far] of each open phase, outermost first
        self._events: list[tuple] = []     # CUDA: (name, start event, end event) not yet read

    def reset(self) -> None:
        """Forget every phase recorded so far (a new step)."""
        self.seconds, self.peak_bytes, self._events = {}, {}, []

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time (and on CUDA, measure the peak memory of) the block as phase `name`."""
        if self.cuda:
            if self.sync:
                torch.cuda.synchronize(self.device)
            self._fold_peak()       # what the open phases reached so far, before the counter restarts
            dist.reset_peak_memory(self.device)
        self._open.append([name, 0])
        timed_by_events = self.cuda and not self.sync
        if timed_by_events:
            begin = torch.cuda.Event(enable_timing=True)
            begin.record(torch.cuda.current_stream(self.device))
        start = time.perf_counter()
        try:
            yield
        finally:
            if self.cuda and self.sync:
                torch.cuda.synchronize(self.device)
            if self.cuda:
                self._fold_peak()
            _, peak = self._open.pop()
            if timed_by_events:
                end = torch.cuda.Event(enable_timing=True)
                end.record(torch.cuda.current_stream(self.device))
                self._events.append((name, begin, end))
                self.seconds.setdefault(name, 0.0)
            else:   # host time (after the synchronization, on CUDA)
                self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start
            if self.cuda:
                self.peak_bytes[name] = max(self.peak_bytes.get(name, 0), peak)

    def _fold_peak(self) -> None:
        """Every open phase has seen at least the allocator's peak since its last restart."""
        now = torch.cuda.max_memory_allocated(self.device)
        for entry in self._open:
            entry[1] = max(entry[1], now)

    def _read_events(self) -> None:
        """Add the GPU time of the phases timed by events (waits for the last one to complete)."""
        if not self._events:
            return
        self._events[-1][2].synchronize()
        for name, begin, end in self._events:
            self.seconds[name] += begin.elapsed_time(end) / 1e3
        self._events = []

    def metrics(self) -> dict:
        """`time/<phase>_s` of every phase recorded since `reset`, and on CUDA `memory/<phase>_peak_gib`."""
        self._read_events()
        out = {f"time/{name}_s": s for name, s in self.seconds.items()}
        out.update({f"memory/{name}_peak_gib": b / 2 ** 30 for name, b in self.peak_bytes.items()})
        return out

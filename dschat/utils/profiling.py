"""`--profile_step N`: torch.profiler around one chosen step, written by rank 0.

The step's wall time is split by `record_function` ranges the trainer opens
("dschat/generate", "dschat/score", "dschat/train", ...); the profile answers where the
rest of a step goes (kernels, ZeRO-3 fetches, the optimizer) without a second tool.
Output in --profile_dir (default: <output_dir>/profile): `step_<N>.txt`, the ops and
kernels by total device time (CPU time on CPU-only runs), and `step_<N>.trace.json` for
chrome://tracing or Perfetto. On CUDA also `memory_snapshot_step<N>.pickle`: the CUDA
caching allocator's memory history over the step (torch.cuda.memory._record_memory_history
from the step's start, the last SNAPSHOT_ENTRIES allocator events kept, dumped at its end),
for https://pytorch.org/memory_viz; a CPU run says once that snapshots need CUDA.
"""
from __future__ import annotations

import os
from typing import Optional

import torch

from dschat.utils.logging import print_rank_0

SNAPSHOT_ENTRIES = 100_000     # allocator events a memory snapshot keeps (the newest)


def add_profile_args(parser) -> None:
    g = parser.add_argument_group("profiling")
    g.add_argument("--profile_step", type=int, default=0,
                   help="Profile this step (1-based) with torch.profiler on rank 0 (0: off); on CUDA also "
                        "record a torch memory snapshot of the step (memory_snapshot_step<N>.pickle, for "
                        "https://pytorch.org/memory_viz; CPU runs write none); see --profile_dir.")
    g.add_argument("--profile_dir", type=str, default=None,
                   help="Where --profile_step writes step_<N>.txt (top ops and kernels), "
                        "step_<N>.trace.json and on CUDA memory_snapshot_step<N>.pickle "
                        "(default: <output_dir>/profile).")


class StepProfiler:
    """`begin(step)` / `end(step)` around each step; profiles only `step == target` on rank 0."""

    def __init__(self, target: int, out_dir: str, rank: int, device: torch.device, rows: int = 40):
        self.target = int(target)
        self.out_dir = out_dir
        self.active = self.target > 0 and rank == 0
        self.device = device
        self.rows = rows
        self._prof: Optional[torch.profiler.profile] = None
        self._recording = False
        self.snapshot: Optional[str] = None    # the memory snapshot's path once written

    def begin(self, step: int) -> None:
        if not self.active or step != self.target:
            return
        from torch.profiler import ProfilerActivity, profile
        activities = [ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(ProfilerActivity.CUDA)
            torch.cuda.synchronize(self.device)
            torch.cuda.memory._record_memory_history(max_entries=SNAPSHOT_ENTRIES, device=self.device)
            self._recording = True
        else:
            print_rank_0(f"--profile_step {step}: torch memory snapshots need CUDA; none is written on "
                         f"{self.device.type}")
        self._prof = profile(activities=activities)
        self._prof.__enter__()

    def end(self, step: int) -> Optional[str]:
        """Stop and write the files if `step` was profiled; returns the table's path (the
        memory snapshot's, on CUDA, is `self.snapshot`)."""
        if self._prof is None or step != self.target:
            return None
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        os.makedirs(self.out_dir, exist_ok=True)
        if self._recording:  # the step's allocator history, then recording stops
            self.snapshot = os.path.join(self.out_dir, f"memory_snapshot_step{step}.pickle")
            torch.cuda.memory._dump_snapshot(self.snapshot)
            torch.cuda.memory._record_memory_history(enabled=None, device=self.device)
            self._recording = False
        prof, self._prof = self._prof, None
        prof.__exit__(None, None, None)
        sort = "device_time_total" if self.device.type == "cuda" else "cpu_time_total"
        table = prof.key_averages().table(sort_by=sort, row_limit=self.rows)
        path = os.path.join(self.out_dir, f"step_{step}.txt")
        with open(path, "w") as f:
            f.write(f"step {step}, sorted by {sort}\n{table}\n")
        prof.export_chrome_trace(os.path.join(self.out_dir, f"step_{step}.trace.json"))
        return path

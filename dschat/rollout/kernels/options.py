"""The decode kernels' launch choices: one frozen KernelOptions, the ones in force read with
`options()` and set for a block with `use_options` (FastGenerator(kernel_options=...) keeps
the ones in force when it is built and puts them in force for its calls). The measurements
behind each default are in docs/DECODE.md."""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Optional, Union


@dataclass(frozen=True)
class KernelOptions:
    """Every launch choice of the kernels here, in one frozen object (defaults: what the
    fast path runs). `FastGenerator(kernel_options=...)` activates one for its calls
    (`use_options`); benchmarks and tests build one instead of editing this module. The
    measurements behind each default are in docs/DECODE.md.

    Launch overlap (Hopper and later, Triton's launch_pdl): each decode kernel may be
    launched while the previous one finishes and waits (griddepcontrol.wait) before it
    touches anything another kernel of the step touches. Kernels launched without it
    (cuBLAS, PyTorch's) order as usual.
    """
    # PDL mode. 0: off; 1: wait first thing; 2: as 1, but the linears read their first
    # weight tile before waiting (weights are never written inside a decode step); 3: as 1,
    # but the linears and the attention first ask L2 for the first `pdl_prefetch(_attn)`
    # bytes they will stream (PTX prefetch.global.L2). None: 3 on compute capability 9+
    # with CUDA 12.3+, else 0.
    pdl: Optional[int] = None
    pdl_prefetch: int = 8192             # mode 3: bytes per linear program (0: none)
    pdl_prefetch_attn: int = 8192        # mode 3: bytes per attention program (0: none)

    # Attention launch knobs; None: the per-shape rule (benchmarks/attn_bench.py's sweep).
    attn_splits: Optional[int] = None    # programs the keys of one (row, head) are split over
    attn_block_n: Optional[int] = None   # keys per inner step: 128 for head_dim <= 64, else 64
    attn_warps: Optional[int] = None     # 2 warps where one query head reads each K/V head
    attn_stages: Optional[int] = None    # software-pipelining stages of the key loop; None: Triton's
    # Scores and the value sum as tensor-core dots (bf16/fp16 caches). None: on for
    # head_dim >= 128 (faster there, slower at 64).
    attn_dot: Optional[bool] = None
    # With the dots: p rounded to the cache dtype before p.V (as HF's eager attention);
    # False: p.V in TF32. Off: slower at bloom-7b1.
    attn_pv_low: bool = False
    # The attention kernel writes the step's K/V into the cache itself (Bloom, OPT blocks).
    fuse_kv_write: bool = True
    # head_dim not a power of two (80, 96): one block of the next power of two, extra lanes
    # masked; False: such models decode with baddbmm (slower).
    attn_pad_head_dim: bool = True
    # Left padding: each row's key loop starts at the block of its first visible slot
    # (same result bit for bit; reads less cache for short prompts).
    attn_skip_pad: bool = True

    # Decode linears. False: cuBLAS everywhere; True: `_linear_kernel` with the fixed rule
    # below; "auto": per shape the fastest of cuBLAS and a few Triton configurations, timed
    # once per process on first use (within 3% cuBLAS is kept). Choices can differ between
    # processes (like cudnn.benchmark); False gives cuBLAS's determinism.
    decode_linear: Union[bool, str] = "auto"
    linear_block_n: Optional[int] = None # True's rule; None: the widest of 64/32/16 giving 2 programs per SM
    linear_block_k: int = 128
    linear_warps: int = 4
    linear_stages: Optional[int] = None
    linear_tma: bool = True              # TMA candidates (Hopper, 16-bit weights) in "auto"'s race
    linear_tune_margin: float = 0.97     # "auto" takes a Triton candidate under this share of cuBLAS's time
    # Tests: ((op, config), ...) used by "auto" instead of timing, op "linear" -> (BLOCK_N,
    # BLOCK_K), "linear+norm" -> (splits, BLOCK_N, BLOCK_K); an op left out: cuBLAS.
    linear_force: Optional[tuple] = None
    fuse_gated: bool = True              # LLaMA's SiLU(gate) * up as one kernel (False: two linears + PyTorch)
    triton_argmax: bool = True           # False: torch's argmax in the decode step

    def __post_init__(self):
        if self.pdl not in (None, 0, 1, 2, 3):
            raise ValueError(f"KernelOptions.pdl must be None or 0-3, got {self.pdl!r}")
        if self.decode_linear not in (True, False, "auto"):
            raise ValueError(f"KernelOptions.decode_linear must be True, False or 'auto', got {self.decode_linear!r}")
        if isinstance(self.linear_force, dict):       # accept a dict, store it hashable
            object.__setattr__(self, "linear_force", tuple(sorted(self.linear_force.items())))


_ACTIVE = KernelOptions()


def options() -> KernelOptions:
    """The kernel options in force (KernelOptions() unless inside `use_options`)."""
    return _ACTIVE


@contextlib.contextmanager
def use_options(opts: Optional[KernelOptions]):
    """Run the block with `opts` in force (None: leave the current ones); restored after."""
    global _ACTIVE
    if opts is None:
        yield _ACTIVE
        return
    if not isinstance(opts, KernelOptions):
        raise TypeError(f"use_options takes a KernelOptions, got {type(opts).__name__}")
    saved, _ACTIVE = _ACTIVE, opts
    try:
        yield opts
    finally:
        _ACTIVE = saved

"""What every decode kernel shares: Triton's import (absent on machines without it: callers
use the PyTorch references), programmatic dependent launch (PDL: on Hopper each kernel may
launch while the previous one ends and waits before touching anything it wrote), the L2
prefetch of mode 3, and small launch-geometry helpers."""
from __future__ import annotations

import os

import torch

from dschat.rollout.kernels.options import options

try:                                   # pragma: no cover - exercised on GPU machines
    import triton
    import triton.language as tl
except Exception:                      # no Triton here: callers use the references
    triton = None
try:                                   # pragma: no cover - host-side TMA descriptors (Triton >= 3.4)
    from triton.tools.tensor_descriptor import TensorDescriptor
except Exception:
    TensorDescriptor = None
try:                                   # pragma: no cover - grid dependency control (Triton >= 3.3)
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
    _HAS_GDC = True
except Exception:
    _HAS_GDC = False


def available() -> bool:
    return triton is not None


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def _cuda_at_least(major: int, minor: int) -> bool:
    try:
        have = tuple(int(v) for v in (torch.version.cuda or "0.0").split(".")[:2])
    except ValueError:
        return False
    return have >= (major, minor)


def _pdl_mode(device) -> int:
    if not _HAS_GDC or device.type != "cuda" or _interpreting():
        return 0
    # programmatic edges inside captured CUDA graphs need CUDA 12.3+
    if torch.cuda.get_device_capability(device)[0] < 9 or not _cuda_at_least(12, 3):
        return 0
    pdl = options().pdl
    return 3 if pdl is None else int(pdl)


def _launch_key(device) -> tuple:
    """The launch settings a per-shape timing depends on."""
    mode = _pdl_mode(device)
    o = options()
    return mode, (o.pdl_prefetch, o.pdl_prefetch_attn) if mode == 3 else 0, o.linear_tma, o.linear_tune_margin


def _pdl_launch(mode: int) -> dict:
    return {"launch_pdl": True} if mode else {}


if triton is not None:

    if _HAS_GDC:
        @triton.jit
        def _pdl_enter(PDL: tl.constexpr):
            """Wait for the previous kernel (all of it, memory included), then let the next
            one launch."""
            if PDL:
                gdc_wait()
                gdc_launch_dependents()
    else:
        @triton.jit
        def _pdl_enter(PDL: tl.constexpr):
            pass

    @triton.jit
    def _l2_prefetch_rows(base, rows, stride, k0, k_end, PF_K: tl.constexpr, LINE: tl.constexpr):
        """Ask L2 for elements k0 .. k0+PF_K (clamped below k_end) of each of `rows` (valid row
        indices) of a row-major matrix: one prefetch per LINE elements (128 bytes)."""
        ks = tl.minimum(k0 + tl.arange(0, PF_K // LINE) * LINE, k_end - 1)
        ptrs = base + rows[:, None].to(tl.int64) * stride + ks[None, :]
        tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [ptrs],
                                  dtype=tl.int32, is_pure=False, pack=1)


def _prefetch_count(limit: int, floor: int) -> int:
    """PDL mode 3's prefetch length along a row: the largest power of two <= limit, at
    least `floor` (one 128-byte line)."""
    n = floor
    while n * 2 <= limit:
        n *= 2
    return n


def _even_chunks(n: int, parts: int, block: int) -> tuple[int, int]:
    """(chunk, count): n split into about `parts` chunks whole in `block`s; count may come
    out lower than parts (never an empty chunk)."""
    per_part = -(-n // parts)
    chunk = -(-per_part // block) * block
    return chunk, -(-n // chunk)

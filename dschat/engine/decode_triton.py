"""Optional Triton kernels for the fast decode step (dschat.engine.decode).

Only imported on CUDA when Triton is importable; every kernel here has a PyTorch
reference (`*_ref`) with the same rounding points, used on CPU and in tests. Kernels:

- `add_norm`: residual add fused with the next LayerNorm / RMSNorm, returning both the
  new residual stream and the normalised activations (one kernel instead of two or
  three per norm in the decode step, where each kernel is a few microseconds of launch
  latency and the tensors are tiny).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

try:                                   # pragma: no cover - exercised on GPU machines
    import triton
    import triton.language as tl
except Exception:                      # no Triton here: callers use the references
    triton = None


def available() -> bool:
    return triton is not None


def add_norm_ref(y, r, w, b, eps: float, rms: bool):
    """x = r + y (rounded to the input dtype); h = norm(x) like HF's LayerNorm / RMSNorm."""
    x = r + y
    if rms:
        return x, F.rms_norm(x, (x.shape[-1],), None, eps) * w
    return x, F.layer_norm(x, (x.shape[-1],), w, b, eps)


if triton is not None:

    @triton.jit
    def _add_norm_kernel(y_ptr, r_ptr, x_ptr, h_ptr, w_ptr, b_ptr, N, eps,
                         sy, sr, sx, sh,
                         BLOCK: tl.constexpr, RMS: tl.constexpr, HAS_B: tl.constexpr):
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        m = cols < N
        y = tl.load(y_ptr + row * sy + cols, mask=m, other=0.0).to(tl.float32)
        r = tl.load(r_ptr + row * sr + cols, mask=m, other=0.0).to(tl.float32)
        x = (y + r).to(x_ptr.dtype.element_ty)            # the residual stream, rounded as HF's add
        tl.store(x_ptr + row * sx + cols, x, mask=m)
        xf = x.to(tl.float32)
        w = tl.load(w_ptr + cols, mask=m, other=0.0).to(tl.float32)
        if RMS:
            var = tl.sum(xf * xf, axis=0) / N
            n = (xf * tl.rsqrt(var + eps)).to(x_ptr.dtype.element_ty).to(tl.float32)
            h = n * w                                     # HF: weight * normed.to(dtype)
        else:
            mean = tl.sum(xf, axis=0) / N
            d = tl.where(m, xf - mean, 0.0)
            var = tl.sum(d * d, axis=0) / N
            h = d * tl.rsqrt(var + eps) * w
            if HAS_B:
                h = h + tl.load(b_ptr + cols, mask=m, other=0.0).to(tl.float32)
        tl.store(h_ptr + row * sh + cols, h.to(h_ptr.dtype.element_ty), mask=m)


def add_norm(y, r, w, b, eps: float, rms: bool):
    """Fused `add_norm_ref` for 2-D [rows, N] tensors on CUDA (else the reference)."""
    if (triton is None or y.dim() != 2 or w is None
            or (y.device.type != "cuda" and not _interpreting())):
        return add_norm_ref(y, r, w, b, eps, rms)
    rows, N = y.shape
    x = torch.empty_like(y)
    h = torch.empty_like(y)
    block = triton.next_power_of_2(N)
    _add_norm_kernel[(rows,)](y, r, x, h, w, b if b is not None else w, N, float(eps),
                              y.stride(0), r.stride(0), x.stride(0), h.stride(0),
                              BLOCK=block, RMS=bool(rms), HAS_B=b is not None,
                              num_warps=4 if block <= 2048 else 8)
    return x, h


def _interpreting() -> bool:
    import os
    return os.environ.get("TRITON_INTERPRET") == "1"

"""Residual add fused with the next LayerNorm / RMSNorm (`add_norm`): the new residual stream
and the normalised activations in one kernel (GPT-NeoX: two norms of one sum), which also
sums the split-K partials of the linear before it (`linears.linear_add_norm`)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from dschat.rollout.kernels.launch import _interpreting, _pdl_launch, _pdl_mode, triton

if triton is not None:                 # pragma: no cover - exercised on GPU machines
    import triton.language as tl

    from dschat.rollout.kernels.launch import _pdl_enter


def add_norm_ref(y, r, w, b, eps: float, rms: bool, y2=None, second=None):
    """x = r + y (rounded to the input dtype); h = norm(x) like HF's LayerNorm / RMSNorm.
    y2: a second summand, x = r + (y + y2) (GPT-NeoX's parallel residual, mlp + attn + x);
    second = (w2, b2, eps2): a second LayerNorm of x, returned as a third output."""
    if y2 is not None:
        y = y + y2
    x = r + y
    if rms:
        return x, F.rms_norm(x, (x.shape[-1],), None, eps) * w
    h = F.layer_norm(x, (x.shape[-1],), w, b, eps)
    if second is not None:
        return x, h, F.layer_norm(x, (x.shape[-1],), second[0], second[1], second[2])
    return x, h


if triton is not None:

    @triton.jit
    def _add_norm_kernel(y_ptr, r_ptr, x_ptr, h_ptr, w_ptr, b_ptr, lb_ptr, N, eps,
                         sy, sr, sx, sh, s_part, y2_ptr, sy2, h2_ptr, w2_ptr, b2_ptr, eps2,
                         BLOCK: tl.constexpr, RMS: tl.constexpr, HAS_B: tl.constexpr,
                         PARTS: tl.constexpr, HAS_LB: tl.constexpr, PDL: tl.constexpr,
                         Y2: tl.constexpr, SECOND: tl.constexpr, N_PARTS: tl.constexpr):
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        m = cols < N
        # Every load is issued before any arithmetic: this kernel is a chain of dependent
        # L2 round trips otherwise (one per partial, then the residual, then the norm's
        # weights after its reductions). The norm's and the linear's parameters are never
        # written inside a decode step, so they are read before the PDL wait.
        w = tl.load(w_ptr + cols, mask=m, other=0.0).to(tl.float32)
        if HAS_B:
            nb = tl.load(b_ptr + cols, mask=m, other=0.0).to(tl.float32)
        if HAS_LB:
            lb = tl.load(lb_ptr + cols, mask=m, other=0.0).to(tl.float32)
        if SECOND:
            w2 = tl.load(w2_ptr + cols, mask=m, other=0.0).to(tl.float32)
            b2 = tl.load(b2_ptr + cols, mask=m, other=0.0).to(tl.float32)
        _pdl_enter(PDL)
        r = tl.load(r_ptr + row * sr + cols, mask=m, other=0.0).to(tl.float32)
        if Y2:
            y2 = tl.load(y2_ptr + row * sy2 + cols, mask=m, other=0.0).to(tl.float32)
        if PARTS:
            # y = the fp32 split-K partials of a linear (N_PARTS slices s_part apart) + its
            # bias, rounded to the model dtype where the linear's output would have been
            y = tl.zeros([BLOCK], tl.float32)
            for i in tl.static_range(N_PARTS):
                y += tl.load(y_ptr + i * s_part + row * sy + cols, mask=m, other=0.0)
            if HAS_LB:
                y += lb
            y = y.to(x_ptr.dtype.element_ty).to(tl.float32)
        else:
            y = tl.load(y_ptr + row * sy + cols, mask=m, other=0.0).to(tl.float32)
        if Y2:                                            # (y + y2) rounded, then + r
            y = (y + y2).to(x_ptr.dtype.element_ty).to(tl.float32)
        x = (y + r).to(x_ptr.dtype.element_ty)            # the residual stream, rounded as HF's add
        tl.store(x_ptr + row * sx + cols, x, mask=m)
        xf = x.to(tl.float32)
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
                h = h + nb
            if SECOND:                                    # a second LayerNorm of the same x
                h2 = d * tl.rsqrt(var + eps2) * w2 + b2
                tl.store(h2_ptr + row * sh + cols, h2.to(h_ptr.dtype.element_ty), mask=m)
        tl.store(h_ptr + row * sh + cols, h.to(h_ptr.dtype.element_ty), mask=m)


def add_norm(y, r, w, b, eps: float, rms: bool, y2=None, second=None):
    """Fused `add_norm_ref` for 2-D [rows, N] tensors on CUDA (else the reference)."""
    if (triton is None or y.dim() != 2 or w is None
            or (y.device.type != "cuda" and not _interpreting())):
        return add_norm_ref(y, r, w, b, eps, rms, y2, second)
    return _launch_add_norm(y, r, w, b, eps, rms, y2=y2, second=second)


def _launch_add_norm(y, r, w, b, eps: float, rms: bool, parts=None, lin_b=None, y2=None, second=None):
    """y [rows, N]; or parts [S, rows, N] fp32 (y then = sum over S + lin_b, rounded)."""
    assert second is None or not rms
    rows, N = r.shape
    x = torch.empty_like(r)
    h = torch.empty_like(r)
    h2 = torch.empty_like(r) if second is not None else h
    w2, b2, eps2 = second if second is not None else (w, w, eps)
    block = triton.next_power_of_2(N)
    src = parts if parts is not None else y
    pdl = _pdl_mode(r.device)
    _add_norm_kernel[(rows,)](src, r, x, h, w, b if b is not None else w,
                              lin_b if lin_b is not None else w, N, float(eps),
                              src.stride(-2), r.stride(0), x.stride(0), h.stride(0),
                              parts.stride(0) if parts is not None else 0,
                              y2 if y2 is not None else r, y2.stride(0) if y2 is not None else 0,
                              h2, w2, b2 if b2 is not None else w, float(eps2),
                              BLOCK=block, RMS=bool(rms), HAS_B=b is not None,
                              PARTS=parts is not None, HAS_LB=lin_b is not None, PDL=pdl,
                              Y2=y2 is not None, SECOND=second is not None,
                              N_PARTS=parts.shape[0] if parts is not None else 0,
                              num_warps=4 if block <= 2048 else 8, **_pdl_launch(pdl))
    return (x, h, h2) if second is not None else (x, h)

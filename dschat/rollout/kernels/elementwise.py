"""One-kernel elementwise ops of the decode step, each with its PyTorch reference: Bloom's
and GPT-2's tanh GELUs in HF's eager rounding order, rotary positions in place, and argmax
over the vocabulary (split, then combined)."""
from __future__ import annotations

import math

import torch

from dschat.rollout.kernels.launch import _even_chunks, _interpreting, _pdl_launch, _pdl_mode, triton

if triton is not None:                 # pragma: no cover - exercised on GPU machines
    import triton.language as tl
    from triton.language.extra import libdevice

    from dschat.rollout.kernels.launch import _pdl_enter


def hf_gelu_ref(y):
    """HF's bloom_gelu_forward op by op (eager PyTorch rounds after every op)."""
    return y * 0.5 * (1.0 + torch.tanh(0.79788456 * y * (1 + 0.044715 * y * y)))


if triton is not None:

    @triton.jit
    def _one_plus_tanh(f, dt, LIBDEVICE: tl.constexpr):
        """1 + tanh(f) as the tanh GELUs' eager ops give it: tanh rounded to dt, then the sum
        rounded to dt (returned in fp32)."""
        if LIBDEVICE:                 # tanhf, as PyTorch's CUDA tanh kernel
            g = libdevice.tanh(f)
        else:                         # Triton's CPU interpreter has no libdevice
            g = 2.0 / (1.0 + tl.exp(-2.0 * f)) - 1.0
        g = g.to(dt).to(tl.float32)
        return (1.0 + g).to(dt).to(tl.float32)

    @triton.jit
    def _hf_gelu_kernel(y_ptr, o_ptr, n, BLOCK: tl.constexpr, LIBDEVICE: tl.constexpr, PDL: tl.constexpr):
        _pdl_enter(PDL)
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        m = offs < n
        x = tl.load(y_ptr + offs, mask=m, other=0.0)
        dt = x.dtype
        x = x.to(tl.float32)
        a = (x * 0.5).to(dt).to(tl.float32)
        b = (0.79788456 * x).to(dt).to(tl.float32)
        c = (0.044715 * x).to(dt).to(tl.float32)
        d = (c * x).to(dt).to(tl.float32)
        e = (1.0 + d).to(dt).to(tl.float32)
        f = (b * e).to(dt).to(tl.float32)
        tl.store(o_ptr + offs, (a * _one_plus_tanh(f, dt, LIBDEVICE)).to(dt), mask=m)


def new_gelu_ref(y):
    """HF's NewGELUActivation (GPT-2's gelu_new) op by op, each result rounded to y's dtype."""
    return 0.5 * y * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (y + 0.044715 * torch.pow(y, 3.0))))


if triton is not None:

    @triton.jit
    def _new_gelu_kernel(y_ptr, o_ptr, n, BLOCK: tl.constexpr, LIBDEVICE: tl.constexpr, PDL: tl.constexpr):
        _pdl_enter(PDL)
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        m = offs < n
        x = tl.load(y_ptr + offs, mask=m, other=0.0)
        dt = x.dtype
        x = x.to(tl.float32)
        x2 = (x * x).to(dt).to(tl.float32)            # pow(x, 3) is x * x * x in x's dtype
        p = (x2 * x).to(dt).to(tl.float32)
        c = (0.044715 * p).to(dt).to(tl.float32)
        s = (x + c).to(dt).to(tl.float32)
        f = (0.7978845608028654 * s).to(dt).to(tl.float32)
        h = _one_plus_tanh(f, dt, LIBDEVICE)
        a = (0.5 * x).to(dt).to(tl.float32)
        tl.store(o_ptr + offs, (a * h).to(dt), mask=m)


def _eager_elementwise(kernel, ref, y, pdl: bool):
    """ref(y) through `kernel` (one program per 1024 elements) for contiguous CUDA tensors,
    else ref itself. No multiply-add contraction, so that every op rounds on its own as in
    eager PyTorch (in fp32 the kernels' casts to y's dtype do not separate the ops)."""
    if triton is None or not y.is_contiguous() or (y.device.type != "cuda" and not _interpreting()):
        return ref(y)
    out = torch.empty_like(y)
    n = y.numel()
    mode = _pdl_mode(y.device) if pdl else 0
    kernel[(triton.cdiv(n, 1024),)](y, out, n, BLOCK=1024, LIBDEVICE=not _interpreting(), PDL=mode,
                                    num_warps=4, enable_fp_fusion=False, **_pdl_launch(mode))
    return out


def new_gelu(y):
    """`new_gelu_ref` in one kernel: one launch instead of PyTorch's eight per decode layer."""
    return _eager_elementwise(_new_gelu_kernel, new_gelu_ref, y, pdl=True)


def hf_gelu(y):
    """`hf_gelu_ref` in one kernel (numerics "hf"; launched without programmatic dependent
    launch, which was not measured with it)."""
    return _eager_elementwise(_hf_gelu_kernel, hf_gelu_ref, y, pdl=False)


# ---------------------------------------------------------------------------- rotary

def rope_ref_(x, cos, sin) -> None:
    """Rotary positions in place on the first R dims of every vector of x (R = cos.shape[-1];
    LLaMA R = D, GPT-NeoX's partial rotary R < D). cos, sin [*lead, R] in x's dtype for x's
    leading dims (decode: x [B, H, J, D], cos [B, R]; prefill: x [B, P, ..., D], cos
    [B, P, R]), sin sign-folded ([-sin_lo, sin_hi]): x*cos + swap_halves(x)*sin, each
    product rounded to x's dtype, then the sum, as HF's x*cos + rotate_half(x)*sin."""
    R = cos.shape[-1]
    shape = cos.shape[:-1] + (1,) * (x.dim() - cos.dim()) + (R,)
    part = x[..., :R]
    swapped = part.unflatten(-1, (2, R // 2)).flip(-2).flatten(-2)
    part.copy_(part * cos.reshape(shape) + swapped * sin.reshape(shape))


if triton is not None:

    @triton.jit
    def _rope_kernel(x_ptr, cos_ptr, sin_ptr, H, sxb, sxh, sxj, scb,
                     J: tl.constexpr, R: tl.constexpr, RP: tl.constexpr, PDL: tl.constexpr):
        """Program (b, h): the J vectors x[b, h, :, :R] rotated in place."""
        _pdl_enter(PDL)
        b = tl.program_id(0) // H
        h = tl.program_id(0) % H
        d = tl.arange(0, RP)
        ok = d < R
        partner = tl.where(d < R // 2, d + R // 2, d - R // 2)
        c = tl.load(cos_ptr + b * scb + d, mask=ok, other=0.0).to(tl.float32)
        s = tl.load(sin_ptr + b * scb + d, mask=ok, other=0.0).to(tl.float32)
        for j in tl.static_range(J):
            base = x_ptr + b.to(tl.int64) * sxb + h * sxh + j * sxj
            v = tl.load(base + d, mask=ok, other=0.0)
            p = tl.load(base + partner, mask=ok, other=0.0)
            t1 = (v.to(tl.float32) * c).to(v.dtype).to(tl.float32)
            t2 = (p.to(tl.float32) * s).to(v.dtype).to(tl.float32)
            tl.store(base + d, (t1 + t2).to(v.dtype), mask=ok)


def rope_(x, cos, sin) -> None:
    """`rope_ref_` as one Triton kernel on CUDA (the decode step's q and k rows rotated where
    the QKV linear wrote them: one launch instead of six PyTorch kernels per layer)."""
    if (triton is None or x.dim() != 4 or cos.dim() != 2 or x.stride(-1) != 1 or cos.stride(-1) != 1
            or sin.stride() != cos.stride() or (x.device.type != "cuda" and not _interpreting())):
        return rope_ref_(x, cos, sin)
    B, H, J, _ = x.shape
    R = cos.shape[-1]
    pdl = _pdl_mode(x.device)
    # no multiply-add contraction: HF rounds each product before the sum (exact in fp32 too)
    _rope_kernel[(B * H,)](x, cos, sin, H, x.stride(0), x.stride(1), x.stride(2), cos.stride(0),
                           J=J, R=R, RP=triton.next_power_of_2(R), PDL=pdl, num_warps=1,
                           enable_fp_fusion=False, **_pdl_launch(pdl))


# ---------------------------------------------------------------------------- argmax

def argmax_ref(x):
    return x.argmax(-1)


if triton is not None:

    @triton.jit
    def _argmax_part_kernel(x_ptr, v_ptr, i_ptr, V, sx, chunk, S,
                            BLOCK: tl.constexpr, WHILE: tl.constexpr, PDL: tl.constexpr):
        """Largest value and its first index in slice s (axis 1) of row (axis 0)."""
        _pdl_enter(PDL)
        row = tl.program_id(0)
        s = tl.program_id(1)
        start = s * chunk
        end = tl.minimum(start + chunk, V)
        best_v = tl.full([], float("-inf"), tl.float32)
        best_i = tl.full([], 0, tl.int32) + start
        if WHILE:
            n0 = start
            while n0 < end:
                best_v, best_i = _argmax_block(x_ptr + row * sx, n0, end, best_v, best_i, BLOCK)
                n0 += BLOCK
        else:
            for n0 in range(start, end, BLOCK):
                best_v, best_i = _argmax_block(x_ptr + row * sx, n0, end, best_v, best_i, BLOCK)
        tl.store(v_ptr + row * S + s, best_v)
        tl.store(i_ptr + row * S + s, best_i)

    @triton.jit
    def _argmax_block(base, n0, end, best_v, best_i, BLOCK: tl.constexpr):
        offs = n0 + tl.arange(0, BLOCK)
        v = tl.load(base + offs, mask=offs < end, other=float("-inf")).to(tl.float32)
        v = tl.where(v != v, float("inf"), v)            # NaN counts as the largest value
        m = tl.max(v, axis=0)
        i = tl.min(tl.where(v == m, offs, 2147483647), axis=0)
        take = m > best_v                                 # strictly: an earlier block keeps ties
        return tl.where(take, m, best_v), tl.where(take, i, best_i)

    @triton.jit
    def _argmax_combine_kernel(v_ptr, i_ptr, out_ptr, S, SP: tl.constexpr, PDL: tl.constexpr):
        _pdl_enter(PDL)
        row = tl.program_id(0)
        offs = tl.arange(0, SP)
        ok = offs < S
        v = tl.load(v_ptr + row * S + offs, mask=ok, other=float("-inf"))
        i = tl.load(i_ptr + row * S + offs, mask=ok, other=2147483647)
        m = tl.max(v, axis=0)
        tl.store(out_ptr + row, tl.min(tl.where(ok & (v == m), i, 2147483647), axis=0).to(tl.int64))


def argmax(x):
    """x.argmax(-1) for 2-D [rows, V] on CUDA in two small kernels (slices of each row, then
    their merge): torch parallelises this wide reduction poorly (docs/DECODE.md, section 3).
    Same index as
    torch's, the first of equal maxima; NaN is taken as the largest value."""
    if (triton is None or x.dim() != 2 or x.stride(-1) != 1 or x.shape[1] >= 2 ** 31
            or (x.device.type != "cuda" and not _interpreting())):
        return argmax_ref(x)
    rows, V = x.shape
    block = 1024
    splits = max(1, min(triton.cdiv(1024, rows), triton.cdiv(V, 4 * block)))
    chunk, splits = _even_chunks(V, splits, block)
    vals = torch.empty(rows, splits, dtype=torch.float32, device=x.device)
    idx = torch.empty(rows, splits, dtype=torch.int32, device=x.device)
    out = torch.empty(rows, dtype=torch.long, device=x.device)
    pdl = _pdl_mode(x.device)
    _argmax_part_kernel[(rows, splits)](x, vals, idx, V, x.stride(0), chunk, splits, BLOCK=block,
                                        WHILE=_interpreting(), PDL=pdl, num_warps=4,
                                        **_pdl_launch(pdl))
    _argmax_combine_kernel[(rows,)](vals, idx, out, splits, SP=max(2, triton.next_power_of_2(splits)),
                                    PDL=pdl, num_warps=1, **_pdl_launch(pdl))
    return out

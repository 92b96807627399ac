"""Optional Triton kernels for the fast decode step (dschat.rollout.decode).

Only imported on CUDA when Triton is importable; every kernel here has a PyTorch
reference (`*_ref`) with the same rounding points, used on CPU and in tests. Kernels:

- `hf_gelu`: Bloom's tanh-GELU with every intermediate rounded to the tensor dtype in
  HF's op order (one kernel instead of HF's nine), so bf16 results match HF's eager ones;
- `add_norm`: residual add fused with the next LayerNorm / RMSNorm, returning both the
  new residual stream and the normalised activations (one kernel instead of two or
  three per norm in the decode step, where each kernel is a few microseconds of launch
  latency and the tensors are tiny);
- `decode_attention` (flash-decoding, optionally writing the step's K/V), the decode
  linears (`tuned_linear`, `linear_add_norm`: per-shape choice against cuBLAS) and `argmax`.

On Hopper and later every kernel here is launched with programmatic dependent launch (`PDL`).
"""
from __future__ import annotations

import contextlib
import hashlib
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Union

import torch
import torch.nn.functional as F

from dschat.rollout import race_cache
from dschat.utils.logging import get_logger

logger = get_logger(__name__)
_SOURCE_HASH = hashlib.sha1(Path(__file__).read_bytes()).hexdigest()[:16]   # a kernel edit retires cached winners

try:                                   # pragma: no cover - exercised on GPU machines
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice
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


# ---------------------------------------------------------------------------- launch overlap

# ---------------------------------------------------------------------------- options

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
    pdl = _ACTIVE.pdl
    return 3 if pdl is None else int(pdl)


def _launch_key(device) -> tuple:
    """The launch settings a per-shape timing depends on."""
    mode = _pdl_mode(device)
    o = _ACTIVE
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


def _even_chunks(n: int, parts: int, block: int) -> tuple[int, int]:
    """(chunk, count): n split into about `parts` chunks whole in `block`s; count may come
    out lower than parts (never an empty chunk)."""
    per_part = -(-n // parts)
    chunk = -(-per_part // block) * block
    return chunk, -(-n // chunk)


def _interpreting() -> bool:
    import os
    return os.environ.get("TRITON_INTERPRET") == "1"


# ---------------------------------------------------------------------------- attention

def decode_attention_ref(q, kv, key_bias, pos, scale: float):
    """One query token per row against cache slots 0..pos (pos: 1-element device tensor).

    q [B, Hkv, G, D]; kv [B, Hkv, L, 2, D]; key_bias [B, Hb, L] additive (Hb 1 or Hkv*G).
    Returns [B, Hkv*G*D]."""
    B, Hkv, G, D = q.shape
    L = kv.shape[2]
    bias = key_bias.float().view(B, -1, 1, L) if key_bias.shape[1] == 1 else \
        key_bias.float().view(B, Hkv, G, L)
    scores = torch.einsum("bhgd,bhld->bhgl", q.float(), kv[:, :, :, 0].float()) * scale + bias
    scores = scores.masked_fill(torch.arange(L, device=q.device) > pos, float("-inf"))
    out = torch.einsum("bhgl,bhld->bhgd", scores.softmax(-1), kv[:, :, :, 1].float())
    return out.to(q.dtype).reshape(B, Hkv * G * D)


if triton is not None:

    @triton.jit
    def _lanes(mask, offs_d, D: tl.constexpr, DP: tl.constexpr):
        """mask [X, 1 or DP] restricted to the D real head_dim lanes of DP (a power of two);
        unchanged (so the same code as before) where D is a power of two."""
        if DP != D:
            mask = mask & (offs_d[None, :] < D)
        return mask

    @triton.jit
    def _attn_load(kv_base, b_base, n0, end, skv_l, gmask, offs_d, D: tl.constexpr,
                   BLOCK_N: tl.constexpr, DP: tl.constexpr):
        """Keys, values [BLOCK_N, DP] and per-key bias [GP, BLOCK_N] of slots n0 .. n0+BLOCK_N
        (those < end), in the cache dtype."""
        offs_n = n0 + tl.arange(0, BLOCK_N)
        valid = offs_n < end
        kmask = _lanes(valid[:, None], offs_d, D, DP)
        k = tl.load(kv_base + offs_n[:, None] * skv_l + offs_d[None, :], mask=kmask, other=0.0)
        v = tl.load(kv_base + offs_n[:, None] * skv_l + D + offs_d[None, :], mask=kmask, other=0.0)
        kb = tl.load(b_base[:, None] + offs_n[None, :], mask=gmask[:, None] & valid[None, :], other=0.0)
        return k, v, kb

    @triton.jit
    def _attn_update(q, k, v, kb, n0, end, m_i, l_i, acc, scale, BLOCK_N: tl.constexpr,
                     GP: tl.constexpr, DOT: tl.constexpr, INTERP: tl.constexpr, PV_LOW: tl.constexpr):
        """Online-softmax update with the block `_attn_load` read at n0. q [GP, D] in the
        cache dtype when DOT (tensor-core dots; GP >= 16 rows, the padding rows zero), else fp32;
        PV_LOW: p.V with p rounded to the cache dtype (KernelOptions.attn_pv_low)."""
        valid = n0 + tl.arange(0, BLOCK_N) < end
        if DOT:
            # bf16/fp16 q.K^T with fp32 accumulation (exact products), then p.V in TF32 (PV_LOW:
            # in the cache dtype, below)
            if INTERP:                # Triton's CPU interpreter gets bf16 dots wrong (3.9)
                s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee") * scale
            else:
                s = tl.dot(q, tl.trans(k)) * scale
        elif GP == 1:                 # one query head per K/V head: plain 2-D GEMV math
            s = tl.sum(k.to(tl.float32) * tl.sum(q, axis=0)[None, :], axis=1)[None, :] * scale
        else:
            s = tl.sum(q[:, None, :] * k.to(tl.float32)[None, :, :], axis=2) * scale   # [GP, BLOCK_N]
        s += kb.to(tl.float32)
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if DOT and PV_LOW:
            p_low = p.to(v.dtype)
            if INTERP:
                pv = tl.dot(p_low.to(tl.float32), v.to(tl.float32), input_precision="ieee")
            else:
                pv = tl.dot(p_low, v)
        elif DOT:
            pv = tl.dot(p, v.to(tl.float32), input_precision="ieee" if INTERP else "tf32")
        elif GP == 1:
            pv = tl.sum(tl.sum(p, axis=0)[:, None] * v.to(tl.float32), axis=0)[None, :]
        else:
            pv = tl.sum(p[:, :, None] * v.to(tl.float32)[None, :, :], axis=1)
        acc = acc * alpha[:, None] + pv
        return m_new, l_i, acc

    @triton.jit
    def _combine_splits(m_ptr, l_ptr, acc_ptr, out_ptr, bh, Hkv, G: tl.constexpr, GP: tl.constexpr,
                        D: tl.constexpr, SPLITS: tl.constexpr, DP: tl.constexpr):
        """out[b, h] = the softmax-weighted merge of the SPLITS partials of program row bh."""
        b = bh // Hkv
        h = bh % Hkv
        offs_s = tl.arange(0, SPLITS)
        offs_g = tl.arange(0, GP)
        offs_d = tl.arange(0, DP)
        rows = (bh * SPLITS + offs_s[:, None]) * GP + offs_g[None, :]        # [S, GP]
        # .cg: read from L2, where the other programs' partials landed (never a stale L1 line)
        # all three loads before any arithmetic: one L2 round trip, not two (the max's
        # cross-warp reduction would otherwise hold the partials' load back)
        m = tl.load(m_ptr + rows, cache_modifier=".cg")
        l = tl.load(l_ptr + rows, cache_modifier=".cg")
        a_ptr = acc_ptr + rows[:, :, None] * D + offs_d[None, None, :]
        if DP != D:
            acc = tl.load(a_ptr, mask=(offs_d < D)[None, None, :], other=0.0, cache_modifier=".cg")
        else:
            acc = tl.load(a_ptr, cache_modifier=".cg")
        m_max = tl.max(m, axis=0)                                           # [GP]
        w = tl.exp(m - m_max[None, :])                                       # empty splits: 0
        denom = tl.sum(w * l, axis=0)
        out = tl.sum(w[:, :, None] * acc, axis=0) / denom[:, None]
        o_ptr = out_ptr + b * (Hkv * G * D) + (h * G + offs_g[:, None]) * D + offs_d[None, :]
        tl.store(o_ptr, out.to(out_ptr.dtype.element_ty), mask=_lanes((offs_g < G)[:, None], offs_d, D, DP))

    @triton.jit
    def _attn_split_kernel(q_ptr, kv_ptr, bias_ptr, pos_ptr, first_ptr, out_ptr, m_ptr, l_ptr, acc_ptr,
                           new_ptr, Hkv, chunk, scale,
                           sq_b, sq_h, sq_g, skv_b, skv_h, skv_l, sb_b, sb_h, sn_b, sn_h, sn_v,
                           G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr,
                           BLOCK_N: tl.constexpr, SPLITS: tl.constexpr, WHILE: tl.constexpr,
                           FUSED: tl.constexpr, DOT: tl.constexpr,
                           GS: tl.constexpr, PDL: tl.constexpr, PF_N: tl.constexpr,
                           LINE: tl.constexpr, DP: tl.constexpr, PV_LOW: tl.constexpr,
                           SKIP_PAD: tl.constexpr):
        bh = tl.program_id(0)
        split = tl.program_id(1)
        b = bh // Hkv
        h = bh % Hkv
        lo = split * chunk                            # this program's slots: lo .. lo+chunk
        start = lo
        # pos (read on the device, so one graph serves every step) was set by the previous
        # step, whose kernels all ended before this one started: read it before the wait
        pos = tl.load(pos_ptr)
        if SKIP_PAD:
            # the row's slots before its first visible key (left padding, set at prefill) are
            # fully masked: skip the whole BLOCK_N blocks of them. Block boundaries stay where
            # they were and a skipped block adds exactly 0 after the rescale, so the sums are
            # the same bit for bit; a chunk of padding only is an empty split (weight 0)
            first = tl.load(first_ptr + b)
            start = tl.maximum(lo, (first // BLOCK_N) * BLOCK_N)
        if PDL == 3 and PF_N > 0:
            # cached slots before pos are never written in this step: ask L2 for this
            # program's first PF_N of them before waiting
            last = tl.maximum(pos - 1, 0)
            slots = tl.minimum(start + tl.arange(0, PF_N), last)
            _l2_prefetch_rows(kv_ptr + b * skv_b + h * skv_h, slots, skv_l, 0, 2 * D, 2 * DP, LINE)
        _pdl_enter(PDL)
        n_keys = pos + 1                              # slots 0..pos
        if FUSED:                                     # slot pos comes from new_ptr, below
            end = tl.minimum(lo + chunk, n_keys - 1)
        else:
            end = tl.minimum(lo + chunk, n_keys)
        offs_g = tl.arange(0, GP)
        offs_d = tl.arange(0, DP)                    # DP: head_dim D padded to a power of two
        gmask = offs_g < G
        m_i = tl.full([GP], float("-inf"), tl.float32)
        l_i = tl.zeros([GP], tl.float32)
        acc = tl.zeros([GP, DP], tl.float32)
        kv_base = kv_ptr + b * skv_b + h * skv_h
        # per-head bias row: query head h*G+g (sb_h is 0 where the bias is shared by heads)
        b_base = bias_ptr + b * sb_b + (h * G + offs_g) * sb_h
        q_in = tl.load(q_ptr + b * sq_b + h * sq_h + offs_g[:, None] * sq_g + offs_d[None, :],
                       mask=_lanes(gmask[:, None], offs_d, D, DP), other=0.0)
        q = q_in.to(tl.float32)
        qb = q_in if DOT else q                       # the dot's operand: the cache dtype
        p = n_keys - 1
        own_new = (p >= lo) & (p < lo + chunk)
        if FUSED:
            # the step's own K/V: the program whose chunk holds slot pos writes it into the
            # cache (no separate index_copy kernel) and adds it to its softmax at the end;
            # read here, with q, so that its latency is not paid after the key loop
            new_base = new_ptr + b * sn_b + h * sn_h
            own = own_new.to(tl.int32)                # (as bounds: a broadcast scalar mask
            dmask = offs_d < D * own                  # trips Triton's CPU interpreter)
            k_new = tl.load(new_base + offs_d, mask=dmask, other=0.0)
            v_new = tl.load(new_base + sn_v + offs_d, mask=dmask, other=0.0)
            tl.store(kv_base + p * skv_l + offs_d, k_new, mask=dmask)
            tl.store(kv_base + p * skv_l + D + offs_d, v_new, mask=dmask)
            kb_new = tl.load(b_base + p, mask=offs_g < G * own, other=0.0).to(tl.float32)
        if WHILE:                                     # Triton's CPU interpreter path
            n0 = start
            while n0 < end:
                k, v, kb = _attn_load(kv_base, b_base, n0, end, skv_l, gmask, offs_d, D, BLOCK_N, DP)
                m_i, l_i, acc = _attn_update(qb, k, v, kb, n0, end, m_i, l_i, acc, scale, BLOCK_N, GP,
                                             DOT, WHILE, PV_LOW)
                n0 += BLOCK_N
        else:
            for n0 in range(start, end, BLOCK_N):
                k, v, kb = _attn_load(kv_base, b_base, n0, end, skv_l, gmask, offs_d, D, BLOCK_N, DP)
                m_i, l_i, acc = _attn_update(qb, k, v, kb, n0, end, m_i, l_i, acc, scale, BLOCK_N, GP,
                                             DOT, WHILE, PV_LOW)
        if FUSED:
            if own_new:
                s_new = tl.sum(q * k_new.to(tl.float32)[None, :], axis=1) * scale + kb_new
                m_new = tl.maximum(m_i, s_new)
                alpha = tl.exp(m_i - m_new)
                p_new = tl.exp(s_new - m_new)
                l_i = l_i * alpha + p_new
                acc = acc * alpha[:, None] + p_new[:, None] * v_new.to(tl.float32)[None, :]
                m_i = m_new
        if SPLITS == 1:
            out = acc / l_i[:, None]
            o_ptr = out_ptr + b * (Hkv * G * D) + (h * G + offs_g[:, None]) * D + offs_d[None, :]
            tl.store(o_ptr, out.to(out_ptr.dtype.element_ty), mask=_lanes(gmask[:, None], offs_d, D, DP))
        else:
            # partials of the GS (G rounded up to a power of two) rows the combine reads; the
            # dot path's padding rows beyond them are dropped
            row = (bh * SPLITS + split) * GS
            smask = offs_g < GS
            tl.store(m_ptr + row + offs_g, m_i, mask=smask)
            tl.store(l_ptr + row + offs_g, l_i, mask=smask)
            tl.store(acc_ptr + (row + offs_g[:, None]) * D + offs_d[None, :], acc,
                     mask=_lanes(smask[:, None], offs_d, D, DP))

    @triton.jit
    def _attn_combine_kernel(m_ptr, l_ptr, acc_ptr, out_ptr, Hkv,
                             G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr,
                             SPLITS: tl.constexpr, PDL: tl.constexpr, DP: tl.constexpr):
        _pdl_enter(PDL)
        _combine_splits(m_ptr, l_ptr, acc_ptr, out_ptr, tl.program_id(0), Hkv, G, GP, D, SPLITS, DP)


def _splits(B: int, Hkv: int, L: int, block_n: int, programs: int = 1024) -> int:
    """About `programs` programs, each with at least one key block: 2048 for the one-warp
    GEMV programs at head_dim <= 64 (8 splits at bloom-560m batch 16), else 1024 (2 splits at
    head_dim 128 batch 16); with the tensor-core dots 512 (1 split at bloom-7b1 batch 16).
    From attn_bench.py's sweep (docs/DECODE.md, section 4)."""
    if _ACTIVE.attn_splits is not None:
        return _ACTIVE.attn_splits
    s = 1
    while B * Hkv * s < programs and L // (2 * s) >= block_n and s < 16:
        s *= 2
    return s


def _small_gemv(D: int, GP: int) -> bool:
    """One query head per K/V head at head_dim <= 64 (Bloom, OPT, GPT-2 shapes): one-warp
    programs over 32-key blocks: 2 warps over 128-key blocks need 255 registers and spill,
    one warp needs 80 (docs/DECODE.md, section 4)."""
    return GP == 1 and D <= 64


def _block_n(D: int, GP: int = 1) -> int:
    return _ACTIVE.attn_block_n or (32 if _small_gemv(D, GP) else 128 if D <= 64 else 64)


def _warps(block_n: int, D: int, GP: int) -> int:
    if _ACTIVE.attn_warps:
        return _ACTIVE.attn_warps
    if GP == 1:      # fewer idle lanes per GEMV: 2 beat 4 and 8 in attn_bench.py's sweep
        return 1 if _small_gemv(D, GP) else 2
    return 8 if block_n * D * GP >= 8192 else 4   # grouped queries: not swept


def _tensor_core_tf32(device) -> bool:
    """bf16 and TF32 tensor-core dots (compute capability 8.0+: A100, H100/H200, L40...)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 8


def write_kv_ref(kv, new_kv, pos) -> None:
    """kv[:, :, pos] = new_kv ([B, Hkv, 2, D]; pos a 1-element device tensor)."""
    kv.index_copy_(2, pos, new_kv.unsqueeze(2))


def decode_attention(q, kv, key_bias, pos, scale: float, new_kv=None, key_start=None):
    """Triton flash-decoding over slots 0..pos read from the device (so one CUDA graph
    serves every step): split-K programs, then a combine kernel when split.

    `new_kv` [B, Hkv, 2, D] (any strides but a contiguous last dim): this step's K/V,
    written into slot pos by the kernel itself (else the caller must have written it).
    `key_start` [B] int32 (optional): each row's first slot whose bias is not masked (its
    left padding); the kernel does not read the blocks of slots wholly before it, and the
    result is the same bit for bit."""
    fallback = triton is None or (q.device.type != "cuda" and not _interpreting())
    B, Hkv, G, D = q.shape
    L = kv.shape[2]
    if D & (D - 1) and not _ACTIVE.attn_pad_head_dim:  # one power-of-two block spans head_dim
        fallback = True
    if not fallback and (q.stride(-1) != 1 or kv.stride(-1) != 1 or kv.stride(3) != D
                         or key_bias.stride(-1) != 1):
        fallback = True
    if not fallback and new_kv is not None and new_kv.stride(-1) != 1:
        fallback = True
    if fallback:
        if new_kv is not None:
            write_kv_ref(kv, new_kv, pos)
        return decode_attention_ref(q, kv, key_bias, pos, scale)
    GS = max(1, triton.next_power_of_2(G))
    # tensor-core dots pad the query rows to 16 (bf16/fp16 caches; fp32 keeps exact FMA math)
    dot = (D >= 128 if _ACTIVE.attn_dot is None else _ACTIVE.attn_dot) and (_interpreting() or (
        kv.dtype in (torch.bfloat16, torch.float16) and _tensor_core_tf32(kv.device)))
    GP = max(16, GS) if dot else GS
    bn = (_ACTIVE.attn_block_n or 32) if dot else _block_n(D, GP)
    S = _splits(B, Hkv, L, bn, 512 if dot else 2048 if _small_gemv(D, GP) else 1024)
    chunk = _even_chunks(L, S, bn)[0]          # S programs per row even where some get no keys
    out = torch.empty(B, Hkv * G * D, dtype=q.dtype, device=q.device)
    if S > 1:
        m = torch.empty(B * Hkv * S * GS, dtype=torch.float32, device=q.device)
        l = torch.empty_like(m)
        acc = torch.empty(B * Hkv * S * GS * D, dtype=torch.float32, device=q.device)
    else:
        m = l = acc = out
    sb_h = 0 if key_bias.shape[1] == 1 else key_bias.stride(1)
    fused = new_kv is not None
    new = new_kv if fused else q
    stages = {"num_stages": _ACTIVE.attn_stages} if _ACTIVE.attn_stages else {}
    pdl = _pdl_mode(q.device)
    DP = triton.next_power_of_2(D)           # head_dim lanes of the kernels' blocks
    line = 128 // kv.element_size()          # elements per 128-byte line; a slot is 2 * D
    pf_n = 0
    if pdl == 3 and _ACTIVE.pdl_prefetch_attn > 0:
        pf_n = _prefetch_count(min(chunk, _ACTIVE.pdl_prefetch_attn // (2 * D * kv.element_size())), 1)
    skip = key_start is not None and _ACTIVE.attn_skip_pad
    if skip and (key_start.dtype != torch.int32 or key_start.shape != (B,) or key_start.stride(0) != 1):
        raise ValueError(f"key_start must be a contiguous int32 [{B}] tensor, got "
                         f"{key_start.dtype} {tuple(key_start.shape)}")
    _attn_split_kernel[(B * Hkv, S)](
        q, kv, key_bias, pos, key_start if skip else pos, out, m, l, acc, new, Hkv, chunk,
        float(scale),
        q.stride(0), q.stride(1), q.stride(2), kv.stride(0), kv.stride(1), kv.stride(2),
        key_bias.stride(0), sb_h, new.stride(0), new.stride(1), new.stride(2) if fused else 0,
        G=G, GP=GP, D=D, DP=DP, BLOCK_N=bn,
        SPLITS=S, WHILE=_interpreting(), FUSED=fused, DOT=dot, GS=GS,
        PDL=pdl, PF_N=pf_n, LINE=line, PV_LOW=dot and _ACTIVE.attn_pv_low, SKIP_PAD=skip,
        num_warps=(_ACTIVE.attn_warps or 4) if dot else _warps(bn, D, GP), **stages,
        **_pdl_launch(pdl))
    if S > 1:
        _attn_combine_kernel[(B * Hkv,)](m, l, acc, out, Hkv, G=G, GP=GS, D=D, SPLITS=S, PDL=pdl, DP=DP,
                                         num_warps=4, **_pdl_launch(pdl))
    return out


# ---------------------------------------------------------------------------- linear

# The decode step's linears multiply a few rows (the batch) by a whole weight: bound by
# reading the weight. cuBLAS picks well for most such shapes but not all (it may add a
# split-K reduce kernel, or pick a slower kernel; docs/DECODE.md, section 5). Two Triton kernels:
# - `_linear_kernel`: each program owns BLOCK_N output columns and walks all of K, bias and
#   tanh-GELU in its epilogue (no second kernel);
# - `_linear_part_kernel`: split-K into fp32 partials [S, rows, N] that the add+norm kernel
#   following the linear sums (+ bias, rounded to the model dtype as the linear's output
#   would be): in a decoder block the attention-output and MLP-down projections are
#   always followed by the residual add + norm, so the split costs no reduce kernel.


def linear_ref(x, w, b=None, gelu: "bool | str" = False):
    """F.linear, then gelu: False none, True / "tanh" tanh-GELU, "erf" exact GELU (applied to
    the linear's output rounded to its dtype, as HF's nn.GELU after nn.Linear)."""
    y = F.linear(x, w, b)
    return F.gelu(y, approximate="none" if gelu == "erf" else "tanh") if gelu else y


def _gelu_code(gelu) -> int:
    """The linear kernels' GELU constexpr: 0 none, 1 tanh (cuBLASLt epilogue's fp32 math),
    2 erf on the output rounded to the model dtype (nn.GELU's)."""
    return 2 if gelu == "erf" else int(bool(gelu))


if triton is not None:

    @triton.jit
    def _load_w(w_ptr, offs_n, k, n_ok, k_ok, sw, swk):
        """The [BLOCK_K, BLOCK_N] tile w[offs_n, k].T (swk 1: an nn.Linear weight [N, K];
        sw 1: a Conv1D weight [K, N] read through its transpose)."""
        return tl.load(w_ptr + offs_n[None, :] * sw + k[:, None] * swk, mask=n_ok[None, :] & k_ok[:, None],
                       other=0.0)

    @triton.jit
    def _dot_block(acc, x_ptr, w_ptr, offs_m, offs_n, k, m_ok, n_ok, k_ok, sx, sw, swk,
                   LIBDEVICE: tl.constexpr, IEEE: tl.constexpr):
        return _dot_w(acc, x_ptr, _load_w(w_ptr, offs_n, k, n_ok, k_ok, sw, swk), offs_m, k, m_ok, k_ok, sx,
                      LIBDEVICE, IEEE)

    @triton.jit
    def _dot_w(acc, x_ptr, w, offs_m, k, m_ok, k_ok, sx, LIBDEVICE: tl.constexpr, IEEE: tl.constexpr):
        """acc + x[offs_m, k] @ w (w: a tile from _load_w)."""
        x = tl.load(x_ptr + offs_m[:, None] * sx + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        if not LIBDEVICE:             # Triton's CPU interpreter gets bf16 dots wrong (3.9)
            x = x.to(tl.float32)
            w = w.to(tl.float32)
        if IEEE:                      # fp32 models: full-precision products, not TF32
            return acc + tl.dot(x, w, input_precision="ieee")
        return acc + tl.dot(x, w)

    @triton.jit
    def _bias_gelu(acc, bias, y_ptr, HAS_B: tl.constexpr, GELU: tl.constexpr, LIBDEVICE: tl.constexpr):
        """A linear's epilogue on its fp32 [rows, cols] tile: + bias, then GELU (`_gelu_code`)."""
        if HAS_B:
            acc += bias[None, :]
        if GELU == 2:                                   # nn.GELU() on the rounded linear output
            v = acc.to(y_ptr.dtype.element_ty).to(tl.float32)
            acc = 0.5 * v * (1.0 + tl.erf(v * 0.7071067811865476))
        if GELU == 1:                                   # tanh-GELU in fp32, as cuBLASLt's epilogue
            u = 0.7978845608028654 * (acc + 0.044715 * acc * acc * acc)
            if LIBDEVICE:
                t = libdevice.tanh(u)
            else:
                t = 2.0 / (1.0 + tl.exp(-2.0 * u)) - 1.0
            acc = 0.5 * acc * (1.0 + t)
        return acc

    @triton.jit
    def _strip(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """A decode linear program's rows, its BLOCK_N output columns, one K block's offsets."""
        offs_m = tl.arange(0, BLOCK_M)
        offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        return offs_m, offs_n, tl.arange(0, BLOCK_K), offs_m < M, offs_n < N

    @triton.jit
    def _linear_kernel(x_ptr, w_ptr, b_ptr, y_ptr, M, N, K, sx, sw, swk, sy,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       HAS_B: tl.constexpr, GELU: tl.constexpr, LIBDEVICE: tl.constexpr,
                       IEEE: tl.constexpr, PDL: tl.constexpr, PF_K: tl.constexpr,
                       LINE: tl.constexpr):
        offs_m, offs_n, offs_k, m_ok, n_ok = _strip(M, N, BLOCK_M, BLOCK_N, BLOCK_K)
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        bias = 0.0
        if HAS_B:                     # a parameter: read now, not in a round trip after the loop
            bias = tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)
        k_first = 0
        if PDL == 3 and PF_K > 0:     # the strip's first PF_K columns into L2 while the previous kernel ends
            _l2_prefetch_rows(w_ptr, tl.minimum(offs_n, N - 1), sw, 0, K, PF_K, LINE)
        if PDL == 2:                  # the first weight tile is read while the previous kernel ends
            w0 = _load_w(w_ptr, offs_n, offs_k, n_ok, offs_k < K, sw, swk)
            _pdl_enter(PDL)
            acc = _dot_w(acc, x_ptr, w0, offs_m, offs_k, m_ok, offs_k < K, sx, LIBDEVICE, IEEE)
            k_first = BLOCK_K
        else:
            _pdl_enter(PDL)
        for k0 in range(k_first, K, BLOCK_K):
            k = k0 + offs_k
            acc = _dot_block(acc, x_ptr, w_ptr, offs_m, offs_n, k, m_ok, n_ok, k < K, sx, sw, swk,
                             LIBDEVICE, IEEE)
        acc = _bias_gelu(acc, bias, y_ptr, HAS_B, GELU, LIBDEVICE)
        tl.store(y_ptr + offs_m[:, None] * sy + offs_n[None, :], acc.to(y_ptr.dtype.element_ty),
                 mask=m_ok[:, None] & n_ok[None, :])

    @triton.jit
    def _linear_part_kernel(x_ptr, w_ptr, p_ptr, M, N, K, chunk, sx, sw, swk,
                            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                            LIBDEVICE: tl.constexpr, IEEE: tl.constexpr, WHILE: tl.constexpr,
                            PDL: tl.constexpr, PF_K: tl.constexpr, LINE: tl.constexpr):
        """Split s of K (program axis 1): fp32 partial x[:, ks] @ w[ns, ks].T -> p[s]."""
        s = tl.program_id(1)
        offs_m, offs_n, offs_k, m_ok, n_ok = _strip(M, N, BLOCK_M, BLOCK_N, BLOCK_K)
        start = s * chunk
        end = tl.minimum(start + chunk, K)
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        if PDL == 3 and PF_K > 0:
            _l2_prefetch_rows(w_ptr, tl.minimum(offs_n, N - 1), sw, start, end, PF_K, LINE)
        if PDL == 2:                  # the first weight tile is read while the previous kernel ends
            k = start + offs_k
            w0 = _load_w(w_ptr, offs_n, k, n_ok, k < end, sw, swk)
            _pdl_enter(PDL)
            acc = _dot_w(acc, x_ptr, w0, offs_m, k, m_ok, k < end, sx, LIBDEVICE, IEEE)
            start += BLOCK_K
        else:
            _pdl_enter(PDL)
        if WHILE:                     # Triton's CPU interpreter path
            k0 = start
            while k0 < end:
                k = k0 + offs_k
                acc = _dot_block(acc, x_ptr, w_ptr, offs_m, offs_n, k, m_ok, n_ok, k < end, sx, sw, swk,
                                 LIBDEVICE, IEEE)
                k0 += BLOCK_K
        else:
            for k0 in range(start, end, BLOCK_K):
                k = k0 + offs_k
                acc = _dot_block(acc, x_ptr, w_ptr, offs_m, offs_n, k, m_ok, n_ok, k < end, sx, sw, swk,
                                 LIBDEVICE, IEEE)
        tl.store(p_ptr + (s * M + offs_m[:, None]) * N + offs_n[None, :], acc,
                 mask=m_ok[:, None] & n_ok[None, :])


if triton is not None:

    @triton.jit
    def _tma_dot(acc, w, x, SWAP: tl.constexpr, LIBDEVICE: tl.constexpr):
        """acc + x @ w.T for a [BLOCK_N, BLOCK_K] weight tile (SWAP: acc.T + w @ x.T)."""
        if not LIBDEVICE:             # Triton's CPU interpreter gets bf16 dots wrong (3.9)
            w = w.to(tl.float32)
            x = x.to(tl.float32)
        if SWAP:
            acc = tl.dot(w, tl.trans(x), acc)
        else:
            acc = tl.dot(x, tl.trans(w), acc)
        return acc

    @triton.jit
    def _silu_mul(acc_g, acc_u, y_ptr, LIBDEVICE: tl.constexpr):
        """silu(g) * u in y's dtype, rounded as HF's LlamaMLP rounds: each linear's output, the
        SiLU, the product."""
        dt = y_ptr.dtype.element_ty
        g = acc_g.to(dt).to(tl.float32)
        u = acc_u.to(dt).to(tl.float32)
        if LIBDEVICE:                 # PyTorch's SiLU: x / (1 + expf(-x)), IEEE division
            s = libdevice.div_rn(g, 1.0 + libdevice.exp(-g))
        else:
            s = g / (1.0 + tl.exp(-g))
        s = s.to(dt).to(tl.float32)
        return (s * u).to(dt)

    @triton.jit
    def _linear_tma_kernel(x_ptr, x_desc, w_ptr, w_desc, b_ptr, u_ptr, u_desc, bu_ptr, y_ptr, M, N, K, chunk,
                           sx, sw, sy, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                           SWAP: tl.constexpr, PARTS: tl.constexpr, GATED: tl.constexpr, X_TMA: tl.constexpr,
                           HAS_B: tl.constexpr, GELU: tl.constexpr, LIBDEVICE: tl.constexpr,
                           PDL: tl.constexpr, PF_K: tl.constexpr, LINE: tl.constexpr):
        """`_linear_kernel` (PARTS: `_linear_part_kernel`, split s of K on program axis 1)
        with the weight tiles brought in by the Hopper tensor memory accelerator (TMA: one
        instruction per [BLOCK_N, BLOCK_K] tile, zero-filled past N and K) instead of
        per-thread loads. SWAP computes y.T = w @ x.T, so that the weight strip is the MMA's
        wide side (64+ rows: warpgroup MMA) and the few batch rows its narrow one. X_TMA: x's
        tiles by TMA too (16-byte aligned x), else by pointer. GATED: `_gated_kernel`'s
        silu(x @ w.T + b) * (x @ u.T + bu)."""
        s = tl.program_id(1)
        n0 = tl.program_id(0) * BLOCK_N
        offs_m, offs_n, offs_k, m_ok, n_ok = _strip(M, N, BLOCK_M, BLOCK_N, BLOCK_K)
        start = s * chunk
        end = tl.minimum(start + chunk, K)
        bias = 0.0
        bias_u = 0.0
        if HAS_B:
            bias = tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)
            if GATED:
                bias_u = tl.load(bu_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)
        if PDL == 3 and PF_K > 0:
            _l2_prefetch_rows(w_ptr, tl.minimum(offs_n, N - 1), sw, start, end, PF_K, LINE)
            if GATED:
                _l2_prefetch_rows(u_ptr, tl.minimum(offs_n, N - 1), sw, start, end, PF_K, LINE)
        _pdl_enter(PDL)
        if SWAP:
            acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
        else:
            acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        if GATED:
            acc_u = tl.zeros_like(acc)
        for k0 in range(start, end, BLOCK_K):
            k = k0 + offs_k
            k_ok = k < end
            w = w_desc.load([n0, k0])
            if X_TMA:                 # TMA reads 0 past M and K (a split is whole BLOCK_Ks)
                x = x_desc.load([0, k0])
            else:
                x = tl.load(x_ptr + offs_m[:, None] * sx + k[None, :], mask=m_ok[:, None] & k_ok[None, :],
                            other=0.0)
            acc = _tma_dot(acc, w, x, SWAP, LIBDEVICE)
            if GATED:
                acc_u = _tma_dot(acc_u, u_desc.load([n0, k0]), x, SWAP, LIBDEVICE)
        if SWAP:
            acc = tl.trans(acc)
            if GATED:
                acc_u = tl.trans(acc_u)
        if PARTS:
            tl.store(y_ptr + (s * M + offs_m[:, None]) * N + offs_n[None, :], acc,
                     mask=m_ok[:, None] & n_ok[None, :])
        elif GATED:
            if HAS_B:
                acc += bias[None, :]
                acc_u += bias_u[None, :]
            tl.store(y_ptr + offs_m[:, None] * sy + offs_n[None, :], _silu_mul(acc, acc_u, y_ptr, LIBDEVICE),
                     mask=m_ok[:, None] & n_ok[None, :])
        else:
            acc = _bias_gelu(acc, bias, y_ptr, HAS_B, GELU, LIBDEVICE)
            tl.store(y_ptr + offs_m[:, None] * sy + offs_n[None, :], acc.to(y_ptr.dtype.element_ty),
                     mask=m_ok[:, None] & n_ok[None, :])


if triton is not None:

    @triton.jit
    def _gated_kernel(x_ptr, g_ptr, u_ptr, bg_ptr, bu_ptr, y_ptr, M, N, K, sx, sw, swk, sy,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      HAS_B: tl.constexpr, LIBDEVICE: tl.constexpr, IEEE: tl.constexpr,
                      PDL: tl.constexpr, PF_K: tl.constexpr, LINE: tl.constexpr):
        """silu(x @ g.T + bg) * (x @ u.T + bu) for BLOCK_N columns, rounded as HF's LlamaMLP
        rounds: each linear's output, the SiLU, the product."""
        offs_m, offs_n, offs_k, m_ok, n_ok = _strip(M, N, BLOCK_M, BLOCK_N, BLOCK_K)
        acc_g = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        acc_u = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        if HAS_B:                     # parameters: read now, not in a round trip after the loop
            bias_g = tl.load(bg_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)
            bias_u = tl.load(bu_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)
        if PDL == 3 and PF_K > 0:
            _l2_prefetch_rows(g_ptr, tl.minimum(offs_n, N - 1), sw, 0, K, PF_K, LINE)
            _l2_prefetch_rows(u_ptr, tl.minimum(offs_n, N - 1), sw, 0, K, PF_K, LINE)
        _pdl_enter(PDL)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + offs_k
            k_ok = k < K
            acc_g = _dot_block(acc_g, x_ptr, g_ptr, offs_m, offs_n, k, m_ok, n_ok, k_ok, sx, sw, swk,
                               LIBDEVICE, IEEE)
            acc_u = _dot_block(acc_u, x_ptr, u_ptr, offs_m, offs_n, k, m_ok, n_ok, k_ok, sx, sw, swk,
                               LIBDEVICE, IEEE)
        if HAS_B:
            acc_g += bias_g[None, :]
            acc_u += bias_u[None, :]
        tl.store(y_ptr + offs_m[:, None] * sy + offs_n[None, :], _silu_mul(acc_g, acc_u, y_ptr, LIBDEVICE),
                 mask=m_ok[:, None] & n_ok[None, :])


def _linear_block_n(N: int) -> int:
    if _ACTIVE.linear_block_n:
        return _ACTIVE.linear_block_n
    for bn in (64, 32):
        if triton.cdiv(N, bn) >= 264:               # 2 programs per SM of an H200
            return bn
    return 16


def _triton_ok(x, w) -> bool:
    return (triton is not None and x.dim() == 2 and x.shape[0] <= 64 and x.stride(-1) == 1
            and 1 in w.stride() and (x.device.type == "cuda" or _interpreting()))


def _linear_triton(x, w, b, gelu, bn: int, bk: int, warps: int = 4, stages=None):
    M, K = x.shape
    N = w.shape[0]
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    pdl = _pdl_mode(x.device)
    _linear_kernel[(triton.cdiv(N, bn),)](
        x, w, b if b is not None else w, y, M, N, K, x.stride(0), w.stride(0), w.stride(1), y.stride(0),
        BLOCK_M=max(16, triton.next_power_of_2(M)), BLOCK_N=bn, BLOCK_K=bk,
        HAS_B=b is not None, GELU=_gelu_code(gelu), LIBDEVICE=not _interpreting(),
        IEEE=x.dtype == torch.float32, PDL=pdl, num_warps=warps,
        **_prefetch_args(pdl, bn, K, w), **({"num_stages": stages} if stages else {}),
        **_pdl_launch(pdl))
    return y


def _prefetch_args(pdl: int, bn: int, k_len: int, w, budget: "int | None" = None) -> dict:
    """PF_K / LINE of the linear kernels: PDL mode 3 prefetches about `pdl_prefetch` bytes of
    each program's bn weight rows, at most its k_len columns (none for a weight read through
    its transpose, whose rows are not contiguous)."""
    line = 128 // w.element_size()
    pf = 0
    budget = _ACTIVE.pdl_prefetch if budget is None else budget
    if pdl == 3 and budget > 0 and w.stride(-1) == 1:
        pf = _prefetch_count(min(k_len, budget // (bn * w.element_size())), line)
    return {"PF_K": pf, "LINE": line}


def _linear_parts(x, w, splits: int, bn: int, bk: int, warps: int = 4, stages=None):
    """fp32 partials [splits, M, N] of x @ w.T over `splits` slices of K."""
    M, K = x.shape
    N = w.shape[0]
    chunk, splits = _even_chunks(K, splits, bk)
    parts = torch.empty(splits, M, N, dtype=torch.float32, device=x.device)
    pdl = _pdl_mode(x.device)
    _linear_part_kernel[(triton.cdiv(N, bn), splits)](
        x, w, parts, M, N, K, chunk, x.stride(0), w.stride(0), w.stride(1),
        BLOCK_M=max(16, triton.next_power_of_2(M)), BLOCK_N=bn, BLOCK_K=bk,
        LIBDEVICE=not _interpreting(), IEEE=x.dtype == torch.float32, WHILE=_interpreting(),
        PDL=pdl, num_warps=warps, **_prefetch_args(pdl, bn, chunk, w),
        **({"num_stages": stages} if stages else {}), **_pdl_launch(pdl))
    return parts


def _tma_ok(x, w) -> bool:
    """Whether the TMA linear can read w: a Hopper+ GPU (or the interpreter), a 16-bit
    K-contiguous weight with 16-byte aligned rows and base (fp32 models keep the exact
    kernels)."""
    if not (_ACTIVE.linear_tma and TensorDescriptor is not None and _triton_ok(x, w)):
        return False
    if w.dtype not in (torch.bfloat16, torch.float16) or w.stride(-1) != 1:
        return False
    if (w.stride(0) * w.element_size()) % 16 or w.data_ptr() % 16:
        return False
    return _interpreting() or torch.cuda.get_device_capability(w.device)[0] >= 9


def _linear_tma(x, w, b, gelu, splits: int, swap: int, bn: int, bk: int, warps: int = 4, stages=None,
                parts: bool = False, up: "tuple | None" = None):
    """`_linear_tma_kernel`: y = x @ w.T (+ b, GELU), or with `parts` the fp32 partials
    [splits, M, N] that the add+norm kernel sums, or with `up` = (u, bu) LLaMA's
    silu(x @ w.T + b) * (x @ u.T + bu)."""
    M, K = x.shape
    N = w.shape[0]
    chunk, splits = _even_chunks(K, splits, bk)
    if parts:
        y = torch.empty(splits, M, N, dtype=torch.float32, device=x.device)
    else:
        y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    pdl = _pdl_mode(x.device)
    bm = max(16, triton.next_power_of_2(M))
    w_desc = TensorDescriptor(w, [N, K], [w.stride(0), 1], [bn, bk])
    x_tma = (x.stride(0) * x.element_size()) % 16 == 0 and x.data_ptr() % 16 == 0
    x_desc = TensorDescriptor(x, [M, K], [x.stride(0), 1], [bm, bk]) if x_tma else w_desc
    u, bu = up if up is not None else (w, b)
    if u.stride() != w.stride():
        raise ValueError(f"gate and up weights must have the same strides, got {w.stride()} and {u.stride()}")
    u_desc = TensorDescriptor(u, [N, K], [u.stride(0), 1], [bn, bk]) if up is not None else w_desc
    _linear_tma_kernel[(triton.cdiv(N, bn), splits)](
        x, x_desc, w, w_desc, b if b is not None else w, u, u_desc, bu if bu is not None else w, y, M, N, K, chunk,
        x.stride(0), w.stride(0), y.stride(-2),
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, SWAP=bool(swap), PARTS=parts, GATED=up is not None, X_TMA=x_tma,
        HAS_B=b is not None and not parts, GELU=0 if parts else _gelu_code(gelu), LIBDEVICE=not _interpreting(),
        PDL=pdl, num_warps=warps,
        **_prefetch_args(pdl, bn, chunk, w, None if up is None else _ACTIVE.pdl_prefetch // 2),
        **({"num_stages": stages} if stages else {}), **_pdl_launch(pdl))
    return y


def _usable(cfg, tma: bool):
    """cfg, or None (cuBLAS) for a TMA config where this call's weights cannot take TMA
    (`tma`: their `_tma_ok`): a shape's choice is made on one weight and reused for every
    weight of that shape, and TMA needs 16-byte aligned ones (a view into a fused buffer may
    not be)."""
    return None if cfg is not None and cfg[0] == "tma" and not tma else cfg


def _run_linear(x, w, b, gelu, cfg):
    """A Triton linear by its candidate config: (BLOCK_N, BLOCK_K[, warps, stages]) for
    `_linear_kernel`, ("tma", 1, swap, BLOCK_N, BLOCK_K[, warps, stages]) for the TMA one."""
    if cfg[0] == "tma":
        return _linear_tma(x, w, b, gelu, *cfg[1:])
    return _linear_triton(x, w, b, gelu, *cfg)


def _run_parts(x, w, cfg):
    """fp32 split-K partials by config: (splits, BLOCK_N, BLOCK_K[, warps, stages]) or
    ("tma", splits, swap, BLOCK_N, BLOCK_K[, warps, stages])."""
    if cfg[0] == "tma":
        return _linear_tma(x, w, None, False, *cfg[1:], parts=True)
    return _linear_parts(x, w, *cfg)


def gated_ref(x, wg, bg, wu, bu):
    """HF's LlamaMLP up to down_proj with SiLU: act(gate(x)) * up(x)."""
    return F.silu(F.linear(x, wg, bg)) * F.linear(x, wu, bu)


def _gated_triton(x, wg, bg, wu, bu, bn: int, bk: int, warps: int = 4, stages=None):
    M, K = x.shape
    N = wg.shape[0]
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    pdl = _pdl_mode(x.device)
    _gated_kernel[(triton.cdiv(N, bn),)](
        x, wg, wu, bg if bg is not None else wg, bu if bu is not None else wg, y, M, N, K,
        x.stride(0), wg.stride(0), wg.stride(1), y.stride(0),
        BLOCK_M=max(16, triton.next_power_of_2(M)), BLOCK_N=bn, BLOCK_K=bk,
        HAS_B=bg is not None, LIBDEVICE=not _interpreting(), IEEE=x.dtype == torch.float32, PDL=pdl,
        num_warps=warps, **_prefetch_args(pdl, bn, K, wg, _ACTIVE.pdl_prefetch // 2),
        **({"num_stages": stages} if stages else {}), **_pdl_launch(pdl))
    return y


def linear(x, w, b=None, gelu: "bool | str" = False):
    """y = x @ w.T (+ b) (then GELU, see `linear_ref`) for 2-D x of at most 64 rows on CUDA in one
    Triton kernel (the fixed LINEAR_* rule); anything else goes to `linear_ref`."""
    if not _triton_ok(x, w):
        return linear_ref(x, w, b, gelu)
    return _linear_triton(x, w, b, gelu, _linear_block_n(w.shape[0]), _ACTIVE.linear_block_k,
                          _ACTIVE.linear_warps, _ACTIVE.linear_stages)


# ---------------------------------------------------------------------------- per-shape choice

# Triton candidates (BLOCK_N, BLOCK_K), 4 warps: the winners of benchmarks/linear_bench.py
# over bloom-560m and bloom-7b1's decode linears at batch 1, 16 and 64 (docs/DECODE.md, section 5)
_TILES = ((16, 256), (32, 128), (32, 256), (64, 128))
# a Conv1D weight [K, N] read through its transpose: contiguous along N, so wider N tiles
_TILES_T = ((32, 128), (64, 128), (128, 64), (256, 32))
_SPLITS = (1, 2, 4, 8)
_REFINE = ((4, 2), (4, 4), (4, 5), (8, 3), (8, 4))     # (warps, stages) tried on the fastest Triton config
_CHOICE: dict = {}                                      # shape key -> (name, config)


# the TMA linear's (swap, BLOCK_N, BLOCK_K, stages), 4 warps, raced where `_tma_ok`: the
# winners of `benchmarks/linear_bench.py --tma` over bloom-7b1's decode linears at batch 16
# (docs/DECODE.md, section 6)
_TILES_TMA = ((1, 64, 128, 4), (1, 64, 256, 3), (1, 128, 128, 4), (1, 64, 64, 6), (0, 32, 256, 4),
              (0, 64, 128, 4), (0, 64, 256, 3))
_REFINE_TMA = ((4, 3), (4, 4), (4, 5), (4, 6), (8, 4))


def _linear_candidates(K: int, parts: bool, transposed: bool = False, tma: bool = False,
                       weights: int = 1) -> dict:
    """name -> config of every kernel "auto" races for one shape (`weights` 2: the gated MLP's
    gate and up, whose TMA tiles need twice the shared memory)."""
    out = {"cublas": None}
    for bn, bk in _TILES_T if transposed else _TILES:
        if not parts:
            out[f"triton n{bn} k{bk}"] = (bn, bk)
            continue
        for sp in _SPLITS:
            if K >= sp * bk:
                out[f"triton split{sp} n{bn} k{bk}"] = (sp, bn, bk)
    for swap, bn, bk, st in _TILES_TMA if tma else ():
        if st * (weights * bn + 16) * bk * 2 > 220 << 10:     # the stages' tiles, 16-bit
            continue
        for sp in _SPLITS if parts else (1,):
            if K >= sp * bk:
                out[_tma_name(("tma", sp, swap, bn, bk, 4, st), parts)] = ("tma", sp, swap, bn, bk, 4, st)
    return out


def _tma_name(cfg: tuple, parts: bool) -> str:
    _, sp, swap, bn, bk, nw, ns = cfg
    return f"tma{f' split{sp}' if parts else ''}{' swap' if swap else ''} n{bn} k{bk} w{nw} st{ns}"


def _refined(name: str, cfg: tuple, parts: bool) -> dict:
    """Candidates around the race's best Triton config: other warps and pipelining stages."""
    if cfg[0] == "tma":
        return {_tma_name(cfg[:5] + r, parts): cfg[:5] + r for r in _REFINE_TMA}
    return {f"{name} w{nw} st{ns}": cfg + (nw, ns) for nw, ns in _REFINE}


def _graph_us(fn, n_calls: int) -> float:
    """Microseconds per call of fn(i) for i in 0..n_calls-1, replayed from one CUDA graph
    (eager launches of a few-microsecond kernel would time the host, not the GPU)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for i in range(2):                    # compile, cuBLAS workspace
            fn(i)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(n_calls):
            fn(i)
    graph.replay()
    best = float("inf")
    for _ in range(3):
        t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0.record()
        graph.replay()
        t1.record()
        t1.synchronize()
        best = min(best, t0.elapsed_time(t1) * 1000.0 / n_calls)
    del graph
    return best


def _weight_copies(w) -> tuple[list, int]:
    """(copies, n_calls) to time a linear on (benchmarks/attn_bench.py: the attention, on
    copies of its K/V cache): distinct copies of w cycled through, > 128 MB together, so
    that L2 (50 MB on an H200) holds none of them when it comes round again, as in a real
    step; n_calls per timed graph replay."""
    ws = w if isinstance(w, tuple) else (w,)             # the gated MLP times two weights
    nbytes = sum(t.numel() * t.element_size() for t in ws)
    n = min(16, -(-(128 << 20) // nbytes))
    clone = (lambda: tuple(t.clone() for t in ws)) if isinstance(w, tuple) else w.clone
    copies = [w] + [clone() for _ in range(n - 1)]
    return copies, max(len(copies), 4 if nbytes > (64 << 20) else 16)


def _choose(key: tuple, run, w, tma: bool = False):
    """The candidate config for this shape (None: cuBLAS): forced, cached, or timed now
    over `_linear_candidates` (run(cfg, w) makes one call with weight w). While a graph is
    being captured nothing can be timed: cuBLAS for this call, and the choice is made at
    the next uncaptured call."""
    if _ACTIVE.linear_force is not None:
        return dict(_ACTIVE.linear_force).get(key[1])
    if key in _CHOICE:
        return _CHOICE[key][1]
    w0 = w[0] if isinstance(w, tuple) else w
    parts = key[1] == "linear+norm"
    cands = _linear_candidates(w0.shape[1], parts=parts, transposed=w0.stride(-1) != 1,
                               tma=tma, weights=len(w) if isinstance(w, tuple) else 1)
    disk, disk_key = _disk_cache(w0.device), ("cuda",) + key[1:]   # any GPU index of this identity
    hit = disk.get(disk_key) if disk is not None else None
    if hit is not None and _is_candidate(hit, cands, parts):
        _CHOICE[key] = hit
        return hit[1]
    if w0.device.type != "cuda" or torch.cuda.is_current_stream_capturing():
        return None
    copies, n_calls = _weight_copies(w)
    times = {}

    def race(cands):
        for name, cfg in cands.items():
            try:
                times[name] = _graph_us(lambda i: run(cfg, copies[i % len(copies)]), n_calls)
            except Exception as exc:                   # a config this GPU cannot run
                times[name] = float("inf")
                logger.debug("decode linear candidate %s failed: %s", name, exc)
    race(cands)
    # then the fastest Triton config's warps and pipelining stages, also where cuBLAS led the
    # first round (a refined TMA config can beat it there; docs/DECODE.md, section 5)
    triton_best = min((n for n in times if n != "cublas"), key=times.get, default=None)
    if triton_best is not None and times[triton_best] < float("inf"):
        cands = dict(cands, **_refined(triton_best, cands[triton_best], key[1] == "linear+norm"))
        race({n: c for n, c in cands.items() if n not in times})
    best = min(times, key=times.get)
    if times[best] >= _ACTIVE.linear_tune_margin * times["cublas"]:
        best = "cublas"
    _CHOICE[key] = (best, cands[best])
    if disk is not None:
        disk.put(disk_key, best, cands[best])
    logger.info("decode linear %s: %s (%.1f us; cuBLAS %.1f us)", key[1:], best, times[best],
                times["cublas"])
    return cands[best]


def _is_candidate(hit: tuple, cands: dict, parts: bool) -> bool:
    """A cached (name, config) is used only if this shape's race would have offered it."""
    name, cfg = hit
    if name in cands:
        return cands[name] == cfg
    return any(_refined(n, c, parts).get(name) == cfg for n, c in cands.items() if c is not None)


_DISK: dict = {}                                       # (folder, device) -> RaceCache


def _device_identity(device) -> Optional[dict]:
    """What a race's timings depend on besides the shape key: the GPU, the libraries and
    this file's kernels. None off CUDA."""
    if device.type != "cuda" or triton is None:
        return None
    props = torch.cuda.get_device_properties(device)
    return {"gpu": props.name, "capability": f"{props.major}.{props.minor}", "sms": props.multi_processor_count,
            "torch": torch.__version__, "cuda": torch.version.cuda, "triton": triton.__version__,
            "kernels": _SOURCE_HASH}


def _disk_cache(device) -> "Optional[race_cache.RaceCache]":
    folder = race_cache.cache_folder()
    if folder is None:
        return None
    slot = (str(folder), str(device))
    if slot not in _DISK:
        identity = _device_identity(device)
        _DISK[slot] = None if identity is None else race_cache.RaceCache(folder, identity)
    return _DISK[slot]


def tuned_linear(x, w, b=None, gelu: "bool | str" = False, epilogue: bool = False):
    """`linear_ref` (or cuBLASLt's bias+tanh-GELU epilogue when `epilogue`) or a Triton
    kernel, whichever "auto" timed fastest for this shape."""
    def cublas(w_):
        if gelu and gelu != "erf" and epilogue and b is not None:
            return torch._addmm_activation(b, x, w_.t(), use_gelu=True)
        return linear_ref(x, w_, b, gelu)
    if not _triton_ok(x, w):
        return cublas(w)
    M, K = x.shape

    def run(cfg, w_):
        return cublas(w_) if cfg is None else _run_linear(x, w_, b, gelu, cfg)
    key = (str(x.device), "linear", M, w.shape[0], K, w.stride(-1) != 1, str(x.dtype), b is not None, gelu,
           *_launch_key(x.device))
    tma = _tma_ok(x, w)
    return run(_usable(_choose(key, run, w, tma), tma), w)


def linear_add_norm(a, w, b, r, nw, nb, eps: float, rms: bool, y2=None, second=None):
    """add_norm(F.linear(a, w, b), r, nw, nb, eps, rms, y2, second) -> (x, h[, h2]), the
    linear split over K into partials that the add+norm kernel sums, where "auto" timed that
    faster than cuBLAS + add+norm for this shape."""
    if not _triton_ok(a, w) or nw is None:
        return add_norm(F.linear(a, w, b), r, nw, nb, eps, rms, y2, second)
    M, K = a.shape

    def run(cfg, w_):
        if cfg is None:
            return add_norm(F.linear(a, w_, b), r, nw, nb, eps, rms, y2, second)
        return _launch_add_norm(None, r, nw, nb, eps, rms, parts=_run_parts(a, w_, cfg), lin_b=b,
                                y2=y2, second=second)
    key = (str(a.device), "linear+norm", M, w.shape[0], K, w.stride(-1) != 1, str(a.dtype), b is not None,
           bool(rms), y2 is not None, second is not None, *_launch_key(a.device))
    tma = _tma_ok(a, w)
    return run(_usable(_choose(key, run, w, tma), tma), w)


def gated_mlp(x, wg, bg, wu, bu):
    """`gated_ref` (SiLU(gate) * up): cuBLAS for each linear plus PyTorch's SiLU and product
    (four kernels), or one Triton kernel reading both weights, whichever "auto" timed
    fastest for this shape."""
    if not (_triton_ok(x, wg) and wg.shape == wu.shape and wg.stride() == wu.stride()
            and (bg is None) == (bu is None)):
        return gated_ref(x, wg, bg, wu, bu)
    M, K = x.shape

    def run(cfg, ws):
        if cfg is None:
            return gated_ref(x, ws[0], bg, ws[1], bu)
        if cfg[0] == "tma":
            return _linear_tma(x, ws[0], bg, False, *cfg[1:], up=(ws[1], bu))
        return _gated_triton(x, ws[0], bg, ws[1], bu, *cfg)
    key = (str(x.device), "gated", M, wg.shape[0], K, wg.stride(-1) != 1, str(x.dtype), bg is not None,
           *_launch_key(x.device))
    tma = _tma_ok(x, wg) and _tma_ok(x, wu)
    return run(_usable(_choose(key, run, (wg, wu), tma), tma), (wg, wu))


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

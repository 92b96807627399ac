"""The decode step's linears (a few rows times a whole weight: bound by reading the weight):
Triton GEMV kernels with bias and GELU epilogues, split-K partials summed by the add+norm
that follows, TMA tiles on Hopper, LLaMA's gated MLP in one kernel, and per shape the fastest
of them and cuBLAS, raced once and kept on disk (race_cache.py)."""
from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F

from dschat.rollout import race_cache
from dschat.rollout.kernels.launch import (
    TensorDescriptor,
    _even_chunks,
    _interpreting,
    _launch_key,
    _pdl_launch,
    _pdl_mode,
    _prefetch_count,
    triton,
)
from dschat.rollout.kernels.norm import _launch_add_norm, add_norm
from dschat.rollout.kernels.options import options
from dschat.utils.logging import get_logger

logger = get_logger(__name__)
# a kernel edit retires cached race winners: the hash of every kernel module's source
_SOURCE_HASH = hashlib.sha1(b"".join(p.read_bytes() for p in sorted(Path(__file__).parent.glob("*.py"))))\
    .hexdigest()[:16]

if triton is not None:                 # pragma: no cover - exercised on GPU machines
    import triton.language as tl
    from triton.language.extra import libdevice

    from dschat.rollout.kernels.launch import _l2_prefetch_rows, _pdl_enter


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
    if options().linear_block_n:
        return options().linear_block_n
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
    budget = options().pdl_prefetch if budget is None else budget
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
    if not (options().linear_tma and TensorDescriptor is not None and _triton_ok(x, w)):
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
        **_prefetch_args(pdl, bn, chunk, w, None if up is None else options().pdl_prefetch // 2),
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
        num_warps=warps, **_prefetch_args(pdl, bn, K, wg, options().pdl_prefetch // 2),
        **({"num_stages": stages} if stages else {}), **_pdl_launch(pdl))
    return y


def linear(x, w, b=None, gelu: "bool | str" = False):
    """y = x @ w.T (+ b) (then GELU, see `linear_ref`) for 2-D x of at most 64 rows on CUDA in one
    Triton kernel (the fixed LINEAR_* rule); anything else goes to `linear_ref`."""
    if not _triton_ok(x, w):
        return linear_ref(x, w, b, gelu)
    return _linear_triton(x, w, b, gelu, _linear_block_n(w.shape[0]), options().linear_block_k,
                          options().linear_warps, options().linear_stages)


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
    if options().linear_force is not None:
        return dict(options().linear_force).get(key[1])
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
        cands = dict(cands, **_refined(triton_best, cands[triton_best], parts))
        race({n: c for n, c in cands.items() if n not in times})
    best = min(times, key=times.get)
    if times[best] >= options().linear_tune_margin * times["cublas"]:
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

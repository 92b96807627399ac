"""Flash-decoding attention of one query token per row over the static KV cache, reading the
filled length on the device (one CUDA graph serves every step): split-K programs and a
combine kernel, the step's K/V written into the cache by the kernel itself, grouped-query
heads, tensor-core dots at head_dim >= 128, each row's left padding skipped."""
from __future__ import annotations

import torch

from dschat.rollout.kernels.launch import _even_chunks, _interpreting, _pdl_launch, _pdl_mode, _prefetch_count, triton
from dschat.rollout.kernels.options import options

if triton is not None:                 # pragma: no cover - exercised on GPU machines
    import triton.language as tl

    from dschat.rollout.kernels.launch import _l2_prefetch_rows, _pdl_enter


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
    if options().attn_splits is not None:
        return options().attn_splits
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
    return options().attn_block_n or (32 if _small_gemv(D, GP) else 128 if D <= 64 else 64)


def _warps(block_n: int, D: int, GP: int) -> int:
    if options().attn_warps:
        return options().attn_warps
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
    if D & (D - 1) and not options().attn_pad_head_dim:  # one power-of-two block spans head_dim
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
    dot = (D >= 128 if options().attn_dot is None else options().attn_dot) and (_interpreting() or (
        kv.dtype in (torch.bfloat16, torch.float16) and _tensor_core_tf32(kv.device)))
    GP = max(16, GS) if dot else GS
    bn = (options().attn_block_n or 32) if dot else _block_n(D, GP)
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
    stages = {"num_stages": options().attn_stages} if options().attn_stages else {}
    pdl = _pdl_mode(q.device)
    DP = triton.next_power_of_2(D)           # head_dim lanes of the kernels' blocks
    line = 128 // kv.element_size()          # elements per 128-byte line; a slot is 2 * D
    pf_n = 0
    if pdl == 3 and options().pdl_prefetch_attn > 0:
        pf_n = _prefetch_count(min(chunk, options().pdl_prefetch_attn // (2 * D * kv.element_size())), 1)
    skip = key_start is not None and options().attn_skip_pad
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
        PDL=pdl, PF_N=pf_n, LINE=line, PV_LOW=dot and options().attn_pv_low, SKIP_PAD=skip,
        num_warps=(options().attn_warps or 4) if dot else _warps(bn, D, GP), **stages,
        **_pdl_launch(pdl))
    if S > 1:
        _attn_combine_kernel[(B * Hkv,)](m, l, acc, out, Hkv, G=G, GP=GS, D=D, SPLITS=S, PDL=pdl, DP=DP,
                                         num_warps=4, **_pdl_launch(pdl))
    return out

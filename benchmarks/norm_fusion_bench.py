"""Why a decode linear that applies the preceding LayerNorm to its input tile as it loads it
is slow (the fused-norm experiment of docs/DECODE.md, section 8): variants of one [16, K] x
[N, K]^T GEMV kernel, timed as decode_triton's "auto" times them (graph replay over weight
copies larger than L2), with the PTX's cp.async / ld.global / bar.sync counts of each.
GPU:  PYTHONPATH=. python benchmarks/norm_fusion_bench.py
CPU check of the variants:  TRITON_INTERPRET=1 PYTHONPATH=. python benchmarks/norm_fusion_bench.py --smoke"""
import argparse
import json
import os
from pathlib import Path

import torch
import triton
import triton.language as tl

from dschat.engine import decode_triton as dt


@triton.jit
def _norm_rows(st_ptr, offs_m, m_ok, M, T, K, eps, TILE: tl.constexpr, T_PAD: tl.constexpr):
    """(mean, rstd) per row from per-tile (mean, M2) statistics [T, M, 2] (Chan's merge)."""
    offs_t = tl.arange(0, T_PAD)
    ok = (offs_t < T)[:, None] & m_ok[None, :]
    at = st_ptr + (offs_t[:, None] * M + offs_m[None, :]) * 2
    mean_t = tl.load(at, mask=ok, other=0.0)
    m2_t = tl.load(at + 1, mask=ok, other=0.0)
    cnt = tl.maximum(tl.minimum(K - offs_t * TILE, TILE), 0).to(tl.float32)[:, None]
    mean = tl.sum(cnt * mean_t, axis=0) / K
    d = mean_t - mean[None, :]
    var = tl.sum(m2_t + cnt * d * d, axis=0) / K
    return mean, tl.rsqrt(var + eps)


@triton.jit
def _k(x_ptr, w_ptr, y_ptr, st_ptr, g_ptr, nb_ptr, mr_ptr, M, N, K, T, eps,
       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, MODE: tl.constexpr,
       T_PAD: tl.constexpr, TILE: tl.constexpr):
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < M
    n_ok = offs_n < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    if MODE == 1 or MODE == 2 or MODE == 4 or MODE == 5:
        mean, rstd = _norm_rows(st_ptr, offs_m, m_ok, M, T, K, eps, TILE, T_PAD)
    else:
        mean = tl.load(mr_ptr + offs_m * 2, mask=m_ok, other=0.0)
        rstd = tl.load(mr_ptr + offs_m * 2 + 1, mask=m_ok, other=1.0)
    if MODE == 7 or MODE == 8:     # x, g, nb read one iteration ahead (loop-carried registers)
        mean, rstd = _norm_rows(st_ptr, offs_m, m_ok, M, T, K, eps, TILE, T_PAD)
        k_ok = offs_k < K
        xn = tl.load(x_ptr + offs_m[:, None] * K + offs_k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        gn = tl.load(g_ptr + offs_k, mask=k_ok, other=0.0)
        bn_ = tl.load(nb_ptr + offs_k, mask=k_ok, other=0.0)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + offs_k
            k_ok = k < K
            w = tl.load(w_ptr + offs_n[None, :] * K + k[:, None], mask=n_ok[None, :] & k_ok[:, None], other=0.0)
            xc, gc, bc = xn, gn, bn_
            k2 = k + BLOCK_K
            k2_ok = k2 < K
            xn = tl.load(x_ptr + offs_m[:, None] * K + k2[None, :], mask=m_ok[:, None] & k2_ok[None, :], other=0.0)
            gn = tl.load(g_ptr + k2, mask=k2_ok, other=0.0)
            bn_ = tl.load(nb_ptr + k2, mask=k2_ok, other=0.0)
            if MODE == 7:
                xc = ((xc.to(tl.float32) - mean[:, None]) * rstd[:, None] * gc.to(tl.float32)[None, :]
                      + bc.to(tl.float32)[None, :]).to(w.dtype)
            else:                  # RMS as HF: (x * rstd) rounded, then * g
                xc = ((xc.to(tl.float32) * rstd[:, None]).to(w.dtype).to(tl.float32)
                      * gc.to(tl.float32)[None, :]).to(w.dtype)
            acc += tl.dot(xc, w)
    for k0 in range(0, K if MODE < 7 else 0, BLOCK_K):
        k = k0 + offs_k
        k_ok = k < K
        w = tl.load(w_ptr + offs_n[None, :] * K + k[:, None], mask=n_ok[None, :] & k_ok[:, None], other=0.0)
        x = tl.load(x_ptr + offs_m[:, None] * K + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        if MODE == 1 or MODE == 3:
            g = tl.load(g_ptr + k, mask=k_ok, other=0.0).to(tl.float32)[None, :]
            nb = tl.load(nb_ptr + k, mask=k_ok, other=0.0).to(tl.float32)[None, :]
            x = ((x.to(tl.float32) - mean[:, None]) * rstd[:, None] * g + nb).to(w.dtype)
        if MODE == 4:
            x = ((x.to(tl.float32) - mean[:, None]) * rstd[:, None]).to(w.dtype)
        if MODE == 5:
            msk = m_ok[:, None] & k_ok[None, :]
            g = tl.load(g_ptr + offs_m[:, None] * 0 + k[None, :], mask=msk, other=0.0).to(tl.float32)
            nb = tl.load(nb_ptr + offs_m[:, None] * 0 + k[None, :], mask=msk, other=0.0).to(tl.float32)
            x = ((x.to(tl.float32) - mean[:, None]) * rstd[:, None] * g + nb).to(w.dtype)
        if MODE == 6:
            x = (x.to(tl.float32) * 1.0001).to(w.dtype)
        acc += tl.dot(x, w)
    tl.store(y_ptr + offs_m[:, None] * N + offs_n[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


NAMES = {0: "plain", 1: "LN on load", 2: "stats prologue, raw x", 3: "LN, no prologue",
         4: "prologue + row math only", 5: "LN, g/nb as 2-D tiles", 6: "x * const only",
         7: "LN, x/g/nb read ahead", 8: "RMS, x/g read ahead"}


def _inputs(M, N, K, dev, dtype, tile=32):
    x = torch.randn(M, K, device=dev).to(dtype)
    w = (torch.randn(N, K, device=dev) / K ** 0.5).to(dtype)
    T = K // tile
    xs = x.float().view(M, T, tile)
    st = torch.stack([xs.mean(-1), xs.var(-1, unbiased=False) * tile], -1).transpose(0, 1).contiguous()
    g, nb = torch.randn(K, device=dev).to(dtype), torch.randn(K, device=dev).to(dtype)
    mean, rstd = x.float().mean(-1), x.float().var(-1, unbiased=False).add(1e-5).rsqrt()
    mr = torch.stack([mean, rstd], -1).contiguous()
    xf, wt = x.float(), w.float().t()
    ln = (torch.nn.functional.layer_norm(xf, (K,), g.float(), nb.float(), 1e-5)).to(dtype).float()
    refs = {0: xf @ wt, 2: xf @ wt, 6: (xf * 1.0001).to(dtype).float() @ wt,
            4: ((xf - mean[:, None]) * rstd[:, None]).to(dtype).float() @ wt,
            8: ((xf * rstd[:, None]).to(dtype).float() * g.float()).to(dtype).float() @ wt}
    refs.update({m: ln @ wt for m in (1, 3, 5, 7)})
    return x, w, st, g, nb, mr, T, tile, refs


def _launch(x, w, y, st, g, nb, mr, T, tile, mode, bn, bk, nw, ns):
    M, K = x.shape
    N = w.shape[0]
    return _k[(triton.cdiv(N, bn),)](x, w, y, st, g, nb, mr, M, N, K, T, 1e-5, BLOCK_M=16, BLOCK_N=bn,
                                     BLOCK_K=bk, MODE=mode, T_PAD=triton.next_power_of_2(T), TILE=tile,
                                     num_warps=nw, num_stages=ns)


def smoke(out: Path) -> None:
    """Every variant against its PyTorch reference, small shapes (Triton's CPU interpreter)."""
    torch.manual_seed(0)
    rows = []
    for M, N, K in [(3, 64, 256), (16, 96, 512)]:
        x, w, st, g, nb, mr, T, tile, refs = _inputs(M, N, K, "cpu", torch.float32)
        for mode, name in NAMES.items():
            y = torch.empty(M, N)
            _launch(x, w, y, st, g, nb, mr, T, tile, mode, 32, 64, 4, 2)
            err = (y - refs[mode]).abs().max().item()
            rows.append(dict(shape=f"{M}x{N}x{K}", mode=name, err=err))
            print(rows[-1], flush=True)
    (out / "norm_fusion_results.json").write_text(json.dumps(rows, indent=1))


def bench(out: Path) -> None:
    torch.manual_seed(0)
    M, rows = 16, []
    print("| shape | config | " + " | ".join(NAMES.values()) + " |")
    print("|---" * (len(NAMES) + 2) + "|")
    for N, K in [(12288, 4096), (16384, 4096), (3072, 1024)]:
        x, w, st, g, nb, mr, T, tile, refs = _inputs(M, N, K, "cuda", torch.bfloat16)
        copies, n_calls = dt._weight_copies(w)
        for bn, bk, nw, ns in [(32, 128, 4, 4), (64, 128, 4, 3), (32, 256, 4, 3), (32, 128, 4, 2), (64, 128, 8, 3)]:
            cells = []
            for mode in NAMES:
                y = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
                try:
                    h = _launch(x, w, y, st, g, nb, mr, T, tile, mode, bn, bk, nw, ns)
                    err = (y.float() - refs[mode]).abs().max().item()
                    if N == 12288 and (bn, bk, nw, ns) == (32, 128, 4, 4):
                        ptx = h.asm["ptx"]
                        print(f"mode {mode}: cp.async {ptx.count('cp.async.cg') + ptx.count('cp.async.ca')}, "
                              f"ld.global {ptx.count('ld.global')}, bar.sync {ptx.count('bar.sync')}, "
                              f"regs {h.n_regs}, smem {h.metadata.shared}", flush=True)
                    us = dt._graph_us(lambda i, mode=mode, y=y: _launch(
                        x, copies[i % len(copies)], y, st, g, nb, mr, T, tile, mode, bn, bk, nw, ns), n_calls)
                    cells.append(f"{us:.1f}")
                    rows.append(dict(shape=f"{M}x{N}x{K}", config=f"n{bn} k{bk} w{nw} st{ns}",
                                     mode=NAMES[mode], us=us, err=err))
                except Exception as exc:
                    cells.append(f"err {type(exc).__name__}")
            print(f"| {M}x{N}x{K} | n{bn} k{bk} w{nw} st{ns} | " + " | ".join(cells) + " |", flush=True)
        print(f"floor at 4.2 TB/s: {N * K * 2 / 4.2e6:.1f} us")
    (out / "norm_fusion_results.json").write_text(json.dumps(rows, indent=1))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT", "."), help="folder for norm_fusion_results.json")
    ap.add_argument("--smoke", action="store_true",
                    help="check every variant against its reference on small shapes (CPU: TRITON_INTERPRET=1)")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    smoke(out) if args.smoke else bench(out)


if __name__ == "__main__":
    main()

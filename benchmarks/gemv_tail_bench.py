"""Where a decode linear loses time against the copy bandwidth: two explanations, tested.

A decode-step linear at batch 16 streams its weight once. bloom-7b1's 2 GB LM head reads it
at about 4.36 TB/s, its 100-134 MB layer linears at 3.6-3.9 (docs/DECODE.md, section 8).

1. Time against size: cuBLAS, `decode_triton`'s linear kernel and the tile-major kernel
   below at K = 4096, N 4096 to 250880. The least-squares line us = a + MB / bw gives the
   fixed cost a per call.
2. Per shape, bloom-7b1's linears: the kernels the decode step runs (row-major weight) against
   a) a work queue (QKV only here; docs/DECODE.md, section 8 has it at every shape): a persistent grid of
      P programs per SM taking units (BLOCK_N rows x `chunk` columns) from an atomic counter,
      against the straggler tail of a one-wave grid where each program owns a fixed strip.
      Partials are kept per k-chunk, so the sums do not depend on who took which unit;
   b) the weight stored tile-major, [N / BLOCK_N, K / BLOCK_K, BLOCK_N, BLOCK_K], so that each
      program streams one contiguous range instead of BLOCK_N separate runs.
Neither became the default: the queue was 3-4 us slower per call, and the tile-major layout
gained 0.4-1.6 us per layer linear.

    python benchmarks/gemv_tail_bench.py [--out DIR]
    TRITON_INTERPRET=1 python benchmarks/gemv_tail_bench.py --smoke   # tiny shapes on CPU
"""
from __future__ import annotations

import argparse
import itertools
import os

import torch

from benchmarks.attn_bench import write_sweep
from dschat.engine import decode_triton as dt

triton, tl = dt.triton, getattr(dt, "tl", None)

if triton is not None:

    @triton.jit
    def _queue_part_kernel(x_ptr, w_ptr, p_ptr, cnt_ptr, M, N, K, sx, sw, n_tiles, chunk, n_units,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                           PDL: tl.constexpr, PF_K: tl.constexpr, LINE: tl.constexpr):
        """Unit u (k-chunk u // n_tiles, column tile u % n_tiles): fp32 partial -> p[k-chunk].
        Program i takes unit i, then n_prog + the counter's next value, until none is left."""
        n_prog = tl.num_programs(0)
        u = tl.program_id(0)
        offs_m = tl.arange(0, BLOCK_M)
        offs_k = tl.arange(0, BLOCK_K)
        m_ok = offs_m < M
        if PDL == 3 and PF_K > 0:     # the first (own) unit's rows into L2 before the wait
            rows = tl.minimum((u % n_tiles) * BLOCK_N + tl.arange(0, BLOCK_N), N - 1)
            start0 = (u // n_tiles) * chunk
            dt._l2_prefetch_rows(w_ptr, rows, sw, start0, start0 + chunk, PF_K, LINE)
        dt._pdl_enter(PDL)
        while u < n_units:
            nt = u % n_tiles
            ks = u // n_tiles
            offs_n = nt * BLOCK_N + tl.arange(0, BLOCK_N)
            n_ok = offs_n < N
            start = ks * chunk
            acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            for k0 in range(start, start + chunk, BLOCK_K):
                k = k0 + offs_k
                acc = dt._dot_block(acc, x_ptr, w_ptr, offs_m, offs_n, k, m_ok, n_ok, k < K, sx, sw, 1,
                                    True, False)
            tl.store(p_ptr + (ks * M + offs_m[:, None]) * N + offs_n[None, :], acc,
                     mask=m_ok[:, None] & n_ok[None, :])
            u = n_prog + tl.atomic_add(cnt_ptr, 1)
        # the last program out resets both counters for the next launch (all claims are done)
        done = tl.atomic_add(cnt_ptr + 1, 1)
        if done == n_prog - 1:
            tl.atomic_xchg(cnt_ptr, 0)
            tl.atomic_xchg(cnt_ptr + 1, 0)

    @triton.jit
    def _blocked_part_kernel(x_ptr, wb_ptr, p_ptr, M, N, K, sx, chunk,
                             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                             PDL: tl.constexpr, PF: tl.constexpr, LINE: tl.constexpr):
        """As _linear_part_kernel, over a weight stored tile-major: wb[N // BLOCK_N, K // BLOCK_K,
        BLOCK_N, BLOCK_K], so that each program streams one contiguous range of memory."""
        t = tl.program_id(0)
        s = tl.program_id(1)
        offs_m = tl.arange(0, BLOCK_M)
        offs_k = tl.arange(0, BLOCK_K)
        offs_n = t * BLOCK_N + tl.arange(0, BLOCK_N)
        m_ok = offs_m < M
        tile = BLOCK_N * BLOCK_K
        kb0 = (s * chunk) // BLOCK_K
        base = wb_ptr + (t * (K // BLOCK_K) + kb0).to(tl.int64) * tile
        if PDL == 3 and PF > 0:       # the first PF elements of the range, as one row
            dt._l2_prefetch_rows(base, tl.zeros([1], tl.int32), 0, 0, PF, PF, LINE)
        dt._pdl_enter(PDL)
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        w_offs = tl.arange(0, BLOCK_N)[None, :] * BLOCK_K + offs_k[:, None]
        for i in range(0, chunk // BLOCK_K):
            w = tl.load(base + i * tile + w_offs)
            k = (kb0 + i) * BLOCK_K + offs_k
            x = tl.load(x_ptr + offs_m[:, None] * sx + k[None, :], mask=m_ok[:, None], other=0.0)
            acc += tl.dot(x, w)
        tl.store(p_ptr + (s * M + offs_m[:, None]) * N + offs_n[None, :], acc, mask=m_ok[:, None])


def blocked(w, bn: int, bk: int):
    """w [N, K] -> its tile-major copy [N // bn, K // bk, bn, bk]."""
    N, K = w.shape
    return w.view(N // bn, bn, K // bk, bk).permute(0, 2, 1, 3).contiguous()


def blocked_parts(x, wb, splits: int, stages=None, warps: int = 4):
    """fp32 partials [splits, M, N] of x @ w.T, w given tile-major (see `blocked`)."""
    M, K = x.shape
    nt, kb, bn, bk = wb.shape
    N = nt * bn
    assert kb * bk == K and kb % splits == 0
    chunk = K // splits
    parts = torch.empty(splits, M, N, dtype=torch.float32, device=x.device)
    pdl = dt._pdl_mode(x.device)
    line = 128 // wb.element_size()
    _blocked_part_kernel[(nt, splits)](
        x, wb, parts, M, N, K, x.stride(0), chunk, BLOCK_M=max(16, triton.next_power_of_2(M)), BLOCK_N=bn,
        BLOCK_K=bk, PDL=pdl, PF=(min(dt.options().pdl_prefetch // wb.element_size(), chunk * bn) if pdl == 3 else 0),
        LINE=line, num_warps=warps, **({"num_stages": stages} if stages else {}), **dt._pdl_launch(pdl))
    return parts


_COUNTERS = {}


def queue_parts(x, w, bn: int, chunk: int, per_sm: int, bk: int = 128, warps: int = 4, stages=None):
    """fp32 partials [K // chunk, M, N] of x @ w.T from a persistent work-queue grid."""
    M, K = x.shape
    N = w.shape[0]
    assert K % chunk == 0 and chunk % bk == 0
    splits, n_tiles = K // chunk, triton.cdiv(N, bn)
    n_units = splits * n_tiles
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count if x.is_cuda else 2
    n_prog = min(n_units, sms * per_sm)
    cnt = _COUNTERS.setdefault(x.device, torch.zeros(2, dtype=torch.int32, device=x.device))
    parts = torch.empty(splits, M, N, dtype=torch.float32, device=x.device)
    pdl = dt._pdl_mode(x.device)
    _queue_part_kernel[(n_prog,)](
        x, w, parts, cnt, M, N, K, x.stride(0), w.stride(0), n_tiles, chunk, n_units,
        BLOCK_M=max(16, triton.next_power_of_2(M)), BLOCK_N=bn, BLOCK_K=bk, PDL=pdl, num_warps=warps,
        **dt._prefetch_args(pdl, bn, chunk, w), **({"num_stages": stages} if stages else {}),
        **dt._pdl_launch(pdl))
    return parts


def timed(fn, w):
    if not w.is_cuda:                   # --smoke: Triton's CPU interpreter, one call
        import time
        t0 = time.perf_counter()
        fn(w)
        return (time.perf_counter() - t0) * 1e6
    copies, n_calls = dt._weight_copies(w)
    return dt._graph_us(lambda i: fn(copies[i % len(copies)]), n_calls)


def fit(points):
    """Least squares us = a + b * MB -> (a us, bandwidth TB/s)."""
    n = len(points)
    mx = sum(p[0] for p in points) / n
    my = sum(p[1] for p in points) / n
    b = sum((p[0] - mx) * (p[1] - my) for p in points) / sum((p[0] - mx) ** 2 for p in points)
    return my - b * mx, 1.0 / b


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--smoke", action="store_true", help="Tiny shapes on CPU (TRITON_INTERPRET=1): checks only.")
    args = ap.parse_args()
    if args.smoke:
        smoke()
    gpu = not args.smoke
    dev, dtype, M = torch.device("cuda" if gpu else "cpu"), torch.bfloat16 if gpu else torch.float32, 16
    rows = []
    K4 = 4096 if gpu else 256
    x4 = torch.randn(M, K4, device=dev, dtype=dtype)

    # 1. fixed cost per call: time against weight size
    for label in ("cublas", "triton bn64 st-", "triton bn64 st4", "blocked bn64 bk128 st4", "blocked bn32 bk256 st4"):
        pts = []
        for N in (4096, 8192, 16384, 32768, 65536, 131072, 250880) if gpu else (256, 512):
            w = (torch.randn(N, K4, device=dev) / 64).to(dtype)
            kind, *knobs = label.split()
            if kind == "cublas":
                fn = lambda w_: torch.nn.functional.linear(x4, w_)  # noqa: E731
            elif kind == "triton":
                bn, st = int(knobs[0][2:]), None if knobs[1] == "st-" else int(knobs[1][2:])
                fn = lambda w_, bn=bn, st=st: dt._linear_triton(x4, w_, None, False, bn, 128, 4, st)  # noqa: E731
            else:
                w = blocked(w, int(knobs[0][2:]), int(knobs[1][2:]))
                fn = lambda w_, st=int(knobs[2][2:]): blocked_parts(x4, w_, 1, st)  # noqa: E731
            us = timed(fn, w)
            mb = N * K4 * 2 / 1e6
            pts.append((mb, us))
            rows.append(dict(shape=f"N{N} K{K4}", rows=M, variant=label, us=us, tb_s=mb / us, err=0.0))
            del w
        a, bw = fit(pts)
        print(f"{label}: " + ", ".join(f"{mb:.0f}MB {us:.2f}us" for mb, us in pts)
              + f" -> fixed {a:.2f} us + bytes at {bw:.2f} TB/s", flush=True)

    # 2. bloom-7b1's linears: the weight as stored (row-major) against tile-major
    shapes = {"7b1 qkv": (12288, 4096), "7b1 dense": (4096, 4096), "7b1 fc1": (16384, 4096),
              "7b1 fc2": (4096, 16384), "7b1 head": (250880, 4096)} if gpu else {"tiny": (64, 8192)}
    for name, (N, K) in shapes.items():
        torch.manual_seed(0)
        x = torch.randn(M, K, device=dev, dtype=dtype)
        w = (torch.randn(N, K, device=dev) / K ** 0.5).to(dtype)
        ref = (x.float() @ w.float().t())
        mb = N * K * 2 / 1e6
        cands = [("cublas", w, lambda w_: torch.nn.functional.linear(x, w_))]
        for bn, st in itertools.product((32, 64), (None, 4)):
            cands.append((f"triton bn{bn} st{st or '-'}", w,
                          lambda w_, bn=bn, st=st: dt._linear_triton(x, w_, None, False, bn, 128, 4, st)))
            for sp in (2, 4):
                cands.append((f"static split{sp} bn{bn} st{st or '-'}", w,
                              lambda w_, bn=bn, sp=sp, st=st: dt._linear_parts(x, w_, sp, bn, 128, 4, st)))
        if name == "7b1 qkv":
            cands.append(("queue bn32 chunk4096 p4 st4", w, lambda w_: queue_parts(x, w_, 32, 4096, 4, 128, 4, 4)))
        head = name.endswith("head")
        for bn, bk in ((16, 256), (16, 512), (32, 64), (32, 128), (32, 256), (64, 64), (64, 128), (64, 256)):
            wb = blocked(w, bn, bk)
            for sp, st in itertools.product((1,) if head else (1, 2, 4, 8) if K > 4096 else (1, 2, 4),
                                            (None, 3, 4, 5, 6)):
                cands.append((f"blocked bn{bn} bk{bk} split{sp} st{st or '-'}", wb,
                              lambda w_, sp=sp, st=st: blocked_parts(x, w_, sp, st)))
        mine = []
        for label, weight, fn in cands:
            try:
                out = fn(weight).float()
                got = out.sum(0) if out.dim() == 3 else out
                err = (got - ref).abs().max().item()
                us = timed(fn, weight)
            except Exception as exc:     # a configuration Triton cannot compile
                print(f"  {label}: {type(exc).__name__}: {str(exc)[:160]}", flush=True)
                continue
            r = dict(shape=name, rows=M, variant=label, us=us, tb_s=mb / us, err=err)
            rows.append(r)
            mine.append(r)
        mine.sort(key=lambda r: r["us"])
        base = next(r for r in mine if r["variant"] == "cublas")
        for kind in ("triton", "static", "queue", "blocked"):
            best = [r for r in mine if r["variant"].startswith(kind)][:4]
            if best:
                print(f"{name} ({mb:.0f} MB; cublas {base['us']:.2f} us): {kind} best "
                      + "; ".join(f"{r['variant']} {r['us']:.2f} us ({r['tb_s']:.2f} TB/s, err {r['err']:.1e})"
                                  for r in best), flush=True)
        del w, cands
    write_sweep(args.out, "gemv_tail", "decode linears: fixed cost and work queue", "rows", "TB/s", "max abs diff",
                rows)


def smoke():
    """The queue kernel's sums against torch on tiny shapes, twice in a row (the counters
    must come back to zero), in Triton's CPU interpreter."""
    torch.manual_seed(0)
    for M, N, K, bn, chunk, per_sm in ((3, 40, 64, 16, 32, 1), (16, 96, 128, 32, 64, 2)):
        x = torch.randn(M, K)
        w = torch.randn(N, K)
        for _ in range(2):
            p = queue_parts(x, w, bn, chunk, per_sm, bk=32)
            err = (p.sum(0) - x @ w.t()).abs().max().item()
            assert err < 1e-3, err
            assert _COUNTERS[x.device].tolist() == [0, 0]
    for bn, bk, sp in ((16, 32, 1), (32, 64, 2)):
        x, w = torch.randn(5, 256), torch.randn(64, 256)
        p = blocked_parts(x, blocked(w, bn, bk), sp)
        err = (p.sum(0) - x @ w.t()).abs().max().item()
        assert err < 1e-3, err
    print("smoke ok")


if __name__ == "__main__":
    main()

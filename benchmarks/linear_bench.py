"""Decode-step linear sweep on one GPU: cuBLAS (F.linear; the bias+GELU epilogue for fc1)
against `dschat.rollout.kernels.linear` over its launch knobs, at the weight shapes of
bloom-560m and bloom-7b1 with 1, 16 and 64 rows, each call replayed from a CUDA graph as
the fast decode path runs it. Prints the best Triton variants per shape and writes a table
(microseconds, weight TB/s, max difference to cuBLAS).

    python benchmarks/linear_bench.py [--out DIR] [--smoke] [--wide | --tma] [--shapes ...]

--tma sweeps the TMA linear (docs/DECODE.md, section 6: its tiles for the per-shape race).
"""
from __future__ import annotations

import argparse
import itertools
import os

import torch

from benchmarks.attn_bench import graph_time_us, write_sweep
from dschat.rollout import kernels as dt

SHAPES = {  # name: (N, K, bias+GELU epilogue)
    "560m qkv": (3072, 1024, False), "560m dense": (1024, 1024, False),
    "560m fc1+gelu": (4096, 1024, True), "560m fc2": (1024, 4096, False), "560m head": (250880, 1024, False),
    "7b1 qkv": (12288, 4096, False), "7b1 dense": (4096, 4096, False),
    "7b1 fc1+gelu": (16384, 4096, True), "7b1 fc2": (4096, 16384, False), "7b1 head": (250880, 4096, False),
}


def cublas(x, w, b, gelu):
    if gelu and x.shape[0] > 1:
        return torch._addmm_activation(b, x, w.t(), use_gelu=True)
    return dt.linear_ref(x, w, b, gelu)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--rows", type=int, nargs="+", default=[16, 1, 64])
    ap.add_argument("--smoke", action="store_true", help="Tiny shapes on CPU (TRITON_INTERPRET=1).")
    ap.add_argument("--shapes", nargs="+", default=None, help=f"Subset of {list(SHAPES)}.")
    ap.add_argument("--wide", action="store_true",
                    help="A wider grid (BLOCK_K up to 512, 4 or 8 warps, 3-6 stages; split-K + add+norm for the "
                         "projections a norm follows), timed as the kernels' per-shape choice times "
                         "(over weight copies larger than L2).")
    ap.add_argument("--tma", action="store_true",
                    help="The TMA linear (kernels/linears.py _linear_tma: weight tiles by the tensor memory "
                         "accelerator, optionally y.T = w @ x.T for warpgroup MMAs) over a grid of tiles, "
                         "stages and splits, against cuBLAS and the pointer-load kernels \"auto\" races, "
                         "timed as --wide times.")
    args = ap.parse_args()
    if args.wide:
        return wide(args)
    if args.tma:
        return tma(args)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16
    shapes = {"tiny": (96, 64, True)} if args.smoke else SHAPES
    rows = []
    for (name, (N, K, gelu)), M in itertools.product(shapes.items(), [2] if args.smoke else args.rows):
        torch.manual_seed(0)
        x = torch.randn(M, K, device=dev, dtype=dtype)
        w = (torch.randn(N, K, device=dev) / K ** 0.5).to(dtype)
        b = None if "head" in name else (torch.randn(N, device=dev) * 0.1).to(dtype)
        ref = cublas(x, w, b, gelu).float()
        wbytes = N * K * 2
        variants = [("cublas", None)]
        # the full grid at 16 rows (the benchmarks' batch); the rule alone at other row counts
        grid = itertools.product((16, 32, 64), (64, 128, 256), (4, 8), (None, 4)) if M == 16 else []
        for bn, bk, warps, stages in ([(16, 32, 4, None)] if args.smoke else grid):
            if bn * bk > 32768:
                continue
            variants.append((f"triton bn{bn} bk{bk} w{warps} st{stages or '-'}", (bn, bk, warps, stages)))
        variants.append(("triton rule", (None, 128, 4, None)))
        for label, knobs in variants:
            try:
                opts = None
                if knobs is None:
                    def fn():
                        return cublas(x, w, b, gelu)
                else:
                    bn, bk, warps, stages = knobs
                    opts = dt.KernelOptions(linear_block_n=bn, linear_block_k=bk, linear_warps=warps,
                                            linear_stages=stages)

                    def fn():
                        return dt.linear(x, w, b, gelu)
                with dt.use_options(opts):        # in force while the graph is captured
                    err = (fn().float() - ref).abs().max().item()
                    us = graph_time_us(fn)
                rows.append(dict(shape=name, rows=M, variant=label, us=us, tb_s=wbytes / us / 1e6, err=err))
            except Exception as exc:      # a knob combination Triton cannot compile
                rows.append(dict(shape=name, rows=M, variant=label, us=float("nan"), tb_s=0.0, err=float("nan"),
                                 error=f"{type(exc).__name__}: {str(exc)[:120]}"))
        mine = [r for r in rows if r["shape"] == name and r["rows"] == M and r["us"] == r["us"]]
        base = next(r for r in mine if r["variant"] == "cublas")
        best = sorted((r for r in mine if r["variant"] != "cublas"), key=lambda r: r["us"])[:4]
        print(f"{name} M{M}: cublas {base['us']:.2f}us ({base['tb_s']:.2f} TB/s); "
              + "; ".join(f"{r['variant']} {r['us']:.2f}us" for r in best), flush=True)
    write_sweep(args.out, "linear", "decode linears", "rows", "weight TB/s", "max abs diff to cuBLAS", rows)

def shape_cases(args, dev, M: int):
    """(name, N, K, gelu, x, w, b, norm, r, nw, nb) per shape of --shapes, bf16, seeded: norm
    marks the output projections, whose residual add + LayerNorm (r, nw, nb) follows."""
    dtype = torch.bfloat16
    for name, (N, K, gelu) in SHAPES.items():
        if args.shapes and name not in args.shapes:
            continue
        torch.manual_seed(0)
        x = torch.randn(M, K, device=dev, dtype=dtype)
        w = (torch.randn(N, K, device=dev) / K ** 0.5).to(dtype)
        b = None if "head" in name else (torch.randn(N, device=dev) * 0.1).to(dtype)
        r, nw, nb = (torch.randn(*s, device=dev, dtype=dtype) for s in ((M, N), (N,), (N,)))
        yield name, N, K, gelu, x, w, b, name.endswith(("dense", "fc2")), r, nw, nb


def wide(args):
    """The decode linears' "auto" candidates and a wider grid around them, at 16 rows."""
    dev, M = torch.device("cuda"), 16
    rows = []
    for name, N, K, gelu, x, w, b, norm, r, nw, nb in shape_cases(args, dev, M):
        nbytes = N * K * 2
        copies, n_calls = dt.linears._weight_copies(w)
        if norm:
            def run(cfg, w_):
                if cfg is None:
                    return dt.add_norm(torch.nn.functional.linear(x, w_, b), r, nw, nb, 1e-5, False)
                return dt.norm._launch_add_norm(None, r, nw, nb, 1e-5, False,
                                                parts=dt.linears._linear_parts(x, w_, *cfg), lin_b=b)
            grid = [(sp, bn, bk, wa, st) for sp, bn, bk, wa, st in itertools.product(
                (1, 2, 4, 8), (16, 32, 64), (128, 256, 512), (4, 8), (None, 4)) if bn * bk <= 16384]
        else:
            def run(cfg, w_):
                if cfg is None:
                    return cublas(x, w_, b, gelu)
                return dt.linears._linear_triton(x, w_, b, gelu, *cfg)
            grid = [(bn, bk, wa, st) for bn, bk, wa, st in itertools.product(
                (16, 32, 64), (128, 256, 512), (4, 8), (None, 3, 4, 6)) if bn * bk <= 16384]
        for cfg in [None] + grid:
            try:
                us = dt.linears._graph_us(lambda i: run(cfg, copies[i % len(copies)]), n_calls)
            except Exception:                  # a configuration Triton cannot compile here
                us = float("nan")
            rows.append(dict(shape=name + (" +norm" if norm else ""), rows=M, variant=str(cfg or "cublas"),
                             us=us, tb_s=nbytes / us / 1e6 if us == us else 0.0, err=0.0))
        mine = sorted((r for r in rows if r["shape"].startswith(name) and r["us"] == r["us"]), key=lambda r: r["us"])
        base = next(r for r in mine if r["variant"] == "cublas")
        print(f"{name}: cublas {base['us']:.2f}us; best " + "; ".join(f"{r['variant']} {r['us']:.2f}us"
                                                                      for r in mine[:6]), flush=True)
    write_sweep(args.out, "linear_wide", "decode linears (wide grid, PDL mode %d)" % dt.launch._pdl_mode(dev),
                "rows", "weight TB/s", "-", rows)


def tma(args):
    """Per shape at 16 rows: cuBLAS, the best of the candidates "auto" races without TMA, and
    the TMA linear over (swap, BLOCK_N, BLOCK_K, stages[, splits]); each with its max abs
    difference to an fp32 reference relative to the reference's max."""
    dev, M = torch.device("cuda"), 16
    tma_grid = [(swap, bn, bk, st) for swap, bn, bk in ((1, 64, 64), (1, 64, 128), (1, 64, 256), (1, 128, 64),
                                                       (1, 128, 128), (1, 128, 256), (0, 32, 128), (0, 32, 256),
                                                       (0, 64, 128), (0, 64, 256))
                for st in ((4, 6) if bk <= 128 else (3, 4))]
    rows = []
    for name, N, K, gelu, x, w, b, norm, r, nw, nb in shape_cases(args, dev, M):
        copies, n_calls = dt.linears._weight_copies(w)
        if norm:
            ref = dt.add_norm_ref(dt.linear_ref(x.float(), w.float(), b.float()), r.float(), nw.float(), nb.float(),
                                  1e-5, False)[1]

            def run(cfg, w_):
                if cfg is None:
                    return dt.add_norm(torch.nn.functional.linear(x, w_, b), r, nw, nb, 1e-5, False)[1]
                return dt.norm._launch_add_norm(None, r, nw, nb, 1e-5, False,
                                                parts=dt.linears._run_parts(x, w_, cfg), lin_b=b)[1]
            grid = [("tma", sp, swap, bn, bk, 4, st) for sp in (1, 2, 4, 8) for swap, bn, bk, st in tma_grid]
        else:
            ref = dt.linear_ref(x.float(), w.float(), b.float() if b is not None else None, gelu)

            def run(cfg, w_):
                if cfg is None:
                    return cublas(x, w_, b, gelu)
                return dt.linears._run_linear(x, w_, b, gelu, cfg)
            grid = [("tma", 1, swap, bn, bk, 4, st) for swap, bn, bk, st in tma_grid]
        old = list(dt.linears._linear_candidates(K, parts=norm).values())
        for cfg in old + grid:
            kind = "cublas" if cfg is None else ("tma" if cfg[0] == "tma" else "auto")
            try:
                err = ((run(cfg, w).float() - ref).abs().max() / ref.abs().max()).item()
                us = dt.linears._graph_us(lambda i: run(cfg, copies[i % len(copies)]), n_calls)
            except Exception as exc:           # a tile that does not fit or compile here
                us, err = float("nan"), float("nan")
                print(f"  {name} {cfg}: {type(exc).__name__}: {str(exc)[:160]}", flush=True)
            rows.append(dict(shape=name + (" +norm" if norm else ""), rows=M, variant=f"{kind} {cfg or ''}",
                             us=us, tb_s=N * K * 2 / us / 1e6 if us == us else 0.0, err=err))
        mine = [r for r in rows if r["shape"].startswith(name) and r["us"] == r["us"]]

        def best(kind):
            return sorted((r for r in mine if r["variant"].startswith(kind)), key=lambda r: r["us"])
        cb, au, tm = best("cublas")[0], best("auto")[0], best("tma")
        print(f"{name}: cublas {cb['us']:.2f} us, auto's best {au['variant'][5:]} {au['us']:.2f} us; TMA best "
              + "; ".join(f"{r['variant'][4:]} {r['us']:.2f} us (err {r['err']:.1e})" for r in tm[:5])
              + f"; TMA / auto {tm[0]['us'] / min(au['us'], cb['us']):.3f}", flush=True)
    write_sweep(args.out, "linear_tma", "decode linears, TMA (PDL mode %d)" % dt.launch._pdl_mode(dev), "rows",
                "weight TB/s", "max abs diff / max |ref|", rows)


if __name__ == "__main__":
    main()

"""Decode-step linear sweep on one GPU: cuBLAS (F.linear; the bias+GELU epilogue for fc1)
against `dschat.engine.decode_triton.linear` over its launch knobs, at the weight shapes of
bloom-560m and bloom-7b1 with 1, 16 and 64 rows, each call replayed from a CUDA graph as
the fast decode path runs it. Prints the best Triton variants per shape and writes a table
(microseconds, weight TB/s, max difference to cuBLAS).

    python benchmarks/linear_bench.py [--out DIR] [--smoke]
"""
from __future__ import annotations

import argparse
import itertools
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.attn_bench import graph_time_us, write_sweep  # noqa: E402
from dschat.engine import decode_triton as dt  # noqa: E402

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
                         "projections a norm follows), timed as decode_triton's per-shape choice times "
                         "(over weight copies larger than L2).")
    args = ap.parse_args()
    if args.wide:
        return wide(args)
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
                if knobs is None:
                    def fn():
                        return cublas(x, w, b, gelu)
                else:
                    dt.LINEAR_BLOCK_N, dt.LINEAR_BLOCK_K, dt.LINEAR_WARPS, dt.LINEAR_STAGES = knobs

                    def fn():
                        return dt.linear(x, w, b, gelu)
                err = (fn().float() - ref).abs().max().item()
                us = graph_time_us(fn)
                rows.append(dict(shape=name, rows=M, variant=label, us=us, tb_s=wbytes / us / 1e6, err=err))
            except Exception as exc:      # a knob combination Triton cannot compile
                rows.append(dict(shape=name, rows=M, variant=label, us=float("nan"), tb_s=0.0, err=float("nan"),
                                 error=f"{type(exc).__name__}: {str(exc)[:120]}"))
        dt.LINEAR_BLOCK_N, dt.LINEAR_BLOCK_K, dt.LINEAR_WARPS, dt.LINEAR_STAGES = None, 128, 4, None
        mine = [r for r in rows if r["shape"] == name and r["rows"] == M and r["us"] == r["us"]]
        base = next(r for r in mine if r["variant"] == "cublas")
        best = sorted((r for r in mine if r["variant"] != "cublas"), key=lambda r: r["us"])[:4]
        print(f"{name} M{M}: cublas {base['us']:.2f}us ({base['tb_s']:.2f} TB/s); "
              + "; ".join(f"{r['variant']} {r['us']:.2f}us" for r in best), flush=True)
    write_sweep(args.out, "linear", "decode linears", "rows", "weight TB/s", "max abs diff to cuBLAS", rows)

def wide(args):
    """The decode_triton "auto" candidates and a wider grid around them, at 16 rows."""
    dev, dtype, M = torch.device("cuda"), torch.bfloat16, 16
    rows = []
    for name, (N, K, gelu) in SHAPES.items():
        if args.shapes and name not in args.shapes:
            continue
        torch.manual_seed(0)
        x = torch.randn(M, K, device=dev, dtype=dtype)
        w = (torch.randn(N, K, device=dev) / K ** 0.5).to(dtype)
        b = None if "head" in name else (torch.randn(N, device=dev) * 0.1).to(dtype)
        norm = name.endswith(("dense", "fc2"))          # a residual add + LayerNorm follows
        r, nw, nb = (torch.randn(*s, device=dev, dtype=dtype) for s in ((M, N), (N,), (N,)))
        nbytes = N * K * 2
        copies, n_calls = dt._weight_copies(w)
        if norm:
            def run(cfg, w_):
                if cfg is None:
                    return dt.add_norm(torch.nn.functional.linear(x, w_, b), r, nw, nb, 1e-5, False)
                return dt._launch_add_norm(None, r, nw, nb, 1e-5, False, parts=dt._linear_parts(x, w_, *cfg),
                                           lin_b=b)
            grid = [(sp, bn, bk, wa, st) for sp, bn, bk, wa, st in itertools.product(
                (1, 2, 4, 8), (16, 32, 64), (128, 256, 512), (4, 8), (None, 4)) if bn * bk <= 16384]
        else:
            def run(cfg, w_):
                if cfg is None:
                    return cublas(x, w_, b, gelu)
                return dt._linear_triton(x, w_, b, gelu, *cfg)
            grid = [(bn, bk, wa, st) for bn, bk, wa, st in itertools.product(
                (16, 32, 64), (128, 256, 512), (4, 8), (None, 3, 4, 6)) if bn * bk <= 16384]
        for cfg in [None] + grid:
            try:
                us = dt._graph_us(lambda i: run(cfg, copies[i % len(copies)]), n_calls)
            except Exception:                  # a configuration Triton cannot compile here
                us = float("nan")
            rows.append(dict(shape=name + (" +norm" if norm else ""), rows=M, variant=str(cfg or "cublas"),
                             us=us, tb_s=nbytes / us / 1e6 if us == us else 0.0, err=0.0))
        mine = sorted((r for r in rows if r["shape"].startswith(name) and r["us"] == r["us"]), key=lambda r: r["us"])
        base = next(r for r in mine if r["variant"] == "cublas")
        print(f"{name}: cublas {base['us']:.2f}us; best " + "; ".join(f"{r['variant']} {r['us']:.2f}us"
                                                                      for r in mine[:6]), flush=True)
    write_sweep(args.out, "linear_wide", "decode linears (wide grid, PDL mode %d)" % dt._pdl_mode(dev),
                "rows", "weight TB/s", "-", rows)


if __name__ == "__main__":
    main()

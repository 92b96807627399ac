"""Decode-attention kernel sweep on one GPU (the inner loop of dschat.rollout.decode).

Times one decode step's attention for one layer, replayed from a CUDA graph as the fast
path runs it (cycling over copies of the cache larger than L2 together, as a step over all
layers reads them), for the Triton flash-decoding kernel over its launch knobs (key splits,
keys per block, warps, pipelining stages, fused K/V write, the split programs combining
their partials themselves) and for the baddbmm path,
at the shapes of benchmarks/decode_bench.py. Prints a table with microseconds per call
and the bandwidth reached over the K/V bytes read. Also checks every variant against
the PyTorch reference (max abs difference).

    python benchmarks/attn_bench.py [--out DIR]
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
from pathlib import Path

import torch

from dschat.rollout import decode
from dschat.rollout import kernels as dt

SHAPES = {  # name: (batch, kv heads, head_dim, cache length)
    "bloom-560m B16": (16, 16, 64, 512),
    "bloom-560m B64": (64, 16, 64, 512),
    "bloom-7b1 B16": (16, 32, 128, 512),
}


def graph_time_us(fn, reps: int = 200) -> float:
    if not torch.cuda.is_available():        # --smoke on CPU (Triton's interpreter): no graphs
        import time
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e6
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(20):
            fn()
    g.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps // 20):
        g.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / reps


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--pos", type=int, nargs="+", default=[300, 450], help="Cache slot of the step (keys 0..pos).")
    ap.add_argument("--shapes", nargs="+", default=None, help=f"Subset of {list(SHAPES)}.")
    ap.add_argument("--filter", nargs="+", default=None,
                    help="Keep only variants whose label contains one of these (bmm always kept).")
    ap.add_argument("--smoke", action="store_true",
                    help="A tiny shape and a few variants on CPU (needs TRITON_INTERPRET=1); checks the script.")
    args = ap.parse_args()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.smoke:
        SHAPES.clear()
        SHAPES["tiny"] = (2, 2, 16, 64)
        args.pos = [40]
    if args.shapes:
        for name in list(SHAPES):
            if name not in args.shapes:
                del SHAPES[name]
    dtype = torch.bfloat16
    rows = []
    for (name, (B, H, D, L)), pos in itertools.product(SHAPES.items(), args.pos):
        torch.manual_seed(0)
        q = torch.randn(B, H, 1, D, device=dev, dtype=dtype)
        kv = torch.randn(B, H, L, 2, D, device=dev, dtype=dtype)
        new = torch.randn(B, H, 2, D, device=dev, dtype=dtype)
        bias = (torch.randn(B, H, L, device=dev) * 0.1).to(dtype)
        p = torch.tensor([pos], device=dev)
        scale = D ** -0.5
        kv_bytes = B * H * (pos + 1) * 2 * D * 2
        kv[:, :, pos] = new
        ref = dt.decode_attention_ref(q, kv, bias, p, scale).float()
        # copies of the cache cycled through, larger than L2 together (as the decode linears'
        # timing cycles its weights), as in a decode step over all layers
        caches = itertools.cycle(dt.linears._weight_copies(kv)[0])
        Lb = min(L, ((pos + 1 + 63) // 64) * 64)        # the bmm path's length bucket
        variants = [("bmm (bucket %d)" % Lb, dict(impl="bmm"))]
        for splits, bn, warps, stages, fused in itertools.product(
                (1, 2, 4, 8, 16), (32, 64, 128), (1, 2, 4, 8), (None,), (True,)):
            if bn * D > 8192 or bn * splits > 2 * L:
                continue
            variants.append((f"triton s{splits} bn{bn} w{warps} st{stages or '-'}{' fusedkv' if fused else ''}",
                             dict(impl="triton", splits=splits, bn=bn, warps=warps, stages=stages, fused=fused)))
        variants.append(("triton rule", dict(impl="triton", splits=None, bn=None, warps=None, stages=None,
                                             fused=True)))
        for stages in (1, 2, 4):
            variants.append((f"triton rule st{stages}", dict(impl="triton", splits=None, bn=None, warps=None,
                                                             stages=stages, fused=True)))
        for splits, bn, warps, stages in itertools.product((None, 1, 2, 4), (16, 32, 64, 128), (2, 4, 8),
                                                           (None, 2, 4, 5)):
            if bn * D > 16384 or (stages and (splits, warps) not in ((None, 4), (2, 4), (None, 8))):
                continue
            variants.append((f"triton dot s{splits or 'rule'} bn{bn} w{warps} st{stages or '-'}",
                             dict(impl="triton", splits=splits, bn=bn, warps=warps, stages=stages, fused=True,
                                  dot=True)))
        for bn, stages in itertools.product((32, 64), (None, 4)):   # p.V with p rounded to the cache dtype
            variants.append((f"triton dot pvlow srule bn{bn} w4 st{stages or '-'}",
                             dict(impl="triton", splits=None, bn=bn, warps=4, stages=stages, fused=True, dot=True,
                                  pvlow=True)))
        variants.append(("triton rule, K/V written apart", dict(impl="triton", splits=None, bn=None, warps=None,
                                                                stages=None, fused=False)))
        if args.smoke:
            variants = (variants[:2] + [v for v in variants if "rule" in v[0] and "dot" not in v[0]]
                        + [v for v in variants if "dot" in v[0]][:1] + [v for v in variants if "pvlow" in v[0]][:1])
        if args.filter:
            variants = [v for v in variants if v[0].startswith("bmm") or any(f in v[0] for f in args.filter)]
        for label, v in variants:
            try:
                opts = None
                if v["impl"] == "bmm":
                    bb = bias[:, :, None, :Lb].masked_fill(torch.arange(Lb, device=dev) > pos, -1e4)

                    def fn(bb=bb):
                        kv_i = next(caches)
                        kv_i.index_copy_(2, p, new.unsqueeze(2))
                        return decode._attend_decode(q, kv_i, Lb, bb, scale, "bmm")
                else:
                    opts = dt.KernelOptions(attn_splits=v["splits"], attn_block_n=v["bn"], attn_warps=v["warps"],
                                            attn_stages=v["stages"], attn_dot=v.get("dot", False),
                                            attn_pv_low=v.get("pvlow", False))
                    if v["fused"]:
                        def fn():
                            return dt.decode_attention(q, next(caches), bias, p, scale, new_kv=new)
                    else:
                        def fn():
                            kv_i = next(caches)
                            kv_i.index_copy_(2, p, new.unsqueeze(2))
                            return dt.decode_attention(q, kv_i, bias, p, scale)
                with dt.use_options(opts):        # in force while the graph is captured
                    err = (fn().float() - ref).abs().max().item()
                    us = graph_time_us(fn)
                rows.append(dict(shape=name, pos=pos, variant=label, us=us, tb_s=kv_bytes / us / 1e6, err=err))
            except Exception as exc:  # a knob combination Triton cannot compile
                rows.append(dict(shape=name, pos=pos, variant=label, us=float("nan"), tb_s=0.0,
                                 err=float("nan"), error=f"{type(exc).__name__}: {str(exc)[:120]}"))
        best = sorted((r for r in rows if r["shape"] == name and r["pos"] == pos and r["us"] == r["us"]),
                      key=lambda r: r["us"])[:8]
        print(f"{name} pos {pos}: " + "; ".join(f"{r['variant']} {r['us']:.2f}us" for r in best), flush=True)
        print("   bmm / rule: " + "; ".join(
            f"{r['variant']} {r['us']:.2f}us" for r in rows if r["shape"] == name and r["pos"] == pos
            and (r["variant"].startswith("bmm") or "rule" in r["variant"])), flush=True)
    write_sweep(args.out, "attn", "one layer's decode attention", "pos", "K/V TB/s", "max abs err", rows)


def write_sweep(out: str, stem: str, what: str, case: str, tb_label: str, err_label: str, rows: list) -> None:
    """`<stem>_results.md` (sorted by shape, case, time) and `<stem>_results.json` in `out`."""
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu (Triton interpreter)"
    lines = [f"{device} torch {torch.__version__}; {what}, bf16, replayed from a CUDA graph", "",
             f"| shape | {case} | variant | us/call | {tb_label} | {err_label} |", "|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: (r["shape"], r[case], r["us"] if r["us"] == r["us"] else 1e9)):
        lines.append(f"| {r['shape']} | {r[case]} | {r['variant']} | {r['us']:.2f} | {r['tb_s']:.2f} | "
                     f"{r['err']:.2e} |")
    Path(out).mkdir(parents=True, exist_ok=True)
    (Path(out) / f"{stem}_results.md").write_text("\n".join(lines) + "\n")
    (Path(out) / f"{stem}_results.json").write_text(json.dumps(rows, indent=1))

if __name__ == "__main__":
    main()

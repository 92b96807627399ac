#!/usr/bin/env python
"""The bf16 matmul rate a GPU reaches at step 3's training shapes, and the step's limit from it.

    python benchmarks/matmul_rate.py --out matmul_rate.md            # bloom-560m, 16 x (256 + 256)
    python benchmarks/matmul_rate.py --hidden 2048 --layers 24       # bloom-1b7's blocks

Each of a Bloom block's four linears (fused QKV, attention output, MLP up, MLP down) and the
output layer is timed at tokens = batch x (prompt + answer) rows, forward (X @ W^T) and both
backward products (dX = dY @ W, dW = dY^T @ X), with CUDA events over --repeats runs after a
warm-up. The rate is total FLOPs / total seconds over all of them, weighted as one training
step of the model runs them. The step's limit then counts, per the measured rate:
training (forward + backward = 3 forward matmul passes) of actor and critic, and the four
scoring forwards (actor, reference, reward, critic), with the decode's weight-read floor
(2 bytes per parameter per token step at the card's memory bandwidth, --bandwidth).
Attention's score matmuls are left out (under 10% of the FLOPs at these shapes).
"""
from __future__ import annotations

import argparse
from pathlib import Path

import torch


def linears(hidden: int, vocab: int) -> list[tuple[str, int, int]]:
    """(name, in, out) of one block's linears and the output layer."""
    return [("qkv", hidden, 3 * hidden), ("attn out", hidden, hidden), ("mlp up", hidden, 4 * hidden),
            ("mlp down", 4 * hidden, hidden), ("lm head", hidden, vocab)]


def time_ms(fn, repeats: int) -> float:
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeats


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=1024, help="Hidden size (bloom-560m: 1024).")
    p.add_argument("--layers", type=int, default=24, help="Blocks (bloom-560m: 24).")
    p.add_argument("--vocab", type=int, default=250880, help="Vocabulary (Bloom: 250880).")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--prompt", type=int, default=256)
    p.add_argument("--answer", type=int, default=256)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--bandwidth", type=float, default=3.35e12,
                   help="Memory bandwidth in bytes/s for the decode floor (H100 SXM 3.35e12, H200 4.8e12).")
    p.add_argument("--out", default=None, help="Write the table (markdown) here too.")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("matmul_rate.py times CUDA matmuls; no GPU is visible")
    dev, dt = "cuda", torch.bfloat16
    tokens = a.batch * (a.prompt + a.answer)
    rows, flops_total, ms_total = [], 0.0, 0.0
    for name, fan_in, fan_out in linears(a.hidden, a.vocab):
        x = torch.randn(tokens, fan_in, device=dev, dtype=dt)
        w = torch.randn(fan_out, fan_in, device=dev, dtype=dt)
        dy = torch.randn(tokens, fan_out, device=dev, dtype=dt)
        per = {"forward": lambda x=x, w=w: x @ w.t(), "dX": lambda dy=dy, w=w: dy @ w,
               "dW": lambda dy=dy, x=x: dy.t() @ x}
        count = 1 if name == "lm head" else a.layers
        flops = 2.0 * tokens * fan_in * fan_out
        for kind, fn in per.items():
            ms = time_ms(fn, a.repeats)
            rows.append((name, kind, tokens, fan_in, fan_out, ms, flops / ms / 1e9))
            flops_total += count * flops
            ms_total += count * ms
        del x, w, dy
    rate = flops_total / (ms_total / 1e3)
    params = a.layers * 12 * a.hidden * a.hidden + a.vocab * a.hidden
    train = 2 * 6.0 * params * tokens          # actor and critic, forward + backward
    score = 4 * 2.0 * params * tokens          # actor, reference, reward, critic forwards
    decode = a.answer * 2.0 * params / a.bandwidth
    limit = (train + score) / rate + decode
    samples = a.batch / limit
    name = torch.cuda.get_device_name(0)
    lines = [f"bf16 matmul rate at step 3's shapes, {name}, torch {torch.__version__}, hidden {a.hidden}, "
             f"{a.layers} blocks, vocab {a.vocab}, {a.batch} x ({a.prompt} + {a.answer}) = {tokens} tokens",
             "", "| linear | product | M | K | N | ms | TFLOP/s |", "|---|---|---|---|---|---|---|"]
    for n, kind, m, k, nn, ms, tf in rows:
        lines.append(f"| {n} | {kind} | {m} | {k} | {nn} | {ms:.3f} | {tf:.0f} |")
    lines += ["", f"weighted rate over a training step's linears: **{rate / 1e12:.0f} TFLOP/s**", "",
              f"limit per step (actor and critic of {params / 1e9:.3f}B parameters): training "
              f"{train:.2e} + scoring {score:.2e} FLOPs at that rate = {(train + score) / rate:.3f} s, "
              f"decode floor {a.answer} x {2 * params / 1e9:.2f} GB / {a.bandwidth / 1e12:.2f} TB/s = "
              f"{decode:.3f} s: **{limit:.3f} s, {samples:.1f} samples/s**"]
    text = "\n".join(lines)
    print(text)
    if a.out:
        Path(a.out).write_text(text + "\n")


if __name__ == "__main__":
    main()

#!/usr/bin/env python
"""How long the fast path's first call takes in a new process, cold and warm, side by side:

    python benchmarks/fast_start.py --model bloom-560m --batch 16 --prompt_len 256 --new_tokens 256

Three fresh processes in a row, each building the model and a FastGenerator and timing its
first and second generate (prompts and lengths as benchmarks/generation.py):

1. cold: empty kernel-race cache (dschat/rollout/race_cache.py) and empty Triton compile cache;
2. warm: both caches as process 1 left them (a second run on the same machine);
3. race only: Triton's compile cache warm, the race cache off (DSCHAT_KERNEL_CACHE_DIR=""):
   what the race alone costs.

"tokens as cold": whether the first call's tokens equal the cold process's (a process that
reads the winners from disk runs the kernels the cold one timed and chose).

The first call includes kernel compilation, the per-shape race of the decode linears and the
CUDA-graph capture; the second is the steady state. Both caches live in a temporary folder
(--workdir), so the machine's own caches are left alone. Prints a table, appends it to --out.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.generation import PRESETS, build_model, make_prompts
from benchmarks.tables import emit_table


def child(args) -> dict:
    from dschat.rollout.decode import FastGenerator
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    t0 = time.perf_counter()
    model = build_model(args.model, dtype, device)
    ids, mask = make_prompts(args.batch, args.prompt_len, model.config.vocab_size, device, 0)
    gen = FastGenerator(model, max_prompt_len=args.prompt_len, max_new_tokens=args.new_tokens)
    built = time.perf_counter() - t0
    calls, outs = [], []
    for _ in range(2):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        outs.append(gen.generate(ids, mask, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens,
                                 pad_token_id=0))
        if device.type == "cuda":
            torch.cuda.synchronize()
        calls.append(time.perf_counter() - t)
    tokens = outs[0].cpu().tolist()
    return {"build_s": built, "first_call_s": calls[0], "second_call_s": calls[1], "device": str(device),
            "tokens": hashlib.sha1(json.dumps(tokens).encode()).hexdigest()}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="bloom-560m", choices=sorted(PRESETS), help="Model shape (random weights).")
    p.add_argument("--batch", type=int, default=16, help="Prompts per generate.")
    p.add_argument("--prompt_len", type=int, default=256, help="Prompt tokens (left-padded, mixed lengths).")
    p.add_argument("--new_tokens", type=int, default=256, help="Generated tokens, forced.")
    p.add_argument("--workdir", default=None, help="Folder of the two caches (default: a new temporary one).")
    p.add_argument("--out", default=None, help="Append the markdown table to this file.")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print("RESULT " + json.dumps(child(args)), flush=True)
        return
    work = Path(args.workdir or tempfile.mkdtemp(prefix="dschat_fast_start_"))
    race, triton_cache = work / "race", work / "triton"
    runs = [("cold", str(race)), ("warm", str(race)), ("race only (compile cache warm)", "")]
    argv_child = [sys.executable, "-m", "benchmarks.fast_start", "--child", "--model", args.model,
                  "--batch", str(args.batch), "--prompt_len", str(args.prompt_len),
                  "--new_tokens", str(args.new_tokens)]
    rows = []
    for name, race_dir in runs:
        env = dict(os.environ, DSCHAT_KERNEL_CACHE_DIR=race_dir, TRITON_CACHE_DIR=str(triton_cache))
        proc = subprocess.run(argv_child, env=env, capture_output=True, text=True,
                              cwd=Path(__file__).resolve().parents[1])
        line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
        if proc.returncode != 0 or line is None:
            sys.exit(f"fast_start.py: the {name} process failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
        rows.append((name, json.loads(line[len("RESULT "):])))
    device = rows[0][1]["device"]
    lines = [f"fast path's first call in a new process, {args.model}, batch {args.batch}, "
             f"{args.prompt_len} + {args.new_tokens} tokens, {device}", "",
             "| process | model build s | first call s | second call s | first / second | tokens as cold |",
             "|---|---|---|---|---|---|"]
    for name, r in rows:
        lines.append(f"| {name} | {r['build_s']:.2f} | {r['first_call_s']:.2f} | {r['second_call_s']:.3f} | "
                     f"{r['first_call_s'] / r['second_call_s']:.1f} | {r['tokens'] == rows[0][1]['tokens']} |")
    table = "\n".join(lines) + "\n"
    emit_table(table, args.out)


if __name__ == "__main__":
    main()

#!/usr/bin/env python
"""Does bf16 optimizer state learn as fp32 state does? Step 1 (SFT) on a real model, three
ways in one run, the held-out loss of each:

  fp32 state           --dtype bf16 (fp32 master weights and Adam moments; the default)
  bf16 state           --dtype bf16 --optimizer_dtype bf16 (stochastic rounding)
  bf16, nearest        the same, rounded to nearest (DSCHAT_BF16_ROUNDING=nearest): what
                       bf16 state without stochastic rounding does

    python benchmarks/optimizer_dtype.py --model /tmp/smollm2-hf \\
        --data ../shared/data/hh-rlhf/harmless-base-test.jsonl.gz --steps 40

Each runs `training/step1_supervised_finetuning/main.py` under `deepspeed --num_gpus N` at
ZeRO-3 with the same seed, data and schedule (on CPU ranks where there is no GPU); the
table gives the held-out loss before and after, the last train losses and the peak memory.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from benchmarks.tables import emit_table

REPO = Path(__file__).resolve().parents[1]
VARIANTS = {"fp32 state": ([], {}),
            "bf16 state": (["--optimizer_dtype", "bf16"], {}),
            "bf16 state, round to nearest": (["--optimizer_dtype", "bf16"], {"DSCHAT_BF16_ROUNDING": "nearest"})}


def run(name, extra, env_extra, args, out: Path) -> dict:
    folder = out / name.replace(" ", "_").replace(",", "")
    cmd = ["deepspeed", "--num_gpus", str(args.num_gpus), "--master_port", str(args.port),
           str(REPO / "training/step1_supervised_finetuning/main.py"),
           "--model_name_or_path", args.model, "--data_path", args.data, "--data_split", "10,0,0",
           "--data_output_path", str(out / "data_cache"), "--output_dir", str(folder),
           "--dtype", "bf16", "--zero_stage", "3", "--max_seq_len", str(args.max_seq_len),
           "--per_device_train_batch_size", str(args.batch), "--per_device_eval_batch_size", str(args.batch),
           "--max_steps", str(args.steps), "--eval_iters", str(args.eval_iters), "--learning_rate", str(args.lr),
           "--num_warmup_steps", "0", "--lr_scheduler_type", "constant", "--seed", str(args.seed), *extra]
    env = {**os.environ, **env_extra, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "WANDB_MODE": "offline",
           "TOKENIZERS_PARALLELISM": "false"}
    log = folder.with_suffix(".log")
    folder.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as f:
        rc = subprocess.run(cmd, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT).returncode
    if rc != 0:
        raise SystemExit(f"{name} failed ({rc}); see {log}")
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines() if line.strip()]
    evals = [r["eval/loss"] for r in rows if "eval/loss" in r]
    train = [r["train/loss"] for r in rows if "train/loss" in r]
    return {"eval_before": evals[0], "eval_after": evals[-1], "train_first": train[0],
            "train_last5": sum(train[-5:]) / len(train[-5:]),
            "peak_gib": max(r.get("memory/peak_gib", 0.0) for r in rows),
            "step_s": sum(r["time/step_s"] for r in rows if "time/step_s" in r) / max(len(train), 1)}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="A causal-LM folder (a real pretrained model).")
    p.add_argument("--data", required=True, help="Step 1 data (e.g. HH-RLHF pairs: the chosen answers).")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--lr", type=float, default=1e-5, help="Constant learning rate (DS-Chat's SFT: 9.65e-6).")
    p.add_argument("--batch", type=int, default=4, help="Per-rank micro-batch.")
    p.add_argument("--max_seq_len", type=int, default=256)
    p.add_argument("--eval_iters", type=int, default=8, help="Held-out batches per rank.")
    p.add_argument("--num_gpus", type=int, default=2, help="Ranks (CPU processes where there is no GPU).")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--port", type=int, default=29637)
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument("--workdir", default="/tmp/dschat_optimizer_dtype")
    p.add_argument("--out", default=None, help="Append the markdown table here.")
    args = p.parse_args(argv)
    results = {}
    for name in args.variants:
        extra, env_extra = VARIANTS[name]
        results[name] = run(name, extra, env_extra, args, Path(args.workdir))
        print(name, json.dumps(results[name]), flush=True)
    base = results.get("fp32 state")
    lines = [f"step 1 on {args.model}, {args.steps} steps of {args.num_gpus} x {args.batch} x {args.max_seq_len} "
             f"tokens, lr {args.lr:g} constant, ZeRO-3, bf16, seed {args.seed}", "",
             "| optimizer state | held-out loss before | after | drop | drop / fp32's | train loss, last 5 | "
             "peak GiB | step s |", "|---|---|---|---|---|---|---|---|"]
    for name, r in results.items():
        drop = r["eval_before"] - r["eval_after"]
        rel = f"{drop / (base['eval_before'] - base['eval_after']):.2f}" if base else "-"
        lines.append(f"| {name} | {r['eval_before']:.4f} | {r['eval_after']:.4f} | {drop:.4f} | {rel} | "
                     f"{r['train_last5']:.4f} | {r['peak_gib']:.2f} | {r['step_s']:.2f} |")
    table = "\n".join(lines) + "\n"
    emit_table(table, args.out)


if __name__ == "__main__":
    sys.exit(main())

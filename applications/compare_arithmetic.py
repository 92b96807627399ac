#!/usr/bin/env python
"""Held-out exact match of step-3 runs on the arithmetic task, one row per run and a
"mean ± sd" row per group of seeds, against the model they started from.

    python applications/compare_arithmetic.py out/arith/grpo-seed1 out/arith/grpo-seed2 \
        --start out/arith/sft/eval_heldout.json --out out/arith/table.md --plot out/arith/curves.png

Each run folder holds `arithmetic_eval.json` (`python -m dschat.tasks.arithmetic eval
--summary`) and step 3's `metrics.jsonl`. Runs whose names agree once a trailing "-seedN"
is removed form a group (applications/compare_runs.py's rule). Columns: held-out exact
match after, its gain over --start in points, the share of answers with a "####" number,
the training reward (exact match of the sampled answers) over the first and the last
tenth of the steps, samples/s and the actor's peak memory.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from applications.compare_runs import group_name, grouped_table
from dschat.utils.metrics import read_metrics


def run_row(folder: Path, start: float | None) -> dict:
    summary = json.loads((folder / "arithmetic_eval.json").read_text())
    records = read_metrics(folder / "metrics.jsonl") if (folder / "metrics.jsonl").is_file() else []
    rewards = [r["ppo/reward_mean"] for r in records if isinstance(r.get("ppo/reward_mean"), (int, float))]
    tenth = max(1, len(rewards) // 10)
    speed = [r["ppo/samples_per_s"] for r in records[1:] if isinstance(r.get("ppo/samples_per_s"), (int, float))]
    memory = [r["memory/peak_gib"] for r in records if isinstance(r.get("memory/peak_gib"), (int, float))]
    return {"accuracy": 100 * summary["accuracy"],
            "gain": None if start is None else 100 * (summary["accuracy"] - start),
            "answered": summary.get("answered"),
            "reward_first": statistics.mean(rewards[:tenth]) if rewards else None,
            "reward_last": statistics.mean(rewards[-tenth:]) if rewards else None,
            "steps": len(records),
            "samples_per_s": statistics.median(speed) if speed else None,
            "peak_gib": max(memory) if memory else None}


COLUMNS = (("held-out exact match %", "accuracy", ".1f"), ("gain (points)", "gain", "+.1f"),
           ("answered", "answered", ".3f"), ("train reward, first 10%", "reward_first", ".3f"),
           ("train reward, last 10%", "reward_last", ".3f"), ("steps", "steps", "d"),
           ("samples/s", "samples_per_s", ".1f"), ("peak GiB", "peak_gib", ".1f"))


def table(rows: dict[str, dict], start: float | None) -> str:
    head = [] if start is None else [f"| start (before step 3) | {100 * start:.1f} |" + " |" * (len(COLUMNS) - 1)]
    return grouped_table(rows, COLUMNS, head)


def plot(folders: list[Path], out: str) -> None:
    """Training reward (exact match of the sampled answers) per step, one line per run,
    coloured by group."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = sorted({group_name(f.name) for f in folders})
    colours = {g: plt.cm.tab10(i % 10) for i, g in enumerate(groups)}
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    seen = set()
    for folder in folders:
        path = folder / "metrics.jsonl"
        if not path.is_file():
            continue
        records = read_metrics(path)
        group = group_name(folder.name)
        label = None if group in seen else group
        seen.add(group)
        for ax, key in zip(axes, ("ppo/reward_mean", "gen/answer_len_mean")):
            points = [(r["step"], r[key]) for r in records if isinstance(r.get(key), (int, float))]
            if points:
                ax.plot(*zip(*points), color=colours[group], label=label, linewidth=1.0, alpha=0.8)
    for ax, title in zip(axes, ("exact match of the sampled answers", "answer tokens")):
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step")
        ax.grid(True, alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+", help="step-3 output folders, each with arithmetic_eval.json")
    p.add_argument("--start", default=None,
                   help="the starting model's eval --summary on the same held-out file (for the gain column)")
    p.add_argument("--out", default=None, help="also write the table to this file")
    p.add_argument("--plot", default=None, help="also draw the training curves into this PNG")
    args = p.parse_args(argv)
    start = None
    if args.start:
        start = json.loads(Path(args.start).read_text())["accuracy"]
    rows, missing = {}, []
    for folder in map(Path, args.runs):
        if (folder / "arithmetic_eval.json").is_file():
            rows[folder.name] = run_row(folder, start)
        else:
            missing.append(folder.name)
    if missing:
        print(f"skipped (no arithmetic_eval.json yet): {', '.join(missing)}", file=sys.stderr)
    if not rows:
        print("error: no run has an arithmetic_eval.json", file=sys.stderr)
        return 2
    text = table(rows, start)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    if args.plot:
        plot([Path(f) for f in args.runs], args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())

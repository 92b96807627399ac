#!/usr/bin/env python
"""One markdown table of several e2e_rlhf.py runs (their report.json), with the mean and
standard deviation over runs that differ only by seed.

    python applications/compare_runs.py out/real/seed1234 out/real/seed1235 out/real/kl0.05-seed1234

A run's name is its folder's name; runs whose names agree once a trailing "-seedN" (or a
folder named "seedN") is removed form a group, and each group with several runs gets a
"mean ± sd" row. Columns are the held-out measures of a run with a judge reward model.
"""
from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from pathlib import Path

COLUMNS = (  # (header, report path, format)
    ("policy RM acc", ("reward_model_eval_accuracy", "after"), ".3f"),
    ("judge RM acc", ("judge_eval_accuracy", "after"), ".3f"),
    ("SFT judge reward", ("heldout_reward", "baseline_judge_mean"), "+.3f"),
    ("PPO judge reward", ("heldout_reward", "finetune_judge_mean"), "+.3f"),
    ("judge gain (SFT sd)", ("heldout_reward", "judge_gain_in_baseline_std"), "+.2f"),
    ("judge win rate", ("heldout_reward", "judge_win_rate"), ".3f"),
    ("policy-RM gain", ("heldout_reward", "reward_gain"), "+.3f"),
    ("KL/answer", ("heldout_reward", "kl_per_answer"), ".2f"),
    ("ended SFT", ("heldout_reward", "baseline_ended_share"), ".3f"),
    ("ended PPO", ("heldout_reward", "finetune_ended_share"), ".3f"),
    ("distinct-2 SFT", ("heldout_reward", "baseline_distinct_2"), ".3f"),
    ("distinct-2 PPO", ("heldout_reward", "finetune_distinct_2"), ".3f"),
    ("tokens SFT", ("heldout_reward", "baseline_answer_tokens_mean"), ".1f"),
    ("tokens PPO", ("heldout_reward", "finetune_answer_tokens_mean"), ".1f"),
)


def value(report: dict, path: tuple[str, str]):
    section = report.get(path[0]) or {}
    v = section.get(path[1])
    return v if isinstance(v, (int, float)) else None


def group_name(run: str) -> str:
    return re.sub(r"(^|[-_/])seed\d+$", "", run)


def grouped_table(values: dict[str, dict], columns, head_rows=()) -> str:
    """A markdown table of runs: `values[run][key]` (None: "n/a") under `columns`, a list of
    (header, key, format); after each group of runs that differ only by seed (`group_name`)
    a "mean ± sd" row (format "d" is shown as ".1f" there). `head_rows`: lines put first."""
    lines = ["| run | " + " | ".join(h for h, _, _ in columns) + " |", "|---" * (len(columns) + 1) + "|",
             *head_rows]
    groups: dict[str, list[str]] = {}
    for name in values:
        groups.setdefault(group_name(name), []).append(name)
    for group, names in groups.items():
        for name in names:
            cells = ["n/a" if (v := values[name][k]) is None else format(v, f) for _, k, f in columns]
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
        if len(names) > 1:
            cells = []
            for _, k, f in columns:
                xs = [v for n in names if (v := values[n][k]) is not None]
                f = ".1f" if f == "d" else f
                cells.append("n/a" if not xs else format(statistics.mean(xs), f) + " ± "
                             + format(statistics.stdev(xs) if len(xs) > 1 else 0.0, f.lstrip("+")))
            lines.append(f"| **{group or 'all'}: mean ± sd of {len(names)}** | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def table(runs: dict[str, dict]) -> str:
    """The held-out measures of e2e reports (`runs[name]` = report.json), grouped by seed."""
    values = {name: {p: value(report, p) for _, p, _ in COLUMNS} for name, report in runs.items()}
    return grouped_table(values, COLUMNS)


CURVES = (("ppo/reward_mean", "policy-RM reward of the rollouts"),
          ("ppo/kl_per_answer", "KL to the reference per answer"),
          ("gen/answer_len_mean", "answer tokens"))


def plot(folders: list[Path], out: str) -> None:
    """Step 3's training curves of every run (RUN/step3/metrics.jsonl), one panel per measure."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from dschat.utils.metrics import read_metrics

    fig, axes = plt.subplots(1, len(CURVES), figsize=(5 * len(CURVES), 3.8))
    for folder in folders:
        candidates = (folder / "step3" / "metrics.jsonl", folder / "step3.metrics.jsonl")
        path = next((p for p in candidates if p.is_file()), None)
        if path is None:
            continue
        records = read_metrics(path)
        for ax, (key, _) in zip(axes, CURVES):
            points = [(r["step"], r[key]) for r in records if isinstance(r.get(key), (int, float))]
            if points:
                ax.plot(*zip(*points), label=folder.name, linewidth=1.2)
    for ax, (_, title) in zip(axes, CURVES):
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("PPO step")
        ax.grid(True, alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+", help="e2e_rlhf.py output folders (each with report.json).")
    p.add_argument("--out", default=None, help="Also write the table to this file.")
    p.add_argument("--plot", default=None, help="Also draw step 3's curves of every run into this PNG.")
    args = p.parse_args(argv)
    runs = {}
    for folder in args.runs:
        path = Path(folder) / "report.json"
        if not path.is_file():
            print(f"error: {path}: no such file (did that run finish its report?)", file=sys.stderr)
            return 2
        runs[Path(folder).name] = json.loads(path.read_text())
    text = table(runs)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    if args.plot:
        plot([Path(f) for f in args.runs], args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())

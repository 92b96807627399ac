"""Plot the metrics.jsonl files a run wrote (see dschat.utils.metrics.MetricsLogger).

    python -m dschat.plot RUN_DIR [--out DIR]

RUN_DIR is an output directory (every metrics.jsonl under it is a run) or one
metrics.jsonl file. One PNG per metric group (losses, reward, KL, answer length,
throughput); in each, one row of subplots per run and one column per metric, x = step.
Groups with no data are skipped. PNG paths are printed, one per line.
"""
import argparse
import math
import re
import sys
from pathlib import Path
from typing import Callable, Dict, List, Sequence, Tuple

from dschat.utils.errors import UserInputError
from dschat.utils.metrics import METRICS_FILE, read_metrics

_KL = re.compile(r"(^|[/_])kl([/_]|$)")
_LENGTH = re.compile(r"(len|length)($|_)")


def _last(key: str) -> str:
    return key.rsplit("/", 1)[-1]


# (file stem, title, which keys belong); a key may fall in several groups.
GROUPS: List[Tuple[str, str, Callable[[str], bool]]] = [
    ("losses", "Losses", lambda k: k.endswith("loss")),
    ("reward", "Reward", lambda k: k.startswith("ppo/reward") or _last(k).startswith("reward")),
    ("kl", "KL", lambda k: bool(_KL.search(k))),
    ("answer_length", "Answer length", lambda k: bool(_LENGTH.search(_last(k)))),
    ("throughput", "Throughput and timings", lambda k: "per_s" in k or k.startswith("time/")),
    ("evaluation", "Evaluation", lambda k: k.startswith("eval/") and not k.endswith("loss")),
    ("memory", "Memory and gathers", lambda k: k.startswith(("memory/", "gather/", "zero/"))),
]
MAX_COLS = 3  # a single run's panels wrap into rows of this many

Series = Dict[str, Tuple[List[float], List[float]]]  # key -> (steps, values)


def find_metrics_files(run_dir: Path) -> List[Path]:
    """``run_dir`` itself if it is a metrics file, else every metrics.jsonl under it, sorted."""
    if run_dir.is_file():
        return [run_dir]
    if not run_dir.is_dir():
        raise UserInputError(f"RUN_DIR {run_dir} does not exist")
    files = sorted(run_dir.rglob(METRICS_FILE))
    if not files:
        raise UserInputError(f"no {METRICS_FILE} found under RUN_DIR {run_dir} "
                             "(runs write it through dschat.utils.metrics.MetricsLogger)")
    return files


def load_series(path: Path) -> Series:
    """Numeric metrics of one metrics.jsonl as key -> (steps, values), in file order."""
    series: Series = {}
    for record in read_metrics(path):
        step = record.get("step")
        if not isinstance(step, (int, float)):
            continue
        for key, value in record.items():
            if key in ("step", "time") or isinstance(value, bool):
                continue
            if isinstance(value, (int, float)) or value is None:
                steps, values = series.setdefault(key, ([], []))
                steps.append(step)
                values.append(math.nan if value is None else float(value))
    return series


def run_label(path: Path, run_dir: Path) -> str:
    """A short name for the run that wrote ``path``: its folder relative to RUN_DIR."""
    if run_dir.is_file():
        return path.parent.name or str(path)
    rel = path.parent.relative_to(run_dir)
    return run_dir.resolve().name if str(rel) == "." else str(rel)


def plot_group(title: str, keys: Sequence[str], runs: Dict[str, Series], out_path: Path) -> None:
    """One figure: a row per run, a column per key; y axes shared down each column."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    single = len(runs) == 1
    if single:  # one run: wrap the panels into a grid instead of one long strip
        ncols = min(MAX_COLS, len(keys))
        nrows = -(-len(keys) // ncols)
    else:
        nrows, ncols = len(runs), len(keys)
    fig, axes = plt.subplots(nrows, ncols, figsize=(4.2 * ncols, 3.0 * nrows + 0.6),
                             squeeze=False, sharex="col", sharey=False if single else "col")
    for ax in axes.flat[len(keys):] if single else ():
        ax.set_visible(False)
    for run_i, (label, series) in enumerate(runs.items()):
        for key_i, key in enumerate(keys):
            row, col = divmod(key_i, ncols) if single else (run_i, key_i)
            ax = axes[row][col]
            steps, values = series.get(key, ([], []))
            if steps:
                ax.plot(steps, values, marker="." if len(steps) <= 50 else None, linewidth=1.2,
                        alpha=0.45 if len(steps) > 30 else 1.0)
                if len(steps) > 30:  # noisy per-step series: add a moving average
                    window = max(2, len(steps) // 15)
                    smooth = [sum(values[max(0, i - window + 1):i + 1]) / len(values[max(0, i - window + 1):i + 1])
                              for i in range(len(values))]
                    ax.plot(steps, smooth, linewidth=1.8, label=f"mean of {window}")
                    ax.legend(fontsize=7)
            else:
                ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes,
                        color="grey")
            ax.set_title(key if single else f"{label}: {key}", fontsize=9)
            ax.grid(True, alpha=0.3)
            if row == nrows - 1 or single:
                ax.set_xlabel("step")
    fig.suptitle(f"{title} ({next(iter(runs))})" if single else title)
    fig.tight_layout()
    fig.savefig(out_path, dpi=100)
    plt.close(fig)


def plot_runs(run_dir, out_dir=None) -> List[Path]:
    """Write one PNG per non-empty metric group for the runs under ``run_dir``; return paths."""
    run_dir = Path(run_dir)
    files = find_metrics_files(run_dir)
    runs = {run_label(f, run_dir): load_series(f) for f in files}
    default_out = (run_dir.parent if run_dir.is_file() else run_dir) / "plots"
    out_dir = Path(out_dir) if out_dir else default_out
    out_dir.mkdir(parents=True, exist_ok=True)
    all_keys = sorted({k for series in runs.values() for k in series})
    written = []
    for stem, title, belongs in GROUPS:
        keys = [k for k in all_keys if belongs(k)]
        if not keys:
            continue
        out_path = out_dir / f"{stem}.png"
        plot_group(title, keys, runs, out_path)
        written.append(out_path)
    return written


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m dschat.plot",
        description="Plot the metrics.jsonl of one or more runs into PNGs: losses (keys "
                    "ending in 'loss'), reward (ppo/reward*), KL (keys with a 'kl' part), "
                    "answer length (keys ending in len/length), throughput (keys with "
                    "'per_s' or under time/), evaluation (eval/*), memory and gathers. One figure "
                    "per group, one row of subplots per run (a single run's panels wrap in rows "
                    "of 3); series longer than 30 points get a moving average; groups without "
                    "data are skipped. Prints the PNG paths.")
    parser.add_argument("run_dir", metavar="RUN_DIR",
                        help="a run's output directory (every metrics.jsonl below it is "
                             "plotted as a separate run) or a metrics.jsonl file")
    parser.add_argument("--out", metavar="DIR", default=None,
                        help="where to write the PNGs (default: RUN_DIR/plots)")
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        paths = plot_runs(args.run_dir, args.out)
    except UserInputError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if not paths:
        print(f"no plottable metrics in {args.run_dir} (no loss/reward/kl/length/throughput keys)",
              file=sys.stderr)
    for path in paths:
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())

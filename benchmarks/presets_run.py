#!/usr/bin/env python
"""Every preset of configs/presets through steps 1-3, a few optimizer / PPO steps each, on
the deployment row this machine has: what each step needs (peak memory) and how fast it
runs, beside the preset's own estimate. Random weights at each preset's shape
(`--random-init`), the bundled data, no report.

    python benchmarks/presets_run.py --deployment-type single_gpu --steps 5 --out benchmarks/presets.md
    python benchmarks/presets_run.py --presets demo --deployment-type cpu --steps 2     # CPU smoke

Each preset runs `applications/e2e_rlhf.py --actor-model P --random-init --step 1 2 3
--stepN-args='--max_steps S'` into <workdir>/<P>, smallest model first (a run cut short
keeps the most rows); a preset that fails gets its error line and log folder in the table,
the tail of its failing step's log on stdout, and the next one runs. The saved weights of
a finished preset are deleted (--keep-models keeps them): three 7B presets write ~90 GB.

--reuse keeps what an earlier run left in --workdir: a step already complete there (its saved
model) is not rerun, and the models stay, so a preset too slow for one sitting runs in two
(a run stopped in step 3 keeps steps 1 and 2; the second run starts at step 3):

    python benchmarks/presets_run.py --presets llama-2-7b --steps 2 --reuse     # twice
"""
import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.tables import emit_table

REPO = Path(__file__).resolve().parents[1]
PRESETS = REPO / "configs" / "presets"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--presets", nargs="+", default=None,
                   help="Preset names (default: every preset with a row for --deployment-type).")
    p.add_argument("--deployment-type", default="single_gpu", help="The presets' deployment row to run.")
    p.add_argument("--steps", type=int, default=5,
                   help="Optimizer steps of steps 1 and 2, PPO rounds of step 3.")
    p.add_argument("--data-path", default="dschat/synthetic-assistant", help="Data of all three steps.")
    p.add_argument("--timeout", type=int, default=1800, help="Seconds per preset (all three steps).")
    p.add_argument("--workdir", default="/tmp/dschat_presets", help="One output folder per preset.")
    p.add_argument("--out", default=None, help="Append the table (markdown) to this file.")
    p.add_argument("--keep-models", action="store_true",
                   help="Keep each preset's saved model folders (default: deleted once its row is read).")
    p.add_argument("--reuse", action="store_true",
                   help="Skip the steps an earlier run completed in --workdir (their rows come from its metrics) "
                        "and keep the saved models for the next run (implies --keep-models).")
    return p.parse_args(argv)


def presets_with_row(row: str) -> list[str]:
    """Presets with a `row` deployment that can be built here, smallest model first."""
    found = []
    for f in sorted(PRESETS.glob("*.json")):
        preset = json.loads(f.read_text())
        if row in preset.get("deployments", {}) and ("config" in preset or preset["name"] == "demo"):
            found.append((preset.get("params_billion", 0.0), preset["name"]))
    return [name for _, name in sorted(found)]


def failing_log_tail(out: Path, lines: int = 40) -> str:
    """The last `lines` lines of the last step log the preset wrote (the failing step's)."""
    logs = sorted((out / "logs").glob("step*.log"))
    if not logs:
        return ""
    return "\n".join(logs[-1].read_text(errors="replace").splitlines()[-lines:])


def drop_saved_models(out: Path) -> None:
    """Delete the step folders' model weights and checkpoints (the metrics and logs stay)."""
    for step in ("step1", "step2", "step3"):
        for sub in (out / step).glob("**/*"):
            if sub.is_file() and sub.suffix in (".safetensors", ".bin", ".pt"):
                sub.unlink()


def step_summary(folder: Path, warmup: int = 1) -> dict:
    """Steps done, mean seconds per step after the first `warmup`, and the peak memory the
    step's metrics report (GiB; GPU on GPUs, host on CPU)."""
    path = folder / "metrics.jsonl"
    if not path.exists():
        return {}
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    rows = [r for r in rows if "time/step_s" in r]
    if not rows:
        return {}
    steady = rows[warmup:] or rows
    return {"steps": len(rows), "step_s": sum(r["time/step_s"] for r in steady) / len(steady),
            "peak_gib": max(r.get("memory/peak_gib", float("nan")) for r in rows),
            "samples_per_s": (sum(r["ppo/samples_per_s"] for r in steady) / len(steady)
                              if "ppo/samples_per_s" in steady[0] else None)}


def run_preset(name: str, args) -> dict:
    out = Path(args.workdir) / name
    preset = json.loads((PRESETS / f"{name}.json").read_text())
    row = preset["deployments"][args.deployment_type]
    # step 3's --max_steps counts generation batches; a PPO round trains after
    # --generation_batches of them, so S rounds are S x that many batches
    rounds = args.steps * int(row.get("step3", {}).get("generation_batches", 1))
    step_args = f"--max_steps {args.steps}"
    cmd = [sys.executable, str(REPO / "applications" / "e2e_rlhf.py"), "--actor-model", name,
           "--deployment-type", args.deployment_type, "--output-dir", str(out), "--data-path", args.data_path,
           "--step", "1", "2", "3", "--no-report", *([] if args.reuse else ["--force"]),
           f"--step1-args={step_args}", f"--step2-args={step_args}", f"--step3-args=--max_steps {rounds}"]
    if name != "demo":
        cmd.append("--random-init")
    t0 = time.time()
    # its own process group: a timeout stops the launcher's rank processes too, not only
    # e2e_rlhf.py (else they hold the GPU through the next preset)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=args.timeout)
        rc, tail = proc.returncode, (stderr or stdout).strip().splitlines()[-1:] or [""]
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        rc, tail = -1, [f"timed out after {args.timeout} s"]
    if rc != 0:
        print(f"--- {name} failed; end of its last step log:\n{failing_log_tail(out)}", flush=True)
    summary = {s: step_summary(out / f"step{s}") for s in (1, 2, 3)}
    if not (args.keep_models or args.reuse):
        drop_saved_models(out)
    return {"preset": name, "rc": rc, "error": "" if rc == 0 else tail[0][:200], "wall_s": time.time() - t0,
            "estimate_gb": row.get("estimate_gb", {}),
            "zero": (row.get("actor_zero_stage"), row.get("reward_zero_stage")),
            "steps": summary, "logs": str(out / "logs")}


def table(results: list[dict], args) -> str:
    lines = [f"every preset, deployment {args.deployment_type}, {args.steps} steps of each of steps 1-3, random "
             f"weights at the preset's shape, data {args.data_path}; s/step (steps 1-2: an optimizer "
             "step; step 3: a PPO round of --generation_batches rollouts and their training) is the mean "
             "after the first", "",
             "| preset | ZeRO actor/reward | step 1 s/step | step 1 peak GiB (est. GB) | step 2 s/step "
             "| step 2 peak GiB (est. GB) | step 3 s/round | step 3 samples/s | step 3 peak GiB (est. GB) | result |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        cells = []
        for s in (1, 2, 3):
            got, est = r["steps"].get(s) or {}, r["estimate_gb"].get(f"step{s}")
            est_txt = f" ({est})" if est is not None else ""
            cells.append(f"{got['step_s']:.2f}" if got else "-")
            if s == 3:
                cells.append(f"{got['samples_per_s']:.2f}" if got and got.get("samples_per_s") else "-")
            cells.append((f"{got['peak_gib']:.1f}" if got else "-") + est_txt)
        result = "ok" if r["rc"] == 0 else f"failed: {r['error']} (logs: {r['logs']})"
        lines.append(f"| {r['preset']} | {r['zero'][0]}/{r['zero'][1]} | " + " | ".join(cells) + f" | {result} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    args = parse_args(argv)
    names = args.presets or presets_with_row(args.deployment_type)
    results = []
    for name in names:
        r = run_preset(name, args)
        print(json.dumps(r), flush=True)
        results.append(r)
    text = table(results, args)
    emit_table(text, args.out)
    return 0 if all(r["rc"] == 0 for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())

"""The report after the steps: the held-out evaluation (inference/prompt_eval.py), the numbers
from each step's metrics.jsonl, plots, and report.json / report.md."""
from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path

from applications.e2e.launch import run_logged
from applications.e2e.plan import Step, judge_step
from applications.e2e.presets import REPO


def metric_series(path: Path, key: str) -> list[tuple[int, float]]:
    from dschat.utils.metrics import read_metrics
    if not path.exists():
        return []
    return [(r["step"], r[key]) for r in read_metrics(path) if isinstance(r.get(key), (int, float))]


def first_last(series) -> dict:
    if not series:
        return {}
    return {"before": series[0][1], "after": series[-1][1], "steps": series[-1][0]}


def heldout_eval(args, steps: list[Step], env: dict) -> dict:
    """Greedy answers of the step-1 model and the PPO actor on held-out prompts, scored by
    the step-2 reward model (inference/prompt_eval.py, one process)."""
    s3 = steps[2].flags
    eval_dir = Path(args.output_dir) / "eval"
    cmd = [sys.executable, str(REPO / "inference" / "prompt_eval.py"),
           "--baseline", s3["actor_model_name_or_path"], "--finetune", str(steps[2].out / "actor"),
           "--reward_model", s3["critic_model_name_or_path"], "--num_prompts", str(args.eval_prompts),
           "--max_new_tokens", str(s3.get("max_answer_seq_len", 256)),
           "--max_prompt_len", str(s3.get("max_prompt_seq_len", 256)),
           "--data_split", s3["data_split"], "--seed", str(s3["seed"]), "--data_path", *s3["data_path"],
           "--jsonl", str(eval_dir / "heldout_answers.jsonl"), "--summary_json", str(eval_dir / "summary.json"),
           "--quiet"]
    if args.eval_prompts_file:
        cmd += ["--prompts", args.eval_prompts_file]
    judge = judge_step(steps)
    if judge is not None:
        cmd += ["--judge_model", str(judge.out)]
    if args.kl_samples:
        cmd += ["--kl_samples", str(args.kl_samples)]
    cmd += ["--batch_size", str(args.eval_batch_size)]
    print(f"\n==> held-out evaluation: {shlex.join(cmd)}", flush=True)
    rc = run_logged(cmd, Path(args.output_dir) / "logs" / "eval.log", env)
    if rc != 0:
        print(f"warning: held-out evaluation failed (exit {rc}); see {args.output_dir}/logs/eval.log", flush=True)
        return {}
    summary = json.loads((eval_dir / "summary.json").read_text())
    rows = [json.loads(line) for line in open(eval_dir / "heldout_answers.jsonl")]
    summary["examples"] = rows[:args.report_examples]
    summary["answers_file"] = str(eval_dir / "heldout_answers.jsonl")
    return summary


def make_plots(steps: list[Step]) -> dict:
    """python -m dschat.plot on each step's folder; {step folder: [png, ...]}."""
    from dschat.plot import plot_runs
    plots = {}
    for step in steps:
        if (step.out / "metrics.jsonl").exists():
            plots[str(step.out)] = [str(p) for p in plot_runs(step.out)]
    return plots


def overview_plot(steps: list[Step], heldout_file: str | None, out_path: Path) -> str | None:
    """report.png: the numbers of the report as curves (the per-step plots of dschat.plot
    have no panel for eval perplexity, reward-model accuracy or the held-out comparison)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s1, s2, s3 = (s.out / "metrics.jsonl" for s in steps[:3])
    fig, axes = plt.subplots(2, 3, figsize=(15, 8))
    panels = [
        (axes[0][0], "step 1 (SFT): loss", [(s1, "train/loss", "train"), (s1, "eval/loss", "eval")], False),
        (axes[0][1], "step 1 (SFT): eval perplexity (log)", [(s1, "eval/ppl", "eval ppl")], True),
        (axes[0][2], "step 2 (reward model): eval accuracy", [(s2, "eval/acc", "accuracy")], False),
        (axes[1][0], "step 2: eval scores", [(s2, "eval/chosen_score", "chosen"),
                                            (s2, "eval/rejected_score", "rejected")], False),
        (axes[1][1], "step 3 (PPO): reward of the rollouts", [(s3, "ppo/reward_mean", "reward mean")], False),
    ]
    for ax, title, curves, log in panels:
        for path, key, label in curves:
            series = metric_series(path, key)
            if series:
                xs, ys = zip(*series)
                ax.plot(xs, ys, marker="." if len(xs) <= 30 else None, label=label, linewidth=1.2)
                if key == "ppo/reward_mean" and len(ys) >= 10:
                    k = max(5, len(ys) // 10)
                    windows = [ys[max(0, i - k + 1):i + 1] for i in range(len(ys))]
                    smooth = [sum(w) / len(w) for w in windows]
                    ax.plot(xs, smooth, linewidth=2.2, label=f"mean of last {k}")
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step")
        ax.grid(True, alpha=0.3)
        if log:
            ax.set_yscale("log")
        if ax.lines:
            ax.legend(fontsize=8)
        else:
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes, color="grey")
    ax = axes[1][2]
    rows = [json.loads(line) for line in open(heldout_file)] if heldout_file and Path(heldout_file).exists() else []
    rows = [r for r in rows if "baseline_reward" in r and "finetune_reward" in r]
    if rows:
        b, f = [r["baseline_reward"] for r in rows], [r["finetune_reward"] for r in rows]
        lo, hi = min(b + f) - 0.3, max(b + f) + 0.3
        ax.plot([lo, hi], [lo, hi], color="grey", linewidth=1, label="no change")
        ax.scatter(b, f, s=18, label=f"{len(rows)} held-out prompts")
        ax.set_xlim(lo, hi)
        ax.set_ylim(lo, hi)
        ax.set_xlabel(f"step-1 model (mean {sum(b) / len(b):.2f})")
        ax.set_ylabel(f"PPO actor (mean {sum(f) / len(f):.2f})")
        ax.legend(fontsize=8, loc="upper left")
    else:
        ax.text(0.5, 0.5, "no held-out evaluation", ha="center", va="center", transform=ax.transAxes, color="grey")
    ax.set_title("held-out reward of greedy answers (above the line: PPO better)", fontsize=10)
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(out_path, dpi=100)
    plt.close(fig)
    return str(out_path)


def build_dpo_report(args, steps, actor, deployment, timings) -> dict:
    """The report of --align dpo: SFT perplexity and DPO's eval metrics before/after (no
    reward model, so no held-out reward of generated answers)."""
    s1, s2 = (s.out / "metrics.jsonl" for s in steps)
    return {
        "align": "dpo",
        "actor_model": {"spec": actor.spec, "path": actor.path, "note": actor.note},
        "reward_model": {"spec": "none", "path": "-", "note": "--align dpo: the step-1 model is its own reference"},
        "deployment": deployment,
        "output_dir": str(Path(args.output_dir).resolve()),
        "seconds": timings,
        "sft_eval_perplexity": first_last(metric_series(s1, "eval/ppl")),
        "dpo_eval": {k: first_last(metric_series(s2, f"eval/{k}"))
                     for k in ("acc", "margin", "loss", "chosen_logps", "rejected_logps", "kl_ref")},
        "heldout_reward": {},
        "models": {"step1_sft": str(steps[0].out), "step2_dpo": str(steps[1].out)},
        "plots": make_plots(steps),
        "overview_plot": None,
        "logs": str(Path(args.output_dir) / "logs"),
    }


def build_report(args, steps, actor, reward, deployment, timings, heldout) -> dict:
    s1, s2, s3 = (s.out / "metrics.jsonl" for s in steps[:3])
    judge = judge_step(steps)
    ppo_reward = metric_series(s3, "ppo/reward_mean")
    k = max(1, min(5, len(ppo_reward) // 4))
    ppo_train = {}
    if ppo_reward:
        ppo_train = {"first_steps_mean": sum(v for _, v in ppo_reward[:k]) / k,
                     "last_steps_mean": sum(v for _, v in ppo_reward[-k:]) / k, "window": k,
                     "steps": ppo_reward[-1][0]}
    return {
        "actor_model": {"spec": actor.spec, "path": actor.path, "note": actor.note},
        "reward_model": {"spec": reward.spec if reward else "step1",
                         "path": reward.path if reward else str(steps[0].out),
                         "note": reward.note if reward else "the step-1 output as backbone"},
        "deployment": deployment,
        "output_dir": str(Path(args.output_dir).resolve()),
        "seconds": timings,
        "sft_eval_perplexity": first_last(metric_series(s1, "eval/ppl")),
        "reward_model_eval_accuracy": first_last(metric_series(s2, "eval/acc")),
        "reward_model_eval_scores": {"chosen": first_last(metric_series(s2, "eval/chosen_score")),
                                     "rejected": first_last(metric_series(s2, "eval/rejected_score"))},
        "ppo_training_reward": ppo_train,
        "ppo_kl": first_last(metric_series(s3, "ppo/kl")),
        "ppo_kl_per_answer": first_last(metric_series(s3, "ppo/kl_per_answer")),
        "judge_eval_accuracy": first_last(metric_series(judge.out / "metrics.jsonl", "eval/acc")) if judge else None,
        "targets": actor.preset.get("targets") if judge else None,
        "heldout_reward": heldout,
        "models": {"step1_sft": str(steps[0].out), "step2_reward_model": str(steps[1].out),
                   "step3_actor": str(steps[2].out / "actor"), "step3_critic": str(steps[2].out / "critic"),
                   **({"step2_judge": str(judge.out)} if judge else {})},
        "plots": make_plots(steps),
        "overview_plot": overview_plot(steps, heldout.get("answers_file"), Path(args.output_dir) / "report.png"),
        "logs": str(Path(args.output_dir) / "logs"),
    }


def fmt(value, spec=".3f") -> str:
    return "n/a" if value is None else format(value, spec)


def cell(text: str) -> str:
    """An answer as one markdown table cell: newlines and pipes visible, not structural."""
    return text.strip().replace("\\", "\\\\").replace("\n", "\\n").replace("|", "\\|")


def _met(ok) -> str:
    return "n/a" if ok is None else ("**yes**" if ok else "**no**")


def judged_table(r: dict) -> list[str]:
    """The held-out comparison of a run with a judge reward model (one PPO never saw), each row
    against the preset's target when it has one."""
    ho, t = r["heldout_reward"], r.get("targets") or {}
    acc, jacc = r.get("reward_model_eval_accuracy") or {}, r.get("judge_eval_accuracy") or {}

    def pm(prefix):
        mean, std = ho.get(f"{prefix}_mean"), ho.get(f"{prefix}_std")
        return "n/a" if mean is None else f"{mean:+.3f} ± {std:.3f}"

    def check(value, bound, kind):
        if value is None or bound is None:
            return None
        return value >= bound if kind == "min" else value <= bound

    rm_min = t.get("reward_model_accuracy_min")
    gain_sd, win, kl = ho.get("judge_gain_in_baseline_std"), ho.get("judge_win_rate"), ho.get("kl_per_answer")
    d2b, d2f = ho.get("baseline_distinct_2"), ho.get("finetune_distinct_2")
    d2_change = abs(d2f / d2b - 1) if d2b and d2f is not None else None
    n = ho.get("num_prompts", 0)
    rows = [
        ("policy reward model: held-out pair accuracy", "", fmt(acc.get("after")), f">= {rm_min}" if rm_min else "",
         check(acc.get("after"), rm_min, "min")),
        ("judge reward model: held-out pair accuracy", "", fmt(jacc.get("after")), f">= {rm_min}" if rm_min else "",
         check(jacc.get("after"), rm_min, "min")),
        (f"policy-RM reward of greedy answers, {n} held-out prompts (mean ± sd)", pm("baseline_reward"),
         pm("finetune_reward"), "", None),
        (f"judge-RM reward, same answers (gain in SFT sd: {fmt(gain_sd, '+.2f')})", pm("baseline_judge"),
         pm("finetune_judge"), f"gain >= {t['judge_gain_in_sft_std_min']} sd" if "judge_gain_in_sft_std_min" in t
         else "", check(gain_sd, t.get("judge_gain_in_sft_std_min"), "min")),
        ("judge win rate of PPO over SFT (ties count half)", "", fmt(win), f">= {t['judge_win_rate_min']}"
         if "judge_win_rate_min" in t else "", check(win, t.get("judge_win_rate_min"), "min")),
        (f"KL of the PPO actor to SFT per answer, nats ({ho.get('kl_samples', 0)} sampled held-out answers)", "",
         fmt(kl, ".2f"), f"<= {t['kl_per_answer_max']}" if "kl_per_answer_max" in t else "",
         check(kl, t.get("kl_per_answer_max"), "max")),
        ("KL to the reference per answer in training, last step", "",
         fmt((r.get("ppo_kl_per_answer") or {}).get("after"), ".2f"), "", None),
        ("answer tokens, mean", fmt(ho.get("baseline_answer_tokens_mean"), ".1f"),
         fmt(ho.get("finetune_answer_tokens_mean"), ".1f"), "", None),
        ("distinct-2 of the answers", fmt(d2b), fmt(d2f),
         f"within {t['distinct_2_relative_change_max']:.0%} of SFT" if "distinct_2_relative_change_max" in t else "",
         check(d2_change, t.get("distinct_2_relative_change_max"), "max")),
        ("answers that end at the end of turn (not cut at the length limit)", fmt(ho.get("baseline_ended_share")),
         fmt(ho.get("finetune_ended_share")), f">= {t['ended_share_min']}" if "ended_share_min" in t else "",
         check(ho.get("finetune_ended_share"), t.get("ended_share_min"), "min")),
    ]
    lines = ["", "Held out: prompts and pairs no step trained on; the judge reward model trained on the other "
                 "half of the training prompts, and PPO never saw it.", "",
             "| measure | SFT (step 1) | PPO actor | target | met |", "|---|---|---|---|---|"]
    lines += [f"| {a} | {b} | {c} | {d} | {_met(e) if d else ''} |" for a, b, c, d, e in rows]
    return lines


def report_markdown(r: dict) -> str:
    ppl, acc, ho, ppo = (r["sft_eval_perplexity"], r.get("reward_model_eval_accuracy"), r["heldout_reward"],
                         r.get("ppo_training_reward"))
    lines = [f"# dschat end-to-end report: {r['actor_model']['spec']}",
             "",
             f"actor: {r['actor_model']['path']} ({r['actor_model']['note']})  ",
             f"reward model: {r['reward_model']['path']} ({r['reward_model']['note']})  ",
             f"deployment: {r['deployment']}; wall time per step (s): "
             + ", ".join(f"{k} {v:.0f}" for k, v in r["seconds"].items()),
             "",
             "| measure | before | after |", "|---|---|---|",
             f"| SFT eval perplexity (step 1, {ppl.get('steps', 0)} steps) | {fmt(ppl.get('before'), '.2f')} "
             f"| {fmt(ppl.get('after'), '.2f')} |"]
    if acc is not None:
        lines.append(f"| reward-model eval accuracy (step 2, {acc.get('steps', 0)} steps) | {fmt(acc.get('before'))} "
                     f"| {fmt(acc.get('after'))} |")
    for key, label in (("acc", "implicit-reward accuracy (chosen above rejected)"), ("margin", "reward margin"),
                       ("kl_ref", "per-token KL to the reference")):
        row = r.get("dpo_eval", {}).get(key)
        if row:
            lines.append(f"| DPO eval {label} (step 2 DPO, {row.get('steps', 0)} steps) | {fmt(row.get('before'))} "
                         f"| {fmt(row.get('after'))} |")
    if ho:
        lines.append(f"| held-out reward of greedy answers, {ho['num_prompts']} prompts ({', '.join(ho['sources'])}): "
                     f"step-1 model vs PPO actor | {fmt(ho.get('baseline_reward_mean'))} "
                     f"| {fmt(ho.get('finetune_reward_mean'))} |")
    if ppo:
        lines.append(f"| PPO training reward (mean of first / last {ppo['window']} of {ppo['steps']} steps) "
                     f"| {fmt(ppo['first_steps_mean'])} | {fmt(ppo['last_steps_mean'])} |")
    if ho and r.get("judge_eval_accuracy") is not None:
        lines += judged_table(r)
    if ho and "finetune_better" in ho:
        ties = ho["num_prompts"] - ho["finetune_better"] - ho["finetune_worse"]
        lines += ["", f"On the held-out prompts the PPO actor's answer scores higher than the step-1 model's on "
                      f"{ho['finetune_better']}, lower on {ho['finetune_worse']} and the same on {ties} "
                      f"(reward gain {ho['reward_gain']:+.3f}; all answers: {ho['answers_file']})."]
    if ho.get("examples"):
        judged = any("baseline_judge" in ex for ex in ho["examples"])
        what = "reward, judge" if judged else "reward"
        lines += ["", f"| prompt | step-1 answer ({what}) | PPO answer ({what}) |", "|---|---|---|"]
        for ex in ho["examples"]:
            q = " ".join(ex["prompt"].replace("Human:", "").replace("Assistant:", "").split())
            scores = {c: fmt(ex.get(f"{c}_reward"), "+.2f")
                      + (f", {fmt(ex.get(f'{c}_judge'), '+.2f')}" if judged else "")
                      for c in ("baseline", "finetune")}
            lines.append(f"| {q} | {cell(ex.get('baseline', ''))} ({scores['baseline']}) "
                         f"| {cell(ex.get('finetune', ''))} ({scores['finetune']}) |")
        lines += ["", "The reward is what the step-2 model prefers, not correctness: a small reward model has blind "
                      "spots PPO will find (reward hacking). Read the answers, not only the mean."]
    lines += ["", "Models:"] + [f"- {k}: {v}" for k, v in r["models"].items()]
    if r["overview_plot"]:
        lines += ["", f"Overview plot: {r['overview_plot']}"]
    lines += ["", "Plots (python -m dschat.plot):"]
    for folder, pngs in r["plots"].items():
        lines.append(f"- {folder}: " + ", ".join(Path(p).name for p in pngs) + f" (in {Path(pngs[0]).parent})"
                     if pngs else f"- {folder}: none")
    lines += ["", f"Logs: {r['logs']}", ""]
    return "\n".join(lines)

#!/usr/bin/env python
"""Steps 1-3 (SFT -> reward model -> PPO) in one command, then a short report.

    python applications/e2e_rlhf.py            # the CPU demo: tiny Bloom, bundled data, 2 ranks
    python applications/e2e_rlhf.py --actor-model bloom-1b7 --reward-model bloom-560m \\
        --deployment-type single_node --output-dir out/bloom-1b7
    python applications/e2e_rlhf.py --actor-model bloom-7b1 --deployment-type multi_node \\
        --hostfile scripts/hostfile.example --output-dir /shared/out/bloom-7b1
    python applications/e2e_rlhf.py --preset smollm2-135m --model PATH --data-path HH.jsonl.gz   # judged run
    python applications/e2e_rlhf.py --list-presets

--actor-model / --reward-model take a preset name (configs/presets/NAME.json: hub name,
ZeRO stages, batch sizes, LoRA, offload and hybrid-engine mode per deployment), a preset
file, a model folder, a config.json (random weights) or a hub name; for a model that is
not a preset, the hyperparameters come from --actor-preset / --reward-preset, by default
the preset closest in parameter count. --reward-model step1 trains the reward model on
the step-1 output (the demo's choice).

Each step is launched through the deepspeed launcher (`deepspeed --num_gpus N` or
`--hostfile`), its output checked before the next starts, and a step whose output is
already complete (step1/model.safetensors, step2/reward_model.json, step3/actor/) is
skipped (say --force to redo it); an incomplete step that left checkpoints
(--stepN-args='--save_interval N') is resumed from the newest. Logs go to OUTPUT_DIR/logs/. At the end the report
(OUTPUT_DIR/report.json + report.md) gives the SFT perplexity before/after, the reward
model's accuracy before/after, the reward of the greedy answers of the step-1 model and
of the PPO actor on held-out prompts (scored by the step-2 reward model), and where the
models and the plots (python -m dschat.plot) are.
"""
from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path

from applications.e2e.launch import (
    child_env,
    differing_flags,
    gpu_count,
    hostfile_slots,
    latest_checkpoint,
    launcher_argv,
    pick_deployment,
    previous_timings,
    run_logged,
    visible_gpus,
    wait_complete,
)
from applications.e2e.plan import build_plan, judge_split_of
from applications.e2e.presets import (
    DEMO,
    DEPLOYMENTS,
    REPO,
    ModelChoice,
    deployment_row,
    is_preset,
    list_presets,
    memory_report,
    resolve_model,
)
from applications.e2e.report import build_dpo_report, build_report, heldout_eval, report_markdown
from dschat.utils.errors import UserInputError
from dschat.utils.run import main_guard


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("models")
    g.add_argument("--actor-model", default=DEMO,
                   help="Preset name, preset file, model folder, config.json or hub name (default: demo).")
    g.add_argument("--reward-model", default=None,
                   help="Same kinds as --actor-model, 'step1' (the step-1 output as backbone) or 'actor' (the "
                        "actor's starting model). "
                        "Default: the actor preset's reward_model.")
    g.add_argument("--preset", default=None,
                   help="A preset for the whole run: its model (unless --model) and hyperparameters; e.g. "
                        "--preset smollm2-135m --model /path/to/SmolLM2-135M-Instruct.")
    g.add_argument("--model", default=None, help="With --preset: the actor's starting model (a folder or hub name).")
    g.add_argument("--actor-preset", default=None, help="Hyperparameters for a non-preset actor model.")
    g.add_argument("--reward-preset", default=None, help="Hyperparameters for a non-preset reward model.")
    g.add_argument("--random-init", action="store_true",
                   help="Build preset models from their 'config' with random weights (shape tests, no download).")
    g = p.add_argument_group("deployment")
    g.add_argument("--deployment-type", choices=DEPLOYMENTS, default=None,
                   help="Which preset row to use (default: cpu without GPUs, single_gpu with one, "
                        "single_node with several, multi_node with --hostfile).")
    g.add_argument("--num-gpus", type=int, default=None,
                   help="GPUs (CPU ranks on cpu) per node; default: the preset row's, at most the visible ones.")
    g.add_argument("--hostfile", default=None, help="DeepSpeed hostfile ('host slots=8' lines) for multi_node.")
    g.add_argument("--num-nodes", type=int, default=None, help="Use only this many hosts of the hostfile.")
    g.add_argument("--master-port", type=int, default=None, help="Rendezvous port (default: a free one).")
    g.add_argument("--launcher-args", default="", metavar="ARGS",
                   help="More deepspeed-launcher flags, e.g. --launcher-args='--no_ssh --node_rank 1 "
                        "--master_addr node-0' (run the same command on every node) or '--include node-0:0,1'.")
    g.add_argument("--output-wait", type=int, default=60,
                   help="Seconds to wait for a step's files after it exits (shared filesystems lag; other nodes).")
    g.add_argument("--actor-zero-stage", type=int, choices=(0, 1, 2, 3), default=None,
                   help="ZeRO stage of step 1 and of the step-3 actor (default: the preset's).")
    g.add_argument("--reward-zero-stage", type=int, choices=(0, 1, 2, 3), default=None,
                   help="ZeRO stage of step 2 and of the step-3 critic (default: the preset's).")
    g.add_argument("--low-memory", action="store_true",
                   help="Apply the preset row's low_memory settings (e.g. layered hybrid engine, offload).")
    g.add_argument("--dtype", choices=("fp32", "fp16", "bf16"), default=None,
                   help="Default: fp32 on cpu, the preset's (bf16) on GPUs.")
    g = p.add_argument_group("run")
    g.add_argument("--output-dir", default=None,
                   help="Where step1/ step2/ step3/ logs/ and the report go (default: output/e2e/<actor>).")
    g.add_argument("--step", type=int, nargs="+", choices=(1, 2, 3), default=[1, 2, 3], help="Steps to run.")
    g.add_argument("--align", choices=("ppo", "dpo"), default="ppo",
                   help="ppo: step 2 reward model + step 3 PPO (DS-Chat's RLHF); dpo: step 1 -> step 2 DPO "
                        "(training/step2_dpo_finetuning, output OUTPUT_DIR/step2_dpo; --step2-args go to it), "
                        "no reward model and no PPO.")
    g.add_argument("--force", action="store_true", help="Rerun the selected steps even when complete.")
    g.add_argument("--data-path", nargs="+", default=None, help="Data for all steps (default: the preset's).")
    g.add_argument("--data-split", default=None, help="Default: the preset's (demo 6,3,1; upstream 2,4,4).")
    g.add_argument("--data-cache", default=None, help="Tokenised-data cache (default: OUTPUT_DIR/data_cache).")
    g.add_argument("--seed", type=int, default=1234, help="Seed of all three steps (keeps their data disjoint).")
    for n in (1, 2, 3):
        g.add_argument(f"--step{n}-args", default="", metavar="FLAGS",
                       help=f"Extra flags for step {n}'s main.py, last wins (e.g. --step{n}-args='--max_steps 5').")
    g = p.add_argument_group("report")
    g.add_argument("--eval-prompts", type=int, default=None,
                   help="Held-out prompts for the before/after PPO reward (0: skip that evaluation; default: "
                        "the preset's \"eval\" section's, else 64).")
    g.add_argument("--kl-samples", type=int, default=None,
                   help="Sampled answers per held-out prompt for KL(PPO || SFT) per answer (default: the "
                        "preset's, else 0: not measured).")
    g.add_argument("--eval-prompts-file", default=None,
                   help="Use these prompts instead (see inference/prompt_eval.py).")
    g.add_argument("--eval-batch-size", type=int, default=None,
                   help="Prompts per generate call in the held-out evaluation (default: the preset's, else 16).")
    g.add_argument("--report-examples", type=int, default=None, help="Example answers in the report "
                   "(default: the preset's, else 6).")
    g.add_argument("--no-report", action="store_true", help="Run the steps only.")
    g.add_argument("--dry-run", action="store_true", help="Print the plan and the commands, run nothing.")
    g.add_argument("--list-presets", action="store_true", help="List the presets and exit.")
    args = p.parse_args(argv)
    if args.model and not args.preset:
        p.error("--model goes with --preset (or use --actor-model with --actor-preset)")
    if args.preset:
        if args.actor_model != DEMO or args.actor_preset:
            p.error("--preset replaces --actor-model/--actor-preset; give one or the other")
        args.actor_model = args.model or args.preset
        args.actor_preset = args.preset if args.model else None
    return args


def eval_settings(args, actor: ModelChoice) -> None:
    """--eval-prompts, --kl-samples, --report-examples and --eval-batch-size: the flag, else the
    preset's "eval" section, else 64, 0, 6 and 16."""
    section = actor.preset.get("eval", {})
    for flag, default in (("eval_prompts", 64), ("kl_samples", 0), ("report_examples", 6), ("eval_batch_size", 16)):
        if getattr(args, flag) is None:
            setattr(args, flag, section.get(flag, default))


def print_plan(steps, actor, reward, deployment, row, launcher, gpus) -> None:
    print(f"actor: {actor.path}  [{actor.note}]")
    if any(step.title == "DPO" for step in steps):
        print("reward model: none (--align dpo: step 2 is DPO against a frozen copy of the step-1 model)")
    else:
        print(f"reward model: {reward.path + '  [' + reward.note + ']' if reward else 'the step-1 output (step1)'}")
    print(f"deployment: {deployment}, {gpus} {'CPU ranks' if deployment == 'cpu' else 'GPUs'}: {row.get('rule', '')}")
    if deployment != "cpu":
        print("estimated model states (rule of thumb, see configs/presets/README.md):")
        print("\n".join(memory_report(steps, actor, reward, gpus, row.get("gpu_memory_gb", 80),
                                       row.get("measured_peak_gib"))))
    for step in steps:
        print(f"\n{step.name}: {shlex.join(launcher + step.argv)}")


def main(argv=None):
    args = parse_args(argv)
    if args.list_presets:
        list_presets()
        return 0
    deployment = pick_deployment(args.deployment_type, args.hostfile)
    if deployment == "multi_node" and not args.hostfile:
        raise UserInputError("--deployment-type multi_node needs --hostfile (see scripts/hostfile.example)")
    if deployment != "cpu" and visible_gpus() == 0 and not args.dry_run:
        raise UserInputError(f"--deployment-type {deployment}: no GPU is visible here; use --deployment-type cpu "
                             "(the demo) or --dry-run to see the commands")
    name = Path(args.actor_model).stem if is_preset(args.actor_model) else Path(args.actor_model.rstrip("/")).name
    default_out = REPO / "output" / ("e2e-demo" if args.actor_model == DEMO else f"e2e/{name}")
    args.output_dir = args.output_dir or str(default_out)
    out = Path(args.output_dir)
    actor = resolve_model(args.actor_model, "actor", args.actor_preset, args.random_init, out)
    eval_settings(args, actor)
    reward_spec = args.reward_model or actor.preset.get("reward_model", "step1")
    if reward_spec == "step1" or args.align == "dpo":
        reward = None
    elif reward_spec == "actor":  # the reward models start from the actor's starting model
        reward = ModelChoice(actor.spec, actor.path, actor.preset, actor.params_b, "the actor's starting model")
    else:
        reward = resolve_model(reward_spec, "reward", args.reward_preset, args.random_init, out)
    steps = build_plan(args, actor, reward, deployment)
    row = deployment_row(actor.preset, deployment, args.low_memory)
    gpus = gpu_count(args, row, deployment)
    launcher = launcher_argv(args, deployment, gpus)
    total = hostfile_slots(args.hostfile, args.num_nodes, args.num_gpus) if args.hostfile else gpus
    print_plan(steps, actor, reward, deployment, row, launcher, total or row["num_gpus"])
    if args.dry_run:
        return 0

    out.mkdir(parents=True, exist_ok=True)
    split = judge_split_of(args, actor)
    if split:
        from dschat.data.judge_split import prepare
        made = prepare(split["source"], split["out"], split.get("eval_fraction", 0.1), split.get("seed", 1234))
        print(f"\n==> data: {', '.join(made['data_path'])} cut by prompt into held-out / policy / judge: "
              f"{made['prompts']} prompts in {split['out']}", flush=True)
    env = child_env(deployment)
    timings = previous_timings(out)
    retrained = []
    for step in sorted(steps, key=lambda s: s.number):  # the judge runs right after step 2
        if step.number not in args.step:
            continue
        if step.complete() and not args.force:
            diffs = differing_flags(step)
            print(f"\n==> {step.name}: {step.out} is already complete ({', '.join(step.done_files)}); skipping "
                  "(--force reruns it)" + (f". Note: it was trained with {'; '.join(diffs)}" if diffs else ""),
                  flush=True)
            if retrained:
                print(f"warning: {step.name} was trained before {retrained[-1]} was just retrained; "
                      f"--force --step {step.number} retrains it on the new output", flush=True)
            continue
        for earlier in steps[:step.number - 1]:
            if not earlier.complete():
                raise UserInputError(f"{step.name} needs the output of {earlier.name} in {earlier.out}, which is "
                                     f"not complete (missing {', '.join(earlier.done_files)}); "
                                     f"add --step {earlier.number}")
        cmd = launcher_argv(args, deployment, gpus) + step.argv
        checkpoint = None if args.force else latest_checkpoint(step.out)
        if checkpoint is not None and "--resume" not in cmd:
            cmd.append("--resume")
            print(f"\n==> {step.name}: an earlier run left {checkpoint}; resuming from it", flush=True)
        print(f"\n==> {step.name}: {shlex.join(cmd)}", flush=True)
        start = time.time()
        rc = run_logged(cmd, out / "logs" / f"{step.key}.log", env)
        timings[step.key] = time.time() - start
        if rc != 0:
            print(f"error: {step.name} failed (exit code {rc}); its log: {out / 'logs' / f'{step.key}.log'}"
                  + ("; with --save_interval in --stepN-args a rerun resumes from its last checkpoint"
                     if rc != 2 else ""), file=sys.stderr, flush=True)
            return rc
        if not wait_complete(step, args.output_wait):
            raise UserInputError(f"{step.name} exited 0 but {step.out} lacks {', '.join(step.done_files)} "
                                 f"after {args.output_wait} s "
                                 "(multi-node: --output-dir must be on a shared filesystem)")
        print(f"==> {step.name} done in {timings[step.key]:.0f} s: {step.out}", flush=True)
        retrained.append(step.name)

    if args.no_report or not all(s.complete() for s in steps):
        missing = [s.name for s in steps if not s.complete()]
        if missing and not args.no_report:
            print(f"\nno report: {', '.join(missing)} not complete yet", flush=True)
        return 0
    if args.align == "dpo":
        report = build_dpo_report(args, steps, actor, deployment, timings)
    else:
        heldout = {}
        if args.eval_prompts > 0:
            start = time.time()
            heldout = heldout_eval(args, steps, env)
            timings["eval"] = time.time() - start
        report = build_report(args, steps, actor, reward, deployment, timings, heldout)
    (out / "report.json").write_text(json.dumps(report, indent=2))
    md = report_markdown(report)
    (out / "report.md").write_text(md)
    print("\n" + md)
    print(f"report saved to {out / 'report.md'} and {out / 'report.json'}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main_guard(main) or 0)

#!/usr/bin/env python
"""One GRPO step side by side: ours (step 3 --algorithm grpo) against TRL's GRPOTrainer.

    python benchmarks/grpo_vs_trl.py --model /tmp/smollm2-hf --out /tmp/grpo_vs_trl.md

Same model, same prompts, same reward, same sizes, both at DeepSpeed ZeRO-3 on one GPU, each
run as its own job through the deepspeed launcher (`python -m deepspeed.launcher.runner
--num_gpus 1`):

- prompts: arithmetic word problems of dschat/tasks/arithmetic.py, each rendered once (through
  the tokenizer's chat template with --chat_template auto, as ours renders step-3 prompts) and
  padded with solved example problems in front to exactly --prompt_len tokens; both frameworks
  read the same rendered text (ours with --chat_template none and no stop strings, TRL as plain
  text prompts), so both tokenize the same ids;
- reward: dschat/tasks/arithmetic.py:exact_match_reward (TRL calls it through a wrapper with
  its reward-function signature, benchmarks/trl_grpo_runner.py:arithmetic_exact_match);
- answers: exactly --answer_len tokens in both (eos blocked until then: ours
  --min_answer_seq_len = --max_answer_seq_len; TRL generation_kwargs min_new_tokens =
  max_completion_length), sampled at temperature --temperature, --group answers per prompt;
- one optimizer step per GRPO step in both: --prompts_per_step x --group answers generated,
  trained once (one PPO epoch / num_iterations 1) in micro-batches of --train_micro_batch with
  gradient accumulation over the rest; KL coefficient --beta in both (0: neither builds a
  reference model), same learning rate, AdamW betas (0.9, 0.95), constant schedule.

Ours: training/step3_rlhf_finetuning/main.py with --enable_hybrid_engine (change with
--ours_args); its metrics.jsonl gives seconds per step split into generation, scoring and
training. TRL: benchmarks/trl_grpo_runner.py (GRPOTrainer, HF generate path, no vLLM) with a
TrainerCallback timing each optimizer step and the trainer's generation method
(`_generate_single_turn`) and experience method (`_generate_and_score_completions`) wrapped.
Steady-state means skip the first --warmup steps. The markdown table is printed (and appended
to --out); the numbers behind it go to --out with the suffix .json (a list, one entry per run).

On a GPU machine without the packages: the wheels of benchmarks/trl_wheels.sh (.whl-trl/: TRL,
datasets and its dependencies) and benchmarks/GPU_SETUP.md (.whl/: DeepSpeed), installed
as below. The TRL wheels go into a folder named site-packages: datasets hashes an in-memory
Dataset with dill, which fails on a pyarrow loaded from elsewhere (trl_grpo_runner.py says so).

    python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl
    python3 -m pip install -q --no-index --no-deps --no-compile --upgrade \\
        --target /tmp/trl/site-packages .whl-trl/*.whl
    export PYTHONPATH=$PWD:/tmp/site:/tmp/trl/site-packages TORCH_CUDA_ARCH_LIST=9.0 HF_HUB_OFFLINE=1
    python3 benchmarks/grpo_vs_trl.py --model /tmp/smollm2-hf --out /tmp/out/grpo_vs_trl.md

CPU smoke run (numbers meaningless; TRL's chunked log-prob kernel runs its torch fallback there):

    python benchmarks/grpo_vs_trl.py --model /tmp/tiny --steps 3 --warmup 1 --dtype fp32 \\
        --answer_len 16 --prompt_len 64
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.processes import free_port
from benchmarks.tables import emit_table

REPO = Path(__file__).resolve().parents[1]
FRAMEWORKS = ("ours", "trl")
STEP3 = REPO / "training" / "step3_rlhf_finetuning" / "main.py"
RUNNER = REPO / "benchmarks" / "trl_grpo_runner.py"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True,
                   help="A local HF causal-LM folder with its tokenizer (SmolLM2-135M-Instruct in practice); "
                        "both frameworks load it from there.")
    p.add_argument("--steps", type=int, default=8, help="GRPO steps (= optimizer steps) per framework.")
    p.add_argument("--warmup", type=int, default=2, help="First steps left out of the steady-state means.")
    p.add_argument("--prompts_per_step", type=int, default=8, help="Distinct prompts per step.")
    p.add_argument("--group", type=int, default=8,
                   help="Answers sampled per prompt (ours --n_samples_per_prompt, TRL num_generations); "
                        "a step samples prompts_per_step x group answers.")
    p.add_argument("--prompt_len", type=int, default=256,
                   help="Prompt tokens, every prompt exactly this long (a problem padded in front with solved "
                        "examples); must leave room for the chat template and a question.")
    p.add_argument("--answer_len", type=int, default=192,
                   help="Answer tokens, forced in both (eos blocked until this many tokens).")
    p.add_argument("--train_micro_batch", type=int, default=0,
                   help="Answers per forward/backward in training (ours --per_device_training_batch_size, "
                        "TRL per_device_train_batch_size), with gradient accumulation over the step's answers "
                        "(ours --gradient_accumulation_steps, TRL gradient_accumulation_steps = "
                        "steps_per_generation). 0: all prompts_per_step x group answers at once.")
    p.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16",
                   help="Training and generation precision (DeepSpeed's bf16 section with fp32 master weights, "
                        "or fp32) for both.")
    p.add_argument("--beta", type=float, default=0.0,
                   help="KL coefficient, the same for both (ours --kl_ctl, k3 estimator in the loss; TRL beta). "
                        "0: neither builds a reference model.")
    p.add_argument("--learning_rate", type=float, default=1e-6, help="Learning rate of both (constant, no warm-up).")
    p.add_argument("--temperature", type=float, default=1.0, help="Sampling temperature of both (top-p 1, no top-k).")
    p.add_argument("--gradient_checkpointing", action="store_true",
                   help="Activation checkpointing in both (ours --actor_gradient_checkpointing; TRL's "
                        "gradient_checkpointing, which TRL turns on by default, is otherwise off).")
    p.add_argument("--frameworks", nargs="+", choices=FRAMEWORKS, default=list(FRAMEWORKS),
                   help="Which to run, in this order.")
    p.add_argument("--trl_zero_stage", type=int, choices=(0, 3), default=3,
                   help="TRL's DeepSpeed ZeRO stage; 0 runs TRL without DeepSpeed (plain accelerate), for machines "
                        "where TRL cannot run under DeepSpeed. Ours always runs its actor at ZeRO-3.")
    p.add_argument("--ours_args", default="--enable_hybrid_engine",
                   help="Extra flags for ours' step 3 (one string, shell-split), e.g. "
                        "'--enable_hybrid_engine --disable_fast_decode'. '' runs ours without its hybrid engine.")
    p.add_argument("--chat_template", choices=("auto", "none"), default="auto",
                   help="How prompts are rendered: auto = the tokenizer's chat template when it has one (else DS-Chat "
                        "text), none = DS-Chat text ('\\n\\nHuman: ...\\n\\nAssistant:').")
    p.add_argument("--difficulty", default="1-3",
                   help="Operations per word problem, N or LO-HI (dschat/tasks/arithmetic.py).")
    p.add_argument("--seed", type=int, default=1234, help="Seed of both runs and of the prompt set.")
    p.add_argument("--timeout", type=int, default=3600, help="Seconds each framework's run may take.")
    p.add_argument("--workdir", default="/tmp/dschat_grpo_vs_trl",
                   help="Scratch folder: data/ (the rendered prompts), ours/ and trl/ (each run's output and "
                        "log.txt, cleared before it runs), cache/ (ours' tokenized prompts).")
    p.add_argument("--out", default=None,
                   help="Append the markdown table to this file; the numbers go to the same path with the "
                        "suffix .json (a list of runs, appended to).")
    args = p.parse_args(argv)
    total = args.prompts_per_step * args.group
    micro = args.train_micro_batch or total
    if args.group < 2 or args.prompts_per_step < 1 or args.steps < 1 or args.warmup < 0:
        p.error("--group must be >= 2, --prompts_per_step and --steps >= 1, --warmup >= 0")
    if total % micro or micro % args.group:
        p.error(f"--train_micro_batch {micro} must divide prompts_per_step x group = {total} and be a multiple "
                f"of --group {args.group}")
    if args.answer_len < 2:
        p.error("--answer_len must be >= 2 (ours drops answers of one token)")
    return args


# ----------------------------------------------------------------------------- prompts
def render_prompts(tokenizer, n: int, prompt_len: int, *, seed: int, difficulty: str = "1-3",
                   chat_template: str = "auto") -> list[dict]:
    """`n` arithmetic problems as rows {prompt, response, answer}: `prompt` is the final text
    (chat template applied) of exactly `prompt_len` tokens of `tokenizer` (special tokens
    included, as both frameworks encode it), a question preceded by the tail of solved example
    problems; `response` the reference solution, `answer` its number."""
    from dschat.data.chat import ChatFormat
    from dschat.data.formats import as_prompt
    from dschat.tasks.arithmetic import INSTRUCTION, generate
    from dschat.utils.errors import UserInputError

    chat = ChatFormat(tokenizer, chat_template)
    length = lambda text: len(tokenizer(text)["input_ids"])  # noqa: E731
    pool = generate(200, difficulty, seed, "eval")            # solved examples for the padding
    ids_of = {}
    rng = random.Random(seed)
    rows, shortest = [], None
    for problem in generate(max(100 * n, 1000), difficulty, seed, "train"):
        if len(rows) == n:
            break
        question = f"{problem.question} {INSTRUCTION}"
        render = lambda context: chat.prompt(as_prompt(f"{context}{question}"))  # noqa: E731
        bare = length(render(""))
        shortest = bare if shortest is None else min(shortest, bare)
        if bare > prompt_len:
            continue
        if bare == prompt_len:
            rows.append({"prompt": render(""), "response": problem.solution, "answer": str(problem.answer)})
            continue
        examples = rng.sample(pool, 8)
        key = tuple(e.question for e in examples)
        if key not in ids_of:
            text = "".join(f"{e.question}\n{e.solution}\n\n" for e in examples)
            ids_of[key] = tokenizer(text, add_special_tokens=False)["input_ids"]
        ids = ids_of[key]
        while len(ids) < prompt_len:
            ids = ids + ids
        # the last k tokens of the examples in front: the prompt grows by about one token per k
        k, hit = prompt_len - bare, None
        for _ in range(8):
            text = render(tokenizer.decode(ids[-k:]) + "\n\n")
            got = length(text)
            if got == prompt_len:
                hit = text
                break
            k += prompt_len - got
            if k <= 0:
                break
        if hit is not None:
            rows.append({"prompt": hit, "response": problem.solution, "answer": str(problem.answer)})
    if len(rows) < n:
        raise UserInputError(f"only {len(rows)} of {n} prompts fit --prompt_len {prompt_len} exactly (the shortest "
                             f"bare question renders to {shortest} tokens with --chat_template {chat_template}); "
                             f"raise --prompt_len, lower --difficulty or use --chat_template none")
    return rows


def write_data(folder: Path, rows: list[dict], eval_rows: list[dict]) -> Path:
    """folder/train.jsonl (every step's prompts; ours reads the folder as its train/eval
    splits, TRL the train file) and folder/eval.jsonl; returns the train file."""
    folder.mkdir(parents=True, exist_ok=True)
    for name, part in (("train.jsonl", rows), ("eval.jsonl", eval_rows)):
        with open(folder / name, "w", encoding="utf-8") as f:
            for row in part:
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
    return folder / "train.jsonl"


# ----------------------------------------------------------------------------- runs
def _launch(script: Path, script_args: list, out: Path, timeout: int) -> bool:
    """`deepspeed --num_gpus 1 script args` (the launcher module of this Python), output to
    out/log.txt; True when it exited 0."""
    port = free_port()
    cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "1", "--master_port", str(port),
           str(script), *[str(a) for a in script_args]]
    env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
               PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false")
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("HF_DATASETS_OFFLINE", "1")
    log = out / "log.txt"
    start = time.time()
    with open(log, "w") as f:
        f.write(shlex.join(cmd) + "\n")
        f.flush()
        try:
            proc = subprocess.run(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=timeout, cwd=REPO)
            rc = proc.returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    for shm in Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_*_{port}_*"):  # DeepSpeed's CPU comm buffers
        shm.unlink(missing_ok=True)
    print(f"{script.name}: exit {rc} after {time.time() - start:.0f} s (log {log})", flush=True)
    if rc != 0:
        print("".join(log.read_text().splitlines(keepends=True)[-60:]), file=sys.stderr, flush=True)
    return rc == 0


def _reset(folder: Path) -> Path:
    shutil.rmtree(folder, ignore_errors=True)   # ours' metrics.jsonl appends: no rows of an earlier run
    folder.mkdir(parents=True)
    return folder


def ours_command(args, data_dir: Path, workdir: Path, out: Path) -> list[str]:
    total = args.prompts_per_step * args.group
    micro = args.train_micro_batch or total
    cmd = ["--algorithm", "grpo", "--n_samples_per_prompt", args.group, "--temperature", args.temperature,
           "--reward_fn", "dschat/tasks/arithmetic.py:exact_match_reward",
           "--actor_model_name_or_path", args.model, "--data_path", data_dir, "--data_split", "0,0,1",
           "--data_output_path", workdir / "cache", "--chat_template", "none", "--stop_strings",
           "--actor_zero_stage", "3", "--dtype", args.dtype, "--kl_ctl", args.beta,
           "--per_device_generation_batch_size", total, "--per_device_training_batch_size", micro,
           "--gradient_accumulation_steps", total // micro, "--ppo_epochs", "1",
           "--max_prompt_seq_len", args.prompt_len, "--max_answer_seq_len", args.answer_len,
           "--min_answer_seq_len", args.answer_len, "--max_steps", args.steps,
           "--actor_learning_rate", args.learning_rate, "--lr_scheduler_type", "constant",
           "--num_warmup_steps", "0", "--seed", args.seed, "--output_dir", out]
    if args.gradient_checkpointing:
        cmd.append("--actor_gradient_checkpointing")
    return [str(c) for c in cmd] + shlex.split(args.ours_args)


def run_ours(args, data_dir: Path, workdir: Path) -> list[dict]:
    """Ours' per-step rows in the common form (see `summarize`)."""
    out = _reset(workdir / "ours")
    if not _launch(STEP3, ours_command(args, data_dir, workdir, out), out, args.timeout):
        return []
    rows = []
    for line in (out / "metrics.jsonl").read_text().splitlines():
        r = json.loads(line)
        if "time/step_s" not in r:
            continue
        rows.append({"step_s": r["time/step_s"], "generate_s": r.get("time/generate_s", 0.0),
                     "score_s": r.get("time/score_s", 0.0), "train_s": r.get("time/train_s", 0.0),
                     "peak_gib": r.get("memory/peak_gib", float("nan")),
                     "answer_len_mean": r.get("gen/answer_len_mean", float("nan")),
                     "reward_mean": r.get("ppo/reward_mean", float("nan")),
                     # the finer split (time/gen_s, time/actor_bwd_s, memory/*_peak_gib, ...) where ours logs it
                     "detail": {k: v for k, v in r.items() if k.startswith(("time/", "memory/", "gen/"))}})
    return rows


def trl_run_config(args, data_file: Path, out: Path) -> dict:
    total = args.prompts_per_step * args.group
    micro = args.train_micro_batch or total
    return {"model": str(Path(args.model).resolve()), "data_file": str(data_file), "output_dir": str(out),
            "steps": args.steps, "seed": args.seed, "group": args.group, "answer_len": args.answer_len,
            "micro_batch": micro, "gradient_accumulation_steps": total // micro, "temperature": args.temperature,
            "beta": args.beta, "learning_rate": args.learning_rate, "dtype": args.dtype,
            "zero_stage": args.trl_zero_stage, "gradient_checkpointing": args.gradient_checkpointing}


def run_trl(args, data_file: Path, workdir: Path) -> list[dict]:
    out = _reset(workdir / "trl")
    config = out / "run.json"
    config.write_text(json.dumps(trl_run_config(args, data_file, out), indent=1))
    if not _launch(RUNNER, ["--config", config], out, args.timeout):
        return []
    rows = []
    for line in (out / "steps.jsonl").read_text().splitlines():
        r = json.loads(line)
        # scoring: everything of the experience but generation (decoding, rewards, advantages,
        # reference / old log-probs when TRL computes them); training: the rest of the step
        rows.append({"step_s": r["step_s"], "generate_s": r["generate_s"],
                     "score_s": r["experience_s"] - r["generate_s"], "train_s": r["step_s"] - r["experience_s"],
                     "peak_gib": r["peak_gib"], "answer_len_mean": r["answer_len_mean"],
                     "reward_mean": r["reward_mean"], "detail": {"zero_stage": r.get("zero_stage")}})
    return rows


# ----------------------------------------------------------------------------- report
def summarize(rows: list[dict], warmup: int, answers_per_step: int) -> dict | None:
    """Steady-state means over the rows after the first `warmup` (all rows when there are
    no more); None for a failed run."""
    if not rows:
        return None
    steady = rows[warmup:] or rows
    mean = lambda k: sum(r[k] for r in steady) / len(steady)  # noqa: E731
    s = {k: mean(k) for k in ("step_s", "generate_s", "score_s", "train_s", "answer_len_mean", "reward_mean")}
    s["rest_s"] = s["step_s"] - s["generate_s"]
    s["samples_per_s"] = answers_per_step / s["step_s"]
    s["peak_gib"] = max(r["peak_gib"] for r in rows)
    s["steps"] = len(rows)
    s["steady_steps"] = len(steady)
    return s


def format_table(results: dict, args) -> str:
    """The markdown table: one row per framework (or 'failed'), then ours / TRL."""
    total = args.prompts_per_step * args.group
    micro = args.train_micro_batch or total
    device = _device_name()
    header = (f"GRPO step, ours ({args.ours_args or 'no hybrid engine'}) vs TRL GRPOTrainer (HF generate), "
              f"{Path(args.model).name}, ours ZeRO-3, TRL ZeRO-{args.trl_zero_stage}, {args.dtype}, 1 {device}, "
              f"{args.prompts_per_step} prompts x {args.group} answers x ({args.prompt_len} + {args.answer_len} "
              f"forced) tokens per step, training micro-batch {micro}, beta {args.beta:g}; "
              f"mean of steps {args.warmup + 1}..{args.steps}")
    lines = [header, "",
             "| framework | step s | generation s | rest s | scoring s | training s | samples/s | peak GiB "
             "| answer tokens | reward | steps done |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name in results:
        r = results[name]
        if r is None:
            lines.append(f"| {name} | failed | | | | | | | | | |")
            continue
        lines.append(f"| {name} | {r['step_s']:.3f} | {r['generate_s']:.3f} | {r['rest_s']:.3f} | "
                     f"{r['score_s']:.3f} | {r['train_s']:.3f} | {r['samples_per_s']:.2f} | {r['peak_gib']:.2f} | "
                     f"{r['answer_len_mean']:.1f} | {r['reward_mean']:.3f} | {r['steps']} |")
    ours, trl = results.get("ours"), results.get("trl")
    if ours and trl:  # every column ours / TRL: below 1 for times, above 1 for samples/s, is ours ahead
        ratio = lambda k: f"{ours[k] / trl[k]:.2f}" if trl[k] else "n/a"  # noqa: E731
        lines.append(f"| ours / TRL | {ratio('step_s')} | {ratio('generate_s')} | {ratio('rest_s')} | "
                     f"{ratio('score_s')} | {ratio('train_s')} | **{ratio('samples_per_s')}** | "
                     f"{ratio('peak_gib')} | | | |")
    return "\n".join(lines) + "\n"


def _device_name() -> str:
    try:
        import torch
        if torch.cuda.is_available():
            return torch.cuda.get_device_name(0)
    except ImportError:
        pass
    return "CPU rank"


def main(argv=None):
    args = parse_args(argv)
    from transformers import AutoTokenizer

    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    total = args.prompts_per_step * args.group
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    # every step's prompts, plus a spare step; the eval split is never read but must exist
    n = args.prompts_per_step * (args.steps + 1)
    rows = render_prompts(tokenizer, n + 4, args.prompt_len, seed=args.seed, difficulty=args.difficulty,
                          chat_template=args.chat_template)
    data_file = write_data(workdir / "data", rows[:n], rows[n:])
    print(f"{n} prompts of {args.prompt_len} tokens in {data_file}", flush=True)
    results, raw = {}, {}
    for name in args.frameworks:
        raw[name] = run_ours(args, data_file.parent, workdir) if name == "ours" else run_trl(args, data_file, workdir)
        results[name] = summarize(raw[name], args.warmup, total)
        print(name, json.dumps(results[name]), flush=True)
    table = format_table(results, args)
    emit_table(table, args.out)
    if args.out:
        js = Path(args.out).with_suffix(".json")
        runs = json.loads(js.read_text()) if js.exists() else []
        runs.append({"args": vars(args), "device": _device_name(), "summary": results, "steps": raw,
                     "time": time.strftime("%Y-%m-%d %H:%M:%S")})
        js.write_text(json.dumps(runs, indent=1))
    return 0 if all(results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python
"""Step 3 end to end, side by side: seconds per PPO step split into generation / scoring /
training, for hybrid off (ZeRO-3 hooks), ours generic (replica + HF generate) and ours fast.

    python benchmarks/step3.py --preset bloom-560m --steps 6 --num_gpus 1

Builds a random-init actor (the preset's shape) and a random reward model on its backbone,
writes prompts of exactly --prompt_len tokens, then runs training/step3_rlhf_finetuning/main.py
once per mode through the deepspeed launcher with actor and critic both at ZeRO-3 (reference
and reward too, except in the "frozen unsharded" mode; the "ZeRO-2" / "ZeRO-0" modes put all
four at that stage, to show what ZeRO-3 costs where it partitions nothing), answers forced to
--answer_len tokens; "checkpointed" recomputes both trained models' activations.
Steady-state numbers skip the first --warmup steps. A second table splits the step into
its phases (generation, scoring by each model, each engine's forward / backward / optimizer
step: the trainer's time/<phase>_s, GPU time between CUDA events on CUDA), and on CUDA a third gives each
phase's peak allocated memory (memory/<phase>_peak_gib), both steady-state means.
"""
import argparse
import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

from benchmarks.tables import emit_table
from benchmarks.trace_phases import report as phase_report

REPO = Path(__file__).resolve().parents[1]

# flags the modes below combine
HYBRID = ["--enable_hybrid_engine"]
CHECKPOINTED = ["--actor_gradient_checkpointing", "--critic_gradient_checkpointing"]
OPTIMIZER_OFFLOADED = ["--offload", "--offload_optimizer_only"]
PINNED = ["--offload_pin_memory"]
REFERENCE_OFFLOADED = ["--offload_reference_model"]
LORA = ["--actor_lora_dim", "128", "--only_optimize_lora"]
BF16_OPTIMIZER = ["--optimizer_dtype", "bf16"]
HALF = ["--checkpoint_every_n_layers", "2"]
SCORED = ["--score_in_training_forward"]     # old log-probs and values from the training forwards
COMPILED = ["--compile_blocks"]               # actor's and critic's blocks compiled for training
ZERO2 = ["--actor_zero_stage", "2", "--critic_zero_stage", "2"]     # after the default stage 3
TWO_MICRO = ["--per_device_training_batch_size", "8", "--gradient_accumulation_steps", "2"]   # after --batch 16

MODES = {
    "hybrid off": [],
    "ours generic": HYBRID + ["--disable_fast_decode"],
    "ours fast": HYBRID,
    # DeepSpeed's own ZeRO-3 hooks on every linear and norm (before: one per transformer block)
    "ours fast, per-module hooks": HYBRID + ["--zero3_hook_granularity", "module"],
    # reference and reward whole on every GPU (ZeRO-0) while actor and critic stay at ZeRO-3
    "ours fast, frozen unsharded": HYBRID + ["--reference_zero_stage", "0", "--reward_zero_stage", "0"],
    # the LM head over every column in scoring and training (before: the answer's only)
    "ours fast, full-width LM head": HYBRID,
    # HF's eager attention (Bloom: fp32 probabilities kept per layer) where SDPA runs by default
    "ours fast, eager attention": HYBRID + ["--attn_implementation", "eager"],
    "hybrid off, eager attention": ["--attn_implementation", "eager"],
    # old log-probs and values from the training forwards: no actor or critic scoring pass
    "ours fast, scored in training": HYBRID + SCORED,
    # activation checkpointing of both trained models: peak memory against recomputation
    "ours fast, checkpointed": HYBRID + CHECKPOINTED,
    "hybrid off, checkpointed": CHECKPOINTED,
    # torch's multi-tensor AdamW (its GPU default) in place of the fused one
    "ours fast, foreach Adam": HYBRID + ["--adam_kernel", "foreach"],
    "ours fast, checkpointed, foreach Adam": HYBRID + CHECKPOINTED + ["--adam_kernel", "foreach"],
    # a copied inference replica of the actor where (one rank, ZeRO-3) views of its shards serve
    "ours fast, replica copied": HYBRID,
    # ZeRO-2 (and ZeRO-0) at world size 1: what ZeRO-3's hooks, fetches and partitioned
    # optimizer step cost where there is nothing to partition (generation on the live weights)
    "ours fast, ZeRO-2": HYBRID + ZERO2,
    "ours fast, ZeRO-0": HYBRID + ["--actor_zero_stage", "0", "--critic_zero_stage", "0"],
    # full fine-tuning of an actor whose training state outgrows one GPU: the parameters stay
    # on the GPU, --offload_ratio of the optimizer states go to host memory (DeepSpeedCPUAdam);
    # "pinned": page-locked host buffers for the offloaded state; "checkpointed": the memory the
    # recomputed activations free holds more of the optimizer on the GPU (a lower ratio);
    # "reference offloaded": the frozen reference's weights on the host too, streamed in for its
    # forward
    "ours fast, optimizer offloaded": HYBRID + OPTIMIZER_OFFLOADED,
    "ours fast, optimizer offloaded, pinned": HYBRID + OPTIMIZER_OFFLOADED + PINNED,
    "ours fast, optimizer offloaded, checkpointed": HYBRID + OPTIMIZER_OFFLOADED + CHECKPOINTED,
    "ours fast, optimizer offloaded, checkpointed, pinned": HYBRID + OPTIMIZER_OFFLOADED + PINNED + CHECKPOINTED,
    "ours fast, optimizer offloaded, checkpointed, reference offloaded":
        HYBRID + OPTIMIZER_OFFLOADED + CHECKPOINTED + REFERENCE_OFFLOADED,
    "ours fast, optimizer offloaded, checkpointed, pinned, reference offloaded":
        HYBRID + OPTIMIZER_OFFLOADED + PINNED + CHECKPOINTED + REFERENCE_OFFLOADED,
    # the same without the hybrid engine (generation through DeepSpeed's ZeRO-3 hooks)
    "hybrid off, optimizer offloaded": OPTIMIZER_OFFLOADED,
    "hybrid off, optimizer offloaded, checkpointed": OPTIMIZER_OFFLOADED + CHECKPOINTED,
    # bf16 master weights and Adam moments written with stochastic rounding (--optimizer_dtype
    # bf16): 8 bytes of training state per parameter in place of 16, no host offload
    "ours fast, bf16 optimizer": HYBRID + BF16_OPTIMIZER,
    "ours fast, bf16 optimizer, checkpointed": HYBRID + BF16_OPTIMIZER + CHECKPOINTED,
    # the same samples per optimizer step trained as two micro-batches (half the activations)
    "ours fast, bf16 optimizer, checkpointed, 2 micro-batches": HYBRID + BF16_OPTIMIZER + CHECKPOINTED + TWO_MICRO,
    "ours fast, bf16 optimizer, checkpointed, reference offloaded":
        HYBRID + BF16_OPTIMIZER + CHECKPOINTED + REFERENCE_OFFLOADED,
    # with the old log-probs and values taken from the training forwards (no actor or critic scoring pass)
    "ours fast, bf16 optimizer, scored in training": HYBRID + BF16_OPTIMIZER + SCORED,
    "ours fast, bf16 optimizer, checkpointed, scored in training":
        HYBRID + BF16_OPTIMIZER + CHECKPOINTED + SCORED,
    # every other transformer block recomputed (--checkpoint_every_n_layers 2): half the recomputation
    "ours fast, bf16 optimizer, half checkpointed": HYBRID + BF16_OPTIMIZER + CHECKPOINTED + HALF,
    "ours fast, bf16 optimizer, half checkpointed, scored in training":
        HYBRID + BF16_OPTIMIZER + CHECKPOINTED + HALF + SCORED,
    # the same with actor and critic at ZeRO-2: no parameter gather or release hooks around each
    # block (on one GPU ZeRO-3 partitions nothing; the frozen models are unpartitioned either way)
    "ours fast, bf16 optimizer, checkpointed, scored in training, ZeRO-2":
        HYBRID + BF16_OPTIMIZER + CHECKPOINTED + SCORED + ZERO2,
    "ours fast, bf16 optimizer, half checkpointed, scored in training, ZeRO-2":
        HYBRID + BF16_OPTIMIZER + CHECKPOINTED + HALF + SCORED + ZERO2,
    # the same with the actor's and critic's blocks compiled for training (--compile_blocks)
    "ours fast, bf16 optimizer, checkpointed, scored in training, ZeRO-2, compiled":
        HYBRID + BF16_OPTIMIZER + CHECKPOINTED + SCORED + ZERO2 + COMPILED,
    "ours fast, bf16 optimizer, half checkpointed, scored in training, ZeRO-2, compiled":
        HYBRID + BF16_OPTIMIZER + CHECKPOINTED + HALF + SCORED + ZERO2 + COMPILED,
    # the step's phase timer synchronizing the GPU at every phase boundary (its earlier form)
    "ours fast, bf16 optimizer, checkpointed, phases synchronized": HYBRID + BF16_OPTIMIZER + CHECKPOINTED,
    # the caching allocator mapping memory into growable segments (PYTORCH_CUDA_ALLOC_CONF):
    # no fragmentation flushes where the live tensors change shape every phase
    "ours fast, bf16 optimizer, checkpointed, scored in training, expandable segments":
        HYBRID + BF16_OPTIMIZER + CHECKPOINTED + SCORED,
    # the allocator's cached free blocks returned to the GPU between the rollout and training
    "ours fast, bf16 optimizer, checkpointed, scored in training, cache emptied before training":
        HYBRID + BF16_OPTIMIZER + CHECKPOINTED + SCORED,
    "hybrid off, bf16 optimizer, checkpointed": BF16_OPTIMIZER + CHECKPOINTED,
    "hybrid off, bf16 optimizer, checkpointed, reference offloaded":
        BF16_OPTIMIZER + CHECKPOINTED + REFERENCE_OFFLOADED,
    # LoRA (rank 128) on the actor's linears, base weights frozen; the critic trains in full;
    # checkpointed: a 7B LoRA actor's activations at 8 x 512 tokens do not fit beside it on 80 GB
    "ours fast, LoRA": HYBRID + LORA,
    "ours fast, LoRA, checkpointed": HYBRID + LORA + CHECKPOINTED,
}
OFFLOADED = tuple(m for m in MODES if "optimizer offloaded" in m)
MODE_ENV = {"ours fast, full-width LM head": {"DSCHAT_FULL_LOGITS": "1"},
            "ours fast, bf16 optimizer, checkpointed, phases synchronized": {"DSCHAT_PHASE_SYNC": "1"},
            "ours fast, replica copied": {"DSCHAT_COPY_REPLICA": "1"},
            "ours fast, bf16 optimizer, checkpointed, scored in training, cache emptied before training":
                {"DSCHAT_EMPTY_CACHE": "1"},
            "ours fast, bf16 optimizer, checkpointed, scored in training, expandable segments":
                {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="bloom-560m", help="A model shape of benchmarks/generation.py.")
    p.add_argument("--critic_preset", default=None,
                   help="The critic's (and reward model's) shape, a model shape of benchmarks/generation.py "
                        "(default: --preset's).")
    p.add_argument("--modes", nargs="+", default=[m for m in MODES if m not in OFFLOADED and "LoRA" not in m],
                   choices=list(MODES), help="Modes to run (default: all but the offloaded and LoRA ones).")
    p.add_argument("--offload_ratio", type=float, default=1.0,
                   help="Step 3's --offload_ratio in the offloaded mode: the share of the optimizer states "
                        "on the CPU (the rest stays on the GPU).")
    p.add_argument("--steps", type=int, default=6, help="PPO steps per mode.")
    p.add_argument("--warmup", type=int, default=2, help="Steps left out of the steady-state mean.")
    p.add_argument("--hybrid_off_steps", type=int, default=None,
                   help="PPO steps of the hybrid-off modes (default: --steps; they run 10-20x slower).")
    p.add_argument("--batch", type=int, default=16, help="Prompts per GPU per step.")
    p.add_argument("--prompt_len", type=int, default=256, help="Prompt tokens (every prompt exactly this long).")
    p.add_argument("--answer_len", type=int, default=256, help="Answer tokens, forced (min = max answer length).")
    p.add_argument("--dtype", default="bf16", help="Training and generation dtype (step 3's --dtype).")
    p.add_argument("--num_gpus", type=int, default=1, help="Ranks per mode (the deepspeed launcher's --num_gpus).")
    p.add_argument("--workdir", default="/tmp/dschat_step3_bench",
                   help="Scratch folder: <workdir>/<preset> holds the random models (built once per preset and "
                        "reused), the prompts and one output folder per mode (cleared before the mode runs).")
    p.add_argument("--out", default=None, help="Append the table (markdown) to this file.")
    p.add_argument("--profile_step", type=int, default=0,
                   help="Pass --profile_step to every mode; its table is copied beside --out "
                        "(or into <workdir>/<preset>) as step3_profile_<mode>.txt, its per-phase wall against kernel "
                        "time as step3_phases_<mode>.md (trace_phases.py), and on CUDA its memory snapshot "
                        "as step3_memory_snapshot_<mode>.pickle (https://pytorch.org/memory_viz).")
    return p.parse_args(argv)


def build_models(preset: str, critic_preset: str, root: Path) -> tuple[Path, Path]:
    """A random actor at `preset`'s shape and a random reward model at `critic_preset`'s,
    each built once under `root` and reused; in bf16 on the GPU where there is one (a 7B
    model initialises in seconds there, minutes on the host)."""
    import torch
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

    from benchmarks.generation import PRESETS
    from dschat.models.model_utils import load_tokenizer, save_hf_format
    from dschat.models.reward_model import RewardModel, save_reward_model

    actor_dir, critic_dir = root / preset / "actor", root / critic_preset / "critic"
    tokenizer = load_tokenizer(None)
    on_gpu = torch.cuda.is_available()
    device, dtype = ("cuda", torch.bfloat16) if on_gpu else ("cpu", torch.float32)

    def config_of(name):
        cfg = dict(PRESETS[name])
        config = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
        config.pad_token_id, config.eos_token_id, config.bos_token_id = 0, 1, 2
        return config

    torch.manual_seed(0)
    if not (actor_dir / "model.safetensors").exists() and not (actor_dir / "model.safetensors.index.json").exists():
        with torch.device(device):
            actor = AutoModelForCausalLM.from_config(config_of(preset), dtype=dtype)
        save_hf_format(actor, tokenizer, actor_dir)
        del actor
    if not (critic_dir / "reward_model.json").exists():
        with torch.device(device):
            backbone = AutoModel.from_config(config_of(critic_preset), dtype=dtype)
        save_reward_model(RewardModel(backbone, pad_token_id=tokenizer.pad_token_id), tokenizer, critic_dir)
        del backbone     # else it stays on the GPU beside every mode's run (2.2 GB at TinyLlama-1.1B)
    if on_gpu:
        torch.cuda.empty_cache()
    return actor_dir, critic_dir


def write_prompts(path: Path, prompt_len: int, n: int) -> None:
    """Prompts of exactly `prompt_len` tokens of the bundled tokenizer (random word salad)."""
    from dschat.models.model_utils import load_tokenizer
    tok = load_tokenizer(None)
    words = [w for w in ("apple red blue seven capital France dog says moo plus minus times larger "
                         "smaller spell backwards letter the of is what which how many legs").split()]
    rng = random.Random(0)
    with open(path, "w") as f:
        for _ in range(n):
            text = "\n\nHuman:"
            while len(tok(text + " x\n\nAssistant:")["input_ids"]) < prompt_len:
                text += " " + rng.choice(words)
            prompt = text + "\n\nAssistant:"
            while len(tok(prompt)["input_ids"]) > prompt_len:  # trim overshoot
                text = text.rsplit(" ", 1)[0]
                prompt = text + "\n\nAssistant:"
            f.write(json.dumps({"prompt": prompt, "response": " ok"}) + "\n")


def steps_of(mode: str, args) -> int:
    return args.hybrid_off_steps if mode.startswith("hybrid off") and args.hybrid_off_steps else args.steps


def run_mode(mode, args, actor, critic, prompts, workdir) -> list[dict]:
    out = workdir / mode.replace(" ", "_")
    shutil.rmtree(out, ignore_errors=True)          # metrics.jsonl appends: no rows of an earlier run
    cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", str(args.num_gpus),
           str(REPO / "training/step3_rlhf_finetuning/main.py"),
           "--actor_model_name_or_path", str(actor), "--critic_model_name_or_path", str(critic),
           "--data_path", str(prompts), "--data_split", "0,0,1", "--data_output_path", str(workdir / "cache"),
           "--actor_zero_stage", "3", "--critic_zero_stage", "3", "--dtype", args.dtype,
           "--per_device_generation_batch_size", str(args.batch), "--per_device_training_batch_size", str(args.batch),
           "--max_prompt_seq_len", str(args.prompt_len), "--max_answer_seq_len", str(args.answer_len),
           "--min_answer_seq_len", str(args.answer_len), "--max_steps", str(steps_of(mode, args)),
           "--num_warmup_steps", "0", "--output_dir", str(out), "--skip_final_save", *MODES[mode]]
    if args.profile_step:
        cmd += ["--profile_step", str(args.profile_step)]
    if mode in OFFLOADED:
        cmd += ["--offload_ratio", str(args.offload_ratio)]
    env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
               **MODE_ENV.get(mode, {}))
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        print(proc.stdout[-4000:], proc.stderr[-4000:], file=sys.stderr)
        return []
    table = out / "profile" / f"step_{args.profile_step}.txt"
    snapshot = out / "profile" / f"memory_snapshot_step{args.profile_step}.pickle"
    dest = Path(args.out).parent if args.out else workdir
    name = mode.replace(' ', '_').replace(',', '')
    if args.profile_step and table.exists():
        dest.mkdir(parents=True, exist_ok=True)
        (dest / f"step3_profile_{name}.txt").write_text(table.read_text())
    trace = out / "profile" / f"step_{args.profile_step}.trace.json"
    if args.profile_step and trace.exists():         # host-bound or GPU-bound, per phase
        dest.mkdir(parents=True, exist_ok=True)
        (dest / f"step3_phases_{name}.md").write_text(phase_report(str(trace)))
    if args.profile_step and snapshot.exists():
        dest.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(snapshot, dest / f"step3_memory_snapshot_{name}.pickle")
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def phase_means(steady: list[dict]) -> dict:
    """Steady-state mean of every phase key (time/<phase>_s, memory/<phase>_peak_gib) the
    rows hold, over the rows that hold it."""
    from dschat.rlhf.trainer import STEP3_PHASES
    out = {}
    for phase in STEP3_PHASES:
        for key in (f"time/{phase}_s", f"memory/{phase}_peak_gib"):
            values = [r[key] for r in steady if key in r]
            if values:
                out[key] = sum(values) / len(values)
    return out


def phase_tables(results: dict) -> list[str]:
    """Markdown lines: seconds per phase for every mode, then (CUDA runs) peak GiB per phase;
    a phase that no mode ran has no column, one a mode did not run is '-'."""
    from dschat.rlhf.trainer import STEP3_PHASES
    tables = (("time/{}_s", "{:.3f}", "seconds per phase, GPU time on CUDA (gen within 'generation s', "
                                      "score_* within 'scoring s', the rest within 'training s')"),
              ("memory/{}_peak_gib", "{:.2f}", "peak GiB allocated per phase (CUDA)"))
    lines = []
    for key, fmt, title in tables:
        phases = [p for p in STEP3_PHASES if any(r and key.format(p) in r["phases"] for r in results.values())]
        if not phases:
            continue
        lines += ["", title, "", "| mode | " + " | ".join(phases) + " |", "|---|" + "---|" * len(phases)]
        for mode, r in results.items():
            got = r["phases"] if r else {}
            cells = [fmt.format(got[key.format(p)]) if key.format(p) in got else "-" for p in phases]
            lines.append(f"| {mode} | " + " | ".join(cells) + " |")
    return lines


def main(argv=None):
    args = parse_args(argv)
    critic_preset = args.critic_preset or args.preset
    # the models are built once per preset and kept; the runs' folders are per actor + critic pair
    workdir = Path(args.workdir) / (args.preset if critic_preset == args.preset else f"{args.preset}+{critic_preset}")
    workdir.mkdir(parents=True, exist_ok=True)
    actor, critic = build_models(args.preset, critic_preset, Path(args.workdir))
    prompts = workdir / "prompts.jsonl"
    write_prompts(prompts, args.prompt_len, args.batch * args.num_gpus * (args.steps + 1) * 2)
    results = {}
    for mode in args.modes:
        rows = run_mode(mode, args, actor, critic, prompts, workdir)
        # the profiled step runs slower under torch.profiler: left out of the mean
        warmup = min(args.warmup, steps_of(mode, args) - 1)
        steady = [r for i, r in enumerate(rows) if i >= warmup and i + 1 != args.profile_step] or rows
        if not steady:
            results[mode] = None
            continue
        mean = lambda k: sum(r.get(k, 0.0) for r in steady) / len(steady)  # noqa: E731
        results[mode] = {k: mean(k) for k in ("time/step_s", "time/generate_s", "time/score_s", "time/train_s",
                                              "gen/fill_seconds", "memory/peak_gib",
                                              "memory/host_peak_gib", "memory/reserved_peak_gib",
                                              "memory/allocator_flushes")}
        results[mode]["samples_per_s"] = args.batch * args.num_gpus / results[mode]["time/step_s"]
        results[mode]["phases"] = phase_means(steady)
        results[mode]["steps"] = len(rows)
        results[mode]["left_gathered_max"] = max(r.get("zero/params_left_gathered", 0) for r in rows)
        results[mode]["reward_first_last"] = (rows[0].get("ppo/reward_mean"), rows[-1].get("ppo/reward_mean"))
        print(mode, json.dumps(results[mode]), flush=True)
    lines = [f"step 3, {args.preset} actor + {critic_preset} critic at ZeRO-3, {args.dtype}, {args.num_gpus} GPU(s), "
             f"{args.batch} x ({args.prompt_len} + {args.answer_len}) per GPU per step; mean of steps "
             f"{args.warmup + 1}..{args.steps}"
             + (f" except the profiled step {args.profile_step}" if args.profile_step else "")
             + (f"; offloaded modes keep {args.offload_ratio:.0%} of the optimizer states on the host"
                if any(m in OFFLOADED for m in args.modes) else ""), "",
             "| mode | step s | generation s | scoring s | training s | refill s | samples/s | x hybrid off | peak GiB "
             "| reserved GiB | allocator flushes per step | host peak GiB | steps done | params left gathered (max) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    base = next((r["samples_per_s"] for m, r in results.items() if m.startswith("hybrid off") and r), None)
    for mode, r in results.items():
        if r is None:
            lines.append(f"| {mode} | failed | | | | | | | | | | | | |")
            continue
        ratio = r["samples_per_s"] / base if base else float("nan")
        lines.append(f"| {mode} | {r['time/step_s']:.2f} | {r['time/generate_s']:.2f} | {r['time/score_s']:.2f} | "
                     f"{r['time/train_s']:.2f} | {r['gen/fill_seconds']:.3f} | {r['samples_per_s']:.2f} | "
                     f"{ratio:.2f} | {r['memory/peak_gib']:.1f} | {r['memory/reserved_peak_gib']:.1f} | "
                     f"{r['memory/allocator_flushes']:.1f} | {r['memory/host_peak_gib']:.1f} | {r['steps']} | "
                     f"{int(r['left_gathered_max'])} |")
    lines += phase_tables(results)
    table = "\n".join(lines) + "\n"
    emit_table(table, args.out)


if __name__ == "__main__":
    main()

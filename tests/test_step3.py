"""Step 3 end to end: PPO on real DeepSpeed engines across 2 CPU ranks (gloo), ZeRO-3."""
import json
import os
from collections import defaultdict
from pathlib import Path

import pytest

from dschat.utils.metrics import read_metrics
from tests.dist_utils import REPO, run_deepspeed, run_python

STEP1 = REPO / "training" / "step1_supervised_finetuning" / "main.py"
STEP2 = REPO / "training" / "step2_reward_model_finetuning" / "main.py"
STEP3 = REPO / "training" / "step3_rlhf_finetuning" / "main.py"
COMMON = ["--data_split", "6,3,1", "--dtype", "fp32", "--seed", "1234"]


@pytest.fixture(scope="module")
def sft_and_rm(tmp_path_factory):
    """A tiny Bloom actor and critic made by steps 1 and 2 (a few steps each)."""
    root = tmp_path_factory.mktemp("s3")
    cache = root / "cache"
    run_deepspeed(STEP1, ["--model_name_or_path", "configs/tiny/bloom.json", "--output_dir", root / "step1",
                          "--zero_stage", "3", "--max_seq_len", "48", "--per_device_train_batch_size", "16",
                          "--max_steps", "30", "--learning_rate", "3e-3", "--eval_iters", "1",
                          "--data_output_path", cache, *COMMON])
    run_deepspeed(STEP2, ["--model_name_or_path", root / "step1", "--output_dir", root / "step2",
                          "--zero_stage", "3", "--max_seq_len", "48", "--per_device_train_batch_size", "8",
                          "--max_steps", "10", "--eval_iters", "1", "--data_output_path", cache, *COMMON])
    return root


def step3_args(root, out, steps, extra=()):
    return ["--actor_model_name_or_path", root / "step1", "--critic_model_name_or_path", root / "step2",
            "--output_dir", out, "--actor_zero_stage", "3", "--critic_zero_stage", "3",
            "--per_device_generation_batch_size", "2", "--per_device_training_batch_size", "2",
            "--max_prompt_seq_len", "24", "--max_answer_seq_len", "8", "--num_warmup_steps", "0",
            "--actor_learning_rate", "1e-4", "--critic_learning_rate", "1e-4", "--max_steps", str(steps),
            "--data_output_path", root / "cache", "--dump_generations", Path(out) / "gen.jsonl", *COMMON, *extra]


def dumped(out):
    return [json.loads(line) for line in (Path(out) / "gen.jsonl").read_text().splitlines()]


PPO_PHASES = ("gen", "score_actor", "score_ref", "score_reward", "score_critic", "actor_fwd", "actor_bwd",
              "actor_step", "critic_fwd", "critic_bwd", "critic_step")
CRITIC_PHASES = ("score_critic", "critic_fwd", "critic_bwd", "critic_step")


def check_phases(rows, phases, absent=()):
    """Every row holds time/<phase>_s >= 0 of each phase and none of `absent`; no per-phase
    memory on CPU; the scoring phases fit inside time/score_s (they are nested in it)."""
    for r in rows:
        for phase in phases:
            assert r[f"time/{phase}_s"] >= 0, (r["step"], phase)
        for phase in absent:
            assert f"time/{phase}_s" not in r, (r["step"], phase)
        # CPU: no per-phase memory, only the run's peak (here the host's) and the host's peak
        assert not [k for k in r if k.startswith("memory/") and k not in ("memory/peak_gib", "memory/host_peak_gib")], r
        assert abs(r["memory/host_peak_gib"] - r["memory/peak_gib"]) < 0.05 and r["memory/peak_gib"] > 0, r
        scoring = sum(v for k, v in r.items() if k.startswith("time/score_") and k != "time/score_s")
        assert scoring <= r["time/score_s"] + 0.01, (r["step"], scoring, r["time/score_s"])


def test_twenty_ppo_steps_zero3_hybrid_engine(sft_and_rm, tmp_path):
    run_deepspeed(STEP3, step3_args(sft_and_rm, tmp_path, 20, ["--enable_hybrid_engine", "--enable_ema"]))
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert len(rows) == 20
    # no ZeRO-3 parameter of actor, reference, critic, reward or EMA left gathered or in flight
    assert all(r["zero/params_left_gathered"] == 0 for r in rows)
    for key in ("ppo/reward_mean", "ppo/reward_std", "ppo/kl", "gen/answer_len_mean", "gen/answer_len_max",
                "ppo/actor_clip_frac", "ppo/actor_loss", "ppo/critic_loss", "time/generate_s", "time/score_s",
                "time/train_s", "memory/peak_gib"):
        assert key in rows[-1], key
    check_phases(rows, PPO_PHASES, absent=("ptx_fwd", "ptx_bwd", "ptx_step"))
    # every rank generates for its own prompts
    by_step = defaultdict(lambda: defaultdict(set))
    for row in dumped(tmp_path):
        by_step[row["step"]][row["rank"]].add(row["prompt"])
    assert len(by_step) == 20
    for step, ranks in by_step.items():
        assert set(ranks) == {0, 1} and not ranks[0] & ranks[1], step
    for sub in ("actor", "critic", "actor_ema"):
        assert (tmp_path / sub / "model.safetensors").exists(), sub


def test_hybrid_engine_on_off_and_tensor_parallel_generate_the_same(sft_and_rm, tmp_path):
    on, off, tp = tmp_path / "on", tmp_path / "off", tmp_path / "tp"
    run_deepspeed(STEP3, step3_args(sft_and_rm, on, 3, ["--enable_hybrid_engine"]))
    run_deepspeed(STEP3, step3_args(sft_and_rm, off, 3))
    run_deepspeed(STEP3, step3_args(sft_and_rm, tp, 3, ["--enable_hybrid_engine", "--inference_tp_size", "2"]))
    key = lambda r: (r["step"], r["rank"], r["prompt"])  # noqa: E731
    a = {key(r): r["answer"] for r in dumped(on)}
    b = {key(r): r["answer"] for r in dumped(off)}
    c = {key(r): r["answer"] for r in dumped(tp)}
    assert a.keys() == b.keys() and a == b
    assert c == a


@pytest.mark.parametrize("actor_family,critic_family", [("gpt_neox", "llama"), ("gpt2", "opt")])
def test_other_families_hybrid_engine_on_and_off_agree(tmp_path, actor_family, critic_family):
    """Step 3 beyond Bloom: an actor and a critic of two other families (random tiny models as
    steps 1-2 would save them), both ZeRO-3 on 2 ranks. With the hybrid engine (replica, fast
    decode path where it applies) and without it (generate through ZeRO-3 hooks) the answers
    are the same, PPO runs to the end with finite losses, and the saved actor loads back."""
    from tests.dist.resume_utils import make_step3_models
    (tmp_path / "a").mkdir()
    (tmp_path / "c").mkdir()
    actor, _ = make_step3_models(tmp_path / "a", actor_family)
    _, critic = make_step3_models(tmp_path / "c", critic_family)

    def args(out, extra=()):
        return ["--actor_model_name_or_path", actor, "--critic_model_name_or_path", critic,
                "--output_dir", out, "--actor_zero_stage", "3", "--critic_zero_stage", "3",
                "--per_device_generation_batch_size", "2", "--per_device_training_batch_size", "2",
                "--max_prompt_seq_len", "24", "--max_answer_seq_len", "8", "--num_warmup_steps", "0",
                "--actor_learning_rate", "1e-4", "--critic_learning_rate", "1e-4", "--max_steps", "3",
                "--data_output_path", tmp_path / "cache", "--dump_generations", Path(out) / "gen.jsonl",
                *COMMON, *extra]
    on, off = tmp_path / "on", tmp_path / "off"
    run_deepspeed(STEP3, args(on, ["--enable_hybrid_engine"]))
    run_deepspeed(STEP3, args(off))
    key = lambda r: (r["step"], r["rank"], r["prompt"])  # noqa: E731
    a = {key(r): r["answer"] for r in dumped(on)}
    assert len(a) == 3 * 2 * 2 and a == {key(r): r["answer"] for r in dumped(off)}
    assert len(set(a.values())) > 1, a                                 # answers that vary
    rows = read_metrics(on / "metrics.jsonl")
    assert len(rows) == 3 and all(r["zero/params_left_gathered"] == 0 for r in rows)
    for r in rows:
        for k in ("ppo/actor_loss", "ppo/critic_loss", "ppo/kl", "ppo/reward_mean"):
            assert r[k] == r[k] and abs(r[k]) < 1e6, (k, r[k])        # finite
    from transformers import AutoModelForCausalLM
    saved = AutoModelForCausalLM.from_pretrained(on / "actor")
    assert saved.config.model_type == actor_family


def assert_same_run(a_dir, b_dir, steps: int = 3) -> list[dict]:
    """Two step-3 runs of `steps` PPO steps sampled the same answers (every step, rank and
    prompt) and logged the same reward, KL and losses within 1e-5, with no parameter left
    gathered in either; returns the first run's metrics rows."""
    key = lambda r: (r["step"], r["rank"], r["prompt"])  # noqa: E731
    assert {key(r): r["answer"] for r in dumped(a_dir)} == {key(r): r["answer"] for r in dumped(b_dir)}
    a, b = read_metrics(a_dir / "metrics.jsonl"), read_metrics(b_dir / "metrics.jsonl")
    assert len(a) == len(b) == steps
    for ra, rb in zip(a, b):
        for k in ("ppo/reward_mean", "ppo/kl", "ppo/actor_loss", "ppo/critic_loss"):
            assert abs(ra[k] - rb[k]) <= 1e-5 * max(1.0, abs(ra[k])), (k, ra[k], rb[k])
        assert ra["zero/params_left_gathered"] == 0 and rb["zero/params_left_gathered"] == 0
    return a


def test_unsharded_frozen_models_score_like_zero3_ones(sft_and_rm, tmp_path):
    """--reference_zero_stage 0 / --reward_zero_stage 0 under an actor and critic at ZeRO-3:
    the same answers, rewards, KL and losses as the default (frozen models at ZeRO-3)."""
    sharded, whole = tmp_path / "sharded", tmp_path / "whole"
    run_deepspeed(STEP3, step3_args(sft_and_rm, sharded, 3, ["--enable_hybrid_engine"]))
    proc = run_deepspeed(STEP3, step3_args(sft_and_rm, whole, 3, ["--enable_hybrid_engine", "--reference_zero_stage",
                                                                   "0", "--reward_zero_stage", "0", "--enable_ema",
                                                                   "--profile_step", "2"]))
    assert_same_run(sharded, whole)
    assert (whole / "actor_ema" / "model.safetensors").exists()   # the EMA follows the reference's stage
    # --profile_step 2: rank 0's table names the step's phases, and a trace beside it
    table = (whole / "profile" / "step_2.txt").read_text()
    for phase in ("dschat/generate", "dschat/score/reference", "dschat/train/actor_backward",
                  "dschat/train/critic_step"):
        assert phase in table, phase
    assert (whole / "profile" / "step_2.trace.json").stat().st_size > 0
    assert not (whole / "profile" / "step_1.txt").exists()
    # a torch memory snapshot needs CUDA: said once, none written
    assert (proc.stdout + proc.stderr).count("memory snapshots need CUDA") == 1
    assert not list((whole / "profile").glob("*.pickle"))


def test_frozen_models_unpartitioned_on_one_rank(sft_and_rm, tmp_path):
    """On one rank ZeRO-3 partitions nothing: the reference and reward models of an actor
    and critic at ZeRO-3 default to stage 0 (no gather hooks) and score exactly as at
    ZeRO-3 (--reference_zero_stage 3 --reward_zero_stage 3, upstream's rule)."""
    default, upstream = tmp_path / "default", tmp_path / "upstream"
    proc = run_deepspeed(STEP3, step3_args(sft_and_rm, default, 3, ["--enable_hybrid_engine"]), num_gpus=1)
    log = proc.stdout + proc.stderr
    assert "reference engine ready (ZeRO-0)" in log and "reward engine ready (ZeRO-0)" in log, log[-3000:]
    assert "the frozen models run unpartitioned and the actor generates from its own shards" in log
    assert "generation reads the shards themselves" in log      # the actor's replica: views, no copy
    proc = run_deepspeed(STEP3, step3_args(sft_and_rm, upstream, 3, ["--enable_hybrid_engine", "--reference_zero_stage",
                                                                      "3", "--reward_zero_stage", "3"]), num_gpus=1)
    assert "reference engine ready (ZeRO-3)" in proc.stdout + proc.stderr
    assert_same_run(default, upstream)


def test_lora_actor_reference_is_its_base_with_adapters_off(sft_and_rm, tmp_path):
    """A LoRA actor with frozen base weights scores its reference with the adapters switched
    off (no second copy of the weights): the same answers, KL, rewards and losses as a
    reference model of its own, and the KL moves once the adapters train."""
    shared, separate = tmp_path / "shared", tmp_path / "separate"
    lora = ["--enable_hybrid_engine", "--actor_lora_dim", "4", "--only_optimize_lora",
            "--actor_lora_learning_rate", "3e-2"]
    proc = run_deepspeed(STEP3, step3_args(sft_and_rm, shared, 3, lora))
    run_deepspeed(STEP3, step3_args(sft_and_rm, separate, 3, lora + ["--separate_lora_reference"]))
    assert "LoRA adapters switched off" in proc.stdout + proc.stderr
    a = assert_same_run(shared, separate)
    assert abs(a[0]["ppo/kl"]) < 1e-6 < abs(a[-1]["ppo/kl"])       # LoRA B starts at 0: the actor is its base


@pytest.mark.parametrize("optimizer_dtype", ["fp32", "bf16"])
def test_bf16_actor_and_critic_at_zero3(sft_and_rm, tmp_path, optimizer_dtype):
    # upstream cannot build its critic here: fp32 value head beside a bf16 backbone; with bf16
    # optimizer state both trained models step their bf16 weights as master weights
    run_deepspeed(STEP3, step3_args(sft_and_rm, tmp_path, 2, ["--enable_hybrid_engine", "--dtype", "bf16",
                                                              "--optimizer_dtype", optimizer_dtype]))
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert len(rows) == 2 and all(r["ppo/actor_loss"] == r["ppo/actor_loss"] for r in rows)    # finite
    for model in ("actor", "critic"):
        assert (tmp_path / model / "config.json").exists()


def test_clear_errors_before_any_model_loads(sft_and_rm, tmp_path):
    env_args = step3_args(sft_and_rm, tmp_path / "o", 1, [
        "--critic_model_name_or_path", sft_and_rm / "step1", "--inference_tp_size", "3",
        "--enable_mixed_precision_lora"])
    os.environ["WORLD_SIZE"] = "2"
    try:
        proc = run_python(STEP3, env_args, check=False)
    finally:
        del os.environ["WORLD_SIZE"]
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    for needle in ("--inference_tp_size 3 does not divide world size 2", "is not a reward model",
                   "--enable_mixed_precision_lora needs"):
        assert needle in proc.stderr, proc.stderr
    proc = run_python(STEP3, step3_args(sft_and_rm, tmp_path / "p", 1, ["--max_prompt_seq_len", "3"]), check=False)
    assert proc.returncode == 2 and "--max_prompt_seq_len 3" in proc.stderr and "Traceback" not in proc.stderr
    assert "actor engine ready" not in proc.stdout


def test_fused_and_plain_log_probs_train_the_same(sft_and_rm, tmp_path):
    """--logprobs fused (output layer + log-softmax in token chunks, under ZeRO-3 with a tied
    output layer) and plain give the same 5 PPO steps on 2 ranks, losses within 1e-5."""
    runs = {}
    for mode in ("fused", "plain"):
        out = tmp_path / mode
        proc = run_deepspeed(STEP3, step3_args(sft_and_rm, out, 5, ["--enable_hybrid_engine", "--logprobs", mode]))
        log = proc.stdout + proc.stderr
        assert ("output layer fused" in log, "fused output layer off: --logprobs plain" in log) == \
            (mode == "fused", mode == "plain")
        runs[mode] = read_metrics(out / "metrics.jsonl")
    assert len(runs["fused"]) == len(runs["plain"]) == 5
    for fused, plain in zip(runs["fused"], runs["plain"]):
        for key in ("ppo/actor_loss", "ppo/critic_loss", "ppo/kl", "ppo/entropy", "ppo/reward_mean"):
            assert abs(fused[key] - plain[key]) <= 1e-5, (fused["step"], key, fused[key], plain[key])
    assert any(r["ppo/actor_loss"] != 0 for r in runs["fused"])


def test_scoring_in_the_training_forward_trains_the_same(sft_and_rm, tmp_path):
    """--score_in_training_forward: old log-probs and values from the training forwards (no
    actor or critic scoring pass) give the same 5 PPO steps on 2 ranks at ZeRO-3, losses within
    1e-5, and answers token for token; the ratio is exactly 1 (nothing clipped). A round that
    trains twice on its rollout is refused, naming the flag."""
    runs = {}
    for name, extra in (("scored", []), ("in_training", ["--score_in_training_forward"])):
        out = tmp_path / name
        run_deepspeed(STEP3, step3_args(sft_and_rm, out, 5, ["--enable_hybrid_engine", *extra]))
        runs[name] = (read_metrics(out / "metrics.jsonl"), dumped(out))
    (scored, scored_gen), (shortcut, shortcut_gen) = runs["scored"], runs["in_training"]
    assert len(scored) == len(shortcut) == 5
    for a, b in zip(scored, shortcut):
        for key in ("ppo/actor_loss", "ppo/critic_loss", "ppo/kl", "ppo/reward_mean", "ppo/value_mean",
                    "ppo/adv_mean", "ppo/entropy"):
            assert abs(a[key] - b[key]) <= 1e-5, (a["step"], key, a[key], b[key])
        assert b["ppo/actor_clip_frac"] == 0.0
    assert [r["answer"] for r in scored_gen] == [r["answer"] for r in shortcut_gen]
    assert any(r["ppo/actor_loss"] != 0 for r in shortcut)
    check_phases(shortcut, ("gen", "score_ref", "score_reward", "actor_fwd", "critic_fwd"),
                 absent=("score_actor", "score_critic"))
    proc = run_python(STEP3, step3_args(sft_and_rm, tmp_path / "bad", 1, ["--score_in_training_forward",
                                                                          "--ppo_epochs", "2"]), check=False)
    assert proc.returncode == 2 and "--score_in_training_forward needs --ppo_epochs 1" in proc.stderr, proc.stderr


def test_compiled_blocks_train_the_same(sft_and_rm, tmp_path):
    """--compile_blocks: actor and critic at ZeRO-2 on 2 ranks, checkpointed, their blocks
    compiled for training, give the same answers and 3 PPO steps as eager blocks, losses within
    1e-5; with a trained model at ZeRO-3 the flag is refused, naming it."""
    zero2 = ["--enable_hybrid_engine", "--actor_zero_stage", "2", "--critic_zero_stage", "2",
             "--actor_gradient_checkpointing", "--critic_gradient_checkpointing"]
    run_deepspeed(STEP3, step3_args(sft_and_rm, tmp_path / "eager", 3, zero2))
    proc = run_deepspeed(STEP3, step3_args(sft_and_rm, tmp_path / "compiled", 3, [*zero2, "--compile_blocks"]))
    assert "actor: 4 blocks compiled for training" in proc.stdout and "critic: 4 blocks compiled" in proc.stdout
    rows = assert_same_run(tmp_path / "eager", tmp_path / "compiled")
    assert any(r["ppo/actor_loss"] != 0 for r in rows)
    proc = run_python(STEP3, step3_args(sft_and_rm, tmp_path / "bad", 1, ["--compile_blocks"]), check=False)
    assert proc.returncode == 2 and "--compile_blocks needs the trained models at ZeRO 0-2" in proc.stderr, proc.stderr

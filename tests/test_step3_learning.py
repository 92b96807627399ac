"""Step 3 learns what it should: models in the right mode, PPO ratio 1 at the first
micro-step, ptx mixed in once per row and step, the LR schedule's length, EMA with LoRA,
mask holes. Multi-rank: 2 CPU ranks, actor and critic at ZeRO-3, tiny OPT models whose
configs have dropout 0.1 (OPT's default), probed by tests/dist/step3_probe.py.
"""
import json
from collections import Counter
from pathlib import Path

import pytest

from dschat.utils.metrics import read_metrics
from tests.dist.resume_utils import launch, make_step3_models
from tests.dist_utils import REPO
from tests.test_step3 import PPO_PHASES, check_phases

PROBE = REPO / "tests" / "dist" / "step3_probe.py"
DROPOUT = {"dropout": 0.1, "attention_dropout": 0.1, "activation_dropout": 0.1}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("learning")
    actor, critic = make_step3_models(root, "opt", DROPOUT)
    return root, actor, critic


def argv(models, out, *, steps=2, gen=2, train=1, extra=()):
    root, actor, critic = models
    return ["--actor_model_name_or_path", str(actor), "--critic_model_name_or_path", str(critic),
            "--actor_zero_stage", "3", "--critic_zero_stage", "3", "--dtype", "fp32",
            "--output_dir", str(out), "--data_output_path", str(root / "cache"), "--data_split", "6,3,1",
            "--per_device_generation_batch_size", str(gen), "--per_device_training_batch_size", str(train),
            "--max_prompt_seq_len", "24", "--max_answer_seq_len", "6", "--min_answer_seq_len", "4",
            "--actor_learning_rate", "1e-3", "--critic_learning_rate", "1e-3", "--num_warmup_steps", "0",
            "--max_steps", str(steps), "--seed", "1234", *map(str, extra)]


def probe(tmp_path, runs: dict[str, dict], timeout: int = 900) -> dict[str, list[dict]]:
    """Run each {name: {"argv": [...], ...}} in one 2-rank launch; name -> [rank 0, rank 1] records."""
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"runs": [{"name": n, **r} for n, r in runs.items()], "out": str(tmp_path / "r")}))
    proc = launch(PROBE, ["--plan", plan], timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-8000:]
    return {n: [json.loads(Path(f"{tmp_path / 'r'}.{n}.rank{k}.json").read_text()) for k in (0, 1)] for n in runs}


def check_scoring(rec):
    """Every model in eval mode while scoring; the reward of the same sequences is the same."""
    assert rec["modes"] and all(not any(m.values()) for m in rec["modes"]), rec["modes"]
    assert max(rec["reward_repeat"]) == 0.0, rec["reward_repeat"]


def check_first_micro(rec, bound, tag=""):
    assert rec["first_micro"], (tag, rec)
    for first in rec["first_micro"]:
        assert first["log_ratio"] <= bound and first["clip_frac"] == 0.0, (tag, rec["first_micro"])


def test_models_in_eval_while_scoring_and_ratio_one_at_first_micro_step(models, tmp_path):
    """fp32, no actor/critic dropout (the step-3 default): each round's first PPO micro-step
    sees ratio 1 (clip fraction 0) for full, layered and tensor-parallel generation, with and
    without LoRA; reward, reference, critic and EMA are in eval mode while scoring (their
    configs have dropout 0.1), so scoring twice gives the same rewards. Row 0's answer has a
    pad token inside (a mask hole): the KL-reward lands on the reward model's end token."""
    lora = ["--actor_lora_dim", "4", "--critic_lora_dim", "4"]
    modes = {"full": ["--enable_hybrid_engine"], "layered": ["--enable_hybrid_engine", "--unpin_actor_parameters"],
             "tp": ["--enable_hybrid_engine", "--inference_tp_size", "2"]}
    runs = {}
    for name, flags in modes.items():
        runs[name] = {"argv": argv(models, tmp_path / name, extra=[*flags, "--enable_ema"]), "hole": True}
        runs[name + "_lora"] = {"argv": argv(models, tmp_path / (name + "_lora"), extra=[*flags, *lora])}
    results = probe(tmp_path, runs)
    for name, recs in results.items():
        for rec in recs:
            check_scoring(rec)
            check_first_micro(rec, 1e-5, name)
            assert rec["kl_end"] and rec["kl_end"] == rec["score_end"], (name, rec["kl_end"], rec["score_end"])


def test_ptx_rows_once_per_epoch_one_step_per_ppo_step_and_schedule_length(models, tmp_path):
    """ptx with generation batch 4, training batch 2, 2 PPO epochs: every ptx row is trained
    exactly once per epoch; the actor (accumulation doubled) steps as often as the critic;
    with gradient accumulation 1 and 2, and with a generation batch smaller than the
    training batch (2 x --generation_batches 2, training batch 4), the LR schedule's length
    is the optimizer steps taken (the cosine ends at 0 on the last one)."""
    ptx = ["--unsupervised_dataset_name", "dschat/synthetic-assistant", "--ppo_epochs", "2"]
    runs = {"gas1": {"argv": argv(models, tmp_path / "gas1", steps=3, gen=4, train=2, extra=ptx)},
            "gas2": {"argv": argv(models, tmp_path / "gas2", steps=3, gen=4, train=2,
                                  extra=[*ptx, "--gradient_accumulation_steps", "2"])},
            "small_gen": {"argv": argv(models, tmp_path / "small_gen", steps=4, gen=2, train=4,
                                       extra=["--generation_batches", "2", "--dump_generations",
                                              tmp_path / "small_gen" / "gen.jsonl"])}}
    results = probe(tmp_path, runs)
    # (run, optimizer steps per round, rounds, accumulation): small_gen trains each 2-row
    # generation batch as one micro-batch, two per round
    for name, per_round, rounds, gas in (("gas1", 4, 3, 1), ("gas2", 2, 3, 2), ("small_gen", 2, 2, 1)):
        for rec in results[name]:
            steps = rec["steps"]
            assert steps["num_total_iters"] == rounds * per_round and len(rec["ptx"]) == rounds, (name, steps)
            assert steps["actor"] == steps["critic"] == steps["actor_sched"] == steps["critic_sched"] \
                == steps["num_total_iters"], (name, steps)
            assert steps["actor_lr_end"] == steps["critic_lr_end"] == 0.0, (name, steps)
            assert all(b >= a for a, b in zip(rec["lr"][1:], rec["lr"])), (name, rec["lr"])  # no climb back
            for r in rec["ptx"]:
                assert r["actor_steps"][1] - r["actor_steps"][0] == r["critic_steps"][1] - r["critic_steps"][0] \
                    == per_round, (name, r["actor_steps"], r["critic_steps"])
                if name != "small_gen":
                    assert len(r["given"]) == 4
                    assert Counter(map(tuple, r["trained"])) == Counter({tuple(row): 2 for row in r["given"]})
            if name != "small_gen":
                assert steps["actor_gas"] == 2 * gas
    # the ptx loss's forward, backward and step are phases of their own (time/ptx_*_s)
    check_phases(read_metrics(tmp_path / "gas1" / "metrics.jsonl"), PPO_PHASES + ("ptx_fwd", "ptx_bwd", "ptx_step"))
    small_gen_rows = read_metrics(tmp_path / "small_gen" / "metrics.jsonl")
    check_phases(small_gen_rows, PPO_PHASES, absent=("ptx_fwd", "ptx_bwd", "ptx_step"))
    # one row per round of --generation_batches 2: its samples/s counts both rollouts of 2 rows
    # on 2 ranks over the round's seconds, which hold both rollouts' generation
    assert len(small_gen_rows) == 2, small_gen_rows
    answers = [json.loads(line) for line in (tmp_path / "small_gen" / "gen.jsonl").read_text().splitlines()]
    for r in small_gen_rows:
        assert abs(r["ppo/samples_per_s"] * r["time/step_s"] - 2 * 2 * 2) < 1e-6, r
        assert r["time/generate_s"] + r["time/train_s"] <= r["time/step_s"], r
        # and its reward is the mean over both rollouts' 8 answers (rounds end at steps 2 and 4)
        rewards = [a["reward"] for a in answers if a["step"] in (r["step"] - 1, r["step"])]
        assert len(rewards) == 8 and abs(r["ppo/reward_mean"] - sum(rewards) / 8) < 1e-5, (r, rewards)


def test_ema_of_a_lora_actor_averages_its_merged_weights(models, tmp_path):
    """--only_optimize_lora --enable_ema, one PPO micro-step: the EMA moved off the SFT
    weights and equals beta * sft + (1 - beta) * (base + LoRA delta) of the trained actor."""
    extra = ["--enable_hybrid_engine", "--actor_lora_dim", "4", "--only_optimize_lora", "--enable_ema",
             "--zero3_hook_granularity", "module"]
    rec0, rec1 = probe(tmp_path, {"ema": {"argv": argv(models, tmp_path / "ema", steps=1, gen=2, train=2,
                                                        extra=extra)}})["ema"]
    for rec in (rec0, rec1):
        ema = rec["ema"]
        assert ema["compared"] > 10 and ema["actor_vs_sft"] > 1e-4, ema
        assert ema["ema_vs_sft"] > 1e-7 and ema["ema_vs_one_update"] < 1e-6, ema


def test_schedule_length_counts_optimizer_steps():
    from dschat.rlhf.engine import ppo_optimizer_steps
    steps = lambda **k: ppo_optimizer_steps(  # noqa: E731
        10, **{"generation_batches": 1, "generation_batch_size": 4, "training_batch_size": 2, "ppo_epochs": 1,
               "gradient_accumulation_steps": 1, **k})
    assert steps() == 20
    assert steps(gradient_accumulation_steps=2) == 10
    assert steps(generation_batch_size=2, training_batch_size=4) == 10     # upstream's gen // train is 0 here
    assert steps(generation_batch_size=5, training_batch_size=2) == 30     # the last micro-batch is smaller
    assert steps(generation_batches=3, ppo_epochs=2) == 9 * 2 * 2          # the 10th batch never trains
    assert steps(gradient_accumulation_steps=3) == 6


def test_lora_at_zero3_only_lora_with_block_hooks_and_bf16(models, tmp_path):
    """--only_optimize_lora (actor and critic LoRA) with the default block hook granularity
    trains like --zero3_hook_granularity module (same merged actor after one step); bf16
    with actor LoRA at ZeRO-3 builds and trains, its first micro-step's |log-ratio| within
    0.02 (bf16: the experience pass and the training forward may round differently)."""
    lora = ["--enable_hybrid_engine", "--actor_lora_dim", "4", "--critic_lora_dim", "4", "--only_optimize_lora",
            "--enable_ema"]
    runs = {"block": {"argv": argv(models, tmp_path / "block", steps=1, gen=2, train=2, extra=lora)},
            "module": {"argv": argv(models, tmp_path / "module", steps=1, gen=2, train=2,
                                    extra=[*lora, "--zero3_hook_granularity", "module"])},
            "bf16": {"argv": argv(models, tmp_path / "bf16", steps=2,
                                  extra=["--enable_hybrid_engine", "--dtype", "bf16", "--actor_lora_dim", "4"])}}
    results = probe(tmp_path, runs)
    for block, module in zip(results["block"], results["module"]):
        check_scoring(block)
        check_first_micro(block, 1e-5)
        assert block["ema"]["actor_vs_sft"] > 1e-4, block["ema"]
        assert block["ema"] == pytest.approx(module["ema"], rel=1e-4, abs=1e-7), (block["ema"], module["ema"])
    for rec in results["bf16"]:
        check_scoring(rec)
        check_first_micro(rec, 0.02)

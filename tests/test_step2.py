"""Step 2 end to end on real DeepSpeed engines across 2 CPU ranks (gloo)."""
import json
from pathlib import Path

import pytest

from dschat.utils.metrics import read_metrics
from tests.dist_utils import REPO, run_deepspeed, run_python

MAIN = REPO / "training" / "step2_reward_model_finetuning" / "main.py"
RW_EVAL = REPO / "training" / "step2_reward_model_finetuning" / "rw_eval.py"
HH = REPO.parent / "shared" / "data" / "hh-rlhf" / "harmless-base-test.jsonl.gz"


def step2_args(out, model="configs/tiny/bloom.json", steps=5, batch=4, extra=()):
    return ["--model_name_or_path", model, "--dtype", "fp32", "--output_dir", out,
            "--max_seq_len", "64", "--per_device_train_batch_size", str(batch),
            "--per_device_eval_batch_size", "16", "--max_steps", str(steps), "--eval_iters", "4",
            "--data_output_path", Path(out) / "cache", "--dropout", "0", "--learning_rate", "5e-4", *extra]


def metric(out, key):
    return [r[key] for r in read_metrics(Path(out) / "metrics.jsonl") if key in r]


@pytest.fixture(scope="module")
def zero3_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("s2_z3")
    run_deepspeed(MAIN, step2_args(out, steps=40, batch=8, extra=["--zero_stage", "3", "--eval_interval", "40"]))
    return out


def test_zero3_two_ranks_equals_zero0_one_rank(tmp_path):
    z3, z0 = tmp_path / "z3", tmp_path / "z0"
    run_deepspeed(MAIN, step2_args(z3, batch=4, extra=["--zero_stage", "3"]))
    run_python(MAIN, step2_args(z0, batch=8, extra=["--zero_stage", "0"]))
    a, b = metric(z3, "train/loss"), metric(z0, "train/loss")
    assert len(a) == len(b) == 5
    assert max(abs(x - y) for x, y in zip(a, b)) < 1e-4, (a, b)


def test_reward_model_learns_and_saves_a_folder_step3_can_read(zero3_run):
    acc = metric(zero3_run, "eval/acc")
    assert acc[0] < 0.65 and acc[-1] > acc[0] + 0.15, acc
    for f in ("config.json", "model.safetensors", "tokenizer.json", "reward_model.json", "training_config.json"):
        assert (zero3_run / f).exists(), f
    proc = run_python(RW_EVAL, ["--model_name_or_path", zero3_run, "--prompt", "What is the capital of Egypt?",
                                "--answer", " Of course! The capital of Egypt is Cairo.",
                                "--answer", " Figure it out yourself."])
    good, rude = [json.loads(line)["score"] for line in proc.stdout.strip().splitlines()[-2:]]
    assert good > rude


@pytest.mark.skipif(not HH.exists(), reason=f"HH sample not found at {HH} (../shared absent)")
def test_hh_sample_trains(tmp_path):
    run_deepspeed(MAIN, step2_args(tmp_path, steps=3, batch=2, extra=[
        "--zero_stage", "3", "--data_path", HH, "--max_seq_len", "128"]))
    assert (tmp_path / "reward_model.json").exists()
    assert len(metric(tmp_path, "train/loss")) == 3


def test_causal_lm_folder_as_critic_path_is_a_clear_error(tmp_path):
    proc = run_python(RW_EVAL, ["--model_name_or_path", REPO / "configs" / "tiny", "--prompt", "a", "--answer", "b"],
                      check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr

"""Step 1 end to end on real DeepSpeed engines across 2 CPU ranks (gloo)."""
import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from dschat.data import create_prompt_dataset
from dschat.models.model_utils import load_tokenizer
from dschat.utils.metrics import read_metrics
from tests.dist_utils import REPO, run_deepspeed, run_python

MAIN = REPO / "training" / "step1_supervised_finetuning" / "main.py"


def step1_args(out, data_cache, config="bloom", steps=5, batch=8, extra=()):
    return ["--model_name_or_path", f"configs/tiny/{config}.json", "--dtype", "fp32",
            "--output_dir", out, "--max_seq_len", "64", "--per_device_train_batch_size", str(batch),
            "--per_device_eval_batch_size", "16", "--max_steps", str(steps), "--eval_iters", "3",
            "--data_output_path", data_cache, "--dropout", "0", "--learning_rate", "1e-3", *extra]


def losses(out):
    return [r["train/loss"] for r in read_metrics(Path(out) / "metrics.jsonl") if "train/loss" in r]


@pytest.fixture(scope="module")
def zero3_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("s1_z3")
    run_deepspeed(MAIN, step1_args(out, out / "cache", batch=8, extra=["--zero_stage", "3"]), num_gpus=2)
    return out


@pytest.fixture(scope="module")
def zero0_run(tmp_path_factory):
    # the same global batch on one rank: 1 x 16 against 2 ranks x 8
    out = tmp_path_factory.mktemp("s1_z0")
    run_python(MAIN, step1_args(out, out / "cache", batch=16, extra=["--zero_stage", "0"]))
    return out


def test_zero3_two_ranks_equals_zero0_one_rank(zero3_run, zero0_run):
    z3, z0 = losses(zero3_run), losses(zero0_run)
    assert len(z3) == len(z0) == 5
    assert max(abs(a - b) for a, b in zip(z3, z0)) < 1e-4, (z3, z0)
    assert z3[-1] < z3[0]  # and it learns


def test_zero3_offload_and_checkpointing_equal_zero0(zero0_run, tmp_path):
    """ZeRO-3 with parameters and optimizer offloaded to the CPU (DeepSpeedCPUAdam) and
    activation checkpointing, block-granular hooks (the default): the same losses."""
    run_deepspeed(MAIN, step1_args(tmp_path, tmp_path / "cache", batch=8,
                                   extra=["--zero_stage", "3", "--offload", "--gradient_checkpointing"]),
                  num_gpus=2)
    got, want = losses(tmp_path), losses(zero0_run)
    assert len(got) == len(want) == 5
    assert max(abs(a - b) for a, b in zip(got, want)) < 1e-4, (got, want)
    config = json.loads((tmp_path / "training_config.json").read_text())
    assert "BloomBlock" in json.dumps(config), "block-granular hooks not in the saved ds config"


def test_saved_model_gives_the_same_eval_loss_without_deepspeed(zero3_run):
    for f in ("config.json", "model.safetensors", "tokenizer.json", "generation_config.json",
              "training_config.json", "metrics.jsonl"):
        assert (zero3_run / f).exists(), f
    final = json.loads((zero3_run / "training_config.json").read_text())["final_eval"]["loss"]
    tokenizer = load_tokenizer(str(zero3_run))
    model = AutoModelForCausalLM.from_pretrained(zero3_run).eval()
    _, eval_data = create_prompt_dataset(0, ["dschat/synthetic-assistant"], "2,4,4", str(zero3_run / "cache"),
                                         1, 1234, tokenizer, 64)
    # the run evaluated 3 batches of 16 per rank over 2 ranks, interleaved by rank
    rows = [eval_data[i] for i in range(min(len(eval_data), 96))]
    total, count = 0.0, 0
    with torch.no_grad():
        for i in range(0, len(rows), 16):
            ids = torch.stack([r["input_ids"] for r in rows[i:i + 16]])
            mask = torch.stack([r["attention_mask"] for r in rows[i:i + 16]])
            labels = torch.stack([r["labels"] for r in rows[i:i + 16]])
            logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1]
            total += torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), labels[:, 1:].reshape(-1),
                                                       ignore_index=-100, reduction="sum").item()
            count += int((labels[:, 1:] != -100).sum())
    assert abs(total / count - final) < 1e-4, (total / count, final)


@pytest.mark.parametrize("config,extra", [
    ("opt", ["--zero_stage", "3"]),
    ("llama", ["--zero_stage", "3", "--lora_dim", "8", "--lora_learning_rate", "3e-3"]),
    ("bloom", ["--zero_stage", "2", "--lora_dim", "4", "--only_optimize_lora", "--lora_learning_rate", "1e-2"]),
])
def test_other_families_and_lora(tmp_path, config, extra):
    run_deepspeed(MAIN, step1_args(tmp_path, tmp_path / "cache", config=config, steps=8, extra=extra), num_gpus=2)
    got = losses(tmp_path)
    assert len(got) == 8 and got[-1] < got[0] - 0.1, got
    model = AutoModelForCausalLM.from_pretrained(tmp_path)  # LoRA merged: a plain HF folder
    assert not any("lora" in n for n, _ in model.named_parameters())


def test_bad_flags_fail_before_any_work(tmp_path):
    proc = run_python(MAIN, ["--model_name_or_path", "./no/such/model", "--output_dir", str(tmp_path / "o"),
                             "--zero_stage", "0", "--offload", "--only_optimize_lora", "--data_split", "1,2"],
                      check=False)
    assert proc.returncode == 2
    err = proc.stderr
    for needle in ("--offload needs", "--only_optimize_lora needs", "--data_split", "./no/such/model"):
        assert needle in err, err
    assert "Traceback" not in err
    assert not (tmp_path / "o").exists()


def test_lora_only_with_checkpointing_trains_as_without(tmp_path):
    """--only_optimize_lora with --gradient_checkpointing (upstream refuses the pair: no input
    of a frozen base requires grad): the adapters' inputs are made to require grad, and the
    losses of 4 steps at ZeRO-3 on 2 ranks equal those without checkpointing."""
    runs = {}
    for name, extra in (("plain", []), ("checkpointed", ["--gradient_checkpointing"])):
        out = tmp_path / name
        run_deepspeed(MAIN, step1_args(out, tmp_path / "cache", steps=4, extra=[
            "--zero_stage", "3", "--lora_dim", "4", "--only_optimize_lora", "--lora_learning_rate", "1e-2",
            *extra]), num_gpus=2)
        runs[name] = losses(out)
    assert len(runs["plain"]) == 4 and runs["plain"][-1] < runs["plain"][0], runs
    assert runs["checkpointed"] == pytest.approx(runs["plain"], abs=1e-5), runs

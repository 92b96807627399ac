"""Real model shapes at ZeRO-3 on 2 CPU ranks (random weights, no downloads).

Tiny models hide what real ones expose: with every tensor small, ZeRO-3 keeps them gathered
between forward and backward and never prefetches, so nothing is in flight when a save
gathers. These models keep the real widths, heads and vocabularies of SmolLM2-135M (tied
embeddings, GQA), bloom-560m, opt-350m (projected embeddings), pythia-160m and gpt2, with 2
blocks (tests/dist/real_shapes.py says why depth does not matter here).

- SmolLM2 through the three entry points: step 1 -> step 2 (its final save injected to
  fail: the state is checkpointed, exit 4, and --resume writes the model) -> step 3 with
  the hybrid engine and EMA; every saved folder equals the trained state DeepSpeed
  checkpointed at the same step and reloads with plain `from_pretrained`.
- Each family (and SmolLM2 with LoRA): load -> train -> evaluate -> save -> reload; the
  reloaded model's held-out loss equals the engine's, and the hybrid engine's greedy
  tokens equal the ZeRO hooks' and plain HF generate's on the reloaded model.
"""
import json
import os

import pytest
import torch
from safetensors.torch import load_file

from tests.dist.real_shapes import REAL_CONFIGS, build_folder
from tests.dist_utils import REPO, run_deepspeed

STEP1 = REPO / "training/step1_supervised_finetuning/main.py"
STEP2 = REPO / "training/step2_reward_model_finetuning/main.py"
STEP3 = REPO / "training/step3_rlhf_finetuning/main.py"


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    return build_folder("smollm2-135m", tmp_path_factory.mktemp("smollm2") / "model")


def _common(tmp_path, data):
    return ["--data_path", data, "--data_split", "4,4,2", "--data_output_path", tmp_path / "cache",
            "--seed", "1234", "--dtype", "fp32"]


def _consolidated(checkpoint_dir):
    """The fp32 weights DeepSpeed checkpointed, consolidated from every rank's ZeRO-3 shards."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    return get_fp32_state_dict_from_zero_checkpoint(str(checkpoint_dir), tag="ds")


def _assert_saved_equals_checkpoint(saved: dict, ckpt: dict, prefix: str = ""):
    """Every saved tensor equals the checkpoint's (tied weights saved once are in both)."""
    assert saved, "nothing saved"
    for name, tensor in saved.items():
        assert prefix + name in ckpt, f"{name} not in the checkpoint ({sorted(ckpt)[:4]}...)"
        torch.testing.assert_close(tensor, ckpt[prefix + name], rtol=0, atol=0, msg=name)


def _assert_trained(saved: dict, initial: dict):
    assert max((saved[k] - initial[k]).abs().max().item() for k in saved if k in initial) > 0


def test_smollm2_three_steps_save_and_reload_at_zero3(tmp_path, smollm2):
    from transformers import AutoModelForCausalLM

    data = tmp_path / "pairs.jsonl"
    rows = [json.loads(line) for line in open(REPO / "dschat/assets/data/synthetic-assistant.jsonl")][:80]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    common = _common(tmp_path, data)
    initial = load_file(smollm2 / "model.safetensors")

    # step 1: evaluation right before the final save (where ZeRO-3 left prefetches in flight)
    s1 = tmp_path / "step1"
    run_deepspeed(STEP1, ["--model_name_or_path", smollm2, *common, "--zero_stage", "3", "--max_seq_len", "64",
                          "--per_device_train_batch_size", "4", "--max_steps", "2", "--eval_iters", "2",
                          "--learning_rate", "1e-3", "--num_warmup_steps", "0", "--save_interval", "1",
                          "--output_dir", s1])
    saved1 = load_file(s1 / "model.safetensors")
    _assert_saved_equals_checkpoint(saved1, _consolidated(s1 / "checkpoints/step_00000002/model"))
    _assert_trained(saved1, initial)
    AutoModelForCausalLM.from_pretrained(s1)

    # step 2: the final save fails (injected on rank 0): nothing lost, one line, exit 4
    s2 = tmp_path / "step2"
    step2 = ["--model_name_or_path", s1, *common, "--zero_stage", "3", "--max_seq_len", "64",
             "--per_device_train_batch_size", "4", "--max_steps", "2", "--eval_iters", "2",
             "--learning_rate", "1e-3", "--num_warmup_steps", "0", "--output_dir", s2]
    os.environ.update(DSCHAT_TEST_FAIL_AT="hf_save:1", DSCHAT_TEST_KILL_RANK="0")
    try:
        failed = run_deepspeed(STEP2, step2, check=False)
    finally:
        del os.environ["DSCHAT_TEST_FAIL_AT"], os.environ["DSCHAT_TEST_KILL_RANK"]
    assert failed.returncode != 0
    lines = [line for line in failed.stderr.splitlines() if line.startswith("error: writing the final model")]
    assert lines and "injected failure" in lines[0] and "--resume" in lines[0], failed.stderr[-3000:]
    assert (s2 / "checkpoints/step_00000002/COMPLETE").is_file()
    assert not (s2 / "model.safetensors").exists()
    run_deepspeed(STEP2, step2 + ["--resume"])
    saved2 = load_file(s2 / "model.safetensors")
    _assert_saved_equals_checkpoint(saved2, _consolidated(s2 / "checkpoints/step_00000002/model"))
    assert json.loads((s2 / "training_config.json").read_text())["final_eval"]["acc"] >= 0

    # step 3: actor and critic at ZeRO-3, hybrid engine, EMA, checkpoints every step
    s3 = tmp_path / "step3"
    run_deepspeed(STEP3, ["--actor_model_name_or_path", s1, "--critic_model_name_or_path", s2, *common,
                          "--actor_zero_stage", "3", "--critic_zero_stage", "3", "--enable_hybrid_engine",
                          "--enable_ema", "--per_device_generation_batch_size", "2",
                          "--per_device_training_batch_size", "2", "--max_prompt_seq_len", "48",
                          "--max_answer_seq_len", "8", "--min_answer_seq_len", "4", "--max_steps", "2",
                          "--actor_learning_rate", "1e-3", "--critic_learning_rate", "1e-3",
                          "--num_warmup_steps", "0", "--save_interval", "1", "--output_dir", s3])
    ckpt = s3 / "checkpoints/step_00000002"
    actor = load_file(s3 / "actor/model.safetensors")
    _assert_saved_equals_checkpoint(actor, _consolidated(ckpt / "actor"))
    _assert_trained(actor, saved1)
    critic = load_file(s3 / "critic/model.safetensors")
    _assert_saved_equals_checkpoint(critic, _consolidated(ckpt / "critic"))
    for folder in ("actor", "actor_ema"):
        AutoModelForCausalLM.from_pretrained(s3 / folder)
    ema = load_file(s3 / "actor_ema/model.safetensors")
    _assert_trained(ema, saved1)  # the EMA moved towards the actor


@pytest.mark.parametrize("name,lora", [(n, False) for n in REAL_CONFIGS] + [("smollm2-135m", True)])
def test_real_shape_save_reload_and_generation(tmp_path, name, lora):
    folder = build_folder(name, tmp_path / "model")
    out = tmp_path / "result"
    run_deepspeed(REPO / "tests/dist/real_shapes.py", ["--folder", folder, "--out", out]
                  + (["--lora"] if lora else []), timeout=900)
    for rank in (0, 1):
        r = json.loads((tmp_path / f"result.rank{rank}.json").read_text())
        assert r["partitioned_numel"] > 1e6, r       # the real shapes are really partitioned
        assert r["eval_after"] < r["eval_before"], r
        assert r["eval_reloaded"] == pytest.approx(r["eval_after"], rel=1e-4), r
        assert r["left_after_save"] == [], r
        assert r["hybrid_equals_hooks"] and r["hybrid_equals_hf"], r

"""Helpers of the resume / fault / bad-input tests (tests/test_resume.py, test_faults.py,
test_bad_input.py): launches that never outlive their timeout, tiny step-3 model folders,
metrics readers."""
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

from tests.dist_utils import REPO, free_port, remove_shm_buffers, test_env

DRIVER = REPO / "tests" / "dist" / "resume_driver.py"
STEP1 = REPO / "training" / "step1_supervised_finetuning" / "main.py"
STEP3 = REPO / "training" / "step3_rlhf_finetuning" / "main.py"


def launch(script, args=(), *, num_gpus: int = 2, timeout: int = 300, env: dict | None = None):
    """`deepspeed --num_gpus N script args` in its own process group; on timeout the whole
    group (launcher and every rank) is killed, so a hung rank never outlives the test."""
    launcher = shutil.which("deepspeed")
    cmd = ([launcher] if launcher else [sys.executable, "-m", "deepspeed.launcher.runner"])
    port = free_port()
    cmd += ["--num_gpus", str(num_gpus), "--master_port", str(port), str(script)]
    cmd += [str(a) for a in args]
    proc = subprocess.Popen(cmd, cwd=REPO, env={**test_env(), **(env or {})}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        raise AssertionError(f"{' '.join(cmd)} still running after {timeout}s (killed):\n{out[-6000:]}")
    finally:
        remove_shm_buffers(port)  # a SIGKILLed rank never unlinks its own
    return subprocess.CompletedProcess(cmd, proc.returncode, out, "")


def run_plan(tmp: Path, runs: list[dict], timeout: int = 300) -> tuple[list[dict], str]:
    """Run `runs` in one 2-rank launch of the driver: their results (rc, error) and the log."""
    plan, out = tmp / "plan.json", tmp / "results.json"
    plan.write_text(json.dumps({"runs": runs, "out": str(out)}, default=str))
    proc = launch(DRIVER, ["--plan", plan], timeout=timeout)
    if proc.returncode != 0 or not out.exists():
        raise AssertionError(f"driver failed ({proc.returncode}):\n{proc.stdout[-8000:]}")
    return json.loads(out.read_text()), proc.stdout


def records(output_dir) -> list[dict]:
    path = Path(output_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def series(output_dir, key: str) -> dict[int, float]:
    """step -> value of `key` in metrics.jsonl (the last record of a step wins)."""
    return {int(r["step"]): r[key] for r in records(output_dir) if key in r}


def step1_argv(out, cache, *, steps: int = 8, extra=()) -> list[str]:
    """Tiny bloom SFT at ZeRO-3, fp32, dropout on (so the RNG state matters)."""
    return ["--model_name_or_path", "configs/tiny/bloom.json", "--dtype", "fp32", "--zero_stage", "3",
            "--output_dir", str(out), "--data_output_path", str(cache), "--max_seq_len", "48",
            "--per_device_train_batch_size", "4", "--per_device_eval_batch_size", "8", "--eval_iters", "1",
            "--max_steps", str(steps), "--dropout", "0.1", "--learning_rate", "2e-3", "--num_warmup_steps", "1",
            "--data_split", "6,3,1", *map(str, extra)]


def make_step3_models(folder: Path, config: str = "bloom", overrides: dict | None = None) -> tuple[Path, Path]:
    """A random tiny actor (HF folder) and critic (reward-model folder), as steps 1 and 2
    would write them, built without training; `overrides` change the tiny config's keys."""
    import torch

    from dschat.models.model_utils import create_hf_model, load_tokenizer, save_hf_format
    from dschat.models.reward_model import create_reward_model, save_reward_model
    cfg = str(REPO / "configs" / "tiny" / f"{config}.json")
    if overrides:
        changed = {**json.loads(Path(cfg).read_text()), **overrides}
        cfg = str(folder / f"{config}.json")
        Path(cfg).write_text(json.dumps(changed))
    tokenizer = load_tokenizer(None)
    actor, critic = folder / "actor_in", folder / "critic_in"
    save_hf_format(create_hf_model(cfg, tokenizer, seed=1), tokenizer, actor)
    reward = create_reward_model(cfg, tokenizer, seed=2)
    with torch.no_grad():  # a reward that varies with the answer, so advantages are not ~0
        reward.v_head.weight.normal_(0, 1.0, generator=torch.Generator().manual_seed(3))
    save_reward_model(reward, tokenizer, critic)
    return actor, critic


def step3_argv(out, cache, actor, critic, *, steps: int = 4, extra=()) -> list[str]:
    """Tiny PPO at ZeRO-3 with our hybrid engine, EMA on, seeded sampling (top-k)."""
    return ["--actor_model_name_or_path", str(actor), "--critic_model_name_or_path", str(critic),
            "--actor_zero_stage", "3", "--critic_zero_stage", "3", "--enable_hybrid_engine", "--enable_ema",
            "--dtype", "fp32", "--output_dir", str(out), "--data_output_path", str(cache),
            "--data_split", "6,3,1", "--per_device_generation_batch_size", "2",
            "--per_device_training_batch_size", "1", "--max_prompt_seq_len", "24", "--max_answer_seq_len", "6",
            "--min_answer_seq_len", "2", "--top_k", "20", "--actor_dropout", "0.1", "--critic_dropout", "0.1",
            "--actor_learning_rate", "1e-3", "--critic_learning_rate", "1e-3", "--num_warmup_steps", "0",
            "--max_steps", str(steps), *map(str, extra)]

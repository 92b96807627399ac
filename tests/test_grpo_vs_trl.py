"""benchmarks/grpo_vs_trl.py without running either framework (a few seconds): its flags, the
prompts it writes, the commands and configs it hands ours and TRL, and its table.

The end-to-end run (both frameworks through the deepspeed launcher on CPU ranks) takes a
minute or more; it is the command in the script's docstring with a tiny model.
"""
import importlib.util
import subprocess
import sys
from types import SimpleNamespace

import pytest

from tests.dist_utils import REPO
from tests.dist_utils import test_env as subprocess_env


def _load(name):
    spec = importlib.util.spec_from_file_location(name, REPO / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


bench = _load("grpo_vs_trl")


@pytest.mark.parametrize("script", ["grpo_vs_trl.py", "trl_grpo_runner.py"])
def test_help(script):
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / script), "--help"], cwd=REPO,
                          env=subprocess_env(), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "--config" in proc.stdout if script.startswith("trl") else "--answer_len" in proc.stdout


def test_bad_micro_batch_is_refused():
    with pytest.raises(SystemExit):
        bench.parse_args(["--model", "m", "--train_micro_batch", "12"])  # 64 answers, groups of 8


def test_prompts_are_exactly_prompt_len_tokens():
    from dschat.models.model_utils import load_tokenizer
    tok = load_tokenizer(None)          # the bundled tokenizer (no chat template: DS-Chat text)
    rows = bench.render_prompts(tok, 6, 96, seed=3)
    assert len(rows) == 6
    assert {len(tok(r["prompt"])["input_ids"]) for r in rows} == {96}
    assert all(r["prompt"].endswith("Put the final answer after ####.\n\nAssistant:") for r in rows)
    assert all(r["answer"].lstrip("-").isdigit() and r["response"].endswith("#### " + r["answer"]) for r in rows)
    with pytest.raises(Exception, match="fit --prompt_len 8"):
        bench.render_prompts(tok, 2, 8, seed=3)


def test_both_frameworks_get_the_same_sizes(tmp_path):
    args = bench.parse_args(["--model", str(tmp_path), "--prompts_per_step", "4", "--group", "4",
                             "--train_micro_batch", "8", "--answer_len", "32", "--beta", "0.04"])
    cmd = bench.ours_command(args, tmp_path / "data", tmp_path, tmp_path / "ours")
    flag = lambda name: cmd[cmd.index(name) + 1]  # noqa: E731
    assert (flag("--per_device_generation_batch_size"), flag("--per_device_training_batch_size"),
            flag("--gradient_accumulation_steps")) == ("16", "8", "2")
    assert flag("--max_answer_seq_len") == flag("--min_answer_seq_len") == "32"
    assert (flag("--kl_ctl"), flag("--n_samples_per_prompt"), flag("--actor_zero_stage")) == ("0.04", "4", "3")
    assert "--enable_hybrid_engine" in cmd
    cfg = bench.trl_run_config(args, tmp_path / "train.jsonl", tmp_path / "trl")
    assert (cfg["micro_batch"], cfg["gradient_accumulation_steps"], cfg["group"], cfg["answer_len"],
            cfg["beta"], cfg["zero_stage"]) == (8, 2, 4, 32, 0.04, 3)


def test_trl_config_forces_the_answer_length(tmp_path):
    pytest.importorskip("trl")
    runner = _load("trl_grpo_runner")
    args = bench.parse_args(["--model", str(tmp_path), "--prompts_per_step", "4", "--group", "4",
                             "--train_micro_batch", "8", "--answer_len", "32", "--trl_zero_stage", "0"])
    cfg = runner.grpo_config(bench.trl_run_config(args, tmp_path / "train.jsonl", tmp_path / "trl"))
    assert cfg.generation_kwargs == {"min_new_tokens": 32} and cfg.max_completion_length == 32
    # one generation of 16 answers per optimizer step of 2 micro-batches of 8
    assert (cfg.per_device_train_batch_size, cfg.gradient_accumulation_steps, cfg.steps_per_generation,
            cfg.generation_batch_size, cfg.num_generations) == (8, 2, 2, 16, 4)
    assert cfg.beta == 0.0 and not cfg.use_vllm and not cfg.gradient_checkpointing and cfg.deepspeed is None
    assert runner.arithmetic_exact_match(["p", "p"], ["so #### 7", "#### 8"], answer=["7", "7"]) == [1.0, 0.0]


def test_table_from_fake_numbers():
    row = lambda step, gen: {"step_s": step, "generate_s": gen, "score_s": 0.1, "train_s": step - gen - 0.1,  # noqa: E731
                             "peak_gib": 2.0, "answer_len_mean": 192.0, "reward_mean": 0.25}
    ours = bench.summarize([row(9.0, 5.0), row(2.0, 1.0), row(2.0, 1.0)], warmup=1, answers_per_step=64)
    trl = bench.summarize([row(9.0, 5.0), row(8.0, 6.0), row(8.0, 6.0)], warmup=1, answers_per_step=64)
    assert ours["step_s"] == 2.0 and ours["samples_per_s"] == 32.0 and ours["rest_s"] == 1.0 and ours["steps"] == 3
    args = SimpleNamespace(model="/m/SmolLM2", trl_zero_stage=3, dtype="bf16", prompts_per_step=8, group=8,
                           prompt_len=256, answer_len=192, train_micro_batch=0, beta=0.0, warmup=1, steps=3,
                           ours_args="--enable_hybrid_engine")
    table = bench.format_table({"ours": ours, "trl": trl}, args)
    assert "| ours | 2.000 | 1.000 | 1.000 | 0.100 | 0.900 | 32.00 | 2.00 | 192.0 | 0.250 | 3 |" in table
    assert "| ours / TRL | 0.25 | 0.17 | 0.50 | 1.00 | 0.47 | **4.00** | 1.00 |" in table
    assert "8 prompts x 8 answers x (256 + 192 forced)" in table
    assert "| trl | failed |" in bench.format_table({"ours": ours, "trl": None}, args)
    assert bench.summarize([], 1, 64) is None

"""The pipeline as a product: presets, scripts, --help of every entry point, prompt_eval,
the chatbot on stdin, and e2e_rlhf.py's skipping and report (no training runs here)."""
import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from applications.e2e import launch, plan, presets
from tests import dist_utils
from tests.dist_utils import REPO

E2E = REPO / "applications" / "e2e_rlhf.py"
PROMPT_EVAL = REPO / "inference" / "prompt_eval.py"
CHATBOT = REPO / "inference" / "chatbot.py"
ENTRY_POINTS = {1: REPO / "training" / "step1_supervised_finetuning" / "main.py",
                2: REPO / "training" / "step2_reward_model_finetuning" / "main.py",
                3: REPO / "training" / "step3_rlhf_finetuning" / "main.py"}
HELP_TARGETS = [*ENTRY_POINTS.values(), REPO / "training" / "step2_reward_model_finetuning" / "rw_eval.py",
                PROMPT_EVAL, CHATBOT, E2E]
PRESETS = sorted((REPO / "configs" / "presets").glob("*.json"))
SCRIPTS = sorted((REPO / "scripts").glob("*.sh"))


def load_module(path: Path, name: str):
    """Import a script by path (registered in sys.modules: dataclasses need that)."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def e2e():
    return load_module(E2E, "dschat_e2e_rlhf")


def run(cmd, timeout=120, **kw):
    return subprocess.run([str(c) for c in cmd], cwd=REPO, env=dist_utils.test_env(), capture_output=True, text=True,
                          timeout=timeout, **kw)


# ----------------------------------------------------------------------------- presets
@pytest.mark.parametrize("path", PRESETS, ids=lambda p: p.stem)
def test_preset_parses_and_follows_the_memory_rule(path, e2e):
    preset = presets.load_preset(path.stem)
    assert preset["name"] == path.stem
    reward = presets.load_preset(preset["reward_model"]) if preset["reward_model"] not in ("step1", "actor") else preset
    for deployment, row in preset["deployments"].items():
        assert deployment in presets.DEPLOYMENTS, deployment
        assert row["actor_zero_stage"] in (0, 1, 2, 3) and row["reward_zero_stage"] in (0, 1, 2, 3)
        assert row["hybrid_engine"] in ("full", "layered", "off")
        if deployment == "cpu" or path.stem == "demo":
            continue
        assert "rule" in row and row["rule"], f"{path.stem}/{deployment}: no rule text"
        steps = plan_steps(e2e, path.stem, deployment)
        budget = presets.GPU_BUDGET * row["gpu_memory_gb"]
        for step in steps:
            est = presets.step_memory_gb(step.number, step.flags, preset, reward, row["num_gpus"])["total"]
            assert est <= budget, f"{path.stem}/{deployment} step {step.number}: {est:.1f} GB > {budget}"
            assert math.isclose(est, row["estimate_gb"][f"step{step.number}"], abs_tol=0.06), \
                f"{path.stem}/{deployment}: estimate_gb of step {step.number} is stale ({est:.2f})"
        s3 = steps[2].flags
        # minimal partitioning: ZeRO-3 on several GPUs only when ZeRO-2 would not fit
        if row["num_gpus"] > 1 and s3["actor_zero_stage"] == 3:
            lower = dict(s3, actor_zero_stage=2, critic_zero_stage=min(2, s3["critic_zero_stage"]))
            assert presets.step_memory_gb(3, lower, preset, reward, row["num_gpus"])["total"] > budget
        # layered generation only when a full replica would not fit
        if s3.get("unpin_actor_parameters"):
            full = dict(s3, unpin_actor_parameters=False)
            assert presets.step_memory_gb(3, full, preset, reward, row["num_gpus"])["total"] > budget
        if s3.get("offload") and row["num_gpus"] == 1 and not s3.get("only_optimize_lora"):
            plain = dict(s3, offload=False, actor_zero_stage=0, critic_zero_stage=0)
            assert presets.step_memory_gb(3, plain, preset, reward, 1)["total"] > budget


def test_deepspeed_estimators_beside_the_rule_of_thumb(e2e):
    """DeepSpeed's own formulas (deepspeed/runtime/zero/stage3.py, stage_1_and_2.py, copied
    here as the reference) for bloom-560m: P params, the embedding as its largest layer."""
    bloom = presets.load_preset("bloom-560m")
    P, L = 0.559e9, 250880 * 1024
    gb = lambda b: b / 1e9  # noqa: E731
    # ZeRO-3, 1 GPU, no offload: 4 bytes of the largest layer + 18 bytes/param; host: that layer x 4 x 1.5
    assert presets.deepspeed_states_gb(bloom, 3, 1, False) == pytest.approx((gb(4 * L + 18 * P), gb(4 * L * 1.5)))
    # ZeRO-3 offloaded over 8 GPUs: the largest layer on the GPU, 18 bytes/param x 1.5 on the host
    assert presets.deepspeed_states_gb(bloom, 3, 8, True) == pytest.approx((gb(4 * L), gb(18 * P * 1.5)))
    # ZeRO-2 over 4 GPUs: 2 bytes/param + 18 partitioned; ZeRO-0: nothing partitioned
    assert presets.deepspeed_states_gb(bloom, 2, 4, False)[0] == pytest.approx(gb(2 * P + 18 * P / 4))
    assert presets.deepspeed_states_gb(bloom, 0, 4, False)[0] == pytest.approx(gb(20 * P))
    steps = plan_steps(e2e, "bloom-560m", "single_node")
    actor = presets.resolve_model("bloom-560m", "actor", None, False, Path("/tmp/dschat-preset-check"))
    lines = presets.memory_report(steps, actor, actor, 8, 80)
    ds = [line for line in lines if "DeepSpeed's estimators" in line]
    assert len(ds) == 3 and "trained models only" in ds[2] and "host memory per node" in ds[2], lines


def test_memory_rule_with_bf16_optimizer_state():
    """--optimizer_dtype bf16: the bf16 weights are the master weights and the moments bf16, so
    4 bytes/param of optimizer state in place of fp32's 12 (tests/test_optim.py counts them in
    DeepSpeed's engines)."""
    assert presets.model_state_gb(1.0, 3, 1) == 16.0
    assert presets.model_state_gb(1.0, 3, 1, optimizer_dtype="bf16") == 8.0
    assert presets.model_state_gb(1.0, 1, 4, optimizer_dtype="bf16") == 2 + 2 + 4 / 4
    flags = {"actor_zero_stage": 3, "critic_zero_stage": 3, "optimizer_dtype": "bf16", "enable_hybrid_engine": True}
    parts = presets.step_memory_gb(3, flags, {"params_billion": 7.0}, {"params_billion": 0.5}, 1)
    assert parts["actor"] == 56.0 and parts["critic"] == 4.0 and parts["reference"] == 14.0, parts


def plan_steps(e2e, name, deployment, tmp="/tmp/dschat-preset-check"):
    args = e2e.parse_args(["--actor-model", name, "--deployment-type", deployment, "--output-dir", tmp])
    actor = presets.resolve_model(args.actor_model, "actor", None, False, Path(tmp))
    reward_spec = actor.preset.get("reward_model", "step1")
    reward = (None if reward_spec == "step1" else actor if reward_spec == "actor"
              else presets.resolve_model(reward_spec, "reward", None, False, Path(tmp)))
    return plan.build_plan(args, actor, reward, deployment)


def test_every_preset_flag_is_accepted_by_the_entry_points(e2e):
    parsers = {n: load_module(p, f"dschat_step{n}_main").parse_args for n, p in ENTRY_POINTS.items()}
    checked = 0
    for path in PRESETS:
        for deployment in presets.load_preset(path.stem)["deployments"]:
            for step in plan_steps(e2e, path.stem, deployment):
                args = parsers[step.number](step.argv[1:])  # argparse exits (SystemExit) on an unknown flag
                if step.number == 3:
                    rows = args.per_device_generation_batch_size * args.generation_batches
                    assert rows % args.per_device_training_batch_size == 0, (path.stem, deployment)
                checked += 1
    assert checked >= 3 * len(PRESETS)


def test_random_init_preset_writes_its_config(e2e, tmp_path):
    choice = presets.resolve_model("llama-2-7b", "actor", None, True, tmp_path)
    config = json.loads(Path(choice.path).read_text())
    assert config["model_type"] == "llama" and config["num_hidden_layers"] == 32
    assert presets.count_params(choice.path) == pytest.approx(6.738, abs=0.01)


def test_extra_step_flags_override_the_preset(e2e):
    assert plan.parse_extra("--max_steps 5 --print_answers --data_path a b") == \
        {"max_steps": "5", "print_answers": True, "data_path": ["a", "b"]}
    steps = plan_steps(e2e, "bloom-7b1", "single_node")
    assert steps[2].flags["actor_zero_stage"] == 3 and steps[0].flags["zero_stage"] == 2


def test_hostfile_example_and_slots(e2e, tmp_path):
    assert launch.hostfile_slots(str(REPO / "scripts" / "hostfile.example")) == 2
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("# two nodes\nnode-0 slots=8\n\nnode-1 slots=8\n")
    assert launch.hostfile_slots(str(hostfile)) == 16
    assert launch.hostfile_slots(str(hostfile), num_nodes=1) == 8
    assert launch.hostfile_slots(str(hostfile), per_node=4) == 8
    hostfile.write_text("node-0 8\n")
    with pytest.raises(ValueError, match="slots=N"):
        launch.hostfile_slots(str(hostfile))


# ----------------------------------------------------------------------------- scripts, --help
@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_script_parses(script):
    proc = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("step", sorted(ENTRY_POINTS))
def test_training_entry_point_answers_help(step, capsys):
    """In process (the modules are imported for the preset test anyway): their argparse --help."""
    module = load_module(ENTRY_POINTS[step], f"dschat_step{step}_main")
    with pytest.raises(SystemExit) as exit_info:
        module.parse_args(["--help"])
    assert exit_info.value.code == 0 and "usage:" in capsys.readouterr().out


def test_scripts_answer_help():
    """rw_eval.py, inference/*.py and e2e_rlhf.py as scripts, in parallel."""
    procs = {p: subprocess.Popen([sys.executable, str(p), "--help"], cwd=REPO, env=dist_utils.test_env(),
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for p in HELP_TARGETS if p not in ENTRY_POINTS.values()}
    for path, proc in procs.items():
        out, err = proc.communicate(timeout=180)
        assert proc.returncode == 0, f"{path}: {err[-2000:]}"
        assert "usage:" in out and "--" in out, path


def test_e2e_dry_run_and_list(e2e, capsys):
    assert e2e.main(["--dry-run", "--output-dir", "/tmp/dschat-dry"]) == 0
    out = capsys.readouterr().out
    assert out.count("training/step") == 3 and "--num_gpus 2" in out and "configs/tiny/bloom.json" in out
    e2e.main(["--list-presets"])
    assert "bloom-7b1" in capsys.readouterr().out
    # a preset row measured on a GPU prints its measured peak under each step's estimate
    assert e2e.main(["--actor-model", "bloom-560m", "--deployment-type", "single_gpu", "--dry-run",
                     "--output-dir", "/tmp/dschat-dry-560m"]) == 0
    out = capsys.readouterr().out
    measured = json.loads((REPO / "configs" / "presets" / "bloom-560m.json").read_text())[
        "deployments"]["single_gpu"]["measured_peak_gib"]
    for step in (1, 2, 3):
        assert f"{measured[f'step{step}']:.1f} GiB peak per GPU" in out, out


# ----------------------------------------------------------------------------- tiny models
@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    """A tiny Bloom causal LM and a reward model on its backbone, saved as step 1/2 would."""
    from transformers import AutoModel

    from dschat.models.model_utils import create_hf_model, load_tokenizer, save_hf_format
    from dschat.models.reward_model import RewardModel, save_reward_model

    root = tmp_path_factory.mktemp("tiny")
    tokenizer = load_tokenizer(str(REPO / "configs" / "tiny" / "bloom.json"))
    lm = create_hf_model(str(REPO / "configs" / "tiny" / "bloom.json"), tokenizer, seed=1)
    save_hf_format(lm, tokenizer, root / "lm")
    backbone = create_hf_model(str(REPO / "configs" / "tiny" / "bloom.json"), tokenizer, seed=2,
                               model_class=AutoModel)
    torch.manual_seed(3)
    save_reward_model(RewardModel(backbone, pad_token_id=tokenizer.pad_token_id), tokenizer, root / "rm")
    judge = create_hf_model(str(REPO / "configs" / "tiny" / "bloom.json"), tokenizer, seed=4, model_class=AutoModel)
    torch.manual_seed(5)
    save_reward_model(RewardModel(judge, pad_token_id=tokenizer.pad_token_id), tokenizer, root / "judge")
    return root


def test_prompt_eval_side_by_side_with_rewards(tiny_models, tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("What is 2 plus 3?\nWhat colour is a banana?\n\nName a capital city.\n")
    out = tmp_path / "answers.jsonl"
    proc = run([sys.executable, PROMPT_EVAL, "--baseline", tiny_models / "lm", "--finetune", tiny_models / "lm",
                "--reward_model", tiny_models / "rm", "--judge_model", tiny_models / "judge", "--prompts", prompts,
                "--max_new_tokens", "6", "--kl_samples", "2", "--jsonl", out])
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    assert lines[0].split("|")[1].strip() == "prompt" and "baseline" in lines[0] and "reward" in lines[0]
    assert "judge" in lines[0]
    summary = json.loads(lines[-1])
    assert summary["num_prompts"] == 3
    assert summary["baseline_reward_mean"] == pytest.approx(summary["finetune_reward_mean"])  # same model
    # the same model on both sides: every pair ties (win rate 1/2) and the sampled KL is 0
    assert summary["win_rate"] == summary["judge_win_rate"] == 0.5
    assert summary["kl_samples"] == 6 and summary["kl_per_answer"] == pytest.approx(0.0, abs=1e-4)
    assert summary["baseline_judge_mean"] != pytest.approx(summary["baseline_reward_mean"])  # another model
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 3 and rows[0]["prompt"] == "\n\nHuman: What is 2 plus 3?\n\nAssistant:"
    assert all(isinstance(r["finetune_reward"], float) and isinstance(r["finetune_judge"], float) for r in rows)
    # six new tokens at most: an answer shorter than that ended on its own
    ended = sum(r["baseline_tokens"] < 6 for r in rows)
    assert summary["baseline_ended_share"] >= ended / 3


def test_prompt_eval_rejects_a_reward_model_as_the_lm(tiny_models):
    proc = run([sys.executable, PROMPT_EVAL, "--finetune", tiny_models / "rm", "--num_prompts", "2"])
    assert proc.returncode == 2 and "is a reward model" in proc.stderr


def test_chatbot_two_turns_on_stdin(tiny_models):
    proc = run([sys.executable, CHATBOT, "--path", tiny_models / "lm", "--max_new_tokens", "8"],
               input="What is 2 plus 3?\nAnd 4 times 5?\nclear\nHi again\nquit\n")
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert out.count("\nHuman: ") == 5 and out.count("Assistant:") == 3, out
    assert "(conversation cleared)" in out and out.rstrip().endswith("bye")


def test_chatbot_stops_at_a_turn_marker_it_writes_itself():
    chatbot = load_module(CHATBOT, "dschat_chatbot")
    printed = []

    class Out:
        def write(self, text):
            printed.append(text)

        def flush(self):
            pass

    printer = chatbot.TurnPrinter(Out())
    for chunk in [" Sure! 5.", "\n", "\nHu", "man: next", " question"]:
        printer.feed(chunk)
    printer.feed("", final=True)
    assert "".join(printed) == " Sure! 5." and printer.answer() == " Sure! 5."


# ----------------------------------------------------------------------------- e2e skip + report
def test_e2e_skips_complete_steps_and_writes_the_report(e2e, tiny_models, tmp_path):
    """With all three outputs present nothing is launched; the report reads the metrics."""
    import shutil

    out = tmp_path / "run"
    shutil.copytree(tiny_models / "lm", out / "step1")
    shutil.copytree(tiny_models / "rm", out / "step2")
    shutil.copytree(tiny_models / "lm", out / "step3" / "actor")
    shutil.copytree(tiny_models / "rm", out / "step3" / "critic")
    metrics = {"step1": [{"step": 0, "eval/ppl": 900.0}, {"step": 5, "train/loss": 2.0},
                         {"step": 10, "eval/ppl": 3.5}],
               "step2": [{"step": 0, "eval/acc": 0.5}, {"step": 8, "eval/acc": 0.9, "train/loss": 0.3}],
               "step3": [{"step": s, "ppo/reward_mean": 1.0 + s, "ppo/kl": 0.01 * s, "gen/answer_len_mean": 9.0}
                         for s in range(1, 9)]}
    for step, records in metrics.items():
        with open(out / step / "metrics.jsonl", "w") as f:
            for r in records:
                f.write(json.dumps({"time": 0, **r}) + "\n")
    assert e2e.main(["--output-dir", str(out), "--eval-prompts", "3"]) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["sft_eval_perplexity"] == {"before": 900.0, "after": 3.5, "steps": 10}
    assert report["reward_model_eval_accuracy"]["after"] == 0.9
    assert report["ppo_training_reward"]["first_steps_mean"] < report["ppo_training_reward"]["last_steps_mean"]
    assert report["heldout_reward"]["num_prompts"] == 3 and "baseline_reward_mean" in report["heldout_reward"]
    assert any(p.endswith("reward.png") for p in report["plots"][str(out / "step3")])
    md = (out / "report.md").read_text()
    assert "already complete" not in md and "| SFT eval perplexity" in md

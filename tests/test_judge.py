"""A run judged by a reward model the policy never sees: the prompt-disjoint data split, the
held-out measures of prompt_eval (distinct-2, ended share, win rates, sampled KL), the
smollm2-135m preset's plan, the report's judged table and applications/compare_runs.py."""
import json
from pathlib import Path

import pytest
import torch

from applications.e2e import plan, presets, report
from dschat.data.judge_split import group_by_prompt, prepare
from dschat.data.sources import load_source
from dschat.utils.errors import UserInputError
from tests.dist_utils import REPO
from tests.test_product import E2E, load_module

PROMPT_EVAL = load_module(REPO / "inference" / "prompt_eval.py", "dschat_prompt_eval")
COMPARE = load_module(REPO / "applications" / "compare_runs.py", "dschat_compare_runs")


@pytest.fixture(scope="module")
def e2e():
    return load_module(E2E, "dschat_e2e_rlhf")


def pairs_file(path: Path, prompts: int = 60, repeats: int = 2) -> Path:
    """HH-style whole conversations; each prompt appears `repeats` times with other answers."""
    with open(path, "w") as f:
        for i in range(prompts):
            for j in range(repeats):
                q = f"\n\nHuman: question number {i}?\n\nAssistant:"
                f.write(json.dumps({"chosen": f"{q} good answer {j}", "rejected": f"{q} bad answer {j}"}) + "\n")
    return path


# ----------------------------------------------------------------------------- data split
def test_judge_split_is_disjoint_by_prompt_complete_and_reproducible(tmp_path):
    data = pairs_file(tmp_path / "pairs.jsonl")
    summary = prepare([str(data)], str(tmp_path / "a"), eval_fraction=0.1, seed=7)
    prompts = {}
    for half in ("policy", "judge"):
        src = load_source(str(tmp_path / "a" / half))
        prompts[half] = {r.prompt for r in src.train}
        prompts[f"{half}-eval"] = {r.prompt for r in src.eval}
        assert len(src.train) == summary["rows"][half] and len(src.eval) == summary["rows"]["eval"]
    assert prompts["policy-eval"] == prompts["judge-eval"]  # one held-out set for both
    assert not prompts["policy"] & prompts["judge"]
    assert not (prompts["policy"] | prompts["judge"]) & prompts["policy-eval"]
    assert len(prompts["policy"] | prompts["judge"] | prompts["policy-eval"]) == 60
    assert summary["prompts"] == {"eval": 6, "policy": 27, "judge": 27}
    assert summary["rows"] == {"eval": 12, "policy": 54, "judge": 54}  # a prompt's rows stay together
    again = prepare([str(data)], str(tmp_path / "b"), eval_fraction=0.1, seed=7)
    assert again["prompts"] == summary["prompts"]
    for name in ("policy/train.jsonl", "judge/train.jsonl", "policy/eval.jsonl"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
    other = prepare([str(data)], str(tmp_path / "c"), eval_fraction=0.1, seed=8)
    assert (tmp_path / "c" / "policy/train.jsonl").read_bytes() != (tmp_path / "a" / "policy/train.jsonl").read_bytes()
    assert other["prompts"] == summary["prompts"]


def test_judge_split_keeps_an_existing_split_and_rejects_bad_input(tmp_path):
    data = pairs_file(tmp_path / "pairs.jsonl", prompts=10, repeats=1)
    prepare([str(data)], str(tmp_path / "s"))
    stamp = (tmp_path / "s" / "policy" / "train.jsonl").stat().st_mtime_ns
    prepare([str(data)], str(tmp_path / "s"))
    assert (tmp_path / "s" / "policy" / "train.jsonl").stat().st_mtime_ns == stamp
    with pytest.raises(UserInputError, match="--eval_fraction"):
        prepare([str(data)], str(tmp_path / "t"), eval_fraction=1.5)
    sft = tmp_path / "sft.jsonl"
    sft.write_text("".join(json.dumps({"prompt": f"q{i}", "response": "a"}) + "\n" for i in range(10)))
    with pytest.raises(UserInputError, match="preference pairs"):
        prepare([str(sft)], str(tmp_path / "u"))
    with pytest.raises(UserInputError, match="too few"):
        prepare([str(pairs_file(tmp_path / "two.jsonl", prompts=2, repeats=1))], str(tmp_path / "v"))


def test_group_by_prompt_keeps_first_seen_order():
    from dschat.data.formats import Row
    rows = [Row("a", "1", "x"), Row("b", "2", "y"), Row("a", "3", "z")]
    assert group_by_prompt(rows) == [[rows[0], rows[2]], [rows[1]]]


# ----------------------------------------------------------------------------- held-out measures
class _Chat:
    stop_token_ids = (9,)


def test_distinct_2_and_ended_by_hand():
    assert PROMPT_EVAL.distinct_n([[1, 2, 3], [1, 2, 1, 2]], 2) == pytest.approx(3 / 5)  # (1,2) (2,3) (2,1)
    assert PROMPT_EVAL.distinct_n([[1]], 2) == 0.0
    assert PROMPT_EVAL.ended([5, 6, 9], _Chat(), 3)        # stopped at the end-of-turn token
    assert PROMPT_EVAL.ended([5, 6], _Chat(), 3)           # shorter than the limit: a stop string
    assert not PROMPT_EVAL.ended([5, 6, 7], _Chat(), 3)    # cut at the length limit


def test_summary_win_rate_gain_and_std_by_hand():
    rows = [{"prompt": "p"}] * 4
    answers = {"baseline": [([1], [5, 9], "")] * 4, "finetune": [([1], [5, 6, 7], "")] * 4}
    scores = {"judge": {"baseline": [0.0, 1.0, 2.0, 3.0], "finetune": [1.0, 1.0, 3.0, 2.0]}}
    s = PROMPT_EVAL.summarize(rows, answers, scores, _Chat(), 3)
    assert s["judge_finetune_better"] == 2 and s["judge_finetune_worse"] == 1
    assert s["judge_win_rate"] == pytest.approx((2 + 0.5) / 4)
    assert s["baseline_judge_std"] == pytest.approx(1.25 ** 0.5)  # population sd of 0, 1, 2, 3
    assert s["judge_gain"] == pytest.approx(0.25)
    assert s["judge_gain_in_baseline_std"] == pytest.approx(0.25 / 1.25 ** 0.5)
    assert s["baseline_ended_share"] == 1.0 and s["finetune_ended_share"] == 0.0
    assert "reward_gain" not in s  # no policy reward model given


def test_answer_logprobs_equal_unpadded_forwards():
    from transformers import AutoModelForCausalLM, LlamaConfig

    from inference.common import answer_logprobs
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=64,
                                                         num_hidden_layers=2, num_attention_heads=4,
                                                         num_key_value_heads=2)).eval()
    pairs = [([1, 2, 3], [4, 5]), ([7, 8], [9, 10, 11, 12])]
    got = answer_logprobs(model, pairs, pad_id=0, batch_size=2)
    for (p, a), value in zip(pairs, got):
        ids = torch.tensor([p + a])
        logp = torch.log_softmax(model(ids).logits[0].float(), -1)
        want = sum(float(logp.detach()[len(p) - 1 + i, tok]) for i, tok in enumerate(a))
        assert value == pytest.approx(want, abs=1e-4)


# ----------------------------------------------------------------------------- the preset's plan
def test_smollm2_preset_plans_a_judge_on_the_other_half(e2e, tmp_path):
    args = e2e.parse_args(["--preset", "smollm2-135m", "--model", str(tmp_path / "m"), "--deployment-type",
                           "single_gpu", "--output-dir", str(tmp_path / "out"), "--data-path", "hh.jsonl"])
    assert args.actor_model == str(tmp_path / "m") and args.actor_preset == "smollm2-135m"
    actor = presets.ModelChoice("m", str(tmp_path / "m"), presets.load_preset("smollm2-135m"), 0.135)
    steps = plan.build_plan(args, actor, actor, "single_gpu")
    by_key = {s.key: s for s in steps}
    assert sorted(by_key) == ["step1", "step2", "step2_judge", "step3"]
    data = tmp_path / "out" / "data"
    assert by_key["step2"].flags["data_path"] == [str(data / "policy")]
    assert by_key["step2_judge"].flags["data_path"] == [str(data / "judge")]
    assert by_key["step3"].flags["data_path"] == [str(data / "policy")]
    assert [by_key[k].flags["data_split"] for k in ("step1", "step2", "step2_judge", "step3")] == \
        ["1,0,0", "0,1,0", "0,1,0", "0,0,1"]
    judge, policy = by_key["step2_judge"].flags, by_key["step2"].flags
    assert {k: v for k, v in judge.items() if k not in ("data_path", "output_dir")} == \
        {k: v for k, v in policy.items() if k not in ("data_path", "output_dir")}
    assert plan.judge_split_of(args, actor)["source"] == ["hh.jsonl"]
    e2e.eval_settings(args, actor)
    assert (args.eval_prompts, args.kl_samples, args.report_examples) == (256, 2, 10)
    with pytest.raises(SystemExit):
        e2e.parse_args(["--model", "x"])  # --model needs --preset


def report_for(acc, judge_acc, ho) -> dict:
    return {"actor_model": {"spec": "m", "path": "m", "note": ""}, "reward_model": {"spec": "actor", "path": "m",
            "note": ""}, "deployment": "single_gpu", "seconds": {}, "sft_eval_perplexity": {},
            "reward_model_eval_accuracy": {"after": acc}, "judge_eval_accuracy": {"after": judge_acc},
            "ppo_kl_per_answer": {"after": 3.0}, "heldout_reward": ho, "models": {}, "plots": {},
            "overview_plot": None, "logs": "logs", "targets": json.loads(
                (REPO / "configs/presets/smollm2-135m.json").read_text())["targets"]}


def test_judged_table_marks_each_target(e2e):
    ho = {"num_prompts": 4, "sources": ["step3-eval"], "baseline_reward_mean": 0.1, "baseline_reward_std": 1.0,
          "finetune_reward_mean": 0.9, "finetune_reward_std": 1.0, "baseline_judge_mean": 0.0,
          "baseline_judge_std": 1.0, "finetune_judge_mean": 0.3, "finetune_judge_std": 1.0,
          "judge_gain_in_baseline_std": 0.3, "judge_win_rate": 0.7, "kl_per_answer": 4.0, "kl_samples": 8,
          "baseline_distinct_2": 0.5, "finetune_distinct_2": 0.3, "baseline_ended_share": 0.95,
          "finetune_ended_share": 0.92, "baseline_answer_tokens_mean": 40.0, "finetune_answer_tokens_mean": 50.0,
          "finetune_better": 3, "finetune_worse": 1, "reward_gain": 0.8, "answers_file": "a.jsonl"}
    md = report.report_markdown(report_for(0.70, 0.60, ho))
    met = {line.split("|")[1].strip(): line.split("|")[5].strip() for line in md.splitlines()
           if line.startswith("|") and line.count("|") == 6}
    assert met["policy reward model: held-out pair accuracy"] == "**yes**"
    assert met["judge reward model: held-out pair accuracy"] == "**no**"
    assert met["judge win rate of PPO over SFT (ties count half)"] == "**yes**"
    assert met["distinct-2 of the answers"] == "**no**"  # 0.3 is 40% below 0.5
    assert met["answers that end at the end of turn (not cut at the length limit)"] == "**yes**"
    assert any(k.startswith("judge-RM reward") and v == "**no**" for k, v in met.items())  # 0.3 < 0.5 sd
    assert any(k.startswith("KL of the PPO actor to SFT") and v == "**yes**" for k, v in met.items())


def test_compare_runs_groups_seeds(tmp_path):
    for name, gain in (("seed1", 0.2), ("seed2", 0.4), ("kl0.05-seed1", 0.9)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "report.json").write_text(json.dumps(
            {"heldout_reward": {"judge_gain_in_baseline_std": gain}, "reward_model_eval_accuracy": {"after": 0.6}}))
    (tmp_path / "seed1" / "step3").mkdir()
    (tmp_path / "seed1" / "step3" / "metrics.jsonl").write_text(
        "".join(json.dumps({"step": i, "ppo/reward_mean": 0.1 * i, "ppo/kl_per_answer": 0.5 * i}) + "\n"
                for i in range(1, 4)))
    out, png = tmp_path / "runs.md", tmp_path / "runs.png"
    assert COMPARE.main([str(tmp_path / n) for n in ("seed1", "seed2", "kl0.05-seed1")]
                        + ["--out", str(out), "--plot", str(png)]) == 0
    assert png.stat().st_size > 1000
    lines = out.read_text().splitlines()
    mean_row = next(line for line in lines if "mean ± sd of 2" in line)
    assert "+0.30 ± 0.14" in mean_row and "0.600 ± 0.000" in mean_row
    assert sum("mean ± sd" in line for line in lines) == 1  # the sweep point stands alone
    assert COMPARE.main([str(tmp_path / "nothing")]) == 2

"""Critic-free step 3 (--algorithm grpo / rloo / reinforce_pp, reward functions, group filter).

Unit tests (no DeepSpeed): the trainer's advantage path equals dschat.rlhf.estimators' and
ppo_math's functions on hand-built batches; reward scoring (weights, bad rows, errors);
the group filter's refill; flag validation; the dataset rows' extra fields reaching the
collator. Multi-rank: 2 CPU ranks at ZeRO-3 with the hybrid engine, a random tiny OPT
actor on arithmetic word problems (dschat.tasks.arithmetic): every algorithm runs and
saves actor/ only, --kl_ctl 0 builds no reference, the filter refills, a reward function
raising on one rank stops both with exit code 2, a grpo checkpoint resumes under grpo.
"""
import json
import math
from types import SimpleNamespace

import pytest
import torch

from dschat.rlhf import estimators as est
from dschat.rlhf import ppo_math as pm
from dschat.rlhf.experience import Experience
from dschat.rlhf.trainer import PPOConfig, PPOTrainer, RewardFn
from dschat.utils.metrics import read_metrics
from tests.dist.resume_utils import launch, make_step3_models
from tests.dist_utils import REPO
from tests.test_step3 import CRITIC_PHASES, PPO_PHASES, check_phases

STEP3 = REPO / "training" / "step3_rlhf_finetuning" / "main.py"


# ---------------------------------------------------------------------------- unit tests

def _trainer(reward_fns=(), critic=False, ref=True, reward=True, tokenizer=None, **cfg):
    engines = SimpleNamespace(actor=SimpleNamespace(device=torch.device("cpu")), critic=object() if critic else None,
                              ref=object() if ref else None, reward=object() if reward else None, ema=None)
    tokenizer = tokenizer or SimpleNamespace(pad_token_id=0, eos_token_id=1)
    return PPOTrainer(engines, tokenizer, PPOConfig(**cfg), reward_fns=reward_fns)


def _batch(B=6, P=3, A=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    mask = torch.ones(B, A, dtype=torch.long)
    mask[1, 3:] = 0
    mask[4, 2:] = 0
    seq = torch.randint(2, 50, (B, P + A), generator=g)
    return Experience(prompts=seq[:, :P], seq=seq,
                      attention_mask=torch.cat([torch.ones(B, P, dtype=torch.long), mask], 1),
                      action_mask=mask, logprobs=-torch.rand(B, A, generator=g),
                      ref_logprobs=-torch.rand(B, A, generator=g), values=torch.randn(B, A, generator=g),
                      rewards=torch.tensor([1.0, 0.0, 2.0, 0.5, 0.5, 3.0]), prompt_lens=torch.full((B,), P))


@pytest.mark.parametrize("std_norm", [True, False])
def test_grpo_advantages_are_the_estimators_with_kl_in_loss_or_reward(std_norm):
    exp = _trainer(algorithm="grpo", n_samples_per_prompt=3, std_norm=std_norm, kl_estimator="k3",
                   kl_in="loss").compute_advantages(_batch())
    adv = est.group_advantages(exp.rewards, 3, std_norm=std_norm)
    assert torch.equal(exp.advantages, est.broadcast_to_tokens(adv, exp.action_mask))
    # KL in the reward: the answer's summed KL leaves each sequence reward first
    exp = _trainer(algorithm="grpo", n_samples_per_prompt=3, std_norm=std_norm, kl_estimator="k2",
                   kl_in="reward", kl_ctl=0.3).compute_advantages(_batch())
    kl = (est.kl_estimate(exp.logprobs, exp.ref_logprobs, "k2") * exp.action_mask).sum(1)
    adv = est.group_advantages(exp.rewards - 0.3 * kl, 3, std_norm=std_norm)
    assert torch.allclose(exp.advantages, est.broadcast_to_tokens(adv, exp.action_mask))


def test_rloo_and_reinforce_pp_advantages_are_the_estimators():
    exp = _trainer(algorithm="rloo", n_samples_per_prompt=2, kl_in="loss").compute_advantages(_batch())
    assert torch.equal(exp.advantages, est.broadcast_to_tokens(est.rloo_advantages(exp.rewards, 2), exp.action_mask))
    exp = _trainer(algorithm="reinforce_pp", kl_ctl=0.2, clip_reward_value=1.5).compute_advantages(_batch())
    adv, ret = est.reinforce_pp_advantages(exp.rewards, exp.logprobs, exp.ref_logprobs, exp.action_mask, 0.2,
                                           1.0, "k1", 1.5)
    assert torch.equal(exp.advantages, adv) and torch.equal(exp.returns, ret)
    # KL as a loss term: none in the returns
    exp = _trainer(algorithm="reinforce_pp", kl_in="loss", kl_ctl=0.2).compute_advantages(_batch())
    adv, _ = est.reinforce_pp_advantages(exp.rewards, exp.logprobs, exp.ref_logprobs, exp.action_mask, 0.0)
    assert torch.equal(exp.advantages, adv)


def test_ppo_default_path_is_ds_chat_and_k3_adds_the_estimator_to_the_rewards():
    exp = _trainer(critic=True).compute_advantages(_batch())
    rewards = pm.compute_kl_rewards(exp.logprobs, exp.ref_logprobs, exp.rewards, exp.action_mask, 0.1, 5.0)
    adv, ret = pm.compute_gae(exp.values, rewards, exp.action_mask, 1.0, 0.95)
    assert torch.equal(exp.advantages, adv) and torch.equal(exp.returns, ret)
    exp = _trainer(critic=True, kl_estimator="k3").compute_advantages(_batch())
    kl = est.kl_estimate(exp.logprobs, exp.ref_logprobs, "k3") * exp.action_mask
    rewards = pm.compute_kl_rewards(exp.logprobs, exp.ref_logprobs, exp.rewards, exp.action_mask, 0.0, 5.0) - 0.1 * kl
    adv, _ = pm.compute_gae(exp.values, rewards, exp.action_mask, 1.0, 0.95)
    assert torch.allclose(exp.advantages, adv)


def _tokenizer():
    from dschat.models.model_utils import load_tokenizer
    return load_tokenizer(None)


def _scoring_batch(tok, prompts, answers, P=16, A=8):
    rows = []
    for p, a in zip(prompts, answers):
        pi, ai = tok(p)["input_ids"][-P:], tok(a)["input_ids"][:A]
        rows.append(([tok.pad_token_id] * (P - len(pi)) + pi, [1] * len(ai) + [0] * (A - len(ai)),
                     ai + [tok.pad_token_id] * (A - len(ai)), [0] * (P - len(pi)) + [1] * len(pi)))
    seq = torch.tensor([r[0] + r[2] for r in rows])
    return seq, torch.tensor([r[3] for r in rows]), torch.tensor([r[1] for r in rows])


def test_reward_functions_get_texts_and_fields_weights_overlong_and_bad_rows():
    tok = _tokenizer()
    seen = {}

    def by_answer(prompts, answers, answer=None, **_):
        seen.update(prompts=prompts, answers=answers, answer=answer)
        return [float(a.strip() == ref) if ref != "bad" else math.nan for a, ref in zip(answers, answer)]

    def constant(prompts, answers, **_):
        return [0.5] * len(answers)

    fns = [RewardFn("by_answer", "by_answer (test)", by_answer), RewardFn("constant", "constant (test)", constant)]
    trainer = _trainer(fns, reward=False, tokenizer=tok, n_samples_per_prompt=2, reward_weights=[2.0, 1.0],
                       skip_bad_rewards=True,
                       max_answer_seq_len=8, overlong_buffer=4)
    answers = ["7", "8", "12", "12", "5", "5"]
    seq, pmask, amask = _scoring_batch(tok, ["q1"] * 2 + ["q2"] * 2 + ["q3"] * 2, answers)
    fields = [{"answer": "7"}, {"answer": "7"}, {"answer": "12"}, {"answer": "bad"}, {"answer": "5"}, {"answer": "5"}]
    timings = {}
    reward, valid = trainer.score(seq, seq.new_ones(seq.shape), pmask, amask, 16, fields, timings)
    assert seen["answers"] == answers and seen["prompts"][0] == "q1" and seen["answer"] == [f["answer"] for f in fields]
    assert valid.tolist() == [True, True, True, False, True, True]
    lengths = amask.sum(1)
    penalty = est.overlong_penalty(lengths, 8, 4)
    expected = torch.tensor([2.5, 0.5, 2.5, 0.0, 2.5, 2.5]) + penalty
    expected[3] = expected[2]            # a bad row takes its group's mean of the valid rows
    assert torch.allclose(reward, expected), (reward, expected)
    assert trainer.rollout_stats["bad_rewards"] == 1 and "reward_fn_s" in timings


def test_a_raising_reward_function_is_one_error_naming_function_rank_and_row():
    from dschat.rlhf.reward_fn import RewardFunctionError
    tok = _tokenizer()

    def picky(prompts, answers, **_):
        return [1.0 / (len(a) - 2) for a in answers]      # "ab" divides by zero

    trainer = _trainer([RewardFn("picky", "picky (rewards.py)", picky)], reward=False, tokenizer=tok)
    seq, pmask, amask = _scoring_batch(tok, ["q", "q"], ["abc", "ab"])
    with pytest.raises(RewardFunctionError) as e:
        trainer.score(seq, seq.new_ones(seq.shape), pmask, amask, 16, None, {})
    assert "picky (rewards.py)" in str(e.value) and "row 1" in str(e.value) and "[rank 0]" in str(e.value)


def test_fill_groups_drops_constant_groups_and_refills_up_to_the_target():
    trainer = _trainer(algorithm="grpo", n_samples_per_prompt=2)

    def rollout(rewards):
        return _with_rewards(_batch(), rewards)

    first = rollout([1.0, 1.0, 0.0, 2.0, 3.0, 3.0])                 # groups: const, varied, const
    more = iter([rollout([0.0, 1.0, 4.0, 4.0, 5.0, 5.0]), rollout([6.0, 7.0, 1.0, 0.0, 9.0, 9.0])])
    out, stats = trainer.fill_groups(first, lambda: next(more), target=3, max_extra=4)
    assert out.rewards.tolist() == [0.0, 2.0, 0.0, 1.0, 6.0, 7.0]
    assert stats == {"groups_seen": 9, "groups_dropped": 5, "extra_rollouts": 2, "groups_kept": 3}
    # bounded: with no varied group anywhere and max_extra 1, the step is skipped
    const = iter([rollout([1.0] * 6)])
    out, stats = trainer.fill_groups(rollout([2.0] * 6), lambda: next(const), target=3, max_extra=1)
    assert out is None and stats["extra_rollouts"] == 1 and stats["groups_kept"] == 0
    # prompts running out end the refill with what there is
    out, stats = trainer.fill_groups(first, lambda: next(iter(())), target=3, max_extra=4)
    assert out.rewards.tolist() == [0.0, 2.0] and stats["groups_kept"] == 1


def _with_rewards(exp, rewards):
    from dataclasses import replace
    return replace(exp, rewards=torch.tensor(rewards))


def test_clip_fractions_split_the_clip_fraction_by_side():
    logprobs = torch.log(torch.tensor([[0.5, 1.5, 1.0, 0.7]]))
    old = torch.zeros(1, 4)
    adv = torch.tensor([[-1.0, 1.0, 1.0, 1.0]])
    mask = torch.ones(1, 4)
    low, high = est.clip_fractions(logprobs, old, adv, mask, 0.2, 0.28)
    _, total = est.clipped_policy_loss(logprobs, old, adv, mask, 0.2, 0.28)
    assert low.item() == 0.25 and high.item() == 0.25 and total.item() == pytest.approx(0.5)


def _step3_problems(*extra, critic=True):
    import importlib.util

    from dschat.cli.validate import step3_problems
    spec = importlib.util.spec_from_file_location("step3_main_v", STEP3)
    main = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(main)
    base = ["--actor_model_name_or_path", "configs/tiny/opt.json", "--output_dir", "/tmp/never_written",
            "--dtype", "fp32"]
    return step3_problems(main.parse_args(base + list(map(str, extra))))


def test_bad_critic_free_flag_combinations_are_one_line_each_naming_the_flag(tmp_path):
    rewards = tmp_path / "r.py"
    rewards.write_text("def ok(prompts, answers, **kw):\n    return [0.0] * len(answers)\n")
    problems = _step3_problems("--algorithm", "grpo", "--n_samples_per_prompt", "1", "--filter_groups",
                               "--reward_fn", f"{rewards}:ok", "--reward_weights", "1,2",
                               "--per_device_generation_batch_size", "3", "--no_std_norm")
    text = "\n".join(problems)
    assert "--algorithm grpo needs --n_samples_per_prompt >= 2" in text
    assert "--filter_groups needs groups" in text
    assert "--reward_weights has 2 weights; expected 1" in text
    problems = _step3_problems("--algorithm", "rloo", "--n_samples_per_prompt", "4", "--reward_fn", f"{rewards}:nope",
                               "--per_device_generation_batch_size", "6", "--kl_ctl", "0", "--kl_target", "3")
    text = "\n".join(problems)
    assert ("--per_device_generation_batch_size 6 (answers per rank) is not a multiple of "
            "--n_samples_per_prompt 4") in text
    assert "greedy decoding" in text and "has no function 'nope'" in text and "--kl_target needs --kl_ctl > 0" in text
    assert any("--algorithm ppo needs --critic_model_name_or_path" in p for p in _step3_problems())
    assert any("--algorithm grpo needs a reward" in p for p in _step3_problems(
        "--algorithm", "grpo", "--n_samples_per_prompt", "2", "--top_k", "5"))
    ok = _step3_problems("--algorithm", "grpo", "--n_samples_per_prompt", "4", "--top_k", "5", "--reward_fn",
                         f"{rewards}:ok", "--per_device_generation_batch_size", "8", "--filter_groups",
                         "--per_device_training_batch_size", "4")
    assert ok == [], ok


def test_row_fields_reach_the_step3_collator(tmp_path):
    from dschat.data import DataCollatorRLHF, create_prompt_dataset
    from dschat.tasks.arithmetic import main as arithmetic
    arithmetic(["make", "--out", str(tmp_path / "a"), "--train", "20", "--eval", "4", "--difficulty", "1"])
    tok = _tokenizer()
    train, _ = create_prompt_dataset(-1, [str(tmp_path / "a")], "0,0,1", str(tmp_path / "c"), 3, 1, tok, 256,
                                     row_fields=True)
    items = [train[i] for i in range(3)]
    assert all(set(it["fields"]) == {"answer", "difficulty"} for it in items)
    batch = DataCollatorRLHF(256, tok.pad_token_id)(items)
    assert [f["answer"] for f in batch["fields"]] == [it["fields"]["answer"] for it in items]
    plain, _ = create_prompt_dataset(-1, [str(tmp_path / "a")], "0,0,1", str(tmp_path / "c"), 3, 1, tok, 256)
    assert "fields" not in plain[0] and plain.cache_dir != train.cache_dir


# ---------------------------------------------------------------------------- 2 ranks, ZeRO-3

REWARDS = '''
import os

MARKED = ("Maya", "Ana ", "Priya", "Keiko", "Lena")   # prompts about these people: constant reward


def lengthy(prompts, answers, **fields):
    """Varies with the sampled answer; 1.0 for every answer to a prompt with a marker."""
    return [1.0 if any(m in p for m in MARKED) else float(len(a) % 5) for p, a in zip(prompts, answers)]

def fails_on_rank_1(prompts, answers, **fields):
    if os.environ.get("RANK") == "1":
        raise ValueError("no reward on rank 1")
    return [0.0] * len(answers)
'''


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from dschat.tasks.arithmetic import main as arithmetic
    root = tmp_path_factory.mktemp("critic_free")
    actor, critic = make_step3_models(root, "opt")
    arithmetic(["make", "--out", str(root / "arith"), "--train", "160", "--eval", "16", "--difficulty", "1"])
    (root / "rewards.py").write_text(REWARDS)
    return root, actor, critic


def argv(setup, out, *extra, steps=2, n=2, gen=4):
    root, actor, _ = setup
    return ["--actor_model_name_or_path", actor, "--data_path", root / "arith", "--data_split", "0,0,1",
            "--actor_zero_stage", "3", "--enable_hybrid_engine", "--dtype", "fp32", "--output_dir", out,
            "--data_output_path", root / "cache", "--n_samples_per_prompt", n,
            "--per_device_generation_batch_size", gen, "--per_device_training_batch_size", "2",
            "--max_prompt_seq_len", "128", "--max_answer_seq_len", "6", "--top_k", "20",
            "--actor_learning_rate", "1e-3", "--num_warmup_steps", "0", "--max_steps", steps, "--seed", "1234",
            *extra]


def run(args, timeout=240):
    proc = launch(STEP3, args, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-6000:]
    return proc.stdout


COMMON_KEYS = ("ppo/reward_mean", "ppo/reward_std", "ppo/adv_mean", "ppo/adv_std", "ppo/kl", "ppo/kl_k3",
               "ppo/kl_coef", "ppo/actor_clip_frac_low", "ppo/actor_clip_frac_high", "ppo/entropy",
               "gen/answer_len_mean", "time/generate_s", "time/score_s", "time/train_s", "ppo/samples_per_s",
               "memory/peak_gib", "ppo/actor_loss")
CASES = {
    # algorithm: extra flags, what it must show
    "grpo": ["--loss_agg", "seq_mean_token_sum_norm", "--cliprange_high", "0.28", "--no_std_norm"],
    "rloo": ["--kl_ctl", "0"],                                # no reference model
    "reinforce_pp": ["--n_samples_per_prompt", "1", "--kl_target", "0.01", "--kl_estimator", "k2"],
    "ppo": ["--kl_estimator", "k3", "--reward_weights", "0.5,1"],
}


@pytest.mark.parametrize("algorithm", list(CASES))
def test_each_algorithm_runs_and_saves_the_actor_only_critic_free(setup, tmp_path, algorithm):
    root, _, critic = setup
    extra = ["--algorithm", algorithm, "--reward_fn", f"{root / 'rewards.py'}:lengthy", *CASES[algorithm]]
    if algorithm == "ppo":
        extra += ["--critic_model_name_or_path", critic, "--critic_zero_stage", "3"]
    log = run(argv(setup, tmp_path, *extra))
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert len(rows) == 2 and all(r["zero/params_left_gathered"] == 0 for r in rows)
    for key in COMMON_KEYS + ("reward/lengthy_mean", "reward/bad_skipped", "time/reward_fn_s"):
        assert key in rows[-1], key
    for r in rows:
        assert all(math.isfinite(r[k]) for k in ("ppo/actor_loss", "ppo/adv_mean", "ppo/entropy")), r
    assert (tmp_path / "actor" / "model.safetensors").exists()
    assert (tmp_path / "critic").exists() == (algorithm == "ppo")
    assert ("critic engine ready" in log) == (algorithm == "ppo")
    if algorithm == "rloo":
        assert "no reference model (--kl_ctl 0)" in log
        assert all(r["ppo/kl"] == 0 and r["ppo/kl_coef"] == 0 for r in rows)
    else:
        assert "no reference model" not in log
    if algorithm == "reinforce_pp":
        assert rows[0]["ppo/kl_coef"] == 0.1 and rows[1]["ppo/kl_coef"] != 0.1     # adaptive
    if algorithm == "grpo":
        assert "ppo/kl_loss" in rows[-1] and "ppo/critic_loss" not in rows[-1]
        # per-phase seconds: the rewards come from the function alone, and nothing of a critic
        check_phases(rows, ("gen", "score_actor", "score_ref", "score_reward", "actor_fwd", "actor_bwd",
                            "actor_step"), absent=CRITIC_PHASES)
    if algorithm == "ppo":
        assert "ppo/critic_loss" in rows[-1] and "ppo/value_mean" in rows[-1]
        check_phases(rows, PPO_PHASES)
    if algorithm == "rloo":
        check_phases(rows, ("gen", "score_actor", "score_reward"), absent=("score_ref",) + CRITIC_PHASES)


def test_filter_groups_refills_when_some_groups_are_constant(setup, tmp_path):
    root = setup[0]
    log = run(argv(setup, tmp_path, "--algorithm", "grpo", "--reward_fn", f"{root / 'rewards.py'}:lengthy",
                   "--filter_groups", "--filter_groups_max_extra", "8", "--dump_generations", tmp_path / "gen.jsonl",
                   steps=2))
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert len(rows) == 2, log[-3000:]
    dropped = sum(r["filter/groups_dropped"] for r in rows)
    assert dropped > 0 and sum(r["filter/extra_rollouts"] for r in rows) > 0, rows
    for r in rows:
        assert r["filter/groups_kept_per_rank"] == 2            # refilled to the full batch
        assert r["filter/groups_seen"] - r["filter/groups_dropped"] >= 4
    trained = [json.loads(line) for line in (tmp_path / "gen.jsonl").read_text().splitlines()]
    marked = ("Maya", "Ana ", "Priya", "Keiko", "Lena")
    assert trained and not any(m in t["prompt"] for t in trained for m in marked)  # constant groups: dropped


def test_reward_function_error_on_one_rank_stops_both_ranks_with_one_line(setup, tmp_path):
    root = setup[0]
    proc = launch(STEP3, argv(setup, tmp_path, "--algorithm", "grpo", "--reward_fn",
                              f"{root / 'rewards.py'}:fails_on_rank_1"), timeout=180)
    assert proc.returncode == 2, proc.stdout[-4000:]
    # one line from each rank (both ranks write to one pipe here, so the two may share a line)
    errors = ["error: " + e.split("\n")[0] for e in proc.stdout.split("error: ")[1:]]
    assert len(errors) == 2 and "Traceback" not in proc.stdout, proc.stdout[-4000:]
    for line in errors:
        assert line.startswith("error: reward function fails_on_rank_1") and "no reward on rank 1" in line \
            and "row 0" in line and line.rstrip().endswith("[rank 1]"), line


def test_grpo_checkpoint_resumes_under_grpo(setup, tmp_path):
    root = setup[0]
    flags = ["--algorithm", "grpo", "--reward_fn", f"{root / 'rewards.py'}:lengthy", "--save_interval", "1"]
    run(argv(setup, tmp_path, *flags, steps=2))
    ckpt = sorted((tmp_path / "checkpoints").iterdir())
    assert ckpt and not any((c / "critic").exists() for c in ckpt)
    log = run(argv(setup, tmp_path, *flags, "--resume", steps=3))
    assert "resumed from" in log
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert not (tmp_path / "critic").exists() and (tmp_path / "actor" / "model.safetensors").exists()


def test_ppo_with_function_rewards_starts_its_critic_from_the_sft_model(setup, tmp_path):
    """Rewards from a function only (the reward model's weight 0): the critic may start from a
    causal-LM folder (the actor's own), with a new value head, and no reward model is built."""
    root, actor, _ = setup
    log = run(argv(setup, tmp_path, "--algorithm", "ppo", "--n_samples_per_prompt", "1",
                   "--reward_fn", f"{root / 'rewards.py'}:lengthy", "--critic_model_name_or_path", actor,
                   "--reward_weights", "0,1", "--critic_zero_stage", "3"))
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert len(rows) == 2 and "critic engine ready" in log
    assert all(math.isfinite(r["ppo/critic_loss"]) for r in rows), rows
    assert (tmp_path / "critic" / "model.safetensors").exists()
    # the same LM folder as the reward model (weight 1) is refused with the step-2 hint
    proc = launch(STEP3, argv(setup, tmp_path / "bad", "--algorithm", "ppo", "--n_samples_per_prompt", "1",
                              "--reward_fn", f"{root / 'rewards.py'}:lengthy",
                              "--critic_model_name_or_path", actor), timeout=240)
    assert proc.returncode != 0 and "is not a reward model" in proc.stdout, proc.stdout[-3000:]

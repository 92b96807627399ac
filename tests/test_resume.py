"""Checkpoints and exact resume (issue #7).

Single-process: checkpoint discovery, pruning, incomplete folders, metrics truncation,
data skipping, RNG round trip, the non-finite guard. Multi-rank (2 CPU ranks, ZeRO-3,
fp32): one launch runs several step-1 trainings in-process (uninterrupted, checkpointed,
resumed, non-finite losses), one launch does the same for step 3 (actor, critic, EMA,
seeded sampling).
"""
import json
import random

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from torch.utils.data import TensorDataset

from dschat.engine.train_utils import make_loader
from dschat.utils import checkpoint as C
from dschat.utils.metrics import MetricsLogger
from tests.dist.resume_utils import make_step3_models, records, run_plan, series, step1_argv, step3_argv


# ------------------------------------------------------------------ single process
def _fake_checkpoint(root, step, complete=True):
    path = C.checkpoint_root(root) / C.checkpoint_name(step)
    path.mkdir(parents=True)
    (path / C.STATE_FILE).write_text(json.dumps({"step": step}))
    if complete:
        (path / C.MARKER).write_text("{}")
    return path


def test_only_complete_checkpoints_are_found_and_incomplete_ones_are_removed(tmp_path):
    for step in (2, 4, 6):
        _fake_checkpoint(tmp_path, step)
    unmarked = _fake_checkpoint(tmp_path, 8, complete=False)  # renamed without marker: never loaded
    tmp = C.checkpoint_root(tmp_path) / (C.TMP_PREFIX + C.checkpoint_name(10))
    tmp.mkdir()
    (tmp / C.MARKER).write_text("{}")  # even a marked temp folder is not a checkpoint
    assert C.latest_checkpoint(tmp_path).name == C.checkpoint_name(6)
    assert set(C.incomplete_checkpoints(tmp_path)) == {unmarked, tmp}
    C.remove_incomplete(tmp_path)
    assert not unmarked.exists() and not tmp.exists()
    assert [p.name for p in C.prune(tmp_path, keep_last=2)] == [C.checkpoint_name(2)]
    assert [p.name for p in C.complete_checkpoints(tmp_path)] == [C.checkpoint_name(4), C.checkpoint_name(6)]
    assert C.prune(tmp_path, keep_last=0) == []
    assert C.latest_checkpoint(tmp_path / "nothing") is None


def test_resume_needs_the_same_world_size(tmp_path):
    path = _fake_checkpoint(tmp_path, 4)
    (path / C.STATE_FILE).write_text(json.dumps({"step": 4, "world_size": 2}))
    with pytest.raises(C.UserInputError, match="written by 2 ranks, this run has 1"):
        C.Checkpointer(str(tmp_path)).load(path)


def test_due_counts_multiples_of_the_interval():
    ck = C.Checkpointer("unused", save_interval=3)
    saved = []
    for step in range(1, 10):
        if ck.due(step):
            saved.append(step)
            ck.last_saved_step = step
    assert saved == [3, 6, 9]
    ck.last_saved_step = 6  # step 3 saves late (after a buffered round): the next is still at 9
    assert not ck.due(8) and ck.due(10)
    assert not C.Checkpointer("unused", save_interval=0).due(5)


def test_truncate_metrics_keeps_the_records_up_to_the_checkpoint(tmp_path):
    with MetricsLogger(tmp_path) as m:
        for step in range(6):
            m.log(step, {"train/loss": float(step)})
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 6, "train/lo')  # torn by a crash
    C.truncate_metrics(tmp_path, 3)
    assert [r["step"] for r in records(tmp_path)] == [0, 1, 2, 3]


def test_skip_batches_continues_the_seeded_epoch_order():
    loader = make_loader(TensorDataset(torch.arange(40)), 4, shuffle=True, seed=7)
    loader.sampler.set_epoch(3)
    full = [b[0].tolist() for b in loader]
    rest = [b[0].tolist() for b in C.skip_batches(loader, 4)]
    assert rest == full[4:] and len(C.skip_batches(loader, 4)) == len(full) - 4
    assert C.skip_batches(loader, 0) is loader


def test_rng_state_round_trip():
    gen = torch.Generator().manual_seed(5)
    state = C.rng_state({"g": gen})
    first = (random.random(), np.random.rand(), torch.rand(2).tolist(), torch.rand(1, generator=gen).item())
    C.set_rng_state(state, {"g": gen})
    assert (random.random(), np.random.rand(), torch.rand(2).tolist(), torch.rand(1, generator=gen).item()) == first


def test_nonfinite_guard_counts_and_halts(tmp_path):
    guard = C.NonFiniteGuard(max_in_a_row=2, device="cpu")
    assert guard.ok("loss", 1, torch.tensor(1.0))
    assert not guard.ok("loss", 2, torch.tensor(float("nan")))
    assert guard.ok("loss", 3, torch.tensor(2.0)) and guard.halted is None  # a good one resets the run
    assert not guard.ok("loss", 4, torch.tensor([1.0, float("inf")]))
    assert not guard.ok("loss", 5, torch.tensor(float("nan")))
    assert guard.skipped == 3 and guard.halted == "loss"
    with pytest.raises(C.TrainingHalted, match="--max_nonfinite_in_a_row 2.*ckpt-here"):
        guard.check_halt(5, lambda: "ckpt-here")
    restored = C.NonFiniteGuard(2, "cpu")
    restored.load_state(json.loads(json.dumps(guard.state())))
    assert restored.state() == guard.state()


# ------------------------------------------------------------------ step 1, 2 ranks
STEPS = 6


@pytest.fixture(scope="module")
def step1_runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("resume1")
    cache = tmp / "cache"
    d = {k: tmp / k for k in ("ref", "ckpt", "res", "nan", "g0", "g1", "halt", "rm_ckpt", "rm_res")}
    # dropout off: a skipped group draws a different number of dropout masks in g0 and g1
    gas = ["--gradient_accumulation_steps", "2", "--per_device_train_batch_size", "2", "--dropout", "0"]
    runs = [
        {"step": 1, "argv": step1_argv(d["ref"], cache, steps=STEPS)},
        {"step": 1, "argv": step1_argv(d["ckpt"], cache, steps=STEPS, extra=["--save_interval", 2, "--keep_last", 0])},
        {"step": 1, "argv": step1_argv(d["res"], cache, steps=STEPS, extra=["--save_interval", 2, "--resume"]),
         "copy_checkpoint": [str(d["ckpt"]), 2, str(d["res"])]},
        {"step": 1, "argv": step1_argv(d["nan"], cache, steps=STEPS), "env": {"DSCHAT_TEST_NONFINITE": "3"}},
        # gradient accumulation: a NaN in the first micro-batch skips before any backward; in
        # the second, the first one's gradients must be dropped - both must train the same
        {"step": 1, "argv": step1_argv(d["g0"], cache, steps=STEPS, extra=gas),
         "env": {"DSCHAT_TEST_NONFINITE": "3.0"}},
        {"step": 1, "argv": step1_argv(d["g1"], cache, steps=STEPS, extra=gas),
         "env": {"DSCHAT_TEST_NONFINITE": "3.1"}},
        {"step": 1, "argv": step1_argv(d["halt"], cache, steps=STEPS, extra=["--max_nonfinite_in_a_row", 3]),
         "env": {"DSCHAT_TEST_NONFINITE": "3,4,5"}},
        # step 2 (reward model) shares the step-1 loop: checkpointed run, resumed copy
        {"step": 2, "argv": step1_argv(d["rm_ckpt"], cache, steps=4, extra=["--save_interval", 2])},
        {"step": 2, "argv": step1_argv(d["rm_res"], cache, steps=4, extra=["--save_interval", 2, "--resume"]),
         "copy_checkpoint": [str(d["rm_ckpt"]), 2, str(d["rm_res"])]},
    ]
    results, _ = run_plan(tmp, runs, timeout=400)
    return d, dict(zip(d, results))


def test_checkpointing_does_not_change_training_and_resume_is_exact(step1_runs):
    d, results = step1_runs
    assert all(results[k]["rc"] == 0 for k in ("ref", "ckpt", "res")), results
    ref, ckpt, res = (series(d[k], "train/loss") for k in ("ref", "ckpt", "res"))
    assert len(ref) == STEPS and ckpt == ref, (ref, ckpt)
    assert sorted(res) == list(range(3, STEPS + 1)), res  # only the steps after the checkpoint ran
    assert all(res[s] == ref[s] for s in res), (ref, res)  # bit-exact (fp32, dropout on)
    names = [p.name for p in C.complete_checkpoints(d["ckpt"])]
    assert names == [C.checkpoint_name(s) for s in (2, 4, 6)], names
    state = json.loads((C.checkpoint_root(d["ckpt"]) / C.checkpoint_name(4) / C.STATE_FILE).read_text())
    assert state["step"] == 4 and state["batches_in_epoch"] == 4 and state["world_size"] == 2
    assert state["config"]["args"]["save_interval"] == 2  # the resolved configuration rides along
    assert (d["res"] / "model.safetensors").exists()  # the final model is still written at the root
    final_ref, final_res = load_file(d["ref"] / "model.safetensors"), load_file(d["res"] / "model.safetensors")
    assert all(torch.equal(final_ref[k], final_res[k]) for k in final_ref)
    assert [p.name for p in C.complete_checkpoints(d["res"])] == [C.checkpoint_name(4), C.checkpoint_name(6)]


def test_step2_resume_is_exact(step1_runs):
    d, results = step1_runs
    assert results["rm_ckpt"]["rc"] == results["rm_res"]["rc"] == 0, results
    full, res = series(d["rm_ckpt"], "train/loss"), series(d["rm_res"], "train/loss")
    assert len(full) == 4 and sorted(res) == [3, 4] and all(res[s] == full[s] for s in res), (full, res)
    assert (d["rm_res"] / "reward_model.json").exists()


def test_a_nonfinite_loss_on_one_rank_skips_the_update_on_all(step1_runs):
    d, results = step1_runs
    assert results["nan"]["rc"] == 0, results["nan"]
    ref, nan = series(d["ref"], "train/loss"), series(d["nan"], "train/loss")
    skipped = series(d["nan"], "train/skipped_nonfinite")
    assert 3 not in nan and [nan[s] for s in (1, 2)] == [ref[1], ref[2]]
    assert [skipped[s] for s in range(1, STEPS + 1)] == [0, 0, 1, 1, 1, 1]
    assert all(np.isfinite(nan[s]) for s in range(4, STEPS + 1))  # training went on, ranks in step
    g0, g1 = series(d["g0"], "train/loss"), series(d["g1"], "train/loss")
    assert 3 not in g0 and 3 not in g1 and len(g0) == STEPS - 1
    assert max(abs(g0[s] - g1[s]) for s in g0) < 1e-6, (g0, g1)


def test_nonfinite_losses_in_a_row_stop_with_a_checkpoint_of_the_last_good_state(step1_runs):
    d, results = step1_runs
    assert results["halt"]["rc"] == 3, results["halt"]
    assert "3 non-finite loss values in a row" in results["halt"]["error"]
    assert "--max_nonfinite_in_a_row 3" in results["halt"]["error"]
    last = C.latest_checkpoint(d["halt"])
    assert last is not None and last.name == C.checkpoint_name(5), last
    state = json.loads((last / C.STATE_FILE).read_text())
    assert state["nonfinite"] == {"skipped": 3, "in_a_row": {"loss": 3}}
    assert not (d["halt"] / "model.safetensors").exists()  # no final model from a halted run
    # the weights in it are those after step 2, the last good update: same fp32 partitions
    # as the checkpointed run's step-2 checkpoint
    good = C.checkpoint_root(d["ckpt"]) / C.checkpoint_name(2)
    for rank in (0, 1):
        name = f"model/ds/zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"
        a = torch.load(last / name, map_location="cpu", weights_only=False)["optimizer_state_dict"]
        b = torch.load(good / name, map_location="cpu", weights_only=False)["optimizer_state_dict"]
        fa, fb = a["fp32_flat_groups"], b["fp32_flat_groups"]
        assert all(torch.equal(x, y) for x, y in zip(fa, fb))


# ------------------------------------------------------------------ step 3, 2 ranks
def test_step3_resume_is_exact_for_actor_critic_ema_and_sampling(tmp_path):
    actor, critic = make_step3_models(tmp_path)
    cache, full, res, crit = tmp_path / "cache", tmp_path / "full", tmp_path / "res", tmp_path / "crit"
    runs = [
        {"step": 3, "argv": step3_argv(full, cache, actor, critic, steps=4,
                                       extra=["--save_interval", 2, "--keep_last", 0])},
        {"step": 3, "argv": step3_argv(res, cache, actor, critic, steps=4, extra=["--save_interval", 2, "--resume"]),
         "copy_checkpoint": [str(full), 2, str(res)]},
        {"step": 3, "argv": step3_argv(crit, cache, actor, critic, steps=4),
         "env": {"DSCHAT_TEST_NONFINITE": "2", "DSCHAT_TEST_NONFINITE_NAME": "critic_loss"}},
    ]
    results, _ = run_plan(tmp_path, runs, timeout=400)
    assert all(r["rc"] == 0 for r in results), results
    for key in ("ppo/actor_loss", "ppo/critic_loss", "ppo/reward_mean", "ppo/kl", "gen/answer_len_mean"):
        a, b = series(full, key), series(res, key)
        assert len(a) == 4 and sorted(b) == [3, 4], (key, a, b)
        assert all(a[s] == b[s] for s in b), (key, a, b)
    for sub in ("actor", "critic", "actor_ema"):
        a, b = load_file(full / sub / "model.safetensors"), load_file(res / sub / "model.safetensors")
        assert all(torch.equal(a[k], b[k]) for k in a), sub
    ema, start = load_file(full / "actor_ema" / "model.safetensors"), load_file(actor / "model.safetensors")
    assert any(not torch.equal(ema[k], start[k]) for k in ema)  # the EMA did move
    assert (C.checkpoint_root(full) / C.checkpoint_name(2) / "ema" / "rank_00001.pt").exists()
    # a non-finite critic loss skipped the critic's 2 updates of step 2 only; the actor trained on
    assert series(crit, "train/skipped_nonfinite") == {1: 0, 2: 2, 3: 2, 4: 2}
    assert series(crit, "ppo/actor_loss")[2] == series(full, "ppo/actor_loss")[2]


# ------------------------------------------------------------------ steps 1-2 from a saved model, 2 ranks
def test_resume_from_a_saved_model_trains_with_dropout(tmp_path):
    """Steps 1 and 2 from a saved folder (from_pretrained hands the model over in eval mode)
    with dropout 0.1: the resumed run skips the first evaluation, and still trains in train
    mode - its losses after the checkpoint equal the uninterrupted run's, bit for bit."""
    sft, _ = make_step3_models(tmp_path)
    cache = tmp_path / "cache"
    d = {k: tmp_path / k for k in ("s1", "s1_res", "s2", "s2_res")}

    def argv(out, extra=()):
        args = step1_argv(out, cache, steps=4, extra=["--save_interval", 2, *extra])
        args[args.index("--model_name_or_path") + 1] = str(sft)
        return args
    runs = [{"step": 1, "argv": argv(d["s1"])},
            {"step": 1, "argv": argv(d["s1_res"], ["--resume"]),
             "copy_checkpoint": [str(d["s1"]), 2, str(d["s1_res"])]},
            {"step": 2, "argv": argv(d["s2"])},
            {"step": 2, "argv": argv(d["s2_res"], ["--resume"]),
             "copy_checkpoint": [str(d["s2"]), 2, str(d["s2_res"])]}]
    results, _ = run_plan(tmp_path, runs, timeout=400)
    assert all(r["rc"] == 0 for r in results), results
    for full, res in (("s1", "s1_res"), ("s2", "s2_res")):
        a, b = series(d[full], "train/loss"), series(d[res], "train/loss")
        assert len(a) == 4 and sorted(b) == [3, 4], (full, a, b)
        assert all(a[s] == b[s] for s in b), (full, a, b)

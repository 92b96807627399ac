"""Fault tolerance (issue #7): SIGKILL one rank during training and during a save, then
relaunch with --resume. 2 CPU ranks, ZeRO-3, step 1, checkpoints every 2 steps.

Each launch runs in its own process group with a timeout, so a surviving rank that hung
would fail the test instead of blocking it (the deepspeed launcher terminates the other
ranks once one dies; that is what ends the killed launches here).
"""
import time

import pytest

from dschat.utils import checkpoint as C
from tests.dist.resume_utils import STEP1, launch, run_plan, series, step1_argv

STEPS, INTERVAL = 8, 2


def complete_steps(output_dir) -> list[int]:
    return [int(p.name[len(C.PREFIX):]) for p in C.complete_checkpoints(output_dir)]


@pytest.fixture(scope="module")
def killed_twice(tmp_path_factory):
    """Kill rank 1 after step 5; resume and kill rank 1 inside the save of step 6;
    resume to the end (and an uninterrupted reference run in the same launch)."""
    tmp = tmp_path_factory.mktemp("faults")
    run, cache = tmp / "run", tmp / "cache"
    argv = step1_argv(run, cache, steps=STEPS, extra=["--save_interval", INTERVAL])
    outcome = {}

    start = time.time()
    proc = launch(STEP1, argv, timeout=240, env={"DSCHAT_TEST_KILL_AT": "step:5"})
    outcome["train"] = dict(rc=proc.returncode, log=proc.stdout, seconds=time.time() - start,
                            complete=complete_steps(run), partial=C.incomplete_checkpoints(run),
                            logged=sorted(series(run, "train/loss")))

    start = time.time()
    proc = launch(STEP1, argv + ["--resume"], timeout=240, env={"DSCHAT_TEST_KILL_AT": "save:1"})
    partial = C.incomplete_checkpoints(run)
    outcome["save"] = dict(rc=proc.returncode, log=proc.stdout, seconds=time.time() - start,
                           complete=complete_steps(run), partial=[p.name for p in partial],
                           contents=[sorted(q.name for q in p.rglob("*")) for p in partial])

    results, log = run_plan(tmp, [{"step": 1, "argv": argv + ["--resume"]},
                                  {"step": 1, "argv": step1_argv(tmp / "ref", cache, steps=STEPS)}], timeout=300)
    outcome["resume"] = dict(results=results, log=log, complete=complete_steps(run),
                             partial=C.incomplete_checkpoints(run))
    return run, tmp / "ref", outcome


def test_sigkill_during_training_keeps_the_last_checkpoints(killed_twice):
    _, _, outcome = killed_twice
    train = outcome["train"]
    assert train["rc"] != 0, train["log"][-3000:]
    assert "DSCHAT_TEST_KILL_AT=step:5: SIGKILL" in train["log"]
    assert train["seconds"] < 200  # the surviving rank was stopped, it did not hang
    assert train["complete"] == [2, 4] and train["partial"] == [], train
    assert train["logged"] == [1, 2, 3, 4, 5]


def test_sigkill_during_a_save_leaves_a_partial_checkpoint_that_is_never_loaded(killed_twice):
    _, _, outcome = killed_twice
    save = outcome["save"]
    assert save["rc"] != 0, save["log"][-3000:]
    assert "resumed from" in save["log"] and C.checkpoint_name(4) in save["log"]
    assert "DSCHAT_TEST_KILL_AT=save:1: SIGKILL" in save["log"]
    assert save["seconds"] < 200
    assert save["complete"] == [2, 4], save  # step 6 never became a checkpoint
    assert save["partial"] == [C.TMP_PREFIX + C.checkpoint_name(6)], save
    [contents] = save["contents"]  # every rank's engine state was written, the marker was not
    assert "zero_pp_rank_1_mp_rank_00_optim_states.pt" in contents and C.MARKER not in contents, contents


def test_resume_after_both_kills_loses_at_most_one_interval_and_matches_an_uninterrupted_run(killed_twice):
    run, ref, outcome = killed_twice
    resume = outcome["resume"]
    assert [r["rc"] for r in resume["results"]] == [0, 0], resume["results"]
    log = resume["log"]
    assert "removed incomplete checkpoint" in log and C.TMP_PREFIX + C.checkpoint_name(6) in log
    assert f"resumed from {C.checkpoint_root(run) / C.checkpoint_name(4)} (step 4)" in log
    # killed after step 5 and inside the save of step 6: restarted from step 4 both times,
    # i.e. never more than one --save_interval lost
    assert 5 - 4 <= INTERVAL and 6 - 4 <= INTERVAL
    assert resume["partial"] == [] and resume["complete"] == [6, 8]  # --keep_last 2
    got, want = series(run, "train/loss"), series(ref, "train/loss")
    assert sorted(got) == list(range(1, STEPS + 1))  # metrics.jsonl reads as one run
    assert got == want, (got, want)  # bit-exact: steps 1-4 from the first launch, 5-8 after resume
    assert (run / "model.safetensors").exists()


def test_short_host_memory_checkpoints_before_the_final_save_so_a_kill_there_loses_nothing(tmp_path):
    """Rank 0 gathers the final weights in host memory; where less is available than the
    save needs, the trained state is checkpointed first, so the host killing the process in
    the save (a 7B LoRA step 3 ended so) costs nothing: --resume writes the models."""
    from tests.dist.resume_utils import STEP3, make_step3_models, step3_argv

    actor, critic = make_step3_models(tmp_path)
    run = tmp_path / "run"
    argv = step3_argv(run, tmp_path / "cache", actor, critic, steps=2, extra=["--actor_lora_dim", "4"])
    proc = launch(STEP3, argv, timeout=300, env={"DSCHAT_TEST_HOST_AVAILABLE_GIB": "1e-6",
                                                 "DSCHAT_TEST_KILL_AT": "hf_save:1", "DSCHAT_TEST_KILL_RANK": "0"})
    assert proc.returncode != 0 and "DSCHAT_TEST_KILL_AT=hf_save:1: SIGKILL" in proc.stdout, proc.stdout[-3000:]
    assert "the final save needs about" in proc.stdout and "--resume" in proc.stdout, proc.stdout[-3000:]
    assert complete_steps(run) == [2]                   # no --save_interval: this is the guard's checkpoint
    assert not (run / "actor" / "model.safetensors").exists()

    proc = launch(STEP3, argv + ["--resume"], timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert "the final save needs about" not in proc.stdout  # enough memory: no checkpoint first
    for folder in ("actor", "critic", "actor_ema"):
        assert (run / folder / "model.safetensors").is_file(), folder


def test_a_failed_checkpoint_before_the_final_save_does_not_stop_the_models_being_written(tmp_path):
    """The checkpoint that short host memory puts before the final save fails on every rank
    (as on a full disk): the run says so and still writes its models."""
    from tests.dist.resume_utils import STEP3, make_step3_models, step3_argv

    actor, critic = make_step3_models(tmp_path)
    run = tmp_path / "run"
    argv = step3_argv(run, tmp_path / "cache", actor, critic, steps=2)
    proc = launch(STEP3, argv, timeout=300, env={"DSCHAT_TEST_HOST_AVAILABLE_GIB": "1e-6",
                                                 "DSCHAT_TEST_FAIL_AT": "save:1", "DSCHAT_TEST_KILL_RANK": "all"})
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert "the checkpoint meant to come first failed (OSError: DSCHAT_TEST_FAIL_AT=save:1" in proc.stdout, \
        proc.stdout[-3000:]
    assert complete_steps(run) == []
    for folder in ("actor", "critic"):
        assert (run / folder / "model.safetensors").is_file(), folder

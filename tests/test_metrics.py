"""MetricsLogger sinks (JSONL, TensorBoard, offline wandb) and the dschat.plot CLI."""
import json
import math
import subprocess
import sys

import pytest
import torch

from dschat import plot
from dschat.utils.metrics import MetricsLogger, read_metrics


def _write_run(run_dir, steps=20, offset=0.0):
    """A synthetic step-3 run through the real logger."""
    with MetricsLogger(run_dir) as logger:
        for step in range(steps):
            logger.log(step, {
                "train/actor_loss": 1.0 / (step + 1) + offset,
                "train/critic_loss": 2.0 / (step + 1),
                "ppo/reward_mean": -0.7 + 0.25 * step + offset,
                "ppo/reward_std": 1.0,
                "ppo/kl": 0.01 * step,
                "gen/answer_len": 40 + step,
                "perf/tokens_per_s": 1000.0 + 10 * step,
                "time/generate_s": 0.5,
            })


def test_jsonl_written_flushed_and_readable(tmp_path, monkeypatch):
    monkeypatch.setenv("RANK", "0")
    logger = MetricsLogger(tmp_path / "run")
    logger.log(3, {"train/loss": torch.tensor(1.5), "eval/ppl": 7, "ppo/reward_mean": float("nan")})
    # flushed before close: a crashed run keeps its lines
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 1
    logger.log(4, {"train/loss": 1.25})
    logger.close()
    logger.close()  # idempotent
    records = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in records] == [3, 4]
    assert records[0]["train/loss"] == 1.5 and records[0]["eval/ppl"] == 7.0
    assert math.isnan(records[0]["ppo/reward_mean"])
    assert isinstance(records[0]["time"], float)
    with MetricsLogger(tmp_path / "run") as again:  # a resumed run appends
        again.log(5, {"train/loss": 1.0})
    assert len(read_metrics(tmp_path / "run" / "metrics.jsonl")) == 3


def test_a_restarted_run_supersedes_the_steps_it_logs_again(tmp_path, monkeypatch):
    monkeypatch.setenv("RANK", "0")
    with MetricsLogger(tmp_path / "run") as first:  # killed after step 3 (eval logged at step 2)
        for step in (1, 2, 2, 3):
            first.log(step, {"train/loss": 10.0 + step})
    with MetricsLogger(tmp_path / "run") as again:  # resumed from a checkpoint at step 1
        for step in (2, 3, 4):
            again.log(step, {"train/loss": float(step)})
    records = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [(r["step"], r["train/loss"]) for r in records] == [(1, 11.0), (2, 2.0), (3, 3.0), (4, 4.0)]


def test_non_numeric_value_names_the_key(tmp_path, monkeypatch):
    monkeypatch.setenv("RANK", "0")
    with MetricsLogger(tmp_path) as logger:
        with pytest.raises(TypeError, match="train/loss"):
            logger.log(0, {"train/loss": "high"})


def test_other_ranks_write_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    with MetricsLogger(tmp_path / "run", enable_tensorboard=True, enable_wandb=True) as logger:
        logger.log(0, {"train/loss": 1.0})
    assert not (tmp_path / "run").exists()


def test_tensorboard_event_file(tmp_path, monkeypatch):
    pytest.importorskip("tensorboard")
    monkeypatch.setenv("RANK", "0")
    tb_dir = tmp_path / "tb"
    with MetricsLogger(tmp_path / "run", enable_tensorboard=True, tensorboard_path=str(tb_dir),
                       config={"lr": 1e-3}) as logger:
        logger.log(0, {"train/loss": 2.0})
        logger.log(1, {"train/loss": 1.0})
    events = list(tb_dir.glob("events.out.tfevents.*"))
    assert events and events[0].stat().st_size > 0
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(str(tb_dir))
    acc.Reload()
    assert [e.value for e in acc.Scalars("train/loss")] == [2.0, 1.0]


def test_wandb_offline_run_dir(tmp_path, monkeypatch):
    try:
        import wandb  # noqa: F401
    except Exception as err:  # a broken wandb install must not fail the suite
        pytest.skip(f"wandb import failed: {err}")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wb"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    with MetricsLogger(tmp_path / "run", enable_wandb=True, run_name="unit",
                       config={"seed": 1}) as logger:
        logger.log(0, {"train/loss": 1.0})
    runs = list((tmp_path / "wb" / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and any(runs[0].glob("*.wandb"))
    assert (tmp_path / "run" / "metrics.jsonl").exists()


def test_plot_writes_one_png_per_group(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("RANK", "0")
    _write_run(tmp_path / "run")
    assert plot.main([str(tmp_path / "run"), "--out", str(tmp_path / "png")]) == 0
    printed = capsys.readouterr().out.split()
    names = sorted(p.rsplit("/", 1)[-1] for p in printed)
    assert names == ["answer_length.png", "kl.png", "losses.png", "reward.png", "throughput.png"]
    for path in printed:
        with open(path, "rb") as fh:
            assert fh.read(8) == b"\x89PNG\r\n\x1a\n"


def test_plot_several_runs_and_skips_empty_groups(tmp_path, monkeypatch):
    monkeypatch.setenv("RANK", "0")
    _write_run(tmp_path / "sweep" / "a", steps=5)
    with MetricsLogger(tmp_path / "sweep" / "b") as logger:
        logger.log(0, {"train/loss": 3.0, "eval/ppl": 9.0})
    # a torn last line (crash mid-write) is skipped, not fatal
    with open(tmp_path / "sweep" / "b" / "metrics.jsonl", "a") as fh:
        fh.write('{"step": 1, "train/lo')
    runs = {plot.run_label(f, tmp_path / "sweep"): plot.load_series(f)
            for f in plot.find_metrics_files(tmp_path / "sweep")}
    assert list(runs) == ["a", "b"] and runs["b"]["train/loss"] == ([0], [3.0])
    paths = plot.plot_runs(tmp_path / "sweep")
    assert {p.name for p in paths} == {"answer_length.png", "kl.png", "losses.png",
                                       "reward.png", "throughput.png", "evaluation.png"}  # b has eval/ppl
    assert all(p.parent == tmp_path / "sweep" / "plots" for p in paths)
    only_b = plot.plot_runs(tmp_path / "sweep" / "b" / "metrics.jsonl", tmp_path / "b_png")
    assert [p.name for p in only_b] == ["losses.png", "evaluation.png"]


def test_plot_cli_help_and_missing_metrics(tmp_path):
    help_out = subprocess.run([sys.executable, "-m", "dschat.plot", "--help"],
                              capture_output=True, text=True, timeout=120)
    assert help_out.returncode == 0 and "RUN_DIR" in help_out.stdout and "--out" in help_out.stdout
    missing = subprocess.run([sys.executable, "-m", "dschat.plot", str(tmp_path)],
                             capture_output=True, text=True, timeout=120)
    assert missing.returncode == 2
    assert "no metrics.jsonl found" in missing.stderr and len(missing.stderr.strip().splitlines()) == 1


def test_group_membership():
    keys = ["train/loss", "ppo/actor_loss", "ppo/reward_mean", "eval/reward_score", "ppo/kl",
            "ppo/approx_kl", "gen/answer_len", "perf/tokens_per_s", "time/step_s", "eval/ppl"]
    groups = {stem: [k for k in keys if belongs(k)] for stem, _, belongs in plot.GROUPS}
    assert groups == {
        "losses": ["train/loss", "ppo/actor_loss"],
        "reward": ["ppo/reward_mean", "eval/reward_score"],
        "kl": ["ppo/kl", "ppo/approx_kl"],
        "answer_length": ["gen/answer_len"],
        "throughput": ["perf/tokens_per_s", "time/step_s"],
        "evaluation": ["eval/reward_score", "eval/ppl"],
        "memory": [],
    }
    assert json.dumps(groups)  # plain data


def test_a_round_of_rollouts_is_one_metrics_row():
    """--generation_batches > 1: a round's row averages its rollouts' values by their row
    counts, keeps maxima / minima over them, sums the skipped-reward count and keeps the
    round's KL coefficient."""
    from dschat.rlhf.trainer import merge_rollout_metrics
    a = {"ppo/reward_mean": 1.0, "gen/answer_len_max": 7.0, "ppo/adv_min": -2.0, "reward/bad_skipped": 1,
         "ppo/kl_coef": 0.1}
    b = {"ppo/reward_mean": 4.0, "gen/answer_len_max": 5.0, "ppo/adv_min": -3.0, "reward/bad_skipped": 2,
         "ppo/kl_coef": 0.1}
    m = merge_rollout_metrics([a, b], [2, 1])
    assert m == {"ppo/reward_mean": (1.0 * 2 + 4.0) / 3, "gen/answer_len_max": 7.0, "ppo/adv_min": -3.0,
                 "reward/bad_skipped": 3, "ppo/kl_coef": 0.1}
    assert merge_rollout_metrics([a], [5]) == a

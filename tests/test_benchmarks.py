"""The GPU benchmarks' scripts on CPU at tiny shapes: they run, and what they check holds.

The numbers they print on CPU mean nothing; these tests keep the scripts working between
device sessions and run their correctness columns for real (ZeRO-3 over 2 CPU ranks).
"""
import json

from tests.dist_utils import REPO, run_deepspeed, run_python


def _rows(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_rank_check_every_rank_matches_hf(tmp_path):
    out = tmp_path / "rank"
    run_deepspeed(REPO / "benchmarks" / "rank_check.py",
                  ["--model", "tiny-bloom", "--dtypes", "fp32", "--batch", "3", "--prompt_len", "12",
                   "--new_tokens", "6", "--out", out], timeout=600)
    rows = _rows(out.with_suffix(".jsonl"))
    assert {r["rank"] for r in rows} == {0, 1}
    assert {r["path"] for r in rows} == {"zero3 hooks", "ours full (replica)", "ours fast",
                                         "ours full, HF generate", "ours layered"}
    for r in rows:
        if "rel_err" in r:
            assert r["rel_err"] < 1e-5, r
        if "same_rows" in r:
            assert r["same_rows"] == 1.0 and r["same_first_token"] == 1.0, r
        if "vs_rank0_max_abs" in r:
            assert r["vs_rank0_max_abs"] == 0.0, r
    assert "| fp32 | 1 | ours fast |" in out.with_suffix(".md").read_text()


def test_generation_benchmark_modes_agree(tmp_path):
    out = tmp_path / "gen"
    run_python(REPO / "benchmarks" / "generation.py",
               ["--models", "tiny-bloom", "--batch", "2", "--prompt_len", "8", "--new_tokens", "4",
                "--dtype", "fp32", "--layered", "--out", out], timeout=600)
    rows = _rows(out.with_suffix(".jsonl"))
    assert [r["mode"] for r in rows] == ["hf", "zero3 hooks", "zero3 DeepSpeed unwrap", "ours generic",
                                         "ours generic layered", "ours fast"]
    assert all(r["same_rows_as_hf"] == 1.0 for r in rows[1:]), rows
    assert "| tiny-bloom | 2 | ours fast |" in out.with_suffix(".md").read_text()

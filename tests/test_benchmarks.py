"""The GPU benchmarks' scripts on CPU at tiny shapes: they run, and what they check holds.

The numbers they print on CPU mean nothing; these tests keep the scripts working between
device sessions and run their correctness columns for real (ZeRO-3 over 2 CPU ranks).
"""
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.dist_utils import REPO, run_deepspeed, run_python
from tests.dist_utils import test_env as subprocess_env


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
                "--dtype", "fp32", "--layered", "--repeats", "2", "--out", out], timeout=600)
    rows = _rows(out.with_suffix(".jsonl"))
    assert [r["mode"] for r in rows] == ["hf", "hf static cache", "zero3 hooks", "zero3 DeepSpeed unwrap",
                                         "ours generic", "ours generic layered", "ours fast"]
    assert all(r["same_rows_as_hf"] == 1.0 for r in rows[1:]), rows
    # every mode timed twice (ours after a refill each time), the table gives the median and spread
    assert all(len(r["run_seconds"]) == 2 for r in rows), rows
    assert all(r["gather_s"] > 0 for r in rows if r["mode"].startswith("ours")), rows
    assert all(r["first_call_s"] > 0 for r in rows if r["mode"] in ("hf static cache", "ours fast")), rows
    table = out.with_suffix(".md").read_text()
    assert "| tiny-bloom | 2 | ours fast |" in table and "median of 2 runs" in table


def test_step3_benchmark_runs_and_a_rerun_counts_only_its_own_steps(tmp_path):
    """step3.py end to end at a tiny shape (one CPU rank, actor and critic at ZeRO-3), twice
    in the same --workdir: the models are reused, and the second table counts only the second
    run's steps (the trainer appends to metrics.jsonl)."""
    args = ["--preset", "tiny-bloom", "--modes", "ours fast", "--warmup", "0", "--batch", "2",
            "--prompt_len", "16", "--answer_len", "8", "--dtype", "fp32", "--num_gpus", "1",
            "--workdir", tmp_path / "work"]
    for steps in (2, 1):
        out = tmp_path / f"step3_{steps}.md"
        profile = ["--profile_step", 1] if steps == 1 else []    # the second run profiles its step
        run_python(REPO / "benchmarks" / "step3.py", args + ["--steps", steps, "--out", out] + profile, timeout=600)
        lines = out.read_text().splitlines()
        row = next(line for line in lines if line.startswith("| ours fast |"))
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert cells[-2:] == [str(steps), "0"], row       # steps done, params left gathered
        # the second table: seconds per phase (no per-phase memory on CPU)
        header = next(line for line in lines if line.startswith("| mode | gen |"))
        phases = [c.strip() for c in header.strip("|").split("|")][1:]
        assert phases == ["gen", "score_actor", "score_ref", "score_reward", "score_critic", "actor_fwd",
                          "actor_bwd", "actor_step", "critic_fwd", "critic_bwd", "critic_step"], header
        seconds = [line for line in lines if line.startswith("| ours fast |")][1]
        assert all(float(c) >= 0 for c in seconds.strip("|").split("|")[1:]), seconds
        assert not any("peak GiB allocated per phase" in line for line in lines)
    assert (tmp_path / "work" / "tiny-bloom" / "actor" / "config.json").exists()
    phases = (tmp_path / "step3_phases_ours_fast.md").read_text()     # trace_phases.py on the trace
    for phase in ("dschat/generate", "dschat/score/reference", "dschat/train/actor_forward"):
        assert f"| {phase} |" in phases, phases


def test_trace_phases_splits_wall_from_kernel_time():
    """A phase's kernels are those launched inside it (by correlation id), wherever they run;
    overlapping kernels count once."""
    from benchmarks.trace_phases import analyse
    ev = [{"ph": "X", "name": "dschat/score/actor", "cat": "user_annotation", "ts": 0, "dur": 100},
          {"ph": "X", "name": "dschat/train/actor_forward", "cat": "user_annotation", "ts": 200, "dur": 50},
          {"ph": "X", "name": "dschat/score/actor", "cat": "gpu_user_annotation", "ts": 20, "dur": 100},  # not a phase
          {"ph": "X", "name": "aten::mm", "cat": "cpu_op", "ts": 5, "dur": 20},
          {"ph": "X", "name": "aten::mm", "cat": "cpu_op", "ts": 10, "dur": 5},         # nested: not counted
          {"ph": "X", "name": "cudaLaunchKernel", "cat": "cuda_runtime", "ts": 10, "dur": 2,
           "args": {"correlation": 1}},
          {"ph": "X", "name": "cudaLaunchKernel", "cat": "cuda_runtime", "ts": 90, "dur": 2,
           "args": {"correlation": 2}},
          {"ph": "X", "name": "cuLaunchKernel", "cat": "cuda_driver", "ts": 210, "dur": 2,
           "args": {"correlation": 3}},
          {"ph": "X", "name": "gemm", "cat": "kernel", "ts": 20, "dur": 30, "args": {"correlation": 1}},
          {"ph": "X", "name": "gemm", "cat": "kernel", "ts": 40, "dur": 80, "args": {"correlation": 2}},  # runs past
          {"ph": "X", "name": "copy", "cat": "kernel", "ts": 260, "dur": 10, "args": {"correlation": 3}}]
    score, train = analyse(ev)
    assert score["phase"] == "dschat/score/actor" and score["launches"] == 2
    assert score["kernel_ms"] == pytest.approx(0.100)          # [20, 120): the union
    assert score["until_last_kernel_ms"] == pytest.approx(0.120)
    assert score["top_host_ops"] == [("aten::mm", pytest.approx(0.020))]
    assert train["kernel_ms"] == pytest.approx(0.010) and train["top_kernels"] == [("copy", pytest.approx(0.010))]


def test_step3_benchmark_offloaded_and_lora_modes(tmp_path):
    """The modes of the 7B-on-one-GPU table at a tiny shape: the optimizer state offloaded
    (DeepSpeed's partial offload at --offload_ratio, the parameters kept where they are)
    and LoRA; both train, and the offload settings reach DeepSpeed's config."""
    out = tmp_path / "step3.md"
    run_python(REPO / "benchmarks" / "step3.py",
               ["--preset", "tiny-bloom", "--modes", "ours fast, optimizer offloaded", "ours fast, LoRA",
                "--offload_ratio", "0.5", "--steps", "2", "--warmup", "0", "--batch", "2", "--prompt_len", "16",
                "--answer_len", "8", "--dtype", "fp32", "--workdir", tmp_path / "work", "--out", out], timeout=600)
    text = out.read_text()
    for mode in ("ours fast, optimizer offloaded", "ours fast, LoRA"):
        row = next(line for line in text.splitlines() if line.startswith(f"| {mode} |"))
        assert [c.strip() for c in row.strip("|").split("|")][-2:] == ["2", "0"], row
    config = json.loads((tmp_path / "work" / "tiny-bloom" / "ours_fast,_optimizer_offloaded" /
                         "training_config.json").read_text())
    zero = json.dumps(config)
    assert '"offload_optimizer": {"device": "cpu", "ratio": 0.5}' in zero, zero[:2000]
    assert not (tmp_path / "work" / "tiny-bloom" / "ours_fast,_LoRA" / "actor").exists()   # --skip_final_save


def test_presets_run_takes_a_preset_through_three_steps(tmp_path):
    """presets_run.py on the CPU row of the demo preset: every step runs and reports."""
    out = tmp_path / "presets.md"
    run_python(REPO / "benchmarks" / "presets_run.py",
               ["--presets", "demo", "--deployment-type", "cpu", "--steps", "1", "--workdir", tmp_path / "work",
                "--out", out], timeout=600)
    row = next(line for line in out.read_text().splitlines() if line.startswith("| demo |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[-1] == "ok" and all(c != "-" for c in cells[2:5]), row
    work = tmp_path / "work" / "demo"
    assert (work / "step3" / "metrics.jsonl").exists() and (work / "step1" / "config.json").exists()
    assert not list(work.glob("step*/**/*.safetensors"))      # weights dropped once the row is read


def test_presets_run_goes_smallest_first():
    """A GPU run cut short still has the small presets' rows."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import presets_run
    finally:
        sys.path.pop(0)
    names = presets_run.presets_with_row("single_gpu")
    sizes = [json.loads((REPO / "configs" / "presets" / f"{n}.json").read_text()).get("params_billion", 0.0)
             for n in names]
    assert len(names) >= 10 and sizes == sorted(sizes), list(zip(names, sizes))


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton not installed")
@pytest.mark.parametrize("script,stem,tol", [("attn_bench.py", "attn", 1e-2), ("linear_bench.py", "linear", 3e-2)])
def test_kernel_sweeps_run_in_the_triton_interpreter(tmp_path, script, stem, tol):
    """The decode-kernel sweeps' --smoke mode: every variant runs and is within bf16
    rounding of its reference (the GPU runs time the same variants)."""
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / script), "--smoke", "--out", str(tmp_path)],
                          cwd=REPO, env=dict(subprocess_env(), TRITON_INTERPRET="1"), capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads((tmp_path / f"{stem}_results.json").read_text())
    assert len(rows) >= 3 and not any("error" in r for r in rows), rows
    assert all(r["err"] <= tol for r in rows), rows


def test_decode_bench_smoke_every_family(tmp_path):
    """decode_bench.py's CPU plan: a tiny model of every family with a fast decode block,
    fp32, fast path token-identical to HF generate (256 forced tokens)."""
    run_python(REPO / "benchmarks" / "decode_bench.py",
               ["--plan", "smoke", "--numerics", "fast", "--profile", "", "--out", tmp_path], timeout=600)
    rows = json.loads((tmp_path / "decode_results.json").read_text())
    assert {r["preset"] for r in rows} == {"tiny-bloom", "tiny-opt", "tiny-llama", "tiny-neox", "tiny-gpt2"}
    for r in rows:
        assert "error" not in r, r
        assert r["frac_identical"] == 1.0 and r["mean_first_divergence"] == 256.0, r


def test_decode_bench_variant_sets_and_restores_switches():
    """A variant's flags set the decode module switches inside `variant()` and every one is
    put back afterwards, also when the run fails (the next variant of a side-by-side table
    must not inherit them)."""
    spec = importlib.util.spec_from_file_location("decode_bench", REPO / "benchmarks" / "decode_bench.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    dtr = bench.decode.kernels
    before = {name: getattr(mod, name) for mod, name in bench._KNOBS}
    defaults = dtr.options()
    with bench.variant("fast:triton:s2:bn64:aw1:cublas:pdl1:pfa16:nogated:cudnn") as (numerics, attn, flags):
        o = dtr.options()
        assert (numerics, attn) == ("fast", "triton")
        assert (o.attn_splits, o.attn_block_n, o.attn_warps) == (2, 64, 1)
        assert (o.decode_linear, o.pdl, o.pdl_prefetch_attn, o.fuse_gated) == (False, 1, 16 * 1024, False)
        assert o.pdl_prefetch == defaults.pdl_prefetch and bench.decode.DECODE_SDPA_BACKENDS is None
    assert {name: getattr(mod, name) for mod, name in bench._KNOBS} == before and dtr.options() == defaults
    with pytest.raises(RuntimeError):
        with bench.variant("fast:s8:aw2"):
            assert dtr.options().attn_splits == 8
            raise RuntimeError("a run that fails")
    assert {name: getattr(mod, name) for mod, name in bench._KNOBS} == before and dtr.options() == defaults


def test_fast_start_runs_three_processes_with_the_same_tokens(tmp_path):
    """fast_start.py: cold, warm and race-only processes each build, generate twice and give
    the same tokens (on CPU there is no race, so the table is all the check there is)."""
    out = tmp_path / "fast_start.md"
    run_python(REPO / "benchmarks" / "fast_start.py",
               ["--model", "tiny-bloom", "--batch", "2", "--prompt_len", "16", "--new_tokens", "8",
                "--workdir", tmp_path / "work", "--out", out], timeout=300)
    rows = [line for line in out.read_text().splitlines() if line.startswith("| ") and "process" not in line]
    assert [r.split(" | ")[0] for r in rows] == ["| cold", "| warm", "| race only (compile cache warm)"]
    assert all(r.rstrip(" |").endswith("True") for r in rows), rows


def test_activation_bytes_counts_the_eager_probabilities():
    """activation_bytes.py at a small shape: eager Bloom keeps each block's probabilities (fp32
    softmax output and its bf16 cast: 6 bytes per score); the fused attention keeps one fp32
    log-sum-exp per query row instead, and nothing else differs."""
    spec = importlib.util.spec_from_file_location("activation_bytes", REPO / "benchmarks" / "activation_bytes.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    a = mod.argparse.Namespace(hidden=128, heads=4, layers=4, batch=2, tokens=64, dtype="bf16", device="cpu")
    (eager, _), (sdpa, _) = mod.per_block("eager", a), mod.per_block("sdpa", a)
    scores = a.batch * a.heads * a.tokens * a.tokens
    assert eager - sdpa == 6 * scores - 4 * a.batch * a.heads * a.tokens, (eager, sdpa)


def test_lora_merge_memory_runs_both_merges(tmp_path):
    """benchmarks/lora_merge_memory.py at a tiny LLaMA shape: both merges run, each in its
    own process, and report a row."""
    out = subprocess.run([sys.executable, "-m", "benchmarks.lora_merge_memory", "--model",
                          str(REPO / "configs/tiny/llama.json"), "--lora_dim", "4"],
                         cwd=REPO, capture_output=True, text=True, check=True).stdout
    assert "| all deltas first |" in out and "| ours |" in out and "ours / all deltas first" in out
    assert "final_save_host_bytes' estimate" in out


def test_zero_step_ops_counts_the_per_gradient_test():
    """benchmarks/zero_step_ops.py at 4 blocks: DeepSpeed's per-gradient NaN/inf test is most
    of ZeRO-2's step (7 ops per trained tensor); without it the step dispatches about what
    ZeRO-3's does."""
    out = run_python(REPO / "benchmarks" / "zero_step_ops.py", ["--layers", "4", "--width", "32"]).stdout
    rows = {line.split(" | ")[0].strip("| "): [float(x) for x in line.strip(" |").split(" | ")[1:]]
            for line in out.splitlines() if line.startswith("| ZeRO")}
    zero3, default, ours = (rows[name] for name, _, _ in _zero_step_configs())
    tensors = ours[0]
    assert default[1] - ours[1] >= 6 * tensors, rows     # the test's ops, one set per gradient
    assert ours[1] < 1.2 * zero3[1], rows


def test_load_weights_compares_both_loads_of_the_same_weights(tmp_path):
    """benchmarks/load_weights.py at a tiny LLaMA: each case loads the same weights both ways,
    each in its own process."""
    out = run_python(REPO / "benchmarks" / "load_weights.py",
                     ["--model", REPO / "configs/tiny/llama.json", "--workdir", tmp_path]).stdout
    rows = [line for line in out.splitlines() if line.startswith(("| causal LM", "| reward model"))]
    assert len(rows) == 3 and all(row.endswith("| yes |") for row in rows), out


def test_load_weights_runs_the_cases_asked_for(tmp_path):
    """--cases: only those loads, and only the folders they read are written."""
    out = run_python(REPO / "benchmarks" / "load_weights.py",
                     ["--model", REPO / "configs/tiny/llama.json", "--workdir", tmp_path,
                      "--cases", "lm-zero2"]).stdout
    rows = [line for line in out.splitlines() if line.startswith(("| causal LM", "| reward model"))]
    assert len(rows) == 1 and rows[0].startswith("| causal LM, ZeRO-2 |") and rows[0].endswith("| yes |"), out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["llama-lm"]


def test_compile_blocks_benchmark_compares_compiled_with_eager(tmp_path):
    """benchmarks/compile_blocks.py at a tiny Bloom on CPU: four rows (eager and compiled,
    checkpointed and not), the compiled rows' loss and gradients within fp32 rounding of eager's."""
    table = tmp_path / "t.md"
    run_python(REPO / "benchmarks" / "compile_blocks.py", ["--model", "tiny", "--batch", "2", "--tokens", "32",
                                                          "--dtype", "fp32", "--repeats", "1", "--device", "cpu",
                                                          "--out", table])
    rows = [line.strip(" |").split(" | ") for line in table.read_text().splitlines()
            if line.startswith(("| eager", "| compiled"))]
    assert [r[0] for r in rows] == ["eager, checkpointed", "compiled, checkpointed", "eager, activations kept",
                                    "compiled, activations kept"], rows
    assert all(float(r[-1]) < 1e-5 for r in rows), rows


def _zero_step_configs():
    spec = importlib.util.spec_from_file_location("zero_step_ops", REPO / "benchmarks" / "zero_step_ops.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.CONFIGS


def test_presets_run_reuse_keeps_completed_steps_and_a_timeout_stops_every_process(tmp_path):
    """--reuse: a second run skips the steps the first completed (their saved models untouched)
    and still reports them. --timeout stops the preset's whole process tree, the launcher's
    ranks included."""
    work, out = tmp_path / "work", tmp_path / "presets.md"
    args = ["--presets", "demo", "--deployment-type", "cpu", "--steps", "1", "--workdir", work, "--reuse"]
    run_python(REPO / "benchmarks" / "presets_run.py", args, timeout=600)
    model = work / "demo" / "step1" / "model.safetensors"
    written = model.stat().st_mtime_ns
    run_python(REPO / "benchmarks" / "presets_run.py", args + ["--out", out], timeout=600)
    assert model.stat().st_mtime_ns == written                       # step 1 was not rerun
    row = next(line for line in out.read_text().splitlines() if line.startswith("| demo |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[-1] == "ok" and all(c != "-" for c in cells[2:5]), row

    slow = tmp_path / "slow"
    proc = run_python(REPO / "benchmarks" / "presets_run.py",
                      ["--presets", "demo", "--deployment-type", "cpu", "--steps", "1", "--workdir", slow,
                       "--timeout", "20"], timeout=300, check=False)
    assert proc.returncode == 1 and "timed out after 20 s" in proc.stdout, proc.stdout[-2000:]
    left = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if str(slow) in cmdline.read_bytes().decode(errors="replace"):
                left.append(cmdline.parent.name)
        except OSError:
            pass
    assert not left, f"processes of the timed-out preset still running: {left}"

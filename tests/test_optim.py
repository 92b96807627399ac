"""The optimizer as steps 1-3 build it: upstream's parameter groups, torch's fused AdamW and the
bf16-state AdamW of --optimizer_dtype bf16."""
import pytest
import torch
import torch.nn as nn

from dschat.engine.optim import build_optimizer, grouped_parameters


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.dense = nn.Linear(16, 16)
        self.ln_f = nn.LayerNorm(16)
        self.lora_right_weight = nn.Parameter(torch.zeros(16, 4))


def test_upstream_groups_decay_no_decay_and_lora():
    groups = grouped_parameters(Tiny(), weight_decay=0.1, lora_lr=5e-4)
    assert [len(g["params"]) for g in groups] == [1, 3, 1]      # dense.weight | biases, ln_f | lora
    assert [g["weight_decay"] for g in groups] == [0.1, 0.0, 0.1] and groups[2]["lr"] == 5e-4


def _train(fused: bool) -> tuple[torch.optim.Optimizer, list[torch.Tensor]]:
    torch.manual_seed(0)
    model = Tiny()
    opt = build_optimizer(model, lr=1e-2, weight_decay=0.1, lora_lr=5e-3, offload=False,
                          adam_kernel="fused" if fused else "foreach")
    g = torch.Generator().manual_seed(1)
    for _ in range(5):
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=g)
        opt.step()
    return opt, [p.detach().clone() for p in model.parameters()]


def test_fused_adamw_is_the_default_and_steps_as_the_unfused_one():
    """The fused kernel (one pass per tensor) where the device has it, else torch's default;
    both give the same weights after 5 steps with weight decay and a LoRA group."""
    fused_opt, fused = _train(True)
    plain_opt, plain = _train(False)
    assert fused_opt.defaults["fused"] is True and not plain_opt.defaults["fused"]
    for a, b in zip(fused, plain):
        assert not torch.equal(a, torch.zeros_like(a))
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_adam_kernel_flag_in_steps_1_2_and_3():
    import argparse

    from dschat.cli import flags
    train, step3 = argparse.ArgumentParser(), argparse.ArgumentParser()
    flags.add_model_train_args(train, learning_rate=1e-3)
    flags.add_step3_args(step3)
    required = {train: ["--model_name_or_path", "m"],
                step3: ["--actor_model_name_or_path", "a", "--critic_model_name_or_path", "c"]}
    for parser, argv in required.items():
        assert parser.get_default("adam_kernel") == "fused"
        known, _ = parser.parse_known_args(argv + ["--adam_kernel", "foreach"])
        assert known.adam_kernel == "foreach"


def test_a_cpu_adam_that_cannot_build_is_one_error_naming_offload():
    """--offload's optimizer is DeepSpeed's CPU Adam, compiled at first use; where that fails
    (here: an extension folder that cannot be created; on a GPU machine: a full disk) the
    error names the flag and the cause instead of DeepSpeed's bare "failed to build/load"."""
    import subprocess
    import sys

    from tests.dist_utils import REPO
    from tests.dist_utils import test_env as subprocess_env

    code = ("import torch\n"
            "from dschat.engine.optim import build_optimizer\n"
            "from dschat.utils.errors import UserInputError\n"
            "try:\n"
            "    build_optimizer(torch.nn.Linear(4, 4), lr=1e-3, weight_decay=0.0, lora_lr=1e-3, offload=True)\n"
            "except UserInputError as e:\n"
            "    print('USER ERROR:', e)\n")
    env = {**subprocess_env(), "TORCH_EXTENSIONS_DIR": "/proc/no_such_dir"}
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=600).stdout
    assert "USER ERROR: --offload needs DeepSpeed's CPU Adam op" in out, out
    assert "FileNotFoundError" in out and "TORCH_EXTENSIONS_DIR" in out, out


# --optimizer_dtype bf16: StochasticRoundingAdamW

def test_stochastic_rounding_is_unbiased_between_the_two_neighbours():
    from dschat.engine.low_precision_adam import stochastic_round_
    g = torch.Generator().manual_seed(0)
    for value, low, high in ((1.0 + 2 ** -10, 1.0, 1.0 + 2 ** -7), (-3.3, -3.3125, -3.296875)):
        src = torch.full((400_000,), value)
        dst = torch.empty(src.shape, dtype=torch.bfloat16)
        stochastic_round_(dst, src.clone(), g)
        assert set(dst.float().unique().tolist()) == {low, high}
        # the mean is the fp32 value (a standard error here is ~1e-5 of the spacing's scale)
        assert abs(dst.double().mean().item() - value) < 2e-5 * abs(high - low) / 2 ** -7, dst.double().mean()
    exact = torch.tensor([0.5, -2.0, 3.0e-5], dtype=torch.bfloat16).float()   # bf16 values stay as they are
    out = torch.empty(3, dtype=torch.bfloat16)
    stochastic_round_(out, exact.clone(), g)
    assert torch.equal(out.float(), exact)


def test_fp32_parameters_step_as_torch_adamw():
    from dschat.engine.low_precision_adam import StochasticRoundingAdamW
    torch.manual_seed(0)
    w = torch.randn(300, 37)
    a, b = w.clone().requires_grad_(), w.clone().requires_grad_()
    ours = StochasticRoundingAdamW([b], lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    torch_adamw = torch.optim.AdamW([a], lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    for _ in range(5):
        g = torch.randn_like(w)
        a.grad, b.grad = g.clone(), g.clone()
        torch_adamw.step()
        ours.step()
    assert not torch.equal(a, w)
    torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-6)


def test_small_bf16_updates_add_up_with_stochastic_rounding_and_vanish_with_nearest():
    """The reason for stochastic rounding: at lr 1e-4 an Adam step moves a weight of 1.0 by
    1e-4, below half of bf16's spacing there (2^-8). Round to nearest (torch's AdamW on bf16
    weights) writes 1.0 back every step; stochastic rounding moves the mean by lr per step."""
    from dschat.engine.low_precision_adam import StochasticRoundingAdamW
    lr, steps, n = 1e-4, 300, 20_000
    ours = torch.ones(n, dtype=torch.bfloat16, requires_grad=True)
    nearest = torch.ones(n, dtype=torch.bfloat16, requires_grad=True)
    opt = StochasticRoundingAdamW([ours], lr=lr, weight_decay=0.0, generator=torch.Generator().manual_seed(0))
    plain = torch.optim.AdamW([nearest], lr=lr, weight_decay=0.0)
    for _ in range(steps):
        ours.grad = torch.ones(n, dtype=torch.bfloat16)   # a constant gradient: each Adam step is -lr
        nearest.grad = torch.ones(n, dtype=torch.bfloat16)
        opt.step()
        plain.step()
    assert torch.equal(nearest.float(), torch.ones(n))
    assert abs(ours.double().mean().item() - (1 - lr * steps)) < 0.02 * lr * steps, ours.double().mean()
    assert opt.state[ours]["exp_avg"].dtype == torch.bfloat16 == opt.state[ours]["exp_avg_sq"].dtype


def _fused_adam_report(interpret: bool) -> dict:
    import json
    import subprocess
    import sys

    from tests.dist_utils import REPO
    from tests.dist_utils import test_env as subprocess_env
    env = dict(subprocess_env(), **({"TRITON_INTERPRET": "1"} if interpret else {}))
    proc = subprocess.run([sys.executable, str(REPO / "tests" / "dist" / "fused_adam_check.py")], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _check_fused_adam(r: dict) -> None:
    assert r["fused_used"] and not r["torch_used_fused"]
    for name in ("weight", "exp_avg", "exp_avg_sq"):
        assert r["nearest_differ_share"][name] < 3e-2, r   # H100: 1.4% of exp_avg (FMA contraction)
        assert r["nearest_max_steps"][name] <= 1, r
        assert r["stochastic_max_steps"][name] <= 1, r
        assert 0.1 < r["stochastic_differ_share"][name] < 0.9, r
    lr, steps = r["lr"], r["steps"]
    assert abs(r["small_update_mean"]["stochastic"] - (1 - lr * steps)) < 0.02 * lr * steps, r
    assert r["small_update_mean"]["nearest"] == 1.0, r
    assert r["fresh_noise_differ_share"] > 0.1, r
    # a tensor over FUSED_LAUNCH elements runs in several launches, each with its own noise
    assert r["split_launch_nearest_equal"] and r["split_launch_rounded_both_ways"], r
    assert not r["split_launch_noise_repeats"], r


@pytest.mark.skipif(not __import__("dschat.engine.low_precision_adam", fromlist=["triton"]).triton,
                    reason="needs Triton")
def test_fused_bf16_adamw_kernel_in_the_cpu_interpreter():
    """The Triton kernel of --optimizer_dtype bf16, in its CPU interpreter (a new process:
    TRITON_INTERPRET is read when the kernel is defined), against the torch update from the
    same state. Rounded to nearest they agree but for the rare element where fp32 operation
    order flips a rounding (within one bf16 spacing); with stochastic rounding every value
    is one of the same two bf16 neighbours, each way about as often as the noise says; small
    updates add up in the mean (and vanish when rounded to nearest); another seed draws other
    noise."""
    r = _fused_adam_report(interpret=True)
    assert r["device"] == "cpu"
    _check_fused_adam(r)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fused_bf16_adamw_kernel_on_cuda():
    """The same checks with the kernel compiled for the GPU."""
    r = _fused_adam_report(interpret=False)
    assert r["device"] == "cuda"
    _check_fused_adam(r)


def test_optimizer_dtype_flag_needs_bf16_zero_and_no_offload():
    import argparse

    from dschat.cli import flags
    from dschat.cli.validate import _offload_knobs
    parser = argparse.ArgumentParser()
    flags.add_model_train_args(parser, learning_rate=1e-3)
    base = ["--model_name_or_path", "m"]
    assert parser.parse_known_args(base)[0].optimizer_dtype == "fp32"
    args = parser.parse_known_args(base + ["--optimizer_dtype", "bf16", "--dtype", "bf16"])[0]
    assert _offload_knobs(args, (3,)) == []
    args = parser.parse_known_args(base + ["--optimizer_dtype", "bf16", "--dtype", "fp32", "--offload"])[0]
    problems = " | ".join(_offload_knobs(args, (0,)))
    for needle in ("needs --dtype bf16", "ZeRO stage 1, 2 or 3", "drop --offload"):
        assert needle in problems, problems
    # a config built directly (no flags) refuses the same combinations with the same words
    from dschat.engine.config import train_ds_config
    ok = dict(dtype="bf16", micro_batch_size=1, optimizer_dtype="bf16")
    assert train_ds_config(zero_stage=3, **ok)["bf16"]["bf16_optimizer_states"]
    for bad, needle in (({"zero_stage": 0}, "ZeRO stage 1, 2 or 3"),
                        ({"zero_stage": 2, "offload": True}, "drop --offload"),
                        ({"zero_stage": 3, "dtype": "fp16"}, "needs --dtype bf16")):
        with pytest.raises(ValueError, match=needle):
            train_ds_config(**{**ok, **bad})


@pytest.mark.parametrize("stage", [3, 2])
def test_bf16_master_weights_in_deepspeed_are_the_weight_partitions(tmp_path, stage):
    """Real ZeRO engines on 2 CPU ranks: with --optimizer_dtype bf16 the master weights are the
    bf16 weight partitions themselves (no copy), the moments bf16: 4 bytes of optimizer state
    per trained element against fp32's 12. It trains like fp32 state over 6 steps, and a
    checkpoint restores the master weights and moments exactly. No step tests each gradient
    for NaN/inf (bf16 has no loss scale to overflow)."""
    import json

    from dschat.engine.config import REDUCE_BUCKET_SIZE
    from tests.dist_utils import REPO, run_deepspeed
    run_deepspeed(REPO / "tests/dist/bf16_optimizer.py", ["--stage", stage, "--out", tmp_path / "r"])
    for rank in (0, 1):
        r = json.loads((tmp_path / f"r.rank{rank}.json").read_text())
        fp32, bf16 = r["fp32"], r["bf16"]
        assert (fp32["optimizer"], bf16["optimizer"]) == ("AdamW", "StochasticRoundingAdamW")
        assert fp32["master_dtype"] == "torch.float32" and not fp32["master_is_the_bf16_partition"]
        assert bf16["master_dtype"] == "torch.bfloat16" and bf16["master_is_the_bf16_partition"], bf16
        assert bf16["moment_dtypes"] == ["torch.bfloat16"] and fp32["moment_dtypes"] == ["torch.float32"]
        assert (bf16["optimizer_bytes_per_element"], fp32["optimizer_bytes_per_element"]) == (4.0, 12.0)
        if stage == 3:      # our bucket size, not DeepSpeed's 5e8 (0.93 GiB in bf16 held all run)
            assert bf16["reduce_bucket_elements"] == fp32["reduce_bucket_elements"] == [REDUCE_BUCKET_SIZE]
        for run in (fp32, bf16):
            assert run["loaded"] == run["saved"], run
            # bf16 needs no overflow test; ZeRO-1/2's default one would reduce every gradient
            assert run["per_gradient_overflow_tests"] == 0 < run["gradients"], run
        assert bf16["losses"][0] == fp32["losses"][0]                 # same weights, same batch
        # stochastic rounding moves each bf16 weight by up to one ulp (about a tenth of an update
        # at lr 1e-3): one step put a loss 0.050 from fp32's on 2 CPU ranks, where the run moves
        # each rank's loss by 0.9-1.2; the bound is a tenth of that
        assert max(abs(a - b) for a, b in zip(bf16["losses"], fp32["losses"])) < 0.1, (bf16, fp32)
        drop = {k: run["losses"][0] - min(run["losses"]) for k, run in r.items()}
        assert drop["fp32"] > 0.3 and drop["bf16"] > 0.8 * drop["fp32"], drop     # it learns as fp32 does

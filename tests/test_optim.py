"""The optimizer as steps 1-3 build it: upstream's parameter groups and torch's fused AdamW."""
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

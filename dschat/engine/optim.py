"""Optimizer, parameter groups and LR schedule, as upstream DeepSpeed-Chat builds them."""
from __future__ import annotations

import os

import torch
import torch.nn as nn
from transformers import get_scheduler

from dschat.utils.errors import UserInputError, brief

NO_DECAY_KEYS = ("bias", "layer_norm.weight", "layernorm.weight", "norm.weight", "ln_f.weight",
                 "ln_1.weight", "ln_2.weight", "word_embeddings_layernorm.weight")
LR_SCHEDULERS = ("linear", "cosine", "cosine_with_restarts", "polynomial", "constant",
                 "constant_with_warmup")


def grouped_parameters(model: nn.Module, weight_decay: float, lora_lr: float = 5e-4) -> list[dict]:
    """Three groups as upstream: decayed, no-decay (biases and norm weights), LoRA."""
    decay, no_decay, lora = [], [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if "lora_" in name:
            lora.append(p)
        elif any(k in name.lower() for k in NO_DECAY_KEYS):
            no_decay.append(p)
        else:
            decay.append(p)
    groups = [{"params": decay, "weight_decay": weight_decay},
              {"params": no_decay, "weight_decay": 0.0},
              {"params": lora, "weight_decay": weight_decay, "lr": lora_lr}]
    return [g for g in groups if g["params"]]


def build_optimizer(model: nn.Module, *, lr: float, weight_decay: float, lora_lr: float,
                    offload: bool, adam_kernel: str = "fused", optimizer_dtype: str = "fp32",
                    betas=(0.9, 0.95)) -> torch.optim.Optimizer:
    """DeepSpeed's CPU Adam when the optimizer state is offloaded; StochasticRoundingAdamW for
    bf16 master weights (--optimizer_dtype bf16); else torch's AdamW with `adam_kernel`
    (--adam_kernel: "fused" where every parameter's device has the kernel, or "foreach").

    torch's AdamW runs on every accelerator (and on the CPU test machines) without a JIT
    build; DeepSpeedCPUAdam is what makes offloaded steps fast. The fused form is one kernel
    over each tensor: the default multi-tensor form makes about ten passes and allocates
    full-size temporaries (e.g. sqrt(v)) while ZeRO's fp32 master partitions step, which
    adds to the step's memory peak (benchmarks/RESULTS.md, table 3: `device_run.sh adam`).
    """
    groups = grouped_parameters(model, weight_decay, lora_lr)
    if offload:
        from deepspeed.ops.adam import DeepSpeedCPUAdam
        try:
            return DeepSpeedCPUAdam(groups, lr=lr, betas=betas)
        except RuntimeError as e:  # the op is compiled at first use; DeepSpeed's message hides why it failed
            cause = e.__cause__ or e
            raise UserInputError(
                f"--offload needs DeepSpeed's CPU Adam op, which failed to build or load here "
                f"({brief(cause, 200)}). It is "
                "compiled at first use into $TORCH_EXTENSIONS_DIR (~/.cache/torch_extensions), which needs a C++ "
                "compiler, ninja and free disk there; `DS_BUILD_CPU_ADAM=1 pip install deepspeed` builds it "
                "ahead. Or train without --offload.") from None
    if optimizer_dtype == "bf16":
        from dschat.engine.low_precision_adam import StochasticRoundingAdamW
        # DSCHAT_BF16_ROUNDING=nearest: the contrast benchmarks/optimizer_dtype.py measures, not a user option
        return StochasticRoundingAdamW(groups, lr=lr, betas=betas,
                                       stochastic=os.environ.get("DSCHAT_BF16_ROUNDING", "stochastic") != "nearest")
    return torch.optim.AdamW(groups, lr=lr, betas=betas, fused=adam_kernel == "fused" and _fused_supported(groups))


def _fused_supported(groups: list[dict]) -> bool:
    """torch's fused AdamW takes floating-point tensors on the devices it has kernels for."""
    from torch.optim.optimizer import _get_fused_kernels_supported_devices
    devices = _get_fused_kernels_supported_devices()
    return all(p.device.type in devices and torch.is_floating_point(p) for g in groups for p in g["params"])


def build_lr_scheduler(optimizer, name: str, num_warmup_steps: int, num_training_steps: int):
    return get_scheduler(name=name, optimizer=optimizer, num_warmup_steps=num_warmup_steps,
                         num_training_steps=num_training_steps)

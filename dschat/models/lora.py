"""LoRA through peft, under DS-Chat's flag names.

`--lora_dim` is peft's rank; `--lora_module_name` restricts LoRA to modules under that
prefix (upstream's default `decoder.layers.` is OPT's; we default to the family's block
path); the linear layers wrapped are the family's default LoRA targets. As upstream,
lora_alpha = lora_dim (scaling 1).
"""
from __future__ import annotations

import re

import torch
import torch.nn as nn

from dschat.engine.zero import match_partitioned_dtype
from dschat.registry import family_of, is_linear
from dschat.utils.errors import UserInputError

PEFT_PREFIX = "base_model.model."


def is_peft_model(model: nn.Module) -> bool:
    return hasattr(model, "peft_config")


def apply_lora(model: nn.Module, lora_dim: int, lora_module_name: str | None = None,
               only_optimize_lora: bool = False, lora_dropout: float = 0.0) -> nn.Module:
    """Wrap `model` with LoRA adapters; without `only_optimize_lora` every weight still trains."""
    if lora_dim <= 0:
        return model
    from peft import LoraConfig, get_peft_model

    fam = family_of(model)
    prefix = (lora_module_name or fam.lora_module_prefix).rstrip(".")
    targets = "|".join(re.escape(t) for t in fam.lora_targets)
    pattern = rf"(.*\.)?{re.escape(prefix)}\..*\.({targets})"
    names = [n for n, m in model.named_modules() if is_linear(m) and re.fullmatch(pattern, n)]
    if not names:
        raise UserInputError(
            f"--lora_module_name {lora_module_name or prefix!r} matches no linear layer of this "
            f"{fam.model_type} model (its blocks live under {fam.blocks!r}; LoRA targets "
            f"{', '.join(fam.lora_targets)})")
    config = LoraConfig(r=lora_dim, lora_alpha=lora_dim, lora_dropout=lora_dropout,
                        target_modules=pattern, bias="none")
    peft_model = get_peft_model(model, config)
    if not only_optimize_lora:
        for p in peft_model.parameters():
            p.requires_grad_(True)
    else:
        # Frozen embeddings give the first block an input without grad; ZeRO-3 with blocks
        # as leaf modules (--zero3_hook_granularity block) fetches a block's weights for
        # backward through hooks on such inputs, so without this the first block's
        # backward ran on released (empty) weights.
        peft_model.enable_input_require_grads()
    # the adapters are added after zero.Init cast the loaded weights to the run's dtype
    match_partitioned_dtype(peft_model)
    return peft_model


def lora_layers(model: nn.Module) -> dict[str, nn.Module]:
    """Module path -> peft LoRA layer (the modules holding `lora_A`/`lora_B` and `scaling`)."""
    return {path: m for path, m in model.named_modules() if hasattr(m, "lora_A") and hasattr(m, "scaling")}


def lora_delta(layer: nn.Module, a: torch.Tensor, b: torch.Tensor, scale: float) -> torch.Tensor:
    """fp32 `scale * B @ A` in the layout of `layer`'s base weight (GPT-2's Conv1D stores W^T)."""
    delta = (b.float() @ a.float()) * scale
    return delta.T if getattr(layer, "fan_in_fan_out", False) else delta


def merged_state_dict(model: nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Base-model state dict with every LoRA delta folded into its base weight.

    `state` is the model's full (gathered) state dict; for a plain model it is returned
    unchanged. It is consumed: each entry leaves `state` as its merged copy is made, and
    each fp32 delta lives only while its own weight is merged, so the merge adds about one
    weight's worth of host memory. (Holding every delta at once cost 4 bytes per LoRA'd
    parameter, about 25 GB at 7B: the host ran out of memory at the end of a 7B LoRA run.)
    The trained tensors are never modified. (peft's own merge, `merge_and_unload` /
    `get_delta_weight`, reads the live adapter weights, which ZeRO-3 holds partitioned; the
    hybrid engine's replica fill uses it inside a gather.)
    """
    if not is_peft_model(model):
        return state
    adapters: dict[str, list] = {}
    for lora_module_path, module in lora_layers(model).items():
        for adapter, scale in module.scaling.items():
            adapters.setdefault(f"{lora_module_path}.base_layer.weight", []).append(
                (module, f"{lora_module_path}.lora_A.{adapter}.weight",
                 f"{lora_module_path}.lora_B.{adapter}.weight", scale))
    out = {}
    for name in [n for n in state if ".lora_A." not in n and ".lora_B." not in n]:
        tensor = state.pop(name)
        if name in adapters:
            merged = tensor.to(torch.float32, copy=True)
            for module, a, b, scale in adapters[name]:
                merged += lora_delta(module, state[a], state[b], scale)
            tensor = merged.to(tensor.dtype)
            del merged
        clean = name[len(PEFT_PREFIX):] if name.startswith(PEFT_PREFIX) else name
        out[clean.replace(".base_layer.", ".")] = tensor
    state.clear()
    return out

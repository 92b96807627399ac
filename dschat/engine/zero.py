"""Small ZeRO helpers shared by saving, the gather scheduler and tests."""
from __future__ import annotations

from typing import Iterable

import torch
import torch.nn as nn


def is_zero3_param(p: torch.Tensor) -> bool:
    return hasattr(p, "ds_id")


def gathered(params: Iterable[torch.Tensor], modifier_rank=None, enabled: bool = True):
    """`deepspeed.zero.GatheredParameters` over the ZeRO-3 params among `params`."""
    import deepspeed
    params = [p for p in params if is_zero3_param(p)]
    return deepspeed.zero.GatheredParameters(params, modifier_rank=modifier_rank,
                                             enabled=enabled and bool(params))


def full_state_dict(module: nn.Module, *, rank0_only: bool = True, rank: int = 0) -> dict:
    """A CPU fp32-or-native state dict of `module`, gathered parameter by parameter.

    Parameters shared between modules (a tied LM head) appear once, under the first
    name `named_parameters` gives them; buffers that are persistent are included.
    Gathering one parameter at a time keeps the peak at one full tensor per rank.
    """
    state = {}
    for name, param in module.named_parameters():
        with gathered([param]):
            if not rank0_only or rank == 0:
                state[name] = param.detach().to("cpu", copy=True)
    for name, buf in module.named_buffers():
        short = name.rsplit(".", 1)[-1]
        owner = module.get_submodule(name.rsplit(".", 1)[0]) if "." in name else module
        if short in getattr(owner, "_non_persistent_buffers_set", set()):
            continue
        if not rank0_only or rank == 0:
            state[name] = buf.detach().to("cpu", copy=True)
    return state


def params_left_gathered(module: nn.Module) -> list[str]:
    """Names of ZeRO-3 params that are not back to NOT_AVAILABLE (gathered or in flight).

    Parameters ZeRO keeps persistent (below `stage3_param_persistence_threshold`) are
    always available and are not counted.
    """
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
    left = []
    for name, p in module.named_parameters():
        if not is_zero3_param(p) or getattr(p, "ds_persist", False):
            continue
        if p.ds_status != ZeroParamStatus.NOT_AVAILABLE:
            left.append(f"{name}:{p.ds_status.name}")
    return left

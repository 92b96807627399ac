"""Small ZeRO helpers shared by saving, the gather scheduler and tests."""
from __future__ import annotations

from typing import Iterable

import torch
import torch.nn as nn


def is_zero3_param(p: torch.Tensor) -> bool:
    return hasattr(p, "ds_id")


def full_numel(p: torch.Tensor) -> int:
    """Elements of the full (unpartitioned) tensor."""
    return int(p.ds_numel) if is_zero3_param(p) else p.numel()


def full_nbytes(p: torch.Tensor) -> int:
    return full_numel(p) * p.dtype.itemsize


def gathered(params: Iterable[torch.Tensor], modifier_rank=None, enabled: bool = True):
    """`deepspeed.zero.GatheredParameters` over the ZeRO-3 params among `params`."""
    import deepspeed
    params = [p for p in params if is_zero3_param(p)]
    return deepspeed.zero.GatheredParameters(params, modifier_rank=modifier_rank,
                                             enabled=enabled and bool(params))


def match_partitioned_dtype(model: nn.Module) -> None:
    """Parameters added to a model loaded partitioned under ZeRO-3 (LoRA adapters, a reward
    model's value head) in the dtype of the partitioned ones.

    zero.Init casts the loaded weights to the run's bf16/fp16 as it partitions them; what is
    created afterwards is fp32, and DeepSpeed's ZeRO-3 optimizer needs one dtype across its
    parameters (an assert in `defragment` at `deepspeed.initialize`).
    """
    dtypes = {p.dtype for p in model.parameters() if is_zero3_param(p)}
    if len(dtypes) != 1:
        return
    dtype = dtypes.pop()
    for p in model.parameters():
        if not is_zero3_param(p) and p.dtype != dtype:
            p.data = p.data.to(dtype)


def engine_and_module(model) -> tuple[object | None, nn.Module]:
    """(DeepSpeed engine or None, the module) of a DeepSpeed engine or a plain module."""
    from deepspeed import DeepSpeedEngine
    if isinstance(model, DeepSpeedEngine):
        return model, model.module
    return None, model


def release_prefetched(engine) -> None:
    """Complete every ZeRO-3 all-gather still in flight and re-partition what it fetched.

    A forward without a backward (evaluation, experience scoring) of a trained ZeRO-3
    engine follows the trace its training steps recorded - forward, then backward - so at
    the LM head DeepSpeed prefetches the first blocks of a backward that never comes.
    Those parameters stay INFLIGHT until the next forward starts; anything that gathers
    parameters in between (a save, the EMA) fails on them with DeepSpeed's "Cannot
    partition a param in flight". Tiny models hide it: all their parameters stay gathered
    between forward and backward (ZeRO's reuse distance), so nothing is prefetched.

    Uses DeepSpeed's own `partition_all_parameters` (what `empty_partition_cache` runs),
    then gathers the persistent parameters again: ZeRO keeps those resident, and code
    reading them (the replica fill) relies on it. A no-op below ZeRO-3.
    """
    if engine is None:
        return
    optimizer = getattr(engine, "optimizer", None)
    # trained engine: the ZeRO-3 optimizer holds the offload; frozen one: it is the "optimizer"
    offload = getattr(optimizer, "parameter_offload", optimizer)
    if not hasattr(offload, "partition_all_parameters"):
        return
    offload.partition_all_parameters()
    persistent = [p for p in engine.module.parameters() if getattr(p, "ds_persist", False)]
    if persistent:
        persistent[0].all_gather(param_list=persistent)


def in_flight(module: nn.Module) -> list[str]:
    """Names of ZeRO-3 parameters of `module` with an all-gather in flight."""
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
    return [n for n, p in module.named_parameters()
            if is_zero3_param(p) and p.ds_status == ZeroParamStatus.INFLIGHT]


def full_state_dict(model, *, rank0_only: bool = True, rank: int = 0) -> dict:
    """A CPU fp32-or-native state dict of `model` (a DeepSpeed engine or a module),
    gathered parameter by parameter.

    Parameters shared between modules (a tied LM head) appear once, under the first
    name `named_parameters` gives them; buffers that are persistent are included.
    Gathering one parameter at a time keeps the peak at one full tensor per rank. Given
    an engine, prefetches left in flight by its last forward are settled first (see
    `release_prefetched`); a bare module with parameters in flight is an error naming them.
    """
    engine, module = engine_and_module(model)
    release_prefetched(engine)
    busy = in_flight(module)
    if busy:
        raise RuntimeError(f"{len(busy)} ZeRO-3 parameters are in flight (e.g. {busy[:3]}): "
                           "pass the DeepSpeed engine, not its module, so they are settled first")
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


def final_save_host_bytes(*models) -> int:
    """Host memory rank 0 needs to write the largest of `models` (engines or modules) as an
    HF folder: the state `full_state_dict` gathers, in each parameter's dtype, plus an fp32
    copy and an fp32 LoRA delta of the largest weight (the merge builds one at a time), and a
    quarter more for the allocator: the whole save of a TinyLlama-shaped LoRA model peaked at
    0.96x the count without that quarter (benchmarks/lora_merge_memory.py)."""
    need = 0
    for model in models:
        _, module = engine_and_module(model)
        params = list(module.parameters())
        if params:
            need = max(need, sum(full_nbytes(p) for p in params) + 8 * max(full_numel(p) for p in params))
    return need * 5 // 4


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


def _first_block(model: nn.Module) -> nn.Module | None:
    """The model's first transformer block (causal LM, its bare backbone as in the reward
    model, or a PEFT wrapper of either); None for an unregistered family."""
    from dschat.registry import REGISTRY, resolve
    family = REGISTRY.get(getattr(getattr(model, "config", None), "model_type", None))
    if family is None:
        return None
    below_backbone = family.blocks[len(family.base_model) + 1:]
    for module in model.modules():
        for path in (family.blocks, below_backbone):
            blocks = resolve(module, path)
            if isinstance(blocks, nn.ModuleList) and len(blocks):
                return blocks[0]
    return None


def block_class_name(model: nn.Module) -> str | None:
    """Class name of the model's transformer blocks; None for an unregistered family."""
    block = _first_block(model)
    return None if block is None else type(block).__name__


def use_block_granularity(ds_config: dict, model: nn.Module, granularity: str = "block") -> dict:
    """At ZeRO-3, make every transformer block one unit of DeepSpeed's gather hooks.

    DeepSpeed hooks each submodule that holds parameters (every linear and norm): a
    Bloom block costs 8-10 hook pairs per forward and as many in backward, each a few
    hundred microseconds of Python. That host time, not the GPU, bounded step 3 on one
    H200 (profile in benchmarks/RESULTS.md). Declared as a ZeRO "leaf module", a block
    is gathered and released whole: one hook pair, the same parameters live at the peak
    (one block), the same numbers. Marks the blocks of `model` and records their class in
    `zero_optimization.leaf_module` of `ds_config` (in place; returned), both before
    `deepspeed.initialize`.

    A block is also the unit ZeRO prefetches in, so the prefetch bucket is raised to one
    block and the live-parameter limit to two (the block running and the next one in
    flight): with upstream's 3e7 elements a 7B block (2e8) could never be prefetched and
    its all-gather would not overlap the previous block's compute on several GPUs.
    `granularity="module"` keeps DeepSpeed's per-submodule hooks.
    """
    zero = ds_config.get("zero_optimization") or {}
    if zero.get("stage") != 3 or granularity == "module":
        return ds_config
    if granularity != "block":
        raise ValueError(f"granularity must be 'block' or 'module', got {granularity!r}")
    block = _first_block(model)
    if block is None:
        return ds_config
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
    from deepspeed.utils import set_z3_leaf_modules
    # the flag on every block instance is what DeepSpeed's hook registration reads (0.14
    # on); newer DeepSpeed (0.19 here) also takes the classes in its config, where they are
    # saved with the run (older versions reject the unknown key)
    set_z3_leaf_modules(model, [type(block)])
    if "leaf_module" in DeepSpeedZeroConfig.model_fields:
        from deepspeed.runtime.zero.leaf_module_config import DEFAULT_LEAF_MODULE_CLASSES
        name = type(block).__name__
        classes = list(zero.get("leaf_module", {}).get("classes", DEFAULT_LEAF_MODULE_CLASSES))
        zero["leaf_module"] = {"classes": classes + [name] if name not in classes else classes}
    numel = sum(full_numel(p) for p in block.parameters())  # partitioned by zero.Init already
    for key, blocks in (("stage3_prefetch_bucket_size", 1), ("stage3_max_live_parameters", 2)):
        zero[key] = max(zero.get(key, 0), blocks * numel)
    return ds_config


def initialize_engine(model: nn.Module, ds_config: dict, hook_granularity: str = "block", **kwargs):
    """`deepspeed.initialize` with the ZeRO-3 hook granularity applied first (see
    `use_block_granularity`); returns the engine. `kwargs`: optimizer, lr_scheduler, ..."""
    import deepspeed
    engine, *_ = deepspeed.initialize(model=model, config=use_block_granularity(ds_config, model, hook_granularity),
                                      **kwargs)
    if (ds_config.get("bf16") or {}).get("bf16_master_weights_and_grads"):
        master_weights_in_place(engine)
    return engine


def master_weights_in_place(engine) -> int:
    """With bf16 master weights (`--optimizer_dtype bf16`) make each ZeRO master partition the
    bf16 weight partition itself, freeing DeepSpeed's copy; returns the bytes freed.

    DeepSpeed copies the weight partition into a master partition of the master dtype. At
    ZeRO-3 it means to skip the copy when the dtypes match, but its test compares a
    torch.device with a device name (never equal), and ZeRO-1/2 always clone; the copy is
    2 bytes per trained parameter (2.2 GB for a bloom-560m actor and critic, 14 GB at 7B). The
    step writes the master into the weight partition afterwards, a copy onto itself here.
    """
    zero = getattr(engine, "optimizer", None)
    inner = getattr(zero, "optimizer", None)
    if inner is None:
        return 0
    if hasattr(zero, "fp32_partitioned_groups_flat"):          # ZeRO-3 (the optimizer's params are set per step)
        masters, weights = zero.fp32_partitioned_groups_flat, zero.fp16_partitioned_groups_flat
    elif hasattr(zero, "single_partition_of_fp32_groups"):     # ZeRO-1/2 (its param groups hold the masters)
        rank = torch.distributed.get_rank(group=zero.dp_process_group)
        masters = zero.single_partition_of_fp32_groups
        weights = [groups[rank] for groups in zero.parallel_partitioned_bit16_groups]
    else:
        return 0
    freed = 0
    for i, (master, weight) in enumerate(zip(masters, weights)):
        if (weight is None or master is weight or master.dtype != weight.dtype or master.device != weight.device
                or master.shape != weight.shape or master.data_ptr() == weight.data_ptr()):
            continue
        if hasattr(master, "ds_id"):
            weight.ds_id = master.ds_id
        for group in inner.param_groups:
            group["params"] = [weight if p is master else p for p in group["params"]]
        masters[i] = weight
        freed += master.numel() * master.element_size()
    return freed


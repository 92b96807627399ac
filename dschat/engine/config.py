"""DeepSpeed config dicts built from flags (as upstream: never from a JSON file).

`train_ds_config` is for engines that train (actor, critic, SFT, reward model);
`eval_ds_config` for frozen ones (reference, reward). Both are plain dicts, so
they can be printed, saved beside a checkpoint and diffed.
"""
from __future__ import annotations

from contextlib import contextmanager

DTYPES = ("fp32", "fp16", "bf16")


# bf16 has fp32's range: no loss scale, so no overflow to skip. ZeRO-1/2 would still test every
# gradient for NaN/inf before each step (7 ops and two reads per gradient, about 2,000 dispatched
# ops per step at 24 blocks, as many as the rest of the step); ZeRO-3 never tests bf16 gradients.
# The training loops' NonFiniteGuard tests each loss before its backward on every stage.
BF16_CHECKS = {"check_grad_overflow": False}


def _precision_section(dtype: str, optimizer_dtype: str = "fp32") -> dict:
    if dtype == "fp16":
        return {"fp16": {"enabled": True, "loss_scale_window": 100, "initial_scale_power": 16}}
    if dtype == "bf16" and optimizer_dtype == "bf16":
        # the bf16 weight partitions are the master weights; the moments are bf16 too
        # (StochasticRoundingAdamW keeps its moments in the parameters' dtype)
        return {"bf16": {"enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True,
                         **BF16_CHECKS}}
    if dtype == "bf16":
        return {"bf16": {"enabled": True, **BF16_CHECKS}}
    if dtype == "fp32":
        return {}
    raise ValueError(f"--dtype must be one of {DTYPES}, got {dtype!r}")


PARTIAL_OFFLOAD_SUB_GROUP = int(2e8)   # parameters per optimizer sub-group under --offload_ratio < 1
# Gradient elements per reduce bucket. DeepSpeed's default (5e8) allocates its contiguous
# bucket up front at that size per engine and gradient dtype: 0.93 GiB in bf16 for each of
# step 3's two trained models, held through every phase, at any model size. 5e7 (100 MB in
# bf16) still reduces in collectives well past NCCL's bandwidth knee on several GPUs.
REDUCE_BUCKET_SIZE = int(5e7)


def _zero_section(stage: int, offload: bool, *, persistence_threshold: float,
                  max_live_parameters: float, prefetch_bucket_size: float,
                  offload_params: bool = True, offload_ratio: float = 1.0, pin_memory: bool = False) -> dict:
    optimizer = {"device": "cpu" if offload else "none"}
    if offload and pin_memory:
        optimizer["pin_memory"] = True
    partial = offload and offload_ratio < 1.0
    if partial:
        # DeepSpeed's partial offload (ZeRO-3): this share of the optimizer's sub-groups on
        # the CPU (DeepSpeedCPUAdam), the rest updated on the GPU
        optimizer["ratio"] = offload_ratio
    # parameter offload exists only at stage 3, and not beside a partial optimizer offload
    params_offloaded = offload and offload_params and offload_ratio == 1.0 and stage == 3
    param = {"device": "cpu" if params_offloaded else "none"}
    if params_offloaded and pin_memory:
        param["pin_memory"] = True
    zero = {
        "stage": stage,
        "offload_param": param,
        "offload_optimizer": optimizer,
        "stage3_param_persistence_threshold": persistence_threshold,
        "stage3_max_live_parameters": max_live_parameters,
        "stage3_prefetch_bucket_size": prefetch_bucket_size,
        "reduce_bucket_size": REDUCE_BUCKET_SIZE,
        "memory_efficient_linear": False,
    }
    if partial:
        # the ratio picks whole sub-groups: DeepSpeed's 1e9-parameter ones round a 7B model's
        # split to eighths (and each holds a 4 GB fp32 gradient while it steps)
        zero["sub_group_size"] = PARTIAL_OFFLOAD_SUB_GROUP
    return zero


def optimizer_dtype_problems(optimizer_dtype: str, dtype: str, zero_stages, offload: bool) -> list[str]:
    """Why --optimizer_dtype cannot run with these settings (empty when it can), in the flags'
    words; `zero_stages`: every trained model's stage. The one check behind the entry points'
    validation and train_ds_config."""
    if optimizer_dtype == "fp32":
        return []
    out = []
    if dtype != optimizer_dtype:
        out.append(f"--optimizer_dtype {optimizer_dtype} needs --dtype {optimizer_dtype} (got --dtype {dtype})")
    if 0 in zero_stages:
        out.append(f"--optimizer_dtype {optimizer_dtype} needs ZeRO stage 1, 2 or 3 for every trained model: "
                   f"DeepSpeed keeps {optimizer_dtype} master weights only in its ZeRO optimizers")
    if offload:
        out.append(f"--optimizer_dtype {optimizer_dtype} keeps the optimizer on the GPU: drop --offload (or keep "
                   f"fp32 state and offload it)")
    return out


def train_ds_config(*, zero_stage: int, dtype: str, micro_batch_size: int,
                    gradient_accumulation_steps: int = 1, offload: bool = False,
                    offload_params: bool = True, offload_ratio: float = 1.0, offload_pin_memory: bool = False,
                    optimizer_dtype: str = "fp32", gradient_clipping: float = 1.0, persistence_threshold: float = 1e4,
                    max_live_parameters: float = 3e7, prefetch_bucket_size: float = 3e7,
                    enable_tensorboard: bool = False, tensorboard_path: str = "",
                    job_name: str = "dschat") -> dict:
    """Config of a trained engine. The optimizer is built by us and passed in."""
    config = {
        "train_micro_batch_size_per_gpu": micro_batch_size,
        "gradient_accumulation_steps": gradient_accumulation_steps,
        "steps_per_print": 10 ** 9,  # we log ourselves
        "zero_optimization": _zero_section(
            zero_stage, offload, persistence_threshold=persistence_threshold,
            max_live_parameters=max_live_parameters, prefetch_bucket_size=prefetch_bucket_size,
            offload_params=offload_params, offload_ratio=offload_ratio, pin_memory=offload_pin_memory),
        "gradient_clipping": gradient_clipping,
        "prescale_gradients": False,
        "wall_clock_breakdown": False,
        # we pass torch's AdamW when not offloading; DeepSpeedCPUAdam when offloading
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False,
    }
    problems = optimizer_dtype_problems(optimizer_dtype, dtype, [zero_stage], offload)
    if problems:
        raise ValueError("; ".join(problems))
    config.update(_precision_section(dtype, optimizer_dtype))
    if enable_tensorboard:
        config["tensorboard"] = {"enabled": True, "output_path": f"{tensorboard_path}/ds_tensorboard_logs/",
                                 "job_name": f"{job_name}_tensorboard"}
    return config


def offload_options(args) -> dict:
    """train_ds_config's offload and optimizer-state keywords from the flags of add_offload_args
    (every step)."""
    return {"offload": bool(args.offload), "offload_params": not getattr(args, "offload_optimizer_only", False),
            "offload_ratio": float(getattr(args, "offload_ratio", 1.0)),
            "offload_pin_memory": bool(getattr(args, "offload_pin_memory", False)),
            "optimizer_dtype": getattr(args, "optimizer_dtype", "fp32")}


def eval_ds_config(*, zero_stage: int, dtype: str, micro_batch_size: int = 1,
                   offload: bool = False, persistence_threshold: float = 1e4) -> dict:
    """Config of a frozen engine (reference, reward): no optimizer."""
    config = {
        "train_micro_batch_size_per_gpu": micro_batch_size,
        "steps_per_print": 10 ** 9,
        "zero_optimization": _zero_section(
            zero_stage, offload, persistence_threshold=persistence_threshold,
            max_live_parameters=3e7, prefetch_bucket_size=3e7),
        "prescale_gradients": False,
        "wall_clock_breakdown": False,
    }
    config.update(_precision_section(dtype))
    return config


def frozen_stage(explicit: int | None, trained_stage: int, *, world_size: int | None = None,
                 offloaded: bool = False) -> int:
    """ZeRO stage of a frozen model (reference / reward / EMA): the flag when given, else
    upstream's rule (ZeRO-3 when the model it mirrors trains at ZeRO-3, else 0), except on a
    single rank (`world_size` 1) without host offload: there ZeRO-3 partitions nothing, so
    stage 0 holds the same whole copy without the per-block gather hooks, which cost these
    scoring forwards about twice their unpartitioned time on one GPU (benchmarks/RESULTS.md,
    table 3). `world_size` None: not known yet (flag validation), upstream's rule."""
    if explicit is not None:
        return int(explicit)
    if trained_stage != 3:
        return 0
    return 0 if world_size == 1 and not offloaded else 3


def weights_dtype(ds_config: dict | None):
    """The dtype saved weights load in for an engine of `ds_config`: its bf16 or fp16, else
    fp32. DeepSpeed casts the module to that dtype anyway and builds any fp32 master weights
    from the cast weights, so loading in fp32 first changes no value; it only converts every
    weight twice and holds an fp32 copy of the model on the host (benchmarks/load_weights.py:
    at ZeRO-0/1/2 a 1.1B model loads about 2x faster in 4 GiB less host memory)."""
    import torch
    for name, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
        if ((ds_config or {}).get(name) or {}).get("enabled"):
            return dtype
    return torch.float32


def zero_stage_of(ds_config: dict | None) -> int:
    return int(((ds_config or {}).get("zero_optimization") or {}).get("stage", 0))


@contextmanager
def hf_zero3_loading(ds_config: dict | None):
    """Keep transformers' `HfDeepSpeedConfig` alive while a model loads under ZeRO-3.

    transformers holds only a weak reference to it; while it lives, `from_pretrained`
    builds inside `deepspeed.zero.Init`, so each rank materialises only its shard.
    """
    if zero_stage_of(ds_config) != 3:
        yield
        return
    from transformers.integrations import HfDeepSpeedConfig
    keep_alive = HfDeepSpeedConfig(ds_config)
    try:
        yield keep_alive
    finally:
        del keep_alive

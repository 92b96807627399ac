#!/usr/bin/env python
"""Host work of one ZeRO optimizer step at world size 1: the ops it dispatches and its CPU
seconds, ZeRO-3 against ZeRO-2 with and without DeepSpeed's per-gradient NaN/inf test; and
the host seconds of the training forward and backward before it (every block checkpointed,
as step 3 trains within 16 GiB).

    python benchmarks/zero_step_ops.py                 # a 24-block Bloom, bf16, bf16 optimizer state

On a GPU every dispatched op is a kernel launch: a step bound by the host (benchmarks/
RESULTS.md, table 11) costs about what it dispatches. Each configuration runs in its own
process (one DeepSpeed engine per process, world size 1 over gloo); the count is of
top-level `aten::` ops inside `engine.step()`, the seconds the median of steps 3..6. With
kernels this small the forward's and backward's seconds are host work too: ZeRO-3's per-block
gathers, releases and gradient hooks against ZeRO-2's per-tensor gradient hooks.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))       # this checkout's dschat and benchmarks
from benchmarks.processes import run_single_rank  # noqa: E402

CONFIGS = (("ZeRO-3", 3, True), ("ZeRO-2, per-gradient NaN/inf test (DeepSpeed's default)", 2, True),
           ("ZeRO-2, no per-gradient test (ours)", 2, False))
# --zero3_knobs: DeepSpeed's own ZeRO-3 settings that might cut its per-block host work
ZERO3_KNOBS = {"ZeRO-3, every parameter kept gathered": {"stage3_param_persistence_threshold": 1e12},
               "ZeRO-3, no prefetch": {"stage3_prefetch_bucket_size": 0},
               "ZeRO-3, no prefetch, no live-parameter limit": {"stage3_prefetch_bucket_size": 0,
                                                                 "stage3_max_live_parameters": 1e12}}


def one(stage: int, check: bool, layers: int, width: int, optimizer_dtype: str, knobs: dict) -> dict:
    import deepspeed
    import torch
    from transformers import BloomConfig, BloomForCausalLM

    from dschat.engine.config import train_ds_config
    from dschat.engine.optim import build_optimizer
    from dschat.engine.zero import initialize_engine
    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    config = train_ds_config(zero_stage=stage, dtype="bf16", micro_batch_size=2, optimizer_dtype=optimizer_dtype)
    config["bf16"]["check_grad_overflow"] = check
    config["zero_optimization"].update(knobs)
    cfg = BloomConfig(n_layer=layers, hidden_size=width, n_head=4, vocab_size=512)
    if stage == 3:
        with deepspeed.zero.Init(config_dict_or_path=config):
            model = BloomForCausalLM(cfg)
    else:
        model = BloomForCausalLM(cfg)
    model = model.to(torch.bfloat16)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    optimizer = build_optimizer(model, lr=1e-4, weight_decay=0.0, lora_lr=1e-4, offload=False,
                                optimizer_dtype=optimizer_dtype)
    engine = initialize_engine(model, config, optimizer=optimizer)
    ids = torch.randint(0, 512, (2, 64))
    seconds, forward, backward, ops = [], [], [], 0
    for i in range(6):
        start = time.perf_counter()
        loss = engine(input_ids=ids, labels=ids).loss
        middle = time.perf_counter()
        engine.backward(loss)
        if i >= 2:
            forward.append(middle - start)
            backward.append(time.perf_counter() - middle)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            start = time.perf_counter()
            engine.step()
            took = time.perf_counter() - start
        if i >= 2:
            seconds.append(took)
            ops = sum(1 for e in prof.events() if e.name.startswith("aten::") and e.cpu_parent is None)
    median_ms = lambda xs: 1000 * sorted(xs)[len(xs) // 2]  # noqa: E731
    return {"gradients": sum(p.requires_grad for p in model.parameters()), "step_ops": ops,
            "step_ms": median_ms(seconds), "forward_ms": median_ms(forward), "backward_ms": median_ms(backward)}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--optimizer_dtype", default="bf16", choices=("fp32", "bf16"))
    p.add_argument("--zero3_knobs", action="store_true", help="Also ZeRO-3 with the settings of ZERO3_KNOBS.")
    p.add_argument("--one", nargs=3, help=argparse.SUPPRESS)   # STAGE CHECK KNOBS: run one configuration here
    args = p.parse_args()
    if args.one:
        stage, check = int(args.one[0]), args.one[1] == "1"
        print(json.dumps(one(stage, check, args.layers, args.width, args.optimizer_dtype, json.loads(args.one[2]))))
        return
    os.environ.setdefault("OMP_NUM_THREADS", "1")      # the children's host time, one thread each
    configs = [(name, stage, check, {}) for name, stage, check in CONFIGS]
    if args.zero3_knobs:
        configs += [(name, 3, True, knobs) for name, knobs in ZERO3_KNOBS.items()]
    rows = [(name, run_single_rank(__file__, ["--one", stage, "1" if check else "0", json.dumps(knobs),
                                              "--layers", args.layers, "--width", args.width,
                                              "--optimizer_dtype", args.optimizer_dtype]))
            for name, stage, check, knobs in configs]
    print(f"one ZeRO optimizer step, world size 1, Bloom {args.layers} blocks x {args.width}, bf16, "
          f"{args.optimizer_dtype} optimizer state\n")
    print("| configuration | trained tensors | ops dispatched in the step | step CPU ms | forward CPU ms "
          "| backward CPU ms |\n|---|---|---|---|---|---|")
    for name, r in rows:
        print(f"| {name} | {r['gradients']} | {r['step_ops']} | {r['step_ms']:.1f} | {r['forward_ms']:.1f} "
              f"| {r['backward_ms']:.1f} |")


if __name__ == "__main__":
    main()

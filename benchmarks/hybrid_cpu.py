"""Generation under ZeRO-3 on CPU ranks: hybrid off vs ours (full, layered) vs DeepSpeed's
`unwrap_model_for_generation`, side by side.

    deepspeed --num_gpus 2 benchmarks/hybrid_cpu.py [--modes off,full,layered,ds_unwrap]
        [--layers 6 --hidden 512 --heads 8 --vocab 4096 --batch 4 --prompt_len 32 --new_tokens 32 --repeats 3
        --group_size 2 --json out.json]

A random-init Bloom from config, fp32, ZeRO-3 with persistence threshold 0 (every weight
partitioned), each rank its own left-padded prompts, greedy, `min_new_tokens =
max_new_tokens` so every mode decodes the same number of steps. Each timed rollout
starts after `mark_weights_updated()` (as after an optimizer step), so ours includes
the refill of the replica; DeepSpeed's unwrap gathers everything every time anyway.
Reported per mode: median seconds per rollout, ms per decode step, speed-up over
hybrid off, gather seconds and bytes per rollout (for the hook path: the bytes its
per-module fetches move, estimated as model bytes x forward passes), and whether the
tokens equal hybrid off's.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--local_rank", type=int, default=-1)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--prompt_len", type=int, default=32)
    p.add_argument("--new_tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--group_size", type=int, default=2, help="tp_gather_partition_size of layered mode")
    p.add_argument("--modes", default="off,full,layered,ds_unwrap",
                   help="comma list of off, full, layered, ds_unwrap, full:dsfetch, layered:dsfetch "
                        "(:dsfetch = the replica filled through DeepSpeed's fetch, not straight from the shards)")
    p.add_argument("--json", default="")
    return p.parse_args()


def build_engine(args):
    import deepspeed
    from transformers import BloomConfig, BloomForCausalLM
    torch.manual_seed(0)
    cfg = BloomConfig(vocab_size=args.vocab, hidden_size=args.hidden, n_layer=args.layers, n_head=args.heads,
                      bos_token_id=2, eos_token_id=1, pad_token_id=0, hidden_dropout=0.0, attention_dropout=0.0)
    model = BloomForCausalLM(cfg)
    ds = {"train_micro_batch_size_per_gpu": args.batch, "steps_per_print": 10 ** 9,
          "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
          "zero_allow_untested_optimizer": True, "zero_force_ds_cpu_optimizer": False}
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-5),
                                      config=ds)
    return engine


def prompts(args, rank: int):
    g = torch.Generator().manual_seed(100 + rank)
    ids = torch.randint(3, args.vocab, (args.batch, args.prompt_len), generator=g)
    mask = torch.ones_like(ids)
    for i in range(1, args.batch):                 # mixed lengths, left padded
        pad = int(torch.randint(0, args.prompt_len // 2, (1,), generator=g))
        ids[i, :pad], mask[i, :pad] = 0, 0
    return ids, mask


def timed_rollouts(run, repeats: int) -> tuple[list[float], torch.Tensor]:
    import torch.distributed as dist
    times, out = [], None
    for _ in range(repeats):
        dist.barrier()
        t0 = time.perf_counter()
        out = run()
        times.append(time.perf_counter() - t0)
    return times, out


def main():
    args = parse()
    import deepspeed
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    deepspeed.init_distributed(dist_backend="gloo")
    import torch.distributed as dist
    from deepspeed.runtime.zero.stage3 import unwrap_model_for_generation

    from dschat.engine.zero import params_left_gathered
    from dschat.rollout import gather as gather_mod
    from dschat.rollout.gather import GatherPlan, GatherScheduler
    from dschat.rollout.hybrid import HybridActor

    rank = dist.get_rank()
    engine = build_engine(args)
    plan_bytes = GatherPlan.build(engine.module).nbytes
    ids, mask = prompts(args, rank)
    gen = dict(max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, eos_token_id=1, pad_token_id=0)
    common = dict(max_prompt_len=args.prompt_len, max_new_tokens=args.new_tokens)
    rows, outputs = {}, {}

    for mode in args.modes.split(","):
        sched = GatherScheduler()
        extra = {}
        # "full:dsfetch" / "layered:dsfetch": the replica filled through DeepSpeed's own fetch
        # (gather.DIRECT_FILL off) instead of straight from the shards
        gather_mod.DIRECT_FILL = not mode.endswith(":dsfetch")
        base_mode = mode.split(":")[0]
        if base_mode in ("off", "full", "layered"):
            actor = HybridActor(engine, enable_hybrid_engine=base_mode != "off",
                                mode="layered" if base_mode == "layered" else "full",
                                tp_gather_partition_size=args.group_size, scheduler=sched, **common)
            first_t0 = time.perf_counter()
            actor.generate(ids, mask, **gen)                       # warm-up (builds the replica)
            extra["first_call_s"] = time.perf_counter() - first_t0
            sched.pop_stats()

            def run():
                actor.mark_weights_updated()
                return actor.generate(ids, mask, **gen)
        elif mode == "ds_unwrap":
            gather_s = []

            def run():
                cm = unwrap_model_for_generation(engine)
                t0 = time.perf_counter()
                model = cm.__enter__()
                gather_s.append(time.perf_counter() - t0)
                try:
                    with torch.no_grad():
                        return model.module.generate(input_ids=ids, attention_mask=mask, do_sample=False,
                                                     synced_gpus=False, **gen)
                finally:
                    cm.__exit__(None, None, None)
            run()                                                  # warm-up
            gather_s.clear()
        else:
            raise SystemExit(f"unknown mode {mode!r}")
        times, out = timed_rollouts(run, args.repeats)
        outputs[mode] = out
        med = statistics.median(times)
        row = {"seconds": med, "ms_per_step": 1000 * med / args.new_tokens, **extra}
        if base_mode in ("full", "layered"):
            g = sched.pop_stats()
            row["gather_s"] = g["gather/seconds"] / args.repeats
            row["gather_bytes"] = g["gather/bytes"] / args.repeats
            row["copy_s"] = g["gather/copy_seconds"] / args.repeats
        elif mode == "ds_unwrap":
            row["gather_s"] = statistics.median(gather_s)
            row["gather_bytes"] = plan_bytes
        else:
            row["gather_s"] = None                                 # inside ZeRO's hooks
            row["gather_bytes"] = plan_bytes * args.new_tokens       # every forward fetches every layer
        row["left_gathered"] = len(params_left_gathered(engine.module))
        rows[mode] = row
        if mode != "off":
            actor = None

    base = rows.get("off", {}).get("seconds")
    for mode, row in rows.items():
        row["speedup_vs_off"] = base / row["seconds"] if base else None
        row["tokens_equal_off"] = bool(torch.equal(outputs[mode], outputs["off"])) if "off" in outputs else None
    equal = torch.tensor([int(all(r["tokens_equal_off"] in (True, None) for r in rows.values()))])
    dist.all_reduce(equal, op=dist.ReduceOp.MIN)
    if rank == 0:
        n_params = plan_bytes // 4
        print(f"\nBloom {args.layers}x{args.hidden} ({n_params / 1e6:.1f}M params, fp32, "
              f"{plan_bytes / 2**20:.1f} MiB), "
              f"ZeRO-3 over {dist.get_world_size()} CPU ranks, batch {args.batch}/rank, prompt {args.prompt_len}, "
              f"{args.new_tokens} new tokens, median of {args.repeats}; layered group size {args.group_size}")
        print("| mode | s/rollout | ms/step | speed-up vs off | gather s | copy s | gather MiB | first call s "
              "| tokens = off |")
        print("|---|---|---|---|---|---|---|---|---|")
        names = {"off": "hybrid off (ZeRO-3 hooks, synced_gpus)", "full": "ours: full replica",
                 "layered": "ours: layered", "ds_unwrap": "DeepSpeed unwrap_model_for_generation",
                 "full:dsfetch": "ours: full replica, filled by DeepSpeed's fetch",
                 "layered:dsfetch": "ours: layered, filled by DeepSpeed's fetch"}
        for mode, r in rows.items():
            gs = "n/a" if r["gather_s"] is None else f"{r['gather_s']:.3f}"
            fc = f"{r['first_call_s']:.2f}" if "first_call_s" in r else "-"
            est = " (est.)" if mode == "off" else ""
            sp = "-" if r["speedup_vs_off"] is None else f"{r['speedup_vs_off']:.2f}x"
            cp = f"{r['copy_s']:.3f}" if "copy_s" in r else "-"
            print(f"| {names[mode]} | {r['seconds']:.3f} | {r['ms_per_step']:.1f} | {sp} | {gs} | {cp} | "
                  f"{r['gather_bytes'] / 2**20:.1f}{est} | {fc} | {r['tokens_equal_off']} |")
        print(f"tokens equal across modes on every rank: {bool(equal.item())}; "
              f"params left gathered: {max(r['left_gathered'] for r in rows.values())}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"args": vars(args), "rows": rows, "all_ranks_equal": bool(equal.item())}, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    from dschat.utils.run import main_guard

    main_guard(main)   # exits via os._exit once done (see main_guard)

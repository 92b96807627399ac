#!/usr/bin/env python
"""Generation under ZeRO-3, side by side in one run: plain HF, HF with its static cache (the
best stock path: on CUDA transformers compiles the decode step of a static cache), ZeRO-3
hooks, DeepSpeed's `unwrap_model_for_generation`, ours generic (HF generate on the replica),
ours fast.

    python benchmarks/generation.py --models bloom-560m bloom-7b1 --batch 16 --prompt_len 256 --new_tokens 256

Random-init models at real shapes (by preset name) or a real model folder (a path in --models).
Every mode generates the same forced number of tokens (min_new_tokens = max_new_tokens)
for the same left-padded prompts on the same weights. The table gives tokens/s, ms per
generated token (prefill included), peak GiB, gather seconds, the ratio to plain HF, and
the bandwidth floor: weight bytes over the device-to-device copy bandwidth measured here.
`--repeats N` times each mode N times and reports the median; `--hf_busy` profiles one plain
HF generate and reports how much of its step is GPU kernels (the rest is host time).
Single process (ZeRO-3 world size 1, as the tables of benchmarks/RESULTS.md); run under
`deepspeed --num_gpus N` for data parallel N (each rank its own prompts; per-GPU numbers).
"""
import argparse
import json
import time

import torch

PRESETS = {
    "tiny-bloom": dict(model_type="bloom", vocab_size=1024, hidden_size=128, n_layer=4, n_head=4),  # CPU smoke
    "bloom-560m": dict(model_type="bloom", vocab_size=250880, hidden_size=1024, n_layer=24, n_head=16),
    "bloom-1b7": dict(model_type="bloom", vocab_size=250880, hidden_size=2048, n_layer=24, n_head=16),
    "bloom-7b1": dict(model_type="bloom", vocab_size=250880, hidden_size=4096, n_layer=30, n_head=32),
    "opt-1.3b": dict(model_type="opt", vocab_size=50272, hidden_size=2048, num_hidden_layers=24,
                     num_attention_heads=32, ffn_dim=8192, word_embed_proj_dim=2048, max_position_embeddings=2048),
    # OPT-13B with an OPT-350m critic: upstream DeepSpeed-Chat's one-GPU headline (step 3)
    "opt-350m": dict(model_type="opt", vocab_size=50272, hidden_size=1024, num_hidden_layers=24,
                     num_attention_heads=16, ffn_dim=4096, word_embed_proj_dim=512, max_position_embeddings=2048),
    "opt-13b": dict(model_type="opt", vocab_size=50272, hidden_size=5120, num_hidden_layers=40,
                    num_attention_heads=40, ffn_dim=20480, word_embed_proj_dim=5120, max_position_embeddings=2048),
    "llama-13b": dict(model_type="llama", vocab_size=32000, hidden_size=5120, num_hidden_layers=40,
                      num_attention_heads=40, num_key_value_heads=40, intermediate_size=13824,
                      max_position_embeddings=4096),
    "llama-7b": dict(model_type="llama", vocab_size=32000, hidden_size=4096, num_hidden_layers=32,
                     num_attention_heads=32, num_key_value_heads=32, intermediate_size=11008,
                     max_position_embeddings=4096),
    # TinyLlama-1.1B's shape: grouped-query attention (4 K/V heads), small enough for a one-GPU step 3
    "tinyllama-1.1b": dict(model_type="llama", vocab_size=32000, hidden_size=2048, num_hidden_layers=22,
                           num_attention_heads=32, num_key_value_heads=4, intermediate_size=5632,
                           max_position_embeddings=2048),
    "gpt2-xl": dict(model_type="gpt2", vocab_size=50257, n_embd=1600, n_layer=48, n_head=25, n_positions=1024),
    "pythia-1.4b": dict(model_type="gpt_neox", vocab_size=50304, hidden_size=2048, num_hidden_layers=24,
                        num_attention_heads=16, intermediate_size=8192, rotary_pct=0.25,
                        max_position_embeddings=2048),
}
MODES = ("hf", "hf_static", "hooks", "unwrap", "generic", "fast")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=["bloom-560m"], help=f"Presets ({', '.join(PRESETS)}) or folders.")
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES, help="Modes to run.")
    p.add_argument("--batch", type=int, nargs="+", default=[16], help="Prompts per rank (several: one row each).")
    p.add_argument("--prompt_len", type=int, default=256, help="Prompt tokens (left-padded, mixed lengths).")
    p.add_argument("--new_tokens", type=int, default=256, help="Generated tokens, forced.")
    p.add_argument("--dtype", default="bf16", choices=DTYPES, help="Inference and ZeRO dtype.")
    p.add_argument("--hooks_max_layers", type=int, default=None,
                   help="Skip the (slow) hooks mode for models with more layers than this.")
    p.add_argument("--layered", action="store_true", help="Also run ours in layered mode (--unpin_actor_parameters).")
    p.add_argument("--dsfetch", action="store_true",
                   help="Also run ours with the replica filled through DeepSpeed's own fetch "
                        "(gather.DIRECT_FILL off) instead of straight from the ZeRO-3 shards.")
    p.add_argument("--repeats", type=int, default=1,
                   help="Timed runs per mode (ours: each after a refill); the table gives the median "
                        "and the JSON rows every run's seconds.")
    p.add_argument("--hf_busy", action="store_true",
                   help="Also profile one plain HF generate (CUDA only) and report the GPU time of its "
                        "kernels per step: how much of HF's step the GPU is busy, the rest being host time.")
    p.add_argument("--out", default=None, help="Append the table (markdown) and JSON rows to this file stem.")
    p.add_argument("--local_rank", type=int, default=-1, help="Set by the deepspeed launcher.")
    return p.parse_args(argv)


def copy_bandwidth(device) -> float:
    """Device-to-device copy bandwidth in bytes/s (reads + writes), best of a few copies."""
    if device.type != "cuda":
        return float("nan")
    src = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(5):
        torch.cuda.synchronize()
        t = time.perf_counter()
        dst.copy_(src)
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t)
    del src, dst
    return 2 * (1 << 30) / best


def build_model(name, dtype, device):
    from transformers import AutoConfig, AutoModelForCausalLM
    if name in PRESETS:
        cfg = dict(PRESETS[name])
        config = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
        config.pad_token_id, config.eos_token_id, config.bos_token_id = 0, 1, 2
        torch.manual_seed(0)
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(name, dtype=dtype).to(device)
    # random bf16 weights at init scale overflow deep models; shrink them (fixed seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.mul_(0.5)
    return model.eval()


def make_prompts(batch, prompt_len, vocab, device, rank):
    g = torch.Generator().manual_seed(1000 + rank)
    ids = torch.randint(4, min(vocab, 32000), (batch, prompt_len), generator=g)
    mask = torch.ones_like(ids)
    for i in range(batch):  # mixed lengths, left padded
        pad = int(torch.randint(0, prompt_len // 4, (1,), generator=g)) if i % 2 else 0
        ids[i, :pad], mask[i, :pad] = 0, 0
    return ids.to(device), mask.to(device)


def timed(fn, device):
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(device)
    t = time.perf_counter()
    out = fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    secs = time.perf_counter() - t
    peak = torch.cuda.max_memory_allocated(device) / 2 ** 30 if device.type == "cuda" else float("nan")
    return out, secs, peak


def timed_runs(fn, device, repeats, before=None):
    """`repeats` timed calls of fn (each after before(), untimed); returns the last output,
    every run's seconds, the median run's seconds and the highest peak GiB."""
    runs, peaks, out = [], [], None
    for _ in range(repeats):
        if before is not None:
            before()
        out, secs, peak = timed(fn, device)
        runs.append(secs)
        peaks.append(peak)
    return out, runs, sorted(runs)[(len(runs) - 1) // 2], max(peaks)


def gpu_kernel_seconds(fn, device, top=6):
    """Seconds of GPU kernels and copies that one call of fn runs (torch.profiler, CUDA only),
    and the `top` names that take most of them, as (name, seconds)."""
    from torch.profiler import ProfilerActivity, profile
    if device.type != "cuda":
        return float("nan"), []
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    ops = [(e.key, e.self_device_time_total / 1e6) for e in prof.key_averages() if e.self_device_time_total > 0]
    ops.sort(key=lambda kv: -kv[1])
    return sum(t for _, t in ops), ops[:top]


def main(argv=None):
    args = parse_args(argv)
    if args.repeats < 1:
        raise SystemExit(f"--repeats must be at least 1 (got {args.repeats})")
    import deepspeed

    from dschat.engine.config import eval_ds_config
    from dschat.rollout import gather as gather_mod
    from dschat.rollout.hybrid import HybridActor
    from dschat.utils.dist import get_rank, get_world_size, init_distributed

    device = init_distributed(args.local_rank)
    dtype = DTYPES[args.dtype]
    bw = copy_bandwidth(device)
    rows = []
    for name in args.models:
        model = build_model(name, dtype, device)
        weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        floor_ms = weight_bytes / bw * 1e3
        vocab = model.config.vocab_size
        layers = model.config.num_hidden_layers
        gen_kwargs = dict(max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False,
                          pad_token_id=0, eos_token_id=1)
        prompts = {batch: make_prompts(batch, args.prompt_len, vocab, device, get_rank()) for batch in args.batch}
        ref_tokens = {}   # batch -> the first mode's tokens (plain HF's when it runs)

        def record(batch, mode, out, runs, secs, peak, gather_s=0.0, extra=None):
            new = out[:, args.prompt_len:]
            ref = ref_tokens.setdefault(batch, new)
            same = float("nan") if ref is new else (new == ref).all(dim=1).float().mean().item()
            rows.append(dict(model=name, batch=batch, mode=mode, tokens_per_s=new.numel() / secs,
                             ms_per_step=secs / args.new_tokens * 1e3, peak_gib=peak, gather_s=gather_s,
                             floor_ms=floor_ms, same_rows_as_hf=same, world=get_world_size(),
                             run_seconds=[round(r, 4) for r in runs], **(extra or {})))
            if get_rank() == 0:
                print(json.dumps(rows[-1]), flush=True)
                if args.out:  # row by row, so a run cut short still leaves its rows
                    with open(args.out + ".jsonl", "a") as f:
                        f.write(json.dumps(rows[-1]) + "\n")

        # plain HF first, at every batch: ZeRO-3 then takes the model over (partitions it in place)
        for batch in args.batch if "hf" in args.modes else []:
            ids, mask = prompts[batch]
            with torch.no_grad():
                # warm up at the measured shapes (kernel choices, allocator): with a 2-token
                # warm-up the opt/llama rows ran 3-5x slower than DeepSpeed's unwrap of the
                # same weights (RESULTS.md), which looked like first-call costs
                model.generate(ids, attention_mask=mask, **dict(gen_kwargs, max_new_tokens=16, min_new_tokens=16))
                hf_generate = lambda: model.generate(ids, attention_mask=mask, **gen_kwargs)  # noqa: E731
                out, runs, secs, peak = timed_runs(hf_generate, device, args.repeats)
                extra = None
                if args.hf_busy and device.type == "cuda":
                    gpu_s, top = gpu_kernel_seconds(hf_generate, device)
                    extra = dict(gpu_ms_per_step=gpu_s / args.new_tokens * 1e3, gpu_busy_share=gpu_s / secs,
                                 gpu_top_ms_per_step={k[:80]: t / args.new_tokens * 1e3 for k, t in top})
            record(batch, "hf", out, runs, secs, peak, extra=extra)
        for batch in args.batch if "hf_static" in args.modes else []:
            ids, mask = prompts[batch]
            static = dict(gen_kwargs, cache_implementation="static")
            with torch.no_grad():
                # the first call at the measured shapes builds the cache (and on CUDA compiles the
                # decode step): timed apart, as our first call is
                _, first_s, _ = timed(lambda: model.generate(ids, attention_mask=mask, **static), device)
                out, runs, secs, peak = timed_runs(lambda: model.generate(ids, attention_mask=mask, **static),
                                                   device, args.repeats)
            record(batch, "hf static cache", out, runs, secs, peak, extra=dict(first_call_s=first_s))
        engine, *_ = deepspeed.initialize(model=model, config=eval_ds_config(zero_stage=3, dtype=args.dtype))
        engine.eval()
        for batch in args.batch:
            ids, mask = prompts[batch]
            if "hooks" in args.modes and (args.hooks_max_layers is None or layers <= args.hooks_max_layers):
                with torch.no_grad():
                    out, runs, secs, peak = timed_runs(lambda: engine.module.generate(
                        ids, attention_mask=mask, synced_gpus=get_world_size() > 1, **gen_kwargs), device, args.repeats)
                record(batch, "zero3 hooks", out, runs, secs, peak)
            if "unwrap" in args.modes:
                from deepspeed.runtime.zero.stage3 import unwrap_model_for_generation

                def unwrap_generate():
                    with unwrap_model_for_generation(engine) as unwrapped, torch.no_grad():
                        return unwrapped.generate(ids, attention_mask=mask, **gen_kwargs)
                out, runs, secs, peak = timed_runs(unwrap_generate, device, args.repeats)
                record(batch, "zero3 DeepSpeed unwrap", out, runs, secs, peak)
            variants = [m for m in ("generic", "fast") if m in args.modes]
            fills = [(m, lay, direct) for m in variants
                     for lay in ([False, True] if args.layered and m == "generic" else [False])
                     for direct in ([True, False] if args.dsfetch else [True])]
            for mode, layered, direct in fills:
                gather_mod.DIRECT_FILL = direct
                actor = HybridActor(engine, enable_hybrid_engine=True, mode="layered" if layered else "full",
                                    use_fast_decode=(mode == "fast"), max_prompt_len=args.prompt_len,
                                    max_new_tokens=args.new_tokens, inference_dtype=dtype)
                # first call builds and fills the replica (and captures graphs): measured apart
                _, first_s, _ = timed(lambda: actor.generate(ids, mask, max_new_tokens=args.new_tokens,
                                                             min_new_tokens=args.new_tokens, eos_token_id=1,
                                                             pad_token_id=0), device)
                actor.pop_stats()

                def refill_next():
                    actor.mark_weights_updated()  # as after an optimizer step: refill in place
                    if get_world_size() > 1:          # ranks level, as after a step's gradient all-reduce, so
                        torch.distributed.barrier()   # the fill's all-gathers do not time a rank's lag
                fills_s = []

                def generate_and_note_fill():
                    result = actor.generate(ids, mask, max_new_tokens=args.new_tokens,
                                            min_new_tokens=args.new_tokens, eos_token_id=1, pad_token_id=0)
                    fills_s.append(actor.pop_stats().get("gen/fill_seconds", 0.0))
                    return result
                out, runs, secs, peak = timed_runs(generate_and_note_fill, device, args.repeats, before=refill_next)
                gather_s = sorted(fills_s)[(len(fills_s) - 1) // 2]
                label = f"ours {mode}" + (" layered" if layered else "") + ("" if direct else " (DeepSpeed fetch)")
                record(batch, label, out, runs, secs, peak, gather_s,
                       extra=dict(first_call_s=first_s, refill_share=gather_s / secs if secs else 0.0))
                actor.release_inference_cache()
                actor = None  # drop the replica before the next fill (closures above read the name)
                torch.cuda.empty_cache() if device.type == "cuda" else None
            gather_mod.DIRECT_FILL = True
        engine = model = None  # free before the next model (closures above read the names)
        torch.cuda.empty_cache() if device.type == "cuda" else None
    if get_rank() == 0:
        print_table(rows, bw)
        if args.out:
            with open(args.out + ".md", "a") as f:
                f.write(table_markdown(rows, bw))


def table_markdown(rows, bw) -> str:
    repeats = max(len(r["run_seconds"]) for r in rows)
    lines = [f"copy bandwidth {bw / 1e12:.2f} TB/s; ms/step = wall seconds / new tokens (prefill included)"
             + (f"; median of {repeats} runs, spread = (slowest - fastest) / median" if repeats > 1 else ""), "",
             "| model | batch | mode | tokens/s | ms/step | x HF | floor ms | peak GiB | gather s | same rows as HF |"
             + (" spread |" if repeats > 1 else ""),
             "|---|---|---|---|---|---|---|---|---|---|" + ("---|" if repeats > 1 else "")]
    hf = {(r["model"], r["batch"]): r["tokens_per_s"] for r in rows if r["mode"] == "hf"}
    models = list(dict.fromkeys(r["model"] for r in rows))
    for r in sorted(rows, key=lambda r: (models.index(r["model"]), r["batch"])):   # stable: mode order kept
        ratio = r["tokens_per_s"] / hf[(r["model"], r["batch"])] if (r["model"], r["batch"]) in hf else float("nan")
        runs = r["run_seconds"]
        spread = f" {(max(runs) - min(runs)) / (sorted(runs)[(len(runs) - 1) // 2] or 1):.1%} |" if repeats > 1 else ""
        lines.append(f"| {r['model']} | {r['batch']} | {r['mode']} | {r['tokens_per_s']:.0f} | "
                     f"{r['ms_per_step']:.2f} | "
                     f"{ratio:.2f} | {r['floor_ms']:.2f} | {r['peak_gib']:.1f} | {r['gather_s']:.3f} | "
                     f"{r['same_rows_as_hf']:.2f} |" + spread)
    busy = [r for r in rows if "gpu_busy_share" in r]
    if busy:
        lines.append("")
        lines += [f"plain HF, {r['model']} batch {r['batch']}: its kernels take {r['gpu_ms_per_step']:.2f} ms of its "
                  f"{r['ms_per_step']:.2f} ms step (GPU busy {r['gpu_busy_share']:.0%}; the rest is host time)"
                  for r in busy]
    return "\n".join(lines) + "\n\n"


def print_table(rows, bw):
    print(table_markdown(rows, bw), flush=True)


if __name__ == "__main__":
    from dschat.utils.run import main_guard

    main_guard(main)   # exits via os._exit once done (see main_guard)

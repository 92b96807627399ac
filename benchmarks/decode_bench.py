"""Fast decode vs HF generate on one GPU, side by side in one run.

    PYTHONUNBUFFERED=1 PYTHONPATH=. python benchmarks/decode_bench.py --out $OUT

Random-init HF models at real shapes (by preset name) built directly on the GPU; left-padded
random prompts (widths 256, real lengths 128..256), 256 new tokens forced with
min_new_tokens, greedy. For every (preset, dtype, batch): HF generate (tokens/s, ms/step =
seconds / new tokens, prefill included) vs FastGenerator (tokens/s, decode ms/step from
device events, prefill ms, first call with graph capture), peak GiB, ratio, the bandwidth
floor (weight bytes / measured device-copy bandwidth; and with the average KV bytes a step
reads), and greedy agreement with HF: identical rows, mean first divergence, max |logit
diff| over the steps whose inputs still agree. Writes decode_results.md / .json to --out.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import importlib.util
import json
import os
import time
import traceback
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]


def _load_decode():
    """dschat.rollout.decode, or the file itself where the package's imports are unavailable."""
    try:
        from dschat.rollout import decode
        return decode
    except ImportError:
        spec = importlib.util.spec_from_file_location("dschat_decode", REPO / "dschat/rollout/decode.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod


decode = _load_decode()

PRESETS = {
    "bloom-560m": ("bloom", dict(hidden_size=1024, n_layer=24, n_head=16, vocab_size=250880)),
    "bloom-1b7": ("bloom", dict(hidden_size=2048, n_layer=24, n_head=16, vocab_size=250880)),
    "bloom-7b1": ("bloom", dict(hidden_size=4096, n_layer=30, n_head=32, vocab_size=250880)),
    "bloom-3b": ("bloom", dict(hidden_size=2560, n_layer=30, n_head=32, vocab_size=250880)),   # head_dim 80
    "opt-1.3b": ("opt", dict(hidden_size=2048, num_hidden_layers=24, num_attention_heads=32,
                             ffn_dim=8192, vocab_size=50272, max_position_embeddings=2048,
                             word_embed_proj_dim=2048)),
    "llama-7b": ("llama", dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
                               num_key_value_heads=32, intermediate_size=11008, vocab_size=32000,
                               max_position_embeddings=2048)),
    "pythia-1.4b": ("gpt_neox", dict(hidden_size=2048, num_hidden_layers=24, num_attention_heads=16,
                                     intermediate_size=8192, vocab_size=50304, rotary_pct=0.25,
                                     max_position_embeddings=2048)),
    "gpt2-xl": ("gpt2", dict(n_embd=1600, n_layer=48, n_head=25, vocab_size=50257, n_positions=1024)),
    # CPU smoke test of this script (--plan smoke)
    "tiny-bloom": ("bloom", dict(hidden_size=96, n_layer=2, n_head=6, vocab_size=1024)),
    "tiny-opt": ("opt", dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, ffn_dim=128,
                             vocab_size=1024, max_position_embeddings=1024, word_embed_proj_dim=64)),
    "tiny-llama": ("llama", dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                 num_key_value_heads=2, intermediate_size=128, vocab_size=1024,
                                 max_position_embeddings=128)),
    "tiny-gpt2": ("gpt2", dict(n_embd=64, n_layer=2, n_head=4, vocab_size=1024, n_positions=1024)),
    "tiny-neox": ("gpt_neox", dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                   intermediate_size=128, vocab_size=1024, rotary_pct=0.25,
                                   max_position_embeddings=128)),
}
DEV = "cuda" if torch.cuda.is_available() else "cpu"
CUDA = DEV == "cuda"


def _sync():
    if CUDA:
        torch.cuda.synchronize()


def _reset_peak():
    if CUDA:
        torch.cuda.reset_peak_memory_stats()


def _peak_gib():
    return torch.cuda.max_memory_allocated() / 2 ** 30 if CUDA else 0.0
PAD, EOS = 0, 1


def build(preset: str, dtype, std=None):
    """Random-init HF causal LM of the preset's shape, created on the GPU in `dtype`."""
    from transformers import (
        BloomConfig,
        BloomForCausalLM,
        GPT2Config,
        GPT2LMHeadModel,
        GPTNeoXConfig,
        GPTNeoXForCausalLM,
        LlamaConfig,
        LlamaForCausalLM,
        OPTConfig,
        OPTForCausalLM,
    )
    kind, cfg = PRESETS[preset]
    cls, conf = {"bloom": (BloomForCausalLM, BloomConfig), "opt": (OPTForCausalLM, OPTConfig),
                 "llama": (LlamaForCausalLM, LlamaConfig),
                 "gpt_neox": (GPTNeoXForCausalLM, GPTNeoXConfig), "gpt2": (GPT2LMHeadModel, GPT2Config)}[kind]
    config = conf(**cfg, pad_token_id=PAD, eos_token_id=EOS, bos_token_id=2)
    if std is not None:
        setattr(config, "init_std" if kind == "opt" else "initializer_range", std)
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(DEV):
            torch.manual_seed(0)
            model = cls(config)
    finally:
        torch.set_default_dtype(old)
    return model.to(dtype).eval()


def prompts(B, P, vocab, seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, vocab, (B, P), generator=g)
    lens = torch.randint(P // 2, P + 1, (B,), generator=g)
    lens[0] = P
    mask = (torch.arange(P)[None] >= (P - lens)[:, None]).long()
    return ids.masked_fill(mask == 0, PAD).to(DEV), mask.to(DEV)


def weight_bytes(model):
    seen, total = set(), 0
    for p in model.parameters():
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            total += p.numel() * p.element_size()
    return total


def copy_bandwidth(gib=4):
    """Device-to-device copy, bytes read + written per second (median of 20)."""
    n = gib * 2 ** 30 // 2
    a = torch.randn(n // 2, device="cuda", dtype=torch.float32).view(torch.bfloat16)
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    times = []
    for _ in range(20):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        b.copy_(a)
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) / 1e3)
    times.sort()
    bw = 2 * a.numel() * a.element_size() / times[len(times) // 2]
    del a, b
    torch.cuda.empty_cache()
    return bw


def sync_time(fn):
    _sync()
    t = time.perf_counter()
    out = fn()
    _sync()
    return out, time.perf_counter() - t


def hf_run(model, ids, mask, T, keep_logits):
    kw = dict(attention_mask=mask, max_new_tokens=T, min_new_tokens=T, do_sample=False,
              pad_token_id=PAD, eos_token_id=EOS)
    model.generate(ids, **{**kw, "max_new_tokens": 4, "min_new_tokens": 4})      # warm-up
    _reset_peak()
    if keep_logits:
        res, secs = sync_time(lambda: model.generate(ids, output_logits=True,
                                                     return_dict_in_generate=True, **kw))
        seqs, logits = res.sequences, res.logits
    else:
        seqs, secs = sync_time(lambda: model.generate(ids, **kw))
        logits = None
    return dict(seqs=seqs, logits=logits, secs=secs, peak=_peak_gib())


# the module switches a variant's flags may set; fast_run puts them back after each run
_KNOBS = [(decode, "DECODE_SDPA_BACKENDS")]      # module switches outside the kernel options


@contextlib.contextmanager
def variant(numerics: str):
    """The kernel options (and decode switches) a numerics string names, in force inside
    the block (restored on exit); yields
    (numerics, attention impl or None, flags).

    e.g. fast, fast:sdpa, fast:sdpa:notriton, fast:sdpa:cudnn, fast:triton:s8:bn64, hf;
    "fusedkv" / "nofusedkv": the Triton attention writes the step's K/V itself or not
    (KernelOptions.fuse_kv_write); "tlin": Triton decode linears
    (fixed rule); "cublas": every decode linear in cuBLAS (default: per-shape choice);
    "torchargmax": torch's argmax (default: kernels.argmax); "dot" / "nodot": attn_dot;
    "pdl0" .. "pdl3": pdl (programmatic dependent launch); "pf<KiB>" /
    "pfl<KiB>" / "pfa<KiB>": mode 3's L2 prefetch per program, linears and attention /
    linears (pdl_prefetch) / attention (pdl_prefetch_attn); "padhd": the
    Triton attention at head dims that are not a power of two (attn_pad_head_dim); "m100": a
    Triton linear is picked whenever it times faster than cuBLAS (default margin 3%);
    "nogated": LLaMA's gate and up as two linears + SiLU + product (fuse_gated off);
    "aw<N>": the decode attention's warps (attn_warps); "pvlow" / "pvtf32": with the tensor-core
    attention, p.V with p rounded to the cache dtype or in TF32 (attn_pv_low); "skippad" /
    "noskippad": the Triton attention skips each row's left padding or reads every slot
    (attn_skip_pad); "tma" / "notma": the TMA linears raced in the per-shape choice or not
    (linear_tma). Every kernel switch is a field of kernels.KernelOptions, in force
    inside the block (FastGenerators built there keep them).
    """
    numerics, *flags = numerics.split(":")
    attn = next((f for f in flags if f in ("sdpa", "bmm", "triton")), None)
    dtr = decode.kernels
    saved = {(mod, name): getattr(mod, name) for mod, name in _KNOBS}
    o = {}                                   # KernelOptions fields the flags change
    for f in flags:
        if f.startswith("s") and f[1:].isdigit():
            o["attn_splits"] = int(f[1:])
        if f.startswith("bn") and f[2:].isdigit():
            o["attn_block_n"] = int(f[2:])
        if f == "cudnn":
            decode.DECODE_SDPA_BACKENDS = None
        if f in ("fusedkv", "nofusedkv"):
            o["fuse_kv_write"] = f == "fusedkv"
        if f in ("tlin", "cublas"):  # the decode linears in kernels.linear (fixed rule) / cuBLAS
            o["decode_linear"] = f == "tlin"
        if f == "torchargmax":
            o["triton_argmax"] = False
        if f in ("dot", "nodot"):   # tensor-core dots in the Triton decode attention or not
            o["attn_dot"] = f == "dot"
        if f == "padhd":
            o["attn_pad_head_dim"] = True
        if f == "nogated":
            o["fuse_gated"] = False
        if f in ("pvlow", "pvtf32"):
            o["attn_pv_low"] = f == "pvlow"
        if f in ("skippad", "noskippad"):
            o["attn_skip_pad"] = f == "skippad"
        if f in ("tma", "notma"):   # part of the race's cache key: the per-shape choice is made again
            o["linear_tma"] = f == "tma"
        if f.startswith("aw") and f[2:].isdigit():
            o["attn_warps"] = int(f[2:])
        if f in ("pdl0", "pdl1", "pdl2", "pdl3"):
            o["pdl"] = int(f[3])
        for pre, names in (("pf", ("pdl_prefetch", "pdl_prefetch_attn")), ("pfl", ("pdl_prefetch",)),
                           ("pfa", ("pdl_prefetch_attn",))):
            if f.startswith(pre) and f[len(pre):].isdigit():
                for name in names:
                    o[name] = int(f[len(pre):]) * 1024
        if f.startswith("m") and f[1:].isdigit():   # part of the race's cache key: chosen again
            o["linear_tune_margin"] = int(f[1:]) / 100
    try:
        with dtr.use_options(dataclasses.replace(dtr.options(), **o)):
            yield numerics, attn, flags
    finally:
        for (mod, name), value in saved.items():
            setattr(mod, name, value)


def fast_run(model, ids, mask, T, numerics, hf_logits=None, sample=False):
    _reset_peak()
    with variant(numerics) as (numerics, attn, flags):
        return _fast_run(model, ids, mask, T, numerics, attn, flags, hf_logits, sample)


def _fast_run(model, ids, mask, T, numerics, attn, flags, hf_logits, sample):
    fg = decode.FastGenerator(model, max_prompt_len=ids.shape[1], max_new_tokens=T,
                              numerics=numerics, attn_impl=attn,
                              use_triton=False if "notriton" in flags else None)
    kw = dict(max_new_tokens=T, min_new_tokens=T, pad_token_id=PAD, eos_token_id=EOS)
    _, first = sync_time(lambda: fg.generate(ids, mask, **kw))
    out, secs = sync_time(lambda: fg.generate(ids, mask, **kw))
    stats = dict(fg.last_stats)
    res = dict(seqs=out, secs=secs, first_call=first, **stats)
    if hf_logits is not None:                # agreement pass: per-step |fast - HF| per row
        diffs = torch.zeros(T, ids.shape[0], device=DEV)

        def cb(step, logits):
            a, b = logits.float(), hf_logits[step]
            d = (a - b).abs()
            d[:, EOS] = 0                     # eos column is masked in place by min_new_tokens
            diffs[step] = d.amax(-1)
        fg.step_callback = cb
        res["agree_seqs"] = fg.generate(ids, mask, **kw)
        fg.step_callback = None
        res["diffs"] = diffs
        res["logit_scale"] = max(float(x.abs().max()) for x in hf_logits[:4])
    if sample:
        skw = dict(kw, do_sample=True, top_k=50, top_p=0.9, temperature=0.8)

        def g():
            return torch.Generator(device=DEV).manual_seed(123)
        a = fg.generate(ids, mask, generator=g(), **skw)
        b, ssecs = sync_time(lambda: fg.generate(ids, mask, generator=g(), **skw))
        res["sample_reproducible"] = bool(torch.equal(a, b))
        res["sample_secs"] = ssecs
        res["sample_decode_ms_step"] = fg.last_stats["decode_ms"] / max(1, fg.last_stats["steps"] - 1)
    res["peak"] = _peak_gib()
    fg.release()
    return res


def agreement(hf, fast, P):
    a, b = fast["agree_seqs"][:, P:], hf["seqs"][:, P:]
    T = a.shape[1]
    same = (a == b)
    first_div = torch.where(same.all(-1), torch.full_like(same[:, 0], T, dtype=torch.long),
                            (~same).int().argmax(-1).long())
    steps = torch.arange(T, device=a.device)[:, None]
    valid = steps <= first_div[None, :]       # step s sees equal inputs while s <= divergence
    d = fast["diffs"].masked_fill(~valid, 0)
    return dict(rows_identical=f"{int(same.all(-1).sum())}/{a.shape[0]}",
                frac_identical=float(same.all(-1).float().mean()),
                mean_first_divergence=float(first_div.float().mean()),
                tokens_identical=float(same.float().mean()),
                max_logit_diff=float(d.max()), prefill_logit_diff=float(fast["diffs"][0].max()),
                logit_scale=fast["logit_scale"],
                distinct_tokens_per_row=float(sum(len(set(r.tolist())) for r in b) / b.shape[0]))


def kv_bytes_avg(model, B, P, T, dtype_bytes):
    c = model.config
    layers = getattr(c, "n_layer", None) or c.num_hidden_layers
    heads = getattr(c, "n_head", None) or c.num_attention_heads
    kvh = getattr(c, "num_key_value_heads", None) or heads
    D = c.hidden_size // heads
    return layers * B * kvh * (P + T / 2) * 2 * D * dtype_bytes


def profile_steps(model, ids, mask, path, steps=6):
    """Kernel time table of a few eager decode steps (same kernels the graph replays)."""
    from torch.profiler import ProfilerActivity, profile
    fg = decode.FastGenerator(model, max_prompt_len=ids.shape[1], max_new_tokens=steps,
                              use_cuda_graph=False)
    kw = dict(max_new_tokens=steps, min_new_tokens=steps, pad_token_id=PAD, eos_token_id=EOS)
    fg.generate(ids, mask, **kw)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fg.generate(ids, mask, **kw)
        _sync()
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=30)
    Path(path).write_text(table)
    fg.release()


def profile_graph(model, ids, mask, path, steps=24):
    """Where the captured decode step's time goes, kernel by kernel: each kernel is charged
    what it adds to the timeline (its end minus the previous kernel's end; with programmatic
    dependent launch kernels overlap, so their own durations would count twice), idle time
    between kernels separately. Written as a table, per decode step, to `path`."""
    import collections
    import tempfile

    from torch.profiler import ProfilerActivity, profile
    fg = decode.FastGenerator(model, max_prompt_len=ids.shape[1], max_new_tokens=steps)
    kw = dict(max_new_tokens=steps, min_new_tokens=steps, pad_token_id=PAD, eos_token_id=EOS)
    fg.generate(ids, mask, **kw)                          # capture
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fg.generate(ids, mask, **kw)
        _sync()
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        trace = json.load(open(f.name))
    fg.release()
    kernels = sorted((e for e in trace["traceEvents"] if e.get("cat") == "kernel"), key=lambda e: e["ts"])
    # the decode steps' kernels: those a cudaGraphLaunch started (CUPTI gives them the
    # launch's correlation id), or those with a graph id where the trace has one, else those
    # whose count is a multiple of the steps (23, prime: prefill's per-layer kernels repeat
    # 24, 30 or 32 times; this last rule misses PyTorch's elementwise kernels, whose names
    # prefill shares)
    launches = {e.get("args", {}).get("correlation") for e in trace["traceEvents"]
                if e.get("cat") == "cuda_runtime" and "GraphLaunch" in e.get("name", "")}
    launches.discard(None)
    graph = [e for e in kernels if int(e.get("args", {}).get("graph id", 0) or 0) > 0]
    count = collections.Counter(e["name"] for e in kernels)
    if any(e.get("args", {}).get("correlation") in launches for e in kernels):
        decode_kernel = lambda e: e.get("args", {}).get("correlation") in launches  # noqa: E731
    elif graph:
        decode_kernel = lambda e: int(e.get("args", {}).get("graph id", 0) or 0) > 0  # noqa: E731
    else:
        decode_kernel = lambda e: count[e["name"]] % (steps - 1) == 0  # noqa: E731
    eff, gap, n_calls = collections.defaultdict(float), 0.0, collections.Counter()
    prev_end = None
    for e in kernels:
        end = e["ts"] + e["dur"]
        if prev_end is not None and decode_kernel(e):
            gap += max(0.0, e["ts"] - prev_end)
            eff[e["name"]] += end - max(prev_end, e["ts"])
            n_calls[e["name"]] += 1
        prev_end = end if prev_end is None else max(prev_end, end)
    per_step = steps - 1
    total = (sum(eff.values()) + gap) / per_step
    lines = [f"decode step (graph replay, {per_step} steps): {total:.1f} us; idle between kernels "
             f"{gap / per_step:.1f} us", "", "| kernel | calls/step | us/step | us/call |", "|---|---|---|---|"]
    for name, us in sorted(eff.items(), key=lambda kv: -kv[1]):
        calls = n_calls[name] / per_step
        lines.append(f"| {name[:90]} | {calls:.1f} | {us / per_step:.1f} | {us / n_calls[name]:.2f} |")
    Path(path).write_text("\n".join(lines) + "\n")
    print("\n".join(lines[:30]), flush=True)


def run_case(preset, dtype, B, P, T, args, numerics_list, agree, sample=False, std=None):
    rows = []
    model = build(preset, dtype, std)
    wb = weight_bytes(model)
    ids, mask = prompts(B, P, model.config.vocab_size)
    hf = hf_run(model, ids, mask, T, keep_logits=agree)
    elem = torch.tensor([], dtype=dtype).element_size()
    kvb = kv_bytes_avg(model, B, P, T, elem)
    for numerics in numerics_list:
        row = dict(preset=preset, dtype=str(dtype).replace("torch.", ""), batch=B, numerics=numerics,
                   std=std, hf_secs=hf["secs"], hf_tok_s=B * T / hf["secs"],
                   hf_ms_step=1e3 * hf["secs"] / T, hf_peak=hf["peak"], weight_gb=wb / 1e9,
                   floor_ms=1e3 * wb / args.bw, floor_kv_ms=1e3 * (wb + kvb) / args.bw)
        try:
            fr = fast_run(model, ids, mask, T, numerics, hf["logits"] if agree else None,
                          sample=sample)
            row.update(fast_secs=fr["secs"], fast_tok_s=B * T / fr["secs"],
                       decode_ms_step=fr["decode_ms"] / (fr["steps"] - 1), prefill_ms=fr["prefill_ms"],
                       first_call_s=fr["first_call"], fast_peak=fr["peak"],
                       speedup=hf["secs"] / fr["secs"],
                       same_as_hf=f"{int((fr['seqs'] == hf['seqs']).all(-1).sum())}/{B}")
            for k in ("sample_reproducible", "sample_secs", "sample_decode_ms_step"):
                if k in fr:
                    row[k] = fr[k]
            if agree:
                row.update(agreement(hf, fr, P))
            # the per-shape decode linears "auto" picked so far in this process
            # (op, rows, N, K, weight read through its transpose, dtype)
            row["linear_choices"] = {" ".join(map(str, k[1:7])) + f" pdl{k[-2]} pf{k[-1]}": str(v)
                                     for k, (v, _) in decode.kernels.linears._CHOICE.items()}
        except Exception as exc:                       # keep the other cases going
            traceback.print_exc()
            row["error"] = f"{type(exc).__name__}: {exc}"[:300]
        print(json.dumps(row), flush=True)
        rows.append(row)
    if args.profile and preset in args.profile and B == 16 and dtype == torch.bfloat16 and std is None:
        try:
            profile_steps(model, ids, mask, Path(args.out) / f"profile_{preset}.txt")
            for name in args.profile_variants.split(","):
                with variant(name):
                    print(f"profile of {preset}, {name}:", flush=True)
                    suffix = "" if name == "fast" else "_" + name.replace(":", "_")
                    profile_graph(model, ids, mask, Path(args.out) / f"profile_graph_{preset}{suffix}.txt",
                                  steps=args.profile_steps)
        except Exception:
            traceback.print_exc()
    del model, hf
    gc.collect()
    if CUDA:
        torch.cuda.empty_cache()
    return rows


def table(rows, bw, device):
    head = ("| model | dtype | B | numerics | HF tok/s | HF ms/step | fast tok/s | fast decode ms/step "
            "| prefill ms | first call s | floor ms (w / w+kv) | speedup | HF peak GiB | fast peak GiB "
            "| same rows | agreement (rows / 1st div / max logit diff / scale) |")
    lines = [f"device: {device}; copy bandwidth {bw / 1e12:.2f} TB/s (read+write)", "",
             head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['preset']} | {r['dtype']} | {r['batch']} | {r['numerics']} | "
                         f"{r['hf_tok_s']:.0f} | {r['hf_ms_step']:.2f} | ERROR {r['error']} |")
            continue
        agree = ""
        if "frac_identical" in r:
            agree = (f"{r['rows_identical']} / {r['mean_first_divergence']:.0f} / "
                     f"{r['max_logit_diff']:.3g} / {r['logit_scale']:.3g}")
        name = r["preset"] + (f" (init std {r['std']})" if r.get("std") else "")
        lines.append(
            f"| {name} | {r['dtype']} | {r['batch']} | {r['numerics']} | {r['hf_tok_s']:.0f} | "
            f"{r['hf_ms_step']:.2f} | {r['fast_tok_s']:.0f} | {r['decode_ms_step']:.3f} | "
            f"{r['prefill_ms']:.1f} | {r['first_call_s']:.2f} | {r['floor_ms']:.2f} / {r['floor_kv_ms']:.2f} | "
            f"{r['speedup']:.1f}x | {r['hf_peak']:.1f} | {r['fast_peak']:.1f} | {r['same_as_hf']} | {agree} |")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--plan", default="full",
                    help="full | quick | tune | kvfuse | candidates | pdl | smoke | comma list of preset:dtype:batch")
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--numerics", default="fast,hf")
    ap.add_argument("--profile", default="bloom-560m",
                    help="presets whose batch-16 bf16 case also gets kernel profiles (eager and graph replay)")
    ap.add_argument("--profile-variants", default="fast",
                    help="comma list of numerics variants (as in --numerics) to profile the graph replay under")
    ap.add_argument("--profile-steps", type=int, default=24,
                    help="decode steps of the graph-replay profile (keys grow from the prompt length)")
    args = ap.parse_args()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    device = f"{torch.cuda.get_device_name() if CUDA else 'cpu'} torch {torch.__version__}"
    import transformers
    device += f" transformers {transformers.__version__}"
    args.bw = copy_bandwidth() if CUDA else 1e10
    print(f"{device}; copy bandwidth {args.bw / 1e12:.2f} TB/s", flush=True)
    args.profile = [p for p in args.profile.split(",") if p]
    nums = args.numerics.split(",")
    bf16, fp32 = torch.bfloat16, torch.float32
    P, T = args.prompt, args.new
    # (preset, dtype, batch, variants, agreement pass, sampling pass, init std or None)
    if args.plan == "full":
        plan = [("bloom-560m", bf16, 16, nums, True, True, None),
                ("bloom-560m", bf16, 16, ["fast", "hf"], True, False, 0.1),
                ("bloom-560m", fp32, 16, ["fast"], True, False, None),
                ("bloom-560m", bf16, 1, ["fast"], False, False, None),
                ("bloom-560m", bf16, 64, ["fast"], False, False, None),
                ("bloom-1b7", bf16, 16, ["fast"], True, False, None),
                ("bloom-7b1", bf16, 16, nums, True, False, None),
                ("opt-1.3b", bf16, 16, ["fast"], True, False, None),
                ("llama-7b", bf16, 16, ["fast"], True, False, None)]
    elif args.plan == "smoke":
        plan = [("tiny-bloom", fp32, 4, nums, True, True, None), ("tiny-bloom", fp32, 4, ["fast"], True, False, 0.5),
                ("tiny-opt", fp32, 3, ["fast"], True, False, None),
                ("tiny-llama", fp32, 2, ["fast"], True, False, None),
                ("tiny-neox", fp32, 2, ["fast"], True, False, None),
                ("tiny-gpt2", fp32, 2, ["fast"], True, False, None)]
    elif args.plan == "tune":
        plan = [("bloom-560m", bf16, 16, nums, True, True, None),
                ("bloom-7b1", bf16, 16, nums, True, True, None)]
    elif args.plan == "kvfuse":   # Triton attention: fused K/V write, fewer splits; bloom-7b1 against bmm
        variants = ["fast:triton", "fast:triton:fusedkv", "fast:triton:s1", "fast:triton:s1:fusedkv",
                    "fast:triton:s2", "fast:triton:s2:fusedkv"]
        plan = [("bloom-560m", bf16, 16, variants, True, True, None),
                ("bloom-560m", bf16, 64, ["fast:triton", "fast:triton:fusedkv"], True, False, None),
                ("bloom-7b1", bf16, 16, ["fast", "fast:triton", "fast:triton:fusedkv"], True, False, None)]
    elif args.plan == "candidates":   # the issue's table, default vs no programmatic dependent launch
        ab = ["fast", "fast:pdl0"]
        plan = [("bloom-560m", bf16, 16, ab + ["fast:cublas", "fast:torchargmax"], True, True, None),
                ("bloom-560m", fp32, 16, ab, True, False, None),
                ("bloom-560m", bf16, 1, ab, False, False, None),
                ("bloom-560m", bf16, 64, ab, True, False, None),
                ("bloom-1b7", bf16, 16, ab, True, False, None),
                ("bloom-7b1", bf16, 16, ab, True, False, None),
                ("opt-1.3b", bf16, 16, ab, True, False, None),
                ("llama-7b", bf16, 16, ab, True, False, None)]
    elif args.plan == "pdl":      # programmatic dependent launch off / on / with weight prefetch
        ab = ["fast:pdl0", "fast:pdl1", "fast:pdl2"]
        plan = [("bloom-7b1", bf16, 16, ab + ["fast:pdl0", "fast:pdl2"], True, False, None),
                ("bloom-560m", bf16, 16, ab, True, True, None),
                ("llama-7b", bf16, 16, ab, True, False, None),
                ("bloom-560m", bf16, 1, ab, False, False, None),
                ("bloom-560m", bf16, 64, ab, False, False, None)]
    elif args.plan == "quick":
        plan = [("bloom-560m", bf16, 16, nums, True, True, None)]
    else:
        plan = []
        for item in args.plan.split(","):
            name, dt, b = item.split(":")
            plan.append((name, {"bf16": bf16, "fp32": fp32}[dt], int(b), nums, True, False, None))
    rows, md = [], ""
    t0 = time.time()
    for preset, dt, B, numerics, agree, sample, std in plan:
        try:
            rows += run_case(preset, dt, B, P, T, args, numerics, agree, sample, std)
        except Exception as exc:
            traceback.print_exc()
            rows.append(dict(preset=preset, dtype=str(dt), batch=B, numerics="-", hf_tok_s=0,
                             hf_ms_step=0, error=f"{type(exc).__name__}: {exc}"[:300]))
        print(f"[{time.time() - t0:.0f}s] done {preset} {dt} B{B}", flush=True)
        # rewritten after every case so a run cut short by a time limit still leaves its table
        md = table(rows, args.bw, device)
        (Path(args.out) / "decode_results.md").write_text(md + "\n")
        (Path(args.out) / "decode_results.json").write_text(json.dumps(rows, indent=1))
    print(md)


if __name__ == "__main__":
    main()

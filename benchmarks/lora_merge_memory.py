#!/usr/bin/env python
"""Host memory of the LoRA merge at a final save (dschat.models.lora.merged_state_dict)
against the merge that builds every fp32 delta first, side by side in one run.

    python benchmarks/lora_merge_memory.py                        # TinyLlama-1.1B's shape, LoRA rank 128
    python benchmarks/lora_merge_memory.py --model llama-7b       # needs about 50 GB of host memory

The saved state is what `full_state_dict` gathers: a bf16 copy of every weight, adapters
included. Each mode runs in its own process and reports the peak resident set during the
merge (sampled every millisecond) minus the resident set just before it, so the merge's own
cost is measured and one mode's freed memory cannot hide the other's peak. A third process
runs the whole save (`save_hf_format`: gather, merge, write) and prints it beside the
estimate the final save checks host memory against (`final_save_host_bytes`).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import threading
import time


def merge_all_deltas_first(model, state):
    """The reference: every fp32 delta built before any weight is merged, the gathered
    state kept beside the merged one."""
    from dschat.models.lora import PEFT_PREFIX, lora_delta, lora_layers

    deltas = {}
    for path, module in lora_layers(model).items():
        for adapter, scale in module.scaling.items():
            deltas[f"{path}.base_layer.weight"] = lora_delta(
                module, state[f"{path}.lora_A.{adapter}.weight"], state[f"{path}.lora_B.{adapter}.weight"], scale)
    out = {}
    for name, tensor in state.items():
        if ".lora_A." in name or ".lora_B." in name:
            continue
        if name in deltas:
            tensor = (tensor.float() + deltas[name]).to(tensor.dtype)
        clean = name[len(PEFT_PREFIX):] if name.startswith(PEFT_PREFIX) else name
        out[clean.replace(".base_layer.", ".")] = tensor
    return out


def measure(mode: str, a) -> dict:
    import psutil
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from benchmarks.generation import PRESETS
    from dschat.engine.zero import final_save_host_bytes
    from dschat.models.lora import apply_lora, lora_layers, merged_state_dict
    from dschat.models.model_utils import load_tokenizer, save_hf_format

    torch.manual_seed(0)
    if a.model in PRESETS:
        cfg = dict(PRESETS[a.model])
        config = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    else:                                       # a config.json (the tests' tiny shapes)
        config = AutoConfig.from_pretrained(a.model)
    torch.set_default_dtype(torch.bfloat16)     # built in bf16: no fp32 copy before the merge
    model = apply_lora(AutoModelForCausalLM.from_config(config), a.lora_dim)
    # the merges start from the gathered state; the whole save gathers it itself
    state = {n: p.detach().clone() for n, p in model.named_parameters()} if mode != "whole save" else None
    lora_params = sum(m.base_layer.weight.numel() for m in lora_layers(model).values())
    proc = psutil.Process()
    before = proc.memory_info().rss
    peak, done = [before], threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], proc.memory_info().rss)
            time.sleep(0.001)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    start = time.perf_counter()
    if mode == "whole save":
        with tempfile.TemporaryDirectory() as folder:
            save_hf_format(model, load_tokenizer(None), folder)
        merged = {}
    elif mode == "all deltas first":
        merged = merge_all_deltas_first(model, state)
    else:
        merged = merged_state_dict(model, state)
    seconds = time.perf_counter() - start
    done.set()
    sampler.join()
    peak[0] = max(peak[0], proc.memory_info().rss)
    return {"mode": mode, "seconds": seconds, "extra_gib": (peak[0] - before) / 2 ** 30,
            "state_gib": sum(t.numel() * t.element_size() for t in merged.values()) / 2 ** 30,
            "lora_params": lora_params, "estimate_gib": final_save_host_bytes(model) / 2 ** 30}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tinyllama-1.1b", help="a shape of benchmarks/generation.py, or a config.json")
    p.add_argument("--lora_dim", type=int, default=128)
    p.add_argument("--mode", default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.mode:                                  # one measurement, in a child process
        print(json.dumps(measure(a.mode, a)))
        return 0
    rows = {}
    for mode in ("all deltas first", "ours", "whole save"):
        # a child per mode, run as a module so that `benchmarks.` imports resolve from the checkout
        out = subprocess.run([sys.executable, "-m", "benchmarks.lora_merge_memory", *(argv or sys.argv[1:]),
                              "--mode", mode], capture_output=True, text=True, check=True)
        rows[mode] = json.loads(out.stdout.strip().splitlines()[-1])
    r = rows["ours"]
    print(f"{a.model}, LoRA rank {a.lora_dim} on {r['lora_params'] / 1e9:.2f}B base parameters, bf16 state "
          f"of {r['state_gib']:.2f} GiB (fp32 deltas of every LoRA'd weight: {r['lora_params'] * 4 / 2 ** 30:.2f} GiB)")
    print("| merge | host memory above the gathered state (GiB) | seconds |")
    print("|---|---|---|")
    for mode in ("all deltas first", "ours"):
        print(f"| {mode} | {rows[mode]['extra_gib']:.2f} | {rows[mode]['seconds']:.2f} |")
    ratio = rows["ours"]["extra_gib"] / max(rows["all deltas first"]["extra_gib"], 1e-9)
    print(f"ours / all deltas first: memory {ratio:.2f}x")
    save = rows["whole save"]
    print(f"the whole save_hf_format of the LoRA model (gather, merge, write): {save['extra_gib']:.2f} GiB above the "
          f"model, {save['seconds']:.2f} s; final_save_host_bytes' estimate of it: {save['estimate_gib']:.2f} GiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python
"""The training forward and backward of a model's transformer blocks, eager against compiled
(dschat.models.model_utils.compile_blocks, step 3's --compile_blocks), side by side in one
process: the same random weights and inputs, activation checkpointing on or off.

    python benchmarks/compile_blocks.py --device cuda                  # bloom-560m, 16 x 512 tokens, bf16
    python benchmarks/compile_blocks.py --model tiny --batch 2 --tokens 64 --dtype fp32   # CPU, seconds

The output layer is left out (its matmul is the same either way; step 3 fuses it with the
log-softmax): the loss is the mean square of the last hidden states. Reported per mode: the
first call (compiling, for the compiled modes), the median of the timed calls (CUDA events on
a GPU, so host time shows where the GPU waits for it), the peak memory on CUDA and the
largest difference of the loss and the gradients from eager's.
"""
from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))       # this checkout's dschat and benchmarks

SHAPES = {"tiny": dict(model_type="bloom", vocab_size=1024, hidden_size=128, n_layer=4, n_head=4)}


def build(model: str, dtype, device):
    from transformers import AutoConfig, AutoModel

    from benchmarks.generation import PRESETS
    from dschat.utils.attention import use_attention
    shape = SHAPES.get(model) or PRESETS[model]
    torch.manual_seed(0)
    backbone = AutoModel.from_config(AutoConfig.for_model(**shape), dtype=dtype).to(device).train()
    use_attention(backbone, "sdpa")
    return backbone


def timed(fn, device, repeats: int) -> tuple[float, list[float]]:
    """Seconds of the first call and of each of `repeats` more (CUDA: events; CPU: wall)."""
    def once():
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3
        t = time.perf_counter()
        fn()
        return time.perf_counter() - t
    first = once()
    return first, [once() for _ in range(repeats)]


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="bloom-560m", help="a shape of benchmarks/generation.py, or 'tiny'")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--out", help="append the table to this markdown file")
    a = p.parse_args()
    from dschat.models.model_utils import compile_blocks, enable_activation_checkpointing
    device, dtype = torch.device(a.device), {"bf16": torch.bfloat16, "fp32": torch.float32}[a.dtype]
    eager = build(a.model, dtype, device)
    compiled = copy.deepcopy(eager)
    compile_blocks(compiled)
    ids = torch.randint(0, eager.config.vocab_size, (a.batch, a.tokens), device=device)
    mask = torch.ones_like(ids)
    mask[: a.batch // 2, : a.tokens // 4] = 0            # half the rows left-padded, as step 3's prompts

    def step(model):
        model.zero_grad(set_to_none=True)
        hidden = model(input_ids=ids, attention_mask=mask, use_cache=False).last_hidden_state
        loss = hidden.float().pow(2).mean()
        loss.backward()
        return loss.detach()

    rows, reference = [], {}
    for checkpointed in (True, False):
        for name, model in (("eager", eager), ("compiled", compiled)):
            if checkpointed:
                enable_activation_checkpointing(model, 1)
            else:
                model.gradient_checkpointing_disable()
            if device.type == "cuda":
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            first, times = timed(lambda: step(model), device, a.repeats)   # noqa: B023
            loss = step(model)
            grads = {n: q.grad.float() for n, q in model.named_parameters()}
            if name == "eager":
                reference = {"loss": loss.float(), "grads": grads}
                diff = 0.0
            else:
                diff = max([abs(float(loss.float() - reference["loss"]))] +
                           [float((g - reference["grads"][n]).abs().max()) for n, g in grads.items()])
            peak = torch.cuda.max_memory_allocated() / 2 ** 30 if device.type == "cuda" else float("nan")
            rows.append((f"{name}, {'checkpointed' if checkpointed else 'activations kept'}",
                         first, statistics.median(times), peak, diff))
            print(rows[-1], flush=True)
    title = (f"{a.model} blocks, training forward + backward, {a.batch} x {a.tokens} tokens, {a.dtype}, "
             f"{a.device}, median of {a.repeats}")
    lines = [title, "", "| mode | first call s | s per step | x eager | peak GiB | max diff from eager |",
             "|---|---|---|---|---|---|"]
    for i, (mode, first, median, peak, diff) in enumerate(rows):
        base = rows[i - i % 2][2]
        lines.append(f"| {mode} | {first:.2f} | {median:.4f} | {base / median:.2f} | {peak:.1f} | {diff:.2e} |")
    print("\n".join(lines), flush=True)
    if a.out:
        with open(a.out, "a") as f:
            f.write("\n".join(lines) + "\n\n")


if __name__ == "__main__":
    main()

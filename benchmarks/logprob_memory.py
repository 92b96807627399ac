#!/usr/bin/env python
"""Peak memory and time of step 3's token log-probs, plain (HF logits, then the fp32
log-softmax) against fused (dschat.utils.linear_logprobs: output layer + log-softmax over
token chunks), forward and backward, side by side in one run.

    python benchmarks/logprob_memory.py                       # SmolLM2-135M's head, CPU
    python benchmarks/logprob_memory.py --vocab 250880 --hidden 1024 --device cuda   # bloom-560m's
    python benchmarks/logprob_memory.py --scoring             # a scoring pass: forward only, no entropy

Each mode runs in its own process (CPU: the peak resident set minus the resident set before
the measured call, which is the first; CUDA: torch.cuda.max_memory_allocated minus the
allocation before it, after a warm-up call), so one mode's freed memory cannot hide the
other's peak. Weight and input gradients (the same in both modes) are included.
"""
from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time


def measure(mode: str, a) -> dict:
    import torch
    import torch.nn.functional as F

    from dschat.utils.linear_logprobs import linear_logprobs
    from dschat.utils.tensor_ops import gather_log_probs

    torch.manual_seed(0)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[a.dtype]
    hidden = torch.randn(a.batch, a.tokens, a.hidden, device=a.device, dtype=dtype, requires_grad=True)
    weight = (0.02 * torch.randn(a.vocab, a.hidden, device=a.device, dtype=dtype)).requires_grad_()
    labels = torch.randint(0, a.vocab, (a.batch, a.tokens), device=a.device)

    def step():
        if a.scoring:          # a scoring pass: forward only, no entropy
            with torch.no_grad():
                if mode == "plain":
                    gather_log_probs(F.linear(hidden, weight), labels)
                else:
                    linear_logprobs(hidden, weight, None, labels, with_entropy=False)
            return
        if mode == "plain":
            logprobs = gather_log_probs(F.linear(hidden, weight), labels)
        else:
            logprobs, _ = linear_logprobs(hidden, weight, None, labels)
        logprobs.sum().backward()

    cuda = a.device.startswith("cuda")
    if cuda:
        step()                              # warm-up (allocator, kernels)
        hidden.grad = weight.grad = None
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    else:                                   # no warm-up: the process's peak must come from this call
        import psutil
        before = psutil.Process().memory_info().rss
    start = time.perf_counter()
    repeats = a.repeats if cuda else 1
    for _ in range(repeats):
        hidden.grad = weight.grad = None     # gradients are written, not accumulated
        step()
    if cuda:
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - before
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
    return {"mode": mode, "seconds": (time.perf_counter() - start) / repeats, "peak_gib": peak / 2 ** 30}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=32, help="sequences (step 3's PPO micro-batch)")
    p.add_argument("--tokens", type=int, default=193, help="answer-predicting columns per sequence")
    p.add_argument("--vocab", type=int, default=49152)
    p.add_argument("--hidden", type=int, default=576)
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    p.add_argument("--device", default="cpu")
    p.add_argument("--repeats", type=int, default=10, help="timed calls on CUDA (the mean; the CPU times one)")
    p.add_argument("--scoring", action="store_true",
                   help="a scoring pass: the forward only, without grad, the fused form without the entropy")
    p.add_argument("--mode", choices=("plain", "fused"), default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.mode:                                  # one measurement, in a child process
        print(json.dumps(measure(a.mode, a)))
        return 0
    rows = {}
    for mode in ("plain", "fused"):
        out = subprocess.run([sys.executable, __file__, *(argv or sys.argv[1:]), "--mode", mode],
                             capture_output=True, text=True, check=True)
        rows[mode] = json.loads(out.stdout.strip().splitlines()[-1])
    logits_gib = a.batch * a.tokens * a.vocab * 4 / 2 ** 30
    print(f"{a.batch} x {a.tokens} tokens, vocabulary {a.vocab}, hidden {a.hidden}, {a.dtype}, {a.device} "
          f"(one fp32 copy of the logits: {logits_gib:.2f} GiB)")
    print(f"| log-probs, {'forward (scoring)' if a.scoring else 'forward + backward'} "
          "| peak memory above the inputs (GiB) | seconds |")
    print("|---|---|---|")
    for mode, r in rows.items():
        print(f"| {mode} | {r['peak_gib']:.2f} | {r['seconds']:.2f} |")
    print(f"fused / plain: memory {rows['fused']['peak_gib'] / max(rows['plain']['peak_gib'], 1e-9):.2f}x, "
          f"time {rows['fused']['seconds'] / rows['plain']['seconds']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())

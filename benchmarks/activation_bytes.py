#!/usr/bin/env python
"""Bytes a Bloom block keeps for backward, HF's eager attention against ours (--attn_implementation
sdpa: dschat/utils/attention.py), side by side in one run:

    python benchmarks/activation_bytes.py                     # bloom-560m's block, 16 x 512, bf16, CPU
    python benchmarks/activation_bytes.py --hidden 4096 --heads 32 --batch 8 --layers 30   # bloom-7b1

Every activation autograd saves during a training forward is counted once per storage
(torch.autograd.graph.saved_tensors_hooks; the weights it saves are left out). The model
runs with 2 and with 3 blocks; the difference is one more block's bytes (the bias ours
shares between blocks is not in it), and the total for --layers blocks is the 2-block count
plus that many more blocks (a small vocabulary: the output layer's share is left out). The
count is exact: what the forward asks autograd to keep (on CUDA the fused kernel keeps the
same kinds of tensor: inputs, output, log-sum-exp), not an allocator's peak.
"""
from __future__ import annotations

import argparse

import torch


def saved_bytes(model, ids) -> int:
    """Bytes of the activations a training forward saves (weights left out)."""
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in weights:
            storages[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(input_ids=ids, use_cache=False).logits.float().sum().backward()
    return sum(storages.values())


def per_block(impl: str, a) -> tuple[int, int]:
    """(bytes of one more block, bytes of --layers blocks)"""
    from transformers import AutoModelForCausalLM, BloomConfig

    from dschat.utils.attention import use_attention

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[a.dtype]
    out = []
    for layers in (2, 3):
        torch.manual_seed(0)
        cfg = BloomConfig(vocab_size=256, hidden_size=a.hidden, n_layer=layers, n_head=a.heads,
                          hidden_dropout=0.0, attention_dropout=0.0)
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype).to(a.device).train()
        use_attention(model, impl)
        ids = torch.randint(0, 256, (a.batch, a.tokens), device=a.device)
        out.append(saved_bytes(model, ids))
    return out[1] - out[0], out[0] + (a.layers - 2) * (out[1] - out[0])


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--layers", type=int, default=24, help="Blocks of the whole model, for the total.")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="bf16")
    p.add_argument("--device", default="cpu")
    a = p.parse_args(argv)
    rows = {impl: per_block(impl, a) for impl in ("eager", "sdpa")}
    gib = 2 ** 30
    print(f"Bloom block, hidden {a.hidden}, {a.heads} heads, {a.batch} x {a.tokens} tokens, {a.dtype}: "
          "bytes saved for backward")
    print("\n| attention | per block GiB | x " + f"{a.layers} blocks GiB | x eager |")
    print("|---|---|---|---|")
    for impl, (block, total) in rows.items():
        print(f"| {impl} | {block / gib:.3f} | {total / gib:.2f} | {total / rows['eager'][1]:.2f} |")


if __name__ == "__main__":
    main()

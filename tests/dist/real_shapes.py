"""Real model shapes at ZeRO-3 on 2 CPU ranks: load -> train -> evaluate -> save -> reload
with plain `from_pretrained` -> generate with the hybrid engine, the ZeRO hooks and plain HF.

    deepspeed --num_gpus 2 tests/dist/real_shapes.py --folder MODEL_DIR [--lora] --out PATH

MODEL_DIR is a saved random-weight model at a real configuration (`REAL_CONFIGS`, built by
`build_folder`); every rank writes PATH.rank<k>.json. The configurations keep each model's
widths, heads and vocabulary - what decides whether a tensor is partitioned, persistent or
prefetched under ZeRO-3 - and only 2 blocks (depth changes none of that: every block has
the same tensors, and two blocks already give the backward a next block to prefetch).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch


LAYERS = 2
# (model_type, the published config's shape keys); layers cut to LAYERS.
REAL_CONFIGS = {
    # SmolLM2-135M-Instruct: tied embeddings, GQA 9/3
    "smollm2-135m": dict(model_type="llama", hidden_size=576, intermediate_size=1536, num_attention_heads=9,
                         num_key_value_heads=3, head_dim=64, vocab_size=49152, max_position_embeddings=8192,
                         rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=True,
                         num_hidden_layers=LAYERS),
    # bloom-560m: tied, 250880-row embedding, 16 heads
    "bloom-560m": dict(model_type="bloom", hidden_size=1024, n_head=16, vocab_size=250880,
                       tie_word_embeddings=True, n_layer=LAYERS),
    # opt-350m: embeddings projected 512 <-> 1024, post-norm blocks
    "opt-350m": dict(model_type="opt", hidden_size=1024, ffn_dim=4096, num_attention_heads=16,
                     vocab_size=50272, word_embed_proj_dim=512, do_layer_norm_before=False,
                     max_position_embeddings=2048, num_hidden_layers=LAYERS),
    # pythia-160m: untied output embedding, partial rotary, parallel residual
    "pythia-160m": dict(model_type="gpt_neox", hidden_size=768, num_attention_heads=12, intermediate_size=3072,
                        vocab_size=50304, rotary_pct=0.25, max_position_embeddings=2048,
                        use_parallel_residual=True, tie_word_embeddings=False, num_hidden_layers=LAYERS),
    # gpt2: tied, Conv1D linears
    "gpt2": dict(model_type="gpt2", n_embd=768, n_head=12, vocab_size=50257, n_positions=1024,
                 tie_word_embeddings=True, n_layer=LAYERS),
}
DROPOUT_OFF = {"bloom": dict(hidden_dropout=0.0, attention_dropout=0.0),
               "opt": dict(dropout=0.0, attention_dropout=0.0, activation_dropout=0.0),
               "gpt_neox": dict(hidden_dropout=0.0, attention_dropout=0.0),
               "gpt2": dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0), "llama": {}}


def build_folder(name: str, folder: Path, seed: int = 0) -> Path:
    """A saved model folder: random weights at REAL_CONFIGS[name] and the bundled tokenizer."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from dschat.data.assets import bundled_tokenizer_path
    spec = dict(REAL_CONFIGS[name])
    model_type = spec.pop("model_type")
    tokenizer = AutoTokenizer.from_pretrained(str(bundled_tokenizer_path()))
    ids = dict(pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
               bos_token_id=tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id)
    config = AutoConfig.for_model(model_type, **spec, **DROPOUT_OFF[model_type], **ids)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def batches(tokenizer, rank: int, n: int, size: int = 2, seed: int = 0) -> list[dict]:
    """`n` right-padded LM batches of bundled-data text, different on every rank."""
    from dschat.data.assets import bundled_dataset_path
    rows = [json.loads(line) for line in open(bundled_dataset_path(), encoding="utf-8")][:200]
    g = torch.Generator().manual_seed(seed + rank)
    picked = torch.randperm(len(rows), generator=g)[:n * size].tolist()
    out = []
    for i in range(n):
        texts = [rows[j]["prompt"] + rows[j]["chosen"] for j in picked[i * size:(i + 1) * size]]
        enc = tokenizer(texts, padding=True, return_tensors="pt")
        labels = enc["input_ids"].masked_fill(enc["attention_mask"] == 0, -100)
        out.append({"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"], "labels": labels})
    return out


def prompts(tokenizer, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded prompts of different lengths, different on every rank."""
    texts = ["\n\nHuman: What is 3 plus 4?\n\nAssistant:", "\n\nHuman: Name a colour.\n\nAssistant:"]
    texts = texts if rank == 0 else texts[::-1] + ["\n\nHuman: Hi\n\nAssistant:"]
    tokenizer.padding_side = "left"
    enc = tokenizer(texts, padding=True, return_tensors="pt")
    tokenizer.padding_side = "right"
    return enc["input_ids"], enc["attention_mask"]


def main():
    import argparse

    from tests.dist import hybrid_common as hc

    p = argparse.ArgumentParser()
    p.add_argument("--folder", required=True)
    p.add_argument("--lora", action="store_true")
    p.add_argument("--out", required=True)
    p.add_argument("--local_rank", type=int, default=-1)
    args = p.parse_args()
    rank, world = hc.init()

    from transformers import AutoModelForCausalLM

    from dschat.engine.config import train_ds_config
    from dschat.rollout.hybrid import HybridActor
    from dschat.engine.optim import build_optimizer
    from dschat.engine.train_utils import evaluate_lm, lm_loss_sum
    from dschat.engine.zero import initialize_engine, params_left_gathered
    from dschat.models.lora import apply_lora
    from dschat.models.model_utils import create_hf_model, load_tokenizer, save_hf_format

    timer = hc.Timer()
    res = {}
    tokenizer = load_tokenizer(args.folder)
    # the step entry points' own ZeRO-3 settings (persistence, prefetch, block hooks)
    ds_config = train_ds_config(zero_stage=3, dtype="fp32", micro_batch_size=2)
    model = create_hf_model(args.folder, tokenizer, ds_config=ds_config)
    if args.lora:
        model = apply_lora(model, 8, None, only_optimize_lora=False)
    optimizer = build_optimizer(model, lr=1e-3, weight_decay=0.0, lora_lr=1e-3, offload=False)
    engine = initialize_engine(model, ds_config, "block", optimizer=optimizer)
    res["partitioned_numel"] = sum(p.ds_numel for p in engine.module.parameters()
                                   if hasattr(p, "ds_id") and not p.ds_persist)
    res["t_load"] = timer()

    train, held_out = batches(tokenizer, rank, 1), batches(tokenizer, rank, 1, seed=99)
    res["eval_before"] = evaluate_lm(engine, held_out, torch.device("cpu"), 10)["loss"]
    for batch in train:
        engine.train()
        logits = engine(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False).logits
        loss = lm_loss_sum(logits, batch["labels"]) / (batch["labels"][:, 1:] != -100).sum()
        engine.backward(loss)
        engine.step()
    res["eval_after"] = evaluate_lm(engine, held_out, torch.device("cpu"), 10)["loss"]
    res["t_train"] = timer()

    # save right after an evaluation (where prefetches of the never-run backward were left)
    saved = Path(args.out).parent / "saved"
    save_hf_format(engine, tokenizer, saved, rank=rank)
    torch.distributed.barrier()
    res["left_after_save"] = params_left_gathered(engine.module)
    plain = AutoModelForCausalLM.from_pretrained(saved, dtype=torch.float32).eval()
    total = torch.zeros(2)
    with torch.no_grad():
        for batch in held_out:
            logits = plain(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
            total += torch.stack([lm_loss_sum(logits, batch["labels"]),
                                  (batch["labels"][:, 1:] != -100).sum().float()])
    torch.distributed.all_reduce(total)
    res["eval_reloaded"] = (total[0] / total[1]).item()
    res["t_save_reload"] = timer()

    # step 3's generation on the trained shards: hybrid replica, ZeRO hooks, plain HF on the reload
    ids, mask = prompts(tokenizer, rank)
    # 4 tokens: the ZeRO hooks gather every weight (bloom-560m's 1 GB embedding) per token
    common = dict(max_prompt_len=32, max_new_tokens=4)
    kw = dict(max_new_tokens=4, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    engine.eval()
    hybrid = HybridActor(engine, enable_hybrid_engine=True, mode="full", **common).generate(ids, mask, **kw)
    hooks = HybridActor(engine, enable_hybrid_engine=False, **common).generate(ids, mask, **kw)
    with torch.no_grad():
        hf = plain.generate(input_ids=ids, attention_mask=mask, do_sample=False, **kw)
    res["hybrid_equals_hooks"] = bool(torch.equal(hybrid, hooks))
    res["hybrid_equals_hf"] = bool(hybrid.shape == hf.shape and torch.equal(hybrid, hf))
    res["answer_tokens"] = hybrid[0, ids.shape[1]:].tolist()
    res["t_generate"] = timer()
    hc.write_results(res, rank)


if __name__ == "__main__":
    main()

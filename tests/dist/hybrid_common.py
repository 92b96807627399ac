"""Shared pieces of the hybrid-actor multi-rank scripts (tiny models, configs, prompts).

Imported by tests/dist/hybrid_*.py, which run under `deepspeed --num_gpus 2` on CPU.
"""
from __future__ import annotations

import atexit
import copy
import json
import os
import sys
import time

import torch

SEED = 1234
VOCAB = 256
PAD, EOS, BOS = 0, 1, 2


def tiny_config(family: str):
    """A tiny fp32 config per registry family; Bloom with 6 heads (not a power of two)."""
    import transformers as T
    ids = dict(bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD)
    if family == "bloom":
        return T.BloomConfig(vocab_size=VOCAB, hidden_size=96, n_layer=3, n_head=6, initializer_range=0.3,
                             hidden_dropout=0.0, attention_dropout=0.0, **ids)
    if family == "opt":
        return T.OPTConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=3, ffn_dim=128,
                           num_attention_heads=4, max_position_embeddings=128, word_embed_proj_dim=64,
                           init_std=0.3, dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, **ids)
    if family == "llama":
        return T.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                             initializer_range=0.3, **ids)
    if family == "gpt_neox":
        return T.GPTNeoXConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
                               intermediate_size=128, max_position_embeddings=128, initializer_range=0.3,
                               hidden_dropout=0.0, attention_dropout=0.0, **ids)
    if family == "gpt2":
        return T.GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=3, n_head=4, n_positions=128,
                            initializer_range=0.3, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, **ids)
    raise KeyError(family)


def tiny_model(family: str, *, lora: bool = False, seed: int = SEED):
    """The same weights on every rank (same seed); LoRA via peft with B != 0."""
    from transformers import AutoModelForCausalLM
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(family))
    if lora:
        import peft
        from dschat.registry import family_of
        cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=list(family_of(model).lora_targets),
                              init_lora_weights=False)      # random A and B: the delta matters
        model = peft.get_peft_model(model, cfg)
    return model


def reference_of(model):
    """A plain HF model holding `model`'s effective weights (LoRA merged by peft itself)."""
    ref = copy.deepcopy(model)
    if hasattr(ref, "merge_and_unload"):
        ref = ref.merge_and_unload()
    return ref.eval()


def ds_config(stage: int, *, offload_param: bool = False, micro_batch: int = 3, persistence: int = 0) -> dict:
    zero = {"stage": stage}
    if stage == 3:
        # persistence 0: every weight is really partitioned, none stays resident
        zero.update(stage3_param_persistence_threshold=persistence, stage3_max_live_parameters=1e9,
                    stage3_prefetch_bucket_size=1e6)
        if offload_param:
            zero["offload_param"] = {"device": "cpu"}
    return {"train_micro_batch_size_per_gpu": micro_batch, "gradient_accumulation_steps": 1,
            "steps_per_print": 10 ** 9, "zero_optimization": zero, "gradient_clipping": 1.0,
            "zero_allow_untested_optimizer": True, "zero_force_ds_cpu_optimizer": False,
            "wall_clock_breakdown": False}


def make_engine(model, stage: int, *, lr: float = 2e-2, offload_param: bool = False, train: bool = True,
                persistence: int = 0):
    import deepspeed
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=lr) if train else None
    config = ds_config(stage, offload_param=offload_param, persistence=persistence)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    return engine


def prompts(rank: int, batch: int = 3, min_len: int = 2, max_len: int = 8, seed: int = SEED):
    """Left-padded prompts of mixed lengths, different on every rank."""
    g = torch.Generator().manual_seed(seed + 101 * (rank + 1))
    lengths = torch.randint(min_len, max_len + 1, (batch,), generator=g).tolist()
    lengths[0] = max_len                     # at least one unpadded row
    P = max(lengths)
    ids = torch.full((batch, P), PAD, dtype=torch.long)
    mask = torch.zeros((batch, P), dtype=torch.long)
    for i, n in enumerate(lengths):
        ids[i, P - n:] = torch.randint(3, VOCAB, (n,), generator=g)
        mask[i, P - n:] = 1
    return ids, mask


def hf_generate(model, ids, mask, *, max_new_tokens: int, eos=EOS, min_new_tokens: int = 0):
    with torch.no_grad():
        return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                              min_new_tokens=min_new_tokens or None, do_sample=False,
                              eos_token_id=eos, pad_token_id=PAD, synced_gpus=False)


def hf_log_probs(model, seq, mask):
    from dschat.registry import position_ids_for
    from dschat.utils.tensor_ops import gather_log_probs
    kwargs = {}
    pos = position_ids_for(model, mask)
    if pos is not None:
        kwargs["position_ids"] = pos
    with torch.no_grad():
        logits = model(input_ids=seq, attention_mask=mask, use_cache=False, **kwargs).logits
    return gather_log_probs(logits[:, :-1], seq[:, 1:])


def train_step(engine, seq, mask) -> float:
    """One optimizer step of an LM loss on `seq` (the engine's own ZeRO hooks at work)."""
    from dschat.registry import position_ids_for
    engine.train()
    kwargs = {}
    pos = position_ids_for(engine.module, mask)
    if pos is not None:
        kwargs["position_ids"] = pos
    labels = seq.masked_fill(mask == 0, -100)
    loss = engine(input_ids=seq, attention_mask=mask, labels=labels, **kwargs).loss
    engine.backward(loss)
    engine.step()
    return float(loss.detach())


def gathered_state_reference(engine, template):
    """HF reference holding the engine's current weights: gather a full state dict (all
    ranks), load it into a copy of the pre-DeepSpeed `template`, merge LoRA with peft."""
    from dschat.engine.zero import full_state_dict
    state = full_state_dict(engine, rank0_only=False)
    model = copy.deepcopy(template)
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if k not in state]
    tied_ok = all(k.endswith("lm_head.weight") for k in missing)
    if unexpected or not tied_ok:
        raise RuntimeError(f"state dict mismatch: missing={missing} unexpected={unexpected}")
    return reference_of(model)


def init():
    """Join the process group; returns (rank, world_size)."""
    import deepspeed
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo")
    from dschat.utils.dist import shutdown_distributed
    atexit.register(shutdown_distributed)
    return torch.distributed.get_rank(), torch.distributed.get_world_size()


def out_path() -> str:
    for i, arg in enumerate(sys.argv):
        if arg == "--out":
            return sys.argv[i + 1]
    raise SystemExit("--out PATH is required")


def write_results(results: dict, rank: int) -> None:
    """Every rank writes its own file: PATH.rank<k>.json."""
    with open(f"{out_path()}.rank{rank}.json", "w") as f:
        json.dump(results, f, indent=1, default=str)


def run_scenarios(scenarios, results: dict, rank: int) -> None:
    """Run each (name, fn) into results[name] with its seconds; on an error write what was
    gathered so far (the error under name) and raise."""
    import traceback
    for name, fn in scenarios:
        timer = Timer()
        try:
            results[name] = fn()
            results[name]["seconds"] = timer()
        except Exception:
            results[name] = {"error": traceback.format_exc()}
            write_results(results, rank)
            raise
    write_results(results, rank)


class Timer:
    def __init__(self):
        self.t0 = time.perf_counter()

    def __call__(self) -> float:
        return round(time.perf_counter() - self.t0, 3)

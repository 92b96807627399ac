"""Rank body: tensor-parallel generation (`--inference_tp_size`) under real ZeRO-3.

Launched by tests/test_tensor_parallel.py as
    deepspeed --num_gpus 2 tests/dist/tp_generate.py --out PATH      (TP 2)
    deepspeed --num_gpus 4 tests/dist/tp_generate.py --out PATH      (TP 2 and TP 4)
Each rank writes PATH.rank<k>.json: per case (family, tp, lora) the checks the test
asserts: greedy tokens == HF generate on the same weights for this rank's own prompts
(mixed lengths, left-padded, batch size differing per rank), ranks stopping at different
steps on their own eos, log-probs vs HF, memory of the sliced replica vs the full one,
refill after an optimizer step, nothing left gathered; plus the clear size errors.
"""
from __future__ import annotations

import copy
import math
import traceback

import torch

import hybrid_common as hc

NEW = 8


def config_for(family: str, world: int):
    """Tiny fp32 configs; head counts not powers of two where the TP sizes allow it."""
    import transformers as T
    ids = dict(bos_token_id=hc.BOS, eos_token_id=hc.EOS, pad_token_id=hc.PAD)
    if family == "bloom":          # 6 heads at TP 2; 12 heads at TP 2 and 4
        heads = 6 if world == 2 else 12
        return T.BloomConfig(vocab_size=hc.VOCAB, hidden_size=8 * heads, n_layer=3, n_head=heads,
                             initializer_range=0.3, hidden_dropout=0.0, attention_dropout=0.0, **ids)
    if family == "llama":          # GQA; uneven MLP split at TP 4 (90 channels); vocab 250 at world 4
        if world == 2:
            return hc.tiny_config("llama")
        return T.LlamaConfig(vocab_size=250, hidden_size=64, intermediate_size=90, num_hidden_layers=3,
                             num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=128,
                             initializer_range=0.3, **ids)
    if family == "gpt_neox_seq":   # sequential residual variant
        cfg = hc.tiny_config("gpt_neox")
        cfg.use_parallel_residual = False
        return cfg
    return hc.tiny_config(family)


def make_model(family: str, world: int, lora: bool):
    from transformers import AutoModelForCausalLM
    torch.manual_seed(hc.SEED)
    model = AutoModelForCausalLM.from_config(config_for(family, world))
    if lora:
        import peft
        from dschat.registry import family_of
        cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=list(family_of(model).lora_targets),
                              init_lora_weights=False)
        model = peft.get_peft_model(model, cfg)
    return model


def prompts(rank: int, vocab: int, seed: int = hc.SEED):
    """Left-padded prompts of mixed lengths; batch size and longest prompt differ per rank."""
    g = torch.Generator().manual_seed(seed + 101 * (rank + 1))
    batch, longest = 2 + rank % 2, 6 + 2 * (rank % 3)
    lengths = torch.randint(2, longest + 1, (batch,), generator=g).tolist()
    lengths[rank % batch] = longest
    ids = torch.full((batch, longest), hc.PAD, dtype=torch.long)
    mask = torch.zeros((batch, longest), dtype=torch.long)
    for i, n in enumerate(lengths):
        ids[i, longest - n:] = torch.randint(3, vocab, (n,), generator=g)
        mask[i, longest - n:] = 1
    return ids, mask


def eos_stop(actor, ref, rank: int, vocab: int) -> dict:
    """Each rank's eos is a token its reference emits at a rank-dependent step, so ranks of a
    group finish at different times; each must still return exactly HF's output."""
    ids, mask = prompts(rank, vocab, seed=hc.SEED + 7)
    probe = hc.hf_generate(ref, ids, mask, max_new_tokens=NEW, eos=None)
    eos = int(probe[0, ids.shape[1] + (1 + 2 * rank) % NEW])
    want = hc.hf_generate(ref, ids, mask, max_new_tokens=NEW, eos=eos)
    got = actor.generate(ids, mask, max_new_tokens=NEW, eos_token_id=eos, pad_token_id=hc.PAD)
    return {"equal": bool(torch.equal(got, want)), "new_tokens": int(want.shape[1] - ids.shape[1])}


def run_family(family: str, tps: list[int], lora: bool, rank: int, world: int) -> list[dict]:
    """One ZeRO-3 engine, one TP actor per size in `tps` (each its own groups and scheduler);
    a result dict per size."""
    from dschat.rollout.gather import GatherPlan, GatherScheduler
    from dschat.rollout.hybrid import HybridActor
    from dschat.engine.zero import params_left_gathered

    timer = hc.Timer()
    model = make_model(family, world, lora)
    vocab = model.config.vocab_size
    template = copy.deepcopy(model)
    ref = hc.reference_of(model)
    engine = hc.make_engine(model, stage=3)
    t_engine = timer()
    plan = GatherPlan.build(engine.module)
    units = [g.nbytes for g in plan.static_groups] + [
        sum(g.nbytes for g in plan.block_groups[i:i + 2]) for i in range(0, len(plan.block_groups), 2)]
    ids, mask = prompts(rank, vocab)
    want = hc.hf_generate(ref, ids, mask, max_new_tokens=NEW)
    seq_mask = torch.cat([mask, torch.ones_like(want[:, ids.shape[1]:])], 1).long()
    # positions whose query and target are real tokens (a left pad's own logits are
    # arbitrary: HF and this path mask fully-padded query rows differently; PPO reads
    # only answer positions, whose queries are real)
    valid = (seq_mask[:, :-1] * seq_mask[:, 1:]).bool()
    lp_ref = hc.hf_log_probs(ref, want, seq_mask)
    t_ref = timer()
    cases, actors, scheds, lps = [], {}, {}, {}
    for tp in tps:
        res = {"family": family, "tp": tp, "lora": lora, "partitioned": plan.partitioned,
               "plan_bytes": plan.nbytes, "max_unit_bytes": max(units)}
        scheds[tp] = GatherScheduler()
        actor = actors[tp] = HybridActor(engine, enable_hybrid_engine=True, inference_tp_size=tp,
                                         tp_gather_partition_size=2, scheduler=scheds[tp], max_prompt_len=16,
                                         max_new_tokens=NEW)
        res["path"] = actor.path
        got = actor.generate(ids, mask, max_new_tokens=NEW, eos_token_id=hc.EOS, pad_token_id=hc.PAD)
        res["t_engine_ref_generate"] = [t_engine, t_ref, timer()]
        res["equal"] = bool(torch.equal(got, want))
        res["shape"] = [list(got.shape), list(want.shape)]
        res["tokens"] = got[:, ids.shape[1]:].tolist()
        res["memory"] = actor._tp.engine.replica.stats()
        res["fill_bytes"] = scheds[tp].stats["bytes_total"]
        res["eos_stop"] = eos_stop(actor, ref, rank, vocab)
        # the experience's log-prob pass on the sliced replica, rows of a different length per rank
        lps[tp] = actor.log_probs(want, seq_mask)
        res["logprob_vs_ref"] = float((lps[tp] - lp_ref)[valid].abs().max())
        res["fills_before_step"] = actor.pop_stats()["gen/refills"]
        # sampling: the leader's draws are broadcast; rows are valid tokens
        sampled = actor.generate(ids, mask, max_new_tokens=NEW, do_sample=True, top_k=20, top_p=0.9,
                                 eos_token_id=hc.EOS, pad_token_id=hc.PAD)
        res["sample_ok"] = bool(sampled.shape[0] == ids.shape[0] and torch.equal(sampled[:, :ids.shape[1]], ids)
                                and int(sampled.max()) < vocab)
        res["left_after_generate"] = params_left_gathered(engine.module)
        cases.append(res)

    # one optimizer step: every replica slice is refilled and matches HF on the new weights
    hc.train_step(engine, want, seq_mask)
    ref2 = hc.gathered_state_reference(engine, template)
    want2 = hc.hf_generate(ref2, ids, mask, max_new_tokens=NEW)
    lp_ref2 = hc.hf_log_probs(ref2, want, seq_mask)
    for res in cases:
        actor = actors[res["tp"]]
        actor.mark_weights_updated()
        got2 = actor.generate(ids, mask, max_new_tokens=NEW, eos_token_id=hc.EOS, pad_token_id=hc.PAD)
        res["after_step_equal"] = bool(torch.equal(got2, want2))
        lp2 = actor.log_probs(want, seq_mask)
        res["logprob_shift_after_step"] = float((lp2 - lps[res["tp"]])[valid].abs().max())
        res["logprob_vs_ref_after_step"] = float((lp2 - lp_ref2)[valid].abs().max())
        res["refills_after_step"] = actor.pop_stats()["gen/refills"]
    loss = hc.train_step(engine, want, seq_mask)
    for res in cases:
        res["loss_finite"] = math.isfinite(loss)
        res["left_final"] = params_left_gathered(engine.module)
        actors[res["tp"]].release_inference_cache()
        res["seconds"] = timer()
    return cases


def size_errors(world: int) -> dict:
    """The clear errors: a TP size that does not divide the world, the head count, the KV
    head count (HybridActor validates before any collective)."""
    import transformers as T
    from dschat.rollout.hybrid import HybridActor
    from dschat.utils.errors import UserInputError

    big = 4 if world == 4 else 2
    cases = {
        "world": (3 if world == 4 else 4, T.BloomConfig(vocab_size=64, hidden_size=48, n_layer=1, n_head=6)),
        "heads": (big, T.BloomConfig(vocab_size=64, hidden_size=48 if world == 4 else 40, n_layer=1,
                                     n_head=6 if world == 4 else 5)),
        "kv_heads": (big, T.LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=1,
                                        num_attention_heads=8, num_key_value_heads=world // 2)),
    }
    out = {}
    for name, (tp, cfg) in cases.items():
        model = T.AutoModelForCausalLM.from_config(cfg)
        engine = type("Engine", (), {"module": model, "device": "cpu"})()
        try:
            HybridActor(engine, enable_hybrid_engine=True, inference_tp_size=tp, max_prompt_len=8, max_new_tokens=8)
            out[name] = None
        except UserInputError as e:
            out[name] = str(e)
    return out


def main():
    rank, world = hc.init()
    tps = [2] if world == 2 else [2, 4]
    if world == 2:
        cases = [("bloom", False), ("bloom", True), ("opt", False), ("llama", False), ("llama", True),
                 ("gpt_neox", False), ("gpt_neox_seq", False)]
    else:
        cases = [(f, False) for f in ("bloom", "opt", "llama")]
    results = {"world_size": world, "cases": [], "errors": {}}
    for family, lora in cases:
        try:
            results["cases"] += run_family(family, tps, lora, rank, world)
        except Exception:
            results["cases"].append({"family": family, "tp": tps, "lora": lora, "error": traceback.format_exc()})
            hc.write_results(results, rank)
            raise
    results["errors"] = size_errors(world)
    hc.write_results(results, rank)


if __name__ == "__main__":
    from dschat.utils.run import main_guard

    main_guard(main)   # exits via os._exit once done (see main_guard)

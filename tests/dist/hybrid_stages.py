"""Rank body: HybridActor across ZeRO stages, param offload, gathered(), a layered actor's peak, sampling.

Launched by tests/test_hybrid.py as
    deepspeed --num_gpus 2 tests/dist/hybrid_stages.py --out PATH
Each rank writes PATH.rank<k>.json with one entry per scenario.
"""
from __future__ import annotations

import copy
import math

import torch

import hybrid_common as hc


def generations_match(actor, ref, ids, mask, **kw) -> bool:
    got = actor.generate(ids, mask, max_new_tokens=8, eos_token_id=hc.EOS, pad_token_id=hc.PAD, **kw)
    return bool(torch.equal(got, hc.hf_generate(ref, ids, mask, max_new_tokens=8)))


def low_stage(stage: int, lora: bool, rank: int) -> dict:
    """ZeRO 0/2: no gather. Alias without LoRA, copy + merge with LoRA; correct after a step."""
    from dschat.rollout.gather import GatherScheduler
    from dschat.rollout.hybrid import HybridActor
    res = {"stage": stage, "lora": lora}
    model = hc.tiny_model("bloom", lora=lora)
    template, ref = copy.deepcopy(model), hc.reference_of(model)
    engine = hc.make_engine(model, stage=stage)
    sched = GatherScheduler()
    actor = HybridActor(engine, enable_hybrid_engine=True, mode="layered", scheduler=sched,
                        max_prompt_len=16, max_new_tokens=8)
    off = HybridActor(engine, enable_hybrid_engine=False, max_prompt_len=16, max_new_tokens=8)
    ids, mask = hc.prompts(rank)
    res["path"] = actor.path
    res["equal"] = generations_match(actor, ref, ids, mask)
    res["equal_off"] = generations_match(off, ref, ids, mask)
    res["gathered_bytes"] = sched.stats["bytes_total"]
    before = actor.generate(ids, mask, max_new_tokens=8, eos_token_id=hc.EOS, pad_token_id=hc.PAD)
    hc.train_step(engine, before, torch.ones_like(before))
    ref2 = hc.gathered_state_reference(engine, template)
    res["after_step_equal"] = generations_match(actor, ref2, ids, mask)
    res["after_step_changed"] = not torch.equal(
        actor.generate(ids, mask, max_new_tokens=8, eos_token_id=hc.EOS, pad_token_id=hc.PAD), before)
    res["module_training_restored"] = engine.module.training
    return res


def offload_case(rank: int) -> dict:
    """ZeRO-3 with offload_param cpu: full, layered, off; bf16 replica; sampling; release."""
    from dschat.rollout.gather import GatherScheduler
    from dschat.rollout.hybrid import HybridActor
    from dschat.engine.zero import params_left_gathered
    res = {}
    model = hc.tiny_model("opt")
    template, ref = copy.deepcopy(model), hc.reference_of(model)
    engine = hc.make_engine(model, stage=3, offload_param=True)
    res["offload_param"] = str(engine.zero_offload_param())
    common = dict(max_prompt_len=16, max_new_tokens=8)
    actors = {
        "full": HybridActor(engine, enable_hybrid_engine=True, mode="full", scheduler=GatherScheduler(),
                            release_inference_cache=True, **common),
        "layered": HybridActor(engine, enable_hybrid_engine=True, mode="layered", tp_gather_partition_size=1,
                               scheduler=GatherScheduler(), **common),
        "off": HybridActor(engine, enable_hybrid_engine=False, **common),
    }
    ids, mask = hc.prompts(rank)
    for name, actor in actors.items():
        res[f"equal_{name}"] = generations_match(actor, ref, ids, mask)

    # a bf16 replica filled from fp32 shards equals HF on the same weights cast to bf16
    bf16 = HybridActor(engine, enable_hybrid_engine=True, mode="full", inference_dtype="bf16",
                       scheduler=GatherScheduler(), **common)
    got = bf16.generate(ids, mask, max_new_tokens=8, eos_token_id=hc.EOS, pad_token_id=hc.PAD)
    res["equal_bf16_replica"] = bool(torch.equal(got, hc.hf_generate(copy.deepcopy(ref).to(torch.bfloat16),
                                                                     ids, mask, max_new_tokens=8)))
    res["bf16_replica_dtype"] = str(next(bf16.inference_model.parameters()).dtype)
    bf16.release_inference_cache()

    # sampling: per-rank seeded; the same generator seed gives the same draw on every path
    sample = {}
    for name, actor in actors.items():
        gen = torch.Generator().manual_seed(99 + rank)
        sample[name] = actor.generate(ids, mask, max_new_tokens=8, do_sample=True, temperature=1.3, top_k=50,
                                      top_p=0.95, eos_token_id=hc.EOS, pad_token_id=hc.PAD, generator=gen)
    res["sample_paths_agree"] = bool(torch.equal(sample["full"], sample["layered"])
                                     and torch.equal(sample["full"], sample["off"]))
    greedy = hc.hf_generate(ref, ids, mask, max_new_tokens=8)
    res["sample_differs_from_greedy"] = not torch.equal(sample["full"], greedy)
    a = actors["full"].generate(ids, mask, max_new_tokens=8, do_sample=True, eos_token_id=hc.EOS, pad_token_id=hc.PAD)
    b = actors["full"].generate(ids, mask, max_new_tokens=8, do_sample=True, eos_token_id=hc.EOS, pad_token_id=hc.PAD)
    res["default_generator_advances"] = not torch.equal(a, b)
    state = torch.random.get_rng_state()
    actors["full"].generate(ids, mask, max_new_tokens=8, do_sample=True, eos_token_id=hc.EOS, pad_token_id=hc.PAD)
    res["global_rng_untouched"] = bool(torch.equal(state, torch.random.get_rng_state()))

    # --release_inference_cache: train() frees the replica; the next generate rebuilds it
    actors["full"].train()
    res["released_on_train"] = actors["full"]._replica is None
    res["left_before_step"] = params_left_gathered(engine.module)
    seq = actors["full"].generate(ids, mask, max_new_tokens=8, eos_token_id=hc.EOS, pad_token_id=hc.PAD)
    seq_mask = torch.cat([mask, torch.ones_like(seq[:, ids.shape[1]:])], 1)
    res["loss0"] = hc.train_step(engine, seq, seq_mask)
    ref2 = hc.gathered_state_reference(engine, template)
    for name, actor in actors.items():
        res[f"after_step_equal_{name}"] = generations_match(actor, ref2, ids, mask)
    res["left_final"] = params_left_gathered(engine.module)
    res["loss1_finite"] = math.isfinite(hc.train_step(engine, seq, seq_mask))
    return res


def gathered_case(rank: int) -> dict:
    """gathered() on a frozen ZeRO-3 engine (a reference / reward model); a layered actor's peak."""
    from dschat.rollout.gather import GatherPlan, GatherScheduler, gathered
    from dschat.rollout.hybrid import HybridActor
    from dschat.utils.tensor_ops import gather_log_probs
    from dschat.engine.zero import params_left_gathered
    res = {}
    model = hc.tiny_model("llama")
    ref = hc.reference_of(model)
    frozen = hc.make_engine(model, stage=3, train=False)
    ids, mask = hc.prompts(rank)
    sched = GatherScheduler()
    want = hc.hf_log_probs(ref, ids, mask)
    with torch.no_grad(), gathered(frozen.module, scheduler=sched, owner="reference") as module:
        n_params = len(list(module.parameters()))
        res["all_available_inside"] = len(params_left_gathered(module)) == n_params
        logits = module(input_ids=ids, attention_mask=mask,
                        position_ids=(mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)).logits
        res["still_available_after_forward"] = len(params_left_gathered(module)) == n_params
    res["gathered_vs_ref"] = float((gather_log_probs(logits[:, :-1], ids[:, 1:]) - want)[mask[:, 1:].bool()].abs().max())
    res["left_after_gathered"] = params_left_gathered(frozen.module)
    res["gathered_bytes"] = sched.stats["bytes_total"]
    res["plan_bytes"] = GatherPlan.build(frozen.module).nbytes
    hooks = hc.hf_log_probs(frozen.module, ids, mask)       # ZeRO's own hooks still work
    res["hooks_vs_ref"] = float((hooks - want)[mask[:, 1:].bool()].abs().max())
    res["left_after_hooks"] = params_left_gathered(frozen.module)

    # a layered actor with one block per chunk: generation equal to HF, and the gathered
    # bytes alive at once never above one chunk (the previous chunk is released before the
    # next one's gather starts); this engine keeps small params (norms) persistent, as the
    # default config does
    model2 = hc.tiny_model("llama", seed=hc.SEED + 5)
    ref2 = hc.reference_of(model2)
    engine = hc.make_engine(model2, stage=3, persistence=100)
    res["persistent_params"] = sum(bool(getattr(p, "ds_persist", False)) for p in engine.module.parameters())
    full = HybridActor(engine, enable_hybrid_engine=True, mode="full", scheduler=GatherScheduler(),
                       max_prompt_len=16, max_new_tokens=8)
    res["persistent_full_equal"] = generations_match(full, ref2, ids, mask)
    full.release_inference_cache()
    sched = GatherScheduler()
    actor = HybridActor(engine, enable_hybrid_engine=True, mode="layered", tp_gather_partition_size=1,
                        scheduler=sched, max_prompt_len=16, max_new_tokens=8)
    res["layered_equal"] = generations_match(actor, ref2, ids, mask)
    res["layered_peak"] = sched.stats["peak_live_bytes"]
    res["max_group_bytes"] = max(g.nbytes for g in GatherPlan.build(engine.module).groups)
    res["left_after_layered"] = params_left_gathered(engine.module)
    seq = actor.generate(ids, mask, max_new_tokens=8, eos_token_id=hc.EOS, pad_token_id=hc.PAD)
    res["loss_finite"] = math.isfinite(hc.train_step(engine, seq, torch.ones_like(seq)))
    return res


def main():
    rank, world = hc.init()
    results = {"world_size": world}
    scenarios = [("stage0", lambda: low_stage(0, False, rank)), ("stage2", lambda: low_stage(2, False, rank)),
                 ("stage2_lora", lambda: low_stage(2, True, rank)), ("offload", lambda: offload_case(rank)),
                 ("gathered", lambda: gathered_case(rank))]
    hc.run_scenarios(scenarios, results, rank)


if __name__ == "__main__":
    from dschat.utils.run import main_guard

    main_guard(main)   # exits via os._exit once done (see main_guard)

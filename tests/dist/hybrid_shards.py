"""Rank body: ZeRO-3 on ONE rank, where the actor's replica is views of its shards (path "shards").

Launched by tests/test_hybrid.py as
    deepspeed --num_gpus 1 tests/dist/hybrid_shards.py --out PATH
Writes PATH.rank0.json with one entry per scenario.
"""
from __future__ import annotations

import copy

import torch

import hybrid_common as hc


def shard_pointers(engine) -> set[int]:
    return {p.ds_tensor.data_ptr() for p in engine.module.parameters()}


def views_case(family: str, *, fast: bool, persistence: int) -> dict:
    """Generation on views of the shards equals HF on the same weights, before and after
    optimizer steps, with nothing gathered or copied and no storage of its own."""
    from dschat.rollout.gather import GatherScheduler
    from dschat.rollout.hybrid import HybridActor
    res = {}
    model = hc.tiny_model(family)
    template, ref = copy.deepcopy(model), hc.reference_of(model)
    engine = hc.make_engine(model, stage=3, persistence=persistence)
    sched = GatherScheduler()
    actor = HybridActor(engine, enable_hybrid_engine=True, mode="full", scheduler=sched,
                        use_fast_decode=True if fast else None, max_prompt_len=16, max_new_tokens=8)
    copied = HybridActor(engine, enable_hybrid_engine=True, mode="full", scheduler=GatherScheduler(),
                         shard_views=False, max_prompt_len=16, max_new_tokens=8)
    ids, mask = hc.prompts(0)
    res["path"], res["copied_path"] = actor.path, copied.path
    gen = dict(max_new_tokens=8, eos_token_id=hc.EOS, pad_token_id=hc.PAD)
    before = actor.generate(ids, mask, **gen)
    res["equal"] = bool(torch.equal(before, hc.hf_generate(ref, ids, mask, max_new_tokens=8)))
    replica = actor.inference_model
    res["fast_used"] = actor._fast is not None
    pointers = shard_pointers(engine)
    res["all_params_are_shards"] = all(p.data_ptr() in pointers for p in replica.parameters())
    res["copied_params_are_shards"] = any(p.data_ptr() in pointers for p in copied.inference_model.parameters())
    for step in range(2):
        seq = actor.generate(ids, mask, **gen)
        res[f"loss{step}"] = hc.train_step(engine, seq, torch.ones_like(seq))
        actor.mark_weights_updated()
        copied.mark_weights_updated()
    after = actor.generate(ids, mask, **gen)
    ref2 = hc.gathered_state_reference(engine, template)
    res["after_step_equal"] = bool(torch.equal(after, hc.hf_generate(ref2, ids, mask, max_new_tokens=8)))
    res["after_step_equal_copied"] = bool(torch.equal(copied.generate(ids, mask, **gen), after))
    res["after_step_changed"] = not torch.equal(after, before)
    # the actor's scoring pass reads the views too
    seq_mask = torch.ones_like(after)
    res["log_probs_diff"] = float((actor.log_probs(after, seq_mask) -
                                   hc.hf_log_probs(ref2, after, seq_mask)).abs().max())
    res["same_replica_after_steps"] = actor.inference_model is replica
    stats = actor.pop_stats()
    res["builds"], res["refills"] = stats["gen/builds"], stats["gen/refills"]
    res["gathered_bytes"] = sched.stats["bytes_total"]
    from dschat.engine.zero import params_left_gathered
    res["left_gathered"] = params_left_gathered(engine.module)
    return res


def fallback_case() -> dict:
    """Where views cannot serve, a copied replica: LoRA (merged), another inference dtype,
    parameters offloaded to the host (shards not on the device of inference)."""
    from dschat.rollout.gather import GatherScheduler
    from dschat.rollout.hybrid import HybridActor
    res = {}
    common = dict(enable_hybrid_engine=True, mode="full", max_prompt_len=16, max_new_tokens=8)
    ids, mask = hc.prompts(0)
    lora_model = hc.tiny_model("opt", lora=True)
    ref = hc.reference_of(lora_model)
    lora = HybridActor(hc.make_engine(lora_model, stage=3), scheduler=GatherScheduler(), **common)
    res["lora_path"] = lora.path
    got = lora.generate(ids, mask, max_new_tokens=8, eos_token_id=hc.EOS, pad_token_id=hc.PAD)
    res["lora_equal"] = bool(torch.equal(got, hc.hf_generate(ref, ids, mask, max_new_tokens=8)))
    plain = hc.make_engine(hc.tiny_model("opt"), stage=3)
    res["bf16_path"] = HybridActor(plain, scheduler=GatherScheduler(), inference_dtype="bf16", **common).path
    offloaded = hc.make_engine(hc.tiny_model("opt"), stage=3, offload_param=True)
    res["offload_path"] = HybridActor(offloaded, scheduler=GatherScheduler(), **common).path
    return res


def main():
    rank, world = hc.init()
    results = {"world_size": world}
    scenarios = [("bloom", lambda: views_case("bloom", fast=False, persistence=0)),
                 ("llama_fast", lambda: views_case("llama", fast=True, persistence=0)),
                 ("opt_persistent", lambda: views_case("opt", fast=False, persistence=10 ** 6)),
                 ("fallback", fallback_case)]
    hc.run_scenarios(scenarios, results, rank)


if __name__ == "__main__":
    from dschat.utils.run import main_guard

    main_guard(main)   # exits via os._exit once done (see main_guard)

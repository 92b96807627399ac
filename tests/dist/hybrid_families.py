"""Rank body: HybridActor under real ZeRO-3 across ranks, every family, LoRA on and off.

Launched by tests/test_hybrid.py as
    deepspeed --num_gpus 2 tests/dist/hybrid_families.py --out PATH [--families a,b] [--lora off,on]
Each rank writes PATH.rank<k>.json: per (family, lora) the checks the test asserts.
"""
from __future__ import annotations

import copy
import math
import sys
import traceback

import torch

import hybrid_common as hc


def arg(name: str, default: str) -> str:
    return sys.argv[sys.argv.index(name) + 1] if name in sys.argv else default


def eos_stop_check(actors: dict, ref, rank: int) -> dict:
    """One row per rank, each rank's eos a token its reference emits at a different step,
    so ranks finish at different times (synced_gpus must keep the collectives matched)."""
    ids, mask = hc.prompts(rank, batch=1, seed=hc.SEED + 7)
    probe = hc.hf_generate(ref, ids, mask, max_new_tokens=8, eos=None)
    step = 1 if rank == 0 else 6
    eos = int(probe[0, ids.shape[1] + step])
    want = hc.hf_generate(ref, ids, mask, max_new_tokens=8, eos=eos)
    out = {}
    for name, actor in actors.items():
        got = actor.generate(ids, mask, max_new_tokens=8, eos_token_id=eos, pad_token_id=hc.PAD)
        out[name] = bool(torch.equal(got, want))
    out["ref_len"] = int(want.shape[1] - ids.shape[1])
    return out


def count_fill_gathers(counts: dict):
    """Count the replica fills' non-empty gathers by kind: straight from the shards
    (gather.ShardGather) or through DeepSpeed's fetch (LoRA groups, where the delta needs
    the gathered adapter params)."""
    from dschat.rollout import gather as G
    real = G._fill_gather

    def counting(*args):
        g = real(*args)
        if g.params:
            counts["direct" if isinstance(g, G.ShardGather) else "deepspeed"] += 1
        return g
    G._fill_gather = counting
    return real


def direct_vs_deepspeed_fill(engine) -> bool:
    """Two replicas filled from the same shards, straight and through DeepSpeed's fetch:
    bit-identical."""
    from dschat.rollout import gather as G
    reps = {}
    for direct in (True, False):
        G.DIRECT_FILL = direct
        reps[direct] = G.build_replica(engine.module)
        G.fill_replica(engine.module, reps[direct], scheduler=G.GatherScheduler())
    G.DIRECT_FILL = True
    a, b = reps[True].state_dict(), reps[False].state_dict()
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def padded_shards_fill() -> dict:
    """Bloom with hidden size 63: its norms and biases do not split evenly over 2 ranks, so
    the last rank's shards are padded. The straight fill (full and layered, with persistent
    params copied as they are) must equal DeepSpeed's fetch bit for bit."""
    import transformers as T
    from dschat.rollout import gather as G
    torch.manual_seed(hc.SEED)
    cfg = T.BloomConfig(vocab_size=hc.VOCAB + 1, hidden_size=63, n_layer=3, n_head=7,
                        bos_token_id=hc.BOS, eos_token_id=hc.EOS, pad_token_id=hc.PAD)
    engine = hc.make_engine(T.BloomForCausalLM(cfg), stage=3, persistence=100)
    world = torch.distributed.get_world_size()
    params = list(engine.module.parameters())
    res = {"padded": sum(p.ds_numel % world != 0 for p in params if hasattr(p, "ds_numel")),
           "persistent": sum(bool(getattr(p, "ds_persist", False)) for p in params)}
    reps = {}
    for direct in (True, False):
        G.DIRECT_FILL = direct
        reps[direct] = G.build_replica(engine.module)
        for _ in range(2):               # the second fill reuses the cached plans
            G.fill_replica(engine.module, reps[direct], scheduler=G.GatherScheduler())
        lay = G.LayeredReplica(engine.module, group_size=2, scheduler=G.GatherScheduler())
        lay.fill()
        with lay.session(), torch.no_grad():     # loads every chunk through the hooks
            reps[(direct, "layered")] = lay.model(torch.arange(3, 11)[None]).logits
        lay.close()
    G.DIRECT_FILL = True
    a, b = reps[True].state_dict(), reps[False].state_dict()
    res["full_equal"] = a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    res["layered_equal"] = bool(torch.equal(reps[(True, "layered")], reps[(False, "layered")]))
    with G.gathered(engine.module):
        res["full_equals_source"] = all(torch.equal(p, a[n]) for n, p in engine.module.named_parameters())
    return res


def run_case(family: str, lora: bool, rank: int) -> dict:
    from dschat.rollout import gather as G
    from dschat.rollout.gather import GatherPlan, GatherScheduler
    from dschat.rollout.hybrid import HybridActor
    from dschat.engine.zero import params_left_gathered

    timer = hc.Timer()
    res = {"family": family, "lora": lora}
    model = hc.tiny_model(family, lora=lora)
    template = copy.deepcopy(model)            # pre-DeepSpeed structure, for post-step references
    ref = hc.reference_of(model)
    engine = hc.make_engine(model, stage=3)
    res["t_engine"] = timer()
    plan = GatherPlan.build(engine.module)
    res["partitioned"] = plan.partitioned
    res["plan_groups"] = [g.name for g in plan.groups]
    res["plan_bytes"] = plan.nbytes

    counts = {"direct": 0, "deepspeed": 0}
    real_fill_gather = count_fill_gathers(counts)
    scheds = {name: GatherScheduler() for name in ("full", "layered")}
    common = dict(max_prompt_len=16, max_new_tokens=8)
    actors = {
        "full": HybridActor(engine, enable_hybrid_engine=True, mode="full", scheduler=scheds["full"],
                            owner="full", **common),
        "layered": HybridActor(engine, enable_hybrid_engine=True, mode="layered", tp_gather_partition_size=2,
                               scheduler=scheds["layered"], owner="layered", **common),
        "off": HybridActor(engine, enable_hybrid_engine=False, **common),
        # the fast decode path (forced on CPU): in-place refill + refresh() contract with decode.py
        "fast": HybridActor(engine, enable_hybrid_engine=True, mode="full", use_fast_decode=True,
                            scheduler=GatherScheduler(), **common),
    }
    res["paths"] = {k: a.path for k, a in actors.items() if k != "fast"}
    ids, mask = hc.prompts(rank)
    want = hc.hf_generate(ref, ids, mask, max_new_tokens=8)
    before = {}
    for name, actor in actors.items():
        got = actor.generate(ids, mask, max_new_tokens=8, eos_token_id=hc.EOS, pad_token_id=hc.PAD)
        before[name] = got
        res[f"equal_{name}"] = bool(torch.equal(got, want))
    res["t_generate"] = timer()
    res["fast_used"] = actors["fast"]._fast is not None
    res["hybrid_on_equals_off"] = bool(torch.equal(before["full"], before["off"])
                                       and torch.equal(before["layered"], before["off"]))
    res["tokens_rank_sample"] = want[0, ids.shape[1]:].tolist()
    res["full_fill_bytes"] = scheds["full"].stats["bytes_total"]
    # full fill keeps one group ahead in flight: the peak is the largest neighbouring pair
    res["full_peak_live"] = scheds["full"].stats["peak_live_bytes"]
    res["max_pair_bytes"] = max(a.nbytes + b.nbytes for a, b in zip(plan.groups, plan.groups[1:]))
    lay = actors["layered"]._layered
    res["layered_slot_bytes"] = lay.slot_nbytes
    from dschat.registry import family_of, resolve
    block0 = resolve(lay.model, family_of(lay.model).blocks)[0]
    res["block_bytes"] = sum(p.numel() * p.element_size() for p in block0.parameters())
    res["src_block_bytes"] = plan.block_groups[0].nbytes      # what one block gathers (+ LoRA)
    res["layered_peak_live"] = scheds["layered"].stats["peak_live_bytes"]
    res["max_static_group_bytes"] = max(g.nbytes for g in plan.static_groups)
    res["left_after_generate"] = params_left_gathered(engine.module)

    # the experience's log-prob pass: replica == live training module == HF reference
    seq = before["full"]
    seq_mask = (torch.cat([mask, torch.ones_like(seq[:, ids.shape[1]:])], 1)).long()
    lp_full = actors["full"].log_probs(seq, seq_mask)
    lp_layered = actors["layered"].log_probs(seq, seq_mask)
    lp_live = actors["off"].log_probs(seq, seq_mask)
    lp_ref = hc.hf_log_probs(ref, seq, seq_mask)
    valid = seq_mask[:, 1:].bool()
    res["logprob_full_vs_live"] = float((lp_full - lp_live)[valid].abs().max())
    res["logprob_layered_vs_live"] = float((lp_layered - lp_live)[valid].abs().max())
    res["logprob_full_vs_ref"] = float((lp_full - lp_ref)[valid].abs().max())
    # the trainer's actor scoring: the same forward with the output layer fused (no [B, S, V] logits)
    from dschat.models.fused_head import FusedLogprobs
    from dschat.registry import position_ids_for
    for name in ("full", "layered", "off"):
        with actors[name].scoring_model() as model, FusedLogprobs(model, seq) as head:
            positions = position_ids_for(model, seq_mask)
            out = model(input_ids=seq, attention_mask=seq_mask, use_cache=False,
                        **({} if positions is None else {"position_ids": positions})).logits
        res[f"fused_active_{name}"] = head.active
        res[f"logprob_fused_{name}_vs_ref"] = float((out[:, :-1] - lp_ref)[valid].abs().max())
    res["full_fills_before_step"] = actors["full"].pop_stats()["gen/refills"]
    res["t_scoring"] = timer()
    res["eos_stop"] = eos_stop_check(actors, ref, rank)   # includes the fast path
    res["t_eos"] = timer()
    res["left_after_scoring"] = params_left_gathered(engine.module)

    # one optimizer step; the trainer marks it for the full actor, the others see global_steps
    res["loss0"] = hc.train_step(engine, seq, seq_mask)
    res["t_step"] = timer()
    actors["full"].mark_weights_updated()
    ref2 = hc.gathered_state_reference(engine, template)
    res["t_ref2"] = timer()
    want2 = hc.hf_generate(ref2, ids, mask, max_new_tokens=8)
    for name, actor in actors.items():
        got = actor.generate(ids, mask, max_new_tokens=8, eos_token_id=hc.EOS, pad_token_id=hc.PAD)
        res[f"after_step_equal_{name}"] = bool(torch.equal(got, want2))
        res[f"after_step_changed_{name}"] = not torch.equal(got, before[name])
    lp_full2 = actors["full"].log_probs(seq, seq_mask)
    res["logprob_shift_after_step"] = float((lp_full2 - lp_full)[valid].abs().max())
    res["logprob_full_vs_ref_after_step"] = float((lp_full2 - hc.hf_log_probs(ref2, seq, seq_mask))[valid].abs().max())
    res["left_after_step_generate"] = params_left_gathered(engine.module)
    loss1 = hc.train_step(engine, seq, seq_mask)
    res["loss1_finite"] = math.isfinite(loss1)
    G._fill_gather = real_fill_gather
    res["fill_gathers"] = counts
    res["direct_equals_deepspeed_fill"] = direct_vs_deepspeed_fill(engine)
    res["left_final"] = params_left_gathered(engine.module)
    res["seconds"] = timer()
    for actor in actors.values():
        actor.release_inference_cache()
    return res


def main():
    rank, world = hc.init()
    families = arg("--families", "bloom,opt,llama,gpt_neox,gpt2").split(",")
    loras = [x == "on" for x in arg("--lora", "off,on").split(",")]
    results = {"world_size": world, "cases": []}
    for family in families:
        for lora in loras:
            try:
                results["cases"].append(run_case(family, lora, rank))
            except Exception:
                results["cases"].append({"family": family, "lora": lora, "error": traceback.format_exc()})
                hc.write_results(results, rank)
                raise
    results["padded_shards"] = padded_shards_fill()
    hc.write_results(results, rank)


if __name__ == "__main__":
    from dschat.utils.run import main_guard

    main_guard(main)   # exits via os._exit once done (see main_guard)

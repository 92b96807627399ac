"""Gather plan, scheduler, replicas and the hybrid actor.

Single-process tests build tiny HF models (no DeepSpeed engine needed); the two
multi-rank tests launch real ZeRO-3 engines on 2 CPU ranks (tests/dist/hybrid_*.py) and
check token identity with plain HF generate, weight refresh after a step, and that no
parameter is left gathered.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dschat.registry import family_of, position_ids_for, resolve, unwrap_peft
from dschat.rollout.gather import (
    GatherPlan,
    GatherScheduler,
    LayeredReplica,
    build_replica,
    fill_replica,
    get_scheduler,
    release_replica,
)
from dschat.rollout.hybrid import HybridActor
from dschat.utils.errors import UserInputError
from tests.dist import hybrid_common as hc
from tests.dist_utils import REPO, run_deepspeed

FAMILIES = ["bloom", "opt", "llama", "gpt_neox", "gpt2"]


def _forward(model, ids, mask):
    kwargs = {}
    pos = position_ids_for(model, mask)
    if pos is not None:
        kwargs["position_ids"] = pos
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask, use_cache=False, **kwargs).logits


# ------------------------------------------------------------------ gather plan

@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("lora", [False, True])
def test_plan_groups_cover_every_parameter_once(family, lora):
    model = hc.tiny_model(family, lora=lora)
    plan = GatherPlan.build(model)
    hf = unwrap_peft(model)
    fam = family_of(hf)
    n_blocks = len(resolve(hf, fam.blocks))
    names = [g.name for g in plan.groups]
    expected = ["embed"] + [f"block.{i}" for i in range(n_blocks)] + ["post"]
    if not plan.tied_head:
        expected.append("head")
    assert names == expected
    ids = [id(p) for g in plan.groups for p in g.tensors()]
    assert len(ids) == len(set(ids)) == len({id(p) for p in hf.parameters()})
    head = resolve(hf, fam.lm_head).weight
    owners = [g.name for g in plan.groups if any(p is head for p in g.tensors())]
    assert owners == (["embed"] if plan.tied_head else ["head"])
    lora_groups = {g.name for g in plan.groups for n, _ in g.params if "lora_" in n}
    assert lora_groups == ({f"block.{i}" for i in range(n_blocks)} if lora else set())


# ------------------------------------------------------------------- scheduler

def test_scheduler_accounts_leases_and_gathers():
    s = GatherScheduler()
    a = s.lease(60, "actor")
    with s.lease(500, "reward") as big:
        assert s.live_bytes == 560 and big.active
    assert s.live_bytes == 60 and not big.active
    a.release()
    a.release()                                                # a second release is a no-op
    assert s.live_bytes == 0
    s.record("actor", nbytes=1000, seconds=0.5)
    s.record("critic", nbytes=24, seconds=0.25, copy_seconds=0.1)
    st = s.stats
    assert st["bytes_total"] == 1024 and st["calls_total"] == 2 and st["peak_live_bytes"] == 560
    assert st["last"] == {"owner": "critic", "bytes": 24, "seconds": 0.25, "copy_seconds": 0.1}
    assert st["by_owner"]["actor"] == {"bytes": 1000, "seconds": 0.5, "calls": 1}
    popped = s.pop_stats()
    assert popped["gather/bytes"] == 1024 and popped["gather/calls"] == 2
    assert popped["gather/seconds"] == pytest.approx(0.75) and popped["gather/peak_live_bytes"] == 560
    assert s.pop_stats()["gather/bytes"] == 0 and s.stats["bytes_total"] == 1024


def test_get_scheduler_is_a_process_singleton():
    assert get_scheduler() is get_scheduler()


def test_actor_rejects_bad_flags():
    with pytest.raises(UserInputError, match="layered"):
        HybridActor(None, enable_hybrid_engine=True, mode="pinned", max_prompt_len=8, max_new_tokens=8)
    with pytest.raises(UserInputError, match="--tp_gather_partition_size"):
        HybridActor(None, enable_hybrid_engine=True, tp_gather_partition_size=0, max_prompt_len=8,
                    max_new_tokens=8)


def _bare_actor(use_fast_decode):
    """The attributes HybridActor._fast_generator reads, on an actor built without an engine
    (its choice between the fast decoder and HF generate does not involve DeepSpeed)."""
    actor = object.__new__(HybridActor)
    actor.use_fast_decode, actor.max_prompt_len, actor.max_new_tokens = use_fast_decode, 8, 8
    actor._fast, actor._fast_unavailable, actor._logged = None, False, set()
    actor.device = torch.device("cpu")
    return actor


def test_fast_decode_falls_back_only_for_a_stated_reason(monkeypatch):
    from transformers import AutoModelForCausalLM, BloomConfig

    from dschat.rollout import decode
    model = AutoModelForCausalLM.from_config(BloomConfig(vocab_size=64, hidden_size=16, n_layer=1, n_head=2))
    # CPU without an explicit choice: HF generate, with the reason logged once
    actor = _bare_actor(None)
    assert actor._fast_generator(model, "full", 4, 4) is None and actor._fast_unavailable
    # an unsupported model: HF generate, with its reason
    monkeypatch.setattr(decode, "fast_decode_unsupported_reason", lambda m, max_total_len=None: "no such family")
    actor = _bare_actor(True)
    assert actor._fast_generator(model, "full", 4, 4) is None and "fast" in actor._logged
    # a bug inside the fast path raises; it does not turn into a quiet fall-back
    monkeypatch.setattr(decode, "fast_decode_unsupported_reason", lambda m, max_total_len=None: None)

    def broken(*args, **kwargs):
        raise RuntimeError("a bug in the decoder")
    monkeypatch.setattr(decode, "FastGenerator", broken)
    with pytest.raises(RuntimeError, match="a bug in the decoder"):
        _bare_actor(True)._fast_generator(model, "full", 4, 4)


# -------------------------------------------------------------------- replicas

@pytest.mark.parametrize("family", ["bloom", "gpt2", "llama"])
def test_replica_merges_lora_in_place_and_keeps_addresses(family):
    model = hc.tiny_model(family, lora=True).eval()
    trained = {n: p.detach().clone() for n, p in model.named_parameters()}
    ref = hc.reference_of(model)
    replica = build_replica(model, torch.float32, "cpu")
    assert not replica.training and not any(p.requires_grad for p in replica.parameters())
    assert type(replica) is type(ref) and not hasattr(replica, "peft_config")
    fam = family_of(replica)
    tied = resolve(replica, fam.lm_head).weight is resolve(replica, fam.embed_tokens).weight
    assert tied == (family != "llama")
    fill_replica(model, replica, scheduler=GatherScheduler())
    ptrs = [p.data_ptr() for p in replica.parameters()]
    ids, mask = hc.prompts(0)
    assert torch.equal(_forward(replica, ids, mask), _forward(ref, ids, mask))
    assert torch.equal(hc.hf_generate(replica, ids, mask, max_new_tokens=6),
                       hc.hf_generate(ref, ids, mask, max_new_tokens=6))
    with torch.no_grad():                                     # "a step": change a LoRA B
        next(p for n, p in model.named_parameters() if "lora_B" in n).add_(0.5)
    fill_replica(model, replica, scheduler=GatherScheduler())
    assert [p.data_ptr() for p in replica.parameters()] == ptrs
    assert torch.equal(_forward(replica, ids, mask), _forward(hc.reference_of(model), ids, mask))
    changed = [n for n, p in model.named_parameters() if not torch.equal(p, trained[n])]
    assert len(changed) == 1 and "lora_B" in changed[0]       # the fill never wrote the trained tensors
    release_replica(replica)
    assert all(p.numel() == 0 for p in replica.parameters())


@pytest.mark.parametrize("family", ["opt", "gpt_neox"])
def test_layered_skeleton_generates_like_hf(family):
    model = hc.tiny_model(family).eval()
    sched = GatherScheduler()
    layered = LayeredReplica(model, group_size=2, dtype=torch.float32, device="cpu", scheduler=sched)
    layered.fill()
    blocks = resolve(model, family_of(model).blocks)
    block_bytes = sum(p.numel() * p.element_size() for p in blocks[0].parameters())
    assert layered.slot_nbytes == 2 * block_bytes            # 3 blocks share a 2-block slot
    ids, mask = hc.prompts(1)
    with layered.session() as skeleton:
        got = hc.hf_generate(skeleton, ids, mask, max_new_tokens=6)
    assert torch.equal(got, hc.hf_generate(model, ids, mask, max_new_tokens=6))
    assert layered.block_gathers > 2                          # chunks reloaded every token
    layered.close()


# ------------------------------------------------------------ multi-rank (gloo)

def _load(out: Path) -> list[dict]:
    return [json.loads(Path(f"{out}.rank{r}.json").read_text()) for r in range(2)]


def test_zero3_families_lora_full_layered_hooks(tmp_path):
    """2 ranks, ZeRO-3 (persistence 0), bloom(6 heads)/opt/llama/gpt_neox/gpt2 x LoRA."""
    out = tmp_path / "families"
    run_deepspeed(REPO / "tests" / "dist" / "hybrid_families.py", ["--out", out], timeout=420)
    for rank, result in enumerate(_load(out)):
        assert result["world_size"] == 2
        assert len(result["cases"]) == 10
        for c in result["cases"]:
            tag = f"rank{rank} {c['family']} lora={c['lora']}"
            assert "error" not in c, c.get("error")
            assert c["partitioned"] and c["paths"] == {"full": "full", "layered": "layered", "off": "hooks"}, tag
            assert c["fast_used"], tag        # every registry family has a fast decode block
            for mode in ("full", "layered", "off", "fast"):
                assert c[f"equal_{mode}"], f"{tag}: {mode} != HF generate"
                assert c["eos_stop"][mode], f"{tag}: {mode} with ranks stopping at different steps"
                assert c[f"after_step_equal_{mode}"], f"{tag}: {mode} after step != HF on new weights"
            assert c["hybrid_on_equals_off"], tag
            assert c["logprob_shift_after_step"] > 1e-3, tag
            assert all(c[f"after_step_changed_{m}"] for m in ("full", "layered", "off", "fast")), tag
            # vs the live module: unmerged LoRA (x@W + s*(x@A)@B) rounds differently from W + s*B@A
            for key, tol in (("logprob_full_vs_live", 1e-4), ("logprob_layered_vs_live", 1e-4),
                             ("logprob_full_vs_ref", 1e-5), ("logprob_full_vs_ref_after_step", 1e-5)):
                assert c[key] < tol, f"{tag}: {key}={c[key]}"
            # the trainer's fused-output-layer scoring; the live module's unmerged LoRA as above
            for mode, tol in (("full", 1e-5), ("layered", 1e-5), ("off", 1e-4)):
                assert c[f"fused_active_{mode}"] and c[f"logprob_fused_{mode}_vs_ref"] < tol, (tag, mode)
            assert c["full_fill_bytes"] == c["plan_bytes"], tag
            assert c["full_peak_live"] == c["max_pair_bytes"], tag   # next group's gather overlapped
            assert c["full_fills_before_step"] == 1, tag       # log-probs reused the replica
            assert c["layered_slot_bytes"] == 2 * c["block_bytes"], tag
            assert c["layered_peak_live"] <= max(2 * c["src_block_bytes"], c["max_static_group_bytes"]), tag
            for key in ("left_after_generate", "left_after_scoring", "left_after_step_generate", "left_final"):
                assert c[key] == [], f"{tag}: {key}"
            assert c["loss1_finite"], tag
            # replica fills read the shards straight, except groups that merge a LoRA delta
            assert c["direct_equals_deepspeed_fill"], tag
            assert c["fill_gathers"]["direct"] > 0, tag
            assert (c["fill_gathers"]["deepspeed"] > 0) == c["lora"], (tag, c["fill_gathers"])
        padded = result["padded_shards"]
        assert padded["padded"] > 0 and padded["persistent"] > 0, padded
        assert padded["full_equal"] and padded["layered_equal"] and padded["full_equals_source"], padded


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_refill_on_cuda():
    """World size 1 on a GPU (NCCL): after each of two optimizer steps the refilled replica
    (fp32, and bf16 by the cast; full and layered) equals the gathered params, straight from
    the shards (no all-gather at world size 1) and through DeepSpeed's fetch."""
    proc = run_deepspeed(REPO / "tests" / "dist" / "refill_cuda.py", num_gpus=1, timeout=300, check=False)
    report = [line for line in proc.stdout.splitlines() if "REFILL_CUDA" in line]
    assert proc.returncode == 0 and report, proc.stdout[-4000:] + proc.stderr[-4000:]


def test_zero_stages_offload_gathered_layered(tmp_path):
    """ZeRO 0/2 (alias, LoRA copy), ZeRO-3 param offload, bf16 replica, sampling,
    --release_inference_cache, gathered() on a frozen engine, a layered actor's peak."""
    out = tmp_path / "stages"
    run_deepspeed(REPO / "tests" / "dist" / "hybrid_stages.py", ["--out", out], timeout=300)
    for rank, r in enumerate(_load(out)):
        for name, path in (("stage0", "alias"), ("stage2", "alias"), ("stage2_lora", "full")):
            c = r[name]
            assert c["path"] == path, (rank, name)
            assert c["equal"] and c["equal_off"] and c["after_step_equal"] and c["after_step_changed"], (rank, c)
            assert c["gathered_bytes"] == 0 and c["module_training_restored"], (rank, c)
        o = r["offload"]
        assert "cpu" in o["offload_param"], o
        for key in ("equal_full", "equal_layered", "equal_off", "equal_bf16_replica", "sample_paths_agree",
                    "sample_differs_from_greedy", "default_generator_advances", "global_rng_untouched",
                    "released_on_train", "after_step_equal_full", "after_step_equal_layered",
                    "after_step_equal_off", "loss1_finite"):
            assert o[key], (rank, key, o)
        assert o["bf16_replica_dtype"] == "torch.bfloat16"
        assert o["left_before_step"] == [] and o["left_final"] == []
        g = r["gathered"]
        assert g["all_available_inside"] and g["still_available_after_forward"], g
        assert g["gathered_vs_ref"] < 1e-5 and g["hooks_vs_ref"] < 1e-5, g
        assert g["gathered_bytes"] == g["plan_bytes"]
        assert g["left_after_gathered"] == [] and g["left_after_hooks"] == []
        assert g["persistent_params"] > 0 and g["persistent_full_equal"], g
        assert g["layered_equal"] and 0 < g["layered_peak"] <= g["max_group_bytes"], g
        assert g["left_after_layered"] == [] and g["loss_finite"], g


def test_zero3_one_rank_replica_is_views_of_the_shards(tmp_path):
    """ZeRO-3 on one rank: the actor's replica is views of its shards (no copy, no gather),
    equal to HF before and after optimizer steps (Bloom; LLaMA through the fast decoder,
    whose fused projections are rebuilt; OPT with every parameter persistent); a copied
    replica where views cannot serve (LoRA, another dtype, offloaded parameters)."""
    out = tmp_path / "shards"
    run_deepspeed(REPO / "tests" / "dist" / "hybrid_shards.py", ["--out", out], num_gpus=1, timeout=300)
    r = json.loads(Path(f"{out}.rank0.json").read_text())
    assert r["world_size"] == 1
    for name in ("bloom", "llama_fast", "opt_persistent"):
        c = r[name]
        assert c["path"] == "shards" and c["copied_path"] == "full", (name, c)
        assert c["all_params_are_shards"] and not c["copied_params_are_shards"], (name, c)
        assert c["equal"] and c["after_step_equal"] and c["after_step_equal_copied"], (name, c)
        assert c["after_step_changed"] and c["same_replica_after_steps"], (name, c)
        assert c["log_probs_diff"] < 1e-5, (name, c)
        assert c["builds"] == 1 and c["gathered_bytes"] == 0 and c["left_gathered"] == [], (name, c)
    assert r["llama_fast"]["fast_used"]
    f = r["fallback"]
    assert f["lora_path"] == f["bf16_path"] == f["offload_path"] == "full" and f["lora_equal"], f

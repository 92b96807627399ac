"""Inference tensor parallelism (`--inference_tp_size`, dschat/rollout/tensor_parallel.py).

Single-process tests: the registry's TP layout on real HF modules, the slicing (whole
heads, uneven MLP/vocab parts that reassemble the full tensor), the size errors, and the
TP decode math in a group of one (token-identical to HF generate). Two multi-rank
launches (tests/dist/tp_generate.py) run ZeRO-3 engines on 2 and 4 CPU ranks: TP 2 and
TP 4, greedy tokens identical to HF generate per rank, log-probs, refill after a step,
memory of the sliced replica vs the full one.
"""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from dschat.registry import family_of, position_ids_for, resolve, tp_head_counts
from dschat.rollout.gather import GatherScheduler
from dschat.rollout.tensor_parallel import TPInference, cut_table, tp_size_problems, vocab_bounds
from tests.dist import hybrid_common as hc
from tests.dist_utils import REPO, run_deepspeed

TP_FAMILIES = ["bloom", "opt", "llama", "gpt_neox"]


# ------------------------------------------------------------------ layout

@pytest.mark.parametrize("family", TP_FAMILIES)
def test_registry_tp_layout_resolves_to_linears(family):
    model = hc.tiny_model(family)
    fam = family_of(model)
    block = resolve(model, fam.blocks)[0]
    heads, kv = tp_head_counts(model.config)
    assert heads == model.config.num_attention_heads
    assert kv == (model.config.num_key_value_heads if family == "llama" else heads)
    for path, unit in fam.tp_column + fam.tp_row:
        assert isinstance(resolve(block, path), nn.Linear), path
        assert unit in ("heads", "kv_heads", "ffn"), path
    assert fam.tp_qkv_layout == ("per_head" if family in ("bloom", "gpt_neox") else "separate")
    assert not family_of(hc.tiny_model("gpt2")).tp_column


@pytest.mark.parametrize("family,size", [("bloom", 2), ("bloom", 3), ("llama", 2), ("opt", 4)])
def test_slices_are_whole_heads_and_reassemble(family, size):
    """Every rank's cut, concatenated in rank order, is the whole tensor; QKV cuts hold whole
    heads (Bloom: [heads, 3, head_dim] rows), MLP and vocab parts may be uneven."""
    model = hc.tiny_model(family)
    params = dict(model.named_parameters())
    tables = [cut_table(model, size, r) for r in range(size)]
    assert tables[0].keys() == tables[-1].keys() and tables[0]
    for name, cut0 in tables[0].items():
        full = params[name]
        parts = [t[name].apply(full) for t in tables]
        assert torch.equal(torch.cat(parts, dim=cut0.dim), full), name
    fam = family_of(model)
    heads, kv = tp_head_counts(model.config)
    if family == "bloom":                            # 6 heads over 3 ranks: 2 whole heads each
        name = f"{fam.blocks}.0.self_attention.query_key_value.weight"
        D = model.config.hidden_size // heads
        per_head = params[name].view(heads, 3 * D, -1)
        for r, t in enumerate(tables):
            h = heads // size
            assert torch.equal(t[name].apply(params[name]), per_head[r * h:(r + 1) * h].reshape(-1, per_head.shape[-1]))
    if family == "llama":                            # GQA: K/V cut by KV heads
        k = f"{fam.blocks}.0.self_attn.k_proj.weight"
        assert tables[1][k].stop - tables[1][k].start == params[k].shape[0] // size
    assert vocab_bounds(250, 4, 3) == (189, 250) and vocab_bounds(5, 4, 3) == (5, 5)


def test_size_problems_name_the_flag_and_numbers():
    import transformers as T
    bloom6 = T.BloomConfig(vocab_size=64, hidden_size=48, n_layer=1, n_head=6)
    llama = T.LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=1,
                          num_attention_heads=8, num_key_value_heads=2)
    assert tp_size_problems(3, 4) == ["--inference_tp_size 3 does not divide world size 4"]
    assert tp_size_problems(2, 4, bloom6) == [] and tp_size_problems(1, 3, bloom6) == []
    assert tp_size_problems(4, 4, bloom6) == [
        "--inference_tp_size 4 does not divide the actor's attention head count 6 (bloom config n_head=6)"]
    (msg,) = tp_size_problems(4, 8, llama)
    assert "key/value head count 2" in msg and "num_key_value_heads=2" in msg
    assert "needs --enable_hybrid_engine" in tp_size_problems(2, 2, bloom6, hybrid=False)[0]
    assert "no tensor-parallel layout" in tp_size_problems(2, 2, hc.tiny_config("gpt2"))[0]
    assert "must be >= 1" in tp_size_problems(0, 2)[0]


def _step3_problems(argv, world: int, monkeypatch) -> list[str]:
    spec = importlib.util.spec_from_file_location("step3_main", REPO / "training" / "step3_rlhf_finetuning" / "main.py")
    main = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(main)
    from dschat.cli.validate import step3_problems
    monkeypatch.setenv("WORLD_SIZE", str(world))
    return step3_problems(main.parse_args(argv))


def test_step3_validation_reads_the_actor_config(tmp_path, monkeypatch):
    base = ["--critic_model_name_or_path", str(tmp_path), "--output_dir", str(tmp_path / "o"), "--enable_hybrid_engine"]
    six = ["--actor_model_name_or_path", str(REPO / "configs" / "tiny" / "bloom-6heads.json")]
    got = _step3_problems(six + base + ["--inference_tp_size", "3"], 4, monkeypatch)
    assert "--inference_tp_size 3 does not divide world size 4" in got
    got = _step3_problems(six + base + ["--inference_tp_size", "4"], 4, monkeypatch)
    assert any("attention head count 6" in p for p in got), got
    got = _step3_problems(six + base + ["--inference_tp_size", "2"], 4, monkeypatch)
    assert not any("inference_tp_size" in p for p in got), got          # no "not implemented" refusal


# --------------------------------------------------------- decode, group of one

@pytest.mark.parametrize("family,lora", [("bloom", False), ("opt", False), ("llama", False), ("gpt_neox", True)])
def test_tp_math_in_a_group_of_one_matches_hf(family, lora):
    """The TP decode path (embedding/head vocab-parallel code, static KV cache, per-row eos)
    without collectives: HF-identical tokens, logits within fp32 rounding."""
    model = hc.tiny_model(family, lora=lora).eval()
    ref = hc.reference_of(model)
    tp = TPInference(model, tp_size=1, device="cpu", scheduler=GatherScheduler())
    tp.fill()
    ids, mask = hc.prompts(0, batch=4)
    for eos in (hc.EOS, int(hc.hf_generate(ref, ids, mask, max_new_tokens=6, eos=None)[1, ids.shape[1] + 2])):
        want = hc.hf_generate(ref, ids, mask, max_new_tokens=6, eos=eos)
        assert torch.equal(tp.generate(ids, mask, max_new_tokens=6, eos_token_id=eos, pad_token_id=hc.PAD), want)
    kwargs = {}
    pos = position_ids_for(ref, mask)
    if pos is not None:
        kwargs["position_ids"] = pos
    with torch.no_grad():
        want_logits = ref(input_ids=ids, attention_mask=mask, **kwargs).logits
    got = tp.logits(ids, mask)
    assert (got - want_logits)[mask.bool()].abs().max() < 1e-4
    assert tp.replica.nbytes == tp.replica.full_nbytes                  # nothing to split at size 1
    tp.release()


# ------------------------------------------------------------ multi-rank (gloo)

def _load(out: Path, world: int) -> list[dict]:
    return [json.loads(Path(f"{out}.rank{r}.json").read_text()) for r in range(world)]


def _check_ranks(results: list[dict], world: int, n_cases: int) -> None:
    for rank, r in enumerate(results):
        assert r["world_size"] == world and len(r["cases"]) == n_cases
        for c in r["cases"]:
            tag = f"rank{rank} {c['family']} tp={c['tp']} lora={c['lora']}"
            assert "error" not in c, c.get("error")
            assert c["partitioned"] and c["path"] == "tp", tag
            assert c["equal"], f"{tag}: TP generate != HF generate {c['shape']}"
            assert c["eos_stop"]["equal"], f"{tag}: own eos, ranks stopping at different steps"
            assert c["after_step_equal"], f"{tag}: after an optimizer step"
            assert c["logprob_vs_ref"] < 1e-4 and c["logprob_vs_ref_after_step"] < 1e-4, tag
            assert c["logprob_shift_after_step"] > 1e-3, tag
            assert c["fills_before_step"] == 1 and c["refills_after_step"] == 1, tag
            assert c["sample_ok"] and c["loss_finite"], tag
            assert c["left_after_generate"] == [] and c["left_final"] == [], tag
            m = c["memory"]
            # the slice of every block is 1/TP of it (norms and row-parallel biases replicated)
            assert m["block_bytes"] <= m["full_block_bytes"] / c["tp"] * 1.04, (tag, m)
            assert m["replica_bytes"] <= m["full_replica_bytes"] / c["tp"] * 1.25, (tag, m)
            # gathered group by group: never the full model at once, all of it once per fill
            assert m["peak_gathered_bytes"] == c["max_unit_bytes"] < c["plan_bytes"], (tag, m)
            assert c["fill_bytes"] == c["plan_bytes"], tag
        errors = r["errors"]
        assert "does not divide world size" in errors["world"], errors
        assert "attention head count" in errors["heads"], errors
        assert "key/value head count" in errors["kv_heads"], errors


def test_tp2_on_two_ranks_zero3(tmp_path):
    """2 ranks, TP 2: bloom (6 heads, +LoRA), opt, llama (GQA, +LoRA), gpt_neox (parallel
    and sequential residual)."""
    out = tmp_path / "tp2"
    run_deepspeed(REPO / "tests" / "dist" / "tp_generate.py", ["--out", out], num_gpus=2, timeout=400)
    _check_ranks(_load(out, 2), 2, 7)


def test_tp2_and_tp4_on_four_ranks_zero3(tmp_path):
    """4 ranks, TP 2 (two groups) and TP 4: bloom (12 heads), opt, llama (8 heads / 4 KV
    heads, 90 MLP channels and a 250-token vocab: uneven parts at TP 4)."""
    out = tmp_path / "tp4"
    run_deepspeed(REPO / "tests" / "dist" / "tp_generate.py", ["--out", out], num_gpus=4, timeout=500)
    _check_ranks(_load(out, 4), 4, 6)

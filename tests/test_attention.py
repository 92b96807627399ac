"""Bloom's fused attention (dschat/utils/attention.py) against HF's eager code, fp32 on CPU."""
import copy

import pytest
import torch
from transformers import AutoModelForCausalLM, BloomConfig, LlamaConfig

from dschat.utils.attention import use_attention

# bloom-560m's head shape (16 heads of 64), two layers
CONFIG = dict(vocab_size=512, hidden_size=1024, n_layer=2, n_head=16, hidden_dropout=0.0, attention_dropout=0.0)


def _pair(**overrides):
    torch.manual_seed(0)
    eager = AutoModelForCausalLM.from_config(BloomConfig(**{**CONFIG, **overrides}), dtype=torch.float32)
    fused = copy.deepcopy(eager)
    assert use_attention(fused, "sdpa").startswith("sdpa")
    return eager, fused


def _batch(seed: int, batch: int = 3, length: int = 48):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 512, (batch, length), generator=g)
    mask = torch.ones_like(ids)
    for row in range(1, batch):  # left padding of different lengths, as the prompts of step 3
        mask[row, : 5 * row + seed % 4] = 0
    return ids, mask


def _loss_and_grads(model, ids, mask):
    model.zero_grad(set_to_none=True)
    logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
    loss = (logits.log_softmax(-1)[..., 0] * mask).sum() / mask.sum()  # padded positions excluded
    loss.backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _assert_close_where_attended(a, b, mask, tol):
    keep = mask.bool()
    scale = a[keep].abs().max()
    assert (a[keep] - b[keep]).abs().max() <= tol * scale


@pytest.mark.parametrize("checkpointing", [False, True])
def test_fused_bloom_attention_equals_eager_values_and_gradients(checkpointing):
    eager, fused = _pair()
    for m in (eager, fused):
        m.train()
        if checkpointing:
            m.gradient_checkpointing_enable()
    # two batches with different padding in turn: the shared bias must follow the mask
    for seed in (1, 2):
        ids, mask = _batch(seed)
        (le, ge), (lf, gf) = _loss_and_grads(eager, ids, mask), _loss_and_grads(fused, ids, mask)
        _assert_close_where_attended(le, lf, mask, 1e-5)
        for name in ge:
            err = (ge[name] - gf[name]).abs().max() / ge[name].abs().max().clamp_min(1e-12)
            assert err <= 1e-5, (name, err.item())


def test_fused_bloom_attention_without_mask_and_in_cached_generation():
    eager, fused = _pair()
    ids, mask = _batch(3)
    with torch.no_grad():
        a, b = eager(input_ids=ids).logits, fused(input_ids=ids).logits  # no mask: causal only
    _assert_close_where_attended(a, b, torch.ones_like(ids), 1e-5)
    # HF generate with its KV cache: a growing key length against one new query per step
    out = [m.generate(input_ids=ids, attention_mask=mask, max_new_tokens=12, do_sample=False,
                      pad_token_id=0, eos_token_id=None) for m in (eager, fused)]
    assert torch.equal(out[0], out[1])


def _square_saves(model, ids, mask, length):
    """Storages of [.., length, length] tensors autograd keeps for backward."""
    seen = set()

    def pack(t):
        if t.dim() >= 2 and t.shape[-2:] == (length, length):
            seen.add(t.untyped_storage().data_ptr())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(input_ids=ids, attention_mask=mask, use_cache=False).logits.sum().backward()
    return len(seen)


def test_fused_bloom_attention_keeps_no_probabilities_for_backward():
    eager, fused = _pair(n_layer=3)
    ids, mask = _batch(4, length=40)
    for m in (eager, fused):
        m.train()
    # eager keeps each layer's probabilities; ours at most the bias, one tensor for all layers
    assert _square_saves(eager, ids, mask, 40) >= 3
    assert _square_saves(fused, ids, mask, 40) <= 1


def test_eager_choice_and_other_families():
    torch.manual_seed(0)
    bloom = AutoModelForCausalLM.from_config(BloomConfig(**CONFIG))
    assert use_attention(bloom, "eager").startswith("eager")
    assert "forward" not in vars(bloom.transformer.h[0].self_attention)  # HF's own code left in place
    llama = AutoModelForCausalLM.from_config(
        LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                    num_attention_heads=4, num_key_value_heads=2), attn_implementation="eager")
    assert use_attention(llama, "sdpa") == "eager"  # other families: transformers' own choice, untouched
    with pytest.raises(ValueError, match="one of"):
        use_attention(bloom, "flash")


def test_inference_replica_keeps_the_fused_attention():
    """The hybrid engine's replica (step 3's actor scoring) runs the attention the actor runs."""
    from dschat.rollout.gather import build_replica, fill_replica
    from dschat.utils.attention import attention_of

    eager, fused = _pair()
    for source in (eager, fused):
        replica = build_replica(source, dtype=torch.float32, device=torch.device("cpu"))
        fill_replica(source, replica)
        assert attention_of(replica) == attention_of(source)
        ids, mask = _batch(5)
        with torch.no_grad():
            a = source(input_ids=ids, attention_mask=mask).logits
            b = replica(input_ids=ids, attention_mask=mask).logits
        _assert_close_where_attended(a, b, mask, 1e-6)

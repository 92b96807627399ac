"""--checkpoint_every_n_layers: activation checkpointing of only every N-th transformer block
(dschat.models.model_utils.enable_activation_checkpointing), on real HF models."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, BloomConfig, LlamaConfig

from dschat.models.model_utils import enable_activation_checkpointing
from dschat.models.reward_model import RewardModel


def _saved_bytes(model, ids) -> tuple[int, dict]:
    """Bytes of activations autograd keeps for backward (the weights left out), and the grads."""
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in weights:
            seen[ptr] = t.untyped_storage().nbytes()
        return t

    model.zero_grad()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(input_ids=ids, use_cache=False).logits
    out.float().pow(2).mean().backward()
    return sum(seen.values()), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("config", [
    BloomConfig(vocab_size=128, hidden_size=64, n_layer=6, n_head=4),
    LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                num_attention_heads=4, num_key_value_heads=2)], ids=["bloom", "llama"])
def test_every_n_layers_recomputes_those_blocks_only_with_the_same_gradients(config):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).train()
    ids = torch.randint(0, 128, (2, 24))
    plain, grads = _saved_bytes(model, ids)
    kept = {}
    for n in (1, 2, 3):
        assert enable_activation_checkpointing(model, n) == len(range(0, 6, n))    # blocks 0, n, 2n, ...
        kept[n], got = _saved_bytes(model, ids)
        for name, g in grads.items():
            torch.testing.assert_close(got[name], g, rtol=1e-5, atol=1e-6, msg=name)
    # every block recomputed keeps least; every other block about half of what checkpointing saves
    assert kept[1] < kept[2] < kept[3] < plain, kept
    saved = plain - kept[1]
    assert 0.3 * saved < plain - kept[2] < 0.7 * saved, (plain, kept)


def test_the_reward_models_blocks_and_a_bad_n():
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(BloomConfig(vocab_size=128, hidden_size=64, n_layer=4, n_head=4))
    critic = RewardModel(base.transformer, pad_token_id=0)
    assert enable_activation_checkpointing(critic, 2) == 2
    assert [b.gradient_checkpointing for b in critic.rwtransformer.h] == [True, False, True, False]
    with pytest.raises(ValueError, match="every_n_layers"):
        enable_activation_checkpointing(critic, 0)


def _loss_and_grads(model, ids, mask):
    model.zero_grad()
    out = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
    out.float().pow(2).mean().backward()
    return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("config", [
    BloomConfig(vocab_size=128, hidden_size=64, n_layer=3, n_head=4),
    LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                num_attention_heads=4, num_key_value_heads=2)], ids=["bloom", "llama"])
def test_compiled_blocks_give_eagers_values_and_gradients(config):
    """--compile_blocks (torch.compile of each block's own forward inside HF's checkpointing;
    Bloom with our fused attention, whose shared bias stays eager): the logits and every
    gradient of eager blocks in fp32, checkpointed or not, at two sequence shapes; no-grad
    calls (scoring, generation) run the eager blocks, and a deep copy's blocks are its own."""
    import copy

    from dschat.models.model_utils import compile_blocks
    from dschat.utils.attention import use_attention
    torch.manual_seed(0)
    eager = AutoModelForCausalLM.from_config(config).train()
    use_attention(eager, "sdpa")
    compiled = copy.deepcopy(eager)
    assert compile_blocks(compiled) == 3
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    ids = torch.randint(0, 128, (2, 24))
    mask = torch.ones_like(ids)
    mask[0, :5] = 0                                   # a left-padded row
    for every_n in (1, None):                         # checkpointed, then not
        for model in (eager, compiled):
            if every_n:
                enable_activation_checkpointing(model, every_n)
            else:
                model.gradient_checkpointing_disable()
        for batch in ((ids, mask), (ids[:, 4:], mask[:, 4:])):
            want, got = _loss_and_grads(eager, *batch), _loss_and_grads(compiled, *batch)
            torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)
            for name, g in want[1].items():
                torch.testing.assert_close(got[1][name], g, rtol=1e-4, atol=1e-6, msg=name)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 1     # the blocks ran compiled
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    blocks = [m for m in compiled.modules() if hasattr(m, "_dschat_compiled")]
    copied = copy.deepcopy(compiled)
    assert all(b.forward.__self__ is b for b in blocks)
    assert all(b.forward.__self__ is b for b in copied.modules() if hasattr(b, "_dschat_compiled"))
    with torch.no_grad():
        torch.testing.assert_close(copied(input_ids=ids, attention_mask=mask).logits,
                                   eager(input_ids=ids, attention_mask=mask).logits, rtol=1e-5, atol=1e-5)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs  # no-grad calls: nothing compiled

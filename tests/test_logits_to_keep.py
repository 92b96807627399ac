"""Step 3 runs the LM head on the answer-predicting columns only (`logits_to_keep`)."""
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from dschat.models.lora import apply_lora
from dschat.rlhf import ppo_math as pm
from dschat.rlhf.trainer import _answer_logits
from dschat.rollout.hybrid import logits_to_keep_kwargs

TINY = {
    "bloom": dict(vocab_size=64, hidden_size=16, n_layer=2, n_head=2),
    "opt": dict(vocab_size=64, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, ffn_dim=32,
                word_embed_proj_dim=16, max_position_embeddings=64),
    "llama": dict(vocab_size=64, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32),
    "gpt_neox": dict(vocab_size=64, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                     intermediate_size=32),
    "gpt2": dict(vocab_size=64, n_embd=16, n_layer=2, n_head=2),
}


@pytest.mark.parametrize("lora", [False, True])
@pytest.mark.parametrize("family", sorted(TINY))
def test_answer_log_probs_from_kept_columns_equal_full_logits(family, lora):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(family, **TINY[family])).eval()
    if lora:
        model = apply_lora(model, 4, None, False)
    P, A = 7, 5
    seq = torch.randint(1, 64, (3, P + A))
    mask = torch.ones_like(seq)
    mask[1, :3] = 0                                 # a left-padded prompt
    keep = logits_to_keep_kwargs(model, A + 1)
    assert keep == {"logits_to_keep": A + 1}, f"{family}: forward takes no logits_to_keep"
    with torch.no_grad():
        full = model(input_ids=seq, attention_mask=mask).logits
        kept = model(input_ids=seq, attention_mask=mask, **keep).logits
    assert kept.shape[1] == A + 1
    want = pm.gather_log_probs(pm.answer_slice(full, P), pm.answer_tokens(seq, P))
    got = pm.gather_log_probs(_answer_logits(kept, seq, P), pm.answer_tokens(seq, P))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert logits_to_keep_kwargs(model, 0) == {}

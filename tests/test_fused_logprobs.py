"""The fused output layer + log-softmax (dschat.utils.linear_logprobs, dschat.models.fused_head)
against the plain computation: values and gradients within 1e-6 in fp32, on bare tensors and
through real HF models (tied and untied output layers, logits_to_keep)."""
import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM, OPTConfig, OPTForCausalLM

from dschat.models.fused_head import FusedLogprobs, fused_head_unsupported_reason
from dschat.utils.linear_logprobs import linear_logprobs, rows_per_chunk
from dschat.utils.tensor_ops import gather_log_probs


@pytest.mark.parametrize("chunk, vocab_chunk, with_bias", [(1, 1, False), (7, 10, True), (64, 97, False),
                                                           (1000, None, True), (5, 96, True)])
def test_values_and_gradients_equal_the_plain_computation(chunk, vocab_chunk, with_bias):
    torch.manual_seed(0)
    hidden = torch.randn(3, 21, 16, dtype=torch.float64).float().requires_grad_()
    weight = (0.3 * torch.randn(97, 16)).requires_grad_()   # logits of a trained model's scale (std ~1)
    bias = torch.randn(97).requires_grad_() if with_bias else None
    labels = torch.randint(0, 97, (3, 21))
    upstream = torch.randn(3, 21)

    logits = F.linear(hidden, weight, bias)
    plain = gather_log_probs(logits, labels)
    plain_entropy = torch.logsumexp(logits, -1) - (logits.softmax(-1) * logits).sum(-1)
    inputs = [hidden, weight] + ([bias] if with_bias else [])
    plain_grads = torch.autograd.grad((plain * upstream).sum(), inputs)

    fused, entropy = linear_logprobs(hidden, weight, bias, labels, chunk, vocab_chunk)
    fused_grads = torch.autograd.grad((fused * upstream).sum(), inputs)
    assert fused.dtype == torch.float32 and fused.shape == (3, 21) and not entropy.requires_grad
    torch.testing.assert_close(fused, plain, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(entropy, plain_entropy.detach(), atol=1e-5, rtol=0)
    for got, want in zip(fused_grads, plain_grads):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    # without the entropy (scoring passes): the same log-probs and gradients, no entropy
    bare, none = linear_logprobs(hidden, weight, bias, labels, chunk, vocab_chunk, with_entropy=False)
    assert none is None and torch.equal(bare, fused)
    for got, want in zip(torch.autograd.grad((bare * upstream).sum(), inputs), fused_grads):
        assert torch.equal(got, want)


def test_bf16_gradients_match_the_plain_bf16_computation():
    """In bf16 each block of the weight's gradient is one product over all tokens rounded to
    bf16, as the plain computation's; the hidden states' gradient sums the blocks' bf16
    products in fp32. Both stay within bf16 rounding of the fp32 gradient, and the gradients
    come back in the inputs' dtype (no fp32 copy of the weight's)."""
    torch.manual_seed(0)
    hidden32 = torch.randn(4, 50, 32)
    weight32 = 0.3 * torch.randn(211, 32)
    labels = torch.randint(0, 211, (4, 50))
    upstream = torch.randn(4, 50)

    def grads(dtype, fused):
        h = hidden32.to(dtype).requires_grad_()
        w = weight32.to(dtype).requires_grad_()
        lp = linear_logprobs(h, w, None, labels, 16, 50)[0] if fused else gather_log_probs(F.linear(h, w), labels)
        out = torch.autograd.grad((lp * upstream).sum(), [h, w])
        assert all(g.dtype == dtype for g in out)
        return [g.float() for g in out]

    exact = grads(torch.float32, fused=False)
    for fused in (False, True):
        for got, want in zip(grads(torch.bfloat16, fused), exact):
            err = (got - want).norm() / want.norm()
            assert err < 2e-2, (fused, err)
    fused_bf16, plain_bf16 = grads(torch.bfloat16, True), grads(torch.bfloat16, False)
    for got, want in zip(fused_bf16, plain_bf16):
        torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)


def test_chunk_rows_follow_the_width():
    assert rows_per_chunk(49152) == 1365 and rows_per_chunk(250880) == 267 and rows_per_chunk(10 ** 12) == 1


def _llama(tied):
    torch.manual_seed(1)
    return LlamaForCausalLM(LlamaConfig(vocab_size=101, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2,
                                        tie_word_embeddings=tied)).float()


def _opt():
    torch.manual_seed(2)
    return OPTForCausalLM(OPTConfig(vocab_size=101, hidden_size=32, ffn_dim=64, num_hidden_layers=2,
                                    num_attention_heads=4, word_embed_proj_dim=32)).float()


@pytest.mark.parametrize("make", [lambda: _llama(True), lambda: _llama(False), _opt],
                         ids=["llama-tied", "llama", "opt"])
@pytest.mark.parametrize("keep", [0, 6])
def test_through_a_model_equals_its_logits_with_the_same_parameter_gradients(make, keep):
    model = make().eval()          # eval: no dropout, so both forwards are the same function
    seq = torch.randint(0, 101, (2, 12))
    mask = torch.ones_like(seq)
    mask[0, :3] = 0                                   # a left-padded row
    kwargs = {"logits_to_keep": keep} if keep else {}
    width = keep or seq.shape[1]

    logits = model(input_ids=seq, attention_mask=mask, **kwargs).logits
    plain = gather_log_probs(logits[:, :-1], seq[:, seq.shape[1] - width + 1:])
    plain.sum().backward()
    plain_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()

    with FusedLogprobs(model, seq, chunk=5) as head:
        out = model(input_ids=seq, attention_mask=mask, **kwargs).logits
    assert head.active and out.shape == (2, width)
    fused = out[:, :-1]
    fused.sum().backward()
    torch.testing.assert_close(fused, plain, atol=1e-6, rtol=1e-6)
    assert set(plain_grads) == {n for n, p in model.named_parameters() if p.grad is not None}
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, plain_grads[name], atol=1e-6, rtol=1e-5, msg=name)
    # the output layer is itself again afterwards
    assert "forward" not in model.get_output_embeddings().__dict__
    assert model(input_ids=seq).logits.shape == (2, 12, 101)


def test_unsupported_output_layers_say_why_and_stay_plain():
    model = _llama(False)
    assert fused_head_unsupported_reason(model) is None
    model.config.final_logit_softcapping = 30.0
    assert "final_logit_softcapping" in fused_head_unsupported_reason(model)
    with FusedLogprobs(model, torch.zeros(1, 4, dtype=torch.long)) as head:
        assert not head.active and "softcapping" in head.reason
    assert not FusedLogprobs(_llama(True), torch.zeros(1, 4, dtype=torch.long), enabled=False).active

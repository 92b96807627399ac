"""Log-probabilities of chosen tokens straight from hidden states, the output layer and the
log-softmax fused and run over chunks of tokens: the [tokens, vocabulary] logits exist one
chunk at a time, in forward and in backward (as Liger's fused linear cross-entropy does).

Plain torch, no model or distributed code. Numbers are those of the plain computation
(`F.linear` in the layer's dtype, then fp32 log-softmax, as `tensor_ops.gather_log_probs`):
the logits of a chunk are the same matmul rounded to the same dtype. The backward recomputes
each chunk's logits from the saved hidden states and the per-token logsumexp, so besides the
inputs only [tokens] fp32 vectors are kept.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

CHUNK_BYTES = 2 ** 28   # fp32 logits per chunk: 1,365 tokens at a 49k vocabulary, 267 at Bloom's 250k


def chunk_tokens(vocab_size: int, chunk_bytes: int = CHUNK_BYTES) -> int:
    return max(1, chunk_bytes // (4 * vocab_size))


class _LinearLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, bias: Optional[Tensor], labels: Tensor, chunk: int):
        n = hidden.shape[0]
        logprobs = torch.empty(n, dtype=torch.float32, device=hidden.device)
        entropy = torch.empty_like(logprobs)
        lse = torch.empty_like(logprobs)
        for s in range(0, n, chunk):
            logits = F.linear(hidden[s:s + chunk], weight, bias).float()
            lse[s:s + chunk] = torch.logsumexp(logits, dim=-1)
            logprobs[s:s + chunk] = logits.gather(-1, labels[s:s + chunk, None]).squeeze(-1) - lse[s:s + chunk]
            probs = torch.exp(logits - lse[s:s + chunk, None])
            entropy[s:s + chunk] = lse[s:s + chunk] - (probs * logits).sum(-1)
        ctx.save_for_backward(hidden, weight, bias, labels, lse)
        ctx.chunk = chunk
        ctx.mark_non_differentiable(entropy)
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs: Tensor, _grad_entropy):
        hidden, weight, bias, labels, lse = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        grad_b = torch.zeros(weight.shape[0], dtype=torch.float32, device=weight.device) \
            if need_b and bias is not None else None
        for s in range(0, hidden.shape[0], ctx.chunk):
            h = hidden[s:s + ctx.chunk]
            logits = F.linear(h, weight, bias).float()
            g = grad_logprobs[s:s + ctx.chunk].float()
            # d logprob / d logits = onehot(label) - softmax
            grad_logits = torch.exp(logits - lse[s:s + ctx.chunk, None]).mul_(-g[:, None])
            grad_logits.scatter_add_(-1, labels[s:s + ctx.chunk, None], g[:, None])
            grad_logits = grad_logits.to(hidden.dtype)   # as autograd hands it to the layer's matmul
            if need_h:
                grad_h[s:s + ctx.chunk] = grad_logits @ weight
            if need_w:
                # the chunk's product in the layer's dtype (tensor cores, fp32 accumulation inside
                # the GEMM), summed over chunks in fp32: an fp32 product here ran as a SIMT GEMM,
                # 43 ms of a 1.2 s bloom-560m PPO step on an H200
                grad_w += (grad_logits.t() @ h).float()
            if grad_b is not None:
                grad_b += grad_logits.float().sum(0)
        return (grad_h, None if grad_w is None else grad_w.to(weight.dtype),
                None if grad_b is None else grad_b.to(bias.dtype), None, None)


def linear_logprobs(hidden: Tensor, weight: Tensor, bias: Optional[Tensor], labels: Tensor,
                    chunk: Optional[int] = None) -> tuple[Tensor, Tensor]:
    """(log p(label), entropy) per token, both fp32 of shape ``hidden.shape[:-1]``, of the
    distribution ``softmax(hidden @ weight.T + bias)``; the entropy carries no gradient.

    hidden ``[..., H]``, weight ``[V, H]``, labels ``[...]`` valid ids; `chunk` tokens of
    logits at a time (default: about 256 MB of fp32 logits).
    """
    shape = hidden.shape[:-1]
    chunk = chunk or chunk_tokens(weight.shape[0])
    logprobs, entropy = _LinearLogprobs.apply(hidden.reshape(-1, hidden.shape[-1]), weight, bias,
                                              labels.reshape(-1).long(), chunk)
    return logprobs.view(shape), entropy.view(shape)

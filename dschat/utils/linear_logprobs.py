"""Log-probabilities of chosen tokens straight from hidden states, the output layer and the
log-softmax fused and run over chunks of tokens: the [tokens, vocabulary] logits exist one
chunk at a time, in forward and in backward (as Liger's fused linear cross-entropy does).

Plain torch, no model or distributed code. Numbers are those of the plain computation
(`F.linear` in the layer's dtype, then fp32 log-softmax, as `tensor_ops.gather_log_probs`):
the logits of a chunk are the same matmul rounded to the same dtype. The backward recomputes
the logits a block of vocabulary columns at a time from the saved hidden states and the
per-token logsumexp, so besides the inputs only [tokens] fp32 vectors are kept, and the
weight's gradient is written block by block in its own dtype.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

CHUNK_BYTES = 2 ** 28   # fp32 logits per chunk: 1,365 tokens at a 49k vocabulary, 267 at Bloom's 250k


def rows_per_chunk(width: int, chunk_bytes: int = CHUNK_BYTES) -> int:
    """Rows of a [rows, width] fp32 block within `chunk_bytes`: tokens of logits over the
    whole vocabulary (forward), vocabulary columns over every token (backward)."""
    return max(1, chunk_bytes // (4 * width))


class _LinearLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, bias: Optional[Tensor], labels: Tensor, chunk: int,
                vocab_chunk: int, with_entropy: bool):
        n = hidden.shape[0]
        logprobs = torch.empty(n, dtype=torch.float32, device=hidden.device)
        entropy = torch.empty(n if with_entropy else 0, dtype=torch.float32, device=hidden.device)
        lse = torch.empty_like(logprobs)
        for s in range(0, n, chunk):
            logits = F.linear(hidden[s:s + chunk], weight, bias).float()
            lse[s:s + chunk] = torch.logsumexp(logits, dim=-1)
            logprobs[s:s + chunk] = logits.gather(-1, labels[s:s + chunk, None]).squeeze(-1) - lse[s:s + chunk]
            if with_entropy:     # another pass over the chunk's logits: only where it is logged
                probs = torch.exp(logits - lse[s:s + chunk, None])
                entropy[s:s + chunk] = lse[s:s + chunk] - (probs * logits).sum(-1)
        ctx.save_for_backward(hidden, weight, bias, labels, lse)
        ctx.vocab_chunk = vocab_chunk
        ctx.mark_non_differentiable(entropy)
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs: Tensor, _grad_entropy):
        # over chunks of the vocabulary, every token at once: each weight-gradient row block is
        # one GEMM over all tokens written in the layer's dtype, as the plain backward's (no fp32
        # [V, H] accumulator: 3.8 GiB at bloom-7b1); the [N, H] hidden gradient sums in fp32
        hidden, weight, bias, labels, lse = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        grad_h = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device) if need_h else None
        grad_w = torch.empty_like(weight) if need_w else None
        grad_b = torch.empty_like(bias) if need_b and bias is not None else None
        g = grad_logprobs.float()
        for v in range(0, weight.shape[0], ctx.vocab_chunk):
            w = weight[v:v + ctx.vocab_chunk]
            logits = F.linear(hidden, w, None if bias is None else bias[v:v + ctx.vocab_chunk]).float()
            # d logprob / d logits = onehot(label) - softmax
            grad_logits = torch.exp(logits.sub_(lse[:, None])).mul_(-g[:, None])
            del logits
            inside = (labels >= v) & (labels < v + w.shape[0])
            grad_logits.scatter_add_(-1, (labels - v).clamp_(0, w.shape[0] - 1)[:, None], (g * inside)[:, None])
            if grad_b is not None:
                grad_b[v:v + w.shape[0]] = grad_logits.sum(0)
            grad_logits = grad_logits.to(hidden.dtype)   # as autograd hands it to the layer's matmul
            if need_h:
                grad_h += (grad_logits @ w).float()
            if need_w:
                grad_w[v:v + w.shape[0]] = grad_logits.t() @ hidden
        return (None if grad_h is None else grad_h.to(hidden.dtype), grad_w, grad_b, None, None, None, None)


def linear_logprobs(hidden: Tensor, weight: Tensor, bias: Optional[Tensor], labels: Tensor,
                    chunk: Optional[int] = None, vocab_chunk: Optional[int] = None,
                    with_entropy: bool = True) -> tuple[Tensor, Optional[Tensor]]:
    """(log p(label), entropy) per token, both fp32 of shape ``hidden.shape[:-1]``, of the
    distribution ``softmax(hidden @ weight.T + bias)``; the entropy carries no gradient and is
    None with `with_entropy` False (one pass over each chunk's logits fewer).

    hidden ``[..., H]``, weight ``[V, H]``, labels ``[...]`` valid ids. The forward takes
    `chunk` tokens of logits at a time, the backward `vocab_chunk` vocabulary columns for
    every token (defaults: about 256 MB of fp32 logits each).
    """
    shape = hidden.shape[:-1]
    hidden = hidden.reshape(-1, hidden.shape[-1])
    chunk = chunk or rows_per_chunk(weight.shape[0])
    vocab_chunk = vocab_chunk or rows_per_chunk(hidden.shape[0])
    logprobs, entropy = _LinearLogprobs.apply(hidden, weight, bias, labels.reshape(-1).long(), chunk, vocab_chunk,
                                              with_entropy)
    return logprobs.view(shape), entropy.view(shape) if with_entropy else None

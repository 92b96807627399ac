"""Tensor helpers used across layers (one copy each): positions from an attention mask,
log-probabilities of chosen tokens. Plain torch, no distributed or model code."""
from __future__ import annotations

import torch
from torch import Tensor


def positions_from_mask(attention_mask: Tensor) -> Tensor:
    """Position ids from a (left-padded) attention mask as HF generate computes them:
    cumsum - 1, pads set to 1; int64, same shape as the mask."""
    position_ids = attention_mask.long().cumsum(-1) - 1
    return position_ids.masked_fill(attention_mask == 0, 1)


def gather_log_probs(logits: Tensor, labels: Tensor, chunk_bytes: int = 2 ** 30) -> Tensor:
    """Log-probability of each label: logits ``[B, T, V]``, labels ``[B, T]`` -> ``[B, T]`` fp32.

    Computed in fp32 whatever the logits dtype (bf16 log-softmax loses the small
    differences PPO ratios are made of). Labels must be valid ids (no -100). Without
    autograd (scoring) rows go through in chunks of about `chunk_bytes` of fp32 logits,
    so the fp32 copy and logsumexp's temporary stay small (Bloom's 250k vocabulary makes
    them 4 GB each at 16 x 256 answer tokens); the numbers are the same either way.
    """
    rows = max(1, chunk_bytes // max(1, logits[0].numel() * 4))
    if rows < logits.shape[0] and not (torch.is_grad_enabled() and logits.requires_grad):
        return torch.cat([gather_log_probs(logits[i:i + rows], labels[i:i + rows], chunk_bytes)
                          for i in range(0, logits.shape[0], rows)])
    logits = logits.float()
    picked = logits.gather(-1, labels.long().unsqueeze(-1)).squeeze(-1)
    # label logit minus logsumexp == log_softmax gathered, without a second [B, T, V] tensor
    return picked - torch.logsumexp(logits, dim=-1)

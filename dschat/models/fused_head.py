"""Run a causal LM's forward with its output layer returning the log-probability of the
next token of a known sequence instead of logits, so that [batch, length, vocabulary]
logits are never materialised (dschat.utils.linear_logprobs does the chunked maths).

    with FusedLogprobs(model, seq) as head:
        out = engine(input_ids=seq, ...)          # out.logits is [B, T] log p(seq[:, t+1])
    if head.active: logprobs, entropy = out.logits, head.entropy

The output layer's `forward` is replaced for the duration of the block only, so the model
keeps its own forward (positions, masks, `logits_to_keep`) and, under ZeRO-3, DeepSpeed's
module hooks still gather the layer's weight around the call and again for its backward.
Models whose output is not a plain linear layer, or whose logits are rescaled after it, run
the plain way (`active` False, `reason` says why).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn

from dschat.utils.linear_logprobs import linear_logprobs

# config attributes of families that transform the logits after the output layer
_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier_scale")


def fused_head_unsupported_reason(model: nn.Module) -> Optional[str]:
    """Why the output layer of `model` cannot be fused, or None when it can."""
    get = getattr(model, "get_output_embeddings", None)
    head = get() if get is not None else None
    if head is None:
        return "the model has no output embeddings"
    if type(head) is not nn.Linear:
        return f"its output layer is a {type(head).__name__}, not a plain nn.Linear"
    config = getattr(model, "config", None)
    for name in _LOGIT_TRANSFORMS:
        value = getattr(config, name, None)
        if value not in (None, 1, 1.0):
            return f"config.{name}={value} changes the logits after the output layer"
    return None


class FusedLogprobs:
    """Context manager; see the module docstring. `enabled=False` keeps the plain forward;
    `with_entropy=False` leaves `entropy` None (scoring passes do not log it)."""

    def __init__(self, model: nn.Module, seq: torch.Tensor, *, enabled: bool = True,
                 chunk: Optional[int] = None, with_entropy: bool = True):
        self.seq, self.chunk, self.with_entropy = seq, chunk, with_entropy
        self.reason = None if enabled else "--logprobs plain"
        if self.reason is None:
            self.reason = fused_head_unsupported_reason(model)
        self.head = None if self.reason else model.get_output_embeddings()
        self.entropy: Optional[torch.Tensor] = None

    @property
    def active(self) -> bool:
        return self.head is not None

    def __enter__(self) -> "FusedLogprobs":
        if self.head is not None:
            self.head.forward = self._forward   # an instance attribute: nn.Module.__call__ (and its hooks) stay
        return self

    def __exit__(self, *exc) -> None:
        if self.head is not None and "forward" in self.head.__dict__:
            del self.head.forward

    def _forward(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden [B, T, H] are the last T columns of seq (T < L under logits_to_keep); column t
        # predicts the token after it, the last column predicts none (label 0, sliced off later)
        seq = self.seq.to(hidden.device)
        width = hidden.shape[1]
        labels = torch.zeros(seq.shape[0], width, dtype=torch.long, device=hidden.device)
        labels[:, :width - 1] = seq[:, seq.shape[1] - width + 1:]
        logprobs, self.entropy = linear_logprobs(hidden, self.head.weight, self.head.bias, labels, self.chunk,
                                                 with_entropy=self.with_entropy)
        return logprobs

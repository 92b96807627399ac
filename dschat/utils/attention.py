"""Fused attention and GELU for the training and scoring forwards of Bloom.

HF's Bloom has only eager attention: per layer it writes the [batch, heads, q, k] scores,
adds the mask, takes an fp32 softmax, casts it back and keeps both the fp32 and the cast
probabilities for backward (about 0.4 GB per layer at bloom-560m, 16 x 512 tokens, 10 GB over
the model). Its GELU is eight elementwise kernels forward and ten backward. Here the attention
is one `scaled_dot_product_attention` call with ALiBi and the mask as its additive bias (built
once per forward and shared by every layer), and the GELU is PyTorch's tanh GELU, the same
formula in one kernel. Both match HF's eager code within fp32 rounding (tests/test_attention.py).

Other families already use SDPA through transformers' `attn_implementation`.
"""
from __future__ import annotations

import inspect
import weakref

import torch
import torch.nn.functional as F
from torch import nn

from dschat.utils.logging import get_logger

logger = get_logger(__name__)

ATTN_IMPLEMENTATIONS = ("sdpa", "eager")


def hf_attn_kwargs(implementation: str) -> dict:
    """transformers' `from_config` / `from_pretrained` keywords for `implementation`: "eager" asks
    for its eager attention; "sdpa" keeps its default (SDPA where the family has it; Bloom's is
    ours, given by `use_attention` after loading)."""
    return {"attn_implementation": "eager"} if implementation == "eager" else {}


class _SharedBias:
    """The [batch, heads, q, k] bias of one forward, shared by its layers.

    HF hands every layer the same `alibi` and mask tensors; the bias is rebuilt when either is
    a different object. Weak references, so a later forward's tensors that land on the same
    storage never pass for the old ones.
    """

    def __init__(self):
        self._alibi = self._mask = None
        self._bias = None

    # never traced: the cache is Python state (torch.compile'd blocks run it eagerly between
    # their graphs, models.model_utils.compile_blocks)
    @torch.compiler.disable
    def get(self, alibi: torch.Tensor, mask: torch.Tensor | None, batch: int, heads: int,
            q_len: int, dtype: torch.dtype) -> torch.Tensor:
        if (self._bias is not None and self._alibi() is alibi
                and (mask is None if self._mask is None else self._mask() is mask)):
            return self._bias
        k_len = alibi.shape[-1]
        bias = alibi.view(batch, heads, 1, k_len).to(dtype)
        if mask is not None:
            if mask.dtype == torch.bool:  # True = attend
                mask = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(
                    ~mask, torch.finfo(dtype).min)
            bias = bias + mask.to(dtype)
        else:
            causal = torch.ones(q_len, k_len, dtype=torch.bool, device=alibi.device).tril_(k_len - q_len)
            bias = bias.masked_fill(~causal, torch.finfo(dtype).min)
        self._bias = bias.expand(batch, heads, q_len, k_len)
        self._alibi = weakref.ref(alibi)
        self._mask = None if mask is None else weakref.ref(mask)
        return self._bias


def _fused_bloom_attention_forward(self, hidden_states, residual, alibi, attention_mask,
                                   layer_past=None, use_cache=False, output_attentions=False, **kwargs):
    if output_attentions:  # the probabilities exist only in the eager code
        return type(self).forward(self, hidden_states, residual, alibi, attention_mask,
                                  layer_past=layer_past, use_cache=use_cache,
                                  output_attentions=output_attentions, **kwargs)
    batch, q_len, _ = hidden_states.shape
    query, key, value = self._reshape(self.query_key_value(hidden_states))
    if layer_past is not None:
        key, value = layer_past.update(key, value, self.layer_idx)
    bias = self._dschat_bias.get(alibi, attention_mask, batch, self.num_heads, q_len, query.dtype)
    context = F.scaled_dot_product_attention(
        query, key, value, attn_mask=bias, scale=self.inv_norm_factor,
        dropout_p=self.attention_dropout.p if self.training else 0.0)
    context = context.transpose(1, 2).reshape(batch, q_len, self.num_heads * self.head_dim)
    out = F.dropout(self.dense(context), p=self.hidden_dropout, training=self.training)
    return residual + out, None


def _fused_gelu_forward(self, x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


def _bloom_attention_supported(attention: nn.Module) -> str | None:
    """None where the fused forward reproduces this BloomAttention, else why not."""
    params = inspect.signature(type(attention).forward).parameters
    missing = [p for p in ("alibi", "attention_mask", "layer_past", "residual") if p not in params]
    if missing:
        return f"this transformers' BloomAttention.forward has no {', '.join(missing)} argument"
    if getattr(attention, "pretraining_tp", 1) > 1 and getattr(attention, "slow_but_exact", False):
        return "slow_but_exact with pretraining_tp > 1"
    if getattr(attention, "beta", 1.0) != 1.0:
        return f"alibi scaled by beta {attention.beta}"
    for name in ("_reshape", "query_key_value", "dense", "inv_norm_factor", "attention_dropout",
                 "hidden_dropout", "num_heads", "head_dim"):
        if not hasattr(attention, name):
            return f"this transformers' BloomAttention has no {name}"
    return None


def attention_of(model: nn.Module) -> str:
    """"sdpa" where `use_attention` gave `model` the fused Bloom attention, else "eager" (for a
    copy of the model, such as the hybrid engine's inference replica, to match it)."""
    return "sdpa" if any(hasattr(m, "_dschat_bias") for m in model.modules()) else "eager"


def use_attention(model: nn.Module, implementation: str = "sdpa") -> str:
    """Give `model`'s Bloom blocks the fused attention and GELU (`implementation` "sdpa"), or
    leave HF's eager code ("eager"). Returns what the model now runs, for the log."""
    if implementation not in ATTN_IMPLEMENTATIONS:
        raise ValueError(f"attention implementation {implementation!r}: one of {ATTN_IMPLEMENTATIONS}")
    if getattr(model.config, "model_type", None) != "bloom":
        return getattr(model.config, "_attn_implementation", None) or "default"
    if implementation == "eager":
        return "eager (HF's Bloom attention)"
    from transformers.models.bloom.modeling_bloom import BloomAttention, BloomGelu

    attentions = [m for m in model.modules() if isinstance(m, BloomAttention)]
    reason = next((r for r in map(_bloom_attention_supported, attentions) if r), None)
    if reason is not None:
        logger.warning(f"Bloom keeps HF's eager attention: {reason}")
        return f"eager ({reason})"
    shared = _SharedBias()
    for attention in attentions:
        attention._dschat_bias = shared
        attention.forward = _fused_bloom_attention_forward.__get__(attention)
    for gelu in (m for m in model.modules() if isinstance(m, BloomGelu)):
        gelu.forward = _fused_gelu_forward.__get__(gelu)
    return "sdpa (ALiBi as the bias; tanh GELU in one kernel)"

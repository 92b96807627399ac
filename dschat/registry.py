"""Model-family registry: where each HF causal-LM family keeps its parts.

Everything in step 1-3 that needs to know a model's layout (the gather plan, LoRA
targets, dropout keys, the reward model's backbone, the fast decode path) asks this
registry instead of special-casing model types inline. Paths are dotted attribute paths
from the `*ForCausalLM` module.
"""
from __future__ import annotations

import inspect
import os
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn as nn

from dschat.utils.errors import UserInputError
from dschat.utils.tensor_ops import positions_from_mask


@dataclass(frozen=True)
class ModelFamily:
    model_type: str
    base_model: str                      # backbone attribute of the causal LM ("transformer")
    blocks: str                          # nn.ModuleList of transformer blocks
    embed_tokens: str                    # token embedding (tied head shares its weight)
    final_norm: Optional[str]            # None where the family may have none
    lm_head: str
    tied_head: bool                      # default of config.tie_word_embeddings
    position: str                        # "alibi" | "rotary" | "learned"
    # Modules outside the blocks that hold weights and run before the first block
    # (position tables, embedding norms, projections); gathered with the embeddings.
    extra_pre: tuple[str, ...] = ()
    extra_post: tuple[str, ...] = ()     # ... and after the last block, before the head
    num_padding_at_beginning: int = 0    # DS-Chat's reward-model convention
    pad_fallback: str = "none"           # "eos": the family's tokenizers ship no pad token
    dropout_keys: tuple[str, ...] = ()
    lora_targets: tuple[str, ...] = ()
    fast_decode: Optional[str] = None    # key into rollout.decode's registry, if any
    aliases: tuple[str, ...] = field(default=())
    # Inference tensor parallelism (`--inference_tp_size`, dschat/rollout/tensor_parallel.py).
    # Linears are block-relative module paths with the unit their split counts in:
    # "heads" / "kv_heads" (whole attention heads: every head's rows stay together) or
    # "ffn" (single MLP intermediate channels). Column-parallel linears keep a slice of
    # their output rows (and bias); row-parallel ones a slice of their input columns, their
    # bias is added once after the all-reduce. The slices run through the family's
    # fast_decode block (no tp_column: no tensor parallelism).
    tp_column: tuple[tuple[str, str], ...] = ()
    tp_row: tuple[tuple[str, str], ...] = ()
    # Fused QKV rows: "per_head" = [heads, 3, head_dim] (Bloom, GPT-NeoX), so one head's
    # q, k and v rows are one contiguous run; "separate" = q/k/v are their own linears.
    tp_qkv_layout: str = "separate"
    tp_heads: tuple[str, ...] = ()       # config attributes of the attention head count
    tp_kv_heads: tuple[str, ...] = ()    # ... of the KV head count (GQA); else = heads

    @property
    def lora_module_prefix(self) -> str:
        """DS-Chat's --lora_module_name for this family: the blocks' path below the
        backbone (`decoder.layers.` for OPT, upstream's default), so it matches in the
        causal LM and in the reward model's backbone alike."""
        return self.blocks[len(self.base_model) + 1:] + "."


_FAMILIES = [
    ModelFamily(
        model_type="bloom", base_model="transformer", blocks="transformer.h",
        embed_tokens="transformer.word_embeddings", final_norm="transformer.ln_f",
        lm_head="lm_head", tied_head=True, position="alibi",
        extra_pre=("transformer.word_embeddings_layernorm",),
        dropout_keys=("hidden_dropout", "attention_dropout"),
        lora_targets=("query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h"),
        fast_decode="bloom",
        tp_qkv_layout="per_head", tp_heads=("n_head",),
        tp_column=(("self_attention.query_key_value", "heads"), ("mlp.dense_h_to_4h", "ffn")),
        tp_row=(("self_attention.dense", "heads"), ("mlp.dense_4h_to_h", "ffn")),
    ),
    ModelFamily(
        model_type="opt", base_model="model", blocks="model.decoder.layers",
        embed_tokens="model.decoder.embed_tokens", final_norm="model.decoder.final_layer_norm",
        lm_head="lm_head", tied_head=True, position="learned",
        extra_pre=("model.decoder.embed_positions", "model.decoder.project_in"),
        extra_post=("model.decoder.project_out",),
        num_padding_at_beginning=1,
        dropout_keys=("dropout", "attention_dropout", "activation_dropout"),
        lora_targets=("q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2"),
        fast_decode="opt",
        tp_heads=("num_attention_heads",),
        tp_column=(("self_attn.q_proj", "heads"), ("self_attn.k_proj", "heads"),
                   ("self_attn.v_proj", "heads"), ("fc1", "ffn")),
        tp_row=(("self_attn.out_proj", "heads"), ("fc2", "ffn")),
    ),
    ModelFamily(
        model_type="llama", base_model="model", blocks="model.layers",
        embed_tokens="model.embed_tokens", final_norm="model.norm",
        lm_head="lm_head", tied_head=False, position="rotary",
        pad_fallback="eos", dropout_keys=("attention_dropout",),
        lora_targets=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
        fast_decode="llama", aliases=("mistral", "qwen2"),
        tp_heads=("num_attention_heads",), tp_kv_heads=("num_key_value_heads",),
        tp_column=(("self_attn.q_proj", "heads"), ("self_attn.k_proj", "kv_heads"),
                   ("self_attn.v_proj", "kv_heads"), ("mlp.gate_proj", "ffn"), ("mlp.up_proj", "ffn")),
        tp_row=(("self_attn.o_proj", "heads"), ("mlp.down_proj", "ffn")),
    ),
    ModelFamily(
        model_type="gpt_neox", base_model="gpt_neox", blocks="gpt_neox.layers",
        embed_tokens="gpt_neox.embed_in", final_norm="gpt_neox.final_layer_norm",
        lm_head="lm_head", tied_head=False, position="rotary", pad_fallback="eos",
        dropout_keys=("attention_dropout", "hidden_dropout"),
        lora_targets=("query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h"),
        fast_decode="gpt_neox",
        tp_qkv_layout="per_head", tp_heads=("num_attention_heads",),
        tp_column=(("attention.query_key_value", "heads"), ("mlp.dense_h_to_4h", "ffn")),
        tp_row=(("attention.dense", "heads"), ("mlp.dense_4h_to_h", "ffn")),
    ),
    ModelFamily(
        model_type="gpt2", base_model="transformer", blocks="transformer.h",
        embed_tokens="transformer.wte", final_norm="transformer.ln_f",
        lm_head="lm_head", tied_head=True, position="learned",
        extra_pre=("transformer.wpe",), pad_fallback="eos",
        dropout_keys=("resid_pdrop", "embd_pdrop", "attn_pdrop"),
        lora_targets=("c_attn", "c_proj", "c_fc"),
        fast_decode="gpt2",
    ),
]

REGISTRY: dict[str, ModelFamily] = {}
for _fam in _FAMILIES:
    REGISTRY[_fam.model_type] = _fam
    for _alias in _fam.aliases:
        REGISTRY[_alias] = _fam


class UnknownModelTypeError(UserInputError):
    pass


def get_family(model_type: str) -> ModelFamily:
    """The registry entry of `model_type` (config.model_type); unknown types are an error."""
    try:
        return REGISTRY[model_type]
    except KeyError:
        raise UnknownModelTypeError(
            f"model_type {model_type!r} is not supported; known model types: "
            f"{', '.join(sorted(REGISTRY))}") from None


def family_of(model_or_config) -> ModelFamily:
    """Family of an HF model, a PEFT-wrapped model, or a config."""
    config = getattr(model_or_config, "config", model_or_config)
    return get_family(config.model_type)


def resolve(module: nn.Module, path: str) -> Optional[nn.Module]:
    """Follow a dotted path from `module`; None where an attribute is absent or None."""
    obj = module
    for part in path.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


def is_linear(module: nn.Module) -> bool:
    """nn.Linear, or GPT-2's transposed Conv1D linear."""
    return isinstance(module, nn.Linear) or type(module).__name__ == "Conv1D"


def unwrap_peft(model: nn.Module) -> nn.Module:
    """The HF causal LM under a peft wrapper (or the model itself)."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def blocks_of(model: nn.Module) -> nn.ModuleList:
    model = unwrap_peft(model)
    return resolve(model, family_of(model).blocks)


def head_is_tied(model: nn.Module) -> bool:
    """Whether this model instance's LM head shares the embedding's weight."""
    model = unwrap_peft(model)
    fam = family_of(model)
    head, emb = resolve(model, fam.lm_head), resolve(model, fam.embed_tokens)
    return head is not None and emb is not None and head.weight is emb.weight


def tp_head_counts(config) -> tuple[Optional[int], Optional[int]]:
    """(attention heads, KV heads) of a config from the family's `tp_heads` / `tp_kv_heads`
    attributes; KV heads default to the head count; (None, None) without a TP layout."""
    fam = family_of(config)
    heads = next((getattr(config, a) for a in fam.tp_heads if getattr(config, a, None)), None)
    kv = next((getattr(config, a) for a in fam.tp_kv_heads if getattr(config, a, None)), None)
    return heads, kv or heads


# ------------------------------------------------------ what a family's forward takes

_FORWARD_TAKES: dict[tuple[type, str], bool] = {}


def _forward_takes(model: nn.Module, name: str) -> bool:
    """Whether the HF model's forward (under a PEFT wrapper) has parameter `name`."""
    key = (type(unwrap_peft(model)), name)
    if key not in _FORWARD_TAKES:
        _FORWARD_TAKES[key] = name in inspect.signature(key[0].forward).parameters
    return _FORWARD_TAKES[key]


def position_ids_for(model: nn.Module, attention_mask: torch.Tensor) -> Optional[torch.Tensor]:
    """Positions from a (left-padded) attention mask, as HF generate computes them
    (cumsum - 1, pads set to 1); None for models whose forward takes no position_ids
    (ALiBi models derive positions from the mask themselves)."""
    if not _forward_takes(model, "position_ids"):
        return None
    return positions_from_mask(attention_mask)


def logits_to_keep_kwargs(model: nn.Module, keep_last: int) -> dict:
    """{"logits_to_keep": n} where the model's forward takes it (HF computes the LM head
    over the last n positions only), else {}; callers slice the last n columns either way.
    Step 3 keeps the answer's columns: with Bloom's 250k vocabulary the head is about as
    much compute as the rest of the model, and its logits the largest tensor of a step."""
    if keep_last <= 0 or not _forward_takes(model, "logits_to_keep"):
        return {}
    if os.environ.get("DSCHAT_FULL_LOGITS") == "1":      # A/B switch of benchmarks/step3.py
        return {}
    return {"logits_to_keep": keep_last}

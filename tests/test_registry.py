"""Every registry entry resolves on the real HF module built from a tiny config."""
import json
from pathlib import Path

import pytest
import torch.nn as nn
from transformers import AutoConfig, AutoModelForCausalLM

from dschat.registry import (
    REGISTRY,
    UnknownModelTypeError,
    blocks_of,
    family_of,
    get_family,
    head_is_tied,
    is_linear,
    resolve,
)

CONFIGS = Path(__file__).resolve().parents[1] / "configs" / "tiny"
TINY = {
    "bloom": "bloom.json", "opt": "opt.json", "llama": "llama.json",
    "gpt_neox": "gpt_neox.json", "gpt2": "gpt2.json",
}
ALIAS_CONFIGS = {
    "mistral": dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2),
    "qwen2": dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2),
}


def build(model_type):
    if model_type in TINY:
        data = json.loads((CONFIGS / TINY[model_type]).read_text())
        config = AutoConfig.for_model(**data)
    else:
        config = AutoConfig.for_model(model_type, **ALIAS_CONFIGS[model_type])
    return AutoModelForCausalLM.from_config(config)


@pytest.mark.parametrize("model_type", sorted(REGISTRY))
def test_every_path_resolves(model_type):
    model = build(model_type)
    fam = family_of(model)
    assert fam is get_family(model_type)
    assert isinstance(resolve(model, fam.base_model), nn.Module)
    blocks = blocks_of(model)
    assert isinstance(blocks, nn.ModuleList) and len(blocks) == model.config.num_hidden_layers
    assert isinstance(resolve(model, fam.embed_tokens), nn.Embedding)
    assert isinstance(resolve(model, fam.lm_head), nn.Linear)
    if fam.final_norm:
        assert isinstance(resolve(model, fam.final_norm), nn.Module)
    for path in fam.extra_pre + fam.extra_post:
        # optional modules (OPT's projections exist only when word_embed_proj_dim != hidden)
        mod = resolve(model, path)
        assert mod is None or isinstance(mod, nn.Module), path
    assert head_is_tied(model) == fam.tied_head == bool(model.config.tie_word_embeddings)
    linear_names = {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if is_linear(m)}
    assert set(fam.lora_targets) <= linear_names, set(fam.lora_targets) - linear_names
    assert all(hasattr(model.config, k) for k in fam.dropout_keys), fam.dropout_keys
    assert fam.position in ("alibi", "rotary", "learned")
    # every block lies under the block path
    assert any(n.startswith(fam.blocks + ".0.") for n, _ in model.named_parameters())


def test_unknown_model_type_lists_known_ones():
    with pytest.raises(UnknownModelTypeError) as e:
        get_family("mamba")
    assert "mamba" in str(e.value) and "bloom" in str(e.value) and "llama" in str(e.value)

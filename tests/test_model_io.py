"""Model creation, LoRA merge and HF-format saving (single process; ZeRO-3 saving is
covered by the step-1 multi-rank test)."""
import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from dschat.models.lora import apply_lora
from dschat.models.model_utils import create_hf_model, load_tokenizer, save_hf_format
from dschat.registry import head_is_tied
from dschat.utils.errors import UserInputError

CONFIGS = Path(__file__).resolve().parents[1] / "configs" / "tiny"


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(None)


@pytest.mark.parametrize("name", ["bloom", "opt", "llama", "gpt2"])
@pytest.mark.parametrize("lora", [0, 4])
def test_save_roundtrip(tmp_path, tokenizer, name, lora):
    model = create_hf_model(str(CONFIGS / f"{name}.json"), tokenizer, seed=7)
    assert model.get_input_embeddings().num_embeddings % 8 == 0
    assert model.get_input_embeddings().num_embeddings >= len(tokenizer)
    model = apply_lora(model, lora)
    if lora:  # make the adapters matter
        for n, p in model.named_parameters():
            if "lora_B" in n:
                torch.nn.init.normal_(p, std=0.05)
    model.eval()
    ids = torch.randint(4, len(tokenizer), (2, 12))
    with torch.no_grad():
        expected = model(input_ids=ids).logits
    save_hf_format(model, tokenizer, tmp_path)
    for f in ("config.json", "model.safetensors", "tokenizer.json", "generation_config.json"):
        assert (tmp_path / f).exists(), f
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert head_is_tied(loaded) == bool(loaded.config.tie_word_embeddings)
    with torch.no_grad():
        got = loaded(input_ids=ids).logits
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    # the saved folder loads back through our own loader, tokenizer included
    tok2 = load_tokenizer(str(tmp_path))
    assert tok2.pad_token_id == tokenizer.pad_token_id and len(tok2) == len(tokenizer)


def test_dropout_override(tokenizer):
    model = create_hf_model(str(CONFIGS / "opt.json"), tokenizer, dropout=0.3)
    assert model.config.dropout == model.config.attention_dropout == 0.3


def test_unknown_model_type(tmp_path, tokenizer):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"model_type": "mamba", "vocab_size": 16}))
    with pytest.raises(UserInputError, match="known model types"):
        create_hf_model(str(cfg), tokenizer)


def test_missing_folder_and_missing_weights(tmp_path, tokenizer):
    with pytest.raises(UserInputError, match="no config.json"):
        create_hf_model(str(tmp_path), tokenizer)

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
def test_saved_weights_load_in_the_training_dtype(tmp_path, tokenizer, name):
    """A folder loads in the engine config's dtype: exactly the fp32 load cast to it, which is
    what DeepSpeed would have made of the fp32 load; without a config, fp32."""
    from dschat.engine.config import train_ds_config
    save_hf_format(create_hf_model(str(CONFIGS / f"{name}.json"), tokenizer, seed=7), tokenizer, tmp_path)
    fp32 = create_hf_model(str(tmp_path), tokenizer)
    for dtype in ("bf16", "fp16"):
        got = create_hf_model(str(tmp_path), tokenizer,
                              ds_config=train_ds_config(zero_stage=2, dtype=dtype, micro_batch_size=1))
        want = dict(fp32.named_parameters())
        for n, p in got.named_parameters():
            assert p.dtype == {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype], n
            assert torch.equal(p, want[n].to(p.dtype)), n
    assert {p.dtype for p in fp32.parameters()} == {torch.float32}


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


def test_lora_merge_holds_one_delta_at_a_time(tokenizer, monkeypatch):
    """The merge at the final save of a LoRA run builds one fp32 delta at a time and frees
    each base weight as it copies it: holding every delta at once (4 bytes per LoRA'd
    parameter) ran a 7B run's host out of memory after its last step. The live weights
    are left as they were, and the merge equals peft's own."""
    import weakref

    from dschat.models import lora as lora_mod

    model = apply_lora(create_hf_model(str(CONFIGS / "llama.json"), tokenizer, seed=7), 4)
    for n, p in model.named_parameters():
        if "lora_B" in n:
            torch.nn.init.normal_(p, std=0.05)
    live = {n: p.detach().clone() for n, p in model.named_parameters()}
    alive, most_alive = [], 0
    real_delta = lora_mod.lora_delta

    def tracked_delta(*args):
        nonlocal most_alive
        delta = real_delta(*args)
        alive.append(weakref.ref(delta))
        most_alive = max(most_alive, sum(r() is not None for r in alive))
        return delta

    monkeypatch.setattr(lora_mod, "lora_delta", tracked_delta)
    state = {n: p.detach().clone() for n, p in model.named_parameters()}
    bases = {n: weakref.ref(t) for n, t in state.items() if ".base_layer." in n}
    merged = lora_mod.merged_state_dict(model, state)
    assert len(alive) == len(lora_mod.lora_layers(model)) > 0
    assert most_alive == 1, f"{most_alive} fp32 deltas were alive at once"
    assert state == {}, "the merge consumes the state it is given"
    assert all(r() is None for r in bases.values()), "a base weight outlived its merged copy"
    for n, p in model.named_parameters():
        assert torch.equal(p.detach(), live[n]), f"{n} was modified"
    reference = model.merge_and_unload().state_dict()
    assert merged.keys() == {k for k in reference if k in merged} and len(merged) > 0
    for k, v in merged.items():
        torch.testing.assert_close(v, reference[k], rtol=1e-6, atol=1e-6)


def test_final_save_host_bytes_counts_the_gathered_state_and_one_merge(tokenizer):
    from dschat.engine.zero import final_save_host_bytes

    small = create_hf_model(str(CONFIGS / "bloom.json"), tokenizer, seed=7)
    model = apply_lora(create_hf_model(str(CONFIGS / "llama.json"), tokenizer, seed=7), 4).to(torch.bfloat16)
    params = list(model.parameters())
    want = (2 * sum(p.numel() for p in params) + 8 * max(p.numel() for p in params)) * 5 // 4
    assert final_save_host_bytes(model) == want
    assert final_save_host_bytes(small, model) == max(want, final_save_host_bytes(small))


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

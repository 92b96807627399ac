"""Reward model: pair loss by hand, scores, save/load in our and DS-Chat's formats."""
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from dschat.models.model_utils import create_hf_model, load_tokenizer, save_hf_format
from dschat.models.reward_model import (create_reward_model, is_reward_checkpoint, last_token_index,
                                        load_reward_model, save_reward_model)
from dschat.utils.errors import UserInputError

CONFIGS = Path(__file__).resolve().parents[1] / "configs" / "tiny"
FAMILIES = ["bloom", "opt", "llama", "gpt_neox", "gpt2"]


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(None)


def pair_batch(pad=0):
    # chosen / rejected share 3 tokens; the rejected answer is longer
    chosen = torch.tensor([[5, 6, 7, 8, 9, pad, pad, pad], [5, 6, 7, 10, 11, 12, pad, pad]])
    rejected = torch.tensor([[5, 6, 7, 20, 21, 22, 23, pad], [5, 6, 7, 10, 11, 12, pad, pad]])
    ids = torch.cat([chosen, rejected])
    return ids, (ids != pad).long()


@pytest.mark.parametrize("family", FAMILIES)
def test_pair_loss_matches_hand_computation(tokenizer, family):
    model = create_reward_model(str(CONFIGS / f"{family}.json"), tokenizer, seed=3).eval()
    ids, mask = pair_batch()
    with torch.no_grad():
        out = model(ids, mask)
        v = model.values(ids, mask)
    # pair 0: differs from position 3; ends 5 (chosen) and 7 (rejected) -> span [3, 7)
    l0 = -F.logsigmoid(v[0, 3:7] - v[2, 3:7]).mean()
    # pair 1: identical -> compare the last real token (index 5)
    l1 = -F.logsigmoid(v[1, 5:6] - v[3, 5:6]).mean()
    torch.testing.assert_close(out["loss"], (l0 + l1) / 2)
    torch.testing.assert_close(out["chosen_mean_scores"], torch.stack([v[0, 4], v[1, 5]]))
    torch.testing.assert_close(out["rejected_mean_scores"], torch.stack([v[2, 6], v[3, 5]]))
    scores = model.forward_value(ids, mask)["chosen_end_scores"]
    torch.testing.assert_close(scores, v.gather(1, last_token_index(mask)[:, None]).squeeze(1))


def test_left_padded_end_index():
    mask = torch.tensor([[0, 0, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1], [0, 1, 0, 0, 0, 0]])
    assert last_token_index(mask).tolist() == [4, 5, 1]


@pytest.mark.parametrize("family", ["bloom", "opt", "llama"])
def test_save_load_roundtrip_and_dschat_format(tmp_path, tokenizer, family):
    model = create_reward_model(str(CONFIGS / f"{family}.json"), tokenizer, seed=4).eval()
    torch.nn.init.normal_(model.v_head.weight, std=0.5)
    ids, mask = pair_batch()
    with torch.no_grad():
        want = model.forward_value(ids, mask)["chosen_end_scores"]
    save_reward_model(model, tokenizer, tmp_path / "ours")
    assert is_reward_checkpoint(tmp_path / "ours")
    loaded = load_reward_model(tmp_path / "ours", tokenizer).eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded.forward_value(ids, mask)["chosen_end_scores"], want)
    # hand-made DS-Chat checkpoint: config.json + pytorch_model.bin with rwtransformer.* / v_head
    ds = tmp_path / "dschat"
    ds.mkdir()
    model.config.save_pretrained(ds)
    torch.save({k: v.clone() for k, v in model.state_dict().items()}, ds / "pytorch_model.bin")
    assert is_reward_checkpoint(ds)
    loaded = load_reward_model(ds, tokenizer).eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded.forward_value(ids, mask)["chosen_end_scores"], want)


def test_causal_lm_folder_is_not_a_reward_model(tmp_path, tokenizer):
    lm = create_hf_model(str(CONFIGS / "bloom.json"), tokenizer)
    save_hf_format(lm, tokenizer, tmp_path)
    with pytest.raises(UserInputError, match="not a reward model.*causal-LM"):
        load_reward_model(tmp_path, tokenizer, flag="--critic_model_name_or_path")


def test_mismatched_keys_listed(tmp_path, tokenizer):
    model = create_reward_model(str(CONFIGS / "bloom.json"), tokenizer)
    state = model.state_dict()
    state.pop("rwtransformer.h.0.mlp.dense_h_to_4h.weight")
    state["rwtransformer.extra.weight"] = torch.zeros(1)
    model.config.save_pretrained(tmp_path)
    torch.save(state, tmp_path / "pytorch_model.bin")
    with pytest.raises(UserInputError, match="missing keys.*dense_h_to_4h.*unexpected keys.*extra"):
        load_reward_model(tmp_path, tokenizer)

"""Reward model: pair loss by hand, scores, save/load in our and DS-Chat's formats."""
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from dschat.models.model_utils import create_hf_model, load_tokenizer, save_hf_format
from dschat.models.reward_model import (
    create_reward_model,
    is_reward_checkpoint,
    last_token_index,
    load_reward_model,
    save_reward_model,
)
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
@pytest.mark.parametrize("lora", [0, 4])
def test_save_load_roundtrip_and_dschat_format(tmp_path, tokenizer, family, lora):
    from dschat.models.lora import apply_lora

    model = create_reward_model(str(CONFIGS / f"{family}.json"), tokenizer, seed=4).eval()
    torch.nn.init.normal_(model.v_head.weight, std=0.5)
    if lora:  # a step-3 critic with LoRA saves its backbone with the adapters merged
        model.rwtransformer = apply_lora(model.rwtransformer, lora)
        for n, p in model.named_parameters():
            if "lora_B" in n:
                torch.nn.init.normal_(p, std=0.05)
    ids, mask = pair_batch()
    with torch.no_grad():
        want = model.forward_value(ids, mask)["chosen_end_scores"]
    save_reward_model(model, tokenizer, tmp_path / "ours")
    assert is_reward_checkpoint(tmp_path / "ours")
    loaded = load_reward_model(tmp_path / "ours", tokenizer).eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded.forward_value(ids, mask)["chosen_end_scores"], want)
    if lora:
        return
    # hand-made DS-Chat checkpoint: config.json + pytorch_model.bin with rwtransformer.* / v_head
    ds = tmp_path / "dschat"
    ds.mkdir()
    model.config.save_pretrained(ds)
    torch.save({k: v.clone() for k, v in model.state_dict().items()}, ds / "pytorch_model.bin")
    assert is_reward_checkpoint(ds)
    loaded = load_reward_model(ds, tokenizer).eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded.forward_value(ids, mask)["chosen_end_scores"], want)


@pytest.mark.parametrize("family", FAMILIES)
def test_load_takes_the_files_tensors_in_the_training_dtype(tmp_path, tokenizer, family):
    """Every parameter and buffer equals the earlier load's (a random fp32 init, then the file
    copied in; the reference below), cast to the config's dtype where DeepSpeed would cast it;
    all trainable, none left without storage."""
    from safetensors.torch import load_file
    from transformers import AutoModel

    from dschat.engine.config import train_ds_config
    from dschat.models.model_utils import load_config
    from dschat.models.reward_model import RewardModel
    model = create_reward_model(str(CONFIGS / f"{family}.json"), tokenizer, seed=6)
    torch.nn.init.normal_(model.v_head.weight, std=0.5)
    save_reward_model(model, tokenizer, tmp_path)
    ref = RewardModel(AutoModel.from_config(load_config(str(tmp_path)), dtype=torch.float32),
                      pad_token_id=tokenizer.pad_token_id, num_padding_at_beginning=model.num_padding_at_beginning)
    ref.load_state_dict(load_file(str(tmp_path / "model.safetensors")), strict=False)
    for dtype, cfg in ((torch.float32, None), (torch.bfloat16, train_ds_config(zero_stage=2, dtype="bf16",
                                                                                micro_batch_size=1))):
        got = load_reward_model(tmp_path, tokenizer, ds_config=cfg)
        want = dict(ref.named_parameters())
        assert set(dict(got.named_parameters())) == set(want)
        for name, p in got.named_parameters():
            assert p.dtype == dtype and p.requires_grad and not p.is_meta, name
            assert torch.equal(p, want[name].to(dtype)), name
        for name, b in ref.named_buffers():
            assert torch.equal(dict(got.named_buffers())[name], b), name


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


# ------------------------------------------------------------------ upstream DS-Chat's maths as the reference
def upstream_pair_loss(values, ids, pad, num_padding_at_beginning=0):
    """DS-Chat's RewardModel.forward on precomputed values [2B, L]: its pad scan for the
    ends, the span from the first differing token to the later end (an identical pair: the
    last column), the mean -logsigmoid over it, end scores at end - 1."""
    bs, seq_len = ids.shape[0] // 2, ids.shape[1]

    def end_of(row):
        pads = (row == pad).nonzero()
        return pads[num_padding_at_beginning].item() if len(pads) > num_padding_at_beginning else seq_len
    loss, chosen, rejected = 0.0, [], []
    for i in range(bs):
        c_ids, r_ids = ids[i], ids[bs + i]
        c_end = end_of(c_ids)
        differ = (c_ids != r_ids).nonzero()
        if len(differ) == 0:
            end, start, r_end = seq_len, seq_len - 1, c_end
        else:
            r_end = end_of(r_ids)
            end, start = max(c_end, r_end), differ[0].item()
        loss += -F.logsigmoid(values[i, start:end] - values[bs + i, start:end]).mean()
        chosen.append(values[i, c_end - 1])
        rejected.append(values[bs + i, r_end - 1])
    return loss / bs, torch.stack(chosen), torch.stack(rejected)


def upstream_end_scores(values, ids, prompt_length, pad):
    """DS-Chat's RewardModel.forward_value (step 3): the first pad after the prompt ends a row."""
    out = []
    for i in range(ids.shape[0]):
        pads = (ids[i, prompt_length:] == pad).nonzero()
        end = pads[0].item() + prompt_length if len(pads) else ids.shape[1]
        out.append(values[i, end - 1])
    return torch.stack(out)


def step2_batch(tokenizer, cache, rows=6):
    """Real step-2 rows (bundled pairs, right-padded to 48) plus one identical pair."""
    from dschat.data import DataCollatorReward, create_prompt_dataset
    train, _ = create_prompt_dataset(0, ["dschat/synthetic-assistant"], "6,3,1", str(cache), 2, 1234, tokenizer, 48)
    items = [train[i] for i in range(rows)]
    same = dict(items[0], rejected_input_ids=items[0]["chosen_input_ids"],
                rejected_attention_mask=items[0]["chosen_attention_mask"])
    return DataCollatorReward()(items + [same])


@pytest.mark.parametrize("family", ["bloom", "llama", "gpt_neox"])
def test_step2_loss_and_end_scores_equal_upstream_where_pad_is_not_eos(tmp_path, tokenizer, family):
    assert tokenizer.pad_token_id != tokenizer.eos_token_id
    model = create_reward_model(str(CONFIGS / f"{family}.json"), tokenizer, seed=5,
                                num_padding_at_beginning=0).eval()
    torch.nn.init.normal_(model.v_head.weight, std=0.5)
    batch = step2_batch(tokenizer, tmp_path / "cache")
    ids, mask = batch["input_ids"], batch["attention_mask"]
    with torch.no_grad():
        out, v = model(ids, mask), model.values(ids, mask)
    loss, chosen, rejected = upstream_pair_loss(v, ids, tokenizer.pad_token_id)
    torch.testing.assert_close(out["loss"], loss)
    torch.testing.assert_close(out["chosen_mean_scores"], chosen)
    torch.testing.assert_close(out["rejected_mean_scores"], rejected)
    # step 3: left-padded prompt, answer, right pads
    P, pad = 5, tokenizer.pad_token_id
    seq = torch.tensor([[pad, pad, 7, 8, 9, 20, 21, 22, tokenizer.eos_token_id, pad],
                        [3, 4, 7, 8, 9, 30, 31, 32, 33, 34]])
    seq_mask = (seq != pad).long()
    with torch.no_grad():
        ours = model.forward_value(seq, seq_mask)["chosen_end_scores"]
        want = upstream_end_scores(model.values(seq, seq_mask), seq, P, pad)
    torch.testing.assert_close(ours, want)


def test_step2_where_pad_is_eos_scores_the_eos_upstream_the_token_before(tmp_path, tokenizer):
    """pad == eos (llama, gpt2 tokenizers): upstream's pad scan stops at the eos itself, so
    its end score is the token before the eos and the eos is outside the loss span; ours
    reads ends from the attention mask, where the eos is a real token: the score is the
    eos's value and the span includes it. Everything else is the same maths."""
    import copy
    tok = copy.deepcopy(tokenizer)
    tok.pad_token = tok.eos_token
    model = create_reward_model(str(CONFIGS / "bloom.json"), tok, seed=5, num_padding_at_beginning=0).eval()
    torch.nn.init.normal_(model.v_head.weight, std=0.5)
    batch = step2_batch(tok, tmp_path / "cache")
    ids, mask = batch["input_ids"], batch["attention_mask"]
    with torch.no_grad():
        out, v = model(ids, mask), model.values(ids, mask)
    _, up_chosen, _ = upstream_pair_loss(v, ids, tok.pad_token_id)
    eos_at = last_token_index(mask)                           # ours: the row's eos (mask 1)
    bs = ids.shape[0] // 2
    assert (ids[torch.arange(2 * bs), eos_at] == tok.eos_token_id).all()
    torch.testing.assert_close(out["chosen_mean_scores"], v[torch.arange(bs), eos_at[:bs]])
    torch.testing.assert_close(up_chosen, v[torch.arange(bs), eos_at[:bs] - 1])
    assert not torch.allclose(out["chosen_mean_scores"], up_chosen)

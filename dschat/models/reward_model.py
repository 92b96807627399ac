"""The reward / critic model: a causal LM's backbone with a bias-free value head.

Pair loss (as upstream DeepSpeed-Chat): for each chosen/rejected pair, over the span from
the first position where the two sequences differ to the later of their ends, the mean of
-logsigmoid(v_chosen - v_rejected); batch loss = mean over pairs. A sequence's score is
the value at its last real token.

Sequence ends are read from the attention mask. Upstream reads them by scanning for pad
tokens after `num_padding_at_beginning` of them, which breaks for tokenizers whose pad
equals eos; the pad scan is kept only for callers that pass no mask.

Checkpoint format (a normal folder): config.json of the backbone's causal LM, weights
`rwtransformer.*` + `v_head.weight` in model.safetensors (DS-Chat's key names, so its
`pytorch_model.bin` checkpoints load too), the tokenizer, and `reward_model.json`.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers import AutoModel

from dschat.engine.zero import match_partitioned_dtype
from dschat.models.model_utils import create_hf_model, has_weights, load_config, save_tokenizer_and_config
from dschat.registry import family_of, position_ids_for
from dschat.utils.attention import hf_attn_kwargs, use_attention
from dschat.utils.checkpoint import fault_point
from dschat.utils.errors import UserInputError

MARKER_FILE = "reward_model.json"
STALE_BUFFERS = ("rotary_emb.inv_freq", "attn.masked_bias", "attn.bias")
MARKER = {"format": "dschat-reward-model", "version": 1,
          "score": "v_head(hidden state) at the last token whose attention_mask is 1",
          "weights": "rwtransformer.* (the backbone) + v_head.weight (hidden -> 1, no bias)"}


def _hidden_size(config) -> int:
    # OPT's decoder projects its output to word_embed_proj_dim when that differs
    return int(getattr(config, "word_embed_proj_dim", None) or getattr(config, "hidden_size", None)
               or config.n_embd)


def last_token_index(attention_mask: torch.Tensor) -> torch.Tensor:
    """Index of the last 1 in each row (right- or left-padded rows alike); 0 for empty rows."""
    positions = torch.arange(attention_mask.size(1), device=attention_mask.device)
    return (attention_mask.long() * positions).max(dim=1).values


class RewardModel(nn.Module):
    def __init__(self, backbone: nn.Module, *, pad_token_id: int, num_padding_at_beginning: int = 0):
        super().__init__()
        self.config = backbone.config
        self.rwtransformer = backbone
        self.v_head = nn.Linear(_hidden_size(self.config), 1, bias=False)
        self.pad_token_id = pad_token_id
        self.num_padding_at_beginning = num_padding_at_beginning

    def gradient_checkpointing_enable(self):
        self.rwtransformer.gradient_checkpointing_enable()

    def values(self, input_ids, attention_mask=None) -> torch.Tensor:
        """Per-token values [B, L] (computed in fp32 from the last hidden states)."""
        kwargs = {}
        if attention_mask is not None:  # left-padded step-3 rows: positions as HF generate has them
            position_ids = position_ids_for(self.rwtransformer, attention_mask)
            if position_ids is not None:
                kwargs["position_ids"] = position_ids
        hidden = self.rwtransformer(input_ids=input_ids, attention_mask=attention_mask,
                                    use_cache=False, **kwargs).last_hidden_state
        return self.v_head(hidden).squeeze(-1).float()

    def _ends(self, input_ids, attention_mask) -> torch.Tensor:
        """Exclusive end of each sequence."""
        if attention_mask is not None:
            return last_token_index(attention_mask) + 1
        ends = []
        for row in input_ids:  # upstream's pad scan, for mask-less callers
            pads = (row == self.pad_token_id).nonzero().flatten()
            ends.append(int(pads[self.num_padding_at_beginning]) if len(pads) > self.num_padding_at_beginning
                        else row.numel())
        return torch.tensor(ends, device=input_ids.device)

    def forward(self, input_ids, attention_mask=None) -> dict:
        """Pairwise loss on a batch of [chosen rows; rejected rows] (2B rows)."""
        values = self.values(input_ids, attention_mask)
        ends = self._ends(input_ids, attention_mask)
        bs = input_ids.size(0) // 2
        chosen_ids, rejected_ids = input_ids[:bs], input_ids[bs:]
        losses, chosen_scores, rejected_scores = [], [], []
        for i in range(bs):
            c_end, r_end = int(ends[i]), int(ends[bs + i])
            differ = (chosen_ids[i] != rejected_ids[i]).nonzero().flatten()
            if len(differ) == 0:  # identical pair: compare the last token only
                start, end = c_end - 1, c_end
            else:
                start, end = int(differ[0]), max(c_end, r_end)
            diff = values[i, start:end] - values[bs + i, start:end]
            losses.append(-F.logsigmoid(diff).mean())
            chosen_scores.append(values[i, c_end - 1])
            rejected_scores.append(values[bs + i, r_end - 1])
        return {"loss": torch.stack(losses).mean(), "chosen_mean_scores": torch.stack(chosen_scores),
                "rejected_mean_scores": torch.stack(rejected_scores)}

    def forward_value(self, input_ids, attention_mask=None, return_value_only: bool = False):
        """Values [B, L], and the score at each row's last real token (step 3)."""
        values = self.values(input_ids, attention_mask)
        if return_value_only:
            return values
        ends = self._ends(input_ids, attention_mask)
        scores = values.gather(1, (ends - 1).clamp(min=0).unsqueeze(1)).squeeze(1)
        return {"values": values, "chosen_end_scores": scores}


def create_reward_model(model_name_or_path: str, tokenizer, *, ds_config: dict | None = None,
                        dropout: float | None = None, seed: int = 1234,
                        num_padding_at_beginning: int | None = None,
                        attn_implementation: str = "sdpa") -> RewardModel:
    """A new reward model on the backbone of a causal LM (a step-1 folder, or a config).

    Passing a folder that already is a reward model continues from its weights.
    """
    if is_reward_checkpoint(model_name_or_path):
        return load_reward_model(model_name_or_path, tokenizer, dropout=dropout,
                                 attn_implementation=attn_implementation, ds_config=ds_config)
    backbone = create_hf_model(model_name_or_path, tokenizer, ds_config=ds_config, dropout=dropout,
                               seed=seed, model_class=AutoModel, attn_implementation=attn_implementation)
    fam = family_of(backbone)
    npb = fam.num_padding_at_beginning if num_padding_at_beginning is None else num_padding_at_beginning
    torch.manual_seed(seed)
    model = RewardModel(backbone, pad_token_id=tokenizer.pad_token_id, num_padding_at_beginning=npb)
    match_partitioned_dtype(model)  # the value head is made after zero.Init cast the backbone
    return model


def is_reward_checkpoint(path: str | Path) -> bool:
    path = Path(path)
    return (path / MARKER_FILE).exists() or (path / "pytorch_model.bin").exists() and \
        not (path / "model.safetensors").exists() and _bin_has_v_head(path / "pytorch_model.bin")


def _bin_has_v_head(path: Path) -> bool:
    try:
        return "v_head.weight" in torch.load(path, map_location="cpu", weights_only=True)
    except Exception:  # noqa: BLE001 - an unreadable file is reported by the loader
        return False


def _read_weights(folder: Path) -> dict[str, torch.Tensor]:
    if (folder / "model.safetensors").exists():
        from safetensors.torch import load_file
        try:
            return load_file(str(folder / "model.safetensors"))
        except Exception as e:  # noqa: BLE001 - safetensors raises several types
            raise UserInputError(f"{folder / 'model.safetensors'}: unreadable ({e})") from None
    if (folder / "pytorch_model.bin").exists():
        try:
            return torch.load(folder / "pytorch_model.bin", map_location="cpu", weights_only=True)
        except Exception as e:  # noqa: BLE001
            raise UserInputError(f"{folder / 'pytorch_model.bin'}: unreadable ({e})") from None
    raise UserInputError(f"{folder}: no model.safetensors or pytorch_model.bin")


def load_reward_model(path: str | Path, tokenizer, *, dropout: float | None = None,
                      flag: str = "reward model path", attn_implementation: str = "sdpa",
                      ds_config: dict | None = None) -> RewardModel:
    """Load a reward model folder (ours or DS-Chat's); keys must match exactly.

    Upstream loads critics ignoring mismatched keys, so a wrong path silently trains from
    random weights; here any missing or unexpected key is an error that lists them.

    The backbone's parameters are built without storage and take the file's tensors,
    converted to `ds_config`'s training dtype (`weights_dtype`; fp32 without a config): no
    random init and no second copy of the weights on the host.
    """
    from accelerate import init_empty_weights

    from dschat.engine.config import weights_dtype
    folder = Path(path)
    if not folder.is_dir():
        raise UserInputError(f"{flag} {path}: no such folder")
    if not has_weights(folder):
        raise UserInputError(f"{flag} {path}: no weights (model.safetensors or pytorch_model.bin)")
    state = _read_weights(folder)
    if "v_head.weight" not in state:
        hint = (" - it looks like a causal-LM checkpoint (step-1 output?); train a reward model "
                "with step 2 and pass its output folder") if any(k.startswith(("transformer.", "model.", "lm_head"))
                                                                  for k in state) else ""
        raise UserInputError(f"{flag} {path} is not a reward model: no v_head.weight{hint}")
    config = load_config(str(folder))
    from dschat.models.model_utils import apply_dropout
    apply_dropout(config, dropout)
    with init_empty_weights(include_buffers=False):   # buffers (e.g. rotary tables) are computed, not loaded
        backbone = AutoModel.from_config(config, dtype=torch.float32, **hf_attn_kwargs(attn_implementation))
    use_attention(backbone, attn_implementation)
    marker = {}
    if (folder / MARKER_FILE).exists():
        marker = json.loads((folder / MARKER_FILE).read_text())
    npb = marker.get("num_padding_at_beginning", family_of(config).num_padding_at_beginning)
    model = RewardModel(backbone, pad_token_id=tokenizer.pad_token_id, num_padding_at_beginning=npb)
    want = set(model.state_dict())
    buffers = {n for n, _ in model.named_buffers()}
    # old HF versions saved a few constant buffers; they are not weights
    state = {k: v for k, v in state.items() if k in want or not k.endswith(STALE_BUFFERS)}
    missing, unexpected = sorted(want - set(state) - buffers), sorted(set(state) - want)
    if missing or unexpected:
        raise UserInputError(
            f"{flag} {path}: weights do not fit a {config.model_type} reward model; "
            f"missing keys: {missing[:8]}{' ...' if len(missing) > 8 else ''}; "
            f"unexpected keys: {unexpected[:8]}{' ...' if len(unexpected) > 8 else ''}")
    # every parameter has its tensor now (the key checks above); the buffers were never empty
    dtype = weights_dtype(ds_config)
    state = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}
    model.load_state_dict(state, strict=False, assign=True)
    return model


def save_reward_model(model, tokenizer, output_dir: str | Path, *, rank: int = 0,
                      extra: dict | None = None) -> None:
    """Write a reward-model folder from a RewardModel or its DeepSpeed engine (collective
    under ZeRO-3: every rank must call; see `save_hf_format` for why the engine)."""
    from safetensors.torch import save_file

    from dschat.engine.zero import engine_and_module, full_state_dict
    from dschat.models.lora import merged_state_dict

    full = full_state_dict(model, rank=rank)
    fault_point("hf_save", 1)
    _, module = engine_and_module(model)
    if rank != 0:
        return
    prefix = "rwtransformer."
    # popped from `full`, so that the merge can free each base weight as it copies it
    backbone_state = merged_state_dict(module.rwtransformer, {
        k[len(prefix):]: full.pop(k) for k in [k for k in full if k.startswith(prefix)]})
    state = {prefix + k: v.contiguous() for k, v in backbone_state.items()}
    state["v_head.weight"] = full["v_head.weight"].contiguous()
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    save_file(state, str(output_dir / "model.safetensors"), metadata={"format": "pt"})
    backbone = module.rwtransformer
    base = backbone.get_base_model() if hasattr(backbone, "get_base_model") else backbone
    save_tokenizer_and_config(base.config, tokenizer, output_dir)
    marker = dict(MARKER, model_type=base.config.model_type,
                  num_padding_at_beginning=module.num_padding_at_beginning, **(extra or {}))
    (output_dir / MARKER_FILE).write_text(json.dumps(marker, indent=2, sort_keys=True))


"""Batch collators of the three steps.

Step 1 (and ptx blocks): `DataCollatorSFT` stacks the already padded items (it is what
`transformers.default_data_collator` would do for these items, without the import).
Step 2: `DataCollatorReward` puts the B chosen rows first, then the B rejected rows.
Step 3: `DataCollatorRLHF` left-pads the prompts to `max_prompt_len` for generation.
"""
from __future__ import annotations

import torch

from dschat.data.tokenize import pad_left


class DataCollatorSFT:
    """Stack each key of equally shaped items: {key: [B, L]}."""

    def __call__(self, features: list[dict]) -> dict[str, torch.Tensor]:
        return {key: torch.stack([f[key] for f in features]) for key in features[0]}


class DataCollatorReward:
    """{input_ids, attention_mask}: [2B, L], rows 0..B-1 chosen, rows B..2B-1 rejected."""

    def __call__(self, features: list[dict]) -> dict[str, torch.Tensor]:
        return {
            "input_ids": torch.stack([f["chosen_input_ids"] for f in features]
                                     + [f["rejected_input_ids"] for f in features]),
            "attention_mask": torch.stack([f["chosen_attention_mask"] for f in features]
                                          + [f["rejected_attention_mask"] for f in features]),
        }


class DataCollatorRLHF:
    """{prompt, prompt_att_mask}: [B, max_prompt_len], left-padded with `pad_token_id`;
    items with "fields" (the rows' other columns) add "fields": a list of B dicts."""

    def __init__(self, max_prompt_len: int, pad_token_id: int):
        self.max_prompt_len = max_prompt_len
        self.pad_token_id = pad_token_id

    def __call__(self, features: list[dict]) -> dict[str, torch.Tensor]:
        ids, masks = [], []
        for f in features:
            prompt = f["prompt_input_ids"]
            if prompt.numel() > self.max_prompt_len:
                # The dataset drops such prompts; meeting one means mismatched lengths.
                raise ValueError(f"prompt of {prompt.numel()} tokens is longer than "
                                 f"max_prompt_len {self.max_prompt_len}")
            padded, mask = pad_left(prompt, self.max_prompt_len, self.pad_token_id)
            ids.append(padded)
            masks.append(mask)
        out = {"prompt": torch.stack(ids), "prompt_att_mask": torch.stack(masks)}
        if "fields" in features[0]:
            out["fields"] = [f["fields"] for f in features]
        return out

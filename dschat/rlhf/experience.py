"""One PPO rollout batch (DS-Chat's experience dict) as a dataclass with shapes.

Layout follows `dschat.rlhf.ppo_math`: prompts left-padded to width P, answers
right-padded to width A, ``seq = [prompts | answers]``; every per-token field is
``[B, A]`` and entry ``a`` belongs to answer token ``seq[:, P + a]``.
"""
from dataclasses import dataclass, fields, replace
from typing import List, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

# Fields indexed by answer position ([B, A]); concat pads them on the right.
_ANSWER_FIELDS = ("action_mask", "logprobs", "ref_logprobs", "values", "advantages", "returns")


@dataclass
class Experience:
    """A generation batch scored by actor, reference, critic and reward model."""

    prompts: Tensor            # [B, P]   long, prompt ids left-padded to width P
    seq: Tensor                # [B, P+A] long, prompts followed by answers right-padded to A
    attention_mask: Tensor     # [B, P+A] long/bool, 1 on real (non-pad) tokens of seq
    action_mask: Tensor        # [B, A]   1 on real answer tokens (attention_mask[:, P:])
    logprobs: Tensor           # [B, A]   fp32, actor log p(answer token) at generation time
    ref_logprobs: Tensor       # [B, A]   fp32, reference-model log p(answer token)
    values: Tensor             # [B, A]   fp32, critic value of the state before each answer token (0 without a critic)
    rewards: Tensor            # [B]      fp32, reward-model score of the whole sequence (unclipped)
    prompt_lens: Tensor        # [B]      long, real (non-pad) prompt tokens per row; answers start at column P
    advantages: Optional[Tensor] = None  # [B, A] fp32, GAE (or critic-free) advantages, None until computed
    returns: Optional[Tensor] = None     # [B, A] fp32, advantages + values (critic-free: returns of
    #                                      REINFORCE++, else the advantages), None until computed

    def __post_init__(self):
        self.validate()

    # ------------------------------------------------------------------ shape helpers
    @property
    def batch_size(self) -> int:
        return self.seq.shape[0]

    @property
    def prompt_width(self) -> int:
        """P: the common (padded) prompt width; answers start at this column of seq."""
        return self.prompts.shape[1]

    @property
    def answer_width(self) -> int:
        """A: the common (padded) answer width."""
        return self.action_mask.shape[1]

    def __len__(self) -> int:
        return self.batch_size

    def validate(self) -> None:
        """Raise ValueError if any field disagrees with the [B, P] / [B, P+A] / [B, A] layout."""
        b, p = self.prompts.shape
        a = self.action_mask.shape[1] if self.action_mask.dim() == 2 else -1
        expected = {"prompts": (b, p), "seq": (b, p + a), "attention_mask": (b, p + a),
                    "rewards": (b,), "prompt_lens": (b,)}
        expected.update({name: (b, a) for name in _ANSWER_FIELDS})
        for name, shape in expected.items():
            value = getattr(self, name)
            if value is not None and tuple(value.shape) != shape:
                raise ValueError(f"Experience.{name} has shape {tuple(value.shape)}, expected "
                                 f"{shape} (B={b}, P={p}, A={a})")

    def _map(self, fn) -> "Experience":
        """A new Experience with ``fn`` applied to every tensor field (None stays None)."""
        return replace(self, **{f.name: fn(getattr(self, f.name)) for f in fields(self)
                                if getattr(self, f.name) is not None})

    # ------------------------------------------------------------------ public API
    def to(self, device) -> "Experience":
        """Copy of the batch with every tensor moved to ``device``."""
        return self._map(lambda t: t.to(device))

    def detach(self) -> "Experience":
        """Copy of the batch with every tensor detached from the autograd graph."""
        return self._map(lambda t: t.detach())

    def select(self, rows: Tensor) -> "Experience":
        """The rows ``rows`` ([K] long indices or [B] bool) of the batch, in that order."""
        return self._map(lambda t: t[rows.to(t.device)])

    def split(self, micro_batch_size: int) -> List["Experience"]:
        """Rows cut into consecutive micro-batches of ``micro_batch_size`` (the last may be smaller).

        Upstream's MiniDataset does this to a generation batch before the PPO epochs
        (per_device_generation_batch_size -> per_device_training_batch_size).
        """
        if micro_batch_size < 1:
            raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
        return [self._map(lambda t, s=start: t[s:s + micro_batch_size])
                for start in range(0, self.batch_size, micro_batch_size)]

    @staticmethod
    def concat(items: Sequence["Experience"], pad_token_id: int = 0) -> "Experience":
        """Rows of several batches stacked into one.

        Batches of different widths are padded to the widest: prompt columns on the left
        with ``pad_token_id`` (attention 0), answer columns on the right (ids
        ``pad_token_id``, masks and per-token values 0). ``advantages``/``returns`` are
        kept only if every batch has them.
        """
        items = list(items)
        if not items:
            raise ValueError("Experience.concat needs at least one batch")
        p = max(e.prompt_width for e in items)
        a = max(e.answer_width for e in items)
        padded = [_pad_to(e, p, a, pad_token_id) for e in items]
        out = {}
        for f in fields(Experience):
            parts = [getattr(e, f.name) for e in padded]
            out[f.name] = None if any(t is None for t in parts) else torch.cat(parts, dim=0)
        return Experience(**out)


def _pad_to(exp: Experience, p: int, a: int, pad_token_id: int) -> Experience:
    """``exp`` padded to prompt width ``p`` (left) and answer width ``a`` (right)."""
    dp, da = p - exp.prompt_width, a - exp.answer_width
    if dp == 0 and da == 0:
        return exp

    def pad_seq(t: Tensor, value) -> Tensor:
        prompt = F.pad(t[:, :exp.prompt_width], (dp, 0), value=value)
        answer = F.pad(t[:, exp.prompt_width:], (0, da), value=value)
        return torch.cat([prompt, answer], dim=1)

    changes = {"prompts": F.pad(exp.prompts, (dp, 0), value=pad_token_id),
               "seq": pad_seq(exp.seq, pad_token_id),
               "attention_mask": pad_seq(exp.attention_mask, 0)}
    for name in _ANSWER_FIELDS:
        value = getattr(exp, name)
        if value is not None:
            changes[name] = F.pad(value, (0, da), value=0)
    return replace(exp, **changes)

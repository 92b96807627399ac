"""Critic-free policy-gradient maths for step 3 (GRPO, Dr.GRPO, RLOO, REINFORCE++, DAPO) as
pure tensor functions, tested against hand-computed numbers (tests/test_estimators.py).

Per-token tensors use ppo_math's answer layout: ``[B, T]`` with one entry per answer token
and ``mask[B, T]`` 1 on real answer tokens (see dschat.rlhf.ppo_math). Like ppo_math, nothing
here talks to other ranks: statistics are over the tensors passed in.

Group layout convention (GRPO, RLOO, `filter_groups`)
-----------------------------------------------------
A batch of ``B = G * group_size`` rows holds ``group_size`` answers to each of ``G``
prompts, **contiguously**: row ``i`` belongs to group ``i // group_size`` (prompt-major,
what ``prompts.repeat_interleave(group_size, 0)`` gives). A group must not be split across
ranks or micro-batches when its advantages are computed.

Sign convention of the KL estimators (`kl_estimate`)
----------------------------------------------------
Answers are sampled from the actor ``pi``; the penalty estimates ``KL(pi || pi_ref)``.
With ``log r = ref_logprobs - logprobs`` (``r = pi_ref(x) / pi(x)``, Schulman 2020,
http://joschu.net/blog/kl-approx.html):

* ``k1 = -log r = logprobs - ref_logprobs``  unbiased, can be negative (ppo_math.approx_kl)
* ``k2 = 0.5 * (log r) ** 2``                 biased, >= 0
* ``k3 = (r - 1) - log r``                    unbiased, >= 0 (GRPO's KL term)
"""
from __future__ import annotations

import math
from typing import Optional, Tuple

import torch
from torch import Tensor

from dschat.rlhf.ppo_math import clipped_ratio_terms, last_token_index, masked_mean, masked_sum_count, masked_whiten

__all__ = [
    "group_advantages", "rloo_advantages", "reinforce_pp_returns", "reinforce_pp_advantages",
    "broadcast_to_tokens", "KL_KINDS", "kl_estimate", "LOSS_AGG_MODES", "aggregate_loss",
    "clipped_policy_loss", "clip_fractions", "AdaptiveKLController", "FixedKLController", "filter_groups",
    "overlong_penalty",
]

KL_KINDS = ("k1", "k2", "k3")
LOSS_AGG_MODES = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm")


# ---------------------------------------------------------------------------- groups

def _grouped(rewards: Tensor, group_size: int, min_size: int = 1) -> Tensor:
    """``rewards [B]`` -> ``[G, group_size]`` fp32 under the contiguous group layout."""
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [B], got shape {tuple(rewards.shape)}")
    if group_size < min_size:
        raise ValueError(f"group_size {group_size} must be >= {min_size}")
    if rewards.shape[0] % group_size:
        raise ValueError(f"batch of {rewards.shape[0]} rows is not a whole number of groups "
                         f"of {group_size}")
    return rewards.float().view(-1, group_size)


def group_advantages(rewards: Tensor, group_size: int, *, std_norm: bool = True,
                     eps: float = 1e-6) -> Tensor:
    """GRPO advantages: ``rewards [B]`` -> ``[B]`` fp32, detached.

    ``adv = (r - mean_group) / (std_group + eps)``; ``std_norm=False`` gives Dr.GRPO's
    ``adv = r - mean_group`` (no division: the std scaling favours groups that are nearly
    all right or all wrong). The std is the *unbiased* (Bessel, ``n - 1``) one, as TRL's
    GRPOTrainer uses (``torch.std``'s default), so advantages match TRL for the same eps
    (TRL adds 1e-4). A group whose rewards are all equal gets advantage 0. group_size >= 2.
    """
    grouped = _grouped(rewards.detach(), group_size, min_size=2)
    adv = grouped - grouped.mean(dim=1, keepdim=True)
    if std_norm:
        adv = adv / (grouped.std(dim=1, keepdim=True) + eps)
    return adv.reshape(-1)


def rloo_advantages(rewards: Tensor, group_size: int) -> Tensor:
    """RLOO advantages: ``rewards [B]`` -> ``[B]`` fp32, detached.

    Each row's baseline is the mean of the *other* ``group_size - 1`` rows of its group:
    ``adv_i = r_i - (sum_group - r_i) / (k - 1)`` (= ``k / (k - 1) * (r_i - mean_group)``).
    group_size >= 2 (with one answer per prompt there is no one else to compare with).
    """
    grouped = _grouped(rewards.detach(), group_size, min_size=2)
    others = (grouped.sum(dim=1, keepdim=True) - grouped) / (group_size - 1)
    return (grouped - others).reshape(-1)


def filter_groups(rewards: Tensor, group_size: int, atol: float = 0.0) -> Tensor:
    """DAPO dynamic sampling: ``rewards [B]`` -> keep ``[G]`` bool, False where every reward
    of the group is equal (within ``atol``): such a group has zero advantage everywhere and
    only dilutes the batch. Rows to keep: ``keep.repeat_interleave(group_size)``.

    How a trainer refills (DAPO): keep the kept groups of this generation round, generate
    another round of fresh prompts and append their kept groups, until ``G_target`` groups
    are collected (then drop the surplus), or a cap on rounds is reached (then train on
    what there is, or skip the step; all ranks must decide alike).
    """
    grouped = _grouped(rewards.detach(), group_size)
    spread = grouped.amax(dim=1) - grouped.amin(dim=1)
    return spread > atol


# ---------------------------------------------------------------------------- tokens

def broadcast_to_tokens(adv: Tensor, mask: Tensor) -> Tensor:
    """Sequence advantages ``[B]`` -> ``[B, T]``: each row's value on its answer tokens, 0
    where ``mask [B, T]`` is 0."""
    keep = mask.bool()
    out = adv.float().unsqueeze(1).expand(keep.shape)
    return torch.where(keep, out, torch.zeros((), dtype=out.dtype, device=out.device))


def reinforce_pp_returns(token_rewards: Tensor, mask: Tensor, gamma: float = 1.0) -> Tensor:
    """Discounted return-to-go ``G_t = r_t + gamma * G_{t+1}``: ``[B, T]``, ``[B, T]`` ->
    ``[B, T]`` fp32, detached. As in ppo_math.compute_gae, a masked position gets 0 and is a
    boundary: nothing after it flows back into earlier tokens."""
    rewards = token_rewards.detach().float()
    keep = mask.to(rewards.dtype)
    running = torch.zeros_like(rewards[:, 0])
    returns = torch.zeros_like(rewards)
    for t in reversed(range(rewards.shape[1])):
        running = (rewards[:, t] + gamma * running) * keep[:, t]
        returns[:, t] = running
    return returns


def reinforce_pp_advantages(scores: Tensor, logprobs: Tensor, ref_logprobs: Tensor, mask: Tensor,
                            kl_coef: float, gamma: float = 1.0, kl_kind: str = "k1",
                            clip_reward_value: float = math.inf) -> Tuple[Tensor, Tensor]:
    """REINFORCE++ (Hu 2025): ``(advantages [B, T], returns [B, T])``, detached fp32.

    scores ``[B]`` (sequence rewards); logprobs, ref_logprobs, mask ``[B, T]``. Token rewards
    are ``-kl_coef * kl_estimate(kind)`` on every answer token plus the clamped score on the
    last valid token (as ppo_math.compute_kl_rewards, which this equals for k1); returns are
    their discounted return-to-go; advantages are the returns whitened (mean 0, unbiased
    std 1) over all valid tokens of the batch: the batch replaces a critic as baseline.
    A row with no answer token gets no score. Whitening uses this rank's tokens only.
    """
    keep = mask.bool()
    kl = kl_estimate(logprobs.detach(), ref_logprobs.detach(), kl_kind)
    rewards = torch.where(keep, -kl_coef * kl, torch.zeros((), dtype=kl.dtype, device=kl.device))
    last = last_token_index(mask)
    rows = torch.nonzero(last >= 0).squeeze(1)
    score = scores.detach().float().clamp(-clip_reward_value, clip_reward_value)
    rewards[rows, last[rows]] += score[rows]
    returns = reinforce_pp_returns(rewards, mask, gamma)
    return masked_whiten(returns, mask), returns


# ---------------------------------------------------------------------------- KL

def kl_estimate(logprobs: Tensor, ref_logprobs: Tensor, kind: str = "k3") -> Tensor:
    """Per-token estimate of KL(actor || reference) at the sampled tokens: ``[B, T]`` x 2 ->
    ``[B, T]`` fp32, differentiable w.r.t. both inputs; apply the mask when aggregating.

    With ``d = ref_logprobs - logprobs`` (= log r, r = pi_ref / pi):
    k1 = -d;  k2 = d**2 / 2;  k3 = exp(d) - 1 - d   (d clamped to [-20, 20] in k3 so exp
    cannot overflow on a token the reference finds absurd; the gradient is 0 past it).

    Gradients w.r.t. logprobs: k1 -> 1, k2 -> -d, k3 -> 1 - r. Used as a loss term on
    on-policy samples (sampling not differentiated), in expectation k1's gradient is 0,
    k2's is the gradient of KL(pi || pi_ref) and k3's that of KL(pi_ref || pi) (the forward
    KL; checked in tests/test_estimators.py).
    """
    if kind not in KL_KINDS:
        raise ValueError(f"KL estimator {kind!r}: expected one of {', '.join(KL_KINDS)}")
    d = ref_logprobs.float() - logprobs.float()
    if kind == "k1":
        return -d
    if kind == "k2":
        return 0.5 * d ** 2
    d = d.clamp(-20.0, 20.0)
    return torch.exp(d) - 1.0 - d


# ---------------------------------------------------------------------------- losses

def aggregate_loss(loss: Tensor, mask: Tensor, mode: str = "token_mean",
                   norm_len: Optional[float] = None) -> Tensor:
    """Per-token loss ``[B, T]`` -> scalar, over entries where ``mask [B, T]`` is 1.

    * ``token_mean``: sum over all valid tokens / their count (every token weighs the same;
      long answers weigh more in total; DAPO).
    * ``seq_mean_token_mean``: mean over each row's tokens, then over rows (GRPO's paper:
      every answer weighs the same, so a token of a long answer weighs less).
    * ``seq_mean_token_sum_norm``: each row's token sum / ``norm_len`` (a constant such as
      the generation's max new tokens), then mean over rows (Dr.GRPO: no length bias).

    Rows without a valid token are left out of the "mean over rows" (the trainer keeps such
    rows with a zeroed mask). Empty input gives 0. With micro-batches or ranks, token_mean
    must be divided by the global token count (ppo_math.masked_sum_count) to be exact.
    """
    if mode == "token_mean":
        return masked_mean(loss, mask)
    rows = mask.bool().any(dim=1)
    if mode == "seq_mean_token_mean":
        return masked_mean(masked_mean(loss, mask, dim=1), rows)
    if mode == "seq_mean_token_sum_norm":
        if norm_len is None or norm_len <= 0:
            raise ValueError(f"loss aggregation {mode} needs a positive norm_len, got {norm_len}")
        return masked_mean(masked_sum_count(loss, mask, dim=1)[0] / norm_len, rows)
    raise ValueError(f"loss aggregation {mode!r}: expected one of {', '.join(LOSS_AGG_MODES)}")


def clipped_policy_loss(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor,
                        cliprange_low: float = 0.2, cliprange_high: float = 0.2,
                        agg: str = "token_mean", norm_len: Optional[float] = None
                        ) -> Tuple[Tensor, Tensor]:
    """Clipped-ratio policy loss with DAPO's clip-higher: ``(loss [], clip_fraction [])``.

    logprobs, old_logprobs, mask ``[B, T]``; advantages ``[B, T]`` or ``[B]`` (broadcast to
    the answer tokens). ``r = exp(logprobs - old_logprobs)`` is clipped to
    ``[1 - cliprange_low, 1 + cliprange_high]``; per token ``max(-A r, -A clip(r))``, then
    `aggregate_loss(agg, norm_len)`. ``clip_fraction`` is the share of valid tokens where
    the clipped term is the larger one (zero gradient), detached. With low == high and
    token_mean this is ppo_math.actor_loss.
    """
    if advantages.dim() == 1:
        advantages = broadcast_to_tokens(advantages, mask)
    unclipped, clipped = clipped_ratio_terms(logprobs, old_logprobs, advantages, mask, cliprange_low, cliprange_high)
    loss = aggregate_loss(torch.max(unclipped, clipped), mask, agg, norm_len)
    clip_fraction = masked_mean((clipped > unclipped).float(), mask)
    return loss, clip_fraction.detach()


def clip_fractions(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor,
                   cliprange_low: float = 0.2, cliprange_high: float = 0.2) -> Tuple[Tensor, Tensor]:
    """``(low [], high [])``: shares of valid tokens whose update the clip stops, on each
    side: ``ratio < 1 - low`` with a negative advantage, ``ratio > 1 + high`` with a
    positive one (their sum is `clipped_policy_loss`'s clip fraction). Detached fp32;
    advantages ``[B, T]`` or ``[B]``; DAPO's clip-higher watches the high side."""
    if advantages.dim() == 1:
        advantages = broadcast_to_tokens(advantages, mask)
    keep = mask.bool()
    log_ratio = torch.where(keep, logprobs.detach().float() - old_logprobs.detach().float(),
                            torch.zeros((), device=logprobs.device))
    ratio = torch.exp(log_ratio)
    adv = advantages.detach().float()
    low = masked_mean(((ratio < 1.0 - cliprange_low) & (adv < 0)).float(), mask)
    high = masked_mean(((ratio > 1.0 + cliprange_high) & (adv > 0)).float(), mask)
    return low, high


# ---------------------------------------------------------------------------- KL coefficient

class AdaptiveKLController:
    """Ziegler et al. 2019's adaptive KL coefficient (``.value``).

    ``update(current_kl, n_steps)``: ``e = clip(current_kl / target - 1, -0.2, 0.2)``,
    ``value *= 1 + e * n_steps / horizon``: the coefficient grows while the measured KL is
    above ``target`` and shrinks below it, by at most 20% per ``horizon`` steps.
    """

    def __init__(self, init_kl_coef: float, target: float, horizon: float):
        if target <= 0 or horizon <= 0:
            raise ValueError(f"adaptive KL needs target > 0 and horizon > 0, got {target}, {horizon}")
        self.value = float(init_kl_coef)
        self.target = float(target)
        self.horizon = float(horizon)

    def update(self, current_kl: float, n_steps: int) -> float:
        error = min(max(float(current_kl) / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon
        return self.value


class FixedKLController:
    """A constant KL coefficient with `AdaptiveKLController`'s interface."""

    def __init__(self, kl_coef: float):
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> float:
        return self.value


# ---------------------------------------------------------------------------- shaping

def overlong_penalty(lengths: Tensor, max_len: int, buffer_len: int,
                     penalty_factor: float = 1.0) -> Tensor:
    """DAPO's soft overlong punishment: answer lengths ``[B]`` -> reward to add ``[B]`` fp32.

    0 up to ``max_len - buffer_len`` tokens, then linear down to ``-penalty_factor`` at
    ``max_len`` (and beyond). ``buffer_len`` 0 gives a hard ``-penalty_factor`` past max_len.
    """
    if not 0 <= buffer_len <= max_len:
        raise ValueError(f"overlong buffer {buffer_len} must be in [0, max_len {max_len}]")
    lengths = lengths.float()
    if buffer_len == 0:
        return torch.where(lengths > max_len, -float(penalty_factor), 0.0)
    excess = (lengths - (max_len - buffer_len)).clamp(0, buffer_len)
    return -excess / buffer_len * penalty_factor

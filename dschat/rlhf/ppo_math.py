"""PPO maths of DeepSpeed-Chat step 3 as pure tensor functions.

No torch.distributed, no deepspeed: every function works on the tensors of one rank and is
tested against hand-computed numbers (tests/test_ppo_math.py).

Answer-slice convention (used by every per-token tensor here and in `Experience`)
-------------------------------------------------------------------------------
A generated sequence is ``seq = [prompt | answer]`` of width ``L = P + A``: prompts are
left-padded to a common width ``P`` so every answer starts at column ``P``; answers are
right-padded to width ``A``. A per-token PPO tensor of shape ``[B, A]`` has one entry per
answer token: entry ``a`` belongs to the action "emit ``seq[:, P + a]``", taken in the
state ``seq[:, :P + a]``. So

* ``logprobs[:, a]``  = log p(seq[:, P+a] | seq[:, :P+a]) = next-token prediction made at
  column ``P - 1 + a`` of the model output;
* ``values[:, a]``    = critic value read at column ``P - 1 + a`` (the state before the
  token is emitted);
* ``rewards[:, a]``   = reward for emitting answer token ``a``;
* ``action_mask[:, a]`` = 1 where answer token ``a`` is a real token (``attention_mask[:, P:]``).

`answer_slice(x, P)` turns any per-column model output ``[B, L, ...]`` (logits, values) into
this ``[B, A, ...]`` layout, and `answer_tokens(seq, P)` gives the matching labels. Upstream
works on the full ``[B, L-1]`` next-token tensors and slices from ``P - 1``; the two agree
position for position (test_answer_slice_matches_upstream_layout).

One deliberate difference from upstream: upstream puts the reward score one position past
the last answer token (its ``ends = start + mask.sum() + 1``), i.e. on the prediction of the
first pad, and GAE then carries it back. Here the score lands on the last answer token that
is really in the sequence (the last ``action_mask == 1`` position).
"""
from typing import Iterable, Optional, Tuple

import torch
from torch import Tensor

from dschat.utils.tensor_ops import gather_log_probs  # one copy, re-exported with step 3's maths

__all__ = [
    "answer_slice", "answer_tokens", "action_mask_from_attention",
    "gather_log_probs", "entropy_from_logits",
    "masked_sum_count", "masked_mean", "masked_whiten", "last_token_index",
    "compute_kl_rewards", "compute_gae", "actor_loss", "critic_loss", "approx_kl",
    "ema_update_",
]


# ---------------------------------------------------------------------------- layout

def answer_slice(x: Tensor, prompt_width: int) -> Tensor:
    """Per-column model output ``[B, L, ...]`` -> the answer-action layout ``[B, A, ...]``.

    Keeps columns ``P-1 .. L-2`` (A = L - P of them): column ``P-1+a`` is where the model
    predicts answer token ``a`` (logits) or values the state before it (critic).
    """
    if not 1 <= prompt_width < x.shape[1]:
        raise ValueError(f"prompt_width {prompt_width} must be in [1, {x.shape[1] - 1}] "
                         f"for a sequence of width {x.shape[1]}")
    return x[:, prompt_width - 1:-1]


def answer_tokens(seq: Tensor, prompt_width: int) -> Tensor:
    """Token ids ``[B, L]`` -> answer tokens ``[B, A]`` (the labels for `answer_slice` logits)."""
    return seq[:, prompt_width:]


def action_mask_from_attention(attention_mask: Tensor, prompt_width: int) -> Tensor:
    """Attention mask ``[B, L]`` -> action mask ``[B, A]`` (1 on real answer tokens)."""
    return attention_mask[:, prompt_width:]


# ---------------------------------------------------------------------------- logits

def entropy_from_logits(logits: Tensor) -> Tensor:
    """Entropy of the next-token distribution: logits ``[B, T, V]`` -> ``[B, T]`` fp32."""
    logits = logits.float()
    probs = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (probs * logits).sum(-1)


# ---------------------------------------------------------------------------- masking

def masked_sum_count(x: Tensor, mask: Tensor, dim: Optional[int] = None) -> Tuple[Tensor, Tensor]:
    """Masked sum of ``x`` and the number of unmasked entries (``x``, ``mask`` same shape).

    The pair is what ranks must all-reduce to get the global masked mean
    (``sum(sums) / sum(counts)``); averaging per-rank means weights ranks, not tokens.
    Masked entries never leak, even if they hold NaN or inf.
    """
    keep = mask.bool()
    total = torch.where(keep, x, torch.zeros((), dtype=x.dtype, device=x.device))
    if dim is None:
        return total.sum(), keep.sum().to(x.dtype)
    return total.sum(dim), keep.sum(dim).to(x.dtype)


def masked_mean(x: Tensor, mask: Tensor, dim: Optional[int] = None) -> Tensor:
    """Mean of ``x`` over entries where ``mask`` is 1 (all of them, or along ``dim``).

    ``x`` and ``mask`` have the same shape; an all-masked reduction gives 0, not NaN.
    """
    total, count = masked_sum_count(x, mask, dim)
    return total / count.clamp(min=1)


def masked_whiten(x: Tensor, mask: Tensor, shift_mean: bool = True, eps: float = 1e-8) -> Tensor:
    """Normalise ``x`` to zero mean, unit (unbiased) variance over unmasked entries.

    Same shape as ``x``; masked entries are 0. With ``shift_mean=False`` the mean is added
    back (scale only). Statistics are this rank's only.
    """
    mean = masked_mean(x, mask)
    count = mask.bool().sum()
    sq = masked_sum_count((x - mean) ** 2, mask)[0]
    var = sq / (count - 1).clamp(min=1)
    out = (x - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        out = out + mean
    return torch.where(mask.bool(), out, torch.zeros((), dtype=out.dtype, device=out.device))


def last_token_index(mask: Tensor) -> Tensor:
    """Index of the last 1 in each row of ``mask [B, A]`` -> ``[B]`` long; -1 for empty rows."""
    keep = mask.bool()
    width = keep.shape[1]
    positions = torch.arange(width, device=mask.device).expand_as(keep)
    return torch.where(keep, positions, torch.full_like(positions, -1)).amax(dim=1)


# ---------------------------------------------------------------------------- PPO

def compute_kl_rewards(logprobs: Tensor, ref_logprobs: Tensor, reward_score: Tensor,
                       action_mask: Tensor, kl_ctl: float, clip_reward_value: float) -> Tensor:
    """Per-token rewards ``[B, A]`` from the KL penalty plus the clipped reward score.

    logprobs, ref_logprobs, action_mask: ``[B, A]``; reward_score: ``[B]``.
    ``rewards = -kl_ctl * (logprobs - ref_logprobs)`` on answer tokens (0 where masked),
    plus ``clamp(reward_score, -clip, clip)`` on the last answer token of each row (the
    last ``action_mask == 1`` position). A row with no answer token gets no score.
    Upstream: kl_ctl 0.1, clip_reward_value 5.
    """
    keep = action_mask.bool()
    kl = -kl_ctl * (logprobs.float() - ref_logprobs.float())
    rewards = torch.where(keep, kl, torch.zeros((), dtype=kl.dtype, device=kl.device))
    score = reward_score.float().clamp(-clip_reward_value, clip_reward_value)
    last = last_token_index(action_mask)
    rows = torch.nonzero(last >= 0).squeeze(1)
    rewards[rows, last[rows]] += score[rows]
    return rewards


def compute_gae(values: Tensor, rewards: Tensor, action_mask: Tensor, gamma: float = 1.0,
                lam: float = 0.95, whiten_advantages: bool = False) -> Tuple[Tensor, Tensor]:
    """Generalised advantage estimation, from the end of the answer backwards.

    values, rewards, action_mask: ``[B, A]`` -> ``(advantages [B, A], returns [B, A])``,
    both detached. ``delta_t = r_t + gamma * V_{t+1} - V_t``,
    ``adv_t = delta_t + gamma * lam * adv_{t+1}``, ``returns = adv + values``.
    A masked position has advantage and return 0 and acts as a boundary: nothing beyond
    it (its value, later rewards) flows back into earlier positions. For the usual
    right-padded tail this is upstream's "zero values and rewards after the end".
    ``whiten_advantages`` (off upstream) whitens over this rank's unmasked tokens.
    Upstream: gamma 1.0, lam 0.95.
    """
    values = values.detach().float()
    rewards = rewards.detach().float()
    keep = action_mask.to(values.dtype)
    next_value = torch.zeros_like(values[:, 0])
    running = torch.zeros_like(values[:, 0])
    advantages = torch.zeros_like(values)
    for t in reversed(range(values.shape[1])):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        running = (delta + gamma * lam * running) * keep[:, t]
        advantages[:, t] = running
        next_value = values[:, t] * keep[:, t]
    returns = advantages + values * keep
    if whiten_advantages:
        advantages = masked_whiten(advantages, action_mask)
    return advantages, returns


def clipped_ratio_terms(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor,
                        cliprange_low: float, cliprange_high: float) -> Tuple[Tensor, Tensor]:
    """Per-token ``(-adv * r, -adv * clamp(r, 1 - low, 1 + high))``, all ``[B, A]`` in fp32,
    with ``r = exp(logprobs - old_logprobs)``: the two terms of every clipped-ratio policy
    loss (`actor_loss`, estimators.clipped_policy_loss)."""
    # zero the log-ratio on masked tokens before exp so garbage there cannot overflow
    log_ratio = torch.where(mask.bool(), logprobs.float() - old_logprobs.float(),
                            torch.zeros((), device=logprobs.device))
    ratio = torch.exp(log_ratio)
    advantages = advantages.float()
    return -advantages * ratio, -advantages * torch.clamp(ratio, 1.0 - cliprange_low, 1.0 + cliprange_high)


def actor_loss(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor,
               cliprange: float = 0.2) -> Tuple[Tensor, Tensor]:
    """Clipped-ratio policy loss: all inputs ``[B, A]`` -> ``(loss [], clip_fraction [])``.

    ``loss = masked_mean(max(-adv * r, -adv * clamp(r, 1 - c, 1 + c)))`` with
    ``r = exp(logprobs - old_logprobs)``. ``clip_fraction`` is the share of answer tokens
    where the clipped term is the larger one (so its gradient is zero). Upstream clip 0.2.
    """
    loss_unclipped, loss_clipped = clipped_ratio_terms(logprobs, old_logprobs, advantages, mask,
                                                       cliprange, cliprange)
    loss = masked_mean(torch.max(loss_unclipped, loss_clipped), mask)
    clip_fraction = masked_mean((loss_clipped > loss_unclipped).float(), mask)
    return loss, clip_fraction.detach()


def critic_loss(values: Tensor, old_values: Tensor, returns: Tensor, mask: Tensor,
                cliprange_value: float = 0.2) -> Tuple[Tensor, Tensor]:
    """Clipped value loss: all inputs ``[B, A]`` -> ``(loss [], clip_fraction [])``.

    ``loss = 0.5 * masked_mean(max((V - R)^2, (Vclip - R)^2))`` with
    ``Vclip = clamp(V, V_old - c, V_old + c)``, computed in fp32. ``clip_fraction`` is the
    share of answer tokens where the clipped term is the larger one. Upstream clip 0.2.
    """
    values = values.float()
    old_values = old_values.float()
    returns = returns.float()
    values_clipped = torch.clamp(values, old_values - cliprange_value, old_values + cliprange_value)
    loss_unclipped = (values - returns) ** 2
    loss_clipped = (values_clipped - returns) ** 2
    loss = 0.5 * masked_mean(torch.max(loss_unclipped, loss_clipped), mask)
    clip_fraction = masked_mean((loss_clipped > loss_unclipped).float(), mask)
    return loss, clip_fraction.detach()


def approx_kl(logprobs: Tensor, ref_logprobs: Tensor, mask: Tensor) -> Tensor:
    """KL(actor || reference) estimate for metrics: ``masked_mean(logprobs - ref_logprobs)``.

    All inputs ``[B, A]`` -> scalar (the k1 estimator over sampled answer tokens), detached.
    """
    return masked_mean(logprobs.detach().float() - ref_logprobs.detach().float(), mask)


@torch.no_grad()
def ema_update_(ema_params: Iterable[Tensor], params: Iterable[Tensor], beta: float = 0.992) -> None:
    """In place ``ema = beta * ema + (1 - beta) * param`` over matching plain tensors.

    Both iterables must have the same length and matching shapes; ``params`` are read
    detached and cast to each EMA tensor's dtype. Upstream's actor EMA uses beta 0.992.
    """
    ema_params, params = list(ema_params), list(params)
    if len(ema_params) != len(params):
        raise ValueError(f"ema_update_: {len(ema_params)} EMA tensors for {len(params)} parameters")
    for ema, param in zip(ema_params, params):
        if ema.shape != param.shape:
            raise ValueError(f"ema_update_: EMA shape {tuple(ema.shape)} != parameter shape {tuple(param.shape)}")
        ema.lerp_(param.detach().to(device=ema.device, dtype=ema.dtype), 1.0 - beta)

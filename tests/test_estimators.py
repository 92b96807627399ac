"""Critic-free estimators (dschat.rlhf.estimators) against numbers worked out by hand.

Group layout: row i belongs to group i // group_size. Per-token tensors are [B, T] as in
ppo_math; MASK's second row has its last token masked.
"""
import math

import pytest
import torch

from dschat.rlhf.estimators import (
    AdaptiveKLController,
    FixedKLController,
    aggregate_loss,
    broadcast_to_tokens,
    clipped_policy_loss,
    filter_groups,
    group_advantages,
    kl_estimate,
    overlong_penalty,
    reinforce_pp_advantages,
    reinforce_pp_returns,
    rloo_advantages,
)
from dschat.rlhf.ppo_math import actor_loss, compute_kl_rewards, masked_mean, masked_whiten
from tests.hand_values import LN, MASK, close, t

# ------------------------------------------------------------------------ group advantages

def test_group_advantages_grpo_uses_the_unbiased_std():
    rewards = t([1, 2, 3, 0, 0, 0])
    # group 0: mean 2, unbiased std sqrt((1 + 0 + 1) / 2) = 1; group 1: all equal -> 0
    close(group_advantages(rewards, 3, eps=1e-12), [-1, 0, 1, 0, 0, 0], atol=1e-5)
    # [1, 0]: mean 0.5, unbiased std sqrt(0.5) (the population std 0.5 would give +-1)
    close(group_advantages(t([1, 0]), 2, eps=0.0), [0.5 / math.sqrt(0.5), -0.5 / math.sqrt(0.5)])


def test_group_advantages_match_trl_formula():
    torch.manual_seed(0)
    rewards, k = torch.randn(12), 4
    view = rewards.view(-1, k)  # TRL: (r - mean) / (std + eps), torch.std's default (unbiased)
    trl = (rewards - view.mean(1).repeat_interleave(k)) / (view.std(1).repeat_interleave(k) + 1e-4)
    close(group_advantages(rewards, k, eps=1e-4), trl, atol=1e-6)


def test_dr_grpo_only_subtracts_the_group_mean():
    close(group_advantages(t([1, 2, 3, 4, 4, 10]), 3, std_norm=False), [-1, 0, 1, -2, -2, 4])


def test_rloo_subtracts_the_mean_of_the_others():
    # others' means: 11/3, 10/3, 3, 2
    close(rloo_advantages(t([1, 2, 3, 6]), 4), [1 - 11 / 3, 2 - 10 / 3, 0, 4], atol=1e-6)
    close(rloo_advantages(t([1, 0, 5, 5]), 2), [1, -1, 0, 0])


def test_group_functions_reject_bad_groups():
    for fn in (rloo_advantages, group_advantages):
        with pytest.raises(ValueError, match="group_size 1 must be >= 2"):
            fn(t([1, 2]), 1)
        with pytest.raises(ValueError, match="not a whole number of groups of 2"):
            fn(t([1, 2, 3]), 2)
    with pytest.raises(ValueError, match="1-D"):
        group_advantages(torch.zeros(2, 2), 2)


def test_group_advantages_split_by_whole_groups_equals_full_batch():
    torch.manual_seed(1)
    rewards = torch.randn(8)
    for fn in (group_advantages, rloo_advantages):
        close(torch.cat([fn(rewards[:4], 2), fn(rewards[4:], 2)]), fn(rewards, 2))


def test_filter_groups_drops_groups_with_equal_rewards():
    rewards = t([1, 1, 1, 0, 1, 0, 2, 2, 2])
    keep = filter_groups(rewards, 3)
    assert keep.tolist() == [False, True, False]
    assert keep.repeat_interleave(3).tolist() == [False] * 3 + [True] * 3 + [False] * 3
    assert filter_groups(t([1.0, 1.05, 0, 1]), 2, atol=0.1).tolist() == [False, True]


# ------------------------------------------------------------------------ tokens / REINFORCE++

def test_broadcast_to_tokens():
    close(broadcast_to_tokens(t([2, -1]), torch.tensor([[1, 1, 0], [0, 1, 1]])), [[2, 2, 0], [0, -1, -1]])


def test_reinforce_pp_returns_hand_values():
    # gamma 0.5: G2 = 3, G1 = 2 + 0.5 * 3 = 3.5, G0 = 1 + 0.5 * 3.5 = 2.75
    close(reinforce_pp_returns(t([[1, 2, 3]]), torch.ones(1, 3), gamma=0.5), [[2.75, 3.5, 3.0]])
    # masked position: 0, and the reward after it does not flow back
    close(reinforce_pp_returns(t([[1, 2, 3], [1, 2, 7]]), MASK), [[6, 5, 3], [3, 2, 0]])
    close(reinforce_pp_returns(t([[1, 2, 3]]), torch.tensor([[1, 0, 1]])), [[1, 0, 3]])


def test_reinforce_pp_advantages_hand_values():
    zeros = torch.zeros(2, 3)  # logprobs == ref: no KL penalty
    adv, ret = reinforce_pp_advantages(t([1, 3]), zeros, zeros, torch.tensor([[1, 1, 0], [1, 1, 1]]),
                                       kl_coef=0.1)
    # score on the last valid token: returns [[1, 1, 0], [3, 3, 3]]
    close(ret, [[1, 1, 0], [3, 3, 3]])
    # valid returns 1, 1, 3, 3, 3: mean 2.2, unbiased var (2 * 1.2**2 + 3 * 0.8**2) / 4 = 1.2
    std = math.sqrt(1.2)
    close(adv, [[-1.2 / std, -1.2 / std, 0], [0.8 / std] * 3], atol=1e-5)


def test_reinforce_pp_k1_rewards_equal_ppo_math_kl_rewards():
    torch.manual_seed(2)
    logprobs, ref = -torch.rand(2, 3), -torch.rand(2, 3)
    scores = t([7.0, -2.0])
    adv, ret = reinforce_pp_advantages(scores, logprobs, ref, MASK, kl_coef=0.1, gamma=0.9,
                                       clip_reward_value=5.0)
    rewards = compute_kl_rewards(logprobs, ref, scores, MASK, kl_ctl=0.1, clip_reward_value=5.0)
    close(ret, reinforce_pp_returns(rewards, MASK, 0.9))
    close(adv, masked_whiten(ret, MASK))
    close(masked_mean(adv, MASK), 0.0, atol=1e-6)


# ------------------------------------------------------------------------ KL estimators

def _kl_with_grad(lp, ref, kind):
    logprobs = t(lp).requires_grad_()
    value = kl_estimate(logprobs, t(ref), kind)
    value.sum().backward()
    return value.detach(), logprobs.grad


def test_kl_estimators_hand_values_and_gradients():
    # token 0: pi 0.5, ref 0.25 -> log r = ln 0.5, r = 0.5; token 1: pi 0.25, ref 0.5 -> r = 2
    lp, ref = [[LN(0.5), LN(0.25)]], [[LN(0.25), LN(0.5)]]
    d = [LN(0.5), LN(2)]
    value, grad = _kl_with_grad(lp, ref, "k1")          # k1 = -log r,  d/dlogp = 1
    close(value, [[-d[0], -d[1]]])
    close(grad, [[1.0, 1.0]])
    value, grad = _kl_with_grad(lp, ref, "k2")          # k2 = (log r)^2 / 2,  d/dlogp = -log r
    close(value, [[0.5 * d[0] ** 2, 0.5 * d[1] ** 2]])
    close(grad, [[-d[0], -d[1]]])
    value, grad = _kl_with_grad(lp, ref, "k3")          # k3 = r - 1 - log r,  d/dlogp = 1 - r
    close(value, [[0.5 - 1 - d[0], 2 - 1 - d[1]]])
    close(grad, [[1 - 0.5, 1 - 2.0]])
    assert value.min() >= 0
    with pytest.raises(ValueError, match="k1, k2, k3"):
        kl_estimate(t([0.0]), t([0.0]), "k4")


def test_kl_estimators_in_expectation():
    """Exact expectation over a 5-way categorical pi = softmax(theta), sampling not
    differentiated: E[k1] = E[k3] = KL(pi||ref); gradients: k1 -> 0, k2 -> grad KL(pi||ref),
    k3 -> grad KL(ref||pi)."""
    torch.manual_seed(3)
    theta = torch.randn(5, dtype=torch.float64)
    log_ref = torch.log_softmax(torch.randn(5, dtype=torch.float64), 0)

    def expected(kind):
        th = theta.clone().requires_grad_()
        logp = torch.log_softmax(th, 0)
        value = (logp.exp().detach() * kl_estimate(logp, log_ref, kind).double()).sum()
        value.backward()
        return value.detach(), th.grad

    def grad_of(fn):
        th = theta.clone().requires_grad_()
        fn(torch.log_softmax(th, 0)).backward()
        return th.grad

    reverse = lambda logp: (logp.exp() * (logp - log_ref)).sum()  # KL(pi || ref)  # noqa: E731
    forward = lambda logp: (log_ref.exp() * (log_ref - logp)).sum()  # KL(ref || pi)  # noqa: E731
    kl = reverse(torch.log_softmax(theta, 0))
    for kind, want_grad in (("k1", torch.zeros(5, dtype=torch.float64)), ("k2", grad_of(reverse)),
                            ("k3", grad_of(forward))):
        value, grad = expected(kind)
        torch.testing.assert_close(grad, want_grad, atol=1e-6, rtol=1e-5)
        if kind != "k2":
            torch.testing.assert_close(value, kl, atol=1e-6, rtol=1e-5)


# ------------------------------------------------------------------------ aggregation / loss

def test_aggregate_loss_modes_hand_values():
    loss = t([[1, 2, 3], [4, 5, 6], [7, 8, 9]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0], [0, 0, 0]])  # the empty third row counts nowhere
    close(aggregate_loss(loss, mask, "token_mean"), (1 + 2 + 3 + 4) / 4)
    close(aggregate_loss(loss, mask, "seq_mean_token_mean"), (6 / 3 + 4 / 1) / 2)
    close(aggregate_loss(loss, mask, "seq_mean_token_sum_norm", norm_len=4), (6 / 4 + 4 / 4) / 2)
    for mode in ("token_mean", "seq_mean_token_mean"):
        close(aggregate_loss(loss, torch.zeros_like(mask), mode), 0.0)
    with pytest.raises(ValueError, match="positive norm_len"):
        aggregate_loss(loss, mask, "seq_mean_token_sum_norm")
    with pytest.raises(ValueError, match="token_mean, seq_mean_token_mean"):
        aggregate_loss(loss, mask, "sum")


def test_clipped_policy_loss_symmetric_equals_actor_loss():
    torch.manual_seed(4)
    for _ in range(3):
        logprobs, old = -torch.rand(4, 6), -torch.rand(4, 6)
        adv, mask = torch.randn(4, 6), (torch.rand(4, 6) > 0.3).long()
        ours = clipped_policy_loss(logprobs, old, adv, mask, 0.2, 0.2, "token_mean")
        theirs = actor_loss(logprobs, old, adv, mask, cliprange=0.2)
        close(ours[0], theirs[0])
        close(ours[1], theirs[1])


def test_clip_higher_hand_values_and_gradients():
    # ratios 1.5, 0.5, 1.25 with advantages +1, -1, +1; clip to [0.8, 1.28]
    logprobs = t([[LN(1.5), LN(0.5), LN(1.25)]]).requires_grad_()
    old, adv, mask = torch.zeros(1, 3), t([[1, -1, 1]]), torch.ones(1, 3)
    loss, frac = clipped_policy_loss(logprobs, old, adv, mask, 0.2, 0.28)
    # per token max(-A r, -A clip(r)): max(-1.5, -1.28), max(0.5, 0.8), max(-1.25, -1.25)
    close(loss, (-1.28 + 0.8 - 1.25) / 3)
    close(frac, 2 / 3)
    loss.backward()
    close(logprobs.grad, [[0.0, 0.0, -1.25 / 3]])  # d(-A r)/dlogp = -A r; clipped tokens 0
    # symmetric 0.2 clips the third token too
    close(clipped_policy_loss(logprobs.detach(), old, adv, mask, 0.2, 0.2)[1], 1.0)


def test_clipped_policy_loss_sequence_advantages_and_aggregation():
    torch.manual_seed(5)
    logprobs, old = -torch.rand(2, 3), -torch.rand(2, 3)
    adv = t([0.5, -2.0])
    a = clipped_policy_loss(logprobs, old, adv, MASK, agg="seq_mean_token_sum_norm", norm_len=3)
    b = clipped_policy_loss(logprobs, old, broadcast_to_tokens(adv, MASK), MASK,
                            agg="seq_mean_token_sum_norm", norm_len=3)
    close(a[0], b[0])
    close(a[1], b[1])


# ------------------------------------------------------------------------ KL coefficient

def test_adaptive_kl_controller_follows_ziegler():
    ctl = AdaptiveKLController(0.1, target=6.0, horizon=10000)
    # e = clip(kl / target - 1, -0.2, 0.2); value *= 1 + e * n_steps / horizon
    close(torch.tensor(ctl.update(9.0, 256)), 0.1 * (1 + 0.2 * 256 / 10000))        # e 0.5 -> 0.2
    v = ctl.value
    close(torch.tensor(ctl.update(6.6, 128)), v * (1 + 0.1 * 128 / 10000), atol=1e-9)   # e 0.1
    v = ctl.value
    close(torch.tensor(ctl.update(0.0, 64)), v * (1 - 0.2 * 64 / 10000), atol=1e-9)     # e -1 -> -0.2
    fixed = FixedKLController(0.05)
    assert fixed.update(100.0, 256) == fixed.value == 0.05
    with pytest.raises(ValueError, match="target > 0"):
        AdaptiveKLController(0.1, target=0, horizon=1)


# ------------------------------------------------------------------------ overlong

def test_overlong_penalty_is_linear_in_the_buffer():
    lengths = torch.tensor([0, 6, 7, 8, 10, 12])
    # max_len 10, buffer 4: 0 up to 6 tokens, then -(L - 6) / 4 * 2
    close(overlong_penalty(lengths, 10, 4, 2.0), [0, 0, -0.5, -1.0, -2.0, -2.0])
    close(overlong_penalty(lengths, 10, 0, 1.0), [0, 0, 0, 0, 0, -1.0])
    with pytest.raises(ValueError, match="overlong buffer"):
        overlong_penalty(lengths, 10, 11)

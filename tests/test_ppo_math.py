"""PPO maths and the Experience batch, checked against numbers worked out by hand.

Layout reminder (dschat.rlhf.ppo_math): per-token tensors are [B, A], entry a belongs to
answer token seq[:, P + a]; B=2, A=3 examples below have the second row's last token masked.
"""

import pytest
import torch

from dschat.rlhf.experience import Experience
from dschat.rlhf.ppo_math import (
    action_mask_from_attention,
    actor_loss,
    answer_slice,
    answer_tokens,
    approx_kl,
    compute_gae,
    compute_kl_rewards,
    critic_loss,
    ema_update_,
    entropy_from_logits,
    gather_log_probs,
    last_token_index,
    masked_mean,
    masked_sum_count,
    masked_whiten,
)
from tests.hand_values import LN, MASK, close, t

# ------------------------------------------------------------------------ logits

def test_gather_log_probs_hand_values():
    # softmax([ln1, ln2, ln3]) = [1/6, 2/6, 3/6]; second position uniform over 3
    logits = t([[[LN(1), LN(2), LN(3)], [0.0, 0.0, 0.0]]])
    labels = torch.tensor([[0, 2]])
    close(gather_log_probs(logits, labels), [[-1.7917595, -1.0986123]])
    labels = torch.tensor([[2, 1]])
    close(gather_log_probs(logits, labels), [[-0.6931472, -1.0986123]])


def test_gather_log_probs_returns_fp32_for_bf16_logits():
    logits = torch.zeros(1, 2, 4, dtype=torch.bfloat16)
    out = gather_log_probs(logits, torch.tensor([[0, 3]]))
    assert out.dtype == torch.float32
    close(out, [[-LN(4), -LN(4)]])


def test_entropy_hand_values():
    logits = t([[[LN(1), LN(2), LN(3)], [5.0, 5.0, 5.0]]])
    # -(1/6 ln 1/6 + 1/3 ln 1/3 + 1/2 ln 1/2) = 1.0114043; uniform over 3 = ln 3
    close(entropy_from_logits(logits), [[1.0114043, 1.0986123]])


def test_answer_slice_matches_upstream_layout():
    """Our [B, A] tensors equal upstream's [B, L-1] next-token tensors sliced from P-1."""
    torch.manual_seed(0)
    b, p, a, v = 2, 3, 4, 7
    seq = torch.randint(0, v, (b, p + a))
    logits = torch.randn(b, p + a, v)
    ours = gather_log_probs(answer_slice(logits, p), answer_tokens(seq, p))
    upstream = gather_log_probs(logits[:, :-1], seq[:, 1:])[:, p - 1:]
    assert ours.shape == (b, a)
    close(ours, upstream)
    values = torch.randn(b, p + a)  # critic output, one value per column
    close(answer_slice(values, p), values[:, :-1][:, p - 1:])
    attention = torch.tensor([[0, 1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1, 1]])
    assert action_mask_from_attention(attention, p).tolist() == [[1, 1, 0, 0], [1, 1, 1, 1]]


def test_answer_slice_rejects_bad_width():
    with pytest.raises(ValueError, match="prompt_width"):
        answer_slice(torch.zeros(1, 4), 0)
    with pytest.raises(ValueError, match="prompt_width"):
        answer_slice(torch.zeros(1, 4), 4)


# ------------------------------------------------------------------------ masking

def test_masked_mean_whole_and_per_row():
    x = t([[1, 2, 3], [4, 5, 6]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    close(masked_mean(x, mask), 7 / 3)
    close(masked_mean(x, mask, dim=1), [1.5, 4.0])
    close(masked_mean(x, torch.zeros_like(mask)), 0.0)  # empty: 0, not NaN


def test_masked_mean_ignores_nan_and_inf_under_the_mask():
    x = t([[1.0, float("nan"), float("inf")]])
    close(masked_mean(x, torch.tensor([[1, 0, 0]])), 1.0)


def test_masked_mean_split_over_two_ranks_equals_full_batch():
    x = t([[1, 2, 3], [4, 5, 6]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    s0, c0 = masked_sum_count(x[:1], mask[:1])
    s1, c1 = masked_sum_count(x[1:], mask[1:])
    assert (s0.item(), c0.item(), s1.item(), c1.item()) == (3.0, 2.0, 4.0, 1.0)
    close((s0 + s1) / (c0 + c1), masked_mean(x, mask))
    # averaging per-rank means weights ranks, not tokens: (1.5 + 4) / 2 != 7 / 3
    mean_of_means = (masked_mean(x[:1], mask[:1]) + masked_mean(x[1:], mask[1:])) / 2
    close(mean_of_means, 2.75)


def test_masked_whiten():
    x = t([[1, 2, 3, 100]])
    mask = torch.tensor([[1, 1, 1, 0]])
    # mean 2, unbiased variance (1 + 0 + 1) / 2 = 1
    close(masked_whiten(x, mask), [[-1, 0, 1, 0]], atol=1e-5)
    close(masked_whiten(x, mask, shift_mean=False), [[1, 2, 3, 0]], atol=1e-5)


def test_last_token_index():
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 0, 1], [0, 0, 0]])
    assert last_token_index(mask).tolist() == [2, 1, 2, -1]


# ------------------------------------------------------------------------ rewards

def test_compute_kl_rewards_hand_values():
    logprobs = t([[-1.0, -2.0, -0.5], [-0.2, -0.4, -0.6]])
    ref = t([[-1.5, -1.0, -0.5], [-0.2, -0.9, -3.0]])
    score = t([7.0, -2.0])  # 7 is clipped to 5
    rewards = compute_kl_rewards(logprobs, ref, score, MASK, kl_ctl=0.1, clip_reward_value=5.0)
    # row 0: -0.1 * [0.5, -1.0, 0.0] = [-0.05, 0.1, 0.0], +5 on the last token
    # row 1: -0.1 * [0.0, 0.5, (masked)] = [0.0, -0.05, 0], -2 on index 1, the last real token
    close(rewards, [[-0.05, 0.1, 5.0], [0.0, -2.05, 0.0]])


def test_compute_kl_rewards_hole_in_mask_and_empty_row():
    zeros = torch.zeros(2, 4)
    mask = torch.tensor([[1, 0, 1, 0], [0, 0, 0, 0]])
    rewards = compute_kl_rewards(zeros, zeros, t([-9.0, 3.0]), mask, kl_ctl=0.1, clip_reward_value=5.0)
    close(rewards, [[0, 0, -5, 0], [0, 0, 0, 0]])


# ------------------------------------------------------------------------ GAE

def test_compute_gae_hand_values():
    values = t([[0.5, 1.0, 2.0], [1.0, -1.0, 9.0]])
    rewards = t([[0.0, 0.1, 1.0], [0.2, 3.0, 7.0]])
    adv, ret = compute_gae(values, rewards, MASK, gamma=1.0, lam=0.95)
    # row 0: t2: 1.0 + 0 - 2.0 = -1.0
    #        t1: delta 0.1 + 2.0 - 1.0 = 1.1;  1.1 + 0.95 * -1.0   = 0.15
    #        t0: delta 0.0 + 1.0 - 0.5 = 0.5;  0.5 + 0.95 * 0.15   = 0.6425
    # row 1: t2 masked -> 0 and its value 9.0 / reward 7.0 do not flow back
    #        t1: delta 3.0 + 0 - (-1.0) = 4.0
    #        t0: delta 0.2 + (-1.0) - 1.0 = -1.8; -1.8 + 0.95 * 4.0 = 2.0
    close(adv, [[0.6425, 0.15, -1.0], [2.0, 4.0, 0.0]])
    close(ret, [[1.1425, 1.15, 1.0], [3.0, 3.0, 0.0]])
    assert not adv.requires_grad and not ret.requires_grad


def test_compute_gae_discounted_hand_values():
    # gamma 0.5, lam 0.5, one row: t1: 1 + 0 - 2 = -1; t0: 0 + 0.5*2 - 1 = 0, 0 + 0.25 * -1 = -0.25
    adv, ret = compute_gae(t([[1.0, 2.0]]), t([[0.0, 1.0]]), torch.ones(1, 2), gamma=0.5, lam=0.5)
    close(adv, [[-0.25, -1.0]])
    close(ret, [[0.75, 1.0]])


def _upstream_gae(values, rewards, gamma, lam):
    """Upstream's loop: no mask, values/rewards already zeroed after the answer end."""
    last, out = 0.0, []
    length = rewards.shape[1]
    for step in reversed(range(length)):
        next_value = values[:, step + 1] if step < length - 1 else 0.0
        delta = rewards[:, step] + gamma * next_value - values[:, step]
        last = delta + gamma * lam * last
        out.append(last)
    adv = torch.stack(out[::-1], dim=1)
    return adv, adv + values


def test_compute_gae_equals_upstream_on_right_padded_rows():
    torch.manual_seed(0)
    values, rewards = torch.randn(3, 6), torch.randn(3, 6)
    mask = torch.tensor([[1] * 6, [1] * 4 + [0] * 2, [1] + [0] * 5])
    ours = compute_gae(values, rewards, mask, gamma=0.9, lam=0.95)
    upstream = _upstream_gae(values * mask, rewards * mask, gamma=0.9, lam=0.95)
    for mine, theirs in zip(ours, upstream):
        close(mine, theirs, atol=1e-5)


def test_compute_gae_split_over_two_ranks_equals_full_batch():
    values = t([[0.5, 1.0, 2.0], [1.0, -1.0, 9.0]])
    rewards = t([[0.0, 0.1, 1.0], [0.2, 3.0, 7.0]])
    full = compute_gae(values, rewards, MASK)
    parts = [compute_gae(values[i:i + 1], rewards[i:i + 1], MASK[i:i + 1]) for i in range(2)]
    for k in range(2):
        close(torch.cat([p[k] for p in parts]), full[k])


def test_compute_gae_whitening_is_optional():
    values = t([[0.5, 1.0, 2.0], [1.0, -1.0, 9.0]])
    rewards = t([[0.0, 0.1, 1.0], [0.2, 3.0, 7.0]])
    raw, _ = compute_gae(values, rewards, MASK)
    white, ret = compute_gae(values, rewards, MASK, whiten_advantages=True)
    close(white, masked_whiten(raw, MASK))
    close(masked_mean(white, MASK), 0.0, atol=1e-6)
    close(ret, [[1.1425, 1.15, 1.0], [3.0, 3.0, 0.0]])  # returns use raw advantages


# ------------------------------------------------------------------------ losses

ACTOR_LOGPROBS = t([[LN(1.5), LN(0.5), LN(1.1)], [LN(0.7), LN(1.0), LN(3.0)]])
ACTOR_ADV = t([[1.0, 1.0, -2.0], [-1.0, 0.5, 100.0]])


def test_actor_loss_hand_values():
    old = torch.zeros(2, 3)
    loss, clip_fraction = actor_loss(ACTOR_LOGPROBS, old, ACTOR_ADV, MASK, cliprange=0.2)
    # per token max(-A r, -A clip(r, 0.8, 1.2)):
    #   r=1.5 A=1:  max(-1.5, -1.2) = -1.2 (clipped)   r=0.5 A=1:  max(-0.5, -0.8) = -0.5
    #   r=1.1 A=-2: max(2.2, 2.2)   = 2.2              r=0.7 A=-1: max(0.7, 0.8)   = 0.8 (clipped)
    #   r=1.0 A=.5: max(-0.5, -0.5) = -0.5             r=3.0: masked
    # loss = (-1.2 - 0.5 + 2.2 + 0.8 - 0.5) / 5 = 0.16; clipped 2 of 5
    close(loss, 0.16)
    close(clip_fraction, 0.4)


def test_actor_loss_gradient_skips_masked_and_clipped_tokens():
    logprobs = ACTOR_LOGPROBS.clone().requires_grad_(True)
    loss, _ = actor_loss(logprobs, torch.zeros(2, 3), ACTOR_ADV, MASK, cliprange=0.2)
    loss.backward()
    # d/dlogp of -A r / 5 = -A r / 5 on unclipped tokens, 0 on clipped and masked ones
    close(logprobs.grad, [[0.0, -0.1, 0.44], [0.0, -0.1, 0.0]])


def test_actor_loss_split_over_two_ranks_is_token_weighted():
    old = torch.zeros(2, 3)
    full, _ = actor_loss(ACTOR_LOGPROBS, old, ACTOR_ADV, MASK)
    l0, _ = actor_loss(ACTOR_LOGPROBS[:1], old[:1], ACTOR_ADV[:1], MASK[:1])
    l1, _ = actor_loss(ACTOR_LOGPROBS[1:], old[1:], ACTOR_ADV[1:], MASK[1:])
    close(l0, 0.5 / 3)
    close(l1, 0.3 / 2)
    close((l0 * 3 + l1 * 2) / 5, full)


def test_critic_loss_hand_values():
    old = t([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]])
    values = t([[1.5, 0.9, 1.0], [-0.5, 0.1, 50.0]])
    returns = t([[2.0, 0.0, 1.0], [0.0, 1.0, 0.0]])
    loss, clip_fraction = critic_loss(values, old, returns, MASK, cliprange_value=0.2)
    # V=1.5 Vc=1.2 R=2: max(0.25, 0.64) = 0.64 (clipped)   V=0.9 R=0: 0.81
    # V=1.0 R=1: 0                                        V=-0.5 Vc=-0.2 R=0: max(0.25, 0.04) = 0.25
    # V=0.1 R=1: 0.81                                     V=50: masked
    # loss = 0.5 * (0.64 + 0.81 + 0 + 0.25 + 0.81) / 5 = 0.251; clipped 1 of 5
    close(loss, 0.251)
    close(clip_fraction, 0.2)


def test_approx_kl_and_two_ranks():
    logprobs = t([[-1.0, -2.0, -0.5], [-0.2, -0.4, -0.6]])
    ref = t([[-1.5, -1.0, -1.0], [-0.7, -0.9, -3.0]])
    # diffs [0.5, -1.0, 0.5], [0.5, 0.5, (masked)] -> 1.0 / 5
    close(approx_kl(logprobs, ref, MASK), 0.2)
    s0, c0 = masked_sum_count(logprobs[:1] - ref[:1], MASK[:1])
    s1, c1 = masked_sum_count(logprobs[1:] - ref[1:], MASK[1:])
    close((s0 + s1) / (c0 + c1), 0.2)


def test_ema_update_in_place():
    ema = [t([1.0, 2.0]), t([[0.0]])]
    params = [t([3.0, 0.0]), t([[10.0]]).requires_grad_(True)]
    ids = [id(e) for e in ema]
    ema_update_(ema, params, beta=0.9)
    close(ema[0], [1.2, 1.8])  # 0.9 * ema + 0.1 * param
    close(ema[1], [[1.0]])
    assert [id(e) for e in ema] == ids and not ema[1].requires_grad


def test_ema_update_rejects_mismatch():
    with pytest.raises(ValueError, match="EMA tensors"):
        ema_update_([torch.zeros(2)], [])
    with pytest.raises(ValueError, match="shape"):
        ema_update_([torch.zeros(2)], [torch.zeros(1)])


# ------------------------------------------------------------------------ Experience

def _experience(b=4, p=2, a=3, offset=0.0):
    g = torch.Generator().manual_seed(b * 10 + p + a)
    seq = torch.randint(4, 50, (b, p + a), generator=g)
    attention = torch.ones(b, p + a, dtype=torch.long)
    attention[0, 0] = 0   # left pad in the prompt
    attention[-1, -1] = 0  # right pad in the answer
    seq[attention == 0] = 0
    return Experience(
        prompts=seq[:, :p].clone(), seq=seq, attention_mask=attention,
        action_mask=attention[:, p:].clone(),
        logprobs=torch.randn(b, a, generator=g) + offset, ref_logprobs=torch.randn(b, a, generator=g),
        values=torch.randn(b, a, generator=g), rewards=torch.randn(b, generator=g),
        prompt_lens=attention[:, :p].sum(1))


def test_experience_split_and_concat_round_trip():
    exp = _experience(b=5)
    parts = exp.split(2)
    assert [len(x) for x in parts] == [2, 2, 1]
    assert all(x.prompt_width == 2 and x.answer_width == 3 for x in parts)
    back = Experience.concat(parts)
    for name in ("prompts", "seq", "attention_mask", "action_mask", "logprobs", "values", "rewards"):
        assert torch.equal(getattr(back, name), getattr(exp, name)), name
    assert back.advantages is None


def test_experience_concat_pads_prompts_left_and_answers_right():
    small, big = _experience(b=1, p=2, a=2), _experience(b=2, p=3, a=4)
    small.advantages = torch.ones(1, 2)
    big.advantages = torch.ones(2, 4)
    both = Experience.concat([small, big], pad_token_id=0)
    assert both.seq.shape == (3, 7) and both.action_mask.shape == (3, 4)
    row = both.seq[0].tolist()
    assert row[0] == 0 and row[1:3] == small.seq[0, :2].tolist()  # prompt padded on the left
    assert row[3:5] == small.seq[0, 2:].tolist() and row[5:] == [0, 0]
    # small's only row has a left-padded prompt and a right-padded answer: [0, 1 | 1, 0]
    assert both.attention_mask[0].tolist() == [0, 0, 1, 1, 0, 0, 0]
    assert both.action_mask[0].tolist() == [1, 0, 0, 0]
    assert both.advantages[0].tolist() == [1, 1, 0, 0]
    assert both.prompt_lens.tolist() == [small.prompt_lens.item()] + big.prompt_lens.tolist()


def test_experience_detach_to_and_validation():
    exp = _experience()
    exp.logprobs.requires_grad_(True)
    out = exp.detach().to("cpu")
    assert not out.logprobs.requires_grad and exp.logprobs.requires_grad
    with pytest.raises(ValueError, match="values"):
        Experience(**{**exp.__dict__, "values": torch.zeros(4, 2)})
    with pytest.raises(ValueError, match="micro_batch_size"):
        exp.split(0)


def test_gather_log_probs_in_row_chunks_is_exact():
    """Scoring (no autograd) goes through rows in chunks: bit-identical to one pass; with
    autograd it stays one pass and differentiable."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 7, 50, generator=g).to(torch.bfloat16)
    labels = torch.randint(0, 50, (5, 7), generator=g)
    whole = gather_log_probs(logits, labels)
    for rows in (1, 2, 4):
        assert torch.equal(gather_log_probs(logits, labels, chunk_bytes=rows * 7 * 50 * 4), whole)
    leaf = logits.float().requires_grad_(True)
    out = gather_log_probs(leaf, labels, chunk_bytes=1)
    out.sum().backward()
    assert leaf.grad is not None and torch.allclose(out.detach(), whole, atol=1e-6)

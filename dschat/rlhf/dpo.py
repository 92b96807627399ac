"""DPO maths (Direct Preference Optimization, Rafailov et al. 2023) as pure tensor functions.

No torch.distributed, no deepspeed; tested against hand computations (tests/test_dpo.py).

Batch layout (dschat.data.DataCollatorReward): ``input_ids`` / ``attention_mask`` are
``[2B, L]``, rows ``0..B-1`` the chosen sequences, rows ``B..2B-1`` the rejected ones,
each ``prompt + answer`` right-padded. One forward of the policy and one of the frozen
reference over the ``2B`` rows give everything below.

Where the answer starts
-----------------------
Phase-2 items hold whole ``prompt + answer`` sequences, no prompt length. As upstream
DS-Chat's DPO step (and its reward model), the answer of a pair is taken to start at the
first position where the chosen and the rejected ids differ (`answer_mask`). For the DPO
losses this is exact: a token before that position has the same context and the same id
in both sequences of the pair, so the causal LM gives it the same log-prob in both, and it
cancels in ``(chosen - rejected)`` for the policy and for the reference alike; only the
margins enter the losses. What it changes is what "the answer" means for the reported
chosen/rejected log-probs, the KL estimate and the ``rpo_alpha`` NLL term: an answer
prefix both answers share (" Sure! 9 plus 5 is" in " ... 14." / " ... 554.") counts as
prompt there. Sequences truncated on the left (``truncation_side="left"``) at different
offsets would diverge at once; DS-Chat truncates on the right.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

LOSS_TYPES = ("sigmoid", "ipo", "hinge")

__all__ = ["LOSS_TYPES", "STAT_KEYS", "split_pairs", "divergence_index", "answer_mask", "sequence_logps",
           "dpo_losses", "implicit_rewards", "token_kl_sum", "pair_stats", "summarize"]

# What `pair_stats` sums over one batch (all-reduced, then averaged by `summarize`).
STAT_KEYS = ("pairs", "loss", "correct", "margin", "chosen_reward", "rejected_reward",
             "chosen_logps", "rejected_logps", "chosen_nll", "chosen_tokens", "kl", "kl_tokens")


def split_pairs(x: Tensor) -> tuple[Tensor, Tensor]:
    """[2B, ...] -> ([B, ...] chosen, [B, ...] rejected)."""
    half = x.size(0) // 2
    return x[:half], x[half:]


def divergence_index(chosen_ids: Tensor, rejected_ids: Tensor) -> Tensor:
    """[B] first column where chosen [B, L] and rejected [B, L] ids differ (0 when they do
    not differ at all, as upstream: then every real token counts)."""
    differ = chosen_ids != rejected_ids                                   # [B, L]
    first = differ.int().argmax(dim=1)                                    # [B], 0 if none
    return torch.where(differ.any(dim=1), first, torch.zeros_like(first))


def answer_mask(input_ids: Tensor, attention_mask: Tensor) -> Tensor:
    """[2B, L] 1 on the answer tokens of each sequence: real tokens (attention 1) from the
    pair's first differing column on. Padding compared with a real token is a difference
    too, so an answer that is a prefix of the other still has its own (empty) span."""
    chosen, rejected = split_pairs(input_ids)
    start = divergence_index(chosen, rejected).repeat(2)                  # [2B]
    cols = torch.arange(input_ids.size(1), device=input_ids.device)       # [L]
    return (cols[None, :] >= start[:, None]).to(attention_mask.dtype) * attention_mask


def sequence_logps(logits: Tensor, input_ids: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """(summed log-probs [N], token counts [N]) of the tokens where ``mask`` [N, L] is 1.

    Token ``t`` is predicted by ``logits[:, t - 1]`` ([N, L, V]); column 0 is never a
    label. Computed in fp32 through cross-entropy (no [N, L, V] log-softmax copy kept).
    """
    labels = input_ids[:, 1:]                                             # [N, L-1]
    weights = mask[:, 1:].float()                                         # [N, L-1]
    flat = logits[:, :-1].float()                                         # [N, L-1, V]
    token_logps = -F.cross_entropy(flat.reshape(-1, flat.size(-1)), labels.reshape(-1),
                                   reduction="none").view_as(weights)     # [N, L-1]
    return (token_logps * weights).sum(dim=1), weights.sum(dim=1)


def dpo_losses(policy_chosen: Tensor, policy_rejected: Tensor, ref_chosen: Tensor,
               ref_rejected: Tensor, *, beta: float, label_smoothing: float = 0.0,
               loss_type: str = "sigmoid") -> Tensor:
    """[B] per-pair DPO losses from summed answer log-probs (each [B]).

    h = (pi_c - ref_c) - (pi_r - ref_r), the log-ratio margin;
    sigmoid: -(1 - eps) log sigma(beta h) - eps log sigma(-beta h)  (upstream DS-Chat;
             eps = label_smoothing, conservative DPO);
    ipo:     (h - 1 / (2 beta))^2  (Azar et al. 2023; on summed log-probs here, where TRL
             averages them per token);
    hinge:   relu(1 - beta h)  (SLiC).
    """
    h = (policy_chosen - ref_chosen) - (policy_rejected - ref_rejected)   # [B]
    if loss_type == "sigmoid":
        return (-F.logsigmoid(beta * h) * (1 - label_smoothing)
                - F.logsigmoid(-beta * h) * label_smoothing)
    if loss_type == "ipo":
        return (h - 1 / (2 * beta)) ** 2
    if loss_type == "hinge":
        return torch.relu(1 - beta * h)
    raise ValueError(f"loss_type must be one of {LOSS_TYPES}, got {loss_type!r}")


def implicit_rewards(policy_logps: Tensor, ref_logps: Tensor, beta: float) -> Tensor:
    """[N] DPO's implicit reward beta * (log pi - log ref) of each sequence."""
    return beta * (policy_logps - ref_logps)


def token_kl_sum(policy_logits: Tensor, ref_logits: Tensor, mask: Tensor) -> Tensor:
    """Sum over the masked label positions of KL(pi || ref) of the next-token
    distributions (exact over the vocabulary), a scalar; logits [N, L, V], mask [N, L]
    aligned with the labels as in `sequence_logps`. Divided by the token count it is the
    mean per-token KL to the reference along the data's answers."""
    p_log = policy_logits[:, :-1].float().log_softmax(-1)                 # [N, L-1, V]
    q_log = ref_logits[:, :-1].float().log_softmax(-1)                    # [N, L-1, V]
    kl = (p_log.exp() * (p_log - q_log)).sum(-1)                          # [N, L-1]
    return (kl * mask[:, 1:].float()).sum()


def pair_stats(policy_logps: Tensor, ref_logps: Tensor, tokens: Tensor, losses: Tensor, beta: float,
               kl_sum: Tensor | None = None) -> Tensor:
    """[len(STAT_KEYS)] sums of one batch: policy_logps / ref_logps / tokens [2B]
    (chosen rows first), losses [B] (the DPO part), kl_sum a scalar over all 2B rows."""
    pc, pr = split_pairs(policy_logps.detach().float())
    rc, rr = split_pairs(ref_logps.detach().float())
    tc, tr = split_pairs(tokens.float())
    chosen_r, rejected_r = implicit_rewards(pc, rc, beta), implicit_rewards(pr, rr, beta)
    zero = torch.zeros((), device=pc.device)
    return torch.stack([
        torch.tensor(float(pc.numel()), device=pc.device), losses.detach().float().sum(),
        (chosen_r > rejected_r).float().sum(), (chosen_r - rejected_r).sum(),
        chosen_r.sum(), rejected_r.sum(), pc.sum(), pr.sum(), -pc.sum(), tc.sum(),
        kl_sum.detach().float() if kl_sum is not None else zero,
        (tc.sum() + tr.sum()) if kl_sum is not None else zero])


def summarize(totals: Tensor, rpo_alpha: float = 0.0) -> dict:
    """Means of summed `pair_stats` (after an all-reduce): loss (the DPO loss per pair plus
    ``rpo_alpha`` x the NLL per chosen answer token, as trained), acc (implicit reward of
    the chosen answer above the rejected one), margin, rewards and log-probs per pair,
    NLL per chosen answer token, KL to the reference per answer token."""
    t = dict(zip(STAT_KEYS, totals.tolist()))
    pairs = max(t["pairs"], 1.0)
    out = {k: t[k] / pairs for k in ("loss", "margin", "chosen_reward", "rejected_reward",
                                     "chosen_logps", "rejected_logps")}
    out["acc"] = t["correct"] / pairs
    out["chosen_nll"] = t["chosen_nll"] / max(t["chosen_tokens"], 1.0)
    out["loss"] += rpo_alpha * out["chosen_nll"]
    if t["kl_tokens"] > 0:
        out["kl_ref"] = t["kl"] / t["kl_tokens"]
    return out

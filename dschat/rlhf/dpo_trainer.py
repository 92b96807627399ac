"""Step 2 DPO on DeepSpeed engines: the policy (trained) and the frozen reference.

The maths is in dschat.rlhf.dpo; this module builds the two engines and runs one optimizer
step / one evaluation over chosen/rejected batches (dschat.data.DataCollatorReward).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from dschat.engine.config import eval_ds_config, frozen_stage
from dschat.engine.train_utils import abandon_accumulation, to_device
from dschat.engine.zero import initialize_engine, release_prefetched
from dschat.models.model_utils import build_lm_engine, create_hf_model
from dschat.rlhf.dpo import (
    STAT_KEYS,
    answer_mask,
    dpo_losses,
    pair_stats,
    sequence_logps,
    split_pairs,
    summarize,
    token_kl_sum,
)
from dschat.utils import dist
from dschat.utils.dist import all_reduce_sum


@dataclass
class DPOConfig:
    beta: float = 0.1
    label_smoothing: float = 0.0
    loss_type: str = "sigmoid"
    rpo_alpha: float = 0.0

    @classmethod
    def from_args(cls, args) -> "DPOConfig":
        return cls(args.beta, args.label_smoothing, args.loss_type, args.rpo_alpha or 0.0)


def reference_ds_config(args) -> dict:
    """The frozen reference's config: ZeRO-3 when the policy trains at ZeRO-3 on several ranks,
    else stage 0 (engine.config.frozen_stage), unless --reference_zero_stage says otherwise."""
    stage = frozen_stage(args.reference_zero_stage, args.zero_stage, world_size=dist.get_world_size(),
                         offloaded=args.offload_reference_model)
    return eval_ds_config(zero_stage=stage, dtype=args.dtype, offload=args.offload_reference_model)


def build_dpo_engines(args, tokenizer, ds_config: dict, num_update_steps: int):
    """(policy engine, reference engine) from --model_name_or_path: the policy with LoRA,
    gradient checkpointing, optimizer and LR schedule as step 1; the reference a second,
    frozen copy of the same weights in eval mode."""
    policy = build_lm_engine(args, tokenizer, ds_config, num_update_steps)
    ref_cfg = reference_ds_config(args)
    ref = create_hf_model(args.model_name_or_path, tokenizer, ds_config=ref_cfg, seed=args.seed,
                          attn_implementation=args.attn_implementation)
    ref.requires_grad_(False)
    ref_engine = initialize_engine(ref, ref_cfg, args.zero3_hook_granularity)
    ref_engine.eval()  # frozen: never runs dropout
    return policy, ref_engine


def _logits(engine, batch) -> torch.Tensor:
    return engine(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False).logits


def train_step(policy, ref, group: list[dict], cfg: DPOConfig, device, world: int, guard, step: int):
    """One optimizer step over `group` micro-batches: (loss, stats sums) over all ranks, or
    (None, None) when a non-finite loss on any rank skipped the update on every rank.

    The objective is the mean DPO loss over the global batch's pairs plus rpo_alpha x the
    mean NLL over its chosen answer tokens; each micro-batch's sums are divided by those
    global counts and multiplied by what DeepSpeed divides by (ranks x accumulation), so a
    step does not depend on how its pairs are split over ranks and micro-batches.
    """
    policy.train()  # every step: a resumed run skips the first eval, from_pretrained starts in eval
    group = [to_device(b, device) for b in group]
    masks = [answer_mask(b["input_ids"], b["attention_mask"]) for b in group]
    counts = torch.tensor([sum(b["input_ids"].size(0) // 2 for b in group),
                           sum(float(split_pairs(m)[0][:, 1:].sum()) for m in masks)], device=device)
    pairs, chosen_tokens = all_reduce_sum(counts).tolist()
    scale = world * policy.gradient_accumulation_steps()
    total = torch.zeros((), device=device)
    stats = torch.zeros(len(STAT_KEYS), device=device)
    for i, (batch, mask) in enumerate(zip(group, masks)):
        with torch.no_grad():
            ref_logps, _ = sequence_logps(_logits(ref, batch), batch["input_ids"], mask)
        logps, tokens = sequence_logps(_logits(policy, batch), batch["input_ids"], mask)
        (pc, pr), (rc, rr) = split_pairs(logps), split_pairs(ref_logps)
        losses = dpo_losses(pc, pr, rc, rr, beta=cfg.beta, label_smoothing=cfg.label_smoothing,
                            loss_type=cfg.loss_type)                                  # [B]
        objective = losses.sum() / max(pairs, 1.0)
        if cfg.rpo_alpha:
            objective = objective + cfg.rpo_alpha * (-pc.sum()) / max(chosen_tokens, 1.0)
        if not guard.ok("loss", step, objective, micro=i):
            abandon_accumulation(policy)
            return None, None
        policy.backward(objective * scale)
        policy.step()
        total += objective.detach()
        stats += pair_stats(logps, ref_logps, tokens, losses, cfg.beta)
    return all_reduce_sum(total).item(), all_reduce_sum(stats)


@torch.no_grad()
def evaluate(policy, ref, loader, cfg: DPOConfig, device, max_batches: int) -> dict:
    """Eval loss, implicit-reward accuracy and margin, chosen/rejected log-probs and rewards,
    chosen NLL and the mean per-token KL(policy || reference), over all ranks."""
    policy.eval()
    totals = torch.zeros(len(STAT_KEYS), device=device)
    for i, batch in enumerate(loader):
        if i >= max_batches:
            break
        batch = to_device(batch, device)
        mask = answer_mask(batch["input_ids"], batch["attention_mask"])
        logits, ref_logits = _logits(policy, batch), _logits(ref, batch)
        logps, tokens = sequence_logps(logits, batch["input_ids"], mask)
        ref_logps, _ = sequence_logps(ref_logits, batch["input_ids"], mask)
        (pc, pr), (rc, rr) = split_pairs(logps), split_pairs(ref_logps)
        losses = dpo_losses(pc, pr, rc, rr, beta=cfg.beta, label_smoothing=cfg.label_smoothing,
                            loss_type=cfg.loss_type)
        totals += pair_stats(logps, ref_logps, tokens, losses, cfg.beta,
                             kl_sum=token_kl_sum(logits, ref_logits, mask))
    totals = all_reduce_sum(totals)
    release_prefetched(policy)  # nothing left in flight for a save or the next gather
    policy.train()
    return summarize(totals, cfg.rpo_alpha)

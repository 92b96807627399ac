"""Step 3: experience generation, rewards (reward model and/or --reward_fn functions),
advantages (PPO's GAE or a critic-free estimator), clipped updates, ptx.

--algorithm ppo with its defaults runs DS-Chat's PPO exactly (ppo_math's KL rewards, GAE,
actor_loss, critic_loss). grpo / rloo / reinforce_pp take their advantages from
dschat.rlhf.estimators and train the actor only.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch
from torch.profiler import record_function

from dschat.engine.train_utils import lm_loss_sum
from dschat.models.fused_head import FusedLogprobs
from dschat.registry import family_of, logits_to_keep_kwargs, position_ids_for, unwrap_peft
from dschat.rlhf import estimators as est
from dschat.rlhf import ppo_math as pm
from dschat.rlhf.engine import RLHFEngines, update_ema
from dschat.rlhf.experience import Experience
from dschat.rlhf.reward_fn import RewardFunctionError, combine_rewards, score
from dschat.utils import dist
from dschat.utils.errors import UserInputError
from dschat.utils.logging import print_rank_0
from dschat.utils.phases import PhaseTimer

# The phases of a step 3 step, in order (time/<phase>_s; on CUDA memory/<phase>_peak_gib):
# generation, the experience's scoring by each model (score_reward: the rewards, reward model
# and/or --reward_fn functions), then per PPO micro-batch each engine's forward (with its
# loss), backward and optimizer step (ptx_*: the ptx loss's, with --unsupervised_dataset_name;
# the actor's accumulation window then closes in ptx_step). A phase is logged only where it
# ran: no critic_* / score_critic without a critic, no score_ref without a reference model.
STEP3_PHASES = ("gen", "score_actor", "score_ref", "score_reward", "score_critic",
                "actor_fwd", "actor_bwd", "actor_step", "critic_fwd", "critic_bwd", "critic_step",
                "ptx_fwd", "ptx_bwd", "ptx_step")


@dataclass
class PPOConfig:
    kl_ctl: float = 0.1
    clip_reward_value: float = 5.0
    cliprange: float = 0.2
    cliprange_value: float = 0.2
    gamma: float = 1.0
    lam: float = 0.95
    max_answer_seq_len: int = 256
    min_answer_seq_len: int = 0        # forced answer length (benchmarks); 0: stop at eos
    unsup_coef: float = 27.8
    ema_beta: float = 0.992
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    # critic-free RL (dschat.rlhf.algorithm); the defaults are DS-Chat's PPO
    algorithm: str = "ppo"
    n_samples_per_prompt: int = 1     # answers per prompt, rows of a group contiguous
    std_norm: bool = True             # grpo: divide by the group's std (False: Dr.GRPO)
    kl_estimator: str = "k1"
    kl_in: str = "reward"             # "reward": penalty in the rewards; "loss": a loss term
    kl_target: Optional[float] = None  # adaptive KL coefficient (Ziegler) when set
    kl_horizon: float = 10000.0
    loss_agg: str = "token_mean"
    cliprange_low: Optional[float] = None    # None: cliprange
    cliprange_high: Optional[float] = None   # None: cliprange
    overlong_buffer: int = 0          # DAPO soft overlong punishment over this many tokens (0: off)
    skip_bad_rewards: bool = False
    reward_weights: Optional[Sequence[float]] = None  # reward model (if any) first, then functions
    filter_max_extra: int = 4         # --filter_groups: extra generation rounds at most per step
    fused_logprobs: bool = True       # output layer + log-softmax in token chunks (dschat.models.fused_head)
    score_in_training_forward: bool = False  # old log-probs / values from the training forwards (on-policy)

    @property
    def clip_low(self) -> float:
        return self.cliprange if self.cliprange_low is None else self.cliprange_low

    @property
    def clip_high(self) -> float:
        return self.cliprange if self.cliprange_high is None else self.cliprange_high


@dataclass
class RewardFn:
    """A loaded --reward_fn: short name (metric keys), label (messages), the function."""
    name: str
    label: str
    fn: Callable


def answer_mask(answers: torch.Tensor, eos_token_id, pad_token_id: int, chat=None) -> torch.Tensor:
    """1 on answer tokens up to and including the first eos (an id or a sequence of stop
    ids: eos and the chat template's end of turn); 0 after it; and with `chat`'s stop
    strings 0 from where the first one begins (masked like padding).

    Reading the end from the first eos (not from `!= pad`) keeps the eos token in the
    answer for families whose pad token is their eos (llama, gpt2).
    """
    stop = torch.as_tensor(eos_token_id if isinstance(eos_token_id, (list, tuple)) else [eos_token_id],
                           device=answers.device)
    is_eos = torch.isin(answers, stop)
    after_eos = (is_eos.long().cumsum(dim=1) - is_eos.long()) > 0
    mask = (~after_eos & (answers != pad_token_id) | is_eos & ~after_eos).long()
    if chat is not None and chat.stop_strings:
        for row, ids in enumerate(answers.tolist()):
            last = int(mask[row].nonzero().max()) + 1 if mask[row].any() else 0
            cut = chat.stop_string_cut(ids[:last])
            if cut is not None:
                mask[row, cut:] = 0
    return mask


class PPOTrainer:
    def __init__(self, engines: RLHFEngines, tokenizer, config: PPOConfig, scheduler=None, chat=None,
                 reward_fns: Sequence[RewardFn] = ()):
        self.e = engines
        self.tokenizer = tokenizer
        self.cfg = config
        self.scheduler = scheduler
        self.pad = tokenizer.pad_token_id
        self.eos = tokenizer.eos_token_id
        # how answers end (dschat.data.chat.ChatFormat): stop ids (eos, the template's end of
        # turn) end generation, stop strings cut answers after it; None: eos only
        self.chat = chat
        self.stop_ids = list(chat.stop_token_ids) if chat is not None else [self.eos]
        # update_guard(name, loss, engine) -> bool, called on every rank before each
        # backward; False skips that backward and step (step 3 sets it to skip non-finite
        # losses identically on all ranks). None: always update.
        self.update_guard = None
        self._actor_updated = True   # the last PPO micro-batch's actor update ran
        self.reward_fns = list(reward_fns)
        if engines.reward is None and not self.reward_fns:
            raise ValueError("PPOTrainer: no reward model and no reward function")
        c = config
        self.kl_ctl = (est.AdaptiveKLController(c.kl_ctl, c.kl_target, c.kl_horizon) if c.kl_target
                       else est.FixedKLController(c.kl_ctl))
        self.rollout_stats: dict = {}   # this rank's counters of the last rollout(s), for metrics
        # seconds and peak memory of each phase (STEP3_PHASES) since the last `phases.reset()`
        # (GPU time by CUDA events; DSCHAT_PHASE_SYNC=1, a benchmark switch, synchronizes at each boundary)
        self.phases = PhaseTimer(engines.actor.device, sync=os.environ.get("DSCHAT_PHASE_SYNC") == "1")
        if c.score_in_training_forward:
            _check_no_dropout(engines)

    # ------------------------------------------------------------------ experience
    @torch.no_grad()
    def generate_experience(self, prompts: torch.Tensor, prompt_mask: torch.Tensor,
                            fields: Optional[list] = None) -> tuple[Experience | None, dict]:
        """`rollout` and its advantages (`compute_advantages`): the experience of one batch."""
        exp, timings = self.rollout(prompts, prompt_mask, fields)
        if exp is not None and exp.logprobs is not None:   # else train_rlhf computes them
            self.compute_advantages(exp)
        return exp, timings

    @torch.no_grad()
    def rollout(self, prompts: torch.Tensor, prompt_mask: torch.Tensor,
                fields: Optional[list] = None) -> tuple[Experience | None, dict]:
        """Generate answers for this rank's prompts and score them (actor, reference,
        reward model and/or reward functions, critic); no advantages yet.

        With --n_samples_per_prompt n every prompt is repeated n times, contiguously (row i
        in group i // n), so a group never spans ranks or batches. `fields`: one dict per
        prompt (the dataset row's other columns) for the reward functions.

        Returns (None, timings) on every rank when any rank has no valid answer (upstream
        drops answers of <= 1 token; under ZeRO-3 all ranks must take the same path).
        """
        timings = {}
        self.eval()
        n = self.cfg.n_samples_per_prompt
        if n > 1:
            # The n copies are separate rows of the same generate call (HF generate or our
            # fast decode on the hybrid engine's replica): each row's prefill is recomputed,
            # not shared (neither path shares a KV-cache prefix between rows).
            prompts, prompt_mask = prompts.repeat_interleave(n, 0), prompt_mask.repeat_interleave(n, 0)
            if fields is not None:
                fields = [f for f in fields for _ in range(n)]
        start = time.time()
        with record_function("dschat/generate"), self.phases.phase("gen"):
            seq = self.e.hybrid.generate(
                prompts, prompt_mask, max_new_tokens=self.cfg.max_answer_seq_len,
                min_new_tokens=self.cfg.min_answer_seq_len, do_sample=self.cfg.do_sample,
                temperature=self.cfg.temperature, top_k=self.cfg.top_k, top_p=self.cfg.top_p,
                eos_token_id=self.stop_ids, pad_token_id=self.pad)
        timings["generate_s"] = time.time() - start
        P = prompts.shape[1]
        answers = seq[:, P:]
        if answers.shape[1] == 0:
            answers = seq.new_full((seq.shape[0], 1), self.pad)
            seq = torch.cat([seq, answers], dim=1)
        action_mask = answer_mask(answers, self.stop_ids, self.pad, self.chat)
        keep = action_mask.sum(1) > 1  # upstream: drop answers of <= 1 token
        all_ok = dist.all_reduce_sum(torch.tensor([float(keep.any())], device=seq.device)).item() \
            == dist.get_world_size()
        if not all_ok:
            return None, timings
        # Dropped rows stay in the batch with their action mask zeroed (no loss, no reward):
        # removing them would give ranks different numbers of PPO micro-batches, and under
        # ZeRO-3 every rank must run the same forwards and backwards.
        attention_mask = torch.cat([prompt_mask.long(), action_mask], dim=1)
        answer_tokens = action_mask        # before zeroing: what the reward functions read
        action_mask = action_mask * keep.unsqueeze(1).long()

        start = time.time()
        # --score_in_training_forward: the actor's and critic's scoring come from their training
        # forwards (train_rlhf), which run on the same weights; logprobs and values stay None here
        deferred = self.cfg.score_in_training_forward
        logprobs = values = None
        if not deferred:
            with record_function("dschat/score/actor"), self.phases.phase("score_actor"), \
                    self.e.hybrid.scoring_model() as model:
                if model is not None:        # the replica (or live module), output layer fused
                    logprobs, _ = self._answer_logprobs(model, seq, attention_mask, P, module=model)
                else:                        # tensor parallel: the group's logits
                    logits = self.e.hybrid.logits(seq, attention_mask, keep_last=seq.shape[1] - P + 1)
                    logprobs = pm.gather_log_probs(_answer_logits(logits, seq, P), pm.answer_tokens(seq, P))
                    del logits
        if self.e.ref is not None:
            with record_function("dschat/score/reference"), torch.no_grad(), self.phases.phase("score_ref"):
                ref_logprobs, _ = self._answer_logprobs(self.e.ref, seq, attention_mask, P)
        else:  # --kl_ctl 0: no reference model; the KL is 0 (deferred: set with the log-probs)
            ref_logprobs = None if deferred else logprobs.clone()
        with self.phases.phase("score_reward"):
            reward, valid = self.score(seq, attention_mask, prompt_mask, answer_tokens, P, fields, timings)
        action_mask = action_mask * valid.unsqueeze(1).long()   # --skip_bad_rewards: no loss on those
        if not deferred:
            if self.e.critic is not None:
                with record_function("dschat/score/critic"), self.phases.phase("score_critic"):
                    values = self.e.critic.module.forward_value(seq, attention_mask, return_value_only=True)
                    values = pm.answer_slice(values, P).float()
            else:
                values = torch.zeros_like(logprobs, dtype=torch.float32)
        timings["score_s"] = time.time() - start
        exp = Experience(prompts=prompts, seq=seq, attention_mask=attention_mask, action_mask=action_mask,
                         logprobs=logprobs, ref_logprobs=ref_logprobs, values=values, rewards=reward,
                         prompt_lens=prompt_mask.long().sum(1))
        return exp, timings

    def score(self, seq, attention_mask, prompt_mask, answer_tokens, P, fields, timings) -> tuple:
        """Rewards of the rows: ``(reward [B] fp32, valid [B] bool)``.

        The reward model's end score and each reward function's rewards, summed with
        --reward_weights (reward model first), plus DAPO's overlong penalty. A reward
        function's error on any rank is raised on every rank (no rank is left waiting in a
        collective). --skip_bad_rewards: rows a function returned a non-finite value for are
        not valid (no loss); with groups they take their group's mean of the valid rows, so
        they move no baseline.
        """
        parts, valid = [], torch.ones(seq.shape[0], dtype=torch.bool, device=seq.device)
        if self.e.reward is not None:
            with record_function("dschat/score/reward"):
                parts.append(self.e.reward.module.forward_value(seq, attention_mask)["chosen_end_scores"].float())
        if self.reward_fns:
            start = time.time()
            with record_function("dschat/score/reward_fn"):
                fn_rewards, fn_valid = self._call_reward_fns(seq, prompt_mask, answer_tokens, P, fields)
            parts += [r.to(seq.device) for r in fn_rewards]
            valid &= fn_valid.to(seq.device)
            timings["reward_fn_s"] = time.time() - start
            self.rollout_stats["bad_rewards"] = self.rollout_stats.get("bad_rewards", 0) + int((~valid).sum())
            for fn, r in zip(self.reward_fns, fn_rewards):
                self.rollout_stats.setdefault(f"reward_fn/{fn.name}", []).append(r.float().mean().item())
        reward = combine_rewards(parts, self.cfg.reward_weights) if len(parts) > 1 or self.cfg.reward_weights \
            else parts[0]
        if self.cfg.overlong_buffer:
            lengths = answer_tokens.sum(1)
            reward = reward + est.overlong_penalty(lengths, self.cfg.max_answer_seq_len,
                                                   self.cfg.overlong_buffer).to(reward.device)
        reward = reward.float()
        if not bool(valid.all()):
            reward = torch.where(valid, reward, torch.zeros_like(reward))
            n = self.cfg.n_samples_per_prompt
            if n > 1:  # a bad row takes its group's mean of the valid rows (0 if none)
                grouped, ok = reward.view(-1, n), valid.view(-1, n).float()
                mean = (grouped * ok).sum(1, keepdim=True) / ok.sum(1, keepdim=True).clamp(min=1)
                reward = torch.where(valid.view(-1, n), grouped, mean.expand_as(grouped)).reshape(-1)
        return reward, valid

    def _call_reward_fns(self, seq, prompt_mask, answer_tokens, P, fields):
        """Every --reward_fn on this rank's rows: ([rewards [B]], valid [B]). Errors are
        all-gathered first, so a function failing on one rank fails the run on all ranks
        with the same message (naming function, rank and row)."""
        tok = self.tokenizer
        prompts = [tok.decode(seq[i, :P][prompt_mask[i].bool()], skip_special_tokens=True)
                   for i in range(seq.shape[0])]
        answers = [tok.decode(seq[i, P:][answer_tokens[i].bool()], skip_special_tokens=True)
                   for i in range(seq.shape[0])]
        rewards, valid, error = [], torch.ones(seq.shape[0], dtype=torch.bool), None
        try:
            for fn in self.reward_fns:
                r, v = score(fn.fn, prompts, answers, fields, skip_bad=self.cfg.skip_bad_rewards, name=fn.label)
                rewards.append(r)
                valid &= v
        except RewardFunctionError as e:
            error = str(e)
        errors = dist.all_gather_object(error)
        failed = [(r, e) for r, e in enumerate(errors) if e is not None]
        if failed:
            where, message = failed[0]
            raise RewardFunctionError(f"{message} [rank {where}]")
        return rewards, valid

    @torch.no_grad()
    def compute_advantages(self, exp: Experience) -> Experience:
        """Fill ``exp.advantages`` / ``exp.returns`` for --algorithm (in place; returns exp).

        ppo: KL-penalised token rewards (ppo_math, k1; estimators for k2/k3) and GAE.
        grpo / rloo: sequence rewards (minus kl_coef x the answer's summed KL when the KL
        goes in the reward) normalised within each group of n_samples_per_prompt rows.
        reinforce_pp: REINFORCE++ returns, whitened over this rank's tokens.
        """
        c = self.cfg
        coef = self.kl_ctl.value if c.kl_in == "reward" else 0.0
        mask = exp.action_mask
        if c.algorithm == "ppo":
            if c.kl_estimator == "k1":
                rewards = pm.compute_kl_rewards(exp.logprobs, exp.ref_logprobs, exp.rewards, mask, coef,
                                                c.clip_reward_value)
            else:
                kl = est.kl_estimate(exp.logprobs, exp.ref_logprobs, c.kl_estimator)
                rewards = pm.compute_kl_rewards(exp.logprobs, exp.ref_logprobs, exp.rewards, mask, 0.0,
                                                c.clip_reward_value)
                rewards = rewards - coef * torch.where(mask.bool(), kl, torch.zeros_like(kl))
            exp.advantages, exp.returns = pm.compute_gae(exp.values, rewards, mask, c.gamma, c.lam)
        elif c.algorithm in ("grpo", "rloo"):
            scores = exp.rewards.float()
            if coef:
                kl = est.kl_estimate(exp.logprobs, exp.ref_logprobs, c.kl_estimator)
                scores = scores - coef * (kl * mask).sum(1)
            adv = (est.group_advantages(scores, c.n_samples_per_prompt, std_norm=c.std_norm)
                   if c.algorithm == "grpo" else est.rloo_advantages(scores, c.n_samples_per_prompt))
            exp.advantages = est.broadcast_to_tokens(adv, mask)
            exp.returns = exp.advantages
        elif c.algorithm == "reinforce_pp":
            exp.advantages, exp.returns = est.reinforce_pp_advantages(
                exp.rewards, exp.logprobs, exp.ref_logprobs, mask, coef, c.gamma, c.kl_estimator,
                c.clip_reward_value)
        else:
            raise ValueError(f"unknown algorithm {c.algorithm!r}")
        return exp

    @torch.no_grad()
    def fill_groups(self, exp: Experience | None, more: Callable[[], Experience | None],
                    target: int, max_extra: int) -> tuple[Experience | None, dict]:
        """--filter_groups (DAPO dynamic sampling): drop groups whose rewards are all equal
        (zero advantage) and refill from new prompts.

        `exp`: a rollout (None when it was skipped); `more()`: the next rollout (None when
        skipped, StopIteration when the prompts ran out); `target`: groups per rank wanted.
        Every rank keeps its varied groups; rounds continue, on all ranks alike, until every
        rank holds `target` or after `max_extra` extra rollouts. Every rank then trains on
        the same number of groups (the least any rank holds, at most `target`), so all run
        the same micro-batches; None when some rank holds none (the step is skipped).
        Advantages are not computed here.
        """
        n = self.cfg.n_samples_per_prompt
        kept, stats = [], {"groups_seen": 0, "groups_dropped": 0, "extra_rollouts": 0}

        def take(e):
            if e is None:
                return
            keep = est.filter_groups(e.rewards, n)
            stats["groups_seen"] += keep.numel()
            stats["groups_dropped"] += int((~keep).sum())
            if keep.any():
                kept.append(e.select(keep.repeat_interleave(n)))

        take(exp)
        while True:
            have = sum(e.batch_size for e in kept) // n
            least = int(-dist.all_reduce_max(torch.tensor(float(-have), device=self.e.actor.device)).item())
            if least >= target or stats["extra_rollouts"] >= max_extra:
                break
            try:
                nxt = more()
            except StopIteration:
                break
            stats["extra_rollouts"] += 1
            take(nxt)
        least = min(least, target)
        stats["groups_kept"] = least
        if least == 0:
            return None, stats
        out = Experience.concat(kept, self.pad) if len(kept) > 1 else kept[0]
        return out.select(torch.arange(least * n)), stats

    def _answer_logprobs(self, engine, seq: torch.Tensor, attention_mask: torch.Tensor, P: int,
                         with_entropy: bool = False, module=None) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """(log p of each answer token, entropy of each answer position or None) [B, A] fp32
        under `engine`'s model (`module`, default engine.module; an HF model scores as its own
        engine); the entropy detached. The LM head runs on the answer-predicting columns only,
        fused with the log-softmax in token chunks where the model allows (--logprobs fused:
        no [B, A, V] logits), else as HF logits then log-softmax."""
        module = engine.module if module is None else module
        keep = seq.shape[1] - P + 1
        with FusedLogprobs(module, seq, enabled=self.cfg.fused_logprobs, with_entropy=with_entropy) as head:
            out = engine(input_ids=seq, attention_mask=attention_mask, use_cache=False,
                         **_positions(module, attention_mask), **logits_to_keep_kwargs(module, keep)).logits
        if not getattr(self, "_logprobs_logged", False):
            self._logprobs_logged = True
            print_rank_0("log-probs: output layer fused with the log-softmax (no [B, A, V] logits)" if head.active
                         else f"log-probs from full logits (fused output layer off: {head.reason})")
        if head.active:
            return _answer_logits(out, seq, P), _answer_logits(head.entropy, seq, P) if with_entropy else None
        answer_logits = _answer_logits(out, seq, P)
        return (pm.gather_log_probs(answer_logits, pm.answer_tokens(seq, P)),
                _row_entropy(answer_logits) if with_entropy else None)

    # ------------------------------------------------------------------ training
    def train_rlhf(self, exp: Experience) -> dict:
        """One actor (and, under ppo, one critic) update on a micro-batch of experience."""
        P = exp.prompt_width
        c = self.cfg
        self.train()
        deferred = exp.logprobs is None   # --score_in_training_forward: scored here, on the same weights
        # the same positions as generation and the experience pass (left-padded prompts)
        with record_function("dschat/train/actor_forward"), self.phases.phase("actor_fwd"):
            logprobs, entropy = self._answer_logprobs(self.e.actor, exp.seq, exp.attention_mask, P,
                                                      with_entropy=True)
        live_values = None
        if deferred:
            # old log-probs and values are the training forwards' own (the PPO ratio is exactly 1);
            # the critic's forward runs before the advantages, which need its values
            exp.logprobs = logprobs.detach().float()
            if exp.ref_logprobs is None:
                exp.ref_logprobs = exp.logprobs.clone()
            if self.e.critic is not None:
                with record_function("dschat/train/critic_forward"), self.phases.phase("critic_fwd"):
                    live_values = pm.answer_slice(self.e.critic.module.forward_value(
                        exp.seq, exp.attention_mask, return_value_only=True), P)
                exp.values = live_values.detach().float()
            else:
                exp.values = torch.zeros_like(exp.logprobs)
            with torch.no_grad():
                self.compute_advantages(exp)
        with record_function("dschat/train/actor_forward"), self.phases.phase("actor_fwd"):
            if c.clip_low == c.clip_high == c.cliprange and c.loss_agg == "token_mean":
                # DS-Chat's loss (clipped_policy_loss computes the same numbers)
                a_loss, a_clip = pm.actor_loss(logprobs, exp.logprobs, exp.advantages, exp.action_mask,
                                               c.cliprange)
            else:
                a_loss, a_clip = est.clipped_policy_loss(logprobs, exp.logprobs, exp.advantages, exp.action_mask,
                                                         c.clip_low, c.clip_high, c.loss_agg, c.max_answer_seq_len)
            stats = {}
            if c.kl_in == "loss" and self.e.ref is not None and self.kl_ctl.value:
                kl = est.aggregate_loss(est.kl_estimate(logprobs, exp.ref_logprobs, c.kl_estimator),
                                        exp.action_mask, c.loss_agg, c.max_answer_seq_len)
                stats["kl_loss"] = kl.detach()
                a_loss = a_loss + self.kl_ctl.value * kl
        with torch.no_grad():
            low, high = est.clip_fractions(logprobs, exp.logprobs, exp.advantages, exp.action_mask,
                                           c.clip_low, c.clip_high)
            stats.update(actor_clip_frac_low=low, actor_clip_frac_high=high,
                         entropy=pm.masked_mean(entropy, exp.action_mask))
        self._actor_updated = self._update("actor", a_loss, self.e.actor)
        stats.update(actor_loss=a_loss.detach(), actor_clip_frac=a_clip)
        if self.e.critic is None:
            return stats

        with record_function("dschat/train/critic_forward"), self.phases.phase("critic_fwd"):
            values = live_values
            if values is None:
                values = pm.answer_slice(self.e.critic.module.forward_value(
                    exp.seq, exp.attention_mask, return_value_only=True), P)
            c_loss, c_clip = pm.critic_loss(values, exp.values, exp.returns, exp.action_mask,
                                            self.cfg.cliprange_value)
        self._update("critic", c_loss, self.e.critic)
        stats.update(critic_loss=c_loss.detach(), critic_clip_frac=c_clip)
        return stats

    def train_unsupervised(self, batch: dict) -> torch.Tensor:
        """ptx: the actor's LM loss on unsupervised text, weighted by --unsup_coef.

        With ptx on, the actor's engine accumulates twice as many micro-batches (see
        `actor_accumulation_steps`), so a PPO micro-batch and its ptx micro-batch make one
        optimizer step together, as upstream.
        """
        self.e.actor.train()
        with record_function("dschat/train/ptx_forward"), self.phases.phase("ptx_fwd"):
            logits = self.e.actor(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                                  use_cache=False).logits
            tokens = (batch["labels"][:, 1:] != -100).sum().clamp(min=1)
            loss = lm_loss_sum(logits, batch["labels"]) / tokens
        # A skipped PPO update rewound the accumulation window: this ptx backward would
        # start the next one and put the optimizer step between PPO and ptx from then on.
        if self._actor_updated:
            self._update("unsup", loss, self.e.actor, weight=self.cfg.unsup_coef, phase="ptx")
        return loss.detach()

    def _update(self, name: str, loss: torch.Tensor, engine, weight: float = 1.0, phase: Optional[str] = None) -> bool:
        """Backward and optimizer step of `engine` on `loss` (times `weight`), unless the
        update guard skips it (it sees the unweighted loss as f"{name}_loss"). `engine.step()`
        only steps the optimizer (and LR schedule) at the end of an accumulation window.
        Timed as phases f"{phase}_bwd" and f"{phase}_step" (`phase` defaults to `name`).
        Returns whether the update ran."""
        if self.update_guard is not None and not self.update_guard(f"{name}_loss", loss, engine):
            return False
        phase = phase or name
        with record_function(f"dschat/train/{name}_backward"), self.phases.phase(f"{phase}_bwd"):
            engine.backward(loss if weight == 1.0 else weight * loss)
        with record_function(f"dschat/train/{name}_step"), self.phases.phase(f"{phase}_step"):
            engine.step()
        return True

    # ------------------------------------------------------------------ modes
    def eval(self) -> None:
        """Every model in eval mode (no dropout) while experience is made and scored.

        The critic too, as upstream (its `eval()` covers actor, critic, ref and reward):
        the old values must be deterministic, like the old log-probs.
        """
        for engine in (self.e.actor, self.e.critic, self.e.ref, self.e.reward, self.e.ema):
            if engine is not None:
                engine.eval()

    def train(self) -> None:
        """Actor and critic in train mode for their updates; the frozen models stay in eval."""
        self.e.actor.train()
        if self.e.critic is not None:
            self.e.critic.train()

    def after_actor_updates(self) -> None:
        """The actor's weights changed: the replica must be refilled; the EMA follows."""
        self.e.hybrid.mark_weights_updated()
        if self.e.ema is not None:
            update_ema(self.e.ema.module, self.e.actor.module, self.cfg.ema_beta)

    def update_kl(self, kl_per_answer: float, n_samples: int) -> float:
        """The adaptive KL controller sees the step's KL (summed over each answer's tokens,
        mean over answers: Ziegler's per-sample KL) and the samples it came from; the fixed
        one ignores it. Returns the coefficient the next step uses."""
        return self.kl_ctl.update(kl_per_answer, n_samples)

    # ------------------------------------------------------------------ metrics
    def params_left_gathered(self) -> int:
        """ZeRO-3 parameters of any step-3 model still gathered or in flight, the most on
        any rank (should be 0; a collective)."""
        from dschat.engine.zero import params_left_gathered
        engines = [self.e.actor, self.e.ref, self.e.critic, self.e.reward, self.e.ema]
        modules = {id(e.module): e.module for e in engines if e is not None}   # a LoRA-base reference is the actor's
        here = sum(len(params_left_gathered(m)) for m in modules.values())
        return int(dist.all_reduce_max(torch.tensor(float(here), device=self.e.actor.device)).item())

    def rollout_metrics(self, exp: Experience) -> dict:
        """`experience_metrics` plus what the algorithm adds: advantage statistics, the KL
        under each estimator and the coefficient, reward functions' means, bad rewards
        skipped (summed over ranks and the step's rollouts). Resets the rollout counters."""
        m = self.experience_metrics(exp)
        if self.e.critic is None:
            m.pop("ppo/value_mean")
        mask = exp.action_mask
        adv = exp.advantages.float()
        sel = adv[mask.bool()]
        empty = torch.zeros((), device=adv.device)
        m["ppo/adv_mean"] = dist.all_reduce_mean(pm.masked_mean(adv, mask)).item()
        m["ppo/adv_std"] = dist.all_reduce_mean(sel.std() if sel.numel() > 1 else empty).item()
        m["ppo/adv_max"] = dist.all_reduce_max(sel.max() if sel.numel() else empty).item()
        m["ppo/adv_min"] = _reduce_min(sel.min() if sel.numel() else empty)
        m["ppo/kl_k2"] = dist.all_reduce_mean(pm.masked_mean(
            est.kl_estimate(exp.logprobs, exp.ref_logprobs, "k2"), mask)).item()
        m["ppo/kl_coef"] = float(self.kl_ctl.value)
        m["ppo/kl_estimator_k"] = float(self.cfg.kl_estimator[1])      # 1, 2 or 3: which ppo/kl_k* drives it
        m["ppo/kl_in_loss"] = float(self.cfg.kl_in == "loss")
        stats, self.rollout_stats = self.rollout_stats, {}
        if self.reward_fns:
            m["reward/bad_skipped"] = int(dist.all_reduce_sum(torch.tensor(float(stats.get("bad_rewards", 0)),
                                                                      device=adv.device)).item())
            for fn in self.reward_fns:
                values = stats.get(f"reward_fn/{fn.name}", [0.0])
                m[f"reward/{fn.name}_mean"] = dist.all_reduce_mean(torch.tensor(sum(values) / len(values),
                                                                           device=adv.device)).item()
        return m

    @staticmethod
    def experience_metrics(exp: Experience) -> dict:
        """Over the rows kept for training (answers of more than one token; >= 1 per rank)."""
        kept = exp.action_mask.sum(1) > 0
        lengths = exp.action_mask.sum(1).float()[kept]
        reward = exp.rewards.float()[kept]
        return {
            "ppo/reward_mean": dist.all_reduce_mean(reward.mean()).item(),
            "ppo/reward_std": dist.all_reduce_mean(reward.std(unbiased=False) if reward.numel() > 1
                                              else torch.zeros((), device=reward.device)).item(),
            # k1 (mean log-ratio; can go negative on greedy answers) and k3 (always >= 0)
            "ppo/kl": dist.all_reduce_mean(pm.approx_kl(exp.logprobs, exp.ref_logprobs, exp.action_mask)).item(),
            # summed over each answer's tokens: the KL budget a run is judged by (nats per answer)
            "ppo/kl_per_answer": dist.all_reduce_mean(
                ((exp.logprobs.float() - exp.ref_logprobs.float()) * exp.action_mask).sum(1)[kept].mean()).item(),
            "ppo/kl_k3": dist.all_reduce_mean(pm.masked_mean(
                torch.expm1(exp.ref_logprobs - exp.logprobs) - (exp.ref_logprobs - exp.logprobs),
                exp.action_mask)).item(),
            "gen/answer_len_mean": dist.all_reduce_mean(lengths.mean()).item(),
            "gen/answer_len_max": dist.all_reduce_max(lengths.max()).item(),
            "ppo/value_mean": dist.all_reduce_mean(pm.masked_mean(exp.values, exp.action_mask)).item(),
        }


# rollout metrics that hold per round whatever the rollout: set before the round, not averaged
_ROUND_CONSTANTS = ("ppo/kl_coef", "ppo/kl_estimator_k", "ppo/kl_in_loss")


def merge_rollout_metrics(rows: list[dict], weights: list[float]) -> dict:
    """One metrics row for a PPO round of several rollouts (--generation_batches): maxima
    and minima over the rollouts, counts (reward/bad_skipped) summed, the round's constants
    (KL coefficient and estimator) as they stand, every other value averaged with the
    rollouts' row counts as weights (exact for means over rows; std columns are the mean of
    the rollouts' stds)."""
    if len(rows) == 1:
        return dict(rows[0])
    total = float(sum(weights))
    out = {}
    for key in rows[-1]:
        values = [(r[key], w) for r, w in zip(rows, weights) if key in r]
        if key in _ROUND_CONSTANTS:
            out[key] = values[-1][0]
        elif key.endswith("_max"):
            out[key] = max(v for v, _ in values)
        elif key.endswith("_min"):
            out[key] = min(v for v, _ in values)
        elif key == "reward/bad_skipped":
            out[key] = sum(v for v, _ in values)
        else:
            out[key] = sum(v * w for v, w in values) / (sum(w for _, w in values) or total)
    return out


def _check_no_dropout(engines: RLHFEngines) -> None:
    """--score_in_training_forward takes the old log-probs and values from forwards in training
    mode: exact only where they run no dropout."""
    bad = []
    for name, engine in (("actor", engines.actor), ("critic", engines.critic)):
        if engine is None:
            continue
        module = engine.module
        config = unwrap_peft(getattr(module, "rwtransformer", module)).config
        bad += [f"{name} {key}={getattr(config, key)}" for key in family_of(config).dropout_keys
                if getattr(config, key, None)]
        bad += [f"{name} {n} p={m.p}" for n, m in module.named_modules()
                if isinstance(m, torch.nn.Dropout) and m.p > 0][:3]
    if bad:
        raise UserInputError(f"--score_in_training_forward needs dropout 0 in actor and critic "
                             f"(--actor_dropout 0 --critic_dropout 0); found {', '.join(bad[:6])}")


def _reduce_min(value: torch.Tensor) -> float:
    return -dist.all_reduce_max(-value.detach().float()).item()


def _row_entropy(answer_logits: torch.Tensor) -> torch.Tensor:
    """Entropy [B, A] of the next-token distributions, one row at a time (a [A, V] fp32
    temporary rather than [B, A, V]); detached."""
    return torch.cat([pm.entropy_from_logits(answer_logits[row:row + 1].detach())
                      for row in range(answer_logits.shape[0])])


def _answer_logits(logits: torch.Tensor, seq: torch.Tensor, P: int) -> torch.Tensor:
    """[B, A, V] logits that predict the answer tokens, from full-width logits or from the
    last columns only (`logits_to_keep`): the columns dropped on the left shift the slice."""
    dropped = seq.shape[1] - logits.shape[1]
    return pm.answer_slice(logits, P - dropped)


def _positions(module, attention_mask) -> dict:
    position_ids = position_ids_for(module, attention_mask)
    return {} if position_ids is None else {"position_ids": position_ids}

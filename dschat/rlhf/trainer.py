"""PPO for step 3: experience generation, KL-penalised rewards, GAE, clipped updates, ptx."""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch.profiler import record_function

from dschat.engine.distributed import all_reduce_mean, all_reduce_sum
from dschat.engine.hybrid import logits_to_keep_kwargs, position_ids_for
from dschat.engine.train_utils import lm_loss_sum
from dschat.rlhf import ppo_math as pm
from dschat.rlhf.engine import RLHFEngines, update_ema
from dschat.rlhf.experience import Experience


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
    def __init__(self, engines: RLHFEngines, tokenizer, config: PPOConfig, scheduler=None, chat=None):
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

    # ------------------------------------------------------------------ experience
    @torch.no_grad()
    def generate_experience(self, prompts: torch.Tensor, prompt_mask: torch.Tensor) -> tuple[Experience | None, dict]:
        """Generate answers for this rank's prompts and score them with all four models.

        Returns (None, timings) on every rank when any rank has no valid answer (upstream
        drops answers of <= 1 token; under ZeRO-3 all ranks must take the same path).
        """
        timings = {}
        self.eval()
        start = time.time()
        with record_function("dschat/generate"):
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
        all_ok = all_reduce_sum(torch.tensor([float(keep.any())], device=seq.device)).item() \
            == torch.distributed.get_world_size()
        if not all_ok:
            return None, timings
        # Dropped rows stay in the batch with their action mask zeroed (no loss, no reward):
        # removing them would give ranks different numbers of PPO micro-batches, and under
        # ZeRO-3 every rank must run the same forwards and backwards.
        attention_mask = torch.cat([prompt_mask.long(), action_mask], dim=1)
        action_mask = action_mask * keep.unsqueeze(1).long()

        start = time.time()
        keep = seq.shape[1] - P + 1      # the LM head runs on the answer-predicting columns only
        with record_function("dschat/score/actor"):
            logits = self.e.hybrid.logits(seq, attention_mask, keep_last=keep)
            logprobs = pm.gather_log_probs(_answer_logits(logits, seq, P), pm.answer_tokens(seq, P))
            del logits
        with record_function("dschat/score/reference"):
            ref_logits = self.e.ref(input_ids=seq, attention_mask=attention_mask, use_cache=False,
                                    **_positions(self.e.ref.module, attention_mask),
                                    **logits_to_keep_kwargs(self.e.ref.module, keep)).logits
            ref_logprobs = pm.gather_log_probs(_answer_logits(ref_logits, seq, P), pm.answer_tokens(seq, P))
            del ref_logits
        with record_function("dschat/score/reward"):
            reward = self.e.reward.module.forward_value(seq, attention_mask)["chosen_end_scores"].float()
        with record_function("dschat/score/critic"):
            values = self.e.critic.module.forward_value(seq, attention_mask, return_value_only=True)
            values = pm.answer_slice(values, P).float()
        timings["score_s"] = time.time() - start
        exp = Experience(prompts=prompts, seq=seq, attention_mask=attention_mask, action_mask=action_mask,
                         logprobs=logprobs, ref_logprobs=ref_logprobs, values=values, rewards=reward,
                         prompt_lens=prompt_mask.long().sum(1))
        rewards = pm.compute_kl_rewards(logprobs, ref_logprobs, reward, action_mask,
                                        self.cfg.kl_ctl, self.cfg.clip_reward_value)
        exp.advantages, exp.returns = pm.compute_gae(values, rewards, action_mask, self.cfg.gamma, self.cfg.lam)
        return exp, timings

    # ------------------------------------------------------------------ training
    def train_rlhf(self, exp: Experience) -> dict:
        """One actor and one critic update on a micro-batch of experience."""
        P = exp.prompt_width
        self.train()
        # the same positions as generation and the experience pass (left-padded prompts)
        with record_function("dschat/train/actor_forward"):
            keep = exp.seq.shape[1] - P + 1
            logits = self.e.actor(input_ids=exp.seq, attention_mask=exp.attention_mask, use_cache=False,
                                  **_positions(self.e.actor.module, exp.attention_mask),
                                  **logits_to_keep_kwargs(self.e.actor.module, keep)).logits
            logprobs = pm.gather_log_probs(_answer_logits(logits, exp.seq, P), pm.answer_tokens(exp.seq, P))
            a_loss, a_clip = pm.actor_loss(logprobs, exp.logprobs, exp.advantages, exp.action_mask,
                                           self.cfg.cliprange)
        self._actor_updated = self._update("actor", a_loss, self.e.actor)

        with record_function("dschat/train/critic_forward"):
            values = self.e.critic.module.forward_value(exp.seq, exp.attention_mask, return_value_only=True)
            values = pm.answer_slice(values, P)
            c_loss, c_clip = pm.critic_loss(values, exp.values, exp.returns, exp.action_mask,
                                            self.cfg.cliprange_value)
        self._update("critic", c_loss, self.e.critic)
        return {"actor_loss": a_loss.detach(), "critic_loss": c_loss.detach(),
                "actor_clip_frac": a_clip, "critic_clip_frac": c_clip}

    def train_unsupervised(self, batch: dict) -> torch.Tensor:
        """ptx: the actor's LM loss on unsupervised text, weighted by --unsup_coef.

        With ptx on, the actor's engine accumulates twice as many micro-batches (see
        `actor_accumulation_steps`), so a PPO micro-batch and its ptx micro-batch make one
        optimizer step together, as upstream.
        """
        self.e.actor.train()
        logits = self.e.actor(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                              use_cache=False).logits
        tokens = (batch["labels"][:, 1:] != -100).sum().clamp(min=1)
        loss = lm_loss_sum(logits, batch["labels"]) / tokens
        # A skipped PPO update rewound the accumulation window: this ptx backward would
        # start the next one and put the optimizer step between PPO and ptx from then on.
        if self._actor_updated:
            self._update("unsup", loss, self.e.actor, weight=self.cfg.unsup_coef)
        return loss.detach()

    def _update(self, name: str, loss: torch.Tensor, engine, weight: float = 1.0) -> bool:
        """Backward and optimizer step of `engine` on `loss` (times `weight`), unless the
        update guard skips it (it sees the unweighted loss as f"{name}_loss"). `engine.step()`
        only steps the optimizer (and LR schedule) at the end of an accumulation window.
        Returns whether the update ran."""
        if self.update_guard is not None and not self.update_guard(f"{name}_loss", loss, engine):
            return False
        with record_function(f"dschat/train/{name}_backward"):
            engine.backward(loss if weight == 1.0 else weight * loss)
        with record_function(f"dschat/train/{name}_step"):
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
        self.e.critic.train()

    def after_actor_updates(self) -> None:
        """The actor's weights changed: the replica must be refilled; the EMA follows."""
        self.e.hybrid.mark_weights_updated()
        if self.e.ema is not None:
            update_ema(self.e.ema.module, self.e.actor.module, self.cfg.ema_beta)

    # ------------------------------------------------------------------ metrics
    def params_left_gathered(self) -> int:
        """ZeRO-3 parameters of any step-3 model still gathered or in flight, the most on
        any rank (should be 0; a collective)."""
        from dschat.engine.zero import params_left_gathered
        engines = [self.e.actor, self.e.ref, self.e.critic, self.e.reward, self.e.ema]
        here = sum(len(params_left_gathered(e.module)) for e in engines if e is not None)
        return int(_all_reduce_max(torch.tensor(float(here), device=self.e.actor.device)))

    @staticmethod
    def experience_metrics(exp: Experience) -> dict:
        """Over the rows kept for training (answers of more than one token; >= 1 per rank)."""
        kept = exp.action_mask.sum(1) > 0
        lengths = exp.action_mask.sum(1).float()[kept]
        reward = exp.rewards.float()[kept]
        return {
            "ppo/reward_mean": all_reduce_mean(reward.mean()).item(),
            "ppo/reward_std": all_reduce_mean(reward.std(unbiased=False) if reward.numel() > 1
                                              else torch.zeros((), device=reward.device)).item(),
            # k1 (mean log-ratio; can go negative on greedy answers) and k3 (always >= 0)
            "ppo/kl": all_reduce_mean(pm.approx_kl(exp.logprobs, exp.ref_logprobs, exp.action_mask)).item(),
            # summed over each answer's tokens: the KL budget a run is judged by (nats per answer)
            "ppo/kl_per_answer": all_reduce_mean(
                ((exp.logprobs.float() - exp.ref_logprobs.float()) * exp.action_mask).sum(1)[kept].mean()).item(),
            "ppo/kl_k3": all_reduce_mean(pm.masked_mean(
                torch.expm1(exp.ref_logprobs - exp.logprobs) - (exp.ref_logprobs - exp.logprobs),
                exp.action_mask)).item(),
            "gen/answer_len_mean": all_reduce_mean(lengths.mean()).item(),
            "gen/answer_len_max": _all_reduce_max(lengths.max()),
            "ppo/value_mean": all_reduce_mean(pm.masked_mean(exp.values, exp.action_mask)).item(),
        }


def _answer_logits(logits: torch.Tensor, seq: torch.Tensor, P: int) -> torch.Tensor:
    """[B, A, V] logits that predict the answer tokens, from full-width logits or from the
    last columns only (`logits_to_keep`): the columns dropped on the left shift the slice."""
    dropped = seq.shape[1] - logits.shape[1]
    return pm.answer_slice(logits, P - dropped)


def _positions(module, attention_mask) -> dict:
    position_ids = position_ids_for(module, attention_mask)
    return {} if position_ids is None else {"position_ids": position_ids}


def _all_reduce_max(value: torch.Tensor) -> float:
    out = value.detach().clone().float()
    if torch.distributed.is_initialized():
        torch.distributed.all_reduce(out, op=torch.distributed.ReduceOp.MAX)
    return out.item()

#!/usr/bin/env python
"""Step 3: PPO of the step-1 actor against the step-2 reward model.

    deepspeed training/step3_rlhf_finetuning/main.py \
        --actor_model_name_or_path output/step1 --critic_model_name_or_path output/step2 \
        --actor_zero_stage 3 --critic_zero_stage 3 --enable_hybrid_engine --dtype fp32 \
        --output_dir output/step3

`--enable_hybrid_engine` is this project's own engine (dschat/engine/hybrid.py), not
DeepSpeed's `hybrid_engine` block: the actor's ZeRO-3 shards are gathered once per
rollout into a persistent inference replica by the shared gather scheduler, generation
runs on the replica, and training goes on with ZeRO's own hooks. Writes actor/, critic/
(and actor_ema/) under --output_dir, with metrics.jsonl and the resolved configuration.

metrics.jsonl splits each step into phases (rank 0's): time/<phase>_s for gen, score_actor,
score_ref, score_reward (reward model and/or --reward_fn), score_critic, actor_fwd /
actor_bwd / actor_step, critic_fwd / critic_bwd / critic_step and ptx_fwd / ptx_bwd /
ptx_step, each only where it ran (no critic_* for critic-free algorithms), summed over the
step's PPO micro-batches and epochs; on CUDA synchronized at each phase's ends, plus
memory/<phase>_peak_gib, the most memory allocated inside the phase (CPU runs: seconds only).
The coarse time/generate_s, time/score_s and time/train_s stay as before.

Critic-free RL (no critic engine, optimizer or critic/ folder), e.g. GRPO on a verifiable task:

    deepspeed training/step3_rlhf_finetuning/main.py --algorithm grpo --n_samples_per_prompt 8 \
        --reward_fn dschat/tasks/arithmetic.py:exact_match_reward --temperature 1.0 \
        --actor_model_name_or_path output/step1 --data_path data/arith --actor_zero_stage 3 \
        --enable_hybrid_engine --output_dir output/grpo

`--save_interval N` (PPO steps) writes resumable checkpoints under --output_dir/checkpoints/
(actor, critic, EMA, data position, RNGs incl. the sampling generator); `--resume` continues
from the newest complete one.
"""
import argparse
import json
import os
import time
from itertools import chain, cycle

import torch
from tqdm import tqdm

from dschat.cli import flags
from dschat.cli.validate import raise_problems, validate_step3
from dschat.data import DataCollatorRLHF, create_prompt_dataset, create_unsupervised_dataset
from dschat.data.chat import ChatFormat
from dschat.data.tokenize import end_of_conversation_text
from dschat.engine.gather import get_scheduler
from dschat.engine.train_utils import abandon_accumulation, make_loader, to_device
from dschat.models.model_utils import load_tokenizer, save_hf_format
from dschat.models.reward_model import save_reward_model
from dschat.rlhf.algorithm import ALGORITHMS, kl_settings, reward_fn_specs, reward_weights, uses_reward_model
from dschat.rlhf.engine import build_rlhf_engines, ppo_optimizer_steps
from dschat.rlhf.estimators import KL_KINDS, LOSS_AGG_MODES
from dschat.rlhf.reward_fn import describe, load_reward_fn
from dschat.rlhf.trainer import PPOConfig, PPOTrainer, RewardFn
from dschat.utils.checkpoint import Checkpointer, NonFiniteGuard, fault_point, skip_batches
from dschat.utils.dist import (
    all_reduce_mean,
    all_reduce_sum,
    get_rank,
    get_world_size,
    init_distributed,
    peak_memory_gib,
)
from dschat.utils.logging import print_rank_0
from dschat.utils.metrics import metrics_logger_for
from dschat.utils.profiling import StepProfiler, add_profile_args
from dschat.utils.run import main_guard, resolved_config, save_json, set_seed


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    flags.add_data_args(p)
    g = p.add_argument_group("data (step 3)")
    g.add_argument("--unsupervised_dataset_name", type=str, default=None,
                   help="Text dataset (local path or hub name) for the ptx loss; off by default.")
    g.add_argument("--unsupervised_dataset_config_name", type=str, default=None,
                   help="datasets config name of --unsupervised_dataset_name.")
    g.add_argument("--unsup_coef", type=float, default=27.8, help="Weight of the ptx loss.")
    g.add_argument("--preprocessing_num_workers", type=int, default=None, help="Kept for DS-Chat compatibility.")
    g = p.add_argument_group("models")
    g.add_argument("--actor_model_name_or_path", type=str, required=True, help="Step-1 output folder (or config).")
    g.add_argument("--critic_model_name_or_path", type=str, default=None,
                   help="Step-2 output folder: a reward model (ours or DS-Chat's format). It initialises the "
                        "critic (--algorithm ppo: required) and is the reward model. With --reward_fn and this "
                        "model's weight 0 in --reward_weights it only initialises the critic, and may then be a "
                        "causal-LM folder (the SFT model; the value head starts new). Optional for critic-free "
                        "algorithms given --reward_fn.")
    g.add_argument("--num_padding_at_beginning", type=int, default=None,
                   help="Kept for DS-Chat compatibility; sequence ends are read from attention masks.")
    g = p.add_argument_group("PPO")
    g.add_argument("--per_device_generation_batch_size", type=int, default=16,
                   help="Answers generated per rank per rollout batch (prompts x --n_samples_per_prompt).")
    g.add_argument("--per_device_training_batch_size", type=int, default=16, help="PPO micro-batch per rank.")
    g.add_argument("--generation_batches", type=int, default=1, help="Generation batches per PPO update round.")
    g.add_argument("--ppo_epochs", type=int, default=1, help="PPO epochs over each round of experience.")
    g.add_argument("--max_prompt_seq_len", type=int, default=256, help="Prompts longer than this are dropped.")
    g.add_argument("--max_answer_seq_len", type=int, default=256, help="Answer tokens generated at most.")
    g.add_argument("--min_answer_seq_len", type=int, default=0,
                   help="Force at least this many answer tokens (benchmarks; 0: stop at eos).")
    g.add_argument("--actor_learning_rate", type=float, default=9.65e-6, help="Actor learning rate.")
    g.add_argument("--critic_learning_rate", type=float, default=5e-6, help="Critic learning rate.")
    g.add_argument("--actor_weight_decay", type=float, default=0.0, help="Actor weight decay.")
    g.add_argument("--critic_weight_decay", type=float, default=0.0, help="Critic weight decay.")
    g.add_argument("--num_train_epochs", type=int, default=1, help="Passes over the prompts.")
    g.add_argument("--lr_scheduler_type", type=str, default="cosine", choices=flags.SCHEDULER_CHOICES,
                   help="Learning-rate schedule.")
    g.add_argument("--gradient_accumulation_steps", type=int, default=1, help="Micro-batches per optimizer step.")
    g.add_argument("--num_warmup_steps", type=int, default=100, help="Warm-up steps of the schedule.")
    g.add_argument("--output_dir", type=str, default=None, help="Where actor/, critic/ and metrics go.")
    g.add_argument("--seed", type=int, default=1234, help="Seed (sampling is seeded per rank from it).")
    g.add_argument("--local_rank", type=int, default=-1, help="Set by the deepspeed launcher.")
    g.add_argument("--kl_ctl", type=float, default=0.1,
                   help="KL penalty coefficient (the start value with --kl_target); 0 builds no reference model.")
    g.add_argument("--clip_reward_value", type=float, default=5.0, help="Reward score clipped to +-this.")
    g.add_argument("--cliprange", type=float, default=0.2,
                   help="PPO ratio clip (both sides unless --cliprange_low/--cliprange_high).")
    g.add_argument("--cliprange_value", type=float, default=0.2, help="Value clip of the critic loss.")
    g.add_argument("--gamma", type=float, default=1.0, help="GAE discount.")
    g.add_argument("--lam", type=float, default=0.95, help="GAE lambda.")
    g.add_argument("--temperature", type=float, default=None, help="Sample with this temperature (default: greedy).")
    g.add_argument("--top_p", type=float, default=None, help="Nucleus sampling (implies sampling).")
    g.add_argument("--top_k", type=int, default=None, help="Top-k sampling (implies sampling).")
    g = p.add_argument_group("algorithm (critic-free RL)")
    g.add_argument("--algorithm", choices=ALGORITHMS, default="ppo",
                   help="ppo: DS-Chat's PPO with a critic (GAE). grpo: group-normalised rewards (GRPO; "
                        "Dr.GRPO with --no_std_norm). rloo: leave-one-out baseline. reinforce_pp: REINFORCE++ "
                        "(KL-penalised token returns whitened over the batch). The last three build no critic.")
    g.add_argument("--n_samples_per_prompt", type=int, default=1, metavar="N",
                   help="Answers sampled per prompt. Each prompt is repeated N times, contiguously, inside one "
                        "generation batch (--per_device_generation_batch_size counts answers and must be a "
                        "multiple of N), so a group never spans ranks or batches. grpo/rloo need N >= 2 and "
                        "sampling (--temperature/--top_p/--top_k).")
    g.add_argument("--no_std_norm", action="store_true",
                   help="grpo: do not divide advantages by the group's std (Dr.GRPO).")
    g.add_argument("--kl_estimator", choices=KL_KINDS, default=None,
                   help="KL(actor || reference) estimator per token: k1 = logprobs - ref_logprobs, "
                        "k2 = (log ratio)^2 / 2, k3 = r - 1 - log r. Default: k1 for ppo and reinforce_pp, "
                        "k3 for grpo and rloo.")
    g.add_argument("--kl_in", choices=("reward", "loss"), default=None,
                   help="Where the KL penalty goes: into the rewards (default for ppo and reinforce_pp, as "
                        "upstream) or as a loss term kl_ctl x KL (default for grpo and rloo, as TRL/DeepSeek).")
    g.add_argument("--kl_target", type=float, default=None,
                   help="Adaptive KL coefficient (Ziegler et al. 2019): start at --kl_ctl and move it so the "
                        "KL per answer (nats, summed over its tokens) approaches this. Default: off (fixed --kl_ctl).")
    g.add_argument("--kl_horizon", type=float, default=10000,
                   help="Adaptive KL: samples over which the coefficient changes by at most 20%%.")
    g.add_argument("--loss_agg", choices=LOSS_AGG_MODES, default="token_mean",
                   help="How per-token policy losses become one: token_mean (DS-Chat, DAPO), "
                        "seq_mean_token_mean (GRPO paper), seq_mean_token_sum_norm (Dr.GRPO: each answer's "
                        "sum / --max_answer_seq_len).")
    g.add_argument("--cliprange_low", type=float, default=None,
                   help="Lower ratio clip (1 - this). Default: --cliprange.")
    g.add_argument("--cliprange_high", type=float, default=None,
                   help="Upper ratio clip (1 + this; DAPO's clip-higher uses 0.28). Default: --cliprange.")
    g.add_argument("--filter_groups", action="store_true",
                   help="DAPO dynamic sampling: drop groups whose rewards are all equal (zero advantage) and "
                        "refill the batch with new prompts' groups, at most --filter_groups_max_extra extra "
                        "generations per step; the ranks then train on the same number of groups. Needs "
                        "--n_samples_per_prompt >= 2.")
    g.add_argument("--filter_groups_max_extra", type=int, default=4,
                   help="--filter_groups: extra generation rounds per step at most.")
    g.add_argument("--overlong_penalty", type=int, default=0, metavar="BUFFER",
                   help="DAPO soft overlong punishment: a reward going linearly from 0 to -1 over the last "
                        "BUFFER tokens before --max_answer_seq_len (0: off).")
    g.add_argument("--reward_fn", action="append", default=None, metavar="FILE.py:FUNCTION",
                   help="A Python reward function fn(prompts, answers, **row_fields) -> one number per answer "
                        "(dschat/rlhf/reward_fn.py); repeatable or comma-separated. Gets the dataset row's "
                        "other columns (e.g. 'answer') as keywords.")
    g.add_argument("--reward_weights", action="append", default=None, metavar="W[,W...]",
                   help="Weights of the rewards, summed: the reward model's first (when "
                        "--critic_model_name_or_path is given), then each --reward_fn in order; "
                        "comma-separated or repeated. Default: 1 each.")
    g.add_argument("--skip_bad_rewards", action="store_true",
                   help="A reward function's non-finite (or None) value masks that answer out of the losses "
                        "(counted in reward/bad_skipped) instead of stopping the run.")
    g = p.add_argument_group("hybrid engine (ours)")
    g.add_argument("--enable_hybrid_engine", action="store_true",
                   help="Generate on a persistent inference replica filled from the ZeRO shards.")
    g.add_argument("--unpin_actor_parameters", action="store_true",
                   help="Layered mode: gather --tp_gather_partition_size blocks at a time (less memory, slower).")
    g.add_argument("--release_inference_cache", action="store_true",
                   help="Free the replica, KV cache and graphs after each rollout.")
    g.add_argument("--inference_tp_size", type=int, default=1,
                   help="Generate with tensor parallelism inside groups of this many consecutive ranks "
                        "(must divide the world size and the head counts; needs --enable_hybrid_engine).")
    g.add_argument("--tp_gather_partition_size", type=int, default=8,
                   help="Blocks gathered at a time in layered mode and in the tensor-parallel replica fill.")
    g.add_argument("--disable_fast_decode", action="store_true",
                   help="Decode with HF generate on the replica even where the fast path (static KV cache "
                        "+ CUDA graphs, on GPU for bloom/opt/llama) is available; for comparisons.")
    g = p.add_argument_group("memory and precision")
    g.add_argument("--offload", action="store_true", help="ZeRO-Offload for actor and critic.")
    g.add_argument("--offload_reference_model", action="store_true", help="Offload the reference model.")
    g.add_argument("--offload_reward_model", action="store_true", help="Offload the reward model.")
    g.add_argument("--actor_zero_stage", type=int, default=0, choices=(0, 1, 2, 3), help="Actor ZeRO stage.")
    g.add_argument("--critic_zero_stage", type=int, default=0, choices=(0, 1, 2, 3), help="Critic ZeRO stage.")
    g.add_argument("--reference_zero_stage", type=int, default=None, choices=(0, 3),
                   help="ZeRO stage of the frozen reference (and EMA) model. Default: 3 when "
                        "--actor_zero_stage is 3, else 0 (upstream's rule). 0 keeps a whole copy on "
                        "every GPU: no per-layer gathers while scoring, at the memory of one model.")
    g.add_argument("--reward_zero_stage", type=int, default=None, choices=(0, 3),
                   help="ZeRO stage of the frozen reward model. Default: 3 when --critic_zero_stage "
                        "is 3, else 0. 0 keeps a whole copy on every GPU (faster scoring, more memory).")
    flags.add_zero3_hooks_arg(g)
    g.add_argument("--actor_gradient_checkpointing", action="store_true", help="Actor activation checkpointing.")
    g.add_argument("--logprobs", choices=("fused", "plain"), default="fused",
                   help="How the actor's training forward and the reference's scoring get token log-probs. "
                        "fused: the output layer and the log-softmax run together over chunks of tokens, so "
                        "[batch, answer, vocabulary] logits never exist (same numbers; a model whose output "
                        "layer is not a plain linear layer, or that rescales its logits, runs plain, said once "
                        "in the log). plain: HF's logits, then the log-softmax (DS-Chat's way).")
    g.add_argument("--critic_gradient_checkpointing", action="store_true", help="Critic activation checkpointing.")
    g.add_argument("--actor_dropout", type=float, default=0.0,
                   help="Actor dropout (default 0.0, as upstream's step-3 scripts: with dropout the PPO "
                        "ratio is not 1 at the first micro-step); set it to train with the model's own.")
    g.add_argument("--critic_dropout", type=float, default=0.0,
                   help="Critic dropout (default 0.0, as upstream's step-3 scripts).")
    g.add_argument("--dtype", type=str, default="fp16", choices=flags.DTYPE_CHOICES, help="Training precision.")
    g.add_argument("--compute_fp32_loss", action="store_true",
                   help="Kept for DS-Chat compatibility: PPO losses are always computed in fp32.")
    g = p.add_argument_group("LoRA")
    g.add_argument("--actor_lora_dim", type=int, default=0, help="Actor LoRA rank (0: off).")
    g.add_argument("--actor_lora_module_name", type=str, default=None, help="Actor LoRA module prefix.")
    g.add_argument("--critic_lora_dim", type=int, default=0, help="Critic LoRA rank (0: off).")
    g.add_argument("--critic_lora_module_name", type=str, default=None, help="Critic LoRA module prefix.")
    g.add_argument("--only_optimize_lora", action="store_true", help="Train only LoRA weights.")
    g.add_argument("--actor_lora_learning_rate", type=float, default=5e-4, help="Actor LoRA learning rate.")
    g.add_argument("--critic_lora_learning_rate", type=float, default=5e-4, help="Critic LoRA learning rate.")
    g.add_argument("--enable_mixed_precision_lora", action="store_true",
                   help="Keep the frozen base weights in low precision (needs LoRA and ZeRO-3).")
    g = p.add_argument_group("other")
    g.add_argument("--enable_ema", action="store_true", help="Keep an EMA of the actor (saved as actor_ema/).")
    g.add_argument("--add_eot_token", action="store_true", help="Add --eot_token to the tokenizer.")
    g.add_argument("--eot_token", type=str, default="<|endoftext|>", help="End-of-turn token.")
    g.add_argument("--stop_strings", nargs="*", default=None,
                   help="Without a chat template: an answer ends before the first of these (default: "
                        "'\\n\\nHuman:', the user's next turn in DS-Chat's text); the tokens from there on "
                        "are masked like padding in experience, rewards and losses. Answers always "
                        "end at eos and at the chat template's end-of-turn token."),
    g.add_argument("--align_overflow", action="store_true", help="Kept for DS-Chat compatibility (fp16 only).")
    g.add_argument("--print_answers", action="store_true", help="Print prompts and answers on rank 0.")
    g.add_argument("--print_answers_interval", type=int, default=1, help="Every this many steps.")
    g.add_argument("--dump_generations", type=str, default=None,
                   help="JSONL file: one row per prompt per PPO step (step, rank, prompt, answer, reward).")
    g.add_argument("--enable_test_mode", action="store_true", help="Stop after --test_stop_step steps.")
    g.add_argument("--test_stop_step", type=int, default=0, help="Steps to run in test mode.")
    g.add_argument("--max_steps", type=int, default=0, help="Stop after this many PPO steps (0: all).")
    flags.add_logging_args(p)
    flags.add_checkpoint_args(p, unit="PPO steps")
    add_profile_args(p)
    return p.parse_args(argv)


def ppo_config(args) -> PPOConfig:
    do_sample = any(v is not None for v in (args.temperature, args.top_p, args.top_k))
    kl_estimator, kl_in = kl_settings(args)
    weights = reward_weights(args)
    if weights is not None and args.critic_model_name_or_path and not uses_reward_model(args):
        weights = weights[1:]    # the reward model's weight 0: it is not built, so not among the rewards
    return PPOConfig(kl_ctl=args.kl_ctl, clip_reward_value=args.clip_reward_value, cliprange=args.cliprange,
                     cliprange_value=args.cliprange_value, gamma=args.gamma, lam=args.lam,
                     max_answer_seq_len=args.max_answer_seq_len, min_answer_seq_len=args.min_answer_seq_len,
                     unsup_coef=args.unsup_coef, do_sample=do_sample,
                     temperature=args.temperature or 1.0, top_k=args.top_k or 0, top_p=args.top_p or 1.0,
                     algorithm=args.algorithm, n_samples_per_prompt=args.n_samples_per_prompt,
                     std_norm=not args.no_std_norm, kl_estimator=kl_estimator, kl_in=kl_in,
                     kl_target=args.kl_target, kl_horizon=args.kl_horizon, loss_agg=args.loss_agg,
                     cliprange_low=args.cliprange_low, cliprange_high=args.cliprange_high,
                     overlong_buffer=args.overlong_penalty, skip_bad_rewards=args.skip_bad_rewards,
                     reward_weights=weights, filter_max_extra=args.filter_groups_max_extra,
                     fused_logprobs=args.logprobs == "fused")


def reward_functions(args) -> list[RewardFn]:
    """The loaded --reward_fn functions, in order."""
    out = []
    for spec in reward_fn_specs(args):
        fn = load_reward_fn(spec)
        out.append(RewardFn(name=getattr(fn, "__name__", spec.rpartition(":")[2]), label=describe(fn), fn=fn))
    return out


def dump_generations(path, step, exp, tokenizer, this_rank):
    """Gather every rank's prompts/answers to rank 0 and append them as JSONL rows."""
    P = exp.prompt_width
    rows = []
    for i in range(exp.batch_size):
        prompt = exp.seq[i, :P][exp.attention_mask[i, :P].bool()]
        answer = exp.seq[i, P:][exp.attention_mask[i, P:].bool()]
        rows.append({"step": step, "rank": this_rank,
                     "prompt": tokenizer.decode(prompt, skip_special_tokens=True),
                     "answer": tokenizer.decode(answer, skip_special_tokens=True),
                     "reward": float(exp.rewards[i])})
    gathered = [None] * get_world_size()
    torch.distributed.all_gather_object(gathered, rows)
    if this_rank == 0:
        with open(path, "a") as f:
            for part in gathered:
                for row in part:
                    f.write(json.dumps(row) + "\n")
    return rows


def split_rows(batch: dict, micro_batch_size: int) -> list[dict]:
    """A collated batch cut into consecutive micro-batches of rows (the last may be smaller)."""
    rows = next(len(v) for v in batch.values() if torch.is_tensor(v))
    return [{k: v[i:i + micro_batch_size] if torch.is_tensor(v) else v for k, v in batch.items()}
            for i in range(0, rows, micro_batch_size)]


def ppo_round(trainer, buffer, unsup_buffer, args) -> dict:
    """--ppo_epochs passes of actor/critic (+ ptx) updates over the buffered experience;
    the mean of each statistic over the round and the ranks.

    A ptx batch has as many rows as a generation batch and is cut like it (upstream's
    MiniDataset): each PPO micro-batch trains with its own ptx micro-batch, so every ptx
    row is trained once per PPO epoch."""
    stats = []
    for _ in range(args.ppo_epochs):
        for exp_i, unsup in zip(buffer, unsup_buffer or [None] * len(buffer)):
            micros = exp_i.split(args.per_device_training_batch_size)
            unsup_micros = split_rows(unsup, args.per_device_training_batch_size) if unsup is not None \
                else [None] * len(micros)
            if len(unsup_micros) != len(micros):
                raise RuntimeError(f"{len(unsup_micros)} ptx micro-batches for {len(micros)} PPO micro-batches")
            for micro, unsup_micro in zip(micros, unsup_micros):
                s = trainer.train_rlhf(micro)
                if unsup_micro is not None:
                    s["unsup_loss"] = trainer.train_unsupervised(unsup_micro)
                trainer.after_actor_updates()
                stats.append(s)
    return {f"ppo/{key}": all_reduce_mean(torch.stack([s[key] for s in stats]).mean()).item() for key in stats[0]}


def main(argv=None):
    args = parse_args(argv)
    validate_step3(args)
    device = init_distributed(args.local_rank)
    world = get_world_size()
    set_seed(args.seed)

    tokenizer = load_tokenizer(args.actor_model_name_or_path, add_eot_token=args.add_eot_token,
                               eot_token=args.eot_token)
    reward_fns = reward_functions(args)
    # with reward functions the prompt rows carry their other columns (e.g. "answer") to them
    prompt_data, _ = create_prompt_dataset(args.local_rank, args.data_path, args.data_split,
                                           args.data_output_path, 3, args.seed, tokenizer, args.max_prompt_seq_len,
                                           chat_template=args.chat_template, row_fields=bool(reward_fns))
    eot = end_of_conversation_text(tokenizer, args.eot_token if args.add_eot_token else None)
    chat = ChatFormat(tokenizer, args.chat_template, eot, args.stop_strings)
    print_rank_0(f"step 3: conversations as {chat.describe()}; "
                 f"generation stops at token ids {list(chat.stop_token_ids)}")
    # --per_device_generation_batch_size counts answers: each prompt is answered n times
    prompts_per_batch = args.per_device_generation_batch_size // args.n_samples_per_prompt
    prompt_loader = make_loader(prompt_data, prompts_per_batch,
                                DataCollatorRLHF(args.max_prompt_seq_len, tokenizer.pad_token_id),
                                shuffle=True, seed=args.seed, drop_last=True)
    unsup_loader = None
    if args.unsupervised_dataset_name:
        unsup_data = create_unsupervised_dataset([args.unsupervised_dataset_name],
                                                 args.unsupervised_dataset_config_name, tokenizer,
                                                 args.max_prompt_seq_len + args.max_answer_seq_len,
                                                 args.data_output_path, args.seed, args.local_rank)
        # whole batches only: each is cut into as many micro-batches as a generation batch
        unsup_loader = make_loader(unsup_data, args.per_device_generation_batch_size, shuffle=True, seed=args.seed,
                                   drop_last=True)
    if len(prompt_loader) == 0:
        raise_problems([f"{len(prompt_data)} prompts fit --max_prompt_seq_len, fewer than one batch of "
                        f"{prompts_per_batch} prompts (--per_device_generation_batch_size "
                        f"{args.per_device_generation_batch_size} / --n_samples_per_prompt "
                        f"{args.n_samples_per_prompt}) on each of {world} ranks"])
    if unsup_loader is not None and len(unsup_loader) == 0:
        raise_problems([f"{len(unsup_data)} rows of --unsupervised_dataset_name, fewer than one batch of "
                        f"--per_device_generation_batch_size {args.per_device_generation_batch_size} "
                        f"on each of {world} ranks"])
    steps_per_epoch = len(prompt_loader)
    total_steps = steps_per_epoch * args.num_train_epochs
    for cap in (args.max_steps, args.test_stop_step if args.enable_test_mode else 0):
        if cap:
            total_steps = min(total_steps, cap)
    # the LR schedules' length: the optimizer steps this run takes (the actor's accumulation
    # is doubled with ptx, so it steps as often as the critic)
    num_total_iters = ppo_optimizer_steps(
        total_steps, generation_batches=args.generation_batches,
        generation_batch_size=args.per_device_generation_batch_size,
        training_batch_size=args.per_device_training_batch_size, ppo_epochs=args.ppo_epochs,
        gradient_accumulation_steps=args.gradient_accumulation_steps)
    print_rank_0(f"LR schedules over {num_total_iters} optimizer steps; actor dropout {args.actor_dropout}, "
                 f"critic dropout {args.critic_dropout}")

    engines = build_rlhf_engines(args, tokenizer, num_total_iters)
    trainer = PPOTrainer(engines, tokenizer, ppo_config(args), chat=chat, reward_fns=reward_fns)
    run_config = resolved_config(args, actor_ds_config=engines.actor_ds_config,
                                 critic_ds_config=engines.critic_ds_config, world_size=world,
                                 prompts=len(prompt_data))
    print_rank_0("resolved configuration:\n" + json.dumps(run_config, indent=1, sort_keys=True, default=str))

    sampling_rng = getattr(engines.hybrid, "_generator", None)
    ckpt = Checkpointer(args.output_dir, args.save_interval, args.keep_last,
                        engines={"actor": engines.actor,
                                 **({"critic": engines.critic} if engines.critic is not None else {})},
                        modules={"ema": engines.ema.module} if engines.ema is not None else {},
                        generators={"hybrid": sampling_rng} if sampling_rng is not None else {})
    guard = NonFiniteGuard(args.max_nonfinite_in_a_row, device)
    resumed = ckpt.resume_or_start(args.resume, run_config, guard)
    step, start_epoch, batches_done = resumed.position if resumed else (0, 0, 0)
    unsup_done = resumed.state["unsup_in_epoch"] if resumed else 0
    if resumed:
        engines.hybrid.mark_weights_updated()  # the replica must be refilled from the loaded shards
        trainer.kl_ctl.value = resumed.state.get("kl_coef", trainer.kl_ctl.value)

    def update_guard(name, loss, engine) -> bool:
        """Skip (on every rank) an actor/critic update whose loss is not finite anywhere."""
        if guard.ok(name, step, loss):
            return True
        abandon_accumulation(engine)
        return False

    trainer.update_guard = update_guard
    metrics = metrics_logger_for(args, run_config)
    if args.dump_generations and get_rank() == 0 and resumed is None:
        os.makedirs(os.path.dirname(os.path.abspath(args.dump_generations)), exist_ok=True)
        open(args.dump_generations, "w").close()

    def save():
        return ckpt.save(step, {"epoch": epoch, "batches_in_epoch": batches_done, "unsup_in_epoch": unsup_done,
                                "nonfinite": guard.state(), "config": run_config, "kl_coef": trainer.kl_ctl.value})

    profiler = StepProfiler(args.profile_step, args.profile_dir or os.path.join(args.output_dir, "profile"),
                            get_rank(), device)
    buffer, unsup_buffer = [], []
    progress = tqdm(total=total_steps, initial=step, desc=f"step 3 ({args.algorithm})", disable=get_rank() != 0)
    epoch = start_epoch
    for epoch in range(start_epoch, args.num_train_epochs):
        if step >= total_steps:
            break
        prompt_loader.sampler.set_epoch(epoch)
        if epoch != start_epoch:
            batches_done, unsup_done = 0, 0
        unsup_iter = None
        if unsup_loader is not None:  # the same order as an uninterrupted run: rest of a pass, then cycles
            unsup_iter = chain(skip_batches(unsup_loader, unsup_done % len(unsup_loader)), cycle(unsup_loader)) \
                if unsup_done % len(unsup_loader) else cycle(unsup_loader)
        batches = iter(skip_batches(prompt_loader, batches_done))
        ckpt.restore_rng(resumed)  # once, where the interrupted run stood
        for batch in batches:
            if step >= total_steps:
                break
            step_start = time.time()
            trainer.phases.reset()      # the phases (time/<phase>_s, memory/<phase>_peak_gib) of this step
            profiler.begin(step + 1)
            batch = to_device(batch, device)
            fields = {"fields": batch["fields"]} if "fields" in batch else {}
            filter_stats = None
            if args.filter_groups:
                exp, timings = trainer.rollout(batch["prompt"], batch["prompt_att_mask"], **fields)

                def more():
                    """The next batch's rollout for the refill (its prompts count as consumed)."""
                    nonlocal batches_done
                    extra = to_device(next(batches), device)   # StopIteration ends the refill
                    batches_done += 1
                    kw = {"fields": extra["fields"]} if "fields" in extra else {}
                    out, extra_timings = trainer.rollout(extra["prompt"], extra["prompt_att_mask"], **kw)
                    for k, v in extra_timings.items():
                        timings[k] = timings.get(k, 0.0) + v
                    return out

                exp, filter_stats = trainer.fill_groups(exp, more, prompts_per_batch, args.filter_groups_max_extra)
                if exp is not None:
                    trainer.compute_advantages(exp)
            else:
                exp, timings = trainer.generate_experience(batch["prompt"], batch["prompt_att_mask"], **fields)
            step += 1
            batches_done += 1
            progress.update(1)
            if exp is None:
                print_rank_0(f"step {step}: a rank generated no answer longer than one token; batch skipped")
            elif not guard.ok("reward", step, exp.rewards, exp.values, exp.logprobs, exp.ref_logprobs):
                metrics.log(step, {"train/skipped_nonfinite": guard.skipped})
            else:
                buffer.append(exp)
                if unsup_iter is not None:
                    unsup_buffer.append(to_device(next(unsup_iter), device))
                    unsup_done += 1
                record = {**trainer.rollout_metrics(exp), **{f"time/{k}": v for k, v in timings.items()}}
                if filter_stats is not None:
                    record.update({f"filter/{k}": int(all_reduce_sum(torch.tensor(float(v))).item())
                                   for k, v in filter_stats.items() if k != "groups_kept"})
                    record["filter/groups_kept_per_rank"] = filter_stats["groups_kept"]
                if args.dump_generations:
                    dump_generations(args.dump_generations, step, exp, tokenizer, get_rank())
                if args.print_answers and step % args.print_answers_interval == 0 and get_rank() == 0:
                    P = exp.prompt_width
                    print(f"--- step {step} prompt: {tokenizer.decode(exp.seq[0, :P], skip_special_tokens=True)!r}\n"
                          f"    answer: {tokenizer.decode(exp.seq[0, P:], skip_special_tokens=True)!r}"
                          f" reward {float(exp.rewards[0]):.3f}", flush=True)
                if len(buffer) >= args.generation_batches:
                    train_start = time.time()
                    record.update(ppo_round(trainer, buffer, unsup_buffer, args))
                    buffer, unsup_buffer = [], []
                    record["time/train_s"] = time.time() - train_start
                    record.update(trainer.phases.metrics())
                    record.update(engines.hybrid.pop_stats())
                    record.update(get_scheduler().pop_stats())
                    record["time/step_s"] = time.time() - step_start
                    record["memory/peak_gib"] = peak_memory_gib(device)
                    record["zero/params_left_gathered"] = trainer.params_left_gathered()
                    record["ppo/samples_per_s"] = exp.batch_size * world / record["time/step_s"]
                    trainer.update_kl(record["ppo/kl_per_answer"], exp.batch_size * world)
                    record["train/skipped_nonfinite"] = guard.skipped
                    metrics.log(step, record)
                    progress.set_postfix(reward=f"{record['ppo/reward_mean']:.3f}", kl=f"{record['ppo/kl']:.3f}")
            written = profiler.end(step)
            if written:
                print_rank_0(f"profile of step {step} written to {written} (and .trace.json)")
                if profiler.snapshot:
                    print_rank_0(f"memory snapshot of step {step} written to {profiler.snapshot} "
                                 "(view it at https://pytorch.org/memory_viz)")
            if not buffer:  # checkpoints only between PPO rounds: the experience buffer is not saved
                fault_point("step", step)
                if ckpt.due(step):
                    save()
            guard.check_halt(step, save)  # (a halt with experience buffered drops that experience)
    progress.close()

    def write_models():
        save_hf_format(engines.actor, tokenizer, os.path.join(args.output_dir, "actor"), rank=get_rank())
        if engines.critic is not None:  # critic-free algorithms have no critic to save
            save_reward_model(engines.critic, tokenizer, os.path.join(args.output_dir, "critic"), rank=get_rank())
        if engines.ema is not None:
            save_hf_format(engines.ema, tokenizer, os.path.join(args.output_dir, "actor_ema"), rank=get_rank())

    ckpt.save_final(write_models, save, args.output_dir)
    if get_rank() == 0:
        save_json(run_config, os.path.join(args.output_dir, "training_config.json"))
    metrics.close()
    print_rank_0(f"saved actor/{' and critic/' if engines.critic is not None else ''} to {args.output_dir}")


if __name__ == "__main__":
    main_guard(main)

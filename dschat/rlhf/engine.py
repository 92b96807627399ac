"""Builds the four (five with EMA) DeepSpeed engines of step 3.

actor (trained, wrapped in our HybridActor), reference (frozen copy of the SFT model),
critic (trained, from the reward model), reward (frozen), optional EMA of the actor.
As upstream, reference and reward run at ZeRO-3 when their trained partner does, else
at stage 0. Only the actor is always built (dschat.rlhf.algorithm): critic-free
algorithms build no critic (nor its optimizer), --kl_ctl 0 no reference, and no reward
model is built without --critic_model_name_or_path or with its --reward_weights entry 0.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from dschat.engine.config import eval_ds_config, frozen_stage, offload_options, train_ds_config
from dschat.engine.optim import build_lr_scheduler, build_optimizer
from dschat.engine.zero import gathered, initialize_engine
from dschat.models.lora import apply_lora
from dschat.models.model_utils import compile_blocks, create_hf_model, enable_activation_checkpointing
from dschat.models.reward_model import create_reward_model, load_reward_model
from dschat.rlhf.ppo_math import ema_update_
from dschat.utils import dist
from dschat.utils.logging import print_rank_0


@dataclass
class RLHFEngines:
    actor: object          # deepspeed engine of the causal LM
    ref: object | None     # None with --kl_ctl 0
    critic: object | None  # deepspeed engine of the RewardModel; None for critic-free algorithms
    reward: object | None  # None without a reward model (reward functions only)
    ema: object | None
    hybrid: object         # dschat.rollout.hybrid.HybridActor around `actor`
    actor_ds_config: dict
    critic_ds_config: dict | None


def ptx_enabled(args) -> bool:
    return bool(getattr(args, "unsupervised_dataset_name", None))


def actor_accumulation_steps(args) -> int:
    """Micro-batches per actor optimizer step: twice --gradient_accumulation_steps with ptx
    on (upstream's rule), so a PPO micro-batch and its ptx micro-batch are one step and the
    actor's LR schedule advances once per PPO step, like the critic's."""
    return args.gradient_accumulation_steps * (2 if ptx_enabled(args) else 1)


def ppo_optimizer_steps(ppo_steps: int, *, generation_batches: int, generation_batch_size: int,
                        training_batch_size: int, ppo_epochs: int, gradient_accumulation_steps: int) -> int:
    """Optimizer steps that `ppo_steps` generation steps make (the LR schedule's length).

    Each round of `generation_batches` generation batches is cut into micro-batches of
    `training_batch_size` (the last may be smaller), trained `ppo_epochs` times; DeepSpeed
    steps once every `gradient_accumulation_steps` micro-batches, counting across rounds.
    A trailing partial round is never trained; batches skipped at run time shorten it.
    """
    micro_per_batch = -(-generation_batch_size // training_batch_size)
    rounds = ppo_steps // generation_batches
    micro = rounds * generation_batches * micro_per_batch * ppo_epochs
    return max(micro // gradient_accumulation_steps, 1)


class LoRABaseReference:
    """The reference model of a LoRA actor with frozen base weights: the actor engine run
    with its adapters switched off (peft's `disable_adapter`), so the base weights are held
    once instead of twice (TRL and OpenRLHF do the same). Stands in for a DeepSpeed engine
    in the scoring forward (`__call__`, `.module`); its train / eval mode is the actor's."""

    def __init__(self, actor_engine):
        self.actor = actor_engine
        self.module = actor_engine.module

    def __call__(self, **kwargs):
        with self.module.disable_adapter():
            return self.actor(**kwargs)

    def eval(self):
        return self


def build_rlhf_engines(args, tokenizer, num_total_iters: int, scheduler=None) -> RLHFEngines:
    from dschat.rlhf.algorithm import shares_lora_base, uses_critic, uses_reference, uses_reward_model
    from dschat.rollout.hybrid import HybridActor

    actor_cfg = train_ds_config(
        zero_stage=args.actor_zero_stage, dtype=args.dtype, **offload_options(args),
        micro_batch_size=args.per_device_training_batch_size,
        gradient_accumulation_steps=actor_accumulation_steps(args))
    critic_cfg = train_ds_config(
        zero_stage=args.critic_zero_stage, dtype=args.dtype, **offload_options(args),
        micro_batch_size=args.per_device_training_batch_size,
        gradient_accumulation_steps=args.gradient_accumulation_steps)

    hooks = args.zero3_hook_granularity
    if dist.get_world_size() == 1 and 3 in (args.actor_zero_stage, args.critic_zero_stage) and not args.offload:
        # measured at bloom-560m on one H100 (benchmarks/RESULTS.md, tables 3 and 11)
        print_rank_0("note: ZeRO-3 on one GPU partitions nothing: the frozen models run unpartitioned and the "
                     "actor generates from its own shards, but training still gathers, releases and hooks every "
                     "block; --actor_zero_stage 2 --critic_zero_stage 2 train the same models faster (bloom-560m, "
                     "bf16 optimizer state, checkpointed: 1.30x the samples/s) in about the same memory "
                     "(0.6 GiB more), unless parameters are offloaded")
    # actor
    attn = args.attn_implementation
    actor = create_hf_model(args.actor_model_name_or_path, tokenizer, ds_config=actor_cfg,
                            dropout=args.actor_dropout, seed=args.seed, attn_implementation=attn)
    actor = apply_lora(actor, args.actor_lora_dim, args.actor_lora_module_name, args.only_optimize_lora)
    if args.actor_gradient_checkpointing:
        enable_activation_checkpointing(actor, args.checkpoint_every_n_layers)
    if args.compile_blocks:
        print_rank_0(f"actor: {compile_blocks(actor)} blocks compiled for training (torch.compile)")
    opt = build_optimizer(actor, lr=args.actor_learning_rate, weight_decay=args.actor_weight_decay,
                          lora_lr=args.actor_lora_learning_rate, offload=args.offload,
                          adam_kernel=args.adam_kernel, optimizer_dtype=args.optimizer_dtype)
    sched = build_lr_scheduler(opt, args.lr_scheduler_type, args.num_warmup_steps, num_total_iters)
    actor_engine = initialize_engine(actor, actor_cfg, hooks, optimizer=opt, lr_scheduler=sched)
    print_rank_0(f"actor engine ready (ZeRO-{args.actor_zero_stage})")

    # reference: the SFT model, frozen
    world = dist.get_world_size()
    ref_stage = frozen_stage(args.reference_zero_stage, args.actor_zero_stage, world_size=world,
                             offloaded=args.offload_reference_model)
    ref_cfg = eval_ds_config(zero_stage=ref_stage, dtype=args.dtype, offload=args.offload_reference_model)
    ref_engine = None
    if uses_reference(args) and shares_lora_base(args):
        ref_engine = LoRABaseReference(actor_engine)
        print_rank_0("reference model: the actor's frozen base weights with its LoRA adapters switched off "
                     "(one copy of the weights; --separate_lora_reference builds its own)")
    elif uses_reference(args):
        ref = create_hf_model(args.actor_model_name_or_path, tokenizer, ds_config=ref_cfg, seed=args.seed,
                              attn_implementation=attn)
        ref_engine = initialize_engine(ref, ref_cfg, hooks)
        ref_engine.eval()  # frozen models never run dropout
        print_rank_0(f"reference engine ready (ZeRO-{ref_stage})")
    else:
        print_rank_0("no reference model (--kl_ctl 0): the KL term is 0")

    ema_engine = None
    if args.enable_ema:
        ema = create_hf_model(args.actor_model_name_or_path, tokenizer, ds_config=ref_cfg, seed=args.seed,
                              attn_implementation=attn)
        ema_engine = initialize_engine(ema, ref_cfg, hooks)
        ema_engine.eval()

    critic_engine = None
    if uses_critic(args):  # critic: from the reward model, trained
        if uses_reward_model(args):
            critic = load_reward_model(args.critic_model_name_or_path, tokenizer, dropout=args.critic_dropout,
                                       flag="--critic_model_name_or_path", attn_implementation=attn,
                                       ds_config=critic_cfg)
        else:  # rewards from functions only: a causal LM (the SFT model) may start the critic, new value head
            critic = create_reward_model(args.critic_model_name_or_path, tokenizer, ds_config=critic_cfg,
                                         dropout=args.critic_dropout, seed=args.seed, attn_implementation=attn)
        critic.rwtransformer = apply_lora(critic.rwtransformer, args.critic_lora_dim,
                                          args.critic_lora_module_name, args.only_optimize_lora)
        if args.critic_gradient_checkpointing:
            enable_activation_checkpointing(critic, args.checkpoint_every_n_layers)
        if args.compile_blocks:
            print_rank_0(f"critic: {compile_blocks(critic)} blocks compiled for training (torch.compile)")
        opt = build_optimizer(critic, lr=args.critic_learning_rate, weight_decay=args.critic_weight_decay,
                              lora_lr=args.critic_lora_learning_rate, offload=args.offload,
                              adam_kernel=args.adam_kernel, optimizer_dtype=args.optimizer_dtype)
        sched = build_lr_scheduler(opt, args.lr_scheduler_type, args.num_warmup_steps, num_total_iters)
        critic_engine = initialize_engine(critic, critic_cfg, hooks, optimizer=opt, lr_scheduler=sched)
        print_rank_0(f"critic engine ready (ZeRO-{args.critic_zero_stage})")
    else:
        critic_cfg = None
        print_rank_0(f"no critic (--algorithm {args.algorithm})")

    reward_engine = None
    if uses_reward_model(args):  # reward: the same reward model, frozen
        # without a critic the reward model follows the actor's stage (it has no partner)
        partner = args.critic_zero_stage if critic_engine is not None else args.actor_zero_stage
        reward_stage = frozen_stage(args.reward_zero_stage, partner, world_size=world,
                                    offloaded=args.offload_reward_model)
        reward_cfg = eval_ds_config(zero_stage=reward_stage, dtype=args.dtype, offload=args.offload_reward_model)
        reward = load_reward_model(args.critic_model_name_or_path, tokenizer, flag="--critic_model_name_or_path",
                                   attn_implementation=attn, ds_config=reward_cfg)
        reward_engine = initialize_engine(reward, reward_cfg, hooks)
        reward_engine.eval()
        print_rank_0(f"reward engine ready (ZeRO-{reward_stage})")

    hybrid = HybridActor(
        actor_engine, enable_hybrid_engine=args.enable_hybrid_engine,
        mode="layered" if args.unpin_actor_parameters else "full",
        tp_gather_partition_size=args.tp_gather_partition_size,
        release_inference_cache=args.release_inference_cache,
        max_prompt_len=args.max_prompt_seq_len, max_new_tokens=args.max_answer_seq_len,
        use_fast_decode=False if args.disable_fast_decode else None,
        scheduler=scheduler, seed=args.seed, inference_tp_size=args.inference_tp_size,
        # A/B switch of benchmarks/step3.py: a copied replica even where the shards can serve
        shard_views=os.environ.get("DSCHAT_COPY_REPLICA") != "1")
    return RLHFEngines(actor_engine, ref_engine, critic_engine, reward_engine, ema_engine, hybrid,
                       actor_cfg, critic_cfg)


@torch.no_grad()
def update_ema(ema_module, actor_module, beta: float = 0.992) -> None:
    """ZeRO-3-aware EMA update, one parameter pair at a time.

    Both tensors are gathered; every rank computes the same update and rank 0's result
    is re-partitioned (`modifier_rank=0`), so the EMA shards stay consistent. A LoRA
    actor is averaged by its merged weights (base + LoRA delta), as upstream's EMA, which
    averages base and LoRA weights and merges them when it saves.
    """
    from dschat.models.lora import lora_delta

    sources = _ema_sources(actor_module)
    for name, ema_param in ema_module.named_parameters():
        if name not in sources:
            continue
        src, deltas = sources[name]
        lora_params = [t for layer, a, b, scale in deltas for t in (a, b)]
        with gathered([src, *lora_params]), gathered([ema_param], modifier_rank=0):
            value = src.data
            if deltas:
                value = value.float() + sum(lora_delta(layer, a.data, b.data, scale)
                                            for layer, a, b, scale in deltas)
            ema_update_([ema_param.data], [value], beta)


def _ema_sources(actor_module) -> dict:
    """EMA (plain model) parameter name -> (actor parameter, [(lora layer, A, B, scale)])."""
    from dschat.models.lora import PEFT_PREFIX, is_peft_model, lora_layers

    if not is_peft_model(actor_module):
        return {name: (p, []) for name, p in actor_module.named_parameters()}
    layers = lora_layers(actor_module)
    out = {}
    for name, p in actor_module.named_parameters():
        if "lora_" in name:
            continue
        deltas = []
        path = name[:-len(".base_layer.weight")] if name.endswith(".base_layer.weight") else None
        if path in layers:
            layer = layers[path]
            deltas = [(layer, layer.lora_A[adapter].weight, layer.lora_B[adapter].weight, scale)
                      for adapter, scale in layer.scaling.items()]
        clean = name[len(PEFT_PREFIX):] if name.startswith(PEFT_PREFIX) else name
        out[clean.replace(".base_layer.", ".")] = (p, deltas)
    return out

"""Flag validation of the three steps: every problem collected, reported together.

`step1_problems`, `step2_problems`, `step3_problems` look only at the parsed flags, the
environment (WORLD_SIZE, set by the launcher) and the file system, so entry points call
`validate_step*` before any process group, model or output file exists.
"""
from __future__ import annotations

import os
from pathlib import Path

from dschat.cli.flags import split_fractions
from dschat.engine.config import frozen_stage, optimizer_dtype_problems
from dschat.utils.errors import UserInputError


def raise_problems(problems: list[str]) -> None:
    """One UserInputError listing every problem (nothing when the list is empty)."""
    if problems:
        raise UserInputError("invalid flags:\n  - " + "\n  - ".join(problems))


def launch_world_size() -> int:
    """The world size the launcher announced (1 for a plain `python main.py`)."""
    try:
        return max(int(os.environ.get("WORLD_SIZE", "1")), 1)
    except ValueError:
        return 1


def looks_local(path: str) -> bool:
    """A path the user meant as local (hub names look like `org/name`)."""
    return path.startswith((".", "/", "~")) or path.endswith((".json", ".jsonl", ".csv", ".parquet", ".gz"))


def _missing_local(path: str | None) -> bool:
    return bool(path) and looks_local(path) and not os.path.exists(os.path.expanduser(path))


def _same_path(a: str | Path, b: str | Path) -> bool:
    try:
        return Path(os.path.expanduser(str(a))).resolve() == Path(os.path.expanduser(str(b))).resolve()
    except OSError:
        return False


def _at_least(args, flags: tuple[str, ...], minimum: int) -> list[str]:
    return [f"--{f} must be >= {minimum}, got {getattr(args, f)}" for f in flags if getattr(args, f) < minimum]


def _data_split(args) -> list[str]:
    try:
        split_fractions(args.data_split)
    except UserInputError as e:
        return [str(e)]
    return []


def _data_paths(args) -> list[str]:
    return [f"--{flag} {p}: no such file or folder"
            for flag in ("data_path", "sft_only_data_path")
            for p in list(getattr(args, flag, None) or []) if _missing_local(p)]


def checkpoint_problems(args) -> list[str]:
    """--save_interval / --keep_last / --max_nonfinite_in_a_row (every step), and a fresh
    run into an --output_dir that holds another run's checkpoints."""
    from dschat.utils.checkpoint import checkpoint_root, latest_checkpoint

    out = _at_least(args, ("save_interval", "keep_last"), 0)
    out += _at_least(args, ("max_nonfinite_in_a_row",), 1)
    if args.output_dir and not args.resume and (last := latest_checkpoint(args.output_dir)) is not None:
        # mixing two runs' checkpoints would make a later --resume continue the wrong one
        out.append(f"--output_dir {args.output_dir} holds checkpoints of an earlier run (newest: {last.name}); "
                   f"pass --resume to continue it, or remove {checkpoint_root(args.output_dir)} or pick "
                   "another --output_dir")
    return out


def _has_fp16_device() -> bool:
    """A GPU-like accelerator is there (DeepSpeed's CPU accelerator has no fp16)."""
    import importlib.util

    import torch
    if torch.cuda.is_available() or getattr(torch, "xpu", None) is not None and torch.xpu.is_available():
        return True
    if os.environ.get("DS_ACCELERATOR", "cpu") != "cpu":
        return True
    return any(importlib.util.find_spec(m) is not None for m in ("torch_npu", "habana_frameworks"))


def _dtype(args) -> list[str]:
    if args.dtype == "fp16" and not _has_fp16_device():
        return ["--dtype fp16 (the DS-Chat default) needs a GPU; on CPU use --dtype fp32 or bf16"]
    return []


def _offload_knobs(args, trained_stages) -> list[str]:
    out = []
    ratio = args.offload_ratio
    if not 0 < ratio <= 1:
        out.append(f"--offload_ratio must be in (0, 1], got {ratio}")
    elif ratio < 1 and (not args.offload or 3 not in trained_stages or any(s in (1, 2) for s in trained_stages)):
        out.append("--offload_ratio below 1 is DeepSpeed's partial offload: it needs --offload and ZeRO stage 3 "
                   "for every trained model that offloads")
    for flag in ("offload_optimizer_only", "offload_pin_memory"):
        if getattr(args, flag) and not args.offload:
            out.append(f"--{flag} needs --offload")
    out += optimizer_dtype_problems(args.optimizer_dtype, args.dtype, trained_stages, args.offload)
    return out


def _dropout(flag: str, value) -> list[str]:
    if value is not None and not 0 <= value < 1:
        return [f"--{flag} must be in [0, 1), got {value}"]
    return []


def _lora(prefix: str, dim: int, module_name) -> list[str]:
    out = []
    if dim < 0:
        out.append(f"--{prefix}lora_dim must be >= 0, got {dim}")
    if dim == 0 and module_name:
        out.append(f"--{prefix}lora_module_name needs --{prefix}lora_dim > 0")
    return out


def sft_problems(args) -> list[str]:
    """Problems shared by steps 1 and 2."""
    out = _data_split(args)
    out += _at_least(args, ("per_device_train_batch_size", "per_device_eval_batch_size", "max_seq_len",
                            "gradient_accumulation_steps", "num_train_epochs", "eval_iters",
                            "checkpoint_every_n_layers"), 1)
    out += _at_least(args, ("num_warmup_steps", "max_steps", "eval_interval"), 0)
    if args.learning_rate <= 0:
        out.append(f"--learning_rate must be > 0, got {args.learning_rate}")
    if args.weight_decay < 0:
        out.append(f"--weight_decay must be >= 0, got {args.weight_decay}")
    out += _dropout("dropout", args.dropout) + _dtype(args)
    if args.offload and args.zero_stage == 0:
        out.append("--offload needs --zero_stage 1, 2 or 3 (ZeRO-Offload offloads ZeRO state)")
    out += _offload_knobs(args, (args.zero_stage,))
    out += _lora("", args.lora_dim, args.lora_module_name)
    if args.lora_dim == 0 and args.only_optimize_lora:
        out.append("--only_optimize_lora needs --lora_dim > 0")
    if args.output_dir is None:
        out.append("--output_dir is required")
    elif args.model_name_or_path and _same_path(args.output_dir, args.model_name_or_path):
        out.append(f"--output_dir {args.output_dir} is --model_name_or_path: the run would overwrite "
                   "its own input model; pick another --output_dir")
    if _missing_local(args.model_name_or_path):
        out.append(f"--model_name_or_path {args.model_name_or_path}: no such file or folder")
    out += _fits_positions(args.model_name_or_path, args.max_seq_len, "--max_seq_len", "model_name_or_path")
    out += _data_paths(args)
    out += checkpoint_problems(args)
    return out


def _fits_positions(path: str | None, length: int, flags: str, owner: str) -> list[str]:
    """A learned position table (OPT, GPT-2) must hold the longest sequence a step feeds;
    past it HF's position lookup fails deep inside the forward. Local models only (their
    config.json is read; nothing is loaded)."""
    from dschat.models.model_utils import load_config
    from dschat.registry import get_family

    if not path or not os.path.exists(os.path.expanduser(path)):
        return []                  # hub names load later; missing paths are reported elsewhere
    try:
        config = load_config(os.path.expanduser(path))
        learned = get_family(config.model_type).position == "learned"
    except (UserInputError, ValueError, OSError):
        return []                  # reported by the path checks or when the model loads
    n = getattr(config, "max_position_embeddings", None)
    if not learned or n is None or length <= n:
        return []
    return [f"{flags} = {length} is longer than the position table of --{owner} {path} "
            f"({config.model_type}: {n} learned positions); lower it"]


def step1_problems(args) -> list[str]:
    return sft_problems(args)


def step2_problems(args) -> list[str]:
    out = sft_problems(args)
    if args.num_padding_at_beginning is not None and args.num_padding_at_beginning < 0:
        out.append(f"--num_padding_at_beginning must be >= 0, got {args.num_padding_at_beginning}")
    return out


def step2_dpo_problems(args) -> list[str]:
    """Every flag problem of step 2 DPO: those of steps 1-2 and the DPO flags."""
    out = sft_problems(args)
    if not args.beta > 0:
        out.append(f"--beta must be > 0, got {args.beta}")
    if not 0 <= args.label_smoothing < 0.5:
        out.append(f"--label_smoothing must be in [0, 0.5), got {args.label_smoothing}")
    if args.label_smoothing and args.loss_type != "sigmoid":
        out.append(f"--label_smoothing applies to --loss_type sigmoid only, not {args.loss_type}")
    if args.rpo_alpha is not None and args.rpo_alpha < 0:
        out.append(f"--rpo_alpha must be >= 0, got {args.rpo_alpha}")
    if args.offload_reference_model and frozen_stage(args.reference_zero_stage, args.zero_stage) != 3:
        out.append("--offload_reference_model needs the reference model at ZeRO-3: --zero_stage 3 "
                   "(it follows the policy) or --reference_zero_stage 3")
    return out


def step3_problems(args) -> list[str]:
    """Every flag problem of step 3."""
    from dschat.models.reward_model import is_reward_checkpoint

    out = []
    world = launch_world_size()
    out += _inference_tp(args, world)
    out += _at_least(args, ("per_device_generation_batch_size", "per_device_training_batch_size",
                            "generation_batches", "ppo_epochs", "max_prompt_seq_len", "max_answer_seq_len",
                            "num_train_epochs", "gradient_accumulation_steps", "print_answers_interval",
                            "checkpoint_every_n_layers",
                            "tp_gather_partition_size"), 1)
    out += _at_least(args, ("num_warmup_steps", "max_steps", "min_answer_seq_len", "test_stop_step", "profile_step"), 0)
    gen_rows = args.per_device_generation_batch_size * args.generation_batches
    if args.per_device_training_batch_size >= 1 and gen_rows % args.per_device_training_batch_size:
        out.append(f"--per_device_generation_batch_size x --generation_batches ({gen_rows}) must be a "
                   f"multiple of --per_device_training_batch_size ({args.per_device_training_batch_size})")
    if args.min_answer_seq_len > args.max_answer_seq_len:
        out.append(f"--min_answer_seq_len {args.min_answer_seq_len} exceeds --max_answer_seq_len "
                   f"{args.max_answer_seq_len}")
    out += _score_in_training_forward(args)
    for flag in ("actor_learning_rate", "critic_learning_rate"):
        if getattr(args, flag) <= 0:
            out.append(f"--{flag} must be > 0, got {getattr(args, flag)}")
    out += _dropout("actor_dropout", args.actor_dropout) + _dropout("critic_dropout", args.critic_dropout)
    out += _dtype(args)
    if args.temperature is not None and args.temperature <= 0:
        out.append(f"--temperature must be > 0, got {args.temperature}")
    if args.top_p is not None and not 0 < args.top_p <= 1:
        out.append(f"--top_p must be in (0, 1], got {args.top_p}")
    if args.top_k is not None and args.top_k < 0:
        out.append(f"--top_k must be >= 0, got {args.top_k}")
    # ZeRO stages and offload
    if args.offload and args.actor_zero_stage == 0 and args.critic_zero_stage == 0:
        out.append("--offload needs --actor_zero_stage or --critic_zero_stage >= 1")
    from dschat.rlhf.algorithm import uses_critic
    trained = (args.actor_zero_stage, args.critic_zero_stage) if uses_critic(args) else (args.actor_zero_stage,)
    out += _offload_knobs(args, trained)
    if getattr(args, "compile_blocks", False) and 3 in trained:
        out.append("--compile_blocks needs the trained models at ZeRO 0-2 (ZeRO-3 gathers parameters inside "
                   "each block): --actor_zero_stage 2 --critic_zero_stage 2 on one node")
    if args.offload_reference_model and frozen_stage(args.reference_zero_stage, args.actor_zero_stage) != 3:
        out.append("--offload_reference_model needs the reference model at ZeRO-3: --actor_zero_stage 3 "
                   "(it follows the actor) or --reference_zero_stage 3; at stage 0 there is nothing to offload")
    # without a critic the reward model follows the actor's stage (dschat/rlhf/engine.py)
    partner = args.critic_zero_stage if getattr(args, "algorithm", "ppo") == "ppo" else args.actor_zero_stage
    if args.offload_reward_model and frozen_stage(args.reward_zero_stage, partner) != 3:
        out.append("--offload_reward_model needs the reward model at ZeRO-3: --critic_zero_stage 3 "
                   "(it follows the critic; without one, the actor) or --reward_zero_stage 3")
    # LoRA
    out += _lora("actor_", args.actor_lora_dim, args.actor_lora_module_name)
    out += _lora("critic_", args.critic_lora_dim, args.critic_lora_module_name)
    if args.enable_mixed_precision_lora and not (args.actor_lora_dim > 0 and args.actor_zero_stage == 3):
        out.append("--enable_mixed_precision_lora needs --actor_lora_dim > 0 and --actor_zero_stage 3")
    if args.only_optimize_lora and args.actor_lora_dim == 0 and args.critic_lora_dim == 0:
        out.append("--only_optimize_lora needs --actor_lora_dim or --critic_lora_dim > 0")
    # hybrid engine
    if args.unpin_actor_parameters and not args.enable_hybrid_engine:
        out.append("--unpin_actor_parameters needs --enable_hybrid_engine")
    if args.release_inference_cache and not args.enable_hybrid_engine:
        out.append("--release_inference_cache needs --enable_hybrid_engine")
    out += _algorithm(args)
    # paths
    actor, critic = args.actor_model_name_or_path, args.critic_model_name_or_path
    if _missing_local(actor):
        out.append(f"--actor_model_name_or_path {actor}: no such file or folder")
    if critic is None:
        pass                     # whether one is needed is checked by _algorithm
    elif not os.path.isdir(critic):
        out.append(f"--critic_model_name_or_path {critic}: no such folder (pass the step-2 output folder)")
    elif not is_reward_checkpoint(critic) and _reward_model_scores(args):
        out.append(f"--critic_model_name_or_path {critic} is not a reward model (no reward_model.json "
                   "and no DS-Chat v_head weights); pass the step-2 output folder (a causal LM may only "
                   "start the critic: with --reward_fn and the reward model's weight 0 in --reward_weights)")
    if args.output_dir is None:
        out.append("--output_dir is required")
    else:
        for sub, flag, path in (("actor", "actor_model_name_or_path", actor),
                                ("critic", "critic_model_name_or_path", critic)):
            if path and _same_path(Path(args.output_dir) / sub, path) or _same_path(args.output_dir, path):
                out.append(f"--output_dir {args.output_dir} would overwrite --{flag} {path} "
                           f"(the run writes {sub}/ there); pick another --output_dir")
    total = args.max_prompt_seq_len + args.max_answer_seq_len
    for owner in ("actor_model_name_or_path", "critic_model_name_or_path"):
        out += _fits_positions(getattr(args, owner), total, "--max_prompt_seq_len + --max_answer_seq_len", owner)
    if _missing_local(args.unsupervised_dataset_name):
        out.append(f"--unsupervised_dataset_name {args.unsupervised_dataset_name}: no such file or folder")
    out += _data_split(args) + _data_paths(args)
    out += checkpoint_problems(args)
    return out


def _reward_model_scores(args) -> bool:
    """Whether --critic_model_name_or_path is also the reward model (its --reward_weights entry
    is not 0); a malformed --reward_weights is reported by _algorithm, so it counts as yes here."""
    from dschat.rlhf.algorithm import uses_reward_model
    try:
        return uses_reward_model(args)
    except (UserInputError, ValueError):
        return True


def _score_in_training_forward(args) -> list[str]:
    """--score_in_training_forward is exact only when each rollout trains once, in one micro-batch,
    on the weights that generated it (dropout is checked once the models exist)."""
    if not getattr(args, "score_in_training_forward", False):
        return []
    needs = [(args.ppo_epochs == 1, f"--ppo_epochs 1 (got {args.ppo_epochs})"),
             (args.generation_batches == 1, f"--generation_batches 1 (got {args.generation_batches})"),
             (args.per_device_training_batch_size >= args.per_device_generation_batch_size,
              f"one training micro-batch per rollout: --per_device_training_batch_size "
              f"{args.per_device_training_batch_size} < --per_device_generation_batch_size "
              f"{args.per_device_generation_batch_size}"),
             (args.gradient_accumulation_steps == 1,
              f"--gradient_accumulation_steps 1 (got {args.gradient_accumulation_steps})"),
             (not args.filter_groups, "no --filter_groups")]
    return [f"--score_in_training_forward needs {what}" for ok, what in needs if not ok]


def _algorithm(args) -> list[str]:
    """--algorithm and the critic-free flags (dschat/rlhf/algorithm.py): one line per problem."""
    from dschat.rlhf.algorithm import GROUP_ALGORITHMS, reward_fn_specs, reward_weights
    from dschat.rlhf.reward_fn import RewardFunctionError, load_reward_fn

    out, algo, n = [], args.algorithm, args.n_samples_per_prompt
    sampling = any(v is not None for v in (args.temperature, args.top_p, args.top_k))
    out += _at_least(args, ("n_samples_per_prompt", "filter_groups_max_extra"), 1)
    out += _at_least(args, ("overlong_penalty",), 0)
    if algo in GROUP_ALGORITHMS and n < 2:
        out.append(f"--algorithm {algo} needs --n_samples_per_prompt >= 2 (it compares the answers to one "
                   f"prompt), got {n}")
    if n >= 1 and args.per_device_generation_batch_size % n:
        out.append(f"--per_device_generation_batch_size {args.per_device_generation_batch_size} (answers per "
                   f"rank) is not a multiple of --n_samples_per_prompt {n}")
    if n > 1 and not sampling:
        out.append(f"--n_samples_per_prompt {n} with greedy decoding gives {n} identical answers; sample with "
                   "--temperature, --top_p or --top_k")
    if args.filter_groups and n < 2:
        out.append("--filter_groups needs groups: --n_samples_per_prompt >= 2")
    if args.filter_groups and args.unsupervised_dataset_name:
        out.append("--filter_groups cannot be combined with --unsupervised_dataset_name (ptx batches are cut "
                   "like full generation batches; a filtered batch is smaller)")
    if args.no_std_norm and algo != "grpo":
        out.append(f"--no_std_norm applies to --algorithm grpo only, not {algo}")
    if args.kl_ctl < 0:
        out.append(f"--kl_ctl must be >= 0, got {args.kl_ctl}")
    if args.kl_target is not None:
        if args.kl_target <= 0:
            out.append(f"--kl_target must be > 0, got {args.kl_target}")
        if args.kl_ctl == 0:
            out.append("--kl_target needs --kl_ctl > 0 (the adaptive coefficient starts there and scales it)")
    if args.kl_horizon <= 0:
        out.append(f"--kl_horizon must be > 0, got {args.kl_horizon}")
    for flag in ("cliprange_low", "cliprange_high"):
        value = getattr(args, flag)
        if value is not None and not value > 0:
            out.append(f"--{flag} must be > 0, got {value}")
    if args.cliprange_low is not None and args.cliprange_low >= 1:
        out.append(f"--cliprange_low must be < 1 (the ratio's lower bound is 1 - it), got {args.cliprange_low}")
    if args.overlong_penalty > args.max_answer_seq_len:
        out.append(f"--overlong_penalty {args.overlong_penalty} exceeds --max_answer_seq_len "
                   f"{args.max_answer_seq_len}")
    # rewards: a reward model, reward functions, or both
    specs = reward_fn_specs(args)
    for spec in specs:
        try:
            load_reward_fn(spec)
        except RewardFunctionError as e:
            out.append(str(e))
    critic = args.critic_model_name_or_path
    if algo == "ppo" and not critic:
        out.append("--algorithm ppo needs --critic_model_name_or_path (the critic's value network starts from "
                   "the reward model; give it weight 0 in --reward_weights to score with --reward_fn only)")
    elif not critic and not specs:
        out.append(f"--algorithm {algo} needs a reward: --critic_model_name_or_path (a reward model) and/or "
                   "--reward_fn FILE.py:FUNCTION")
    try:
        weights = reward_weights(args)
    except ValueError:
        out.append(f"--reward_weights {','.join(args.reward_weights)}: expected numbers")
        weights = None
    if weights is not None:
        expected = len(specs) + (1 if critic else 0)
        if len(weights) != expected:
            what = " + ".join((["1 for the reward model"] if critic else []) + [f"{len(specs)} for --reward_fn"])
            out.append(f"--reward_weights has {len(weights)} weights; expected {expected} ({what})")
        elif weights and all(w == 0 for w in weights):
            out.append("--reward_weights are all 0: nothing would reward the answers")
    if args.skip_bad_rewards and not specs:
        out.append("--skip_bad_rewards applies to --reward_fn rewards; none given")
    return out


def validate_step1(args) -> None:
    raise_problems(step1_problems(args))


def validate_step2(args) -> None:
    raise_problems(step2_problems(args))


def validate_step2_dpo(args) -> None:
    raise_problems(step2_dpo_problems(args))


def _inference_tp(args, world: int) -> list[str]:
    """--inference_tp_size: divides the world size; with the actor's config (read before
    any model loads) it must also divide the attention and KV head counts."""
    from dschat.models.model_utils import load_config
    from dschat.rollout.tensor_parallel import tp_size_problems

    config = None
    actor = args.actor_model_name_or_path
    if args.inference_tp_size > 1 and not _missing_local(actor):
        try:
            config = load_config(actor)
        except UserInputError:
            pass        # a bad actor path is reported by the path checks
    return tp_size_problems(args.inference_tp_size, world, config, hybrid=args.enable_hybrid_engine)


def validate_step3(args) -> None:
    raise_problems(step3_problems(args))

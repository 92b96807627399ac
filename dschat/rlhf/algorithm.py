"""Step 3's algorithm choice (--algorithm) and what it implies: which models are built,
which KL defaults apply, where each reward weight goes. Pure functions of the parsed flags
(no torch, no deepspeed), shared by validation, the engine builder and the trainer.

    ppo           critic (GAE), DS-Chat's default; KL k1 in the reward
    grpo          group-normalised rewards (Dr.GRPO with --no_std_norm); KL k3 in the loss
    rloo          leave-one-out baseline over the group; KL k3 in the loss
    reinforce_pp  REINFORCE++: return-to-go of KL-penalised token rewards, whitened over the
                  batch; KL k1 in the reward
"""
from __future__ import annotations

ALGORITHMS = ("ppo", "grpo", "rloo", "reinforce_pp")
GROUP_ALGORITHMS = ("grpo", "rloo")          # advantages compare the answers of one prompt
# (default KL estimator, where the KL goes): upstream DS-Chat / OpenRLHF for ppo and
# REINFORCE++, TRL / DeepSeekMath for GRPO and RLOO
KL_DEFAULTS = {"ppo": ("k1", "reward"), "reinforce_pp": ("k1", "reward"),
               "grpo": ("k3", "loss"), "rloo": ("k3", "loss")}


def uses_critic(args) -> bool:
    return args.algorithm == "ppo"


def uses_reference(args) -> bool:
    """--kl_ctl 0 builds no reference model (the KL term is then 0 everywhere)."""
    return args.kl_ctl > 0


def shares_lora_base(args) -> bool:
    """The reference is the actor's own base weights: a LoRA actor whose base is frozen
    (--only_optimize_lora), unless --separate_lora_reference or a reference placement flag
    asks for a model of its own. Flags missing from `args` take step 3's defaults (the
    presets' memory estimate passes only the flags a preset sets)."""
    return (getattr(args, "actor_lora_dim", 0) > 0 and bool(getattr(args, "only_optimize_lora", False))
            and not getattr(args, "separate_lora_reference", False)
            and getattr(args, "reference_zero_stage", None) is None
            and not getattr(args, "offload_reference_model", False))


def reward_fn_specs(args) -> list[str]:
    """--reward_fn values, repeatable and comma-separated, in order."""
    return [s.strip() for value in (args.reward_fn or []) for s in value.split(",") if s.strip()]


def reward_weights(args) -> list[float] | None:
    """--reward_weights as floats (None when not given); ValueError on a bad number."""
    if args.reward_weights is None:
        return None
    return [float(w) for value in args.reward_weights for w in str(value).split(",") if w.strip()]


def reward_model_weight(args) -> float:
    """The reward model's weight: the first --reward_weights entry when a reward model is
    given (1 without --reward_weights); 0 without a reward model."""
    if not args.critic_model_name_or_path:
        return 0.0
    weights = reward_weights(args)
    return weights[0] if weights else 1.0


def uses_reward_model(args) -> bool:
    """The reward model (--critic_model_name_or_path) scores answers unless its weight is 0
    (then it is not even built; under ppo the path still initialises the critic)."""
    return reward_model_weight(args) != 0


def kl_settings(args) -> tuple[str, str]:
    """(estimator, "reward" | "loss") with the algorithm's defaults filled in."""
    estimator, where = KL_DEFAULTS[args.algorithm]
    return args.kl_estimator or estimator, args.kl_in or where

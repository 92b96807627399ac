"""Presets (configs/presets/NAME.json): loading, resolving --actor-model / --reward-model to a
model path and hyperparameters, and the rule-of-thumb memory estimate per step."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

from dschat.rlhf.algorithm import shares_lora_base
from dschat.utils.errors import UserInputError

REPO = Path(__file__).resolve().parents[2]


PRESET_DIR = REPO / "configs" / "presets"


DEMO = "demo"


DEPLOYMENTS = ("single_gpu", "single_node", "multi_node", "cpu")


def preset_names() -> list[str]:
    return sorted(p.stem for p in PRESET_DIR.glob("*.json"))


def load_preset(name_or_path: str) -> dict:
    """A preset by name (configs/presets/NAME.json) or by path to such a file."""
    path = Path(name_or_path)
    if not (path.suffix == ".json" and path.is_file()):
        path = PRESET_DIR / f"{name_or_path}.json"
    if not path.is_file():
        raise UserInputError(f"no preset {name_or_path!r}; known presets: {', '.join(preset_names())}")
    try:
        preset = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise UserInputError(f"preset {path}: not valid JSON ({e})") from None
    for key in ("name", "model", "deployments"):
        if key not in preset:
            raise UserInputError(f"preset {path}: missing {key!r}")
    preset["_path"] = str(path)
    return preset


def is_preset(spec: str) -> bool:
    path = Path(spec)
    if (PRESET_DIR / f"{spec}.json").is_file():
        return True
    if path.suffix == ".json" and path.is_file():
        try:
            return "deployments" in json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            return False
    return False


def repo_path(value: str) -> str:
    """Preset model paths like configs/tiny/bloom.json are relative to the repository."""
    if value.startswith(("configs/", "./", "../")) and (REPO / value).exists():
        return str(REPO / value)
    return value


def count_params(model: str) -> float | None:
    """Parameters (billions) of a model folder, config.json or cached hub name, counted on
    the meta device (no weights are read); None when its config cannot be read."""
    import torch
    from transformers import AutoModelForCausalLM

    from dschat.models.model_utils import load_config
    try:
        config = load_config(model)
    except (UserInputError, OSError, ValueError):
        return None
    with torch.device("meta"):
        lm = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in lm.parameters()) / 1e9


def closest_preset(params_b: float | None, role: str) -> dict:
    """The hub-model preset nearest in size (log scale) to a model of `params_b` billion."""
    import math
    presets = [load_preset(n) for n in preset_names() if n != DEMO]
    if params_b is None:
        raise UserInputError(f"cannot read the config of the {role} model to pick a preset; "
                             f"pass --{role}-preset (one of {', '.join(preset_names())})")
    if params_b < 0.05:
        return load_preset(DEMO)
    return min(presets, key=lambda p: abs(math.log(p["params_billion"] / params_b)))


@dataclass
class ModelChoice:
    """What one of --actor-model / --reward-model resolved to."""
    spec: str                    # as the user gave it
    path: str                    # what main.py gets: a folder, a config.json or a hub name
    preset: dict                 # where its hyperparameters come from
    params_b: float | None
    note: str = ""


def resolve_model(spec: str, role: str, preset_override: str | None, random_init: bool,
                  output_dir: Path) -> ModelChoice:
    """Turn --actor-model / --reward-model into a model path and a preset."""
    if is_preset(spec):
        preset = load_preset(spec)
        path = repo_path(preset["model"])
        note = f"preset {preset['name']} ({preset['_path']})"
        if random_init:
            if "config" not in preset:
                raise UserInputError(f"--random-init: preset {preset['name']} has no 'config' to build from")
            cfg_path = output_dir / "configs" / f"{preset['name']}.json"
            cfg_path.parent.mkdir(parents=True, exist_ok=True)
            cfg_path.write_text(json.dumps(preset["config"], indent=2))
            path = str(cfg_path)
            note += ", random weights from its config"
        if preset_override:
            preset = load_preset(preset_override)
            note += f", hyperparameters of preset {preset['name']}"
        return ModelChoice(spec, path, preset, preset.get("params_billion"), note)
    local = Path(spec).expanduser()
    if spec.startswith((".", "/", "~")) and not local.exists():
        raise UserInputError(f"--{role}-model {spec}: no such file or folder, and not a preset "
                             f"({', '.join(preset_names())})")
    path = str(local.resolve()) if local.exists() else spec
    params = count_params(path)
    preset = load_preset(preset_override) if preset_override else closest_preset(params, role)
    size = f"{params:.2f}B parameters" if params is not None else "size unknown"
    how = "given" if preset_override else "closest in size"
    return ModelChoice(spec, path, preset, params, f"{size}; hyperparameters of preset {preset['name']} ({how})")


def deployment_row(preset: dict, deployment: str, low_memory: bool = False) -> dict:
    """The preset's settings for one deployment, with its low_memory overrides applied if asked."""
    rows = preset["deployments"]
    if deployment not in rows:
        raise UserInputError(f"preset {preset['name']} has no {deployment!r} deployment; it has: "
                             f"{', '.join(rows)}")
    row = json.loads(json.dumps(rows[deployment]))  # deep copy
    if low_memory:
        for key, value in row.pop("low_memory", {}).items():
            if isinstance(value, dict):
                row.setdefault(key, {}).update(value)
            else:
                row[key] = value
    return row


GPU_BUDGET = 0.5  # model states may take this share of GPU memory; the rest: activations, logits, KV cache


OPTIMIZER_BYTES = {"fp32": 12, "bf16": 4}   # per trained parameter beside its weight and gradient (--optimizer_dtype)


def model_state_gb(params_b: float, stage: int, gpus: int, *, trained: bool = True, offload: bool = False,
                   lora_params_b: float = 0.0, optimizer_dtype: str = "fp32") -> float:
    """Per-GPU GB of one model's states under ZeRO: the rule of thumb the presets follow.

    Trained with Adam in mixed precision: 16 bytes/param (2 weights + 2 grads + 12 fp32
    master weights and moments); stage 1 partitions the 12 over the GPUs, stage 2 also the
    grads, stage 3 everything; --offload moves the 12 (and at stage 3 the weights) to CPU.
    With --optimizer_dtype bf16 the weights are the master weights and the moments bf16: 4
    in place of the 12.
    LoRA with --only_optimize_lora: the base weights are frozen (2 bytes/param) and only
    the LoRA weights carry the 16. Frozen models (reference, reward): 2 bytes/param,
    partitioned at stage 3 only, on the CPU when offloaded at stage 3.
    """
    n = max(gpus, 1)
    if not trained:
        return 0.0 if offload and stage == 3 else 2 * params_b / (n if stage == 3 else 1)
    if lora_params_b:
        base = 0.0 if offload and stage == 3 else 2 * params_b / (n if stage == 3 else 1)
        return base + model_state_gb(lora_params_b, stage, gpus, offload=offload, optimizer_dtype=optimizer_dtype)
    weights, grads, optim = 2 * params_b, 2 * params_b, OPTIMIZER_BYTES[optimizer_dtype] * params_b
    if offload and stage >= 1:
        optim = 0.0
        if stage == 3:
            weights = 0.0
    if stage >= 1:
        optim /= n
    if stage >= 2:
        grads /= n
    if stage == 3:
        weights /= n
    return weights + grads + optim


def lora_params(preset: dict, rank: int) -> float:
    """LoRA parameters (billions) at `rank` over the family's default target modules."""
    return preset.get("lora_params_million_per_rank", 0.0) * rank / 1000.0


def step_memory_gb(step: int, flags: dict, actor: dict, critic: dict, gpus: int) -> dict:
    """Per-GPU GB of model states in one step, from its final flags and the two presets."""
    a_b, c_b = actor.get("params_billion", 0.0), critic.get("params_billion", 0.0)
    offload, only_lora = bool(flags.get("offload")), bool(flags.get("only_optimize_lora"))
    opt_dtype = flags.get("optimizer_dtype", "fp32")
    if step in (1, 2):
        preset, size = (actor, a_b) if step == 1 else (critic, c_b)
        lora = lora_params(preset, flags.get("lora_dim", 0)) if only_lora else 0.0
        return {"total": model_state_gb(size, flags["zero_stage"], gpus, offload=offload, lora_params_b=lora,
                                        optimizer_dtype=opt_dtype)}
    a_stage, c_stage = flags["actor_zero_stage"], flags["critic_zero_stage"]
    frozen = lambda stage: 3 if stage == 3 else 0  # noqa: E731 - as dschat.rlhf.engine
    parts = {
        "actor": model_state_gb(a_b, a_stage, gpus, offload=offload, optimizer_dtype=opt_dtype,
                                lora_params_b=lora_params(actor, flags.get("actor_lora_dim", 0)) if only_lora else 0),
        "critic": model_state_gb(c_b, c_stage, gpus, offload=offload, optimizer_dtype=opt_dtype,
                                 lora_params_b=(lora_params(critic, flags.get("critic_lora_dim", 0))
                                                if only_lora else 0)),
        # a LoRA actor with a frozen base is its own reference (adapters off): no copy
        "reference": 0.0 if shares_lora_base(SimpleNamespace(**flags)) else model_state_gb(
            a_b, frozen(a_stage), gpus, trained=False, offload=bool(flags.get("offload_reference_model"))),
        "reward": model_state_gb(c_b, frozen(c_stage), gpus, trained=False,
                                 offload=bool(flags.get("offload_reward_model"))),
    }
    # on one GPU without LoRA and with the shards on it, the replica is views of the shards
    shard_views = (gpus == 1 and not flags.get("actor_lora_dim")
                   and not (offload and not flags.get("offload_optimizer_only")))
    if a_stage == 3 and flags.get("enable_hybrid_engine") and not shard_views:
        layers = actor.get("num_layers", 24)
        share = (min(1.0, flags.get("tp_gather_partition_size", 8) / layers)
                 if flags.get("unpin_actor_parameters") else 1.0)
        parts["replica"] = 2 * a_b * share
    parts["total"] = sum(parts.values())
    return parts


def dpo_memory_gb(flags: dict, actor: dict, gpus: int) -> dict:
    """Per-GPU GB of model states of step 2 DPO: the policy trained like step 1 plus the
    frozen reference (ZeRO-3 when the policy is, else whole; offloaded if asked)."""
    stage, size = int(flags["zero_stage"]), actor.get("params_billion", 0.0)
    lora = lora_params(actor, flags.get("lora_dim", 0)) if flags.get("only_optimize_lora") else 0.0
    ref_stage = int(flags.get("reference_zero_stage", 3 if stage == 3 else 0))
    parts = {"policy": model_state_gb(size, stage, gpus, offload=bool(flags.get("offload")), lora_params_b=lora),
             "reference": model_state_gb(size, ref_stage, gpus, trained=False,
                                         offload=bool(flags.get("offload_reference_model")))}
    parts["total"] = sum(parts.values())
    return parts


def list_presets() -> None:
    print(f"{'preset':<12} {'model':<28} {'params':>7}  {'reward model':<12} deployments")
    for name in preset_names():
        p = load_preset(name)
        rows = ", ".join(f"{k}({v['num_gpus']}): ZeRO {v['actor_zero_stage']}/{v['reward_zero_stage']}"
                         for k, v in p["deployments"].items())
        print(f"{name:<12} {p['model']:<28} {p.get('params_billion', 0):>6.2f}B  "
              f"{p.get('reward_model', '-'):<12} {rows}")


def sized(choice: ModelChoice) -> dict:
    """The preset of a model with its own parameter count (a non-preset model may differ)."""
    return {**choice.preset, "params_billion": choice.params_b or choice.preset.get("params_billion", 0.0)}


def largest_layer_b(preset: dict) -> float:
    """Billions of parameters in the largest layer (the embedding, vocabulary x hidden, where
    the preset's config gives them; else an even share of the layers)."""
    cfg = preset.get("config", {})
    hidden = cfg.get("hidden_size") or cfg.get("n_embd")
    if cfg.get("vocab_size") and hidden:
        return cfg["vocab_size"] * hidden / 1e9
    return preset.get("params_billion", 0.0) / max(1, preset.get("num_layers", 1))


def deepspeed_states_gb(preset: dict, stage: int, gpus: int, offload: bool) -> tuple[float, float]:
    """(GPU GB per GPU, host GB per node) of one trained model's states by DeepSpeed's own
    estimators (estimate_zero3_model_states_mem_needs at stage 3, estimate_zero2_... below:
    fp32 gradients counted, a 1.5x host buffer), beside the rule of thumb above."""
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs
    params = int(preset.get("params_billion", 0.0) * 1e9)
    n = max(gpus, 1) if stage >= 1 else 1
    if stage == 3:
        cpu, gpu, _ = estimate_zero3_model_states_mem_needs(
            params, int(largest_layer_b(preset) * 1e9), num_gpus_per_node=n, cpu_offload=offload,
            cpu_offload_params=offload)
    else:
        cpu, gpu = estimate_zero2_model_states_mem_needs(params, num_gpus_per_node=n, cpu_offload=offload)
    return gpu / 1e9, cpu / 1e9


def memory_report(steps, actor: ModelChoice, reward: ModelChoice | None, gpus: int, gpu_gb: float,
                  measured: dict | None = None) -> list[str]:
    """Per step: estimated per-GPU model states against the GPU_BUDGET share of memory,
    DeepSpeed's estimators for the trained models (with host memory), and the peak a GPU run
    of the preset's row measured (`measured_peak_gib`), where there is one."""
    a, c = sized(actor), sized(reward or actor)
    lines = []
    for step in steps:
        # DPO: the trained policy (the actor) and its frozen reference
        parts = (dpo_memory_gb(step.flags, a, gpus) if step.title == "DPO"
                 else step_memory_gb(step.number, step.flags, a, c, gpus))
        detail = ", ".join(f"{k} {v:.1f}" for k, v in parts.items() if k != "total")
        verdict = "ok" if parts["total"] <= GPU_BUDGET * gpu_gb else f"OVER the {GPU_BUDGET:.0%} budget"
        lines.append(f"  {step.name}: {parts['total']:.1f} GB per GPU of {gpu_gb:.0f} over {gpus} GPUs"
                     f"{' (' + detail + ')' if detail else ''}: {verdict}")
        peak = (measured or {}).get(f"step{step.number}") if step.title != "DPO" else None
        if peak is not None:
            lines.append(f"    measured with the preset's own flags: {peak:.1f} GiB peak per GPU "
                         f"({measured.get('on', 'one GPU run')})")
        if step.flags.get("only_optimize_lora"):
            continue                       # DeepSpeed's estimators know no frozen base weights
        offload = bool(step.flags.get("offload"))
        if step.title == "DPO" or step.number == 1:      # the policy / the SFT model
            trained = [(a, step.flags["zero_stage"])]
        elif step.number == 2:                              # the reward model
            trained = [(c, step.flags["zero_stage"])]
        else:
            trained = [(a, step.flags["actor_zero_stage"])]
            if step.flags.get("algorithm", "ppo") == "ppo":
                trained.append((c, step.flags["critic_zero_stage"]))
        est = [deepspeed_states_gb(p, int(stage), gpus, offload) for p, stage in trained]
        lines.append(f"    DeepSpeed's estimators, trained model{'s' if len(est) > 1 else ''} only: "
                     f"{sum(g for g, _ in est):.1f} GB per GPU, {sum(h for _, h in est):.1f} GB host memory per node")
    return lines

#!/usr/bin/env python
"""Steps 1-3 (SFT -> reward model -> PPO) in one command, then a short report.

    python applications/e2e_rlhf.py            # the CPU demo: tiny Bloom, bundled data, 2 ranks
    python applications/e2e_rlhf.py --actor-model bloom-1b7 --reward-model bloom-560m \\
        --deployment-type single_node --output-dir out/bloom-1b7
    python applications/e2e_rlhf.py --actor-model bloom-7b1 --deployment-type multi_node \\
        --hostfile scripts/hostfile.example --output-dir /shared/out/bloom-7b1
    python applications/e2e_rlhf.py --list-presets

--actor-model / --reward-model take a preset name (configs/presets/NAME.json: hub name,
ZeRO stages, batch sizes, LoRA, offload and hybrid-engine mode per deployment), a preset
file, a model folder, a config.json (random weights) or a hub name; for a model that is
not a preset, the hyperparameters come from --actor-preset / --reward-preset, by default
the preset closest in parameter count. --reward-model step1 trains the reward model on
the step-1 output (the demo's choice).

Each step is launched through the deepspeed launcher (`deepspeed --num_gpus N` or
`--hostfile`), its output checked before the next starts, and a step whose output is
already complete (step1/model.safetensors, step2/reward_model.json, step3/actor/) is
skipped (say --force to redo it); an incomplete step that left checkpoints
(--stepN-args='--save_interval N') is resumed from the newest. Logs go to OUTPUT_DIR/logs/. At the end the report
(OUTPUT_DIR/report.json + report.md) gives the SFT perplexity before/after, the reward
model's accuracy before/after, the reward of the greedy answers of the step-1 model and
of the PPO actor on held-out prompts (scored by the step-2 reward model), and where the
models and the plots (python -m dschat.plot) are.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from dschat.utils.errors import UserInputError
from dschat.utils.run import main_guard

REPO = Path(__file__).resolve().parents[1]
PRESET_DIR = REPO / "configs" / "presets"
DEMO = "demo"
DEPLOYMENTS = ("single_gpu", "single_node", "multi_node", "cpu")
STEP_MAIN = {1: "training/step1_supervised_finetuning/main.py",
             2: "training/step2_reward_model_finetuning/main.py",
             3: "training/step3_rlhf_finetuning/main.py"}
STEP_NAME = {1: "SFT", 2: "reward model", 3: "PPO"}
DPO_MAIN = "training/step2_dpo_finetuning/main.py"
JUDGE = "judge reward model"
# --align dpo without a "step2_dpo" section in the preset row: the policy is the actor, sized
# as in its step-1 section, with upstream's DPO script settings (opt-350m: lr 5e-5, wd 0.1)
DPO_FROM_STEP1 = ("max_seq_len", "per_device_train_batch_size", "per_device_eval_batch_size",
                  "gradient_checkpointing", "offload", "lora_dim", "lora_module_name", "only_optimize_lora")
DPO_DEFAULTS = {"learning_rate": 5e-5, "weight_decay": 0.1, "dropout": 0.0}



# ----------------------------------------------------------------------------- presets
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


def pick_deployment(requested: str | None, hostfile: str | None) -> str:
    """--deployment-type, else: a hostfile -> multi_node; no GPU -> cpu; 1 GPU -> single_gpu; else single_node."""
    if requested:
        return requested
    if hostfile:
        return "multi_node"
    gpus = visible_gpus()
    return "cpu" if gpus == 0 else "single_gpu" if gpus == 1 else "single_node"


def visible_gpus() -> int:
    try:
        import torch
        return torch.cuda.device_count()
    except Exception:  # noqa: BLE001 - a broken CUDA install counts as no GPU
        return 0


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


# ----------------------------------------------------------------------------- memory rule
GPU_BUDGET = 0.5  # model states may take this share of GPU memory; the rest: activations, logits, KV cache


def model_state_gb(params_b: float, stage: int, gpus: int, *, trained: bool = True, offload: bool = False,
                   lora_params_b: float = 0.0) -> float:
    """Per-GPU GB of one model's states under ZeRO: the rule of thumb the presets follow.

    Trained with Adam in mixed precision: 16 bytes/param (2 weights + 2 grads + 12 fp32
    master weights and moments); stage 1 partitions the 12 over the GPUs, stage 2 also the
    grads, stage 3 everything; --offload moves the 12 (and at stage 3 the weights) to CPU.
    LoRA with --only_optimize_lora: the base weights are frozen (2 bytes/param) and only
    the LoRA weights carry the 16. Frozen models (reference, reward): 2 bytes/param,
    partitioned at stage 3 only, on the CPU when offloaded at stage 3.
    """
    n = max(gpus, 1)
    if not trained:
        return 0.0 if offload and stage == 3 else 2 * params_b / (n if stage == 3 else 1)
    if lora_params_b:
        base = 0.0 if offload and stage == 3 else 2 * params_b / (n if stage == 3 else 1)
        return base + model_state_gb(lora_params_b, stage, gpus, offload=offload)
    weights, grads, optim = 2 * params_b, 2 * params_b, 12 * params_b
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
    if step in (1, 2):
        preset, size = (actor, a_b) if step == 1 else (critic, c_b)
        lora = lora_params(preset, flags.get("lora_dim", 0)) if only_lora else 0.0
        return {"total": model_state_gb(size, flags["zero_stage"], gpus, offload=offload, lora_params_b=lora)}
    a_stage, c_stage = flags["actor_zero_stage"], flags["critic_zero_stage"]
    frozen = lambda stage: 3 if stage == 3 else 0  # noqa: E731 - as dschat.rlhf.engine
    parts = {
        "actor": model_state_gb(a_b, a_stage, gpus, offload=offload,
                                lora_params_b=lora_params(actor, flags.get("actor_lora_dim", 0)) if only_lora else 0),
        "critic": model_state_gb(c_b, c_stage, gpus, offload=offload,
                                 lora_params_b=(lora_params(critic, flags.get("critic_lora_dim", 0))
                                                if only_lora else 0)),
        "reference": model_state_gb(a_b, frozen(a_stage), gpus, trained=False,
                                    offload=bool(flags.get("offload_reference_model"))),
        "reward": model_state_gb(c_b, frozen(c_stage), gpus, trained=False,
                                 offload=bool(flags.get("offload_reward_model"))),
    }
    if a_stage == 3 and flags.get("enable_hybrid_engine"):
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


# ----------------------------------------------------------------------------- plan
@dataclass
class Step:
    number: int
    out: Path
    argv: list[str]                       # main.py and its flags
    done_files: list[str]
    flags: dict = field(default_factory=dict)
    title: str = ""                       # STEP_NAME's unless set ("DPO", "judge reward model")

    @property
    def name(self) -> str:
        return f"step {self.number} ({self.title or STEP_NAME[self.number]})"

    @property
    def key(self) -> str:
        """Its log file and timing name: step1, step2, step3, or step2_judge for the judge."""
        return f"step{self.number}" + ("_judge" if self.title == JUDGE else "")

    def complete(self) -> bool:
        return all((self.out / f).exists() for f in self.done_files)


def to_argv(flags: dict) -> list[str]:
    """{flag: value} -> ["--flag", "value", ...]; True -> bare flag; False/None -> left out."""
    argv = []
    for key, value in flags.items():
        if value is None or value is False:
            continue
        if value is True:
            argv.append(f"--{key}")
        elif isinstance(value, (list, tuple)):
            argv += [f"--{key}", *[str(v) for v in value]]
        else:
            argv += [f"--{key}", str(value)]
    return argv


def base_dtype(deployment: str, preset: dict, override: str | None) -> str:
    if override:
        return override
    return "fp32" if deployment == "cpu" else preset.get("dtype", "bf16")


def hybrid_flags(mode: str) -> dict:
    """full: a pinned replica per rollout; layered: --unpin_actor_parameters; off: HF generate."""
    if mode not in ("full", "layered", "off"):
        raise UserInputError(f"hybrid_engine {mode!r}: expected full, layered or off")
    return {"enable_hybrid_engine": mode != "off", "unpin_actor_parameters": mode == "layered"}


def parse_extra(text: str) -> dict:
    """'--a 1 --b --c x y' -> {"a": "1", "b": True, "c": ["x", "y"]} (merged over the preset's flags)."""
    flags, key = {}, None
    for token in shlex.split(text or ""):
        if token.startswith("--"):
            key = token[2:]
            if "=" in key:
                key, value = key.split("=", 1)
                flags[key], key = value, None
            else:
                flags[key] = True
        elif key is None:
            raise UserInputError(f"extra step flags {text!r}: {token!r} does not follow a --flag")
        elif flags[key] is True:
            flags[key] = token
        else:
            flags[key] = (flags[key] if isinstance(flags[key], list) else [flags[key]]) + [token]
    return flags


def build_plan(args, actor: ModelChoice, reward: ModelChoice | None, deployment: str) -> list[Step]:
    """The three steps' output folders and main.py flags.

    Precedence, lowest first: the preset rows (actor row for steps 1 and 3, reward row for
    step 2 and the critic's stage), their step sections, --actor/--reward-zero-stage,
    then --stepN-args.
    """
    out = Path(args.output_dir)
    arow = deployment_row(actor.preset, deployment, args.low_memory)
    rrow = deployment_row((reward or actor).preset, deployment, args.low_memory)
    data = dict(actor.preset.get("data", {}))
    split = judge_split_of(args, actor)
    common = {"data_path": [split["folders"]["policy"]] if split else
              args.data_path or data.get("data_path", ["Dahoas/rm-static"]),
              "data_split": args.data_split or data.get("data_split", "2,4,4"), "seed": args.seed,
              "data_output_path": args.data_cache or str(out / "data_cache"),
              "dtype": base_dtype(deployment, actor.preset, args.dtype)}
    s1 = {"model_name_or_path": actor.path, "output_dir": str(out / "step1"), **common,
          "zero_stage": arow["actor_zero_stage"], **arow.get("step1", {})}
    s2 = {"model_name_or_path": str(out / "step1") if reward is None else reward.path,
          "output_dir": str(out / "step2"), **common, "zero_stage": rrow["reward_zero_stage"], **rrow.get("step2", {})}
    s3 = {"actor_model_name_or_path": str(out / "step1"), "critic_model_name_or_path": str(out / "step2"),
          "output_dir": str(out / "step3"), **common, "actor_zero_stage": arow["actor_zero_stage"],
          "critic_zero_stage": rrow["reward_zero_stage"], **hybrid_flags(arow.get("hybrid_engine", "full")),
          **arow.get("step3", {})}
    if args.actor_zero_stage is not None:
        s1["zero_stage"] = s3["actor_zero_stage"] = args.actor_zero_stage
    if args.reward_zero_stage is not None:
        s2["zero_stage"] = s3["critic_zero_stage"] = args.reward_zero_stage
    for flags, extra in ((s1, args.step1_args), (s2, args.step2_args), (s3, args.step3_args)):
        flags.update(parse_extra(extra))
        for key, value in flags.items():  # presets may name files in the step's folder
            if isinstance(value, str) and "{step_dir}" in value:
                flags[key] = value.replace("{step_dir}", flags["output_dir"])
    for flags in (s1, s2):  # a stage lowered on the command line drops what needs ZeRO
        if flags.get("offload") and int(flags["zero_stage"]) == 0:
            flags["offload"] = False
    if s3.get("offload") and int(s3["actor_zero_stage"]) == 0 and int(s3["critic_zero_stage"]) == 0:
        s3["offload"] = False
    if int(s3["actor_zero_stage"]) < 3:
        s3["unpin_actor_parameters"] = False  # below ZeRO-3 generation runs on the live weights
    steps = []
    for number, flags, done in ((1, s1, ["model.safetensors", "config.json"]),
                                (2, s2, ["model.safetensors", "reward_model.json"]),
                                (3, s3, ["actor/model.safetensors", "critic/reward_model.json"])):
        steps.append(Step(number, Path(flags["output_dir"]), [STEP_MAIN[number], *to_argv(flags)], done, flags))
    if getattr(args, "align", "ppo") == "dpo":
        steps = [steps[0], dpo_step(args, arow, common, s1)]
    elif split:  # the judge: step 2's recipe on the other half of the data, never seen by step 3
        judge = {**s2, "data_path": [split["folders"]["judge"]], "output_dir": str(out / "step2_judge")}
        steps.append(Step(2, out / "step2_judge", [STEP_MAIN[2], *to_argv(judge)], steps[1].done_files, judge,
                          title=JUDGE))
    return steps


def judge_split_of(args, actor: ModelChoice) -> dict | None:
    """A preset whose data has "judge_split" cuts its data by prompt into held-out, policy and
    judge parts (dschat.data.judge_split) under OUTPUT_DIR/data: {"source", "folders", ...}."""
    data = actor.preset.get("data", {})
    if "judge_split" not in data or getattr(args, "align", "ppo") == "dpo":
        return None
    out = Path(args.output_dir) / "data"
    return {"source": args.data_path or data["data_path"], **data["judge_split"], "out": str(out),
            "folders": {"policy": str(out / "policy"), "judge": str(out / "judge")}}


def judge_step(steps: list[Step]) -> Step | None:
    return next((s for s in steps if s.title == JUDGE), None)


def dpo_step(args, arow: dict, common: dict, s1: dict) -> Step:
    """--align dpo: step 2 is DPO of the step-1 model against a frozen copy of it (upstream's
    training/step2_dpo_finetuning), replacing the reward model and PPO. Flags, lowest first:
    the actor row's step-1 sizes and DPO_DEFAULTS, or the row's "step2_dpo" section when it
    has one; --actor-zero-stage; --step2-args."""
    out = Path(args.output_dir)
    section = arow.get("step2_dpo")
    if section is None:
        section = {**{k: v for k, v in arow.get("step1", {}).items() if k in DPO_FROM_STEP1}, **DPO_DEFAULTS}
    flags = {"model_name_or_path": str(out / "step1"), "output_dir": str(out / "step2_dpo"), **common,
             "zero_stage": s1["zero_stage"], **section}
    flags.update(parse_extra(args.step2_args))
    if flags.get("offload") and int(flags["zero_stage"]) == 0:
        flags["offload"] = False
    return Step(2, Path(flags["output_dir"]), [DPO_MAIN, *to_argv(flags)], ["model.safetensors", "config.json"],
                flags, title="DPO")


def launcher_argv(args, deployment: str, num_gpus: int) -> list[str]:
    """`deepspeed --num_gpus N --master_port P` (or --hostfile H), as scripts/common.sh launches."""
    exe = shutil.which("deepspeed")
    argv = [exe] if exe else [sys.executable, "-m", "deepspeed.launcher.runner"]
    if args.hostfile:
        argv += ["--hostfile", args.hostfile]
        if args.num_gpus:
            argv += ["--num_gpus", str(args.num_gpus)]
        if args.num_nodes:
            argv += ["--num_nodes", str(args.num_nodes)]
    else:
        argv += ["--num_gpus", str(num_gpus)]
    argv += ["--master_port", str(args.master_port or free_port())]
    return argv + shlex.split(args.launcher_args or "")


def hostfile_slots(path: str, num_nodes: int | None = None, per_node: int | None = None) -> int:
    """Processes a DeepSpeed hostfile gives ('host slots=N' lines, '#' comments): the slots of
    its first `num_nodes` hosts, each capped at `per_node` (the launcher's --num_gpus)."""
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as e:
        raise UserInputError(f"--hostfile {path}: {e.strerror}") from None
    slots = []
    for line in lines:
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        parts = line.split()
        if len(parts) < 2 or not parts[1].startswith("slots=") or not parts[1][6:].isdigit():
            raise UserInputError(f"--hostfile {path}: bad line {line!r} (expected 'hostname slots=N')")
        slots.append(int(parts[1][6:]))
    if not slots:
        raise UserInputError(f"--hostfile {path}: no hosts in it")
    slots = slots[:num_nodes] if num_nodes else slots
    return sum(min(n, per_node) if per_node else n for n in slots)


def previous_timings(out: Path) -> dict:
    """Step wall times of an earlier report in `out`, kept for the steps this run skips."""
    try:
        seconds = json.loads((out / "report.json").read_text()).get("seconds", {})
    except (OSError, json.JSONDecodeError):
        return {}
    return {k: v for k, v in seconds.items() if k.startswith("step")}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_env(deployment: str) -> dict:
    """Offline by default (as scripts/common.sh); one thread per rank on CPU."""
    env = dict(os.environ)
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("HF_DATASETS_OFFLINE", "1")
    env.setdefault("WANDB_MODE", "offline")
    env["TOKENIZERS_PARALLELISM"] = "false"
    env["PYTHONUNBUFFERED"] = "1"
    if deployment == "cpu":
        env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def run_logged(cmd: list[str], log_path: Path, env: dict) -> int:
    """Run `cmd` in the repository root, streaming its output to the terminal and to a log."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        log.write(f"\n$ {shlex.join(cmd)}\n".encode())
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        while True:
            chunk = proc.stdout.read1(65536) if hasattr(proc.stdout, "read1") else proc.stdout.read(4096)
            if not chunk:
                break
            sys.stdout.buffer.write(chunk)
            sys.stdout.flush()
            log.write(chunk)
        return proc.wait()


def wait_complete(step: Step, seconds: int) -> bool:
    """Whether the step's files appear within `seconds` (rank 0 of another node may still be writing)."""
    deadline = time.time() + seconds
    while not step.complete():
        if time.time() >= deadline:
            return False
        time.sleep(2)
    return True


def latest_checkpoint(step_dir: Path):
    """The newest complete resumable checkpoint a crashed run left in `step_dir`, if any."""
    from dschat.utils.checkpoint import latest_checkpoint as latest
    return latest(step_dir) if (step_dir / "checkpoints").is_dir() else None


def differing_flags(step: Step) -> list[str]:
    """Flags of the finished run (its training_config.json) that differ from this plan."""
    cfg = step.out / "training_config.json"
    if not cfg.exists():
        return []
    try:
        done = json.loads(cfg.read_text()).get("args", {})
    except (OSError, json.JSONDecodeError):
        return []
    diffs = []
    for key, value in step.flags.items():
        if key in done and value is not None and not isinstance(value, bool) and key != "data_output_path":
            if str(done[key]) != str(value) and not (isinstance(value, list) and done[key] == value):
                diffs.append(f"--{key} {done[key]} (now {value})")
    return diffs


# ----------------------------------------------------------------------------- report
def metric_series(path: Path, key: str) -> list[tuple[int, float]]:
    from dschat.utils.metrics import read_metrics
    if not path.exists():
        return []
    return [(r["step"], r[key]) for r in read_metrics(path) if isinstance(r.get(key), (int, float))]


def first_last(series) -> dict:
    if not series:
        return {}
    return {"before": series[0][1], "after": series[-1][1], "steps": series[-1][0]}


def heldout_eval(args, steps: list[Step], env: dict) -> dict:
    """Greedy answers of the step-1 model and the PPO actor on held-out prompts, scored by
    the step-2 reward model (inference/prompt_eval.py, one process)."""
    s3 = steps[2].flags
    eval_dir = Path(args.output_dir) / "eval"
    cmd = [sys.executable, str(REPO / "inference" / "prompt_eval.py"),
           "--baseline", s3["actor_model_name_or_path"], "--finetune", str(steps[2].out / "actor"),
           "--reward_model", s3["critic_model_name_or_path"], "--num_prompts", str(args.eval_prompts),
           "--max_new_tokens", str(s3.get("max_answer_seq_len", 256)),
           "--max_prompt_len", str(s3.get("max_prompt_seq_len", 256)),
           "--data_split", s3["data_split"], "--seed", str(s3["seed"]), "--data_path", *s3["data_path"],
           "--jsonl", str(eval_dir / "heldout_answers.jsonl"), "--summary_json", str(eval_dir / "summary.json"),
           "--quiet"]
    if args.eval_prompts_file:
        cmd += ["--prompts", args.eval_prompts_file]
    judge = judge_step(steps)
    if judge is not None:
        cmd += ["--judge_model", str(judge.out)]
    if args.kl_samples:
        cmd += ["--kl_samples", str(args.kl_samples)]
    cmd += ["--batch_size", str(args.eval_batch_size)]
    print(f"\n==> held-out evaluation: {shlex.join(cmd)}", flush=True)
    rc = run_logged(cmd, Path(args.output_dir) / "logs" / "eval.log", env)
    if rc != 0:
        print(f"warning: held-out evaluation failed (exit {rc}); see {args.output_dir}/logs/eval.log", flush=True)
        return {}
    summary = json.loads((eval_dir / "summary.json").read_text())
    rows = [json.loads(line) for line in open(eval_dir / "heldout_answers.jsonl")]
    summary["examples"] = rows[:args.report_examples]
    summary["answers_file"] = str(eval_dir / "heldout_answers.jsonl")
    return summary


def make_plots(steps: list[Step]) -> dict:
    """python -m dschat.plot on each step's folder; {step folder: [png, ...]}."""
    from dschat.plot import plot_runs
    plots = {}
    for step in steps:
        if (step.out / "metrics.jsonl").exists():
            plots[str(step.out)] = [str(p) for p in plot_runs(step.out)]
    return plots


def overview_plot(steps: list[Step], heldout_file: str | None, out_path: Path) -> str | None:
    """report.png: the numbers of the report as curves (the per-step plots of dschat.plot
    have no panel for eval perplexity, reward-model accuracy or the held-out comparison)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s1, s2, s3 = (s.out / "metrics.jsonl" for s in steps[:3])
    fig, axes = plt.subplots(2, 3, figsize=(15, 8))
    panels = [
        (axes[0][0], "step 1 (SFT): loss", [(s1, "train/loss", "train"), (s1, "eval/loss", "eval")], False),
        (axes[0][1], "step 1 (SFT): eval perplexity (log)", [(s1, "eval/ppl", "eval ppl")], True),
        (axes[0][2], "step 2 (reward model): eval accuracy", [(s2, "eval/acc", "accuracy")], False),
        (axes[1][0], "step 2: eval scores", [(s2, "eval/chosen_score", "chosen"),
                                            (s2, "eval/rejected_score", "rejected")], False),
        (axes[1][1], "step 3 (PPO): reward of the rollouts", [(s3, "ppo/reward_mean", "reward mean")], False),
    ]
    for ax, title, curves, log in panels:
        for path, key, label in curves:
            series = metric_series(path, key)
            if series:
                xs, ys = zip(*series)
                ax.plot(xs, ys, marker="." if len(xs) <= 30 else None, label=label, linewidth=1.2)
                if key == "ppo/reward_mean" and len(ys) >= 10:
                    k = max(5, len(ys) // 10)
                    windows = [ys[max(0, i - k + 1):i + 1] for i in range(len(ys))]
                    smooth = [sum(w) / len(w) for w in windows]
                    ax.plot(xs, smooth, linewidth=2.2, label=f"mean of last {k}")
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step")
        ax.grid(True, alpha=0.3)
        if log:
            ax.set_yscale("log")
        if ax.lines:
            ax.legend(fontsize=8)
        else:
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes, color="grey")
    ax = axes[1][2]
    rows = [json.loads(line) for line in open(heldout_file)] if heldout_file and Path(heldout_file).exists() else []
    rows = [r for r in rows if "baseline_reward" in r and "finetune_reward" in r]
    if rows:
        b, f = [r["baseline_reward"] for r in rows], [r["finetune_reward"] for r in rows]
        lo, hi = min(b + f) - 0.3, max(b + f) + 0.3
        ax.plot([lo, hi], [lo, hi], color="grey", linewidth=1, label="no change")
        ax.scatter(b, f, s=18, label=f"{len(rows)} held-out prompts")
        ax.set_xlim(lo, hi)
        ax.set_ylim(lo, hi)
        ax.set_xlabel(f"step-1 model (mean {sum(b) / len(b):.2f})")
        ax.set_ylabel(f"PPO actor (mean {sum(f) / len(f):.2f})")
        ax.legend(fontsize=8, loc="upper left")
    else:
        ax.text(0.5, 0.5, "no held-out evaluation", ha="center", va="center", transform=ax.transAxes, color="grey")
    ax.set_title("held-out reward of greedy answers (above the line: PPO better)", fontsize=10)
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(out_path, dpi=100)
    plt.close(fig)
    return str(out_path)


def build_dpo_report(args, steps, actor, deployment, timings) -> dict:
    """The report of --align dpo: SFT perplexity and DPO's eval metrics before/after (no
    reward model, so no held-out reward of generated answers)."""
    s1, s2 = (s.out / "metrics.jsonl" for s in steps)
    return {
        "align": "dpo",
        "actor_model": {"spec": actor.spec, "path": actor.path, "note": actor.note},
        "reward_model": {"spec": "none", "path": "-", "note": "--align dpo: the step-1 model is its own reference"},
        "deployment": deployment,
        "output_dir": str(Path(args.output_dir).resolve()),
        "seconds": timings,
        "sft_eval_perplexity": first_last(metric_series(s1, "eval/ppl")),
        "dpo_eval": {k: first_last(metric_series(s2, f"eval/{k}"))
                     for k in ("acc", "margin", "loss", "chosen_logps", "rejected_logps", "kl_ref")},
        "heldout_reward": {},
        "models": {"step1_sft": str(steps[0].out), "step2_dpo": str(steps[1].out)},
        "plots": make_plots(steps),
        "overview_plot": None,
        "logs": str(Path(args.output_dir) / "logs"),
    }


def build_report(args, steps, actor, reward, deployment, timings, heldout) -> dict:
    s1, s2, s3 = (s.out / "metrics.jsonl" for s in steps[:3])
    judge = judge_step(steps)
    ppo_reward = metric_series(s3, "ppo/reward_mean")
    k = max(1, min(5, len(ppo_reward) // 4))
    ppo_train = {}
    if ppo_reward:
        ppo_train = {"first_steps_mean": sum(v for _, v in ppo_reward[:k]) / k,
                     "last_steps_mean": sum(v for _, v in ppo_reward[-k:]) / k, "window": k,
                     "steps": ppo_reward[-1][0]}
    return {
        "actor_model": {"spec": actor.spec, "path": actor.path, "note": actor.note},
        "reward_model": {"spec": reward.spec if reward else "step1",
                         "path": reward.path if reward else str(steps[0].out),
                         "note": reward.note if reward else "the step-1 output as backbone"},
        "deployment": deployment,
        "output_dir": str(Path(args.output_dir).resolve()),
        "seconds": timings,
        "sft_eval_perplexity": first_last(metric_series(s1, "eval/ppl")),
        "reward_model_eval_accuracy": first_last(metric_series(s2, "eval/acc")),
        "reward_model_eval_scores": {"chosen": first_last(metric_series(s2, "eval/chosen_score")),
                                     "rejected": first_last(metric_series(s2, "eval/rejected_score"))},
        "ppo_training_reward": ppo_train,
        "ppo_kl": first_last(metric_series(s3, "ppo/kl")),
        "ppo_kl_per_answer": first_last(metric_series(s3, "ppo/kl_per_answer")),
        "judge_eval_accuracy": first_last(metric_series(judge.out / "metrics.jsonl", "eval/acc")) if judge else None,
        "targets": actor.preset.get("targets") if judge else None,
        "heldout_reward": heldout,
        "models": {"step1_sft": str(steps[0].out), "step2_reward_model": str(steps[1].out),
                   "step3_actor": str(steps[2].out / "actor"), "step3_critic": str(steps[2].out / "critic"),
                   **({"step2_judge": str(judge.out)} if judge else {})},
        "plots": make_plots(steps),
        "overview_plot": overview_plot(steps, heldout.get("answers_file"), Path(args.output_dir) / "report.png"),
        "logs": str(Path(args.output_dir) / "logs"),
    }


def fmt(value, spec=".3f") -> str:
    return "n/a" if value is None else format(value, spec)


def cell(text: str) -> str:
    """An answer as one markdown table cell: newlines and pipes visible, not structural."""
    return text.strip().replace("\\", "\\\\").replace("\n", "\\n").replace("|", "\\|")


def _met(ok) -> str:
    return "n/a" if ok is None else ("**yes**" if ok else "**no**")


def judged_table(r: dict) -> list[str]:
    """The held-out comparison of a run with a judge reward model (one PPO never saw), each row
    against the preset's target when it has one."""
    ho, t = r["heldout_reward"], r.get("targets") or {}
    acc, jacc = r.get("reward_model_eval_accuracy") or {}, r.get("judge_eval_accuracy") or {}

    def pm(prefix):
        mean, std = ho.get(f"{prefix}_mean"), ho.get(f"{prefix}_std")
        return "n/a" if mean is None else f"{mean:+.3f} ± {std:.3f}"

    def check(value, bound, kind):
        if value is None or bound is None:
            return None
        return value >= bound if kind == "min" else value <= bound

    rm_min = t.get("reward_model_accuracy_min")
    gain_sd, win, kl = ho.get("judge_gain_in_baseline_std"), ho.get("judge_win_rate"), ho.get("kl_per_answer")
    d2b, d2f = ho.get("baseline_distinct_2"), ho.get("finetune_distinct_2")
    d2_change = abs(d2f / d2b - 1) if d2b and d2f is not None else None
    n = ho.get("num_prompts", 0)
    rows = [
        ("policy reward model: held-out pair accuracy", "", fmt(acc.get("after")), f">= {rm_min}" if rm_min else "",
         check(acc.get("after"), rm_min, "min")),
        ("judge reward model: held-out pair accuracy", "", fmt(jacc.get("after")), f">= {rm_min}" if rm_min else "",
         check(jacc.get("after"), rm_min, "min")),
        (f"policy-RM reward of greedy answers, {n} held-out prompts (mean ± sd)", pm("baseline_reward"),
         pm("finetune_reward"), "", None),
        (f"judge-RM reward, same answers (gain in SFT sd: {fmt(gain_sd, '+.2f')})", pm("baseline_judge"),
         pm("finetune_judge"), f"gain >= {t['judge_gain_in_sft_std_min']} sd" if "judge_gain_in_sft_std_min" in t
         else "", check(gain_sd, t.get("judge_gain_in_sft_std_min"), "min")),
        ("judge win rate of PPO over SFT (ties count half)", "", fmt(win), f">= {t['judge_win_rate_min']}"
         if "judge_win_rate_min" in t else "", check(win, t.get("judge_win_rate_min"), "min")),
        (f"KL of the PPO actor to SFT per answer, nats ({ho.get('kl_samples', 0)} sampled held-out answers)", "",
         fmt(kl, ".2f"), f"<= {t['kl_per_answer_max']}" if "kl_per_answer_max" in t else "",
         check(kl, t.get("kl_per_answer_max"), "max")),
        ("KL to the reference per answer in training, last step", "",
         fmt((r.get("ppo_kl_per_answer") or {}).get("after"), ".2f"), "", None),
        ("answer tokens, mean", fmt(ho.get("baseline_answer_tokens_mean"), ".1f"),
         fmt(ho.get("finetune_answer_tokens_mean"), ".1f"), "", None),
        ("distinct-2 of the answers", fmt(d2b), fmt(d2f),
         f"within {t['distinct_2_relative_change_max']:.0%} of SFT" if "distinct_2_relative_change_max" in t else "",
         check(d2_change, t.get("distinct_2_relative_change_max"), "max")),
        ("answers that end at the end of turn (not cut at the length limit)", fmt(ho.get("baseline_ended_share")),
         fmt(ho.get("finetune_ended_share")), f">= {t['ended_share_min']}" if "ended_share_min" in t else "",
         check(ho.get("finetune_ended_share"), t.get("ended_share_min"), "min")),
    ]
    lines = ["", "Held out: prompts and pairs no step trained on; the judge reward model trained on the other "
                 "half of the training prompts, and PPO never saw it.", "",
             "| measure | SFT (step 1) | PPO actor | target | met |", "|---|---|---|---|---|"]
    lines += [f"| {a} | {b} | {c} | {d} | {_met(e) if d else ''} |" for a, b, c, d, e in rows]
    return lines


def report_markdown(r: dict) -> str:
    ppl, acc, ho, ppo = (r["sft_eval_perplexity"], r.get("reward_model_eval_accuracy"), r["heldout_reward"],
                         r.get("ppo_training_reward"))
    lines = [f"# dschat end-to-end report: {r['actor_model']['spec']}",
             "",
             f"actor: {r['actor_model']['path']} ({r['actor_model']['note']})  ",
             f"reward model: {r['reward_model']['path']} ({r['reward_model']['note']})  ",
             f"deployment: {r['deployment']}; wall time per step (s): "
             + ", ".join(f"{k} {v:.0f}" for k, v in r["seconds"].items()),
             "",
             "| measure | before | after |", "|---|---|---|",
             f"| SFT eval perplexity (step 1, {ppl.get('steps', 0)} steps) | {fmt(ppl.get('before'), '.2f')} "
             f"| {fmt(ppl.get('after'), '.2f')} |"]
    if acc is not None:
        lines.append(f"| reward-model eval accuracy (step 2, {acc.get('steps', 0)} steps) | {fmt(acc.get('before'))} "
                     f"| {fmt(acc.get('after'))} |")
    for key, label in (("acc", "implicit-reward accuracy (chosen above rejected)"), ("margin", "reward margin"),
                       ("kl_ref", "per-token KL to the reference")):
        row = r.get("dpo_eval", {}).get(key)
        if row:
            lines.append(f"| DPO eval {label} (step 2 DPO, {row.get('steps', 0)} steps) | {fmt(row.get('before'))} "
                         f"| {fmt(row.get('after'))} |")
    if ho:
        lines.append(f"| held-out reward of greedy answers, {ho['num_prompts']} prompts ({', '.join(ho['sources'])}): "
                     f"step-1 model vs PPO actor | {fmt(ho.get('baseline_reward_mean'))} "
                     f"| {fmt(ho.get('finetune_reward_mean'))} |")
    if ppo:
        lines.append(f"| PPO training reward (mean of first / last {ppo['window']} of {ppo['steps']} steps) "
                     f"| {fmt(ppo['first_steps_mean'])} | {fmt(ppo['last_steps_mean'])} |")
    if ho and r.get("judge_eval_accuracy") is not None:
        lines += judged_table(r)
    if ho and "finetune_better" in ho:
        ties = ho["num_prompts"] - ho["finetune_better"] - ho["finetune_worse"]
        lines += ["", f"On the held-out prompts the PPO actor's answer scores higher than the step-1 model's on "
                      f"{ho['finetune_better']}, lower on {ho['finetune_worse']} and the same on {ties} "
                      f"(reward gain {ho['reward_gain']:+.3f}; all answers: {ho['answers_file']})."]
    if ho.get("examples"):
        judged = any("baseline_judge" in ex for ex in ho["examples"])
        what = "reward, judge" if judged else "reward"
        lines += ["", f"| prompt | step-1 answer ({what}) | PPO answer ({what}) |", "|---|---|---|"]
        for ex in ho["examples"]:
            q = " ".join(ex["prompt"].replace("Human:", "").replace("Assistant:", "").split())
            scores = {c: fmt(ex.get(f"{c}_reward"), "+.2f")
                      + (f", {fmt(ex.get(f'{c}_judge'), '+.2f')}" if judged else "")
                      for c in ("baseline", "finetune")}
            lines.append(f"| {q} | {cell(ex.get('baseline', ''))} ({scores['baseline']}) "
                         f"| {cell(ex.get('finetune', ''))} ({scores['finetune']}) |")
        lines += ["", "The reward is what the step-2 model prefers, not correctness: a small reward model has blind "
                      "spots PPO will find (reward hacking). Read the answers, not only the mean."]
    lines += ["", "Models:"] + [f"- {k}: {v}" for k, v in r["models"].items()]
    if r["overview_plot"]:
        lines += ["", f"Overview plot: {r['overview_plot']}"]
    lines += ["", "Plots (python -m dschat.plot):"]
    for folder, pngs in r["plots"].items():
        lines.append(f"- {folder}: " + ", ".join(Path(p).name for p in pngs) + f" (in {Path(pngs[0]).parent})"
                     if pngs else f"- {folder}: none")
    lines += ["", f"Logs: {r['logs']}", ""]
    return "\n".join(lines)


# ----------------------------------------------------------------------------- CLI
def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("models")
    g.add_argument("--actor-model", default=DEMO,
                   help="Preset name, preset file, model folder, config.json or hub name (default: demo).")
    g.add_argument("--reward-model", default=None,
                   help="Same kinds as --actor-model, 'step1' (the step-1 output as backbone) or 'actor' (the "
                        "actor's starting model). "
                        "Default: the actor preset's reward_model.")
    g.add_argument("--preset", default=None,
                   help="A preset for the whole run: its model (unless --model) and hyperparameters; e.g. "
                        "--preset smollm2-135m --model /path/to/SmolLM2-135M-Instruct.")
    g.add_argument("--model", default=None, help="With --preset: the actor's starting model (a folder or hub name).")
    g.add_argument("--actor-preset", default=None, help="Hyperparameters for a non-preset actor model.")
    g.add_argument("--reward-preset", default=None, help="Hyperparameters for a non-preset reward model.")
    g.add_argument("--random-init", action="store_true",
                   help="Build preset models from their 'config' with random weights (shape tests, no download).")
    g = p.add_argument_group("deployment")
    g.add_argument("--deployment-type", choices=DEPLOYMENTS, default=None,
                   help="Which preset row to use (default: cpu without GPUs, single_gpu with one, "
                        "single_node with several, multi_node with --hostfile).")
    g.add_argument("--num-gpus", type=int, default=None,
                   help="GPUs (CPU ranks on cpu) per node; default: the preset row's, at most the visible ones.")
    g.add_argument("--hostfile", default=None, help="DeepSpeed hostfile ('host slots=8' lines) for multi_node.")
    g.add_argument("--num-nodes", type=int, default=None, help="Use only this many hosts of the hostfile.")
    g.add_argument("--master-port", type=int, default=None, help="Rendezvous port (default: a free one).")
    g.add_argument("--launcher-args", default="", metavar="ARGS",
                   help="More deepspeed-launcher flags, e.g. --launcher-args='--no_ssh --node_rank 1 "
                        "--master_addr node-0' (run the same command on every node) or '--include node-0:0,1'.")
    g.add_argument("--output-wait", type=int, default=60,
                   help="Seconds to wait for a step's files after it exits (shared filesystems lag; other nodes).")
    g.add_argument("--actor-zero-stage", type=int, choices=(0, 1, 2, 3), default=None,
                   help="ZeRO stage of step 1 and of the step-3 actor (default: the preset's).")
    g.add_argument("--reward-zero-stage", type=int, choices=(0, 1, 2, 3), default=None,
                   help="ZeRO stage of step 2 and of the step-3 critic (default: the preset's).")
    g.add_argument("--low-memory", action="store_true",
                   help="Apply the preset row's low_memory settings (e.g. layered hybrid engine, offload).")
    g.add_argument("--dtype", choices=("fp32", "fp16", "bf16"), default=None,
                   help="Default: fp32 on cpu, the preset's (bf16) on GPUs.")
    g = p.add_argument_group("run")
    g.add_argument("--output-dir", default=None,
                   help="Where step1/ step2/ step3/ logs/ and the report go (default: output/e2e/<actor>).")
    g.add_argument("--step", type=int, nargs="+", choices=(1, 2, 3), default=[1, 2, 3], help="Steps to run.")
    g.add_argument("--align", choices=("ppo", "dpo"), default="ppo",
                   help="ppo: step 2 reward model + step 3 PPO (DS-Chat's RLHF); dpo: step 1 -> step 2 DPO "
                        "(training/step2_dpo_finetuning, output OUTPUT_DIR/step2_dpo; --step2-args go to it), "
                        "no reward model and no PPO.")
    g.add_argument("--force", action="store_true", help="Rerun the selected steps even when complete.")
    g.add_argument("--data-path", nargs="+", default=None, help="Data for all steps (default: the preset's).")
    g.add_argument("--data-split", default=None, help="Default: the preset's (demo 6,3,1; upstream 2,4,4).")
    g.add_argument("--data-cache", default=None, help="Tokenised-data cache (default: OUTPUT_DIR/data_cache).")
    g.add_argument("--seed", type=int, default=1234, help="Seed of all three steps (keeps their data disjoint).")
    for n in (1, 2, 3):
        g.add_argument(f"--step{n}-args", default="", metavar="FLAGS",
                       help=f"Extra flags for step {n}'s main.py, last wins (e.g. --step{n}-args='--max_steps 5').")
    g = p.add_argument_group("report")
    g.add_argument("--eval-prompts", type=int, default=None,
                   help="Held-out prompts for the before/after PPO reward (0: skip that evaluation; default: "
                        "the preset's \"eval\" section's, else 64).")
    g.add_argument("--kl-samples", type=int, default=None,
                   help="Sampled answers per held-out prompt for KL(PPO || SFT) per answer (default: the "
                        "preset's, else 0: not measured).")
    g.add_argument("--eval-prompts-file", default=None,
                   help="Use these prompts instead (see inference/prompt_eval.py).")
    g.add_argument("--eval-batch-size", type=int, default=None,
                   help="Prompts per generate call in the held-out evaluation (default: the preset's, else 16).")
    g.add_argument("--report-examples", type=int, default=None, help="Example answers in the report "
                   "(default: the preset's, else 6).")
    g.add_argument("--no-report", action="store_true", help="Run the steps only.")
    g.add_argument("--dry-run", action="store_true", help="Print the plan and the commands, run nothing.")
    g.add_argument("--list-presets", action="store_true", help="List the presets and exit.")
    args = p.parse_args(argv)
    if args.model and not args.preset:
        p.error("--model goes with --preset (or use --actor-model with --actor-preset)")
    if args.preset:
        if args.actor_model != DEMO or args.actor_preset:
            p.error("--preset replaces --actor-model/--actor-preset; give one or the other")
        args.actor_model = args.model or args.preset
        args.actor_preset = args.preset if args.model else None
    return args


def eval_settings(args, actor: ModelChoice) -> None:
    """--eval-prompts, --kl-samples, --report-examples and --eval-batch-size: the flag, else the
    preset's "eval" section, else 64, 0, 6 and 16."""
    section = actor.preset.get("eval", {})
    for flag, default in (("eval_prompts", 64), ("kl_samples", 0), ("report_examples", 6), ("eval_batch_size", 16)):
        if getattr(args, flag) is None:
            setattr(args, flag, section.get(flag, default))


def list_presets() -> None:
    print(f"{'preset':<12} {'model':<28} {'params':>7}  {'reward model':<12} deployments")
    for name in preset_names():
        p = load_preset(name)
        rows = ", ".join(f"{k}({v['num_gpus']}): ZeRO {v['actor_zero_stage']}/{v['reward_zero_stage']}"
                         for k, v in p["deployments"].items())
        print(f"{name:<12} {p['model']:<28} {p.get('params_billion', 0):>6.2f}B  "
              f"{p.get('reward_model', '-'):<12} {rows}")


def gpu_count(args, row: dict, deployment: str) -> int:
    """Processes per node: --num-gpus, else the row's count (capped to the visible GPUs)."""
    if args.num_gpus:
        return args.num_gpus
    if deployment == "cpu":
        return row["num_gpus"]
    if deployment == "multi_node":
        return 0  # the hostfile decides
    visible = visible_gpus()
    if deployment == "single_node" and visible and visible < row["num_gpus"]:
        print(f"note: the preset row is sized for {row['num_gpus']} GPUs; this node has {visible}: using "
              f"{visible} (more memory per GPU: check the estimate, or pass --low-memory)", flush=True)
        return visible
    return row["num_gpus"]


def sized(choice: ModelChoice) -> dict:
    """The preset of a model with its own parameter count (a non-preset model may differ)."""
    return {**choice.preset, "params_billion": choice.params_b or choice.preset.get("params_billion", 0.0)}


def memory_report(steps, actor: ModelChoice, reward: ModelChoice | None, gpus: int, gpu_gb: float) -> list[str]:
    """One line per step: estimated per-GPU model states against the GPU_BUDGET share of memory."""
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
    return lines


def print_plan(steps, actor, reward, deployment, row, launcher, gpus) -> None:
    print(f"actor: {actor.path}  [{actor.note}]")
    if any(step.title == "DPO" for step in steps):
        print("reward model: none (--align dpo: step 2 is DPO against a frozen copy of the step-1 model)")
    else:
        print(f"reward model: {reward.path + '  [' + reward.note + ']' if reward else 'the step-1 output (step1)'}")
    print(f"deployment: {deployment}, {gpus} {'CPU ranks' if deployment == 'cpu' else 'GPUs'}: {row.get('rule', '')}")
    if deployment != "cpu":
        print("estimated model states (rule of thumb, see configs/presets/README.md):")
        print("\n".join(memory_report(steps, actor, reward, gpus, row.get("gpu_memory_gb", 80))))
    for step in steps:
        print(f"\n{step.name}: {shlex.join(launcher + step.argv)}")


def main(argv=None):
    args = parse_args(argv)
    if args.list_presets:
        list_presets()
        return 0
    deployment = pick_deployment(args.deployment_type, args.hostfile)
    if deployment == "multi_node" and not args.hostfile:
        raise UserInputError("--deployment-type multi_node needs --hostfile (see scripts/hostfile.example)")
    if deployment != "cpu" and visible_gpus() == 0 and not args.dry_run:
        raise UserInputError(f"--deployment-type {deployment}: no GPU is visible here; use --deployment-type cpu "
                             "(the demo) or --dry-run to see the commands")
    name = Path(args.actor_model).stem if is_preset(args.actor_model) else Path(args.actor_model.rstrip("/")).name
    default_out = REPO / "output" / ("e2e-demo" if args.actor_model == DEMO else f"e2e/{name}")
    args.output_dir = args.output_dir or str(default_out)
    out = Path(args.output_dir)
    actor = resolve_model(args.actor_model, "actor", args.actor_preset, args.random_init, out)
    eval_settings(args, actor)
    reward_spec = args.reward_model or actor.preset.get("reward_model", "step1")
    if reward_spec == "step1" or args.align == "dpo":
        reward = None
    elif reward_spec == "actor":  # the reward models start from the actor's starting model
        reward = ModelChoice(actor.spec, actor.path, actor.preset, actor.params_b, "the actor's starting model")
    else:
        reward = resolve_model(reward_spec, "reward", args.reward_preset, args.random_init, out)
    steps = build_plan(args, actor, reward, deployment)
    row = deployment_row(actor.preset, deployment, args.low_memory)
    gpus = gpu_count(args, row, deployment)
    launcher = launcher_argv(args, deployment, gpus)
    total = hostfile_slots(args.hostfile, args.num_nodes, args.num_gpus) if args.hostfile else gpus
    print_plan(steps, actor, reward, deployment, row, launcher, total or row["num_gpus"])
    if args.dry_run:
        return 0

    out.mkdir(parents=True, exist_ok=True)
    split = judge_split_of(args, actor)
    if split:
        from dschat.data.judge_split import prepare
        made = prepare(split["source"], split["out"], split.get("eval_fraction", 0.1), split.get("seed", 1234))
        print(f"\n==> data: {', '.join(made['data_path'])} cut by prompt into held-out / policy / judge: "
              f"{made['prompts']} prompts in {split['out']}", flush=True)
    env = child_env(deployment)
    timings = previous_timings(out)
    retrained = []
    for step in sorted(steps, key=lambda s: s.number):  # the judge runs right after step 2
        if step.number not in args.step:
            continue
        if step.complete() and not args.force:
            diffs = differing_flags(step)
            print(f"\n==> {step.name}: {step.out} is already complete ({', '.join(step.done_files)}); skipping "
                  "(--force reruns it)" + (f". Note: it was trained with {'; '.join(diffs)}" if diffs else ""),
                  flush=True)
            if retrained:
                print(f"warning: {step.name} was trained before {retrained[-1]} was just retrained; "
                      f"--force --step {step.number} retrains it on the new output", flush=True)
            continue
        for earlier in steps[:step.number - 1]:
            if not earlier.complete():
                raise UserInputError(f"{step.name} needs the output of {earlier.name} in {earlier.out}, which is "
                                     f"not complete (missing {', '.join(earlier.done_files)}); "
                                     f"add --step {earlier.number}")
        cmd = launcher_argv(args, deployment, gpus) + step.argv
        checkpoint = None if args.force else latest_checkpoint(step.out)
        if checkpoint is not None and "--resume" not in cmd:
            cmd.append("--resume")
            print(f"\n==> {step.name}: an earlier run left {checkpoint}; resuming from it", flush=True)
        print(f"\n==> {step.name}: {shlex.join(cmd)}", flush=True)
        start = time.time()
        rc = run_logged(cmd, out / "logs" / f"{step.key}.log", env)
        timings[step.key] = time.time() - start
        if rc != 0:
            print(f"error: {step.name} failed (exit code {rc}); its log: {out / 'logs' / f'{step.key}.log'}"
                  + ("; with --save_interval in --stepN-args a rerun resumes from its last checkpoint"
                     if rc != 2 else ""), file=sys.stderr, flush=True)
            return rc
        if not wait_complete(step, args.output_wait):
            raise UserInputError(f"{step.name} exited 0 but {step.out} lacks {', '.join(step.done_files)} "
                                 f"after {args.output_wait} s "
                                 "(multi-node: --output-dir must be on a shared filesystem)")
        print(f"==> {step.name} done in {timings[step.key]:.0f} s: {step.out}", flush=True)
        retrained.append(step.name)

    if args.no_report or not all(s.complete() for s in steps):
        missing = [s.name for s in steps if not s.complete()]
        if missing and not args.no_report:
            print(f"\nno report: {', '.join(missing)} not complete yet", flush=True)
        return 0
    if args.align == "dpo":
        report = build_dpo_report(args, steps, actor, deployment, timings)
    else:
        heldout = {}
        if args.eval_prompts > 0:
            start = time.time()
            heldout = heldout_eval(args, steps, env)
            timings["eval"] = time.time() - start
        report = build_report(args, steps, actor, reward, deployment, timings, heldout)
    (out / "report.json").write_text(json.dumps(report, indent=2))
    md = report_markdown(report)
    (out / "report.md").write_text(md)
    print("\n" + md)
    print(f"report saved to {out / 'report.md'} and {out / 'report.json'}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main_guard(main) or 0)

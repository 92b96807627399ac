"""The plan of a run: each step's output folder and main.py flags from the preset rows and the
command line (and the judge reward model of a preset with a judge split)."""
from __future__ import annotations

import shlex
from dataclasses import dataclass, field
from pathlib import Path

from applications.e2e.presets import ModelChoice, deployment_row
from dschat.utils.errors import UserInputError

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

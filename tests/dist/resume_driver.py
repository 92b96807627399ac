"""Run several training runs of a step inside one multi-rank launch (saves launcher and
import time): `deepspeed --num_gpus 2 tests/dist/resume_driver.py --plan plan.json`.

plan.json: {"runs": [{"step": 1, "argv": [...], "env": {"DSCHAT_TEST_NONFINITE": "2"},
                      "copy_checkpoint": [src_output_dir, step, dst_output_dir]}, ...],
            "out": "results.json"}
Each run calls the step's `main(argv)` in this process, with `env` set for its duration;
`copy_checkpoint` first copies one complete checkpoint into a fresh output folder (rank 0,
then a barrier). Rank 0 writes [{"rc": 0 | 2 | 3, "error": str | None}, ...] to "out":
rc 2 for a UserInputError, 3 for TrainingHalted, as the entry points exit.
"""
import argparse
import importlib.util
import json
import os
import shutil
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

MAINS = {1: "training/step1_supervised_finetuning/main.py",
         2: "training/step2_reward_model_finetuning/main.py",
         3: "training/step3_rlhf_finetuning/main.py"}


def load_main(step: int):
    spec = importlib.util.spec_from_file_location(f"step{step}_main", REPO / MAINS[step])
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main


def copy_checkpoint(src: str, step: int, dst: str) -> None:
    import torch.distributed as dist

    from dschat.utils.checkpoint import checkpoint_name, checkpoint_root
    if int(os.environ.get("RANK", "0")) == 0:
        target = checkpoint_root(dst) / checkpoint_name(step)
        shutil.rmtree(dst, ignore_errors=True)
        target.parent.mkdir(parents=True)
        shutil.copytree(checkpoint_root(src) / checkpoint_name(step), target)
    if dist.is_initialized():
        dist.barrier()


def run_one(run: dict) -> dict:
    from dschat.utils.errors import TrainingHalted, UserInputError

    if run.get("copy_checkpoint"):
        copy_checkpoint(*run["copy_checkpoint"])
    saved = {k: os.environ.get(k) for k in run.get("env", {})}
    os.environ.update(run.get("env", {}))
    try:
        load_main(run["step"])(run["argv"])
        return {"rc": 0, "error": None}
    except UserInputError as e:
        return {"rc": 2, "error": str(e)}
    except TrainingHalted as e:
        return {"rc": 3, "error": str(e)}
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--plan", required=True)
    parser.add_argument("--local_rank", type=int, default=-1)
    args = parser.parse_args()
    plan = json.loads(Path(args.plan).read_text())
    results = []
    for run in plan["runs"]:
        results.append(run_one(run))
        print(f"driver: run {len(results)} -> {results[-1]}", flush=True)
    if int(os.environ.get("RANK", "0")) == 0:
        Path(plan["out"]).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    from dschat.utils.run import main_guard

    main_guard(main)   # exits via os._exit once done (see main_guard)

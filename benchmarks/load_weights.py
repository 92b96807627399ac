#!/usr/bin/env python
"""Loading saved weights for a bf16 engine: in fp32 first (DeepSpeed casts afterwards), as
before, against loading in the training dtype (dschat.engine.config.weights_dtype), side
by side in one run.

    python benchmarks/load_weights.py                          # TinyLlama-1.1B's shape, CPU
    python benchmarks/load_weights.py --model llama-7b         # needs about 60 GB of host memory
    python benchmarks/load_weights.py --model llama-7b --cases lm-zero2    # one row of the three

A causal LM (`create_hf_model`, HF's `from_pretrained`) at ZeRO-2 and at ZeRO-3 with its
parameters offloaded, and a reward model folder (`load_reward_model`; the earlier load, a
random fp32 init of the backbone with the file copied in, is copied here as the baseline).
Each load runs in its own process at world size 1 and reports its seconds, up to a bf16
module whose every page has been read (DeepSpeed's cast next, included), and the process's
peak resident memory; the weights are written once, in bf16, as steps 1 and 2 write them.
"""
from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))       # this checkout's dschat and benchmarks
from benchmarks.processes import run_single_rank  # noqa: E402

# name on the command line (--cases): row label, folder kind, ZeRO stage
CASES = {"lm-zero2": ("causal LM, ZeRO-2", "lm", 2),
         "lm-zero3": ("causal LM, ZeRO-3, parameters offloaded", "lm", 3),
         "reward-zero2": ("reward model, ZeRO-2", "reward", 2)}


def config_of(stage: int) -> dict:
    from dschat.engine.config import train_ds_config
    return train_ds_config(zero_stage=stage, dtype="bf16", micro_batch_size=1, offload=stage == 3)


def old_reward_load(folder: Path, tokenizer):
    """The baseline: the backbone built and randomly initialised in fp32, the file copied in."""
    from safetensors.torch import load_file
    from transformers import AutoModel

    from dschat.models.model_utils import load_config
    from dschat.models.reward_model import RewardModel
    model = RewardModel(AutoModel.from_config(load_config(str(folder)), dtype=torch.float32),
                        pad_token_id=tokenizer.pad_token_id)
    model.load_state_dict(load_file(str(folder / "model.safetensors")), strict=False)
    return model


def load_once(kind: str, stage: int, ours: bool, folder: Path) -> dict:
    import deepspeed
    from transformers import AutoModelForCausalLM

    from dschat.engine.config import hf_zero3_loading
    from dschat.models.model_utils import create_hf_model, load_tokenizer
    from dschat.models.reward_model import load_reward_model
    deepspeed.init_distributed(dist_backend="gloo")
    tokenizer = load_tokenizer(None)
    config = config_of(stage)
    start = time.perf_counter()
    if kind == "lm" and ours:
        model = create_hf_model(str(folder), tokenizer, ds_config=config)
    elif kind == "lm":      # the earlier load: fp32, cast by DeepSpeed afterwards
        with hf_zero3_loading(config):
            model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    elif ours:
        model = load_reward_model(folder, tokenizer, ds_config=config)
    else:
        model = old_reward_load(folder, tokenizer)
    # what DeepSpeed does next: cast to the engine's dtype; then read every page, so a load that
    # maps the file and defers reading it is charged for the reading too
    model = model.to(torch.bfloat16)
    touched = sum(float(p.detach().reshape(-1)[::1024].float().sum()) for p in model.parameters())
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20,
            "checksum": touched}


def write_folders(shape: str, workdir: Path, kinds: set) -> tuple[Path, Path]:
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

    from benchmarks.generation import PRESETS
    from dschat.models.model_utils import load_tokenizer
    from dschat.models.reward_model import RewardModel, save_reward_model
    lm, reward = workdir / f"{Path(shape).stem}-lm", workdir / f"{Path(shape).stem}-reward"
    tokenizer = load_tokenizer(None)
    config = Path(shape) if Path(shape).is_file() else None
    cfg = AutoConfig.from_pretrained(str(config)) if config else AutoConfig.for_model(**PRESETS[shape])
    if "lm" in kinds and not (lm / "model.safetensors").exists():
        AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).save_pretrained(lm)
    if "reward" in kinds and not (reward / "model.safetensors").exists():
        save_reward_model(RewardModel(AutoModel.from_config(cfg, dtype=torch.bfloat16),
                                      pad_token_id=tokenizer.pad_token_id), tokenizer, reward)
    return lm, reward


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tinyllama-1.1b", help="a shape of benchmarks/generation.py, or a config.json")
    p.add_argument("--workdir", default="/tmp/dschat_load_weights",
                   help="where the bf16 folders are written; kept, so a later run reuses them")
    p.add_argument("--cases", nargs="+", choices=list(CASES), default=list(CASES),
                   help="which loads to compare (default: all), so a 7B run can be split across calls")
    p.add_argument("--one", nargs=4, help=argparse.SUPPRESS)      # KIND STAGE OURS FOLDER
    args = p.parse_args()
    if args.one:
        kind, stage, ours, folder = args.one
        print(json.dumps(load_once(kind, int(stage), ours == "1", Path(folder))))
        return
    start = time.perf_counter()
    lm, reward = write_folders(args.model, Path(args.workdir), {CASES[case][1] for case in args.cases})
    print(f"loading {args.model} (bf16 files, written in {time.perf_counter() - start:.0f} s) for a bf16 "
          "engine, one process per load, world size 1\n", flush=True)
    print("| load | fp32 first: s | peak RSS GiB | training dtype (ours): s | peak RSS GiB | speed-up | same weights |")
    print("|---|---|---|---|---|---|---|", flush=True)
    for case in args.cases:          # each row as soon as it is measured: a 7B row takes minutes
        name, kind, stage = CASES[case]
        old, new = (run_single_rank(__file__, ["--one", kind, stage, "1" if ours else "0",
                                               lm if kind == "lm" else reward]) for ours in (False, True))
        print(f"| {name} | {old['seconds']:.1f} | {old['peak_rss_gib']:.2f} | {new['seconds']:.1f} | "
              f"{new['peak_rss_gib']:.2f} | {old['seconds'] / new['seconds']:.2f}x | "
              f"{'yes' if old['checksum'] == new['checksum'] else 'NO'} |", flush=True)


if __name__ == "__main__":
    main()

#!/usr/bin/env python
"""TRL's GRPOTrainer for benchmarks/grpo_vs_trl.py: one run, timed per optimizer step.

    deepspeed --num_gpus 1 benchmarks/trl_grpo_runner.py --config WORKDIR/trl/run.json

Started by grpo_vs_trl.py, which writes the JSON (model, data file, lengths, batch sizes, KL
coefficient, learning rate, dtype, ZeRO stage, output folder). Generation is TRL's
transformers path (`use_vllm=False`): under ZeRO-3 the policy's shards are gathered for the
whole `generate` call (`ds3_gather_for_generation`, TRL's default). Answers are forced to
`answer_len` tokens with `generation_kwargs={"min_new_tokens": answer_len}` (every eos id
is blocked until then) and `max_completion_length=answer_len`.

Writes OUTPUT/steps.jsonl, one row per optimizer step:
  zero_stage  the ZeRO stage of the engine TRL trains with (0: no DeepSpeed engine)
  step_s      on_step_begin -> on_step_end (CUDA synchronised at both ends)
  generate_s  GRPOTrainer._generate_single_turn (prompt padding, gather, HF generate, eos masking)
  experience_s  GRPOTrainer._generate_and_score_completions (the generation above, decoding,
              rewards, advantages, reference/old log-probs when TRL computes them)
  peak_gib    torch.cuda.max_memory_allocated (CPU: the process's max RSS), never reset
  answer_len_mean/min, reward_mean  from the trainer's own metrics of that step
"""
import argparse
import json
import os
import sys
import time
from pathlib import Path


def arithmetic_exact_match(prompts, completions, answer, **kwargs):
    """TRL's reward-function signature around dschat/tasks/arithmetic.py:exact_match_reward
    (the function ours gets with --reward_fn)."""
    from dschat.tasks.arithmetic import exact_match_reward
    return exact_match_reward(prompts, completions, answer=answer)


def check_arrow_location() -> None:
    """datasets fingerprints an in-memory Dataset with dill, and dill pickles the functions of a
    module by value (dragging pyarrow's internals along, which fails: "Can't pickle <class
    'MonthDayNano'>") unless the module lies under sys.prefix or a path with 'site-packages'
    in it. Wheels installed with `pip install --target /tmp/site` do not: say so up front."""
    import pyarrow
    path = os.path.realpath(pyarrow.__file__)
    if "site-packages" not in path and not path.startswith(os.path.realpath(sys.prefix)):
        raise SystemExit(f"pyarrow is loaded from {path}: datasets cannot fingerprint a Dataset from there "
                         f"(dill pickles pyarrow by value); install the wheels of benchmarks/trl_wheels.sh with "
                         f"--target into a folder named site-packages, e.g. /tmp/trl/site-packages")


def _sync():
    import torch
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _peak_gib() -> float:
    import torch
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2 ** 30
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20  # KiB -> GiB, as dschat reports CPU


def _timed(obj, name: str, totals: dict, key: str) -> None:
    """Wrap the bound method `obj.name` so each call's wall time (synchronised) adds to totals[key]."""
    inner = getattr(obj, name)

    def wrapper(*args, **kwargs):
        _sync()
        start = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            _sync()
            totals[key] = totals.get(key, 0.0) + time.perf_counter() - start

    setattr(obj, name, wrapper)


def grpo_config(cfg: dict):
    """The GRPOConfig of a run description (see grpo_vs_trl.py's `trl_run_config`)."""
    import torch
    from trl import GRPOConfig

    from dschat.engine.config import train_ds_config

    micro, gas = cfg["micro_batch"], cfg["gradient_accumulation_steps"]
    ds = None
    if cfg["zero_stage"]:
        # ours' own actor config (same ZeRO-3 thresholds, clipping, precision section)
        ds = train_ds_config(zero_stage=cfg["zero_stage"], dtype=cfg["dtype"], micro_batch_size=micro,
                             gradient_accumulation_steps=gas)
    return GRPOConfig(
        output_dir=cfg["output_dir"], report_to="none", logging_steps=1, save_strategy="no",
        max_steps=cfg["steps"], seed=cfg["seed"], data_seed=cfg["seed"], dataloader_num_workers=0,
        per_device_train_batch_size=micro, gradient_accumulation_steps=gas,   # steps_per_generation = gas
        num_generations=cfg["group"], max_completion_length=cfg["answer_len"],
        generation_kwargs={"min_new_tokens": cfg["answer_len"]},
        temperature=cfg["temperature"], top_p=1.0, top_k=0,
        beta=cfg["beta"], loss_type="dapo", scale_rewards="group", epsilon=0.2, num_iterations=1,
        learning_rate=cfg["learning_rate"], lr_scheduler_type="constant", warmup_steps=0,
        optim="adamw_torch", adam_beta1=0.9, adam_beta2=0.95, weight_decay=0.0, max_grad_norm=1.0,
        bf16=cfg["dtype"] == "bf16", fp16=False,
        use_cpu=not torch.cuda.is_available(),      # transformers refuses bf16 on a CPU-only machine otherwise
        gradient_checkpointing=cfg["gradient_checkpointing"],
        use_vllm=False, deepspeed=ds, log_completions=False, disable_tqdm=True,
    )


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True, help="The run's JSON, written by grpo_vs_trl.py.")
    p.add_argument("--local_rank", type=int, default=-1, help="Set by the deepspeed launcher (unused).")
    args = p.parse_args(argv)
    cfg = json.loads(Path(args.config).read_text())

    import torch
    if not torch.cuda.is_available() and "RANK" in os.environ and not torch.distributed.is_initialized():
        # CPU ranks under the deepspeed launcher: gloo, as dschat.utils.dist does (accelerate
        # joins an existing process group)
        import deepspeed
        deepspeed.init_distributed(dist_backend="gloo")

    check_arrow_location()
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOTrainer

    rows = [json.loads(line) for line in Path(cfg["data_file"]).read_text().splitlines() if line.strip()]
    dataset = Dataset.from_list(rows)
    tokenizer = AutoTokenizer.from_pretrained(cfg["model"], padding_side="left")
    totals: dict = {}
    records: list = []
    out = Path(cfg["output_dir"])
    out.mkdir(parents=True, exist_ok=True)
    steps_file = out / "steps.jsonl"
    steps_file.write_text("")

    class StepTimer(TrainerCallback):
        trainer = None

        def on_step_begin(self, args, state, control, **kwargs):
            _sync()
            totals.clear()
            self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            _sync()
            step_s = time.perf_counter() - self.start
            m = self.trainer._metrics["train"]
            last = lambda k: float(m[k][-1]) if m.get(k) else float("nan")  # noqa: E731
            engine = self.trainer.model_wrapped      # a DeepSpeedEngine once training runs under DeepSpeed
            stage = engine.zero_optimization_stage() if hasattr(engine, "zero_optimization_stage") else 0
            rec = {"step": state.global_step, "zero_stage": stage, "step_s": step_s,
                   "generate_s": totals.get("generate_s", 0.0),
                   "experience_s": totals.get("experience_s", 0.0), "peak_gib": _peak_gib(),
                   "answer_len_mean": last("completions/mean_length"),
                   "answer_len_min": last("completions/min_length"), "reward_mean": last("reward")}
            records.append(rec)
            if state.is_world_process_zero:
                with open(steps_file, "a") as f:
                    f.write(json.dumps(rec) + "\n")
                print(f"trl step {state.global_step}: {json.dumps(rec)}", flush=True)

    import datasets
    import pyarrow
    import transformers
    import trl
    print(f"trl runner: trl {trl.__version__}, transformers {transformers.__version__}, datasets "
          f"{datasets.__version__}, pyarrow {pyarrow.__version__}, torch {torch.__version__}, "
          f"ZeRO stage asked {cfg['zero_stage']}", flush=True)
    timer = StepTimer()
    trainer = GRPOTrainer(model=cfg["model"], reward_funcs=[arithmetic_exact_match], args=grpo_config(cfg),
                          train_dataset=dataset, processing_class=tokenizer, callbacks=[timer])
    timer.trainer = trainer
    _timed(trainer, "_generate_single_turn", totals, "generate_s")
    _timed(trainer, "_generate_and_score_completions", totals, "experience_s")
    trainer.train()
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()

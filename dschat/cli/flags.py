"""DS-Chat's command-line flags (names and defaults kept), defined once per group.

The library never parses argv: entry points build a parser from these groups, parse,
then call `dschat.cli.validate.validate_step*`, which collects every problem and raises
them together.
"""
from __future__ import annotations

import argparse

from dschat.data.assets import BUNDLED_DATASET_NAME
from dschat.utils.errors import UserInputError

DTYPE_CHOICES = ("fp32", "fp16", "bf16")
SCHEDULER_CHOICES = ("linear", "cosine", "cosine_with_restarts", "polynomial", "constant",
                     "constant_with_warmup")


def add_data_args(parser: argparse.ArgumentParser, *, default_data=(BUNDLED_DATASET_NAME,)) -> None:
    g = parser.add_argument_group("data")
    g.add_argument("--data_path", nargs="*", default=list(default_data),
                   help="Datasets: local files (jsonl/json/parquet/csv, gzipped too), folders, "
                        "save_to_disk folders or hub names; several are blended. Default: the "
                        f"bundled demo dataset {BUNDLED_DATASET_NAME!r}.")
    g.add_argument("--data_split", type=str, default="2,4,4",
                   help="Comma-separated proportions of each dataset for steps 1,2,3 (e.g. 2,4,4 "
                        "gives step 1 the first 20%%). Use the same split and seed in all steps "
                        "to keep their data disjoint.")
    g.add_argument("--sft_only_data_path", nargs="*", default=[],
                   help="Datasets used whole in step 1 only.")
    g.add_argument("--data_output_path", type=str, default="/tmp/data_files/",
                   help="Where tokenised datasets are cached (shared by the ranks of a node).")
    g.add_argument("--chat_template", type=str, default="auto", choices=("auto", "none"),
                   help="auto: render DS-Chat's 'Human: ... Assistant: ...' rows (multi-turn "
                        "too) with the tokenizer's chat template when it has one; answers then end "
                        "with the template's end-of-turn token, which step 1 trains, step 2 scores at "
                        "and step 3 stops at. none: DS-Chat's raw text, as upstream.")


def add_model_train_args(parser: argparse.ArgumentParser, *, learning_rate: float) -> None:
    g = parser.add_argument_group("model and training")
    g.add_argument("--model_name_or_path", type=str, required=True,
                   help="A model folder, a config.json (random init, for demos/tests) or a hub name.")
    g.add_argument("--per_device_train_batch_size", type=int, default=16,
                   help="Micro-batch size per device for training.")
    g.add_argument("--per_device_eval_batch_size", type=int, default=16,
                   help="Micro-batch size per device for evaluation.")
    g.add_argument("--max_seq_len", type=int, default=512, help="Sequence length (prompt + answer).")
    g.add_argument("--learning_rate", type=float, default=learning_rate, help="Initial learning rate.")
    g.add_argument("--weight_decay", type=float, default=0.0, help="Weight decay.")
    g.add_argument("--num_train_epochs", type=int, default=1, help="Training epochs.")
    g.add_argument("--max_steps", type=int, default=0,
                   help="Stop after this many optimizer steps (0: run all epochs).")
    g.add_argument("--gradient_accumulation_steps", type=int, default=1,
                   help="Micro-batches accumulated per optimizer step.")
    g.add_argument("--lr_scheduler_type", type=str, default="cosine", choices=SCHEDULER_CHOICES,
                   help="Learning-rate schedule.")
    g.add_argument("--num_warmup_steps", type=int, default=0, help="Warm-up steps of the schedule.")
    g.add_argument("--output_dir", type=str, default=None,
                   help="Where the final model is written (at its root) with metrics and config.")
    g.add_argument("--seed", type=int, default=1234, help="Seed for data split, init and sampling.")
    g.add_argument("--local_rank", type=int, default=-1, help="Set by the deepspeed launcher.")
    g.add_argument("--gradient_checkpointing", action="store_true",
                   help="Recompute activations in backward to save memory.")
    g.add_argument("--dropout", type=float, default=None,
                   help="Set every dropout of the model to this value (default: keep the model's).")
    g.add_argument("--offload", action="store_true",
                   help="ZeRO-Offload: optimizer state (and at stage 3 parameters) in CPU memory.")
    g.add_argument("--dtype", type=str, default="fp16", choices=DTYPE_CHOICES,
                   help="Training precision (fp32 on CPU).")
    g.add_argument("--zero_stage", type=int, default=0, choices=(0, 1, 2, 3), help="ZeRO stage.")
    add_zero3_hooks_arg(g)
    g.add_argument("--compute_fp32_loss", action="store_true",
                   help="Kept for DS-Chat compatibility: losses are always computed in fp32.")
    g.add_argument("--print_loss", action="store_true", help="Print the loss of every step.")
    g.add_argument("--eval_interval", type=int, default=0,
                   help="Evaluate every this many steps (0: once per epoch).")
    g.add_argument("--eval_iters", type=int, default=100, help="Evaluation batches at most.")
    g.add_argument("--add_eot_token", action="store_true",
                   help="Add --eot_token to the tokenizer and end every answer with it.")
    g.add_argument("--eot_token", type=str, default="<|endoftext|>", help="End-of-turn token.")


def add_zero3_hooks_arg(g) -> None:
    g.add_argument("--zero3_hook_granularity", type=str, default="block", choices=("block", "module"),
                   help="ZeRO-3 parameter gathering unit: 'block' gathers and releases each transformer "
                        "block whole (one hook per block; far less host time per step, same numbers); "
                        "'module' keeps DeepSpeed's hooks on every linear and norm.")


def add_lora_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("LoRA")
    g.add_argument("--lora_dim", type=int, default=0, help="LoRA rank (0: no LoRA).")
    g.add_argument("--lora_module_name", type=str, default=None,
                   help="Apply LoRA only under this module prefix (default: the family's "
                        "transformer blocks, e.g. transformer.h. for Bloom, decoder.layers. for OPT).")
    g.add_argument("--only_optimize_lora", action="store_true",
                   help="Train only the LoRA weights.")
    g.add_argument("--lora_learning_rate", type=float, default=5e-4, help="LoRA learning rate.")


def add_logging_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("logging")
    g.add_argument("--enable_tensorboard", action="store_true", help="Also log to TensorBoard.")
    g.add_argument("--tensorboard_path", type=str, default="step_tensorboard",
                   help="TensorBoard log folder (relative paths go under --output_dir).")
    g.add_argument("--enable_wandb", action="store_true",
                   help="Also log to wandb (offline unless WANDB_MODE/WANDB_API_KEY say otherwise).")
    g.add_argument("--wandb_project", type=str, default="dschat", help="wandb project name.")


def add_checkpoint_args(parser: argparse.ArgumentParser, *, unit: str = "optimizer steps") -> None:
    g = parser.add_argument_group("checkpoints and fault tolerance")
    g.add_argument("--save_interval", type=int, default=0,
                   help=f"Write a resumable checkpoint under --output_dir/checkpoints/ every this many "
                        f"{unit} (0: none; the final model is written at the end either way).")
    g.add_argument("--resume", action="store_true",
                   help="Continue from the newest complete checkpoint under --output_dir/checkpoints/ "
                        "(none there: start from scratch). Needs the same number of ranks.")
    g.add_argument("--keep_last", type=int, default=2,
                   help="Keep only the newest this many checkpoints (0: keep all).")
    g.add_argument("--max_nonfinite_in_a_row", type=int, default=5,
                   help="A non-finite loss (or reward) skips its update; this many in a row stop the "
                        "run after checkpointing the last good state.")


def split_fractions(data_split: str) -> list[float]:
    try:
        parts = [float(x) for x in data_split.split(",")]
    except ValueError:
        raise UserInputError(f"--data_split {data_split!r}: expected three numbers like 2,4,4") from None
    if len(parts) != 3 or any(p < 0 for p in parts) or sum(parts) <= 0:
        raise UserInputError(f"--data_split {data_split!r}: expected three non-negative numbers like 2,4,4")
    return [p / sum(parts) for p in parts]

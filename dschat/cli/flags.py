"""DS-Chat's command-line flags (names and defaults kept), defined once per group.

The library never parses argv: entry points build a parser from these groups, parse,
then call `dschat.cli.validate.validate_step*`, which collects every problem and raises
them together.
"""
from __future__ import annotations

import argparse

from dschat.data.assets import BUNDLED_DATASET_NAME
from dschat.rlhf.algorithm import ALGORITHMS
from dschat.rlhf.estimators import KL_KINDS, LOSS_AGG_MODES
from dschat.utils.attention import ATTN_IMPLEMENTATIONS
from dschat.utils.errors import UserInputError
from dschat.utils.profiling import add_profile_args

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
                   help="Recompute activations in backward to save memory (with --only_optimize_lora too, "
                        "which upstream refuses).")
    add_checkpoint_every_n_layers_arg(g)
    g.add_argument("--dropout", type=float, default=None,
                   help="Set every dropout of the model to this value (default: keep the model's).")
    add_offload_args(g, "ZeRO-Offload: optimizer state (and at stage 3 parameters) in CPU memory.")
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
    """--zero3_hook_granularity, and --attn_implementation beside it (both shape every model's forward)."""
    g.add_argument("--attn_implementation", type=str, default="sdpa", choices=ATTN_IMPLEMENTATIONS,
                   help="Attention of the training and scoring forwards. sdpa: PyTorch's fused "
                        "scaled_dot_product_attention (for Bloom, whose HF code has only eager attention, "
                        "ours, with ALiBi and the mask as its bias and a one-kernel GELU: same numbers within "
                        "fp32 rounding, no [batch, heads, len, len] probabilities kept for backward). eager: "
                        "HF's eager attention. Generation uses its own kernels either way.")
    g.add_argument("--zero3_hook_granularity", type=str, default="block", choices=("block", "module"),
                   help="ZeRO-3 parameter gathering unit: 'block' gathers and releases each transformer "
                        "block whole (one hook per block; far less host time per step, same numbers); "
                        "'module' keeps DeepSpeed's hooks on every linear and norm.")


def add_checkpoint_every_n_layers_arg(g) -> None:
    g.add_argument("--checkpoint_every_n_layers", type=int, default=1, metavar="N",
                   help="With activation checkpointing on, recompute only every N-th transformer block (the "
                        "first, then every N-th, as transformers' every_n_layers); the others keep their "
                        "activations: N=2 holds about half of the activations checkpointing saves and does half "
                        "its recomputation. Default 1: every block.")


def add_offload_args(g, offload_help: str) -> None:
    """--offload (upstream's) and the two knobs that make a 7B actor fit one GPU's host."""
    g.add_argument("--offload", action="store_true", help=offload_help)
    g.add_argument("--offload_optimizer_only", action="store_true",
                   help="With --offload: keep the parameters on the GPU and offload only the optimizer "
                        "states (fp32 master weights, Adam moments, fp32 gradients). On one GPU this avoids "
                        "fetching every parameter from host memory in each forward and backward.")
    g.add_argument("--offload_ratio", type=float, default=1.0,
                   help="With --offload at ZeRO-3: the share of the optimizer states kept and updated on "
                        "the CPU (DeepSpeed's partial offload, in sub-groups of 2e8 parameters); the rest "
                        "stays on the GPU. Below 1 the parameters stay on the GPU. For a model whose 16 "
                        "bytes/param of training state fit neither the GPU nor the host alone.")
    g.add_argument("--offload_pin_memory", action="store_true",
                   help="With --offload: page-locked host buffers for the offloaded state (faster copies "
                        "to and from the GPU; the host memory they take cannot be swapped).")
    g.add_argument("--adam_kernel", default="fused", choices=("fused", "foreach"),
                   help="Without --offload, torch AdamW's kernel: fused (one kernel per tensor, no "
                        "full-size temporaries) or foreach (torch's multi-tensor default on GPUs). "
                        "With --offload DeepSpeed's CPU Adam steps.")
    g.add_argument("--optimizer_dtype", default="fp32", choices=("fp32", "bf16"),
                   help="Precision of the optimizer's state. fp32 (default): fp32 master weights and Adam "
                        "moments, 16 bytes per trained parameter with the bf16 weights and gradients. bf16: "
                        "the bf16 weights are the master weights, the moments bf16, the weights written "
                        "with stochastic rounding so small updates still add up (8 bytes per parameter; "
                        "one Triton kernel per tensor on CUDA, faster than torch's fused fp32 AdamW; "
                        "benchmarks/RESULTS.md measures its learning against fp32). Needs --dtype bf16, ZeRO "
                        "stage 1-3 for every trained model and no --offload.")


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


def add_step3_args(p: argparse.ArgumentParser) -> None:
    """Step 3's flags (DS-Chat's, the critic-free algorithms', the hybrid engine's, logging,
    checkpoints, profiling) on parser `p`."""
    add_data_args(p)
    g = p.add_argument_group("data (step 3)")
    g.add_argument("--unsupervised_dataset_name", type=str, default=None,
                   help="Text dataset (local path or hub name) for the ptx loss; off by default.")
    g.add_argument("--unsupervised_dataset_config_name", type=str, default=None,
                   help="datasets config name of --unsupervised_dataset_name.")
    g.add_argument("--unsup_coef", type=float, default=27.8, help="Weight of the ptx loss.")
    g.add_argument("--preprocessing_num_workers", type=int, default=None, help="Kept for DS-Chat compatibility.")
    g = p.add_argument_group("models")
    g.add_argument("--actor_model_name_or_path", type=str, required=True, help="Step-1 output folder (or config).")
    g.add_argument("--critic_model_name_or_path", type=str, default=None,
                   help="Step-2 output folder: a reward model (ours or DS-Chat's format). It initialises the "
                        "critic (--algorithm ppo: required) and is the reward model. With --reward_fn and this "
                        "model's weight 0 in --reward_weights it only initialises the critic, and may then be a "
                        "causal-LM folder (the SFT model; the value head starts new). Optional for critic-free "
                        "algorithms given --reward_fn.")
    g.add_argument("--num_padding_at_beginning", type=int, default=None,
                   help="Kept for DS-Chat compatibility; sequence ends are read from attention masks.")
    g = p.add_argument_group("PPO")
    g.add_argument("--per_device_generation_batch_size", type=int, default=16,
                   help="Answers generated per rank per rollout batch (prompts x --n_samples_per_prompt).")
    g.add_argument("--per_device_training_batch_size", type=int, default=16, help="PPO micro-batch per rank.")
    g.add_argument("--generation_batches", type=int, default=1,
                   help="Generation batches per PPO update round; step 3 logs one metrics row per round "
                        "(its seconds, samples/s and phases span the whole round).")
    g.add_argument("--ppo_epochs", type=int, default=1, help="PPO epochs over each round of experience.")
    g.add_argument("--max_prompt_seq_len", type=int, default=256, help="Prompts longer than this are dropped.")
    g.add_argument("--max_answer_seq_len", type=int, default=256, help="Answer tokens generated at most.")
    g.add_argument("--min_answer_seq_len", type=int, default=0,
                   help="Force at least this many answer tokens (benchmarks; 0: stop at eos).")
    g.add_argument("--actor_learning_rate", type=float, default=9.65e-6, help="Actor learning rate.")
    g.add_argument("--critic_learning_rate", type=float, default=5e-6, help="Critic learning rate.")
    g.add_argument("--actor_weight_decay", type=float, default=0.0, help="Actor weight decay.")
    g.add_argument("--critic_weight_decay", type=float, default=0.0, help="Critic weight decay.")
    g.add_argument("--num_train_epochs", type=int, default=1, help="Passes over the prompts.")
    g.add_argument("--lr_scheduler_type", type=str, default="cosine", choices=SCHEDULER_CHOICES,
                   help="Learning-rate schedule.")
    g.add_argument("--gradient_accumulation_steps", type=int, default=1, help="Micro-batches per optimizer step.")
    g.add_argument("--num_warmup_steps", type=int, default=100, help="Warm-up steps of the schedule.")
    g.add_argument("--output_dir", type=str, default=None, help="Where actor/, critic/ and metrics go.")
    g.add_argument("--seed", type=int, default=1234, help="Seed (sampling is seeded per rank from it).")
    g.add_argument("--local_rank", type=int, default=-1, help="Set by the deepspeed launcher.")
    g.add_argument("--kl_ctl", type=float, default=0.1,
                   help="KL penalty coefficient (the start value with --kl_target); 0 builds no reference model.")
    g.add_argument("--clip_reward_value", type=float, default=5.0, help="Reward score clipped to +-this.")
    g.add_argument("--cliprange", type=float, default=0.2,
                   help="PPO ratio clip (both sides unless --cliprange_low/--cliprange_high).")
    g.add_argument("--cliprange_value", type=float, default=0.2, help="Value clip of the critic loss.")
    g.add_argument("--gamma", type=float, default=1.0, help="GAE discount.")
    g.add_argument("--lam", type=float, default=0.95, help="GAE lambda.")
    g.add_argument("--temperature", type=float, default=None, help="Sample with this temperature (default: greedy).")
    g.add_argument("--top_p", type=float, default=None, help="Nucleus sampling (implies sampling).")
    g.add_argument("--top_k", type=int, default=None, help="Top-k sampling (implies sampling).")
    g = p.add_argument_group("algorithm (critic-free RL)")
    g.add_argument("--algorithm", choices=ALGORITHMS, default="ppo",
                   help="ppo: DS-Chat's PPO with a critic (GAE). grpo: group-normalised rewards (GRPO; "
                        "Dr.GRPO with --no_std_norm). rloo: leave-one-out baseline. reinforce_pp: REINFORCE++ "
                        "(KL-penalised token returns whitened over the batch). The last three build no critic.")
    g.add_argument("--n_samples_per_prompt", type=int, default=1, metavar="N",
                   help="Answers sampled per prompt. Each prompt is repeated N times, contiguously, inside one "
                        "generation batch (--per_device_generation_batch_size counts answers and must be a "
                        "multiple of N), so a group never spans ranks or batches. grpo/rloo need N >= 2 and "
                        "sampling (--temperature/--top_p/--top_k).")
    g.add_argument("--no_std_norm", action="store_true",
                   help="grpo: do not divide advantages by the group's std (Dr.GRPO).")
    g.add_argument("--kl_estimator", choices=KL_KINDS, default=None,
                   help="KL(actor || reference) estimator per token: k1 = logprobs - ref_logprobs, "
                        "k2 = (log ratio)^2 / 2, k3 = r - 1 - log r. Default: k1 for ppo and reinforce_pp, "
                        "k3 for grpo and rloo.")
    g.add_argument("--kl_in", choices=("reward", "loss"), default=None,
                   help="Where the KL penalty goes: into the rewards (default for ppo and reinforce_pp, as "
                        "upstream) or as a loss term kl_ctl x KL (default for grpo and rloo, as TRL/DeepSeek).")
    g.add_argument("--kl_target", type=float, default=None,
                   help="Adaptive KL coefficient (Ziegler et al. 2019): start at --kl_ctl and move it so the "
                        "KL per answer (nats, summed over its tokens) approaches this. Default: off (fixed --kl_ctl).")
    g.add_argument("--kl_horizon", type=float, default=10000,
                   help="Adaptive KL: samples over which the coefficient changes by at most 20%%.")
    g.add_argument("--loss_agg", choices=LOSS_AGG_MODES, default="token_mean",
                   help="How per-token policy losses become one: token_mean (DS-Chat, DAPO), "
                        "seq_mean_token_mean (GRPO paper), seq_mean_token_sum_norm (Dr.GRPO: each answer's "
                        "sum / --max_answer_seq_len).")
    g.add_argument("--cliprange_low", type=float, default=None,
                   help="Lower ratio clip (1 - this). Default: --cliprange.")
    g.add_argument("--cliprange_high", type=float, default=None,
                   help="Upper ratio clip (1 + this; DAPO's clip-higher uses 0.28). Default: --cliprange.")
    g.add_argument("--filter_groups", action="store_true",
                   help="DAPO dynamic sampling: drop groups whose rewards are all equal (zero advantage) and "
                        "refill the batch with new prompts' groups, at most --filter_groups_max_extra extra "
                        "generations per step; the ranks then train on the same number of groups. Needs "
                        "--n_samples_per_prompt >= 2.")
    g.add_argument("--filter_groups_max_extra", type=int, default=4,
                   help="--filter_groups: extra generation rounds per step at most.")
    g.add_argument("--overlong_penalty", type=int, default=0, metavar="BUFFER",
                   help="DAPO soft overlong punishment: a reward going linearly from 0 to -1 over the last "
                        "BUFFER tokens before --max_answer_seq_len (0: off).")
    g.add_argument("--reward_fn", action="append", default=None, metavar="FILE.py:FUNCTION",
                   help="A Python reward function fn(prompts, answers, **row_fields) -> one number per answer "
                        "(dschat/rlhf/reward_fn.py); repeatable or comma-separated. Gets the dataset row's "
                        "other columns (e.g. 'answer') as keywords.")
    g.add_argument("--reward_weights", action="append", default=None, metavar="W[,W...]",
                   help="Weights of the rewards, summed: the reward model's first (when "
                        "--critic_model_name_or_path is given), then each --reward_fn in order; "
                        "comma-separated or repeated. Default: 1 each.")
    g.add_argument("--skip_bad_rewards", action="store_true",
                   help="A reward function's non-finite (or None) value masks that answer out of the losses "
                        "(counted in reward/bad_skipped) instead of stopping the run.")
    g = p.add_argument_group("hybrid engine (ours)")
    g.add_argument("--enable_hybrid_engine", action="store_true",
                   help="Generate on a persistent inference replica filled from the ZeRO shards.")
    g.add_argument("--unpin_actor_parameters", action="store_true",
                   help="Layered mode: gather --tp_gather_partition_size blocks at a time (less memory, slower).")
    g.add_argument("--release_inference_cache", action="store_true",
                   help="Free the replica, KV cache and graphs after each rollout.")
    g.add_argument("--inference_tp_size", type=int, default=1,
                   help="Generate with tensor parallelism inside groups of this many consecutive ranks "
                        "(must divide the world size and the head counts; needs --enable_hybrid_engine).")
    g.add_argument("--tp_gather_partition_size", type=int, default=8,
                   help="Blocks gathered at a time in layered mode and in the tensor-parallel replica fill.")
    g.add_argument("--disable_fast_decode", action="store_true",
                   help="Decode with HF generate on the replica even where the fast path (static KV cache "
                        "+ CUDA graphs, on GPU for bloom/opt/llama) is available; for comparisons.")
    g = p.add_argument_group("memory and precision")
    add_offload_args(g, "ZeRO-Offload for actor and critic: their optimizer states (and at stage 3 "
                        "their parameters) in CPU memory.")
    g.add_argument("--offload_reference_model", action="store_true", help="Offload the reference model.")
    g.add_argument("--offload_reward_model", action="store_true", help="Offload the reward model.")
    g.add_argument("--actor_zero_stage", type=int, default=0, choices=(0, 1, 2, 3), help="Actor ZeRO stage.")
    g.add_argument("--critic_zero_stage", type=int, default=0, choices=(0, 1, 2, 3), help="Critic ZeRO stage.")
    g.add_argument("--separate_lora_reference", action="store_true",
                   help="With a LoRA actor whose base weights are frozen (--actor_lora_dim, "
                        "--only_optimize_lora) build the reference as a model of its own. Default: the "
                        "reference is the actor with its adapters switched off (the same weights, held once).")
    g.add_argument("--reference_zero_stage", type=int, default=None, choices=(0, 3),
                   help="ZeRO stage of the frozen reference (and EMA) model. Default: 3 when "
                        "--actor_zero_stage is 3, else 0 (upstream's rule); on one GPU 0 unless "
                        "--offload_reference_model (ZeRO-3 partitions nothing there). 0 keeps a whole copy on "
                        "every GPU: no per-layer gathers while scoring, at the memory of one model.")
    g.add_argument("--reward_zero_stage", type=int, default=None, choices=(0, 3),
                   help="ZeRO stage of the frozen reward model. Default: 3 when --critic_zero_stage "
                        "is 3, else 0; on one GPU 0 unless --offload_reward_model. 0 keeps a whole copy on "
                        "every GPU (faster scoring, more memory).")
    add_zero3_hooks_arg(g)
    g.add_argument("--actor_gradient_checkpointing", action="store_true", help="Actor activation checkpointing.")
    g.add_argument("--logprobs", choices=("fused", "plain"), default="fused",
                   help="How the actor's training forward and the reference's scoring get token log-probs. "
                        "fused: the output layer and the log-softmax run together over chunks of tokens, so "
                        "[batch, answer, vocabulary] logits never exist (same numbers; a model whose output "
                        "layer is not a plain linear layer, or that rescales its logits, runs plain, said once "
                        "in the log). plain: HF's logits, then the log-softmax (DS-Chat's way).")
    g.add_argument("--score_in_training_forward", action="store_true",
                   help="Take the actor's old log-probs and the critic's old values from their training forwards "
                        "instead of separate scoring forwards after generation: the two forwards fewer per step. "
                        "Exact only when the round trains once on weights it was generated with, so it needs "
                        "--ppo_epochs 1, --generation_batches 1, one training micro-batch per rollout "
                        "(--per_device_training_batch_size >= --per_device_generation_batch_size), "
                        "--gradient_accumulation_steps 1, no --filter_groups and dropout 0 in actor and critic. "
                        "The PPO ratio is then exactly 1; both models' activations are alive together.")
    g.add_argument("--critic_gradient_checkpointing", action="store_true", help="Critic activation checkpointing.")
    add_checkpoint_every_n_layers_arg(g)
    g.add_argument("--compile_blocks", action="store_true",
                   help="torch.compile the transformer blocks of the actor and critic for their training "
                        "forwards and backwards (scoring and generation stay eager): fewer kernels and less host "
                        "work per block, where host time bounds small models' training on a GPU (the speed-up "
                        "is not measured yet; benchmarks/RESULTS.md). The first step compiles (tens of "
                        "seconds). Needs --actor_zero_stage and --critic_zero_stage <= 2.")
    g.add_argument("--actor_dropout", type=float, default=0.0,
                   help="Actor dropout (default 0.0, as upstream's step-3 scripts: with dropout the PPO "
                        "ratio is not 1 at the first micro-step); set it to train with the model's own.")
    g.add_argument("--critic_dropout", type=float, default=0.0,
                   help="Critic dropout (default 0.0, as upstream's step-3 scripts).")
    g.add_argument("--dtype", type=str, default="fp16", choices=DTYPE_CHOICES, help="Training precision.")
    g.add_argument("--compute_fp32_loss", action="store_true",
                   help="Kept for DS-Chat compatibility: PPO losses are always computed in fp32.")
    g = p.add_argument_group("LoRA")
    g.add_argument("--actor_lora_dim", type=int, default=0, help="Actor LoRA rank (0: off).")
    g.add_argument("--actor_lora_module_name", type=str, default=None, help="Actor LoRA module prefix.")
    g.add_argument("--critic_lora_dim", type=int, default=0, help="Critic LoRA rank (0: off).")
    g.add_argument("--critic_lora_module_name", type=str, default=None, help="Critic LoRA module prefix.")
    g.add_argument("--only_optimize_lora", action="store_true", help="Train only LoRA weights.")
    g.add_argument("--actor_lora_learning_rate", type=float, default=5e-4, help="Actor LoRA learning rate.")
    g.add_argument("--critic_lora_learning_rate", type=float, default=5e-4, help="Critic LoRA learning rate.")
    g.add_argument("--enable_mixed_precision_lora", action="store_true",
                   help="Keep the frozen base weights in low precision (needs LoRA and ZeRO-3).")
    g = p.add_argument_group("other")
    g.add_argument("--enable_ema", action="store_true", help="Keep an EMA of the actor (saved as actor_ema/).")
    g.add_argument("--add_eot_token", action="store_true", help="Add --eot_token to the tokenizer.")
    g.add_argument("--eot_token", type=str, default="<|endoftext|>", help="End-of-turn token.")
    g.add_argument("--stop_strings", nargs="*", default=None,
                   help="Without a chat template: an answer ends before the first of these (default: "
                        "'\\n\\nHuman:', the user's next turn in DS-Chat's text); the tokens from there on "
                        "are masked like padding in experience, rewards and losses. Answers always "
                        "end at eos and at the chat template's end-of-turn token."),
    g.add_argument("--align_overflow", action="store_true", help="Kept for DS-Chat compatibility (fp16 only).")
    g.add_argument("--print_answers", action="store_true", help="Print prompts and answers on rank 0.")
    g.add_argument("--print_answers_interval", type=int, default=1, help="Every this many steps.")
    g.add_argument("--dump_generations", type=str, default=None,
                   help="JSONL file: one row per prompt per PPO step (step, rank, prompt, answer, reward).")
    g.add_argument("--enable_test_mode", action="store_true", help="Stop after --test_stop_step steps.")
    g.add_argument("--test_stop_step", type=int, default=0, help="Steps to run in test mode.")
    g.add_argument("--max_steps", type=int, default=0, help="Stop after this many PPO steps (0: all).")
    g.add_argument("--skip_final_save", action="store_true",
                   help="Do not write the final actor / critic (benchmarks and sweeps that keep only the "
                        "metrics; a 7B actor takes a minute and 14 GB of disk to write).")
    add_logging_args(p)
    add_checkpoint_args(p, unit="PPO steps")
    add_profile_args(p)

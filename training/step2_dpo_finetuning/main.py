#!/usr/bin/env python
"""Step 2 DPO: Direct Preference Optimization of a causal LM on chosen/rejected pairs,
against a frozen reference copy of the starting model (upstream DS-Chat's
training/step2_dpo_finetuning; instead of step 2's reward model + step 3's PPO).

    deepspeed training/step2_dpo_finetuning/main.py \\
        --model_name_or_path output/step1 --dtype fp32 --zero_stage 3 \\
        --beta 0.1 --output_dir output/step2_dpo

The data flags are those of steps 1-2 (phase-2 pairs of --data_path under --data_split).
Log-probs are summed over the answer tokens (the prompt masked; an answer is taken to start
where the chosen and rejected sequences first differ, as upstream: see dschat/rlhf/dpo.py).
The aligned model is written at the root of --output_dir as a plain HF causal-LM folder
(LoRA merged), with metrics.jsonl and training_config.json beside it; eval metrics: loss,
implicit-reward accuracy (chosen above rejected), reward margin, chosen/rejected log-probs
and rewards, and the per-token KL to the reference. `--save_interval N` writes resumable
checkpoints under --output_dir/checkpoints/; `--resume` continues from the newest complete one.
"""
import argparse

from dschat.cli import flags
from dschat.cli.validate import validate_step2_dpo
from dschat.data import DataCollatorReward
from dschat.engine.config import offload_options, train_ds_config
from dschat.engine.train_loop import load_step_data, start_run
from dschat.models.model_utils import load_tokenizer, save_hf_format
from dschat.rlhf.dpo import LOSS_TYPES, summarize
from dschat.rlhf.dpo_trainer import DPOConfig, build_dpo_engines, evaluate, train_step
from dschat.utils.dist import get_rank, get_world_size, init_distributed
from dschat.utils.logging import print_rank_0
from dschat.utils.run import main_guard, set_seed


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    flags.add_data_args(parser)
    flags.add_model_train_args(parser, learning_rate=1e-3)  # upstream's DPO default
    flags.add_lora_args(parser)
    flags.add_logging_args(parser)
    flags.add_checkpoint_args(parser)
    g = parser.add_argument_group("DPO")
    g.add_argument("--beta", type=float, default=0.1,
                   help="Temperature of the DPO loss (upstream default 0.1; typically 0.1-0.5): the "
                        "implicit reward is beta * (log pi - log ref); as beta -> 0 the reference is ignored.")
    g.add_argument("--label_smoothing", type=float, default=0.0,
                   help="Conservative DPO (sigmoid loss only): the probability that a preference label is "
                        "flipped; in [0, 0.5).")
    g.add_argument("--loss_type", type=str, default="sigmoid", choices=LOSS_TYPES,
                   help="sigmoid: -log sigma(beta h) with label smoothing (upstream DS-Chat); ipo: "
                        "(h - 1/(2 beta))^2; hinge: relu(1 - beta h); h is the log-ratio margin "
                        "(log pi_c - log ref_c) - (log pi_r - log ref_r) of summed answer log-probs.")
    g.add_argument("--rpo_alpha", type=float, default=None,
                   help="Add this weight x the NLL of the chosen answers (mean per answer token over the "
                        "global batch) to the loss, as TRL's rpo_alpha (default: none). An answer's tokens "
                        "are counted from where it first differs from the rejected one (dschat/rlhf/dpo.py).")
    g.add_argument("--reference_zero_stage", type=int, default=None, choices=(0, 3),
                   help="ZeRO stage of the frozen reference model. Default: 3 when --zero_stage is 3, "
                        "else 0 (upstream's rule). 0 keeps a whole copy on every GPU.")
    g.add_argument("--offload_reference_model", action="store_true",
                   help="Keep the reference model's ZeRO-3 parameters in CPU memory.")
    return parser


def parse_args(argv=None):
    return build_parser().parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    validate_step2_dpo(args)
    device = init_distributed(args.local_rank)
    world = get_world_size()
    set_seed(args.seed)
    cfg = DPOConfig.from_args(args)

    tokenizer = load_tokenizer(args.model_name_or_path, add_eot_token=args.add_eot_token,
                               eot_token=args.eot_token)
    data = load_step_data(args, tokenizer, 2, DataCollatorReward())
    ds_config = train_ds_config(
        zero_stage=args.zero_stage, dtype=args.dtype, micro_batch_size=args.per_device_train_batch_size,
        gradient_accumulation_steps=args.gradient_accumulation_steps, **offload_options(args))
    policy, ref = build_dpo_engines(args, tokenizer, ds_config, data.total_steps)
    run = start_run(args, policy, device, ds_config=ds_config, train_pairs=len(data.train),
                    eval_pairs=len(data.eval))

    def run_eval(step: int, epoch: int | None) -> dict:
        result = evaluate(policy, ref, data.eval_loader, cfg, device, args.eval_iters)
        print_rank_0(f"step {step}: eval loss {result['loss']:.4f}, reward accuracy {result['acc']:.4f}, "
                     f"margin {result['margin']:.4f}, KL to reference {result.get('kl_ref', 0.0):.5f}")
        run.metrics.log(step, {f"eval/{k}": v for k, v in result.items()})
        return result

    def one_step(group, step):
        loss, stats = train_step(policy, ref, group, cfg, device, world, run.guard, step)
        if stats is None:
            return loss, None
        train = summarize(stats, cfg.rpo_alpha)
        return loss, {f"train/{k}": train[k] for k in ("acc", "margin", "chosen_logps", "rejected_logps")}

    result, save = run.train(desc="step 2 (DPO)", engine=policy, data=data, args=args, device=device,
                             train_step=one_step, run_eval=run_eval)
    run.finish(lambda: save_hf_format(policy, tokenizer, args.output_dir, rank=get_rank()), save,
               args.output_dir, result, policy)
    print_rank_0(f"saved the DPO model to {args.output_dir}")


if __name__ == "__main__":
    main_guard(main)

#!/usr/bin/env python
"""Step 2: reward-model training on chosen/rejected pairs.

    deepspeed training/step2_reward_model_finetuning/main.py \
        --model_name_or_path output/step1 --dtype fp32 --zero_stage 3 \
        --output_dir output/step2

The reward model is written at the root of --output_dir (config, model.safetensors with
`rwtransformer.*` + `v_head.weight`, tokenizer, reward_model.json); step 3 takes that
folder as --critic_model_name_or_path. `--save_interval N` writes resumable checkpoints under
--output_dir/checkpoints/; `--resume` continues from the newest complete one.
"""
import argparse

from dschat.cli import flags
from dschat.cli.validate import validate_step2
from dschat.data import DataCollatorReward
from dschat.engine.config import offload_options, train_ds_config
from dschat.engine.train_loop import load_step_data, start_run
from dschat.models.lora import apply_lora
from dschat.models.model_utils import enable_activation_checkpointing, load_tokenizer, train_engine
from dschat.models.reward_model import create_reward_model, save_reward_model
from dschat.rlhf.reward_trainer import evaluate, train_step
from dschat.utils.dist import get_rank, get_world_size, init_distributed
from dschat.utils.logging import print_rank_0
from dschat.utils.run import main_guard, set_seed


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    flags.add_data_args(parser)
    flags.add_model_train_args(parser, learning_rate=5e-5)
    flags.add_lora_args(parser)
    flags.add_logging_args(parser)
    flags.add_checkpoint_args(parser)
    parser.add_argument("--num_padding_at_beginning", type=int, default=None,
                        help="DS-Chat's pad-count convention for finding sequence ends when no "
                             "attention mask is given (default: the model family's, e.g. 1 for OPT). "
                             "Ends are read from the attention mask whenever there is one.")
    return parser.parse_args(argv)


def build_engine(args, tokenizer, ds_config, num_update_steps):
    model = create_reward_model(args.model_name_or_path, tokenizer, ds_config=ds_config,
                                dropout=args.dropout, seed=args.seed,
                                num_padding_at_beginning=args.num_padding_at_beginning,
                                attn_implementation=args.attn_implementation)
    model.rwtransformer = apply_lora(model.rwtransformer, args.lora_dim, args.lora_module_name,
                                     args.only_optimize_lora)
    if args.gradient_checkpointing:
        enable_activation_checkpointing(model, args.checkpoint_every_n_layers)
    return train_engine(model, args, ds_config, num_update_steps)


def main(argv=None):
    args = parse_args(argv)
    validate_step2(args)
    device = init_distributed(args.local_rank)
    world = get_world_size()
    set_seed(args.seed)

    tokenizer = load_tokenizer(args.model_name_or_path, add_eot_token=args.add_eot_token,
                               eot_token=args.eot_token)
    data = load_step_data(args, tokenizer, 2, DataCollatorReward())
    ds_config = train_ds_config(
        zero_stage=args.zero_stage, dtype=args.dtype, micro_batch_size=args.per_device_train_batch_size,
        gradient_accumulation_steps=args.gradient_accumulation_steps, **offload_options(args))
    engine = build_engine(args, tokenizer, ds_config, data.total_steps)
    run = start_run(args, engine, device, ds_config=ds_config, train_pairs=len(data.train),
                    eval_pairs=len(data.eval))

    def run_eval(step: int, epoch: int | None) -> dict:
        result = evaluate(engine, data.eval_loader, device, args.eval_iters)
        print_rank_0(f"step {step}: eval accuracy {result['acc']:.4f}, chosen {result['chosen_score']:.4f}, "
                     f"rejected {result['rejected_score']:.4f}")
        run.metrics.log(step, {f"eval/{k}": v for k, v in result.items()})
        return result

    result, save = run.train(
        desc="step 2 (reward model)", engine=engine, data=data, args=args, device=device, run_eval=run_eval,
        train_step=lambda group, step: (train_step(engine, group, device, world, run.guard, step), None))
    run.finish(lambda: save_reward_model(engine, tokenizer, args.output_dir, rank=get_rank()), save,
               args.output_dir, result, engine)
    print_rank_0(f"saved the reward model to {args.output_dir}")


if __name__ == "__main__":
    main_guard(main)

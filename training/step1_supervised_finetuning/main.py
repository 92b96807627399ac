#!/usr/bin/env python
"""Step 1: supervised fine-tuning of a causal LM on prompt + chosen answers.

    deepspeed training/step1_supervised_finetuning/main.py \
        --model_name_or_path configs/tiny/bloom.json --dtype fp32 --zero_stage 3 \
        --output_dir output/step1

The final model is written at the root of --output_dir (HF format), so step 2 and step 3
take that folder as their model path; metrics.jsonl and the resolved configuration sit
beside it. `--save_interval N` writes resumable checkpoints under --output_dir/checkpoints/;
`--resume` continues from the newest complete one.
"""
import argparse

from dschat.cli import flags
from dschat.cli.validate import validate_step1
from dschat.engine.config import offload_options, train_ds_config
from dschat.engine.train_loop import load_step_data, start_run
from dschat.engine.train_utils import evaluate_lm, sft_train_step
from dschat.models.model_utils import build_lm_engine, load_tokenizer, save_hf_format
from dschat.utils.dist import get_rank, get_world_size, init_distributed
from dschat.utils.logging import print_rank_0
from dschat.utils.run import main_guard, set_seed


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    flags.add_data_args(parser)
    flags.add_model_train_args(parser, learning_rate=1e-3)
    flags.add_lora_args(parser)
    flags.add_logging_args(parser)
    flags.add_checkpoint_args(parser)
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    validate_step1(args)
    device = init_distributed(args.local_rank)
    world = get_world_size()
    set_seed(args.seed)

    tokenizer = load_tokenizer(args.model_name_or_path, add_eot_token=args.add_eot_token,
                               eot_token=args.eot_token)
    data = load_step_data(args, tokenizer, 1, sft_only_data_path=args.sft_only_data_path)
    ds_config = train_ds_config(
        zero_stage=args.zero_stage, dtype=args.dtype, micro_batch_size=args.per_device_train_batch_size,
        gradient_accumulation_steps=args.gradient_accumulation_steps, **offload_options(args),
        enable_tensorboard=False)
    engine = build_lm_engine(args, tokenizer, ds_config, data.total_steps)
    run = start_run(args, engine, device, ds_config=ds_config, train_rows=len(data.train), eval_rows=len(data.eval))

    def run_eval(step: int, epoch: int | None) -> dict:
        result = evaluate_lm(engine, data.eval_loader, device, args.eval_iters)
        when = "before training" if step == 0 else f"epoch {epoch}" if epoch is not None else f"step {step}"
        print_rank_0(f"{when}: eval loss {result['loss']:.4f}, perplexity {result['ppl']:.3f}")
        run.metrics.log(step, {"eval/loss": result["loss"], "eval/ppl": result["ppl"],
                               **({"train/epoch": epoch} if epoch is not None else {})})
        return result

    def one_step(group, step):
        return sft_train_step(engine, group, device, args.gradient_accumulation_steps, world, run.guard, step), None

    result, save = run.train(desc="step 1 (SFT)", engine=engine, data=data, args=args, device=device,
                             train_step=one_step, run_eval=run_eval)
    run.finish(lambda: save_hf_format(engine, tokenizer, args.output_dir, rank=get_rank()), save,
               args.output_dir, result, engine)
    print_rank_0(f"saved the model to {args.output_dir}")


if __name__ == "__main__":
    main_guard(main)

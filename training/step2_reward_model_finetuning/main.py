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
import json

import torch

from dschat.cli import flags
from dschat.cli.validate import validate_step2
from dschat.data import DataCollatorReward, create_prompt_dataset
from dschat.engine.config import train_ds_config
from dschat.engine.train_loop import finish, train_epochs
from dschat.engine.train_utils import abandon_accumulation, make_loader, to_device
from dschat.engine.zero import release_prefetched
from dschat.models.lora import apply_lora
from dschat.models.model_utils import load_tokenizer, train_engine
from dschat.models.reward_model import create_reward_model, save_reward_model
from dschat.utils.checkpoint import Checkpointer, NonFiniteGuard
from dschat.utils.dist import all_reduce_sum, get_rank, get_world_size, init_distributed
from dschat.utils.logging import print_rank_0
from dschat.utils.metrics import metrics_logger_for
from dschat.utils.run import main_guard, resolved_config, set_seed


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
                                num_padding_at_beginning=args.num_padding_at_beginning)
    model.rwtransformer = apply_lora(model.rwtransformer, args.lora_dim, args.lora_module_name,
                                     args.only_optimize_lora)
    if args.gradient_checkpointing:
        model.gradient_checkpointing_enable()
    return train_engine(model, args, ds_config, num_update_steps)


def train_step(engine, group, device, world: int, guard: NonFiniteGuard, step: int) -> float | None:
    """One optimizer step over `group` micro-batches; the mean pair loss over ranks.
    A non-finite loss on any rank skips the whole update on every rank (None)."""
    engine.train()  # every step: a resumed run skips the first eval, and from_pretrained models start in eval
    loss = torch.zeros((), device=device)
    for i, batch in enumerate(group):
        batch = to_device(batch, device)
        out = engine(batch["input_ids"], batch["attention_mask"])
        if not guard.ok("loss", step, out["loss"], micro=i):
            abandon_accumulation(engine)
            return None
        engine.backward(out["loss"])
        engine.step()
        loss += out["loss"].detach().float() / len(group)
    return (all_reduce_sum(loss) / world).item()


@torch.no_grad()
def evaluate(engine, loader, device, max_batches: int) -> dict:
    """Accuracy (chosen score > rejected score) and mean scores over all ranks."""
    engine.eval()
    totals = torch.zeros(4, device=device)  # correct, pairs, chosen sum, rejected sum
    for i, batch in enumerate(loader):
        if i >= max_batches:
            break
        batch = to_device(batch, device)
        out = engine(batch["input_ids"], batch["attention_mask"])
        chosen, rejected = out["chosen_mean_scores"].float(), out["rejected_mean_scores"].float()
        totals += torch.stack([(chosen > rejected).sum().float(), torch.tensor(float(chosen.numel()), device=device),
                               chosen.sum(), rejected.sum()])
    totals = all_reduce_sum(totals)
    release_prefetched(engine)  # nothing left in flight for a save or the next gather
    engine.train()
    pairs = totals[1].clamp(min=1)
    return {"acc": (totals[0] / pairs).item(), "chosen_score": (totals[2] / pairs).item(),
            "rejected_score": (totals[3] / pairs).item()}


def main(argv=None):
    args = parse_args(argv)
    validate_step2(args)
    device = init_distributed(args.local_rank)
    world = get_world_size()
    set_seed(args.seed)

    tokenizer = load_tokenizer(args.model_name_or_path, add_eot_token=args.add_eot_token,
                               eot_token=args.eot_token)
    train_data, eval_data = create_prompt_dataset(
        args.local_rank, args.data_path, args.data_split, args.data_output_path, 2, args.seed,
        tokenizer, args.max_seq_len, end_of_conversation_token=args.eot_token if args.add_eot_token else None,
        chat_template=args.chat_template)
    collator = DataCollatorReward()
    train_loader = make_loader(train_data, args.per_device_train_batch_size, collator, shuffle=True, seed=args.seed)
    eval_loader = make_loader(eval_data, args.per_device_eval_batch_size, collator, shuffle=False, seed=args.seed)
    steps_per_epoch = -(-len(train_loader) // args.gradient_accumulation_steps)
    total_steps = steps_per_epoch * args.num_train_epochs
    if args.max_steps:
        total_steps = min(total_steps, args.max_steps)

    ds_config = train_ds_config(
        zero_stage=args.zero_stage, dtype=args.dtype, micro_batch_size=args.per_device_train_batch_size,
        gradient_accumulation_steps=args.gradient_accumulation_steps, offload=args.offload)
    engine = build_engine(args, tokenizer, ds_config, total_steps)
    run_config = resolved_config(args, ds_config=ds_config, world_size=world,
                                 train_pairs=len(train_data), eval_pairs=len(eval_data))
    print_rank_0("resolved configuration:\n" + json.dumps(run_config, indent=1, sort_keys=True, default=str))

    ckpt = Checkpointer(args.output_dir, args.save_interval, args.keep_last, engines={"model": engine})
    guard = NonFiniteGuard(args.max_nonfinite_in_a_row, device)
    resumed = ckpt.resume_or_start(args.resume, run_config, guard)
    metrics = metrics_logger_for(args, run_config)

    def run_eval(step: int, epoch: int | None) -> dict:
        result = evaluate(engine, eval_loader, device, args.eval_iters)
        print_rank_0(f"step {step}: eval accuracy {result['acc']:.4f}, chosen {result['chosen_score']:.4f}, "
                     f"rejected {result['rejected_score']:.4f}")
        metrics.log(step, {f"eval/{k}": v for k, v in result.items()})
        return result

    result, save = train_epochs(
        desc="step 2 (reward model)", engine=engine, loader=train_loader, ckpt=ckpt, resumed=resumed, guard=guard,
        metrics=metrics, device=device, run_config=run_config, total_steps=total_steps,
        num_epochs=args.num_train_epochs, accumulation=args.gradient_accumulation_steps,
        eval_interval=args.eval_interval, print_loss=args.print_loss,
        train_step=lambda group, step: (train_step(engine, group, device, world, guard, step), None),
        run_eval=run_eval)
    finish(ckpt, lambda: save_reward_model(engine, tokenizer, args.output_dir, rank=get_rank()), save,
           args.output_dir, run_config, result, metrics)
    print_rank_0(f"saved the reward model to {args.output_dir}")


if __name__ == "__main__":
    main_guard(main)

#!/usr/bin/env python
"""Step 3: PPO of the step-1 actor against the step-2 reward model.

    deepspeed training/step3_rlhf_finetuning/main.py \
        --actor_model_name_or_path output/step1 --critic_model_name_or_path output/step2 \
        --actor_zero_stage 3 --critic_zero_stage 3 --enable_hybrid_engine --dtype fp32 \
        --output_dir output/step3

`--enable_hybrid_engine` is this project's own engine (dschat/rollout/hybrid.py), not
DeepSpeed's `hybrid_engine` block: the actor's ZeRO-3 shards are gathered once per
rollout into a persistent inference replica by the shared gather scheduler, generation
runs on the replica, and training goes on with ZeRO's own hooks. Writes actor/, critic/
(and actor_ema/) under --output_dir, with metrics.jsonl and the resolved configuration.

metrics.jsonl splits each step into phases (rank 0's): time/<phase>_s for gen, score_actor,
score_ref, score_reward (reward model and/or --reward_fn), score_critic, actor_fwd /
actor_bwd / actor_step, critic_fwd / critic_bwd / critic_step and ptx_fwd / ptx_bwd /
ptx_step, each only where it ran (no critic_* for critic-free algorithms), summed over the
step's PPO micro-batches and epochs; on CUDA synchronized at each phase's ends, plus
memory/<phase>_peak_gib, the most memory allocated inside the phase (CPU runs: seconds only).
The coarse time/generate_s, time/score_s and time/train_s stay as before.

Critic-free RL (no critic engine, optimizer or critic/ folder), e.g. GRPO on a verifiable task:

    deepspeed training/step3_rlhf_finetuning/main.py --algorithm grpo --n_samples_per_prompt 8 \
        --reward_fn dschat/tasks/arithmetic.py:exact_match_reward --temperature 1.0 \
        --actor_model_name_or_path output/step1 --data_path data/arith --actor_zero_stage 3 \
        --enable_hybrid_engine --output_dir output/grpo

`--save_interval N` (PPO steps) writes resumable checkpoints under --output_dir/checkpoints/
(actor, critic, EMA, data position, RNGs incl. the sampling generator); `--resume` continues
from the newest complete one.
"""
import argparse

from dschat.cli import flags
from dschat.cli.validate import validate_step3
from dschat.rlhf.loop import train_step3
from dschat.utils.run import main_guard


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    flags.add_step3_args(p)
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    validate_step3(args)
    train_step3(args)


if __name__ == "__main__":
    main_guard(main)

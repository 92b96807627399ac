#!/usr/bin/env bash
# Step 3 (PPO) with a Bloom actor and critic, ZeRO-3 and our hybrid engine. Defaults: the
# step-1 and step-2 demo outputs (built first if absent) on the bundled data, on CPU.
# For a real run:
#   ACTOR=out/step1 CRITIC=out/step2 NUM_GPUS=8 OUTPUT=out/step3 bash scripts/run_step3_bloom.sh
#   HOSTFILE=hostfile ACTOR=... CRITIC=... bash scripts/run_step3_bloom.sh   # several nodes
set -euo pipefail
source "$(dirname "$0")/common.sh"
if [ -z "${ACTOR:-}" ]; then
  ACTOR=$DEMO_DIR/step1
  [ -f "$ACTOR/model.safetensors" ] || OUTPUT=$ACTOR bash "$ROOT/scripts/run_step1_bloom.sh"
fi
if [ -z "${CRITIC:-}" ]; then
  CRITIC=$DEMO_DIR/step2
  [ -f "$CRITIC/reward_model.json" ] || OUTPUT=$CRITIC MODEL=$ACTOR bash "$ROOT/scripts/run_step2_bloom.sh"
fi
OUTPUT=${OUTPUT:-$DEMO_DIR/step3}
if [ "$ON_GPU" = 1 ]; then DEFAULTS=(--per_device_generation_batch_size 16 --per_device_training_batch_size 16 --max_prompt_seq_len 256 --max_answer_seq_len 256 --actor_learning_rate 9.65e-6 --critic_learning_rate 5e-6 --actor_gradient_checkpointing)
else DEFAULTS=(--per_device_generation_batch_size 8 --per_device_training_batch_size 8 --max_prompt_seq_len 32 --max_answer_seq_len 24 --actor_learning_rate 2e-5 --critic_learning_rate 5e-5 --num_warmup_steps 2 --max_steps 20); fi
launch training/step3_rlhf_finetuning/main.py --actor_model_name_or_path "$ACTOR" --critic_model_name_or_path "$CRITIC" \
  --data_path $DATA_PATH --data_split "$DATA_SPLIT" --data_output_path "$DATA_CACHE" \
  --actor_zero_stage 3 --critic_zero_stage 3 --enable_hybrid_engine --dtype "$DTYPE" \
  --output_dir "$OUTPUT" --seed 1234 --dump_generations "$OUTPUT/generations.jsonl" "${DEFAULTS[@]}" "$@"

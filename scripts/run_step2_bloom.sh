#!/usr/bin/env bash
# Step 2 (reward model) on a Bloom backbone. Defaults: the step-1 demo output (built first if
# absent) on the bundled data, on CPU. For a real run:
#   MODEL=bigscience/bloom-560m NUM_GPUS=8 OUTPUT=out/step2 bash scripts/run_step2_bloom.sh
set -euo pipefail
source "$(dirname "$0")/common.sh"
if [ -z "${MODEL:-}" ]; then
  MODEL=$DEMO_DIR/step1
  [ -f "$MODEL/model.safetensors" ] || OUTPUT=$MODEL bash "$ROOT/scripts/run_step1_bloom.sh"
fi
OUTPUT=${OUTPUT:-$DEMO_DIR/step2}
ZERO_STAGE=${ZERO_STAGE:-3}
if [ "$ON_GPU" = 1 ]; then DEFAULTS=(--max_seq_len 512 --per_device_train_batch_size 8 --num_train_epochs 1 --learning_rate 5e-5)
else DEFAULTS=(--max_seq_len 64 --per_device_train_batch_size 16 --num_train_epochs 3 --learning_rate 5e-4 --num_warmup_steps 5 --eval_interval 25); fi
launch training/step2_reward_model_finetuning/main.py --model_name_or_path "$MODEL" \
  --data_path $DATA_PATH --data_split "$DATA_SPLIT" --data_output_path "$DATA_CACHE" \
  --zero_stage "$ZERO_STAGE" --dtype "$DTYPE" --output_dir "$OUTPUT" --seed 1234 "${DEFAULTS[@]}" "$@"

#!/usr/bin/env bash
# Step 1 (SFT) of a Bloom model. Defaults: the tiny demo Bloom on the bundled data, on CPU
# (2 ranks, ZeRO-3, fp32). For a real run:
#   MODEL=bigscience/bloom-560m NUM_GPUS=8 OUTPUT=out/step1 bash scripts/run_step1_bloom.sh --per_device_train_batch_size 8
# Extra arguments are passed to training/step1_supervised_finetuning/main.py.
set -euo pipefail
source "$(dirname "$0")/common.sh"
MODEL=${MODEL:-configs/tiny/bloom.json}
OUTPUT=${OUTPUT:-$DEMO_DIR/step1}
ZERO_STAGE=${ZERO_STAGE:-3}
if [ "$ON_GPU" = 1 ]; then DEFAULTS=(--max_seq_len 512 --per_device_train_batch_size 8 --num_train_epochs 1 --learning_rate 9.65e-6 --gradient_checkpointing)
else DEFAULTS=(--max_seq_len 64 --per_device_train_batch_size 16 --num_train_epochs 4 --learning_rate 2e-3 --num_warmup_steps 10); fi
launch training/step1_supervised_finetuning/main.py --model_name_or_path "$MODEL" \
  --data_path $DATA_PATH --data_split "$DATA_SPLIT" --data_output_path "$DATA_CACHE" \
  --zero_stage "$ZERO_STAGE" --dtype "$DTYPE" --output_dir "$OUTPUT" --seed 1234 "${DEFAULTS[@]}" "$@"

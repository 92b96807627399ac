#!/usr/bin/env bash
# Step 2 DPO (instead of step 2 + step 3) on a Bloom policy: the step-1 demo output (built
# first if absent) against a frozen copy of itself, on the bundled pairs, on CPU. For a real run:
#   MODEL=out/step1 NUM_GPUS=8 OUTPUT=out/step2_dpo bash scripts/run_step2_dpo_bloom.sh
# Extra flags go to main.py, e.g. --beta 0.2 --loss_type ipo --rpo_alpha 0.5 --lora_dim 64.
set -euo pipefail
source "$(dirname "$0")/common.sh"
if [ -z "${MODEL:-}" ]; then
  MODEL=$DEMO_DIR/step1
  [ -f "$MODEL/model.safetensors" ] || OUTPUT=$MODEL bash "$ROOT/scripts/run_step1_bloom.sh"
fi
OUTPUT=${OUTPUT:-$DEMO_DIR/step2_dpo}
ZERO_STAGE=${ZERO_STAGE:-3}
# GPU: upstream's DPO settings (opt-350m script: lr 5e-5, weight decay 0.1, dropout 0)
if [ "$ON_GPU" = 1 ]; then DEFAULTS=(--max_seq_len 512 --per_device_train_batch_size 4 --per_device_eval_batch_size 4 --num_train_epochs 1 --learning_rate 5e-5 --weight_decay 0.1 --dropout 0.0)
else DEFAULTS=(--max_seq_len 64 --per_device_train_batch_size 8 --num_train_epochs 1 --learning_rate 5e-4 --num_warmup_steps 5 --eval_interval 25 --dropout 0.0); fi
launch training/step2_dpo_finetuning/main.py --model_name_or_path "$MODEL" \
  --data_path $DATA_PATH --data_split "$DATA_SPLIT" --data_output_path "$DATA_CACHE" \
  --zero_stage "$ZERO_STAGE" --dtype "$DTYPE" --output_dir "$OUTPUT" --seed 1234 --beta 0.1 "${DEFAULTS[@]}" "$@"

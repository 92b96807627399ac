#!/usr/bin/env bash
# Run this first with a model of your own: a few steps of each of steps 1-3 at ZeRO-3 on
# your model and data, each saved model reloaded with plain from_pretrained (prompt_eval.py
# answers with the SFT and the PPO actor and scores them with the reward model). Minutes on
# 2 CPU ranks for a 135M model; what breaks here would break at the end of a long run.
#   MODEL=/path/to/hf-model DATA=/path/to/pairs.jsonl bash scripts/smoke_model.sh
# DATA: DS-Chat-format pairs (prompt/chosen/rejected, or HH chosen/rejected); default the
# bundled demo data. OUTPUT (default output/smoke) is replaced; step 3's answers are in
# OUTPUT/step3/generations.jsonl. Extra arguments go to all three steps (e.g. --chat_template none).
set -euo pipefail
source "$(dirname "$0")/common.sh"
MODEL=${MODEL:?set MODEL to a model folder (or hub name)}
DATA=${DATA:-$DATA_PATH}
OUTPUT=${OUTPUT:-$ROOT/output/smoke}
STEPS=${STEPS:-3}
rm -rf "$OUTPUT"
COMMON=(--data_path "$DATA" --data_split 4,4,2 --data_output_path "$OUTPUT/data_cache" --seed 1234 --dtype "$DTYPE")
launch training/step1_supervised_finetuning/main.py --model_name_or_path "$MODEL" "${COMMON[@]}" \
  --zero_stage 3 --max_seq_len 128 --per_device_train_batch_size 2 --max_steps "$STEPS" --eval_iters 2 \
  --learning_rate 1e-5 --num_warmup_steps 0 --save_interval 2 --output_dir "$OUTPUT/step1" "$@"
launch training/step2_reward_model_finetuning/main.py --model_name_or_path "$OUTPUT/step1" "${COMMON[@]}" \
  --zero_stage 3 --max_seq_len 128 --per_device_train_batch_size 2 --max_steps "$STEPS" --eval_iters 2 \
  --learning_rate 1e-5 --num_warmup_steps 0 --save_interval 2 --output_dir "$OUTPUT/step2" "$@"
launch training/step3_rlhf_finetuning/main.py --actor_model_name_or_path "$OUTPUT/step1" \
  --critic_model_name_or_path "$OUTPUT/step2" "${COMMON[@]}" --actor_zero_stage 3 --critic_zero_stage 3 \
  --enable_hybrid_engine --enable_ema --per_device_generation_batch_size 2 --per_device_training_batch_size 2 \
  --max_prompt_seq_len 96 --max_answer_seq_len 32 --max_steps "$STEPS" --num_warmup_steps 0 \
  --save_interval 1 --dump_generations "$OUTPUT/step3/generations.jsonl" --output_dir "$OUTPUT/step3" "$@"
(cd "$ROOT" && python3 inference/prompt_eval.py --baseline "$OUTPUT/step1" --finetune "$OUTPUT/step3/actor" \
  --reward_model "$OUTPUT/step2" --data_path "$DATA" --data_split 4,4,2 --num_prompts 4 --max_new_tokens 32)
python3 - "$OUTPUT/step3/actor_ema" <<'EOF'
import sys
from transformers import AutoModelForCausalLM
AutoModelForCausalLM.from_pretrained(sys.argv[1])
print(f"reloaded {sys.argv[1]}")
EOF
echo "smoke run passed: $OUTPUT/{step1,step2,step3/actor,step3/critic,step3/actor_ema} saved and reloaded"

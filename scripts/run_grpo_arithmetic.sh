#!/usr/bin/env bash
# Critic-free RL (GRPO) on verifiable arithmetic word problems: no reward model, no critic, the
# reward is dschat/tasks/arithmetic.py:exact_match_reward against each row's "answer". Actor at
# ZeRO-3 with our hybrid engine; bf16 on GPU. Then the greedy exact-match accuracy on DATA/eval.jsonl.
#   MODEL=out/step1 DATA=data/arith OUTPUT=out/grpo bash scripts/run_grpo_arithmetic.sh   # one GPU
#   python -m dschat.tasks.arithmetic make --out data/arith --train 5000 --eval 500      # DATA
# On CPU the defaults are tiny and short (a random tiny OPT from configs/tiny/opt.json, 4 steps):
# it shows the pipeline end to end, not learning. Extra arguments go to step 3.
set -euo pipefail
source "$(dirname "$0")/common.sh"
export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}   # dschat importable without an install
OUTPUT=${OUTPUT:-$DEMO_DIR/grpo_arithmetic}
if [ "$ON_GPU" = 1 ]; then
  NUM_GPUS=${NUM_GPUS_GRPO:-1}
  MODEL=${MODEL:?set MODEL to a causal-LM folder (a step-1 output or an instruct model)}
  DEFAULTS=(--n_samples_per_prompt 8 --per_device_generation_batch_size 64 --per_device_training_batch_size 16
            --max_prompt_seq_len 256 --max_answer_seq_len 256 --actor_learning_rate 1e-6 --kl_ctl 0.04
            --num_warmup_steps 10 --temperature 1.0 --actor_gradient_checkpointing --save_interval 50)
  EVAL_ARGS=(--max_new_tokens 256)
else
  MODEL=${MODEL:-$ROOT/configs/tiny/opt.json}
  DEFAULTS=(--n_samples_per_prompt 4 --per_device_generation_batch_size 8 --per_device_training_batch_size 4
            --max_prompt_seq_len 128 --max_answer_seq_len 16 --actor_learning_rate 1e-4 --num_warmup_steps 0
            --temperature 1.0 --max_steps 4)
  EVAL_ARGS=(--max_new_tokens 16 --limit 32 --device cpu)
fi
if [ -z "${DATA:-}" ]; then
  DATA=$DEMO_DIR/arith
  [ -f "$DATA/train.jsonl" ] || (cd "$ROOT" && python3 -m dschat.tasks.arithmetic make --out "$DATA" --train 2000 --eval 200 --difficulty 1)
fi
launch training/step3_rlhf_finetuning/main.py --algorithm grpo --actor_model_name_or_path "$MODEL" \
  --reward_fn dschat/tasks/arithmetic.py:exact_match_reward \
  --data_path "$DATA" --data_split 0,0,1 --data_output_path "$DATA_CACHE" \
  --actor_zero_stage 3 --enable_hybrid_engine --dtype "$DTYPE" \
  --output_dir "$OUTPUT" --seed 1234 --dump_generations "$OUTPUT/generations.jsonl" "${DEFAULTS[@]}" "$@"
if [ "${EVAL:-1}" = 1 ]; then
  (cd "$ROOT" && python3 -m dschat.tasks.arithmetic eval --model "$OUTPUT/actor" --data "$DATA/eval.jsonl" \
    --jsonl "$OUTPUT/arithmetic_eval.jsonl" "${EVAL_ARGS[@]}")
fi

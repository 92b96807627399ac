#!/usr/bin/env bash
# Which RL algorithm teaches a real instruct model verifiable arithmetic best: held-out exact
# match before and after step 3 with grpo, Dr.GRPO, rloo, reinforce_pp and ppo, the same number
# of sampled answers each, several seeds (one GPU; several runs share it at once).
#
#   MODEL=/path/to/SmolLM2-135M-Instruct bash scripts/run_arithmetic_learning.sh
#
# 1. A short SFT (step 1) on worked solutions at difficulties 1-6 teaches the answer format
#    ("#### N"); a 135M instruct model hardly ever writes it on its own.
# 2. The SFT model is scored on a held-out probe of every difficulty; the task's difficulty is
#    the one where it answers 10-40% correctly, else the narrowest mix of consecutive ones
#    expected to ("1-2"; `python -m dschat.tasks.arithmetic pick`; DIFFICULTY= sets it instead).
# 3. Step 3 per algorithm and seed from the SFT model, rewards from
#    dschat/tasks/arithmetic.py:exact_match_reward only (ppo's critic starts from the SFT model),
#    then greedy exact match on held-out problems of that difficulty.
# 4. OUT/table.md and OUT/curves.png (applications/compare_arithmetic.py).
# A run whose arithmetic_eval.json exists is skipped: running again continues where it stopped.
#   ALGOS="grpo drgrpo rloo reinforce_pp ppo"  SEEDS="1 2 3"  PARALLEL=5 (about 16-19 GiB of GPU each)  STEPS=80
#   (drgrpo_bf16state: Dr.GRPO with --optimizer_dtype bf16, for DTYPE=bf16)
#   GROUP=8 (answers per prompt)  ANSWERS=64 (sampled answers per step, every algorithm)  LR=2e-5
set -euo pipefail
source "$(dirname "$0")/common.sh"
export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}
: "${MODEL:?set MODEL to a causal-LM folder (SmolLM2-135M-Instruct)}"
OUT=${OUT:-$ROOT/output/arith-learning}
ALGOS=${ALGOS:-grpo drgrpo rloo reinforce_pp ppo}
SEEDS=${SEEDS:-1 2 3}
PARALLEL=${PARALLEL:-4}
STEPS=${STEPS:-80}
GROUP=${GROUP:-8}
ANSWERS=${ANSWERS:-64}
LR=${LR:-2e-5}
TRAIN_MB=$(( ANSWERS < 32 ? ANSWERS : 32 ))   # PPO micro-batch
KL_CTL=${KL_CTL:-0.01}
MAX_ANSWER=${MAX_ANSWER:-192}
PORT_BASE=${PORT_BASE:-29700}
mkdir -p "$OUT"
arith() { (cd "$ROOT" && python3 -m dschat.tasks.arithmetic "$@"); }

# 1. SFT on the format (train side, data seed 1); its probe and the RL data use other seeds
[ -f "$OUT/sft_data/train.jsonl" ] || arith make --out "$OUT/sft_data" --train 1000 --eval 600 --difficulty 1-6 --seed 1
if [ ! -f "$OUT/sft/config.json" ]; then
  MASTER_PORT=$PORT_BASE launch training/step1_supervised_finetuning/main.py --model_name_or_path "$MODEL" \
    --data_path "$OUT/sft_data" --data_split 1,0,0 --data_output_path "$OUT/data_cache/sft" \
    --per_device_train_batch_size 16 --max_seq_len 384 --learning_rate "${SFT_LR:-2e-5}" --num_train_epochs 1 \
    --num_warmup_steps 5 --zero_stage 3 --dtype "$DTYPE" --seed 1234 --output_dir "$OUT/sft" \
    > "$OUT/sft.log" 2>&1
fi

# 2. the task's difficulty: where the SFT model starts at 10-40%
[ -f "$OUT/sft/probe.json" ] || arith eval --model "$OUT/sft" --data "$OUT/sft_data/eval.jsonl" \
  --max_new_tokens "$MAX_ANSWER" --batch_size 128 --summary "$OUT/sft/probe.json" --jsonl "$OUT/sft/probe.jsonl" \
  > "$OUT/sft/probe.log" 2>&1
DIFFICULTY=${DIFFICULTY:-$(arith pick --summary "$OUT/sft/probe.json" --low 0.1 --high 0.4)}
DATA=$OUT/data-d$DIFFICULTY
[ -f "$DATA/train.jsonl" ] || arith make --out "$DATA" --train 3000 --eval 500 --difficulty "$DIFFICULTY" --seed 2
[ -f "$OUT/sft/eval_d$DIFFICULTY.json" ] || arith eval --model "$OUT/sft" --data "$DATA/eval.jsonl" \
  --max_new_tokens "$MAX_ANSWER" --batch_size 128 --summary "$OUT/sft/eval_d$DIFFICULTY.json" \
  --jsonl "$OUT/sft/eval_d$DIFFICULTY.jsonl" > "$OUT/sft/eval_d$DIFFICULTY.log" 2>&1
echo "difficulty $DIFFICULTY: SFT model $(python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['accuracy'])" \
  "$OUT/sft/eval_d$DIFFICULTY.json") exact match on $DATA/eval.jsonl"

# 3. step 3 per algorithm and seed, PARALLEL at once
algo_flags() {
  case $1 in
    grpo)         echo "--algorithm grpo --n_samples_per_prompt $GROUP" ;;
    drgrpo)       echo "--algorithm grpo --n_samples_per_prompt $GROUP --no_std_norm --loss_agg seq_mean_token_sum_norm" ;;
    # the same with bf16 optimizer state (DTYPE=bf16): does it learn as fp32 state does
    drgrpo_bf16state) echo "$(algo_flags drgrpo) --optimizer_dtype bf16" ;;
    rloo)         echo "--algorithm rloo --n_samples_per_prompt $GROUP" ;;
    reinforce_pp) echo "--algorithm reinforce_pp --n_samples_per_prompt $GROUP" ;;
    ppo)          echo "--algorithm ppo --n_samples_per_prompt 1 --critic_model_name_or_path $OUT/sft --reward_weights 0,1 \
                        --critic_zero_stage 3 --critic_learning_rate ${CRITIC_LR:-2e-5}" ;;
    *) echo "unknown algorithm $1 (grpo drgrpo drgrpo_bf16state rloo reinforce_pp ppo)" >&2; return 2 ;;
  esac
}
# --num_train_epochs 100: passes enough over the prompts that --max_steps ends every run (ppo takes
# 64 prompts a step, the group algorithms 8)
one_run() {  # one_run ALGO SEED PORT
  local run=$OUT/runs/$1-seed$2
  [ -f "$run/arithmetic_eval.json" ] && return 0
  mkdir -p "$run"
  # shellcheck disable=SC2046
  MASTER_PORT=$3 launch training/step3_rlhf_finetuning/main.py --actor_model_name_or_path "$OUT/sft" \
    --reward_fn dschat/tasks/arithmetic.py:exact_match_reward $(algo_flags "$1") \
    --data_path "$DATA" --data_split 0,0,1 --data_output_path "$OUT/data_cache/d$DIFFICULTY" \
    --actor_zero_stage 3 --enable_hybrid_engine --dtype "$DTYPE" \
    --per_device_generation_batch_size "$ANSWERS" --per_device_training_batch_size "$TRAIN_MB" \
    --max_prompt_seq_len 256 --max_answer_seq_len "$MAX_ANSWER" --temperature 1.0 \
    --actor_learning_rate "$LR" --kl_ctl "$KL_CTL" --num_warmup_steps 5 --max_steps "$STEPS" \
    --num_train_epochs 100 \
    --seed "$2" --output_dir "$run" --dump_generations "$run/generations.jsonl" > "$run/train.log" 2>&1 &&
  arith eval --model "$run/actor" --data "$DATA/eval.jsonl" --max_new_tokens "$MAX_ANSWER" --batch_size 128 \
    --summary "$run/arithmetic_eval.json.tmp" --jsonl "$run/arithmetic_eval.jsonl" > "$run/eval.log" 2>&1 &&
  mv "$run/arithmetic_eval.json.tmp" "$run/arithmetic_eval.json"
}
read -r -a algos <<< "$ALGOS"
read -r -a seeds <<< "$SEEDS"
runs=() n=0
for seed in "${seeds[@]}"; do
  for algo in "${algos[@]}"; do
    algo_flags "$algo" > /dev/null
    runs+=("$OUT/runs/$algo-seed$seed")
    wait_below "$PARALLEL"
    n=$((n + 1))
    one_run "$algo" "$seed" $((PORT_BASE + n)) &
  done
done
wait_below 1
[ "$failed" = 0 ] || echo "$failed run(s) failed: see OUT/runs/*/train.log and eval.log" >&2

# 4. the table and the curves
python3 "$ROOT/applications/compare_arithmetic.py" "${runs[@]}" --start "$OUT/sft/eval_d$DIFFICULTY.json" \
  --out "$OUT/table.md" --plot "$OUT/curves.png"

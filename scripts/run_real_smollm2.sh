#!/usr/bin/env bash
# SmolLM2-135M-Instruct through SFT -> reward model -> PPO on HH-RLHF harmless-base, judged on
# held-out prompts by a second reward model PPO never sees (configs/presets/smollm2-135m.json):
# one GPU, ZeRO-3, our hybrid engine.
#
#   MODEL=/path/to/SmolLM2-135M-Instruct DATA=/path/to/harmless-base-test.jsonl.gz bash scripts/run_real_smollm2.sh
#
# Steps 1-2 (SFT, the policy and the judge reward models) run once, with the first seed; every
# seed in SEEDS and every point of SWEEP reuses them (linked, not retrained) and runs step 3 and
# the held-out evaluation, PARALLEL runs at once (a 135M model leaves most of a GPU idle).
# SWEEP holds "name|step-3 flags" entries, each run at the first seed. The last lines print the
# table of all runs (applications/compare_runs.py). A run whose report.json exists is skipped,
# so running the script again continues where it stopped; each run logs to OUT/<run>.log.
#   SEEDS="1234 1235 1236"  SWEEP="kl0.05|--kl_ctl 0.05;lr1e-5|--actor_learning_rate 1e-5"
#   PARALLEL=1  OUT=output/real-smollm2  DEPLOYMENT=single_gpu (cpu: a few steps each, a smoke test)
#   STEP2_ARGS="--learning_rate 1e-4"  (both reward models)  STEP3_ARGS="--actor_learning_rate 1e-5"  (every step-3 run)
set -euo pipefail
source "$(dirname "$0")/common.sh"
: "${MODEL:?set MODEL to a SmolLM2-135M-Instruct folder}"
: "${DATA:?set DATA to HH-RLHF harmless-base preference pairs (a jsonl[.gz] file or folder)}"
OUT=${OUT:-$ROOT/output/real-smollm2}
SEEDS=${SEEDS:-1234 1235 1236}
SWEEP=${SWEEP:-}
STEP2_ARGS=${STEP2_ARGS:-}
STEP3_ARGS=${STEP3_ARGS:-}
DEPLOYMENT=${DEPLOYMENT:-single_gpu}
PARALLEL=${PARALLEL:-1}
read -r -a seeds <<< "$SEEDS"
first=${seeds[0]}
e2e() {  # a run whose report exists is done (rerunning the script continues where it stopped)
  local dir=$2
  [ -f "$dir/report.json" ] && { echo "==> $dir: done"; return 0; }
  python3 "$ROOT/applications/e2e_rlhf.py" --preset smollm2-135m --model "$MODEL" --data-path "$DATA" \
    --deployment-type "$DEPLOYMENT" "$@"
}
reuse() {  # a run folder sharing the first run's data, SFT model and both reward models
  mkdir -p "$1"
  [ "$1" = "$OUT/seed$first" ] && return 0
  for part in data data_cache step1 step2 step2_judge; do
    [ -e "$1/$part" ] || ln -s "$OUT/seed$first/$part" "$1/$part"
  done
}

# steps 1-2 once (the first seed's), then every step-3 run (seeds, sweep points), PARALLEL at once
e2e --output-dir "$OUT/seed$first" --seed "$first" --step 1 2 --no-report ${STEP2_ARGS:+--step2-args "$STEP2_ARGS"}
step3_run() {  # step3_run FOLDER SEED [STEP-3 FLAGS]: step 3, the held-out evaluation, the report
  reuse "$1"
  local flags="$STEP3_ARGS${3:+ $3}"
  e2e --output-dir "$1" --seed "$2" --step 3 ${flags:+--step3-args "$flags"} > "$1.log" 2>&1
}
runs=()
queue() {
  wait_below "$PARALLEL"
  runs+=("$1")
  step3_run "$@" &
}
for seed in "${seeds[@]}"; do queue "$OUT/seed$seed" "$seed"; done
IFS=';' read -r -a points <<< "$SWEEP"
for point in "${points[@]}"; do
  name=${point%%|*}; flags=${point#*|}
  queue "$OUT/$name-seed$first" "$first" "$flags"
done
wait_below 1
[ "$failed" = 0 ] || echo "$failed step-3 run(s) failed: see OUT/<run>.log" >&2
python3 "$ROOT/applications/compare_runs.py" "${runs[@]}" --out "$OUT/runs.md" --plot "$OUT/runs.png"

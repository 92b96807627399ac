#!/usr/bin/env bash
# Steps 1-3 of a Bloom model in one command (applications/e2e_rlhf.py), then the report.
# Defaults: the CPU demo (tiny Bloom, bundled data, 2 CPU ranks, ~5 minutes) -> output/e2e-demo.
# A real run: a preset name or a model folder, and the GPU count, e.g.
#   ACTOR=bloom-1b7 NUM_GPUS=8 OUTPUT=out/bloom-1b7 bash scripts/run_e2e_bloom.sh
#   ACTOR=/models/bloom-7b1 ACTOR_PRESET=bloom-7b1 REWARD=/models/bloom-560m NUM_GPUS=8 bash scripts/run_e2e_bloom.sh
#   ACTOR=bloom-560m NUM_GPUS=1 bash scripts/run_e2e_bloom.sh --random-init --step1-args='--max_steps 10'
# Variables (all optional): ACTOR, REWARD (preset, folder, or step1), ACTOR_PRESET, REWARD_PRESET,
# NUM_GPUS (1 -> single_gpu row, more -> single_node), DEPLOYMENT (overrides that choice), HOSTFILE
# (-> multi_node; see scripts/multinode_example.sh), ACTOR_ZERO_STAGE, REWARD_ZERO_STAGE, OUTPUT,
# DATA_PATH, DATA_SPLIT, STEPS ("1 2 3"). Extra arguments go to e2e_rlhf.py (see its --help).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
export HF_HUB_OFFLINE=${HF_HUB_OFFLINE:-1} HF_DATASETS_OFFLINE=${HF_DATASETS_OFFLINE:-1}
ARGS=()
[ -n "${ACTOR:-}" ] && ARGS+=(--actor-model "$ACTOR")
[ -n "${REWARD:-}" ] && ARGS+=(--reward-model "$REWARD")
[ -n "${ACTOR_PRESET:-}" ] && ARGS+=(--actor-preset "$ACTOR_PRESET")
[ -n "${REWARD_PRESET:-}" ] && ARGS+=(--reward-preset "$REWARD_PRESET")
[ -n "${NUM_GPUS:-}" ] && ARGS+=(--num-gpus "$NUM_GPUS")
if [ -n "${DEPLOYMENT:-}" ]; then ARGS+=(--deployment-type "$DEPLOYMENT")
elif [ -n "${NUM_GPUS:-}" ] && [ -z "${HOSTFILE:-}" ] && [ -n "${ACTOR:-}" ]; then
  if [ "$NUM_GPUS" = 1 ]; then ARGS+=(--deployment-type single_gpu); else ARGS+=(--deployment-type single_node); fi
fi
[ -n "${HOSTFILE:-}" ] && ARGS+=(--hostfile "$HOSTFILE")
[ -n "${ACTOR_ZERO_STAGE:-}" ] && ARGS+=(--actor-zero-stage "$ACTOR_ZERO_STAGE")
[ -n "${REWARD_ZERO_STAGE:-}" ] && ARGS+=(--reward-zero-stage "$REWARD_ZERO_STAGE")
[ -n "${OUTPUT:-}" ] && ARGS+=(--output-dir "$OUTPUT")
[ -n "${DATA_PATH:-}" ] && ARGS+=(--data-path $DATA_PATH)
[ -n "${DATA_SPLIT:-}" ] && ARGS+=(--data-split "$DATA_SPLIT")
[ -n "${STEPS:-}" ] && ARGS+=(--step $STEPS)
cd "$ROOT"
exec python3 applications/e2e_rlhf.py "${ARGS[@]}" "$@"

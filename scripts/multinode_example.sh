#!/usr/bin/env bash
# Steps 1-3 over several nodes listed in a DeepSpeed hostfile (applications/e2e_rlhf.py, preset row
# multi_node). Defaults: the demo through the multi-node launch path on this machine only
# (scripts/hostfile.example = "localhost slots=2", CPU ranks when there is no GPU).
#
# Two nodes of 8 GPUs, launched from node-0 over passwordless ssh (pdsh):
#   HOSTFILE=my_hostfile ACTOR=bloom-7b1 OUTPUT=/shared/out/bloom-7b1 bash scripts/multinode_example.sh
# Without ssh between nodes (SLURM, Kubernetes): run the same command on every node with its rank:
#   NODE_RANK=0 MASTER_ADDR=node-0 HOSTFILE=my_hostfile ACTOR=bloom-7b1 OUTPUT=/shared/out ... (node-0)
#   NODE_RANK=1 MASTER_ADDR=node-0 HOSTFILE=my_hostfile ACTOR=bloom-7b1 OUTPUT=/shared/out ... (node-1)
# Variables: HOSTFILE, ACTOR, REWARD, ACTOR_PRESET, REWARD_PRESET, NUM_GPUS (per node), NUM_NODES,
# NODE_RANK + MASTER_ADDR (no-ssh mode), MASTER_PORT, OUTPUT (shared by all nodes), NCCL_* (exported
# to every node by the launcher). Extra arguments go to e2e_rlhf.py.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
export HF_HUB_OFFLINE=${HF_HUB_OFFLINE:-1} HF_DATASETS_OFFLINE=${HF_DATASETS_OFFLINE:-1}
HOSTFILE=${HOSTFILE:-$ROOT/scripts/hostfile.example}
ARGS=(--hostfile "$HOSTFILE")
hosts=$(grep -Ev '^\s*(#|$)' "$HOSTFILE" | awk '{print $1}' | sort -u | tr '\n' ' ')
if [ -n "${NODE_RANK:-}" ]; then
  ARGS+=(--launcher-args "--no_ssh --node_rank $NODE_RANK --master_addr ${MASTER_ADDR:?set MASTER_ADDR to the first host}")
  [ -n "${MASTER_PORT:-}" ] || MASTER_PORT=29500   # every node must agree on the port
elif [ "$hosts" = "localhost " ]; then
  ARGS+=(--launcher-args "--no_ssh --node_rank 0 --master_addr 127.0.0.1")   # one local "node": no ssh needed
fi
if ! nvidia-smi -L >/dev/null 2>&1; then ARGS+=(--deployment-type cpu); else ARGS+=(--deployment-type multi_node); fi
[ -n "${MASTER_PORT:-}" ] && ARGS+=(--master-port "$MASTER_PORT")
[ -n "${ACTOR:-}" ] && ARGS+=(--actor-model "$ACTOR")
[ -n "${REWARD:-}" ] && ARGS+=(--reward-model "$REWARD")
[ -n "${ACTOR_PRESET:-}" ] && ARGS+=(--actor-preset "$ACTOR_PRESET")
[ -n "${REWARD_PRESET:-}" ] && ARGS+=(--reward-preset "$REWARD_PRESET")
[ -n "${NUM_GPUS:-}" ] && ARGS+=(--num-gpus "$NUM_GPUS")
[ -n "${NUM_NODES:-}" ] && ARGS+=(--num-nodes "$NUM_NODES")
ARGS+=(--output-dir "${OUTPUT:-$ROOT/output/e2e-multinode}")
cd "$ROOT"
exec python3 applications/e2e_rlhf.py "${ARGS[@]}" "$@"

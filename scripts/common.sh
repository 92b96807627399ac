# Shared by the run_*.sh scripts: launcher, device defaults, demo paths.
# Every variable can be overridden from the environment.
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
export HF_HUB_OFFLINE=${HF_HUB_OFFLINE:-1} HF_DATASETS_OFFLINE=${HF_DATASETS_OFFLINE:-1}
export TOKENIZERS_PARALLELISM=false WANDB_MODE=${WANDB_MODE:-offline}
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  ON_GPU=1; DTYPE=${DTYPE:-bf16}; NUM_GPUS=${NUM_GPUS:-$(nvidia-smi -L | wc -l)}
else
  ON_GPU=0; DTYPE=${DTYPE:-fp32}; NUM_GPUS=${NUM_GPUS:-2}
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
fi
DEMO_DIR=${DEMO_DIR:-$ROOT/output/demo}
DATA_PATH=${DATA_PATH:-dschat/synthetic-assistant}
DATA_SPLIT=${DATA_SPLIT:-6,3,1}
DATA_CACHE=${DATA_CACHE:-$DEMO_DIR/data_cache}
launch() {  # launch SCRIPT ARGS... through the deepspeed launcher (multi-node with HOSTFILE)
  local launcher
  if command -v deepspeed >/dev/null 2>&1; then launcher=(deepspeed); else launcher=(python3 -m deepspeed.launcher.runner); fi
  if [ -n "${HOSTFILE:-}" ]; then launcher+=(--hostfile "$HOSTFILE"); else launcher+=(--num_gpus "$NUM_GPUS"); fi
  [ -n "${MASTER_PORT:-}" ] && launcher+=(--master_port "$MASTER_PORT")
  (cd "$ROOT" && "${launcher[@]}" "$@")
}
failed=0
wait_below() {  # wait_below N: block until fewer than N background jobs run; each failed one adds 1 to $failed
  while [ "$(jobs -rp | wc -l)" -ge "$1" ]; do wait -n || failed=$((failed + 1)); done
}

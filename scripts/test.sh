#!/usr/bin/env bash
# Install what the tests need, then run the whole suite (CPU; GPU-only tests skip).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false WANDB_MODE=offline
exec ${PYTHON:-python3} -m pytest -q -ra tests "$@"

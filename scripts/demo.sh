#!/usr/bin/env bash
# Fresh machine -> the trained demo: install, then steps 1-3 (SFT, reward model, PPO) of the
# tiny Bloom on the bundled data on 2 CPU ranks under ZeRO-3 (a GPU machine uses its GPUs),
# ending with a report (output/e2e-demo/report.md). About 3 minutes on 2 cores.
# Only step 1: bash scripts/run_step1_bloom.sh
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
exec python3 applications/e2e_rlhf.py "$@"

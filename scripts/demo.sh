#!/usr/bin/env bash
# Fresh machine -> the step-1 demo: install, then SFT of the tiny Bloom on the bundled data
# on 2 CPU ranks under ZeRO-3 (a GPU machine uses its GPUs). The model lands in output/demo/step1.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
bash scripts/run_step1_bloom.sh "$@"

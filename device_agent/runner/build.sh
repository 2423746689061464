#!/usr/bin/env bash
# Builds mobizo_runner against the pinned ExecuTorch's pip wheel and prints the binary's path.
#
#   build.sh            for this machine, against the executorch installed in the Python environment (the
#                       repository's .venv unless PYTHON says otherwise), into build/. On an aarch64 Linux host
#                       (a Jetson) this is the native aarch64 build: pip installs the aarch64 wheel there.
#   build.sh --aarch64  cross-builds for aarch64 Linux on an x86-64 host, into build/aarch64-linux-gnu/, against the
#                       aarch64 wheel of the same executorch version, fetched once with `pip download` into
#                       .cache/executorch-aarch64/ and unpacked there. Needs Debian's g++-aarch64-linux-gnu and
#                       libc6-arm64-cross (scripts/aarch64.sh installs them with qemu-user, which runs the result).
#
# Incremental: a no-op when nothing changed.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
python="${PYTHON:-$repo/.venv/bin/python}"
[ -x "$python" ] || python="$(command -v python3)"
cross=()

case "${1:-}" in
  "")
    # The wheel's package root holds share/cmake/executorch-config.cmake.
    # (executorch is a namespace package: it has __path__, not __file__.)
    prefix="$("$python" -c 'import executorch; print(list(executorch.__path__)[0])')"
    build="$here/build"
    ;;
  --aarch64)
    command -v aarch64-linux-gnu-g++ >/dev/null \
      || { echo "build.sh --aarch64: no aarch64-linux-gnu-g++ (install it: bash scripts/aarch64.sh)" >&2; exit 1; }
    version="$("$python" -c 'from importlib.metadata import version; print(version("executorch"))')"
    pyver="$("$python" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')"
    cache="$repo/.cache/executorch-aarch64/$version-py$pyver"
    prefix="$cache/executorch"
    if [ ! -f "$prefix/share/cmake/executorch-config.cmake" ]; then
      # Unpacked beside, then renamed into place: an interrupted fetch leaves no half a wheel behind.
      mkdir -p "$repo/.cache"
      tmp="$(mktemp -d "$repo/.cache/.executorch-aarch64.XXXXXX")"
      trap 'rm -rf "$tmp"' EXIT
      "$python" -m pip download --quiet --no-deps --only-binary=:all: --platform manylinux_2_28_aarch64 \
        --python-version "$pyver" "executorch==$version" -d "$tmp/wheel" >&2
      "$python" -m zipfile -e "$tmp"/wheel/executorch-*.whl "$tmp/unpacked"
      mkdir -p "$(dirname "$cache")" && rm -rf "$cache" && mv "$tmp/unpacked" "$cache"
    fi
    build="$here/build/aarch64-linux-gnu"
    cross=(-DCMAKE_TOOLCHAIN_FILE="$here/aarch64-linux-gnu.cmake")
    ;;
  *)
    echo "usage: build.sh [--aarch64]" >&2
    exit 2
    ;;
esac

log="$build/build.log"
mkdir -p "$build"
cmake -S "$here" -B "$build" -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH="$prefix" "${cross[@]}" >"$log" 2>&1 \
  || { cat "$log" >&2; exit 1; }
cmake --build "$build" -j "$(nproc 2>/dev/null || echo 2)" >>"$log" 2>&1 \
  || { cat "$log" >&2; exit 1; }
echo "$build/mobizo_runner"

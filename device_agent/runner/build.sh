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
#   --bundle            then makes the self-contained bundle of that build (bundle.sh): build/<arch>-bundle/, the
#                       runner with the wheel's libraries, the C and C++ runtimes and the glibc loader, which runs on
#                       any Linux kernel of its architecture, Android's included; prints the folder's path.
#                       `build.sh --aarch64 --bundle` is the runner for an Android phone or an aarch64 board.
#
# Incremental: a no-op when nothing changed (the bundle is made again beside and kept only if it differs).
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
python="${PYTHON:-$repo/.venv/bin/python}"
[ -x "$python" ] || python="$(command -v python3)"
cross=()
target=host
bundle=false
for arg in "$@"; do
  case "$arg" in
    --aarch64) target=aarch64 ;;
    --bundle) bundle=true ;;
    *) echo "usage: build.sh [--aarch64] [--bundle]" >&2; exit 2 ;;
  esac
done

case "$target" in
  host)
    # The wheel's package root holds share/cmake/executorch-config.cmake.
    # (executorch is a namespace package: it has __path__, not __file__.)
    prefix="$("$python" -c 'import executorch; print(list(executorch.__path__)[0])')"
    build="$here/build"
    tools=(READELF=readelf CXX=c++ STRIP=strip)
    arch="$(uname -m)"
    ;;
  aarch64)
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
    tools=(READELF=aarch64-linux-gnu-readelf CXX=aarch64-linux-gnu-g++ STRIP=aarch64-linux-gnu-strip)
    arch=aarch64
    ;;
esac

log="$build/build.log"
mkdir -p "$build"
cmake -S "$here" -B "$build" -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH="$prefix" "${cross[@]}" >"$log" 2>&1 \
  || { cat "$log" >&2; exit 1; }
cmake --build "$build" -j "$(nproc 2>/dev/null || echo 2)" >>"$log" 2>&1 \
  || { cat "$log" >&2; exit 1; }
if $bundle; then
  cmake --install "$build" --prefix "$build/install" >>"$log" 2>&1 || { cat "$log" >&2; exit 1; }
  env "${tools[@]}" bash "$here/bundle.sh" "$build/install/bin/mobizo_runner" "$here/build/$arch-bundle" \
    "$prefix/lib"
else
  echo "$build/mobizo_runner"
fi

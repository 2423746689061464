#!/usr/bin/env bash
# Cross-compiles mobizo_runner for an Android phone with the NDK, into device_agent/runner/build/android-<abi>/.
#
# NOT run in this repository's CI: no NDK and no ExecuTorch source tree exist there. CI cross-builds the same
# sources for aarch64 Linux against the aarch64 executorch wheel (build.sh --aarch64) and runs that binary on the
# adb stand-in's phone under qemu-user (tests/device_agent/test_aarch64.py).
#
# Why two stages: the executorch pip wheels hold Linux libraries (x86-64 and aarch64, linked against glibc), not
# Android's (bionic), so ExecuTorch itself must be built for the phone from source first, at the SAME version as
# the wheel that exports the programs (the .pte format and the operator set must match).
#
# Both stages compile with -ffp-contract=off: the server accepts a phone's B only if it equals the replay of its log
# bit for bit, and the update is separate multiplies and adds, each rounded once. Clang contracts a*b+c into a fused
# multiply-add by default (-ffp-contract=on), which rounds once for the pair: in ExecuTorch's kernels that would
# move about a third of B's elements by an ulp after one step, and every upload would be refused.
#
# Needs:
#   ANDROID_NDK            NDK root (r26 or newer), holding build/cmake/android.toolchain.cmake
#   EXECUTORCH_SOURCE_DIR  an ExecuTorch checkout with submodules, at the wheel's version:
#                            git clone --branch v1.5.1 --recursive https://github.com/pytorch/executorch
#   cmake >= 3.24 and a host python with executorch's build requirements (the repo's .venv is fine)
# Optional: ANDROID_ABI (arm64-v8a), ANDROID_PLATFORM (android-26), PYTHON, EXECUTORCH_ANDROID_BUILD
#
# Then, with a phone attached:
#   adb push build/android-arm64-v8a/mobizo_runner /data/local/tmp/mobizo/mobizo_runner
# The binary is static against ExecuTorch and the C++ runtime (c++_static), so it needs nothing else on the phone.
set -euo pipefail

: "${ANDROID_NDK:?set ANDROID_NDK to the Android NDK root}"
: "${EXECUTORCH_SOURCE_DIR:?set EXECUTORCH_SOURCE_DIR to an ExecuTorch checkout (see the header of this script)}"
abi="${ANDROID_ABI:-arm64-v8a}"
platform="${ANDROID_PLATFORM:-android-26}"
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
python="${PYTHON:-$repo/.venv/bin/python}"
[ -x "$python" ] || python="$(command -v python3)"
toolchain="$ANDROID_NDK/build/cmake/android.toolchain.cmake"
[ -f "$toolchain" ] || { echo "no NDK toolchain file at $toolchain" >&2; exit 1; }
et_build="${EXECUTORCH_ANDROID_BUILD:-$EXECUTORCH_SOURCE_DIR/cmake-out-android-$abi}"
et_install="$et_build/install"
android=(-DCMAKE_TOOLCHAIN_FILE="$toolchain" -DANDROID_ABI="$abi" -DANDROID_PLATFORM="$platform"
         -DANDROID_STL=c++_static -DCMAKE_BUILD_TYPE=Release
         -DCMAKE_C_FLAGS=-ffp-contract=off -DCMAKE_CXX_FLAGS=-ffp-contract=off)

# Stage 1: ExecuTorch for the phone. Exactly what the runner uses: the runtime, the Module API with its
# file/mmap data loaders, the .ptd reader (flat_tensor, named_data_map), the tensor helpers, the optimized CPU
# kernels (with the portable ones behind them) and the XNNPACK delegate.
cmake -S "$EXECUTORCH_SOURCE_DIR" -B "$et_build" "${android[@]}" \
  -DCMAKE_INSTALL_PREFIX="$et_install" \
  -DPYTHON_EXECUTABLE="$python" \
  -DEXECUTORCH_BUILD_EXTENSION_MODULE=ON \
  -DEXECUTORCH_BUILD_EXTENSION_DATA_LOADER=ON \
  -DEXECUTORCH_BUILD_EXTENSION_FLAT_TENSOR=ON \
  -DEXECUTORCH_BUILD_EXTENSION_NAMED_DATA_MAP=ON \
  -DEXECUTORCH_BUILD_EXTENSION_TENSOR=ON \
  -DEXECUTORCH_BUILD_KERNELS_OPTIMIZED=ON \
  -DEXECUTORCH_BUILD_XNNPACK=ON \
  -DEXECUTORCH_ENABLE_LOGGING=ON
cmake --build "$et_build" -j "$(nproc 2>/dev/null || echo 4)" --target install

# Stage 2: the runner, against that install. CMAKE_FIND_ROOT_PATH lets find_package look outside the NDK
# sysroot; EXECUTORCH_SOURCE_DIR gives CMakeLists.txt the helper that links the kernel and delegate
# registration archives whole (their static constructors register them; nothing else references them).
out="$here/build/android-$abi"  # under build/, which .gitignore already ignores
cmake -S "$here" -B "$out" "${android[@]}" \
  -DCMAKE_PREFIX_PATH="$et_install" \
  -DCMAKE_FIND_ROOT_PATH="$et_install" \
  -DEXECUTORCH_SOURCE_DIR="$EXECUTORCH_SOURCE_DIR"
cmake --build "$out" -j "$(nproc 2>/dev/null || echo 4)"
echo "$out/mobizo_runner"

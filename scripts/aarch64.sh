#!/usr/bin/env bash
# What the aarch64 device tests need on an x86-64 Debian host (tests/device_agent/test_aarch64.py): the cross
# compiler and the aarch64 C library (g++-aarch64-linux-gnu, libc6-arm64-cross), which build the native runner with
# `device_agent/runner/build.sh --aarch64`, and qemu-user, which runs it. Installed with apt when missing (as root,
# or through sudo). Nothing to do on an aarch64 host. The tests fail, not skip, when these are absent.
set -euo pipefail
[ "$(uname -m)" = aarch64 ] && exit 0
if command -v aarch64-linux-gnu-g++ >/dev/null && command -v qemu-aarch64 >/dev/null \
  && [ -e /usr/aarch64-linux-gnu/lib/ld-linux-aarch64.so.1 ]; then
  exit 0
fi
packages=(g++-aarch64-linux-gnu libc6-arm64-cross qemu-user)
echo "aarch64: installing Debian's ${packages[*]} for the aarch64 device tests (apt)"
sudo=""
if [ "$(id -u)" != 0 ]; then sudo="sudo"; fi
export DEBIAN_FRONTEND=noninteractive
$sudo apt-get install -y -qq --no-install-recommends "${packages[@]}" >/dev/null \
  || { $sudo apt-get update -qq >/dev/null && $sudo apt-get install -y -qq --no-install-recommends "${packages[@]}" >/dev/null; }
echo "aarch64: $(aarch64-linux-gnu-g++ --version | head -1); $(qemu-aarch64 --version | head -1)"

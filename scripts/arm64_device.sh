#!/usr/bin/env bash
# An emulated arm64 device on an x86-64 Debian host: a Debian arm64 root (debootstrap minbase with Python 3.11)
# whose programs run under qemu-user through binfmt_misc, with mobizo's device extra installed into a venv from
# aarch64 wheels, as `pip install 'mobizo[device]'` installs it on a Raspberry Pi or a Jetson.
#
#   arm64_device.sh              build what is missing and print the root's path (the venv is ROOT/opt/mobizo)
#   arm64_device.sh run CMD...   run CMD inside the root (its own mount namespace, /proc and /sys mounted, a clean
#                                environment with HOME=/root; MOBIZO_* variables pass through)
#
# Cached outside the clone, keyed by their inputs (MOBIZO_ARM64_CACHE, default /var/cache/mobizo/arm64):
#   root-<key>/       the Debian root, keyed by this script's root recipe (suite, mirror, packages)
#   wheels-<key>/     the aarch64 wheels of mobizo[device]'s dependencies, keyed by pyproject.toml
#   root-<key>/opt/mobizo/   the device venv with those dependencies (rebuilt when the wheels' key changes)
# Each call installs the working tree's mobizo (a wheel built here) into the venv with --no-deps, so the device
# runs the code of this checkout. Needs root (debootstrap, chroot, binfmt_misc); installs Debian's debootstrap
# and qemu-user-static when missing.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cache="${MOBIZO_ARM64_CACHE:-/var/cache/mobizo/arm64}"
suite=bookworm
mirror="${MOBIZO_DEBIAN_MIRROR:-http://deb.debian.org/debian}"
packages=python3,python3-venv
python="${PYTHON:-$repo/.venv/bin/python}"
[ -x "$python" ] || python="$(command -v python3)"
say() { echo "arm64: $*" >&2; }

[ "$(id -u)" = 0 ] || { say "needs root (debootstrap, chroot, binfmt_misc)"; exit 1; }

tools() {
  local missing=()
  command -v debootstrap >/dev/null || missing+=(debootstrap)
  [ -x /usr/libexec/qemu-binfmt/aarch64-binfmt-P ] || missing+=(qemu-user-static)
  command -v unshare >/dev/null || missing+=(util-linux)
  if [ ${#missing[@]} -gt 0 ]; then
    say "installing Debian's ${missing[*]} (apt)"
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null \
      || { apt-get update -qq >/dev/null && apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null; }
  fi
  # aarch64 executables run through qemu (the F flag: the interpreter is opened now, so it works inside the root)
  if [ ! -e /proc/sys/fs/binfmt_misc/register ]; then
    mount -t binfmt_misc binfmt_misc /proc/sys/fs/binfmt_misc
  fi
  if [ ! -e /proc/sys/fs/binfmt_misc/qemu-aarch64 ]; then
    cat /usr/lib/binfmt.d/qemu-aarch64.conf > /proc/sys/fs/binfmt_misc/register
  fi
}

key_of() { sha256sum | cut -c1-16; }

build_root() {
  local key root tmp
  key=$(printf '%s\n' "$suite" "$mirror" "$packages" "minbase arm64 v1" | key_of)
  root="$cache/root-$key"
  if [ ! -x "$root/usr/bin/python3" ]; then
    say "building the Debian $suite arm64 root ($packages) into $root (a few minutes, once)"
    mkdir -p "$cache"
    tmp="$(mktemp -d "$cache/.root.XXXXXX")"
    debootstrap --arch=arm64 --variant=minbase --include="$packages" "$suite" "$tmp" "$mirror" >"$tmp.log" 2>&1 \
      || { tail -20 "$tmp.log" >&2; rm -rf "$tmp"; exit 1; }
    rm -f "$tmp.log"
    mv "$tmp" "$root"
  fi
  echo "$root"
}

# The project's wheel, built from this checkout (pure Python; printed: its path)
project_wheel() {
  local out="$1"
  rm -rf "$out" && mkdir -p "$out"
  "$python" -m pip wheel --quiet --disable-pip-version-check --no-deps -w "$out" "$repo" >/dev/null 2>&1 \
    || "$python" -m pip wheel --disable-pip-version-check --no-deps -w "$out" "$repo" >&2
  ls "$out"/mobizo-*.whl
}

build_wheels() {
  local key wheels tmp wheel
  key=$(cat "$repo/pyproject.toml" | key_of)
  wheels="$cache/wheels-$key"
  if [ ! -f "$wheels/.complete" ]; then
    say "downloading the aarch64 wheels of mobizo[device] into $wheels"
    tmp="$(mktemp -d "$cache/.wheels.XXXXXX")"
    wheel=$(project_wheel "$tmp/project")
    "$python" -m pip download --quiet --disable-pip-version-check --only-binary=:all: \
      --platform manylinux_2_28_aarch64 --platform manylinux_2_17_aarch64 --platform manylinux2014_aarch64 \
      --implementation cp --python-version 3.11 -d "$tmp/wheels" "mobizo[device] @ file://$wheel" >&2
    rm -f "$tmp"/wheels/mobizo-*.whl && rm -rf "$tmp/project"
    touch "$tmp/wheels/.complete"
    rm -rf "$wheels" && mv "$tmp/wheels" "$wheels" && rmdir "$tmp"
  fi
  echo "$wheels"
}

in_root() {  # in_root ROOT CMD...: CMD inside ROOT, in a mount namespace of its own (mounts vanish with it)
  local root="$1"
  shift
  local pass=()
  while IFS='=' read -r name _; do pass+=("$name=${!name}"); done < <(env | grep -E '^MOBIZO_[A-Z0-9_]*=' || true)
  unshare --mount --propagation private --fork -- sh -c '
    root="$1"; shift
    mount -t proc proc "$root/proc"
    mount --rbind /dev "$root/dev"
    mount --rbind /sys "$root/sys"
    mount -t tmpfs tmpfs "$root/tmp"
    exec chroot "$root" "$@"' sh "$root" \
    env -i PATH=/opt/mobizo/bin:/usr/local/bin:/usr/bin:/bin HOME=/root LANG=C.UTF-8 "${pass[@]}" "$@"
}

build_venv() {
  local root="$1" wheels="$2" key
  key=$(basename "$wheels")
  if [ "$(cat "$root/opt/mobizo/.wheels" 2>/dev/null)" != "$key" ]; then
    say "installing mobizo[device]'s dependencies into $root/opt/mobizo (under qemu: a minute, once)"
    rm -rf "$root/opt/mobizo" "$root/opt/wheels"
    cp -r "$wheels" "$root/opt/wheels"
    local wheel
    wheel=$(project_wheel "$root/opt/project")
    in_root "$root" /usr/bin/python3 -m venv /opt/mobizo
    in_root "$root" /opt/mobizo/bin/pip install --quiet --disable-pip-version-check --no-index \
      --find-links /opt/wheels "mobizo[device] @ file:///opt/project/$(basename "$wheel")" >&2
    echo "$key" > "$root/opt/mobizo/.wheels"
  fi
}

install_project() {  # this checkout's mobizo into the device venv (no dependencies: they are the extra's)
  local root="$1" wheel
  wheel=$(project_wheel "$root/opt/project")
  in_root "$root" /opt/mobizo/bin/pip install --quiet --disable-pip-version-check --no-index --no-deps \
    --force-reinstall "/opt/project/$(basename "$wheel")" >&2
}

tools
root=$(build_root)
case "${1:-}" in
  "")
    wheels=$(build_wheels)
    build_venv "$root" "$wheels"
    install_project "$root"
    echo "$root"
    ;;
  run)
    shift
    in_root "$root" "$@"
    ;;
  *)
    echo "usage: arm64_device.sh [run CMD...]" >&2
    exit 2
    ;;
esac

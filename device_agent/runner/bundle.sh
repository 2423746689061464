#!/usr/bin/env bash
# Makes a self-contained runner bundle: a folder holding the runner (mobizo_runner.bin), every shared library it
# needs (the executorch wheel's and the C and C++ runtimes), the glibc loader that starts it, and a launcher script
# mobizo_runner. It needs nothing from the device's own libraries, so the same folder runs on any Linux kernel of
# its architecture: a Jetson, a Raspberry Pi, or an Android phone (whose libc is not glibc), started as
#
#   DIR/mobizo_runner ARGS...                                                       (a shell with /bin/sh)
#   DIR/ld-linux-aarch64.so.1 --library-path DIR DIR/mobizo_runner.bin ARGS...      (what the agent's driver runs)
#
#   bundle.sh RUNNER OUT [DIR...]   (build.sh --bundle runs it with READELF, CXX and STRIP for the runner's target,
#                                    and the executorch wheel's lib/ as DIR)
#
# The libraries are found as the loader would find them, recursively from the runner's NEEDED entries (readelf
# -d): in each file's own RUNPATH ($ORIGIN expanded), then in the DIRs, then in the compiler's library path (CXX
# -print-file-name: the cross toolchain's /usr/aarch64-linux-gnu/lib, or this machine's), and copied under their
# NEEDED names, symbolic links resolved. OUT is written beside and renamed into place, so a reader never sees half
# a bundle; one that holds the same files already is left alone.
set -euo pipefail

[ $# -ge 2 ] || { echo "usage: bundle.sh RUNNER OUT [DIR...]" >&2; exit 2; }
runner="$(realpath "$1")"
out="$2"
shift 2
dirs=("$@")
readelf="${READELF:-readelf}"
cxx="${CXX:-c++}"
strip="${STRIP:-strip}"

mkdir -p "$(dirname "$out")"
tmp="$(mktemp -d "$(dirname "$out")/.bundle.XXXXXX")"
trap 'rm -rf "$tmp"' EXIT

needed() { "$readelf" -d "$1" | sed -n 's/.*(NEEDED).*\[\(.*\)\]$/\1/p'; }
run_paths() {  # the RUNPATH (or RPATH) folders of an ELF file, one a line, $ORIGIN expanded
  local origin
  origin="$(dirname "$1")"
  "$readelf" -d "$1" | sed -n 's/.*(R\(UN\)\{0,1\}PATH).*\[\(.*\)\]$/\2/p' | tr ':' '\n' \
    | sed -e "s|\$ORIGIN|$origin|g" -e "s|\${ORIGIN}|$origin|g"
}
locate() {  # NAME FROM: where the loader would find library NAME that ELF file FROM needs
  local dir found
  while IFS= read -r dir; do
    if [ -n "$dir" ] && [ -f "$dir/$1" ]; then realpath "$dir/$1"; return; fi
  done < <(run_paths "$2")
  for dir in ${dirs[@]+"${dirs[@]}"}; do
    if [ -f "$dir/$1" ]; then realpath "$dir/$1"; return; fi
  done
  found="$("$cxx" -print-file-name="$1")"
  if [ "$found" != "$1" ] && [ -f "$found" ]; then realpath "$found"; return; fi
  echo "bundle.sh: $1 (needed by $(basename "$2")) is in neither its run path, ${dirs[*]:-no DIR} nor the compiler's path" >&2
  exit 1
}

interpreter="$("$readelf" -l "$runner" | sed -n 's/.*Requesting program interpreter: \(.*\)\]$/\1/p')"
[ -n "$interpreter" ] || { echo "bundle.sh: $runner names no program interpreter" >&2; exit 1; }
loader="$(basename "$interpreter")"

cp "$runner" "$tmp/mobizo_runner.bin"
cp -L "$(locate "$loader" "$runner")" "$tmp/$loader"
queue=("$runner")
while [ ${#queue[@]} -gt 0 ]; do
  elf="${queue[0]}"
  queue=("${queue[@]:1}")
  while IFS= read -r name; do
    [ -e "$tmp/$name" ] && continue
    path="$(locate "$name" "$elf")"
    cp -L "$path" "$tmp/$name"
    queue+=("$path")
  done < <(needed "$elf")
done
# The runner's symbol table, which the loader does not read (the libraries come stripped, and stay the very files
# the wheel and the C library ship).
"$strip" --strip-unneeded "$tmp/mobizo_runner.bin"
chmod 0755 "$tmp/mobizo_runner.bin" "$tmp/$loader"

# The launcher: POSIX sh (Android's /system/bin/sh is mksh; on a phone run it as `sh DIR/mobizo_runner`, there
# being no /bin/sh).
cat >"$tmp/mobizo_runner" <<EOF
#!/bin/sh
# The native runner, self-contained: started through the bundle's own loader with the bundle's libraries.
dir=\$(dirname "\$0")
exec "\$dir/$loader" --library-path "\$dir" "\$dir/mobizo_runner.bin" "\$@"
EOF
chmod 0755 "$tmp/mobizo_runner" "$tmp"

# A bundle with the same files stays as it is (a reader may be using it); another is replaced.
if ! { [ -d "$out" ] && diff -r -q "$tmp" "$out" >/dev/null 2>&1; }; then
  old=""
  if [ -e "$out" ]; then old="$tmp.old"; mv -T "$out" "$old"; fi
  mv -T "$tmp" "$out"
  [ -z "$old" ] || rm -rf "$old"
fi
echo "$out"

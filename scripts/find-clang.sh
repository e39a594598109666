#!/usr/bin/env bash
# Prints the path of a clang++ of version 16 or newer, installing Debian's clang-16 (with its sanitizer and
# libFuzzer runtimes and its OpenMP) where none is found. Used by check-clang.sh and check-sanitizers.sh.
set -euo pipefail

version_of() { "$1" --version 2>/dev/null | sed -n 's/.*clang version \([0-9]*\).*/\1/p' | head -n1; }

install() {
  if ! command -v apt-get >/dev/null 2>&1; then
    echo "find-clang: no apt-get: install clang 16 or newer with compiler-rt and libomp, and rerun" >&2
    exit 1
  fi
  echo "find-clang: installing $* (apt-get)" >&2
  local sudo_cmd=()
  [[ $(id -u) == 0 ]] || sudo_cmd=(sudo)
  DEBIAN_FRONTEND=noninteractive "${sudo_cmd[@]}" apt-get update -qq >&2
  DEBIAN_FRONTEND=noninteractive "${sudo_cmd[@]}" apt-get install -y -qq --no-install-recommends "$@" >&2
}

for candidate in clang++ clang++-{22..16}; do
  path=$(command -v "$candidate" 2>/dev/null) || continue
  v=$(version_of "$path")
  [[ -n $v && $v -ge 16 ]] || continue
  # Debian splits the sanitizer / libFuzzer runtimes and OpenMP off the compiler.
  if command -v dpkg >/dev/null 2>&1; then
    missing=()
    for pkg in "libclang-rt-$v-dev" "libomp-$v-dev"; do
      dpkg -s "$pkg" >/dev/null 2>&1 || missing+=("$pkg")
    done
    ((${#missing[@]} == 0)) || install "${missing[@]}"
  fi
  echo "$path"
  exit 0
done

install clang-16 libclang-rt-16-dev libomp-16-dev
command -v clang++-16

#!/usr/bin/env bash
# Installs what building flare needs, only where it is missing (Debian / Ubuntu, apt-get):
#   cmake (3.25+ for CMakePresets.json v6), g++ (C++20, OpenMP), make, and with --tests libgtest-dev and
#   python3 with pip and venv (the Python tests' packages are scripts/python-env.sh's business).
# Checks with command -v / dpkg first, so on a ready machine it does nothing. Used by demo.sh, test.sh
# and .ci/run; runnable on its own: scripts/ensure-deps.sh [--tests]
set -euo pipefail

want_tests=0
for arg in "$@"; do
  case "$arg" in
    --tests) want_tests=1 ;;
    *) echo "usage: $0 [--tests]" >&2; exit 2 ;;
  esac
done

missing=()
command -v cmake >/dev/null 2>&1 || missing+=(cmake)
command -v g++ >/dev/null 2>&1 || missing+=(g++)
command -v make >/dev/null 2>&1 || missing+=(make)
# GoogleTest is a library, not a command: ask dpkg (elsewhere, CMake's find_package reports it if absent).
if [[ $want_tests == 1 ]] && command -v dpkg >/dev/null 2>&1 && ! dpkg -s libgtest-dev >/dev/null 2>&1; then
  missing+=(libgtest-dev)
fi
if [[ $want_tests == 1 ]]; then
  command -v python3 >/dev/null 2>&1 || missing+=(python3)
  python3 -m pip --version >/dev/null 2>&1 || missing+=(python3-pip)
  python3 -c 'import ensurepip, venv' >/dev/null 2>&1 || missing+=(python3-venv)
fi

if ((${#missing[@]} > 0)); then
  echo "ensure-deps: installing ${missing[*]}"
  if ! command -v apt-get >/dev/null 2>&1; then
    echo "ensure-deps: missing ${missing[*]} and no apt-get here: install them and rerun" >&2
    exit 1
  fi
  if [[ $(id -u) == 0 ]]; then
    sudo_cmd=()
  elif command -v sudo >/dev/null 2>&1; then
    sudo_cmd=(sudo)
  else
    echo "ensure-deps: missing ${missing[*]} and not root (no sudo either): install them and rerun" >&2
    exit 1
  fi
  export DEBIAN_FRONTEND=noninteractive
  "${sudo_cmd[@]}" apt-get update -qq
  "${sudo_cmd[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

# CMakePresets.json is version 6: cmake 3.25 or newer.
cmake_version=$(cmake --version | sed -n 's/^cmake version \([0-9]*\.[0-9]*\).*/\1/p')
if [[ $(printf '%s\n3.25\n' "$cmake_version" | sort -V | head -n1) != 3.25 ]]; then
  echo "ensure-deps: cmake $cmake_version is too old: the presets need 3.25 or newer" >&2
  exit 1
fi

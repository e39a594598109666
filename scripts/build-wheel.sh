#!/usr/bin/env bash
# Builds the release wheel of flare reproducibly, repairs it with auditwheel and checks it.
#   scripts/build-wheel.sh              the release wheel: CUDA backend for every shipped architecture
#                                       (FLARE_RELEASE_ARCHS in cmake/FlareCuda.cmake, the sm90a forward too)
#   scripts/build-wheel.sh --cpu        the same without the CUDA backend (FLARE_CUDA=OFF)
#   scripts/build-wheel.sh --twice      build twice in two build trees and require the same bytes
#   scripts/build-wheel.sh --jobs N     parallel compile jobs (default: nproc)
# Output: dist/flare_attention-<version>-py3-none-manylinux_<glibc>_x86_64.whl, dist/SHA256SUMS and
# dist/report.json (scripts/wheel_check.py: tag, size, needed libraries, minimum glibc).
#
# Reproducible: the Python tools are pinned (scripts/wheel-requirements.txt, in the virtual environment
# build/wheel-tools), every file's time is the last commit's (SOURCE_DATE_EPOCH), build paths are mapped out of
# the binaries and each build starts from an empty build tree: the same commit built with the same compilers
# (gcc, nvcc, cmake: docs/install.md) gives the same wheel.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

cuda=ON
twice=0
jobs=$(nproc)
while [[ $# -gt 0 ]]; do
  case $1 in
    --cpu) cuda=OFF; shift ;;
    --twice) twice=1; shift ;;
    --jobs) jobs=$2; shift 2 ;;
    -h|--help) sed -n '2,15p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "build-wheel: unknown argument '$1' (try --help)" >&2; exit 2 ;;
  esac
done
log() { echo "build-wheel: $*" >&2; }

if [[ -n $(git status --porcelain --untracked-files=no) ]]; then
  log "warning: the work tree has uncommitted changes; the wheel will not match the commit's"
fi
tools=build/wheel-tools
if [[ ! -x $tools/bin/python ]] || ! cmp -s scripts/wheel-requirements.txt "$tools/requirements.txt"; then
  log "installing the pinned build tools into $tools"
  rm -rf "$tools"
  python3 -m venv "$tools"
  "$tools/bin/python" -m pip install -q -r scripts/wheel-requirements.txt
  cp scripts/wheel-requirements.txt "$tools/requirements.txt"
fi
[[ $cuda == ON ]] && scripts/ensure-cutlass.sh  # build/deps/cutlass, where CMake finds the headers
archs=$(sed -n 's/^set(FLARE_RELEASE_ARCHS "\([^"]*\)").*/\1/p' cmake/FlareCuda.cmake)

export SOURCE_DATE_EPOCH
SOURCE_DATE_EPOCH=$(git log -1 --format=%ct)
export FLARE_CUDA=$cuda FLARE_ARCHS=$archs CMAKE_BUILD_PARALLEL_LEVEL=$jobs
export CMAKE_ARGS="-DFLARE_SM90=AUTO"
unset FLARE_WHEEL_LIBRARY

build_once() {  # $1: build tree; prints the repaired wheel's path
  local tree=$1
  rm -rf "$tree"
  local start=$SECONDS
  log "building (FLARE_CUDA=$cuda, archs $archs, $jobs jobs) in $tree"
  "$tools/bin/python" -m pip wheel . --no-deps --no-build-isolation -q -w "$tree/raw" -Cbuild-dir="$tree/build" >&2
  log "built in $((SECONDS - start)) s; auditwheel repair"
  PATH="$PWD/$tools/bin:$PATH" "$tools/bin/auditwheel" repair -w "$tree/repaired" "$tree"/raw/flare_attention-*.whl >&2
  ls "$tree"/repaired/flare_attention-*.whl
}

wheel=$(build_once build/wheel-release)
if [[ $twice == 1 ]]; then
  again=$(build_once build/wheel-release-2)
  if ! cmp -s "$wheel" "$again"; then
    log "FAILED: two builds of the same commit differ: $wheel and $again"
    exit 1
  fi
  log "reproducible: the second build gave the same bytes"
fi

"$tools/bin/auditwheel" show "$wheel" >&2
mkdir -p dist
cp "$wheel" dist/
wheel=dist/$(basename "$wheel")
python3 scripts/wheel_check.py "$wheel" --json dist/report.json
(cd dist && sha256sum "$(basename "$wheel")" > SHA256SUMS && cat SHA256SUMS)
scripts/check-wheel.sh --wheel "$wheel"

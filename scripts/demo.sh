#!/usr/bin/env bash
# Builds flare and its demo with the release preset, then runs the demo: flare against the naive way
# (time, peak memory, accuracy) at a few sequence lengths. Arguments go to the demo:
#   scripts/demo.sh            the full demo (about a minute or two on 2 cores)
#   scripts/demo.sh --quick    small sizes, a few seconds
#   scripts/demo.sh --help     its options
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

# With an NVIDIA GPU and nvcc present, the demo runs on the GPU: a CUDA build (kernels for this GPU's
# architecture and the head dims the demo uses). Otherwise the CPU build, as on a machine without a GPU.
# The release preset configures the tests too (one build tree for demo.sh and test.sh), so GoogleTest
# is installed along with the compiler.
scripts/ensure-deps.sh --tests
if command -v nvcc >/dev/null 2>&1 && command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  scripts/ensure-cutlass.sh
  cmake --preset cuda -DFLARE_BUILD_TOOLS=ON -DFLARE_BUILD_TESTS=OFF -DFLARE_ARCHS=native \
        -DFLARE_HEADDIMS="64;128"
  cmake --build build/cuda --target flare_demo -j"$(nproc)"
  exec build/cuda/tools/flare_demo "$@"
fi
cmake --preset release -DFLARE_BUILD_TOOLS=ON
cmake --build build/release --target flare_demo -j"$(nproc)"
exec build/release/tools/flare_demo "$@"

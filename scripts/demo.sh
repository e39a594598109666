#!/usr/bin/env bash
# Builds flare and its demo with the release preset, then runs the demo: flare against the naive way
# (time, peak memory, accuracy) at a few sequence lengths. Arguments go to the demo:
#   scripts/demo.sh            the full demo (about a minute or two on 2 cores)
#   scripts/demo.sh --quick    small sizes, a few seconds
#   scripts/demo.sh --help     its options
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

# The release preset configures the tests too (one build tree for demo.sh and test.sh), so GoogleTest
# is installed along with the compiler.
scripts/ensure-deps.sh --tests
cmake --preset release -DFLARE_BUILD_TOOLS=ON
cmake --build build/release --target flare_demo -j"$(nproc)"
exec build/release/tools/flare_demo "$@"

#!/usr/bin/env bash
# The sanitizer, fuzzing and clang checks of CI (scripts/test.sh), from one build: clang >= 16
# (scripts/find-clang.sh installs Debian's clang-16 where none is found) at -O1 with AddressSanitizer and
# UndefinedBehaviorSanitizer (no recovery) and libFuzzer's coverage instrumentation:
#   1. the C++ tests (ctest), which also replay the C ABI fuzz target's regression seeds (tests/fuzz/corpus):
#      flare built and tested with clang, and every test under both sanitizers;
#   2. the fuzz target under libFuzzer for FLARE_FUZZ_SECONDS (default 90) from the seeds, on a scratch copy
#      of them. A finding fails the run; libFuzzer names the input (crash-*, in the scratch folder) to add to
#      tests/fuzz/corpus with the fix (tests/fuzz/README.md).
# One build serves all three (a separate GCC debug build and clang release build took twice as long on CI's
# two cores); scripts/check-clang.sh adds the bf16 units' -O0 check.
# Usage: scripts/check-sanitizers.sh [build-dir] (default build/sanitize).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

build=${1:-build/sanitize}
jobs=$(nproc)
seconds=${FLARE_FUZZ_SECONDS:-90}
export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=1}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}
# LLVM's OpenMP runtime keeps per-thread blocks it never frees (reported by LeakSanitizer when a test grows
# the team); scripts/lsan.supp names it, and nothing of flare's.
export LSAN_OPTIONS=${LSAN_OPTIONS:-suppressions=$PWD/scripts/lsan.supp:print_suppressions=0}

cxx=$(scripts/find-clang.sh)
echo "check-sanitizers: $("$cxx" --version | head -n1), ASan + UBSan + libFuzzer coverage, -O1, in $build"
cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_CXX_COMPILER="$cxx" \
      -DCMAKE_C_COMPILER="${cxx/clang++/clang}" -DFLARE_ENABLE_CUDA=OFF -DFLARE_BUILD_TESTS=ON -DFLARE_BUILD_TOOLS=OFF \
      -DFLARE_FUZZ_LIBFUZZER=ON -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O1 -g" \
      -DCMAKE_CXX_FLAGS="-fsanitize=address,undefined,fuzzer-no-link -fno-sanitize-recover=all -fno-omit-frame-pointer"
cmake --build "$build" -j"$jobs" --target flare flare_tests flare_fuzz_c_abi
# The consumer test installs and builds a package: no sanitizer finds anything there that the others miss.
ctest --test-dir "$build" --output-on-failure -j"$jobs" -E '^cmake_consumer$'

work="$build/fuzz-run"
rm -rf "$work" && mkdir -p "$work/corpus"
cp tests/fuzz/corpus/* "$work/corpus/" 2>/dev/null || true
echo "check-sanitizers: fuzzing the C ABI for ${seconds}s"
fuzzer="$(cd "$build/tests/fuzz" && pwd)/flare_fuzz_c_abi"
(cd "$work" && "$fuzzer" -max_total_time="$seconds" -timeout=30 \
   -rss_limit_mb=4096 -max_len=256 -print_final_stats=1 corpus)
echo "check-sanitizers: passed"

#!/usr/bin/env bash
# The sanitizer checks of CI (scripts/test.sh), in two parts:
#   1. the debug preset (GCC, AddressSanitizer + UndefinedBehaviorSanitizer, no recovery) at -O1: the C++
#      tests that exercise the kernels and the C ABI's checks (sanitized_tests below), and the C ABI fuzz
#      target's regression seeds (tests/fuzz/corpus) through its seeded random driver;
#   2. the fuzz target under libFuzzer (clang >= 16, scripts/find-clang.sh; ASan + UBSan, library built with
#      coverage) for FLARE_FUZZ_SECONDS (default 90) from the seeds, on a scratch copy of them. A finding
#      fails the run; libFuzzer names the input (crash-*, in the scratch folder) to add to tests/fuzz/corpus
#      with the fix (tests/fuzz/README.md).
# Usage: scripts/check-sanitizers.sh [build-root] (default build; uses <root>/debug and <root>/fuzz).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

root=${1:-build}
jobs=$(nproc)
seconds=${FLARE_FUZZ_SECONDS:-90}
export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=1}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}
# Which C++ tests run under the sanitizers (a ctest -R regex; "" = all of them).
sanitized_tests=""

echo "check-sanitizers: debug preset (ASan + UBSan, -O1) in $root/debug"
cmake --preset debug -B "$root/debug" -DFLARE_BUILD_TESTS=ON -DFLARE_BUILD_TOOLS=OFF -DCMAKE_CXX_FLAGS_DEBUG="-g -O1"
cmake --build "$root/debug" -j"$jobs" --target flare_tests flare_fuzz_c_abi
filter=()
[[ -n $sanitized_tests ]] && filter=(-R "$sanitized_tests")
# The consumer test installs and builds a package (no sanitizer finds anything there that the others miss).
ctest --test-dir "$root/debug" --output-on-failure -j"$jobs" -E '^cmake_consumer$' "${filter[@]}"

cxx=$(scripts/find-clang.sh)
echo "check-sanitizers: libFuzzer build with $("$cxx" --version | head -n1) in $root/fuzz"
cmake -S . -B "$root/fuzz" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_CXX_COMPILER="$cxx" \
      -DCMAKE_C_COMPILER="${cxx/clang++/clang}" -DFLARE_ENABLE_CUDA=OFF -DFLARE_BUILD_TESTS=ON -DFLARE_BUILD_TOOLS=OFF \
      -DFLARE_FUZZ_LIBFUZZER=ON -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O1 -g" \
      -DCMAKE_CXX_FLAGS="-fsanitize=address,undefined,fuzzer-no-link -fno-sanitize-recover=all -fno-omit-frame-pointer"
cmake --build "$root/fuzz" -j"$jobs" --target flare_fuzz_c_abi
work="$root/fuzz/run"
rm -rf "$work" && mkdir -p "$work/corpus"
cp tests/fuzz/corpus/* "$work/corpus/" 2>/dev/null || true
echo "check-sanitizers: fuzzing the C ABI for ${seconds}s"
fuzzer="$(cd "$root/fuzz/tests/fuzz" && pwd)/flare_fuzz_c_abi"
(cd "$work" && "$fuzzer" -max_total_time="$seconds" -timeout=30 \
   -rss_limit_mb=4096 -max_len=256 -print_final_stats=1 corpus)
echo "check-sanitizers: passed"

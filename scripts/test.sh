#!/usr/bin/env bash
# Builds everything with the release preset and runs every test; exits non-zero on any failure.
#   0. bench/results and docs/img against bench/README.md's results policy (scripts/check-results.py)
#   1. the C++ tests (GoogleTest via CTest) and the demo smoke test, at this machine's best SIMD level
#   2. the C++ tests again at every SIMD level below that one (FLARE_CPU_ISA=avx512bf16, avx512, avx2,
#      generic), so the lower kernels are checked on a machine that would not pick them; levels above the
#      best are named as not testable here
#   2a. the C++ tests against the AMX level on tiles emulated in software, where the processor has
#      AVX512_BF16 but no AMX (flare_tests_amx_emulated)
#   2b. flare built with clang >= 16 under ASan + UBSan: the C++ tests (the C ABI fuzz target's seeds among
#      them) and a bounded libFuzzer run (scripts/check-sanitizers.sh); the bf16 units' clang -O0 check
#      (scripts/check-clang.sh)
#   3. the Python tests (pytest over tests/python: torch ops, flash_attn API, transformers, ring attention over
#      gloo), with the pinned tests/python/requirements.txt installed by scripts/python-env.sh where missing
#   3b. the Python wheel of that library: inspected, installed into a fresh venv, smoke-tested (check-wheel.sh)
#   4. where nvcc is installed: the CUDA sources compiled (one head-dim tile of each pass and one wide
#      forward tile, sm_80), so a compile error cannot land, and the library checked for symbols it lacks (a
#      forward-only dispatcher too), the sm80 dropout draws' column groups checked against the MMA layouts on
#      the CPU; one sm90
#      forward unit compiled for sm_90a and its machine code checked, the sm90 layouts checked on the CPU
#      (scripts/check-sm90.sh); where a GPU is present too, a CUDA build and the GPU suite (tests/gpu)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

jobs=$(nproc)
stage() { printf '\n==== %s (%s)\n' "$1" "$(date +%T)"; }

stage "dependencies"
scripts/ensure-deps.sh --tests

stage "result files and plots (scripts/check-results.py)"
python3 scripts/check-results.py

stage "configure and build (release preset, -j$jobs)"
cmake --preset release -DFLARE_BUILD_TESTS=ON -DFLARE_BUILD_TOOLS=ON
cmake --build build/release -j"$jobs"

stage "C++ tests, SIMD level: best available"
ctest --test-dir build/release --output-on-failure -j"$jobs"

# Which tests to repeat per forced SIMD level: a ctest -R regex ("" = all of them). Everything is cheap
# enough for CI today; narrow this to the kernel tests if the suite outgrows the 30-minute budget.
forced_isa_tests=""
best=$(build/release/tools/flare_demo --isa)
levels=(amx avx512bf16 avx512 avx2 generic)  # best first; FLARE_CPU_ISA only ever lowers the level
if [[ " ${levels[*]} " != *" $best "* ]]; then
  echo "test.sh: flare reports an unknown SIMD level '$best'; add it to the levels list" >&2
  exit 1
fi
below=0
for isa in "${levels[@]}"; do
  if [[ $below == 0 ]]; then
    if [[ $isa == "$best" ]]; then
      below=1
    else
      stage "C++ tests, SIMD level $isa: skipped (this CPU, or its OS, does not support it; best is $best)"
    fi
    continue
  fi
  stage "C++ tests, SIMD level forced to $isa (FLARE_CPU_ISA=$isa)"
  filter=()
  [[ -n $forced_isa_tests ]] && filter=(-R "$forced_isa_tests")
  FLARE_CPU_ISA=$isa ctest --test-dir build/release --output-on-failure -j"$jobs" "${filter[@]}"
done

# The AMX level's code on tiles emulated in software (tests/cpp/CMakeLists.txt), where the processor has
# AVX512_BF16 but not AMX; CpuLevels is left out (it expects the level CPUID reports, which emulation raises).
if [[ $best == avx512bf16 ]]; then
  stage "C++ tests, SIMD level amx on tiles emulated in software (flare_tests_amx_emulated)"
  build/release/tests/cpp/flare_tests_amx_emulated --gtest_brief=1 \
    --gtest_filter=-CpuLevels.BestLevelOrTheForcedOneBelowIt
else
  stage "C++ tests, SIMD level amx on emulated tiles: skipped (it needs AVX512_BF16 without AMX; best is $best)"
fi

stage "clang >= 16, ASan + UBSan: C++ tests, C ABI fuzz target (scripts/check-sanitizers.sh)"
scripts/check-sanitizers.sh build/sanitize

stage "clang: the bf16 units at -O0 (scripts/check-clang.sh)"
scripts/check-clang.sh build/clang

stage "Python tests (pytest, tests/python), against build/release/src/libflare.so"
py=$(scripts/python-env.sh)  # a Python with the pinned tests/python/requirements.txt
# torch.compile's cache lives in this build tree: the default one in /tmp is shared by every checkout on the
# machine and can hand back graphs compiled against another checkout's flare ops.
FLARE_LIBRARY="$PWD/build/release/src/libflare.so" HF_HUB_OFFLINE=1 TORCHINDUCTOR_CACHE_DIR="$PWD/build/torchinductor" \
  "$py" -m pytest tests/python -q -p no:cacheprovider

stage "Python wheel: packaged, inspected, installed in a fresh venv, smoke-tested (scripts/check-wheel.sh)"
scripts/check-wheel.sh --library build/release/src/libflare.so

if command -v nvcc >/dev/null 2>&1; then
  stage "CUDA sources: compile check (FLARE_HEADDIMS=64;512, FLARE_ARCHS=80, both passes)"
  scripts/ensure-cutlass.sh
  cmake -S . -B build/cuda-check -DCMAKE_BUILD_TYPE=Release -DFLARE_ENABLE_CUDA=ON "-DFLARE_HEADDIMS=64;512" \
        -DFLARE_ARCHS=80 -DFLARE_BUILD_TESTS=OFF -DFLARE_BUILD_TOOLS=OFF
  cmake --build build/cuda-check -j"$jobs"
  # The library names no flare symbol it does not define (it would not load: head dim 512's tile has a forward
  # unit alone, so the dispatcher must name no backward of it), and a forward-only build's dispatcher names no
  # backward kernel (the forward-only library is built in full on GPU machines only).
  undefined=$(nm -D --undefined-only -C build/cuda-check/src/libflare.so | grep "flare::" || true)
  if [[ -n $undefined ]]; then echo "test.sh: libflare.so needs symbols it lacks:"; echo "$undefined"; exit 1; fi
  cmake -S . -B build/cuda-check-fwd -DCMAKE_BUILD_TYPE=Release -DFLARE_ENABLE_CUDA=ON -DFLARE_HEADDIMS=64 \
        -DFLARE_ARCHS=80 -DFLARE_CUDA_PASSES=fwd -DFLARE_BUILD_TESTS=OFF -DFLARE_BUILD_TOOLS=OFF >/dev/null
  make -C build/cuda-check-fwd/src cuda/backend.cu.o >/dev/null
  backward=$(nm -C build/cuda-check-fwd/src/CMakeFiles/flare_cuda_host.dir/cuda/backend.cu.o | grep -E " U .*backward" || true)
  if [[ -n $backward ]]; then echo "test.sh: a forward-only build names backward kernels:"; echo "$backward"; exit 1; fi
  # The sm80 dropout draws' column groups against every configuration's MMA layout, on the CPU.
  nvcc -std=c++20 --expt-relaxed-constexpr -O1 -I include -I src -isystem build/deps/cutlass/cutlass_library/source/include \
       tests/cuda/test_sm80_dropout_groups.cu -o build/cuda-check/test_sm80_dropout_groups
  build/cuda-check/test_sm80_dropout_groups

  stage "sm90 forward without a GPU: three units for sm_90a and their SASS; layouts and partitions on the CPU"
  scripts/check-sm90.sh build/sm90-check
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    stage "GPU tests (tests/gpu: pytest suite and compute-sanitizer), CUDA build for this GPU"
    cmake --preset cuda -DFLARE_ARCHS=native -DFLARE_BUILD_TESTS=OFF
    cmake --build build/cuda -j"$jobs"
    FLARE_LIBRARY="$PWD/build/cuda/src/libflare.so" PYTHON="$py" tests/gpu/run.sh tests sanitize
  fi
else
  stage "CUDA sources: skipped (no nvcc on this machine)"
fi

stage "all tests passed"

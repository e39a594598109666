#!/usr/bin/env bash
# clang's own check beside scripts/check-sanitizers.sh (which builds and tests flare with clang >= 16): the
# AVX-512 BF16 and AMX units compiled at -O0 and checked to pass no value of bf16 vector type between
# functions (clang 16 passes two such arguments in one register at -O0: src/cpu/dot_bf16.hpp).
# Usage: scripts/check-clang.sh [build-dir] (default build/clang).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

build=${1:-build/clang}
cxx=$(scripts/find-clang.sh)
cc=${cxx/clang++/clang}
echo "check-clang: $("$cxx" --version | head -n1)"

# The bf16 units at -O0, where nothing is inlined: no function of theirs may take or return a bf16 vector
# (mangled Dv<n>_u6__bf16 by clang 16, Dv<n>_DF16b by later ones).
objs="$build/bf16-O0"
mkdir -p "$objs"
common=(-std=c++20 -O0 -fopenmp -DFLARE_X86=1 -Iinclude -Isrc -mavx512f -mavx512bw -mavx512vl -mavx512dq -mfma
        -mf16c -mavx2 -mavx512bf16)
"$cxx" "${common[@]}" -c src/cpu/isa_avx512bf16.cpp -o "$objs/isa_avx512bf16.o"
"$cxx" "${common[@]}" -mamx-tile -mamx-bf16 -c src/cpu/isa_amx.cpp -o "$objs/isa_amx.o"
if nm "$objs"/*.o | grep -E 'Dv[0-9]+_(u6__bf16|DF16b)'; then
  echo "check-clang: the functions above pass bf16 vectors by value; clang 16 miscompiles such calls at -O0" >&2
  exit 1
fi
echo "check-clang: no bf16 vector crosses a function boundary in the bf16 units"

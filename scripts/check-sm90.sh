#!/usr/bin/env bash
# Checks of the sm90 forward that need nvcc but no GPU (scripts/test.sh runs it where nvcc is installed):
#   1. one generated sm90 unit (head dim 128, bf16) compiles for sm_90a with the flags src/CMakeLists.txt uses;
#   2. its machine code holds HGMMA in both forms and setmaxnreg, and no local-memory traffic
#      (tests/cuda/check_sm90_sass.py; cuobjdump from the PyPI package nvidia-cuda-cuobjdump where the CUDA
#      toolkit lacks it);
#   3. tests/cuda/test_sm90_layouts.cu, compiled for the host and run: the wgmma partitions, register views and
#      shared-memory layouts of every head dim's configuration.
#   scripts/check-sm90.sh [BUILD_DIR]        (default build/sm90-check)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
out=${1:-build/sm90-check}
mkdir -p "$out"
scripts/ensure-cutlass.sh
cutlass=build/deps/cutlass/cutlass_library/source/include
flags=(-std=c++20 --expt-relaxed-constexpr -I include -I src -isystem "$cutlass")

# cuobjdump disassembles through nvdisasm, which it looks for on PATH.
cuobjdump=$(command -v cuobjdump || true)
if [[ -z $cuobjdump ]] || ! command -v nvdisasm >/dev/null; then
  bin=build/deps/cuobjdump/nvidia/cu13/bin
  if [[ ! -x $bin/cuobjdump || ! -x $bin/nvdisasm ]]; then
    echo "check-sm90: installing cuobjdump and nvdisasm (PyPI nvidia-cuda-*) into build/deps/cuobjdump" >&2
    python3 -m pip install -q --no-deps --target build/deps/cuobjdump "nvidia-cuda-cuobjdump>=13,<14" \
      "nvidia-cuda-nvdisasm>=13,<14" >&2
  fi
  export PATH="$PWD/$bin:$PATH"
  cuobjdump=$bin/cuobjdump
fi

unit=src/cuda/instantiations/sm90_fwd_bf16_hdim128.cu
start=$(date +%s)
nvcc "${flags[@]}" -O3 -gencode arch=compute_90a,code=sm_90a -c "$unit" -o "$out/sm90_fwd_bf16_hdim128.o"
echo "check-sm90: $unit compiled for sm_90a in $(( $(date +%s) - start )) s"
python3 tests/cuda/check_sm90_sass.py --cuobjdump "$cuobjdump" "$out/sm90_fwd_bf16_hdim128.o"

start=$(date +%s)
nvcc "${flags[@]}" -O1 tests/cuda/test_sm90_layouts.cu -o "$out/test_sm90_layouts"
echo "check-sm90: layout test compiled in $(( $(date +%s) - start )) s"
"$out/test_sm90_layouts"

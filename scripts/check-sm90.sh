#!/usr/bin/env bash
# Checks of the sm90 forward that need nvcc but no GPU (scripts/test.sh runs it where nvcc is installed):
#   1. three generated sm90 units (head dims 128, 192 and 256) compile for sm_90a with the flags
#      src/CMakeLists.txt uses;
#   2. their machine code holds HGMMA in both forms and setmaxnreg, and no local-memory traffic
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

# Head dim 128 (bf16), and the two whose consumers hold the most registers: 192 (fp16, which also holds the
# configuration with V's head dim 128) and 256 (bf16). Two compile at a time.
units=(sm90_fwd_bf16_hdim128 sm90_fwd_fp16_hdim192 sm90_fwd_bf16_hdim256)
start=$(date +%s)
pids=()
for unit in "${units[@]}"; do
  nvcc "${flags[@]}" -O3 -DNDEBUG -gencode arch=compute_90a,code=sm_90a -c "src/cuda/instantiations/$unit.cu" \
    -o "$out/$unit.o" &
  pids+=($!)
  if (( ${#pids[@]} == 2 )); then wait "${pids[0]}"; pids=("${pids[@]:1}"); fi
done
for pid in "${pids[@]}"; do wait "$pid"; done
echo "check-sm90: ${units[*]} compiled for sm_90a in $(( $(date +%s) - start )) s"
objects=()
for unit in "${units[@]}"; do objects+=("$out/$unit.o"); done
python3 tests/cuda/check_sm90_sass.py --cuobjdump "$cuobjdump" "${objects[@]}"

start=$(date +%s)
nvcc "${flags[@]}" -O1 tests/cuda/test_sm90_layouts.cu -o "$out/test_sm90_layouts"
echo "check-sm90: layout test compiled in $(( $(date +%s) - start )) s"
"$out/test_sm90_layouts"

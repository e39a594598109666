#!/usr/bin/env bash
# Puts the CuTe/CUTLASS 4.2 headers the CUDA kernels need under build/deps/cutlass (pip, no dependencies),
# unless they are already there. CMake finds them there by itself (src/CMakeLists.txt).
#   scripts/ensure-cutlass.sh
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
dest=build/deps/cutlass
if [[ -f $dest/cutlass_library/source/include/cute/tensor.hpp ]]; then
  exit 0
fi
echo "ensure-cutlass: installing nvidia-cutlass==4.2.0.0 headers into $dest" >&2
python3 -m pip install -q --no-deps --target "$dest" nvidia-cutlass==4.2.0.0 >&2
test -f $dest/cutlass_library/source/include/cute/tensor.hpp

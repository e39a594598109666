// entry.hpp — the sm80 kernels as the host dispatcher (src/cuda/backend.cu) sees them: one function per
// (pass, dtype, head-dim tile), each defined in its own generated translation unit under
// src/cuda/instantiations/ (whose generate.py holds the list of tiles). No CuTe here, so the dispatcher
// compiles quickly.
#pragma once

#include <cuda_runtime.h>

#include "cuda/common/params.hpp"
#include "flare/flare.h"

namespace flare::cuda::sm80 {

// Each takes the shared-memory class of the configuration to run (SmemClass, params.hpp; backend.cu picks it).
template <flare_dtype kDtype, int kHeadDim>
cudaError_t run_forward(AttnParams const& p, cudaStream_t stream, SmemClass c);

template <flare_dtype kDtype, int kHeadDim>
cudaError_t run_backward(BwdParams const& p, cudaStream_t stream, SmemClass c);

// Shared memory (bytes) each kernel needs, for the device-capacity check; defined with the kernels.
template <flare_dtype kDtype, int kHeadDim>
int forward_smem_bytes(SmemClass c);
template <flare_dtype kDtype, int kHeadDim>
int backward_smem_bytes(SmemClass c);

// Key-tile height of the backward kernel (the grid and the deterministic dq split count depend on it).
template <flare_dtype kDtype, int kHeadDim>
int backward_block_n(SmemClass c);

}  // namespace flare::cuda::sm80

// entry.hpp — the sm90a (Hopper) kernels as the host dispatcher (src/cuda/backend.cu) sees them: one function per
// (dtype, head dim), each defined in its own generated translation unit under src/cuda/instantiations/ and
// compiled for sm_90a alone. No CuTe here, so the dispatcher compiles quickly.
#pragma once

#include <cuda_runtime.h>

#include "cuda/common/params.hpp"
#include "flare/flare.h"

namespace flare::cuda::sm90 {

// Runs the forward on `stream`. The call must be one the sm90 path supports (heuristics.hpp decides).
// q_tokens / k_tokens: the tokens q and k (and v) hold, at least 1: dense, seqlen_q / seqlen_k; varlen, every
// sequence's (the TMA views' extents).
template <flare_dtype kDtype, int kHeadDim>
cudaError_t run_forward(AttnParams const& p, int q_tokens, int k_tokens, cudaStream_t stream);

// Shared memory (bytes) the forward kernel takes per block, for the device-capacity check.
template <flare_dtype kDtype, int kHeadDim>
int forward_smem_bytes();

}  // namespace flare::cuda::sm90

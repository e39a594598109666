// entry.hpp — the decode kernels' entry points for the host (src/cuda/backend.cu). The attention kernel has one
// specialisation per (dtype, head-dim tile), each defined in its generated unit
// (src/cuda/instantiations/decode_fwd_<dtype>_hdim<d>.cu); the append, the rotary copy of q and the combine
// are compiled once (src/cuda/decode/kernels.cu). Each launches on `stream` and returns the launch's error.
#pragma once

#include <cuda_runtime.h>

#include "cuda/decode/params.hpp"
#include "flare/flare.h"

namespace flare::cuda::decode {

// Split-KV attention over the (appended, rotated) cache: p.num_splits CTAs per (sequence, kv head, row chunk).
template <flare_dtype D, int kHeadDim>
cudaError_t run_attention(KvCacheParams const& p, cudaStream_t stream);

// k_new / v_new into the cache at slots cache_seqlens[b] + i (k_new rotated when p.rotary_dim > 0).
cudaError_t run_append(KvCacheParams const& p, flare_dtype dtype, cudaStream_t stream);

// q_source rotated into q (the workspace copy), (batch, seqlen_q, nheads, headdim).
cudaError_t run_rotary_q(KvCacheParams const& p, flare_dtype dtype, cudaStream_t stream);

// The splits' outputs and lse merged into out and lse (the head's sink folded in).
cudaError_t run_combine(KvCacheParams const& p, flare_dtype dtype, cudaStream_t stream);

}  // namespace flare::cuda::decode

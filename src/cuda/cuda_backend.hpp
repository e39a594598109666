// cuda_backend.hpp — the CUDA backend's entry points, called by src/api after validation (only in builds
// with FLARE_ENABLE_CUDA). Each takes a validated Problem on a CUDA device, checks what the GPU path adds
// (dtype, head-dim alignment, 16-byte strides, compute capability), and launches on the caller's stream.
// No device-wide synchronisation; errors come back as a status with flare_last_error set.
#pragma once

#include <cstddef>

#include "common/problem.hpp"

namespace flare::cuda {

flare_status forward(const detail::Problem& p);
flare_status backward(const detail::Problem& p);
// The KV-cache pass: append k_new / v_new, rotary, split-KV decode attention and combine (src/cuda/decode).
flare_status kvcache(const detail::Problem& p);
// Bytes of device workspace the KV-cache pass needs (rotated q, split partials; heuristics.hpp decode_layout).
flare_status kvcache_workspace_size(const detail::Problem& p, size_t* bytes);

// Bytes of device workspace the pass needs (the backward's fp32 accumulators; 0 for the forward).
flare_status workspace_size(const detail::Problem& p, size_t* bytes);

}  // namespace flare::cuda

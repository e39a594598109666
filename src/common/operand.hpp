// operand.hpp — one (token, head, dim) operand as every backend addresses it: a pointer and three element
// strides. Plain C++ with no dependency, so host code (src/api, src/cpu) and CUDA kernels (src/cuda) share
// the one type: the CUDA kernels receive the validated Problem's operands unchanged.
#pragma once

#include <cstdint>

namespace flare::detail {

// Element (b, t, h, c) of a dense tensor lives at
//   data + b * batch_stride + t * row_stride + h * head_stride + c            (elements of dtype).
// Varlen tensors have batch_stride 0 and tokens are offset by cu_seqlens. A paged KV cache addresses
// blocks through batch_stride (the stride of its num_blocks dimension; see Problem::block_table).
struct Operand {
  void* data = nullptr;
  int64_t batch_stride = 0;
  int64_t row_stride = 0;
  int64_t head_stride = 0;
};

}  // namespace flare::detail

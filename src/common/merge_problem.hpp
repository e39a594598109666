// merge_problem.hpp — the validated description of one flare_merge_states call (see flare.h): two partial
// attention results, each with its softmax_lse, merged row by row into one. Built by src/api/validate_merge.cpp,
// run by the CPU backend (src/cpu/merge.cpp).
#pragma once

#include <cstdint>

#include "common/problem.hpp"

namespace flare::detail {

// lse row (b, h) starts at data + b * batch_stride + h * head_stride and holds `seqlen` entries, stride 1.
struct LseRows {
  float* data = nullptr;
  int64_t batch_stride = 0;
  int64_t head_stride = 0;
};

struct MergeProblem {
  flare_dtype dtype = FLARE_DTYPE_F32;  // of out_a, out_b, out
  // Varlen tensors (total, nheads, headdim) are batch 1 with seqlen = total.
  int64_t batch = 0, seqlen = 0, nheads = 0, headdim = 0;
  Operand out_a, out_b, out;  // element (b, t, h, c) as in Operand
  LseRows lse_a, lse_b, lse;  // lse.data null: not wanted
  int num_threads = 0;        // 0 = by size
};

}  // namespace flare::detail

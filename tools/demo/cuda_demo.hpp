// cuda_demo.hpp — the demo's GPU rows (compiled only when the demo is built with CUDA: FLARE_DEMO_CUDA).
//
// One row: bf16 attention of one shape on the GPU, fresh N(0,1) inputs generated on the device, run by
//   flare      flare_fwd through the C ABI with CUDA tensor views, on the demo's stream, with a workspace
//              the demo allocates at the size flare_fwd_workspace_size asks for (so flare allocates nothing)
//   naive      tools/demo/cuda_demo.cu's own kernels: S = scale * Q K^T materialised in fp32
//              (batch x heads x seqlen_q x seqlen_k), masked, softmax row by row, then P V, in fp32
// Time: CUDA events around each call, median of the timed runs after one warm-up run.
// Memory: device memory each variant needs beyond the inputs and the outputs, i.e. what it allocates: the
// workspace for flare, the score matrix for the naive way (skipped when that exceeds the budget).
#pragma once

#include <cstdint>
#include <string>

#include "child_measure.hpp"
#include "naive_attention.hpp"

namespace flare_demo {

struct CudaDeviceInfo {
  int count = 0;  // 0: no usable device (error says why)
  std::string name, error;
  int sm_count = 0, major = 0, minor = 0;
  double memory_gib = 0.0;
};

// The first CUDA device, or count 0 with the runtime's reason.
CudaDeviceInfo cuda_device_info();

struct CudaRow {
  Measurement flare, naive;  // extra_mib: the allocation each variant needs beyond inputs and outputs
  bool naive_skipped = false;
  double naive_scores_bytes = 0.0;
  double max_abs_diff = -1.0;  // < 0: not compared
};

// Runs one row (bf16, shape s) on device 0; reps timed runs after one warm-up (one if the warm-up took
// longer than long_run_s). The naive way runs only if its score matrix fits in budget_bytes.
CudaRow run_cuda_row(const AttentionShape& s, int reps, double long_run_s, double budget_bytes, uint64_t seed);

}  // namespace flare_demo

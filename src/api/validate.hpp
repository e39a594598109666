// validate.hpp — from the C ABI's params structs to a checked, normalised detail::Problem.
//
// Every rule of flare.h is checked here, before any kernel runs: presence, ranks, shapes, dtypes, devices,
// strides, alignment, head-dim range, int32 index limits, option values, and (on the CPU) the contents of
// the index tensors. A failure returns FLARE_INVALID_ARGUMENT, or FLARE_UNSUPPORTED for valid input this
// build cannot run, with flare_last_error() set through detail::fail; *problem is then unspecified.
// CUDA index tensors are not read here (their contents live on the device).
#pragma once

#include "common/merge_problem.hpp"
#include "common/problem.hpp"
#include "flare/flare.h"

namespace flare::detail {

// flare_fwd (varlen = false: rank-4 tensors, no cu_seqlens) or flare_fwd_varlen (varlen = true).
flare_status validate_fwd(const flare_fwd_params* params, bool varlen, Problem* problem);

// flare_bwd / flare_bwd_varlen, as above.
flare_status validate_bwd(const flare_bwd_params* params, bool varlen, Problem* problem);

// flare_fwd_kvcache (dense or paged cache).
flare_status validate_kvcache(const flare_kvcache_params* params, Problem* problem);

// flare_merge_states: CPU tensors only (CUDA ones are FLARE_UNSUPPORTED).
flare_status validate_merge(const flare_merge_params* params, MergeProblem* problem);

// FLARE_OUT_OF_MEMORY when the caller gave a workspace smaller than the backend needs for this problem
// (CPU: cpu::workspace_size). A null workspace always passes: flare then allocates its own.
flare_status validate_workspace(const Problem& problem);

// flare_dropout_mask (dropout_mask.cpp): checks its arguments, then writes the keep mask of one sequence.
flare_status dropout_mask(float dropout_p, uint64_t seed, uint64_t offset, int64_t sequence, int64_t nheads,
                          int64_t seqlen_q, int64_t seqlen_k, uint8_t* mask);

}  // namespace flare::detail

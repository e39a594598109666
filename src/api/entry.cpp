// entry.cpp — the exported C ABI (flare.h): each entry point clears the error, validates its params into
// a Problem, checks the workspace and dispatches by device. No C++ exception crosses this file's functions.
#include <cstddef>
#include <cstring>
#include <new>
#include <string>

#include "api/validate.hpp"
#include "common/error.hpp"
#include "cpu/cpu_backend.hpp"
#if FLARE_WITH_CUDA
#include "cuda/cuda_backend.hpp"
#endif
#include "flare/flare.h"

namespace flare::detail {
namespace {

#define FLARE_STRINGIFY_(x) #x
#define FLARE_STRINGIFY(x) FLARE_STRINGIFY_(x)
constexpr const char kVersion[] = FLARE_STRINGIFY(FLARE_VERSION_MAJOR) "." FLARE_STRINGIFY(
    FLARE_VERSION_MINOR) "." FLARE_STRINGIFY(FLARE_VERSION_PATCH);

constexpr const char kNoCuda[] = "this build of flare has no CUDA backend (tensors are on a CUDA device)";

// Sets the error without letting a failed allocation of its text escape.
flare_status fail_quietly(flare_status status, const char* message) noexcept {
  try {
    return fail(status, message);
  } catch (...) {
    return status;
  }
}

// Runs one entry point's body: the error is cleared first, and any exception becomes a status.
template <class Body>
flare_status guarded(const char* entry, Body&& body) noexcept {
  try {
    clear_error();
    return body();
  } catch (const std::bad_alloc&) {
    return fail_quietly(FLARE_OUT_OF_MEMORY, "out of memory: flare could not allocate host memory");
  } catch (const std::exception& e) {
    try {
      return fail(FLARE_INTERNAL_ERROR, std::string("internal error in ") + entry + ": " + e.what());
    } catch (...) {
      return fail_quietly(FLARE_INTERNAL_ERROR, "internal error (and no memory to describe it)");
    }
  } catch (...) {
    return fail_quietly(FLARE_INTERNAL_ERROR, "internal error: a non-standard exception was thrown");
  }
}

// Validated problem to backend: the CPU entry `run`, or the CUDA one for the same pass.
constexpr const char kNoCudaDsinks[] =
    "the sinks' gradient (dsinks) has no CUDA kernel in this release: form it from out, dout and softmax_lse "
    "(dsinks[h] = -sum over head h's rows of exp(sinks[h] - lse) * rowsum(dout * out); flare.ops.sink_gradient)";
// What the CUDA backend does not take, named before anything runs; nullptr when it takes the call.
const char* cuda_gap(const Problem& problem) {
  if (problem.dsinks != nullptr) return kNoCudaDsinks;
  return nullptr;
}
flare_status dispatch(const Problem& problem, flare_status (*run)(const Problem&)) {
  if (problem.device.type == FLARE_DEVICE_CUDA) {
    if (const char* gap = cuda_gap(problem)) return fail(FLARE_UNSUPPORTED, gap);
#if FLARE_WITH_CUDA
    switch (problem.pass) {
      case Pass::kForward: return cuda::forward(problem);
      case Pass::kBackward: return cuda::backward(problem);
      case Pass::kKvCache: return cuda::kvcache(problem);
    }
#endif
    return fail(FLARE_UNSUPPORTED, kNoCuda);
  }
  if (flare_status s = validate_workspace(problem); s != FLARE_OK) return s;
  return run(problem);
}

flare_status report_workspace(const Problem& problem, size_t* bytes) {
  if (problem.device.type == FLARE_DEVICE_CUDA) {
    if (const char* gap = cuda_gap(problem)) return fail(FLARE_UNSUPPORTED, gap);
#if FLARE_WITH_CUDA
    if (problem.pass == Pass::kKvCache) return cuda::kvcache_workspace_size(problem, bytes);
    return cuda::workspace_size(problem, bytes);
#else
    return fail(FLARE_UNSUPPORTED, kNoCuda);
#endif
  }
  return cpu::workspace_size(problem, bytes);
}

flare_status check_bytes_and_varlen(size_t* bytes, int32_t varlen) {
  if (bytes == nullptr) return fail(FLARE_INVALID_ARGUMENT, "bytes is null: pass where to store the size");
  if (varlen != 0 && varlen != 1) {
    return fail(FLARE_INVALID_ARGUMENT, "varlen is " + std::to_string(varlen) + ": it must be 0 or 1");
  }
  return FLARE_OK;
}

flare_status run_fwd(const flare_fwd_params* params, bool varlen) {
  return guarded(varlen ? "flare_fwd_varlen" : "flare_fwd", [&] {
    Problem problem;
    if (flare_status s = validate_fwd(params, varlen, &problem); s != FLARE_OK) return s;
    return dispatch(problem, cpu::forward);
  });
}

flare_status run_bwd(const flare_bwd_params* params, bool varlen) {
  return guarded(varlen ? "flare_bwd_varlen" : "flare_bwd", [&] {
    Problem problem;
    if (flare_status s = validate_bwd(params, varlen, &problem); s != FLARE_OK) return s;
    return dispatch(problem, cpu::backward);
  });
}

}  // namespace
}  // namespace flare::detail

using flare::detail::guarded;
using flare::detail::Problem;

extern "C" {

FLARE_API const char* flare_last_error(void) { return flare::detail::last_error(); }

FLARE_API const char* flare_status_string(flare_status status) {
  // A C caller may pass any int; in C++ a value outside the enum's range is not a flare_status, so the
  // bytes are read as the int they are (no load of an out-of-range enum value).
  int code = 0;
  std::memcpy(&code, &status, sizeof code);
  switch (code) {
    case FLARE_OK: return "FLARE_OK";
    case FLARE_INVALID_ARGUMENT: return "FLARE_INVALID_ARGUMENT";
    case FLARE_UNSUPPORTED: return "FLARE_UNSUPPORTED";
    case FLARE_OUT_OF_MEMORY: return "FLARE_OUT_OF_MEMORY";
    case FLARE_CUDA_ERROR: return "FLARE_CUDA_ERROR";
    case FLARE_INTERNAL_ERROR: return "FLARE_INTERNAL_ERROR";
  }
  return "FLARE_UNKNOWN_STATUS";
}

FLARE_API const char* flare_version(void) { return flare::detail::kVersion; }

FLARE_API flare_tensor flare_tensor_contiguous(void* data, flare_dtype dtype, flare_device device,
                                               int32_t rank, const int64_t* shape) {
  flare_tensor t{};
  t.data = data;
  t.dtype = dtype;
  t.device = device;
  if (rank < 1 || rank > FLARE_MAX_RANK || shape == nullptr) return t;  // absent: the call will say so
  t.rank = rank;
  int64_t stride = 1;
  for (int d = rank - 1; d >= 0; --d) {
    t.shape[d] = shape[d];
    t.strides[d] = stride;
    // A stride that overflows saturates; validation then rejects the tensor's span.
    if (__builtin_mul_overflow(stride, shape[d] > 1 ? shape[d] : 1, &stride)) stride = INT64_MAX;
  }
  return t;
}

FLARE_API void flare_fwd_params_init(flare_fwd_params* params) {
  if (params == nullptr) return;
  *params = flare_fwd_params{};
  params->struct_size = sizeof(flare_fwd_params);
  params->attn.window_left = -1;
  params->attn.window_right = -1;
}

FLARE_API void flare_bwd_params_init(flare_bwd_params* params) {
  if (params == nullptr) return;
  *params = flare_bwd_params{};
  params->struct_size = sizeof(flare_bwd_params);
  params->attn.window_left = -1;
  params->attn.window_right = -1;
}

FLARE_API void flare_kvcache_params_init(flare_kvcache_params* params) {
  if (params == nullptr) return;
  *params = flare_kvcache_params{};
  params->struct_size = sizeof(flare_kvcache_params);
  params->attn.window_left = -1;
  params->attn.window_right = -1;
}

FLARE_API flare_status flare_fwd(const flare_fwd_params* params) {
  return flare::detail::run_fwd(params, false);
}

FLARE_API flare_status flare_fwd_varlen(const flare_fwd_params* params) {
  return flare::detail::run_fwd(params, true);
}

FLARE_API flare_status flare_bwd(const flare_bwd_params* params) {
  return flare::detail::run_bwd(params, false);
}

FLARE_API flare_status flare_bwd_varlen(const flare_bwd_params* params) {
  return flare::detail::run_bwd(params, true);
}

FLARE_API flare_status flare_fwd_kvcache(const flare_kvcache_params* params) {
  return guarded("flare_fwd_kvcache", [&] {
    Problem problem;
    if (flare_status s = flare::detail::validate_kvcache(params, &problem); s != FLARE_OK) return s;
    return flare::detail::dispatch(problem, flare::cpu::kvcache);
  });
}

FLARE_API flare_status flare_fwd_workspace_size(const flare_fwd_params* params, int32_t varlen,
                                                size_t* bytes) {
  return guarded("flare_fwd_workspace_size", [&] {
    if (flare_status s = flare::detail::check_bytes_and_varlen(bytes, varlen); s != FLARE_OK) return s;
    Problem problem;
    if (flare_status s = flare::detail::validate_fwd(params, varlen == 1, &problem); s != FLARE_OK) return s;
    return flare::detail::report_workspace(problem, bytes);
  });
}

FLARE_API flare_status flare_bwd_workspace_size(const flare_bwd_params* params, int32_t varlen,
                                                size_t* bytes) {
  return guarded("flare_bwd_workspace_size", [&] {
    if (flare_status s = flare::detail::check_bytes_and_varlen(bytes, varlen); s != FLARE_OK) return s;
    Problem problem;
    if (flare_status s = flare::detail::validate_bwd(params, varlen == 1, &problem); s != FLARE_OK) return s;
    return flare::detail::report_workspace(problem, bytes);
  });
}

FLARE_API flare_status flare_kvcache_workspace_size(const flare_kvcache_params* params, size_t* bytes) {
  return guarded("flare_kvcache_workspace_size", [&] {
    if (flare_status s = flare::detail::check_bytes_and_varlen(bytes, 0); s != FLARE_OK) return s;
    Problem problem;
    if (flare_status s = flare::detail::validate_kvcache(params, &problem); s != FLARE_OK) return s;
    return flare::detail::report_workspace(problem, bytes);
  });
}

FLARE_API flare_status flare_dropout_mask(float dropout_p, uint64_t dropout_seed, uint64_t dropout_offset,
                                          int64_t sequence, int64_t nheads, int64_t seqlen_q, int64_t seqlen_k,
                                          uint8_t* mask) {
  return guarded("flare_dropout_mask", [&] {
    return flare::detail::dropout_mask(dropout_p, dropout_seed, dropout_offset, sequence, nheads, seqlen_q,
                                       seqlen_k, mask);
  });
}

FLARE_API void flare_merge_params_init(flare_merge_params* params) {
  if (params == nullptr) return;
  *params = flare_merge_params{};
  params->struct_size = sizeof(flare_merge_params);
}

FLARE_API flare_status flare_merge_states(const flare_merge_params* params) {
  return guarded("flare_merge_states", [&] {
    flare::detail::MergeProblem problem;
    if (flare_status s = flare::detail::validate_merge(params, &problem); s != FLARE_OK) return s;
    return flare::cpu::merge_states(problem);
  });
}

FLARE_API const char* flare_cpu_isa(void) {
  try {
    return flare::cpu::isa_name();
  } catch (...) {
    return "generic";
  }
}

FLARE_API int32_t flare_has_cuda(void) { return FLARE_WITH_CUDA ? 1 : 0; }

}  // extern "C"

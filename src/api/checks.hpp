// checks.hpp — the building blocks of argument validation (src/api/validate*.cpp): the rules every
// tensor obeys, and the option rules shared by every pass.
//
// Each check either returns or throws InvalidInput; the validate_* functions catch it once at their
// boundary and turn it into detail::fail(status, message), so the exception never leaves src/api.
// Every message names the argument, its value and the rule it breaks.
#pragma once

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <string>
#include <utility>

#include "common/error.hpp"
#include "common/problem.hpp"
#include "flare/flare.h"

namespace flare::detail {

// A rule broken by the caller's arguments (status FLARE_INVALID_ARGUMENT or FLARE_UNSUPPORTED).
struct InvalidInput {
  flare_status status;
  std::string message;
};

[[noreturn]] void reject(std::string message);              // FLARE_INVALID_ARGUMENT
[[noreturn]] void reject_unsupported(std::string message);  // FLARE_UNSUPPORTED

constexpr int64_t kInt32Max = 2147483647;

// Bytes per element; 0 for a value outside flare_dtype.
size_t dtype_size(int32_t dtype);
// "cpu", "cuda:1", ...
std::string device_name(const flare_device& device);
// "(2, 128, 8, 64)"
std::string shape_string(const flare_tensor& t);

inline bool is_present(const flare_tensor& t) { return t.rank != 0; }
inline bool same_device(const flare_device& a, const flare_device& b) {
  return a.type == b.type && a.index == b.index;
}
bool has_zero_elements(const flare_tensor& t);

// The rules every present tensor obeys: rank 1..FLARE_MAX_RANK, a known dtype and device, shapes and
// strides >= 0, the last dimension contiguous (stride 1, unless it has a single element), an element span
// that fits in int64, non-null and dtype-aligned data unless the tensor has no elements.
void check_tensor(const flare_tensor& t, const char* name);

// Rejects an absent tensor that the call needs.
void require_present(const flare_tensor& t, const char* name);
// Rejects a present tensor that this entry point does not take; `why` says which entry does.
void require_absent(const flare_tensor& t, const char* name, const char* why);

// Rank and every extent. `layout` spells the expected dims, e.g. "(batch, seqlen_q, nheads, headdim_v)".
void require_shape(const flare_tensor& t, const char* name, std::initializer_list<int64_t> dims,
                   const char* layout);

void require_dtype(const flare_tensor& t, const char* name, flare_dtype dtype, const char* why);
// t has the dtype of `ref` (named ref_name).
void require_same_dtype(const flare_tensor& t, const char* name, const flare_tensor& ref,
                        const char* ref_name);
void require_same_device(const flare_tensor& t, const char* name, const flare_tensor& ref,
                         const char* ref_name);

// A tensor the call writes: no two elements may share an address (zero or interleaved strides).
void require_no_overlap(const flare_tensor& t, const char* name);

// `what` (e.g. "q.shape[1] (seqlen_q)") fits in int32, since index tensors hold int32 positions.
void require_int32(int64_t value, const char* what);

// Element `i` of a rank-1 int32 tensor (or element (row, i) of a rank-2 one) on the CPU.
inline int32_t read_i32(const flare_tensor& t, int64_t i) {
  return static_cast<const int32_t*>(t.data)[i];
}
inline int32_t read_i32(const flare_tensor& t, int64_t row, int64_t i) {
  return static_cast<const int32_t*>(t.data)[row * t.strides[0] + i];
}

// Runs checks that may throw InvalidInput; returns FLARE_OK, or the status with its message set as the
// thread's last error.
template <class Fn>
flare_status run_checks(Fn&& fn) {
  try {
    fn();
    return FLARE_OK;
  } catch (InvalidInput& e) {
    return fail(e.status, std::move(e.message));
  }
}

// ---- shared by every pass ----------------------------------------------------------------------------

// The params pointer is non-null and its struct_size covers at least `minimum` bytes: the fields of the first
// version of the struct (`type` names it). Fields appended since are read only where struct_size covers them.
void check_struct_size(const void* params, size_t struct_size, size_t minimum, const char* type);

// Whether the caller's struct (its struct_size) reaches to the end of a field appended after 0.1.0.
template <class Params, class Field>
bool covers(const Params& params, Field Params::*field) {
  const char* base = reinterpret_cast<const char*>(&params);
  const char* at = reinterpret_cast<const char*>(&(params.*field));
  return params.struct_size >= static_cast<size_t>(at - base) + sizeof(Field);
}

// A params struct's arch_path: one of flare_arch_path's values.
flare_arch_path check_arch_path(int32_t arch_path);

// Head counts: both >= 1 and nheads a multiple of nheads_k (k_name: "k" or "k_cache").
void check_heads(int64_t nheads, int64_t nheads_k, const char* k_name);
// A call's head dims (what: "q.shape[3] (headdim)", "v.shape[3] (headdim_v)") on q's device. The library's
// rule, INVALID_ARGUMENT past it: headdim in 1..576 and headdim_v in 1..512 (the CPU backend's range,
// cpu::kMaxHeaddim / kMaxHeaddimV). On CUDA, a head dim wider than every CUDA kernel of the call's kind is
// FLARE_UNSUPPORTED: the call is valid, but only the CPU backend runs it. The attention kernels take the whole
// range; the KV-cache kernels (kv_cache) take head dims up to their widest tile (256).
void check_head_dims(int64_t headdim, const char* headdim_what, int64_t headdim_v, const char* headdim_v_what,
                     const flare_device& device, bool kv_cache = false);

// q's dtype is one the device can compute with: F32/F16/BF16 everywhere, F64 on the CPU, E4M3 on CUDA in
// forward passes (`allow_fp8`). Unknown or index dtypes are invalid; valid ones this device or pass cannot
// run are FLARE_UNSUPPORTED.
void check_compute_dtype(const flare_tensor& q, const char* name, bool allow_fp8);
// The dtype `out` must have for inputs of q's dtype: q's own, or F16/BF16 for E4M3 inputs.
void require_output_dtype(const flare_tensor& out, const char* name, const flare_tensor& q);

// Checks attn (scale, softcap, causal, windows, ALiBi slopes against batch and nheads, on q's device) and
// returns the normalised score parameters (scale resolved, causal folded into window_right = 0).
ScoreParams check_attn_options(const flare_attn_options& attn, const flare_tensor& q, int64_t batch,
                               int64_t nheads, int64_t headdim);
// Learnable sinks (flare.h) of a call whose q has nheads heads: absent (nullptr), or fp32 (nheads) on q's
// device, and then its data. `name` is "sinks" or "dsinks" (the backward's gradient, which is written).
float* check_sinks(const flare_tensor& sinks, const char* name, const flare_tensor& q, int64_t nheads);
// Dropout's probability (flare.h): finite, in [0, 1).
float check_dropout_p(float dropout_p);

// Checks exec and copies it into the problem; the device comes from `device`.
void check_exec_options(const flare_exec_options& exec, const flare_device& device, Problem* problem);

// The (batch, token, head, dim) view of a rank-4 tensor, and of a rank-3 varlen one (no batch stride).
inline Operand dense_operand(const flare_tensor& t) {
  return {t.data, t.strides[0], t.strides[1], t.strides[2]};
}
inline Operand varlen_operand(const flare_tensor& t) { return {t.data, 0, t.strides[0], t.strides[1]}; }

}  // namespace flare::detail

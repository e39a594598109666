// checks.cpp — per-tensor and per-option validation rules shared by every pass (see checks.hpp).
#include "api/checks.hpp"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>

#include "cpu/cpu_backend.hpp"
#include "cuda/instantiations/head_dims.hpp"

namespace flare::detail {

void reject(std::string message) { throw InvalidInput{FLARE_INVALID_ARGUMENT, std::move(message)}; }

void reject_unsupported(std::string message) {
  throw InvalidInput{FLARE_UNSUPPORTED, std::move(message)};
}

size_t dtype_size(int32_t dtype) {
  switch (dtype) {
    case FLARE_DTYPE_F32: return 4;
    case FLARE_DTYPE_F16: return 2;
    case FLARE_DTYPE_BF16: return 2;
    case FLARE_DTYPE_F64: return 8;
    case FLARE_DTYPE_I32: return 4;
    case FLARE_DTYPE_E4M3: return 1;
    default: return 0;
  }
}

std::string device_name(const flare_device& device) {
  switch (device.type) {
    case FLARE_DEVICE_CPU: return device.index == 0 ? "cpu" : cat("cpu:", device.index);
    case FLARE_DEVICE_CUDA: return cat("cuda:", device.index);
    default: return cat("device type ", device.type, " index ", device.index);
  }
}

std::string shape_string(const flare_tensor& t) {
  std::string s = "(";
  const int rank = std::clamp(t.rank, 0, FLARE_MAX_RANK);
  for (int d = 0; d < rank; ++d) s += cat(d ? ", " : "", t.shape[d]);
  return s + ")";
}

bool has_zero_elements(const flare_tensor& t) {
  for (int d = 0; d < t.rank && d < FLARE_MAX_RANK; ++d) {
    if (t.shape[d] == 0) return true;
  }
  return false;
}

void check_tensor(const flare_tensor& t, const char* name) {
  if (t.rank < 1 || t.rank > FLARE_MAX_RANK) {
    reject(cat(name, ".rank is ", t.rank, ": a tensor has rank 1..", FLARE_MAX_RANK,
               " (0 means absent)"));
  }
  if (dtype_size(t.dtype) == 0) {
    reject(cat(name, ".dtype is ", t.dtype, ": not a flare_dtype value"));
  }
  if (t.device.type != FLARE_DEVICE_CPU && t.device.type != FLARE_DEVICE_CUDA) {
    reject(cat(name, ".device.type is ", t.device.type,
               ": must be FLARE_DEVICE_CPU (0) or FLARE_DEVICE_CUDA (1)"));
  }
  if (t.device.type == FLARE_DEVICE_CPU && t.device.index != 0) {
    reject(cat(name, ".device.index is ", t.device.index, ": the CPU device has index 0"));
  }
  if (t.device.type == FLARE_DEVICE_CUDA && t.device.index < 0) {
    reject(cat(name, ".device.index is ", t.device.index, ": a CUDA ordinal is >= 0"));
  }
  for (int d = 0; d < t.rank; ++d) {
    if (t.shape[d] < 0) reject(cat(name, ".shape[", d, "] is ", t.shape[d], ": extents must be >= 0"));
    if (t.strides[d] < 0) {
      reject(cat(name, ".strides[", d, "] is ", t.strides[d], ": strides must be >= 0"));
    }
  }
  const int last = t.rank - 1;
  if (t.shape[last] > 1 && t.strides[last] != 1) {
    reject(cat(name, ".strides[", last, "] is ", t.strides[last],
               ": the last dimension must be contiguous (stride 1)"));
  }
  if (has_zero_elements(t)) return;  // nothing is addressed, so data may be null

  // The offset of the last element, and its byte span, must fit in int64.
  int64_t span = 0;
  for (int d = 0; d < t.rank; ++d) {
    int64_t term = 0;
    if (__builtin_mul_overflow(t.shape[d] - 1, t.strides[d], &term) ||
        __builtin_add_overflow(span, term, &span)) {
      reject(cat(name, " with shape ", shape_string(t), " and strides[", d, "] = ", t.strides[d],
                 " spans more than 2^63 elements: offsets must fit in int64"));
    }
  }
  int64_t elements = 0, bytes = 0;
  if (__builtin_add_overflow(span, 1, &elements) ||
      __builtin_mul_overflow(elements, static_cast<int64_t>(dtype_size(t.dtype)), &bytes)) {
    reject(cat(name, " with shape ", shape_string(t), " spans ", span, " + 1 elements of ", dtype_name(t.dtype),
               ": its byte size must fit in int64"));
  }
  if (t.data == nullptr) {
    reject(cat(name, ".data is null but ", name, " has shape ", shape_string(t),
               ": only a tensor with zero elements may have null data"));
  }
  const auto address = reinterpret_cast<uintptr_t>(t.data);
  if (address % dtype_size(t.dtype) != 0) {
    reject(cat(name, ".data is ", t.data, ": ", dtype_name(t.dtype), " data must be aligned to ",
               dtype_size(t.dtype), " bytes"));
  }
}

void require_present(const flare_tensor& t, const char* name) {
  if (!is_present(t)) reject(cat(name, " is absent (rank 0) but this call needs it"));
}

void require_absent(const flare_tensor& t, const char* name, const char* why) {
  if (is_present(t)) reject(cat(name, " is given (rank ", t.rank, ") but ", why));
}

void require_shape(const flare_tensor& t, const char* name, std::initializer_list<int64_t> dims,
                   const char* layout) {
  const int rank = static_cast<int>(dims.size());
  bool same = t.rank == rank;
  for (int d = 0; same && d < rank; ++d) same = t.shape[d] == dims.begin()[d];
  if (same) return;
  std::string expected = "(";
  for (int d = 0; d < rank; ++d) expected += cat(d ? ", " : "", dims.begin()[d]);
  expected += ")";
  if (t.rank != rank) {
    reject(cat(name, " has rank ", t.rank, " (shape ", shape_string(t), ") but must have rank ", rank,
               ": ", layout, " = ", expected));
  }
  reject(cat(name, " has shape ", shape_string(t), " but must be ", layout, " = ", expected));
}

void require_dtype(const flare_tensor& t, const char* name, flare_dtype dtype, const char* why) {
  if (t.dtype != dtype) {
    reject(cat(name, ".dtype is ", dtype_name(t.dtype), ": ", why, " (", dtype_name(dtype), ")"));
  }
}

void require_same_dtype(const flare_tensor& t, const char* name, const flare_tensor& ref,
                        const char* ref_name) {
  if (t.dtype != ref.dtype) {
    reject(cat(name, ".dtype is ", dtype_name(t.dtype), " but ", ref_name, ".dtype is ",
               dtype_name(ref.dtype), ": ", name, " must have the dtype of ", ref_name));
  }
}

void require_same_device(const flare_tensor& t, const char* name, const flare_tensor& ref,
                         const char* ref_name) {
  if (!same_device(t.device, ref.device)) {
    reject(cat(name, " is on ", device_name(t.device), " but ", ref_name, " is on ",
               device_name(ref.device), ": all tensors of a call must be on one device"));
  }
}

void require_no_overlap(const flare_tensor& t, const char* name) {
  if (has_zero_elements(t)) return;
  // Visit dims from the smallest stride up; each must step past everything the smaller ones reach.
  std::array<int, FLARE_MAX_RANK> order{};
  int n = 0;
  for (int d = 0; d < t.rank; ++d) {
    if (t.shape[d] > 1) order[n++] = d;
  }
  for (int i = 1; i < n; ++i) {  // insertion sort by stride: at most FLARE_MAX_RANK dims
    for (int j = i; j > 0 && t.strides[order[j]] < t.strides[order[j - 1]]; --j) {
      std::swap(order[j], order[j - 1]);
    }
  }
  int64_t reach = 0;  // largest offset reachable with the dims visited so far
  for (int i = 0; i < n; ++i) {
    const int d = order[i];
    if (t.strides[d] <= reach) {
      reject(cat(name, " has shape ", shape_string(t), " and strides[", d, "] = ", t.strides[d],
                 ": an output's elements must not overlap (each stride must exceed the span of the "
                 "smaller ones)"));
    }
    reach += (t.shape[d] - 1) * t.strides[d];  // cannot overflow: check_tensor bounded the span
  }
}

void require_int32(int64_t value, const char* what) {
  if (value > kInt32Max) {
    reject(cat(what, " is ", value, ": it must fit in int32 (<= ", kInt32Max,
               ") because flare's index tensors are int32"));
  }
}

void check_struct_size(const void* params, size_t struct_size, size_t minimum, const char* type) {
  if (params == nullptr) {
    reject(cat("params is null: pass a ", type, " set up by ", type, "_init"));
  }
  if (struct_size < minimum) {
    reject(cat("params->struct_size is ", struct_size, " but a ", type, " has at least ", minimum,
               " bytes: set it up with ", type, "_init"));
  }
}

flare_arch_path check_arch_path(int32_t arch_path) {
  switch (arch_path) {
    case FLARE_ARCH_PATH_AUTO:
    case FLARE_ARCH_PATH_SM80:
    case FLARE_ARCH_PATH_SM90: return static_cast<flare_arch_path>(arch_path);
  }
  reject(cat("arch_path is ", arch_path, ": it must be FLARE_ARCH_PATH_AUTO (0), FLARE_ARCH_PATH_SM80 (80) or "
             "FLARE_ARCH_PATH_SM90 (90)"));
}

// The widest head dim any CUDA attention kernel of any build takes: the largest sm80 tile (a call runs on the
// smallest tile >= its head dims) or sm90 head dim; the same for the KV-cache kernels.
constexpr int64_t kCudaMaxHeaddim = std::max(*std::ranges::max_element(cuda::kSm80HeadDims),
                                             *std::ranges::max_element(cuda::kSm90HeadDims));
constexpr int64_t kCudaKvCacheMaxHeaddim = *std::ranges::max_element(cuda::kDecodeHeadDims);
static_assert(kCudaMaxHeaddim >= cpu::kMaxHeaddim && kCudaMaxHeaddim >= cpu::kMaxHeaddimV,
              "the CUDA attention kernels take every head dim the C ABI does (multiples of 8)");

void check_head_dims(int64_t headdim, const char* headdim_what, int64_t headdim_v, const char* headdim_v_what,
                     const flare_device& device, bool kv_cache) {
  const std::string rule = cat("headdim (q, k) must be in 1..", cpu::kMaxHeaddim, " and headdim_v (v, out) in 1..",
                               cpu::kMaxHeaddimV);
  if (headdim < 1 || headdim > cpu::kMaxHeaddim) reject(cat(headdim_what, " is ", headdim, ": ", rule));
  if (headdim_v < 1 || headdim_v > cpu::kMaxHeaddimV) reject(cat(headdim_v_what, " is ", headdim_v, ": ", rule));
  // The attention kernels take the whole range (the static_assert above); the KV-cache kernels stop short of it.
  if (device.type != FLARE_DEVICE_CUDA || !kv_cache) return;
  for (const auto& [value, what] : {std::pair{headdim, headdim_what}, std::pair{headdim_v, headdim_v_what}}) {
    if (value > kCudaKvCacheMaxHeaddim) {
      reject_unsupported(cat(what, " is ", value, " on ", device_name(device), ": the CUDA KV-cache kernels take "
                             "head dims up to ", kCudaKvCacheMaxHeaddim, "; head dims up to ", cpu::kMaxHeaddim,
                             " (headdim_v up to ", cpu::kMaxHeaddimV, ") run on the CPU"));
    }
  }
}

float check_dropout_p(float dropout_p) {
  if (!(dropout_p >= 0.0f && dropout_p < 1.0f)) {
    reject(cat("dropout_p is ", dropout_p, ": it must be in [0, 1) (0 is no dropout)"));
  }
  return dropout_p;
}

float* check_sinks(const flare_tensor& sinks, const char* name, const flare_tensor& q, int64_t nheads) {
  if (!is_present(sinks)) return nullptr;
  check_tensor(sinks, name);
  require_same_device(sinks, name, q, "q");
  require_dtype(sinks, name, FLARE_DTYPE_F32, "sinks are fp32, one logit per query head");
  require_shape(sinks, name, {nheads}, "(nheads)");
  return static_cast<float*>(sinks.data);
}

void check_heads(int64_t nheads, int64_t nheads_k, const char* k_name) {
  if (nheads < 1) reject(cat("q has ", nheads, " heads: it needs at least 1"));
  if (nheads_k < 1) reject(cat(k_name, " has ", nheads_k, " heads: it needs at least 1"));
  if (nheads % nheads_k != 0) {
    reject(cat(k_name, " has ", nheads_k, " heads but q has ", nheads,
               ": q heads must be a multiple of k heads"));
  }
}

void check_compute_dtype(const flare_tensor& q, const char* name, bool allow_fp8) {
  switch (q.dtype) {
    case FLARE_DTYPE_F32:
    case FLARE_DTYPE_F16:
    case FLARE_DTYPE_BF16:
      return;
    case FLARE_DTYPE_F64:
      if (q.device.type == FLARE_DEVICE_CPU) return;
      reject_unsupported(cat(name, ".dtype is F64 on ", device_name(q.device),
                             ": F64 attention runs on the CPU only"));
    case FLARE_DTYPE_E4M3:
      if (q.device.type == FLARE_DEVICE_CPU) {
        reject_unsupported(cat(name, ".dtype is E4M3: the CPU backend does not take FP8 inputs "
                                     "(it takes F32, F16, BF16, F64)"));
      }
      if (!allow_fp8) {
        reject_unsupported(cat(name, ".dtype is E4M3: FP8 inputs are taken by the forward pass only"));
      }
      return;
    default:
      reject(cat(name, ".dtype is ", dtype_name(q.dtype),
                 ": q, k and v must be F32, F16, BF16 or F64 (E4M3 on CUDA)"));
  }
}

void require_output_dtype(const flare_tensor& out, const char* name, const flare_tensor& q) {
  if (q.dtype != FLARE_DTYPE_E4M3) {
    require_same_dtype(out, name, q, "q");
  } else if (out.dtype != FLARE_DTYPE_F16 && out.dtype != FLARE_DTYPE_BF16) {
    reject(cat(name, ".dtype is ", dtype_name(out.dtype), ": with E4M3 inputs ", name,
               " must be F16 or BF16"));
  }
}

ScoreParams check_attn_options(const flare_attn_options& attn, const flare_tensor& q, int64_t batch,
                               int64_t nheads, int64_t headdim) {
  ScoreParams score;
  if (!std::isfinite(attn.softmax_scale) || attn.softmax_scale < 0.0f) {
    reject(cat("attn.softmax_scale is ", attn.softmax_scale,
               ": it must be 0 (meaning 1/sqrt(headdim)) or finite and > 0"));
  }
  // The default is resolved in double: fp64 inputs use it at full precision, lower dtypes round it.
  score.scale = attn.softmax_scale == 0.0f ? 1.0 / std::sqrt(double(headdim)) : double(attn.softmax_scale);
  if (!std::isfinite(attn.softcap) || attn.softcap < 0.0f) {
    reject(cat("attn.softcap is ", attn.softcap, ": it must be 0 (off) or finite and > 0"));
  }
  score.softcap = attn.softcap;
  if (attn.causal != 0 && attn.causal != 1) {
    reject(cat("attn.causal is ", attn.causal, ": it must be 0 or 1"));
  }
  if (attn.window_left < -1) {
    reject(cat("attn.window_left is ", attn.window_left, ": it must be -1 (unbounded) or >= 0"));
  }
  if (attn.window_right < -1) {
    reject(cat("attn.window_right is ", attn.window_right, ": it must be -1 (unbounded) or >= 0"));
  }
  score.window_left = attn.window_left;
  // causal is the window's right side at the diagonal (it overrides window_right, as in FlashAttention)
  score.window_right = attn.causal ? 0 : attn.window_right;

  const flare_tensor& alibi = attn.alibi_slopes;
  if (is_present(alibi)) {
    check_tensor(alibi, "attn.alibi_slopes");
    require_same_device(alibi, "attn.alibi_slopes", q, "q");
    require_dtype(alibi, "attn.alibi_slopes", FLARE_DTYPE_F32, "ALiBi slopes are fp32");
    if (alibi.rank == 1) {
      require_shape(alibi, "attn.alibi_slopes", {nheads}, "(nheads)");
      score.alibi_batch_stride = 0;
    } else if (alibi.rank == 2) {
      require_shape(alibi, "attn.alibi_slopes", {batch, nheads}, "(batch, nheads)");
      score.alibi_batch_stride = alibi.strides[0];
    } else {
      reject(cat("attn.alibi_slopes has rank ", alibi.rank, " (shape ", shape_string(alibi),
                 "): it must be (nheads) = (", nheads, ") or (batch, nheads) = (", batch, ", ", nheads,
                 ")"));
    }
    score.alibi_slopes = static_cast<const float*>(alibi.data);
  }
  return score;
}

void check_exec_options(const flare_exec_options& exec, const flare_device& device, Problem* problem) {
  if (exec.num_threads < 0) {
    reject(cat("exec.num_threads is ", exec.num_threads, ": it must be 0 (OpenMP's default) or > 0"));
  }
  // 0 (the default) needs no bound: max_threads() asks the OS for the affinity mask, a system call per call.
  if (device.type == FLARE_DEVICE_CPU && exec.num_threads > 0 && exec.num_threads > cpu::max_threads()) {
    reject(cat("exec.num_threads is ", exec.num_threads, " but the CPU backend runs at most ", cpu::max_threads(),
               " threads here (the larger of ", cpu::kMaxThreadsFloor,
               " and the processor count, capped by OpenMP's thread limit, OMP_THREAD_LIMIT)"));
  }
  problem->num_threads = exec.num_threads;
  problem->workspace = exec.workspace;
  problem->workspace_size = exec.workspace != nullptr ? exec.workspace_size : 0;
  problem->stream = exec.stream;
  problem->device = device;
}

}  // namespace flare::detail

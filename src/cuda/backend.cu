// backend.cu — the host side of the CUDA backend: CUDA-specific checks, Problem -> kernel params, the choice
// of head-dim tile, the backward workspace (caller's, or stream-ordered cudaMallocAsync), and dispatch to the
// generated sm80 units (src/cuda/instantiations/dispatch.hpp). Kernels run on the caller's stream; nothing here
// synchronises the device.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <string>
#include <string_view>

#include "common/error.hpp"
#include "cuda/cuda_backend.hpp"
#include "cuda/instantiations/dispatch.hpp"  // with CMake's flare_cuda_config.hpp: the units of this build
#include "cuda/instantiations/head_dims.hpp"
#include "cuda/sm80/entry.hpp"

namespace flare::cuda {
namespace {

using detail::cat;
using detail::fail;
using detail::Problem;

std::string built_tiles() {
  std::string s;
  for (int d : kSm80HeadDims) {
    if (sm80_unit_built(d)) s += cat(s.empty() ? "" : ", ", d);
  }
  return s.empty() ? "none" : s;
}

// Switches to the tensors' device for the duration of a call and back.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    if (cudaGetDevice(&previous_) != cudaSuccess) previous_ = -1;
    if (previous_ != device) status_ = cudaSetDevice(device);
  }
  ~DeviceGuard() {
    if (previous_ >= 0) cudaSetDevice(previous_);
  }
  cudaError_t status() const { return status_; }

 private:
  int previous_ = -1;
  cudaError_t status_ = cudaSuccess;
};

flare_status cuda_fail(cudaError_t e, const char* what) {
  cudaGetLastError();  // clear a sticky-free error so later calls start clean
  return fail(FLARE_CUDA_ERROR, cat(what, ": ", cudaGetErrorName(e), " (", cudaGetErrorString(e), ")"));
}

// The kernels one call runs: its head-dim tile and shared-memory class.
struct Choice {
  int tile = 0;
  SmemClass cls = SmemClass::kLarge;
};

// The shared memory per block the kernels may use: the device's opt-in limit, or less when the environment
// sets FLARE_CUDA_SMEM_LIMIT (bytes; tests use it to run the small class on a large GPU).
int smem_limit(int device_limit) {
  const char* env = std::getenv("FLARE_CUDA_SMEM_LIMIT");
  if (env == nullptr || *env == '\0') return device_limit;
  char* end = nullptr;
  const long v = std::strtol(env, &end, 10);
  if (*end != '\0' || v <= 0) return device_limit;  // malformed: ignored, as an unset variable
  return static_cast<int>(std::min<long>(v, device_limit));
}

// The forward tile the environment forces with FLARE_CUDA_FWD_ROWS (64 or 128 query rows per CTA; tests run
// both shapes whatever the lengths would pick), else 0: forward_shape's rule.
int forced_forward_rows() {
  const char* env = std::getenv("FLARE_CUDA_FWD_ROWS");
  if (env == nullptr) return 0;
  const std::string_view v(env);
  return v == "64" ? 64 : v == "128" ? 128 : 0;  // anything else: ignored, as an unset variable
}

// What the GPU path needs beyond the C ABI's rules, for the problem's pass (forward or backward): picks the
// head-dim tile and the shared-memory class and checks that the kernel fits the GPU's shared memory.
// The class: small on sm_86 / sm_87 / sm_89 (the cubins those GPUs run hold only the small one, see
// sm80::body_here) and wherever the large one does not fit; else large.
flare_status check_problem(const Problem& p, Choice* out) {
  const bool bwd = p.pass == detail::Pass::kBackward;
  const char* pass = bwd ? "the backward" : "the forward";
  if (p.dtype != FLARE_DTYPE_F16 && p.dtype != FLARE_DTYPE_BF16) {
    return fail(FLARE_UNSUPPORTED, cat(pass, " on CUDA takes fp16 or bf16 tensors (dtype ", p.dtype,
                                "): convert fp32 inputs to bf16/fp16, or run on the CPU"));
  }
  if (p.headdim % 8 != 0 || p.headdim_v % 8 != 0) {
    return fail(FLARE_UNSUPPORTED, cat("headdim ", p.headdim, " / headdim_v ", p.headdim_v, ": on CUDA head dims "
                                "must be multiples of 8 (pad q, k and v with zeros to the next one)"));
  }
  // Every row must start on a 16-byte boundary for the 16-byte copies.
  const std::pair<const detail::Operand*, const char*> operands[] = {
      {&p.q, "q"}, {&p.k, "k"}, {&p.v, "v"}, {&p.out, "out"}, {&p.dout, "dout"}, {&p.dq, "dq"},
      {&p.dk, "dk"}, {&p.dv, "dv"}};
  for (const auto& [op, name] : operands) {
    if (op->data == nullptr) continue;
    if (reinterpret_cast<uintptr_t>(op->data) % 16 != 0) {
      return fail(FLARE_UNSUPPORTED, cat(name, ".data is not 16-byte aligned: the CUDA path reads and writes rows "
                                  "with 16-byte vectors"));
    }
    if (op->batch_stride % 8 != 0 || op->row_stride % 8 != 0 || op->head_stride % 8 != 0) {
      return fail(FLARE_UNSUPPORTED, cat(name, " has strides (batch ", op->batch_stride, ", token ", op->row_stride,
                                  ", head ", op->head_stride, "): on CUDA they must be multiples of 8 "
                                  "elements (16 bytes); make the tensor contiguous"));
    }
  }
  const int width = static_cast<int>(std::max(p.headdim, p.headdim_v));
  int tile = 0;
  for (int d : kSm80HeadDims) {
    if (sm80_unit_built(d) && d >= width) {
      tile = d;
      break;
    }
  }
  if (tile == 0) {
    return fail(FLARE_UNSUPPORTED, cat("head dim ", width, " has no kernel in this build (head-dim tiles built: ",
                                built_tiles(), "; configure with FLARE_HEADDIMS to add tiles)"));
  }
  // Attributes, not cudaGetDeviceProperties: that one queries everything and costs far more per call.
  int major = 0, minor = 0, smem = 0;
  for (auto [attr, out] : {std::pair{cudaDevAttrComputeCapabilityMajor, &major},
                           std::pair{cudaDevAttrComputeCapabilityMinor, &minor},
                           std::pair{cudaDevAttrMaxSharedMemoryPerBlockOptin, &smem}}) {
    if (cudaError_t e = cudaDeviceGetAttribute(out, attr, p.device.index); e != cudaSuccess) {
      return cuda_fail(e, "cudaDeviceGetAttribute");
    }
  }
  if (major < 8) {
    cudaDeviceProp prop{};
    const bool named = cudaGetDeviceProperties(&prop, p.device.index) == cudaSuccess;
    return fail(FLARE_UNSUPPORTED, cat("cuda:", p.device.index, " (", named ? prop.name : "?", ") is sm_", major,
                                       minor, ": flare's CUDA kernels need sm_80 or newer (Ampere, Ada, Hopper)"));
  }
  if (p.batch > 65535) {
    return fail(FLARE_UNSUPPORTED, cat("batch is ", p.batch, ": the CUDA path takes at most 65535 sequences "
                                       "per call; split the batch"));
  }
  const auto smem_needed = [&](SmemClass c) {
    return sm80_dispatch(p.dtype, tile, 0, [&]<flare_dtype D, int d>() {
      return bwd ? sm80::backward_smem_bytes<D, d>(c) : sm80::forward_smem_bytes<D, d>(c);
    });
  };
  const int limit = smem_limit(smem);
  const bool small_arch = major == 8 && minor != 0;
  const SmemClass cls = small_arch || smem_needed(SmemClass::kLarge) > limit ? SmemClass::kSmall : SmemClass::kLarge;
  const int needed = smem_needed(cls);
  if (needed > limit) {
    return fail(FLARE_UNSUPPORTED, cat(pass, " kernel for head dim tile ", tile, " needs ", needed,
                                       " bytes of shared memory per block but this GPU allows ", limit));
  }
#ifndef FLARE_CUDA_ALL_CONFIGS
  if (bwd && cls == SmemClass::kSmall && major >= 9) {
    return fail(FLARE_UNSUPPORTED, cat(pass, " kernel for head dim tile ", tile, " needs ",
                                       smem_needed(SmemClass::kLarge), " bytes of shared memory per block but this "
                                       "GPU allows ", limit, "; the kernels that fit (<= ", kSmallSmemBytes,
                                       " bytes) are compiled for sm_8x only (or with FLARE_CUDA_ALL_CONFIGS=ON)"));
  }
#endif
  *out = Choice{tile, cls};
  return FLARE_OK;
}

Tensor3 tensor3(const detail::Operand& o) { return Tensor3{o.data, o.batch_stride, o.row_stride, o.head_stride}; }

void fill_attn(const Problem& p, AttnParams* a) {
  a->q = tensor3(p.q);
  a->k = tensor3(p.k);
  a->v = tensor3(p.v);
  a->out = tensor3(p.out);
  a->lse = p.lse;
  a->lse_batch_stride = p.lse_batch_stride;
  a->lse_head_stride = p.lse_head_stride;
  a->batch = static_cast<int>(p.batch);
  a->nheads = static_cast<int>(p.nheads);
  a->nheads_k = static_cast<int>(p.nheads_k);
  a->headdim = static_cast<int>(p.headdim);
  a->headdim_v = static_cast<int>(p.headdim_v);
  a->seqlen_q = static_cast<int>(p.seqlen_q);
  a->seqlen_k = static_cast<int>(p.seqlen_k);
  if (p.varlen) {
    a->cu_seqlens_q = p.cu_seqlens_q;
    a->cu_seqlens_k = p.cu_seqlens_k;
  }
  a->seqused_k = p.seqused_k;
  a->scale = static_cast<float>(p.score.scale);
  a->scale_log2 = static_cast<float>(p.score.scale * 1.4426950408889634);
  a->softcap = p.score.softcap;
  // Windows beyond the int range are unbounded in effect (lengths are int32).
  auto clamp_window = [](int64_t w) { return w < 0 ? -1 : static_cast<int>(std::min<int64_t>(w, 0x7fffffff)); };
  a->window_left = clamp_window(p.score.window_left);
  a->window_right = clamp_window(p.score.window_right);
  a->alibi_slopes = p.score.alibi_slopes;
  a->alibi_batch_stride = p.score.alibi_batch_stride;
}

// ---- the backward workspace ---------------------------------------------------------------------------------
struct BwdLayout {
  int64_t q_rows, k_rows;
  int seqlen_q_rounded, seqlen_k_rounded;
  int splits;
  size_t dsum, dq, dkv;  // bytes of each part (dkv: dk_accum + dv_accum)
  size_t total() const { return dsum + dq + dkv; }
};

constexpr size_t align256(size_t x) { return (x + 255) / 256 * 256; }

BwdLayout bwd_layout(const Problem& p, Choice k, int num_sms) {
  const int tile = k.tile;
  const int block_n =
      sm80_dispatch(p.dtype, tile, 1, [&]<flare_dtype D, int d>() { return sm80::backward_block_n<D, d>(k.cls); });
  BwdLayout l{};
  auto round128 = [](int64_t x) { return (x + kRowPad - 1) / kRowPad * kRowPad; };
  l.seqlen_q_rounded = static_cast<int>(round128(p.seqlen_q));
  l.seqlen_k_rounded = static_cast<int>(round128(p.seqlen_k));
  l.q_rows = p.varlen ? round128(p.total_q + p.batch * kRowPad) : p.batch * l.seqlen_q_rounded;
  l.k_rows = p.varlen ? round128(p.total_k + p.batch * kRowPad) : p.batch * l.seqlen_k_rounded;
  l.splits = 1;
  if (p.deterministic) {
    // Enough CTAs to fill the GPU twice over, at most 8 dq buffers (memory), at most one per key tile.
    const int64_t n_blocks = (p.seqlen_k + block_n - 1) / block_n;
    const int64_t heads = std::max<int64_t>(1, p.batch * p.nheads);
    const int64_t want = (2 * int64_t{num_sms} + heads - 1) / heads;
    l.splits = static_cast<int>(std::clamp<int64_t>(std::min(want, n_blocks), 1, 8));
  }
  l.dsum = align256(sizeof(float) * p.nheads * l.q_rows);
  l.dq = align256(sizeof(float) * l.splits * p.nheads * l.q_rows * tile);
  l.dkv = p.nheads != p.nheads_k ? 2 * align256(sizeof(float) * p.nheads * l.k_rows * tile) : 0;
  return l;
}

int sm_count(int device) {
  int n = 0;
  if (cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device) != cudaSuccess || n <= 0) n = 1;
  return n;
}

}  // namespace

flare_status forward(const Problem& p) {
  Choice k;
  if (flare_status s = check_problem(p, &k); s != FLARE_OK) return s;
  DeviceGuard guard(p.device.index);
  if (guard.status() != cudaSuccess) return cuda_fail(guard.status(), "cudaSetDevice");
  if (p.batch == 0 || p.seqlen_q == 0 || p.nheads == 0) return FLARE_OK;
  AttnParams a;
  fill_attn(p, &a);
  a.forward_rows = forced_forward_rows();
  auto stream = static_cast<cudaStream_t>(p.stream);
  const cudaError_t e = sm80_dispatch(p.dtype, k.tile, cudaErrorInvalidValue, [&]<flare_dtype D, int d>() {
    return sm80::run_forward<D, d>(a, stream, k.cls);
  });
  if (e != cudaSuccess) return cuda_fail(e, "launching the forward kernel");
  return FLARE_OK;
}

flare_status workspace_size(const Problem& p, size_t* bytes) {
  *bytes = 0;
  if (p.pass != detail::Pass::kBackward) return FLARE_OK;
  Choice k;
  if (flare_status s = check_problem(p, &k); s != FLARE_OK) return s;
  *bytes = bwd_layout(p, k, sm_count(p.device.index)).total();
  return FLARE_OK;
}

flare_status backward(const Problem& p) {
  Choice k;
  if (flare_status s = check_problem(p, &k); s != FLARE_OK) return s;
  DeviceGuard guard(p.device.index);
  if (guard.status() != cudaSuccess) return cuda_fail(guard.status(), "cudaSetDevice");
  auto stream = static_cast<cudaStream_t>(p.stream);

  const BwdLayout l = bwd_layout(p, k, sm_count(p.device.index));
  if (p.workspace != nullptr && reinterpret_cast<uintptr_t>(p.workspace) % 256 != 0) {
    return fail(FLARE_INVALID_ARGUMENT, "exec.workspace is not 256-byte aligned: the CUDA backward lays its fp32 "
                                        "buffers out from it (cudaMalloc and torch allocations are)");
  }
  if (p.workspace != nullptr && p.workspace_size < l.total()) {
    return fail(FLARE_OUT_OF_MEMORY, cat("exec.workspace_size is ", p.workspace_size, " bytes but this call "
                                         "needs ", l.total(), " bytes (see flare_bwd_workspace_size)"));
  }
  if (p.batch == 0 || p.nheads == 0) return FLARE_OK;

  void* ws = p.workspace;
  bool owned = false;
  if (ws == nullptr && l.total() > 0) {
    if (cudaError_t e = cudaMallocAsync(&ws, l.total(), stream); e != cudaSuccess) {
      cudaGetLastError();
      return fail(FLARE_OUT_OF_MEMORY, cat("cudaMallocAsync of the backward workspace (", l.total(),
                                           " bytes) failed: ", cudaGetErrorString(e)));
    }
    owned = true;
  }
  char* w = static_cast<char*>(ws);
  BwdParams b;
  fill_attn(p, &b);
  b.dout = tensor3(p.dout);
  b.dq = tensor3(p.dq);
  b.dk = tensor3(p.dk);
  b.dv = tensor3(p.dv);
  b.dsum = reinterpret_cast<float*>(w);
  b.dq_accum = reinterpret_cast<float*>(w + l.dsum);
  if (l.dkv > 0) {
    b.dk_accum = reinterpret_cast<float*>(w + l.dsum + l.dq);
    b.dv_accum = reinterpret_cast<float*>(w + l.dsum + l.dq + l.dkv / 2);
  }
  b.q_rows = l.q_rows;
  b.k_rows = l.k_rows;
  b.seqlen_q_rounded = l.seqlen_q_rounded;
  b.seqlen_k_rounded = l.seqlen_k_rounded;
  b.headdim_rounded = k.tile;
  b.dq_splits = l.splits;
  b.deterministic = p.deterministic;

  cudaError_t e = sm80_dispatch(p.dtype, k.tile, cudaErrorInvalidValue,
                                [&]<flare_dtype D, int d>() { return sm80::run_backward<D, d>(b, stream, k.cls); });
  if (owned) {
    const cudaError_t f = cudaFreeAsync(ws, stream);
    if (e == cudaSuccess) e = f;
  }
  if (e != cudaSuccess) return cuda_fail(e, "running the backward kernels");
  return FLARE_OK;
}

flare_status kvcache(const Problem&) {
  return fail(FLARE_UNSUPPORTED, "flare_fwd_kvcache has no CUDA kernels in this version: run the KV-cache pass "
                                 "on CPU tensors, or use flare_fwd / flare_fwd_varlen on the GPU");
}

}  // namespace flare::cuda

// backend.cu — the host side of the CUDA backend: CUDA-specific checks, the device's properties, the plan of a
// call (arch path, head-dim tile, shared-memory class: the rules are src/cuda/heuristics.hpp's), Problem ->
// kernel params, the backward workspace (caller's, or stream-ordered cudaMallocAsync), and dispatch to the
// generated units of each arch path (src/cuda/instantiations/dispatch.hpp). Kernels run on the caller's stream;
// nothing here synchronises the device.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <utility>

#include "common/error.hpp"
#include "common/philox.hpp"
#include "cuda/cuda_backend.hpp"
#include "cuda/heuristics.hpp"
#include "cuda/instantiations/dispatch.hpp"  // with CMake's flare_cuda_config.hpp: the units of this build
#include "cuda/sm80/entry.hpp"
#include "cuda/sm90/entry.hpp"

namespace flare::cuda {
namespace {

using detail::cat;
using detail::fail;
using detail::Pass;
using detail::Problem;

// The kernel units of this build (FLARE_HEADDIMS, FLARE_SM90, FLARE_CUDA_ALL_CONFIGS).
constexpr HeadDimSubset kSm80Tiles(kSm80HeadDims, sm80_unit_built);
constexpr HeadDimSubset kSm90Dims(kSm90HeadDims, sm90_unit_built);
#ifdef FLARE_CUDA_ALL_CONFIGS
constexpr bool kAllSmemConfigs = true;
#else
constexpr bool kAllSmemConfigs = false;
#endif
constexpr BuiltKernels kBuilt{kSm80Tiles.span(), kSm90Dims.span(), kAllSmemConfigs};
// The passes compiled (FLARE_CUDA_PASSES): code that names a pass's kernels sits under `if constexpr` on these,
// so a build without that pass links.
constexpr bool kHasForward = FLARE_HAS_PASS_FWD;
constexpr bool kHasBackward = FLARE_HAS_PASS_BWD;

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

flare_status cuda_fail(cudaError_t e, const std::string& what) {
  cudaGetLastError();  // clear a sticky-free error so later calls start clean
  return fail(FLARE_CUDA_ERROR, cat(what, ": ", cudaGetErrorName(e), " (", cudaGetErrorString(e), ")"));
}

// What every CUDA kernel needs beyond the C ABI's rules, whichever arch path runs it.
flare_status check_operands(const Problem& p) {
  const char* pass = p.pass == Pass::kBackward ? "the backward" : "the forward";
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
  if (p.batch > 65535) {
    return fail(FLARE_UNSUPPORTED, cat("batch is ", p.batch, ": the CUDA path takes at most 65535 sequences "
                                       "per call; split the batch"));
  }
  return FLARE_OK;
}

// The device's properties, by attribute: cudaGetDeviceProperties queries everything and costs far more per call.
// The shared memory is cut by FLARE_CUDA_SMEM_LIMIT. Compute capability below 8.0: UNSUPPORTED naming the GPU.
flare_status query_device(int device, DeviceProps* dev) {
  int smem = 0;
  for (auto [attr, out] : {std::pair{cudaDevAttrComputeCapabilityMajor, &dev->cc_major},
                           std::pair{cudaDevAttrComputeCapabilityMinor, &dev->cc_minor},
                           std::pair{cudaDevAttrMultiProcessorCount, &dev->sm_count},
                           std::pair{cudaDevAttrMaxSharedMemoryPerBlockOptin, &smem}}) {
    if (cudaError_t e = cudaDeviceGetAttribute(out, attr, device); e != cudaSuccess) {
      return cuda_fail(e, "cudaDeviceGetAttribute");
    }
  }
  dev->sm_count = std::max(dev->sm_count, 1);
  dev->smem_per_block = smem_limit(smem, std::getenv("FLARE_CUDA_SMEM_LIMIT"));
  if (dev->cc_major < 8) {
    cudaDeviceProp prop{};
    const bool named = cudaGetDeviceProperties(&prop, device) == cudaSuccess;
    return fail(FLARE_UNSUPPORTED, cat("cuda:", device, " (", named ? prop.name : "?", ") is sm_", dev->cc_major,
                                       dev->cc_minor, ": flare's CUDA kernels need sm_80 or newer (Ampere, Ada, "
                                       "Hopper)"));
  }
  return FLARE_OK;
}

// The kernels one call runs.
struct Plan {
  ArchPath path = ArchPath::kSm80;
  int headdim = 0;                    // sm80: the head-dim tile; sm90: the call's head dim
  SmemClass cls = SmemClass::kLarge;  // sm80 only
  DeviceProps dev;
};

// Shared memory of the sm90 forward for the call's (dtype, head dim), 0 where this build has no such unit.
int sm90_smem_bytes(const Problem& p) {
  if (p.pass != Pass::kForward || !sm90_unit_built(static_cast<int>(p.headdim))) return 0;
  return sm90_dispatch(p.dtype, static_cast<int>(p.headdim), 0,
                       [&]<flare_dtype D, int d>() { return sm90::forward_smem_bytes<D, d>(); });
}

// Checks a validated call against what the GPU path needs and picks its kernels: the arch path (the params'
// arch_path or FLARE_CUDA_ARCH_PATH; heuristics.hpp's rule), then for the sm80 path the head-dim tile and the
// shared-memory class, each checked against what this build holds and the device allows.
flare_status plan_call(const Problem& p, Plan* plan) {
  if (flare_status s = check_operands(p); s != FLARE_OK) return s;
  const bool bwd = p.pass == Pass::kBackward;
  if (!(bwd ? kHasBackward : kHasForward)) {
    return fail(FLARE_UNSUPPORTED, cat("this build has no CUDA ", bwd ? "backward" : "forward", " kernels (it was "
                                       "configured with FLARE_CUDA_PASSES without ", bwd ? "bwd" : "fwd", ")"));
  }
  Plan k;
  if (flare_status s = query_device(p.device.index, &k.dev); s != FLARE_OK) return s;

  const char* env = std::getenv("FLARE_CUDA_ARCH_PATH");
  flare_arch_path request = FLARE_ARCH_PATH_AUTO;
  if (!requested_arch_path(p, env, &request)) {
    return fail(FLARE_INVALID_ARGUMENT, cat("FLARE_CUDA_ARCH_PATH is \"", env, "\": it must be sm80, sm90 or auto "
                                            "(or unset)"));
  }
  const int sm90_smem = request == FLARE_ARCH_PATH_SM80 ? 0 : sm90_smem_bytes(p);
  const PathChoice path = choose_arch_path(p, request, k.dev, kBuilt, sm90_smem);
  if (!path.unsupported.empty()) return fail(FLARE_UNSUPPORTED, path.unsupported);
  k.path = path.path;
  if (k.path == ArchPath::kSm90) {
    k.headdim = static_cast<int>(p.headdim);
    *plan = k;
    return FLARE_OK;
  }

  k.headdim = sm80_tile(p, kBuilt.sm80_tiles);
  if (k.headdim == 0) {
    return fail(FLARE_UNSUPPORTED, cat("head dim ", std::max(p.headdim, p.headdim_v), " has no kernel in this build "
                                       "(head-dim tiles built: ", head_dims_string(kBuilt.sm80_tiles),
                                       "; configure with FLARE_HEADDIMS to add tiles)"));
  }
  const Sm80SmemBytes bytes =
      sm80_dispatch(p.dtype, k.headdim, Sm80SmemBytes{}, [&]<flare_dtype D, int d>() {
        Sm80SmemBytes b{};
        if constexpr (kHasBackward) {
          if (bwd) {
            b = {sm80::backward_smem_bytes<D, d>(SmemClass::kLarge), sm80::backward_smem_bytes<D, d>(SmemClass::kSmall)};
          }
        }
        if constexpr (kHasForward) {
          if (!bwd) {
            b = {sm80::forward_smem_bytes<D, d>(SmemClass::kLarge), sm80::forward_smem_bytes<D, d>(SmemClass::kSmall)};
          }
        }
        return b;
      });
  const SmemChoice smem = sm80_smem_class(p.pass, k.headdim, bytes, k.dev, kBuilt.all_smem_configs);
  if (!smem.unsupported.empty()) return fail(FLARE_UNSUPPORTED, smem.unsupported);
  k.cls = smem.cls;
  *plan = k;
  return FLARE_OK;
}

void fill_attn(const Problem& p, AttnParams* a) {
  a->q = p.q;
  a->k = p.k;
  a->v = p.v;
  a->out = p.out;
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
  a->sinks = p.sinks;
  a->dropout_p = p.dropout_p;
  if (p.dropout_p > 0.0f) {
    const philox::DropoutKey key = philox::dropout_key(p.dropout_seed, p.dropout_offset);
    a->dropout_scale = static_cast<float>(1.0 / (1.0 - static_cast<double>(p.dropout_p)));
    a->dropout_threshold = philox::dropout_threshold(p.dropout_p);
    a->dropout_k0 = key.k0;
    a->dropout_k1 = key.k1;
    a->dropout_offset = key.offset;
  }
}

// The sm80 backward's workspace for a planned call.
BwdLayout bwd_layout(const Problem& p, const Plan& k) {
  const int block_n = sm80_dispatch(p.dtype, k.headdim, 1, [&]<flare_dtype D, int d>() {
    if constexpr (kHasBackward) return sm80::backward_block_n<D, d>(k.cls);
    return 1;  // unreachable: plan_call refuses a backward this build lacks
  });
  return sm80_bwd_layout(p, k.headdim, block_n, k.dev.sm_count);
}

}  // namespace

flare_status forward(const Problem& p) {
  Plan k;
  if (flare_status s = plan_call(p, &k); s != FLARE_OK) return s;
  DeviceGuard guard(p.device.index);
  if (guard.status() != cudaSuccess) return cuda_fail(guard.status(), "cudaSetDevice");
  if (p.batch == 0 || p.seqlen_q == 0 || p.nheads == 0) return FLARE_OK;
  AttnParams a;
  fill_attn(p, &a);
  auto stream = static_cast<cudaStream_t>(p.stream);
  cudaError_t e = cudaErrorInvalidValue;
  if (k.path == ArchPath::kSm90) {
    e = sm90_dispatch(p.dtype, k.headdim, e,
                      [&]<flare_dtype D, int d>() { return sm90::run_forward<D, d>(a, stream); });
  } else {
    a.forward_rows = forced_forward_rows(std::getenv("FLARE_CUDA_FWD_ROWS"));
    e = sm80_dispatch(p.dtype, k.headdim, e, [&]<flare_dtype D, int d>() {
      if constexpr (kHasForward) return sm80::run_forward<D, d>(a, stream, k.cls);
      return cudaErrorInvalidValue;  // unreachable: plan_call refuses a forward this build lacks
    });
  }
  if (e != cudaSuccess) return cuda_fail(e, cat("launching the ", arch_path_name(k.path), " forward kernel"));
  return FLARE_OK;
}

// Asked of the path that will run the call: the sm80 backward's fp32 buffers; the forward of either path takes
// none.
flare_status workspace_size(const Problem& p, size_t* bytes) {
  *bytes = 0;
  Plan k;
  if (flare_status s = plan_call(p, &k); s != FLARE_OK) return s;
  if (p.pass == Pass::kBackward) *bytes = bwd_layout(p, k).total();
  return FLARE_OK;
}

// The backward always runs on the sm80 path (plan_call refuses an sm90 request for it).
flare_status backward(const Problem& p) {
  Plan k;
  if (flare_status s = plan_call(p, &k); s != FLARE_OK) return s;
  DeviceGuard guard(p.device.index);
  if (guard.status() != cudaSuccess) return cuda_fail(guard.status(), "cudaSetDevice");
  auto stream = static_cast<cudaStream_t>(p.stream);

  const BwdLayout l = bwd_layout(p, k);
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
  b.dout = p.dout;
  b.dq = p.dq;
  b.dk = p.dk;
  b.dv = p.dv;
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
  b.headdim_rounded = k.headdim;
  b.dq_splits = l.splits;
  b.deterministic = p.deterministic;

  cudaError_t e = sm80_dispatch(p.dtype, k.headdim, cudaErrorInvalidValue, [&]<flare_dtype D, int d>() {
    if constexpr (kHasBackward) return sm80::run_backward<D, d>(b, stream, k.cls);
    return cudaErrorInvalidValue;  // unreachable: plan_call refuses a backward this build lacks
  });
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

// backend.cu — the host side of the CUDA backend: CUDA-specific checks, the device's properties, the plan of a
// call (arch path, head-dim tile, shared-memory class: the rules are src/cuda/heuristics.hpp's), Problem ->
// kernel params, the workspaces of the backward, the KV-cache pass and a split forward (caller's, or
// stream-ordered cudaMallocAsync), and dispatch to the generated units of each arch path
// (src/cuda/instantiations/dispatch.hpp). Kernels run on the caller's stream; nothing here synchronises the
// device.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <utility>

#include "common/error.hpp"
#include "common/philox.hpp"
#include "cuda/cuda_backend.hpp"
#include "cuda/decode/entry.hpp"
#include "cuda/decode/plan.hpp"
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
constexpr HeadDimSubset kDecodeTiles(kDecodeHeadDims, decode_unit_built);
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

// A call's scratch, the same for every pass that takes one: exec.workspace, checked against the bytes the call
// needs (256-byte aligned, since the buffers are laid out from it; at least `bytes`), or where the caller gave
// none a stream-ordered allocation, freed on the same stream when the call's kernels are queued. `user` ends the
// alignment message, `query` names the size query, `name` the allocation.
flare_status check_workspace(const Problem& p, size_t bytes, const char* user, const char* query) {
  if (p.workspace != nullptr && reinterpret_cast<uintptr_t>(p.workspace) % 256 != 0) {
    return fail(FLARE_INVALID_ARGUMENT, cat("exec.workspace is not 256-byte aligned: ", user, " (cudaMalloc and "
                                            "torch allocations are)"));
  }
  if (p.workspace != nullptr && p.workspace_size < bytes) {
    return fail(FLARE_OUT_OF_MEMORY, cat("exec.workspace_size is ", p.workspace_size, " bytes but this call needs ",
                                         bytes, " bytes (see ", query, ")"));
  }
  return FLARE_OK;
}

struct Workspace {
  void* data = nullptr;
  bool owned = false;
};

// exec.workspace, or where it is null and `bytes` > 0 a stream-ordered allocation of them.
flare_status take_workspace(const Problem& p, size_t bytes, cudaStream_t stream, const char* name, Workspace* ws) {
  ws->data = p.workspace;
  if (ws->data != nullptr || bytes == 0) return FLARE_OK;
  if (cudaError_t e = cudaMallocAsync(&ws->data, bytes, stream); e != cudaSuccess) {
    cudaGetLastError();
    ws->data = nullptr;
    return fail(FLARE_OUT_OF_MEMORY, cat("cudaMallocAsync of ", name, " (", bytes, " bytes) failed: ",
                                         cudaGetErrorString(e)));
  }
  ws->owned = true;
  return FLARE_OK;
}

// Frees an allocated workspace on the stream; the call's own error `e` comes first.
cudaError_t release_workspace(const Workspace& ws, cudaStream_t stream, cudaError_t e) {
  if (!ws.owned) return e;
  const cudaError_t f = cudaFreeAsync(ws.data, stream);
  return e == cudaSuccess ? f : e;
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
  int splits = 1;                     // sm80 forward only: split-KV (sm80_forward_grid)
  int forward_rows = 0;               // sm80 forward only: AttnParams::forward_rows (sm80_forward_grid)
  DeviceProps dev;
};

void fill_attn(const Problem& p, AttnParams* a);
KvCacheParams kvcache_params(const Problem& p, const DecodeLayout& l, char* workspace);

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
  if (!bwd) {
    AttnParams a;
    fill_attn(p, &a);
    a.forward_rows = forced_forward_rows(std::getenv("FLARE_CUDA_FWD_ROWS"));
    // Wide tiles run 64-row tiles whatever FLARE_CUDA_FWD_ROWS says; their output slices count as CTAs.
    const bool wide = k.headdim > kSm80WideTile;
    const Sm80ForwardGrid grid = sm80_forward_grid(
        p, sm80_forward_rows(k.headdim, a), wide ? 0 : a.forward_rows, k.dev.sm_count,
        forced_forward_splits(std::getenv("FLARE_CUDA_FWD_SPLITS")), sm80_forward_slices(k.headdim, p.headdim_v));
    k.splits = grid.splits;
    k.forward_rows = grid.forward_rows;
  }
  *plan = k;
  return FLARE_OK;
}

// A window bound as the kernels take it: -1 unbounded; bounds beyond the int range are unbounded in effect
// (lengths are int32).
int clamp_window(int64_t w) { return w < 0 ? -1 : static_cast<int>(std::min<int64_t>(w, 0x7fffffff)); }

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

// Whether forward call p runs on the KV-cache kernels (heuristics.hpp's forward_on_decode_kernels: a paged
// varlen call always, a call of few query rows under AUTO, which needs the device's SM count). A paged call they
// cannot run fails here, saying why.
flare_status route_forward(const Problem& p, bool* on_decode) {
  *on_decode = false;
  if (p.pass != Pass::kForward) return FLARE_OK;
  flare_arch_path request = FLARE_ARCH_PATH_AUTO;
  if (!requested_arch_path(p, std::getenv("FLARE_CUDA_ARCH_PATH"), &request)) return FLARE_OK;  // plan_call says
  if (p.block_table != nullptr) {
    if (request == FLARE_ARCH_PATH_SM90) {
      return fail(FLARE_UNSUPPORTED, "a paged varlen forward (block_table) runs on the KV-cache kernels, which have "
                                     "no sm90 form: leave the arch path auto (or sm80)");
    }
    if (const std::string why = decode_forward_rejection(p, kDecodeTiles.span()); !why.empty()) {
      return fail(FLARE_UNSUPPORTED, cat("a paged varlen forward (block_table) runs on the KV-cache kernels, and ",
                                         why));
    }
    *on_decode = true;
    return FLARE_OK;
  }
  if (request != FLARE_ARCH_PATH_AUTO) return FLARE_OK;
  DeviceProps dev;
  if (flare_status s = query_device(p.device.index, &dev); s != FLARE_OK) return s;
  *on_decode = forward_on_decode_kernels(p, request, kDecodeTiles.span(), dev.sm_count);
  return FLARE_OK;
}

// The sm80 backward's workspace for a planned call.
BwdLayout bwd_layout(const Problem& p, const Plan& k) {
  const int block_n = sm80_dispatch(p.dtype, k.headdim, 1, [&]<flare_dtype D, int d>() {
    if constexpr (kHasBackward) return sm80::backward_block_n<D, d>(k.cls);
    return 1;  // unreachable: plan_call refuses a backward this build lacks
  });
  return sm80_bwd_layout(p, k.headdim, block_n, k.dev.sm_count);
}

// The sm80 forward of a planned call; with split-KV (k.splits > 1) into the workspace (the caller's, or a
// stream-ordered allocation), then the KV-cache pass's combine kernel merges the splits into out and lse.
flare_status forward_sm80(const Problem& p, const Plan& k, AttnParams a, cudaStream_t stream) {
  a.forward_rows = k.forward_rows;
  const FwdSplitLayout l = sm80_forward_split_layout(p, k.splits);
  Workspace ws;
  if (l.splits > 1) {
    if (flare_status s = check_workspace(p, l.total(), "the split-KV forward lays its buffers out from it",
                                         "flare_fwd_workspace_size");
        s != FLARE_OK) {
      return s;
    }
    if (flare_status s = take_workspace(p, l.total(), stream, "the split-KV forward's workspace", &ws); s != FLARE_OK) {
      return s;
    }
    a.num_splits = l.splits;
    a.part_rows = static_cast<int>(l.part_rows);
    a.part_o = static_cast<float*>(ws.data);
    a.part_lse = reinterpret_cast<float*>(static_cast<char*>(ws.data) + l.part_o);
  }
  const char* step = "the sm80 forward kernel";
  cudaError_t e = sm80_dispatch(p.dtype, k.headdim, cudaErrorInvalidValue, [&]<flare_dtype D, int d>() {
    if constexpr (kHasForward) return sm80::run_forward<D, d>(a, stream, k.cls);
    return cudaErrorInvalidValue;  // unreachable: plan_call refuses a forward this build lacks
  });
  if (e == cudaSuccess && l.splits > 1) {
    step = "the split-KV combine kernel";
    // The KV-cache pass's view of the call, its split buffers where a.part_o and a.part_lse put them.
    const DecodeLayout parts{.splits = l.splits, .part_o = l.part_o, .part_lse = l.part_lse};
    const KvCacheParams c = kvcache_params(decode_view(p), parts, static_cast<char*>(ws.data));
    e = decode::run_combine(c, p.dtype, stream);
  }
  e = release_workspace(ws, stream, e);
  if (e != cudaSuccess) return cuda_fail(e, cat("launching ", step));
  return FLARE_OK;
}

}  // namespace

flare_status forward(const Problem& p) {
  bool on_decode = false;
  if (flare_status s = route_forward(p, &on_decode); s != FLARE_OK) return s;
  if (on_decode) return kvcache(decode_view(p));
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
    // The TMA views' token extents (sm90_rejection keeps them in int range); at least 1, as an empty view
    // cannot be described (an empty key range is never loaded).
    const int q_tokens = static_cast<int>(std::max<int64_t>(p.varlen ? p.total_q : p.seqlen_q, 1));
    const int k_tokens = static_cast<int>(std::max<int64_t>(p.varlen ? p.total_k : p.seqlen_k, 1));
    e = sm90_dispatch(p.dtype, k.headdim, e,
                      [&]<flare_dtype D, int d>() { return sm90::run_forward<D, d>(a, q_tokens, k_tokens, stream); });
  } else {
    return forward_sm80(p, k, a, stream);
  }
  if (e != cudaSuccess) return cuda_fail(e, cat("launching the ", arch_path_name(k.path), " forward kernel"));
  return FLARE_OK;
}

// Asked of the kernels that will run the call: the sm80 backward's fp32 buffers; the split buffers of a forward
// that the KV-cache kernels run or that the sm80 forward splits; the sm90 forward takes none.
flare_status workspace_size(const Problem& p, size_t* bytes) {
  *bytes = 0;
  bool on_decode = false;
  if (flare_status s = route_forward(p, &on_decode); s != FLARE_OK) return s;
  if (on_decode) return kvcache_workspace_size(decode_view(p), bytes);
  Plan k;
  if (flare_status s = plan_call(p, &k); s != FLARE_OK) return s;
  if (p.pass == Pass::kBackward) *bytes = bwd_layout(p, k).total();
  if (p.pass == Pass::kForward && k.path == ArchPath::kSm80) *bytes = sm80_forward_split_layout(p, k.splits).total();
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
  if (flare_status s = check_workspace(p, l.total(), "the CUDA backward lays its fp32 buffers out from it",
                                       "flare_bwd_workspace_size");
      s != FLARE_OK) {
    return s;
  }
  if (p.batch == 0 || p.nheads == 0) return FLARE_OK;

  Workspace ws;
  if (flare_status s = take_workspace(p, l.total(), stream, "the backward workspace", &ws); s != FLARE_OK) return s;
  char* w = static_cast<char*>(ws.data);
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
  e = release_workspace(ws, stream, e);
  if (e != cudaSuccess) return cuda_fail(e, "running the backward kernels");
  return FLARE_OK;
}

// ---- the KV-cache pass: append, rotary q, split-KV attention, combine (src/cuda/decode) ----------------------

namespace {

// What the KV-cache kernels need beyond validation, and the call's decode tile. The index tensors
// (cache_seqlens, block_table, ...) live on the device and are not read here (no host sync): in-range
// indices are the caller's to guarantee, as in FlashAttention.
flare_status plan_kvcache(const Problem& p, int* tile, DeviceProps* dev) {
  if (flare_status s = check_operands(p); s != FLARE_OK) return s;
  for (const auto& [op, name] : {std::pair{&p.k_new, "k_new"}, std::pair{&p.v_new, "v_new"}}) {
    if (op->data == nullptr) continue;
    if (reinterpret_cast<uintptr_t>(op->data) % 16 != 0 || op->batch_stride % 8 != 0 || op->row_stride % 8 != 0 ||
        op->head_stride % 8 != 0) {
      return fail(FLARE_UNSUPPORTED, cat(name, " must be 16-byte aligned with strides of multiples of 8 elements "
                                         "on CUDA: make the tensor contiguous"));
    }
  }
  if (!kHasForward) {
    return fail(FLARE_UNSUPPORTED, "this build has no CUDA forward kernels (it was configured with "
                                   "FLARE_CUDA_PASSES without fwd), so none for flare_fwd_kvcache");
  }
  if (p.seqlen_new > 0 && p.cache_seqlens == nullptr) {
    return fail(FLARE_INVALID_ARGUMENT, cat("k_new has ", p.seqlen_new, " keys but cache_seqlens is absent, so every "
                                            "sequence counts as full (", p.seqlen_cache, " keys): give "
                                            "cache_seqlens to say where the new keys go"));
  }
  if (p.nheads_k * decode_row_chunks(p) * decode::kMaxSplits > 0x7fffffff) {
    return fail(FLARE_UNSUPPORTED, cat("nheads_k ", p.nheads_k, " x seqlen_q ", p.seqlen_q, " is too large for the "
                                       "CUDA KV-cache kernels' grid: split the call"));
  }
  if (flare_status s = query_device(p.device.index, dev); s != FLARE_OK) return s;
  *tile = decode_tile(p, kDecodeTiles.span());
  if (*tile == 0) {
    return fail(FLARE_UNSUPPORTED, cat("head dim ", std::max(p.headdim, p.headdim_v), " has no CUDA KV-cache kernel "
                                       "in this build (decode tiles built: ", head_dims_string(kDecodeTiles.span()),
                                       "; configure with FLARE_HEADDIMS to add tiles)"));
  }
  if (const int need = decode::smem_bytes(*tile, 2); need > dev->smem_per_block) {
    return fail(FLARE_UNSUPPORTED, cat("the CUDA KV-cache kernel of head-dim tile ", *tile, " takes ", need, " bytes of "
                                       "shared memory per block but this GPU allows ", dev->smem_per_block,
                                       " (FLARE_CUDA_SMEM_LIMIT may cut it)"));
  }
  return FLARE_OK;
}

KvCacheParams kvcache_params(const Problem& p, const DecodeLayout& l, char* workspace) {
  KvCacheParams k;
  k.q = p.q;
  k.q_source = p.q;
  k.k = p.k;
  k.v = p.v;
  k.k_new = p.k_new;
  k.v_new = p.v_new;
  k.out = p.out;
  k.lse = p.lse;
  k.lse_batch_stride = p.lse_batch_stride;
  k.lse_head_stride = p.lse_head_stride;
  k.batch = static_cast<int>(p.batch);
  k.nheads = static_cast<int>(p.nheads);
  k.nheads_k = static_cast<int>(p.nheads_k);
  k.group = static_cast<int>(p.nheads / p.nheads_k);
  k.headdim = static_cast<int>(p.headdim);
  k.headdim_v = static_cast<int>(p.headdim_v);
  k.seqlen_q = static_cast<int>(p.seqlen_q);
  k.rows = static_cast<int>(decode_rows(p));
  k.row_chunks = static_cast<int>(l.row_chunks);
  k.seqlen_cache = static_cast<int>(p.seqlen_cache);
  k.seqlen_new = static_cast<int>(p.seqlen_new);
  k.cache_seqlens = p.cache_seqlens;
  k.cache_batch_idx = p.cache_batch_idx;
  k.cache_leftpad = p.cache_leftpad;
  k.block_table = p.block_table;
  k.block_table_stride = p.block_table_stride;
  k.block_size = static_cast<int>(p.block_size);
  k.cu_seqlens_q = p.cu_seqlens_q;  // a varlen forward's (decode_view); null for a KV-cache call
  k.cu_seqlens_k = p.cu_seqlens_k;
  k.rotary_cos = p.rotary_cos;
  k.rotary_sin = p.rotary_sin;
  k.rotary_row_stride = p.rotary_row_stride;
  k.rotary_dim = static_cast<int>(p.rotary_dim);
  k.rotary_interleaved = p.rotary_interleaved;
  k.rotary_per_query = p.score.window_left >= 0 || p.score.window_right >= 0;
  k.scale = static_cast<float>(p.score.scale);
  k.softcap = p.score.softcap;
  k.window_left = clamp_window(p.score.window_left);
  k.window_right = clamp_window(p.score.window_right);
  k.alibi_slopes = p.score.alibi_slopes;
  k.alibi_batch_stride = p.score.alibi_batch_stride;
  k.sinks = p.sinks;
  k.num_splits = l.splits;
  if (l.q_rot > 0) {
    // The rotated q, contiguous (batch, seqlen_q, nheads, headdim).
    k.q = {workspace, p.seqlen_q * p.nheads * p.headdim, p.nheads * p.headdim, p.headdim};
  }
  if (l.splits > 1) {
    k.part_o = reinterpret_cast<float*>(workspace + l.q_rot);
    k.part_lse = reinterpret_cast<float*>(workspace + l.q_rot + l.part_o);
  }
  return k;
}

}  // namespace

flare_status kvcache_workspace_size(const Problem& p, size_t* bytes) {
  *bytes = 0;
  int tile = 0;
  DeviceProps dev;
  if (flare_status s = plan_kvcache(p, &tile, &dev); s != FLARE_OK) return s;
  *bytes = decode_layout(p, dev.sm_count).total();
  return FLARE_OK;
}

// Append (k_new, v_new into the cache), rotate q into the workspace, attend (split-KV), combine: four launches
// on the caller's stream, in that order, each reading what the one before wrote. No host sync; the workspace is
// the caller's or a stream-ordered allocation freed on the same stream, so the call can be captured in a graph
// (with the caller's workspace, or a graph that allows memory nodes).
flare_status kvcache(const Problem& p) {
  int tile = 0;
  DeviceProps dev;
  if (flare_status s = plan_kvcache(p, &tile, &dev); s != FLARE_OK) return s;
  DeviceGuard guard(p.device.index);
  if (guard.status() != cudaSuccess) return cuda_fail(guard.status(), "cudaSetDevice");
  auto stream = static_cast<cudaStream_t>(p.stream);
  const DecodeLayout l = decode_layout(p, dev.sm_count);
  if (flare_status s = check_workspace(p, l.total(), "the CUDA KV-cache pass lays its buffers out from it",
                                       "flare_kvcache_workspace_size, or for a forward flare_fwd_workspace_size");
      s != FLARE_OK) {
    return s;
  }
  if (p.batch == 0 || p.nheads_k == 0) return FLARE_OK;
  const bool attend = p.seqlen_q > 0;
  Workspace ws;
  if (flare_status s = take_workspace(p, attend ? l.total() : 0, stream, "the KV-cache workspace", &ws);
      s != FLARE_OK) {
    return s;
  }
  const KvCacheParams k = kvcache_params(p, l, static_cast<char*>(ws.data));
  cudaError_t e = cudaSuccess;
  const char* step = "";
  if (p.seqlen_new > 0) {
    step = "the KV-cache append kernel";
    e = decode::run_append(k, p.dtype, stream);
  }
  if (e == cudaSuccess && attend && l.q_rot > 0) {
    step = "the rotary kernel of q";
    e = decode::run_rotary_q(k, p.dtype, stream);
  }
  if (e == cudaSuccess && attend) {
    step = "the decode attention kernel";
    e = decode_dispatch(p.dtype, tile, cudaErrorInvalidValue, [&]<flare_dtype D, int d>() {
      if constexpr (kHasForward) return decode::run_attention<D, d>(k, stream);  // units of the fwd pass
      return cudaErrorInvalidValue;  // unreachable: plan_kvcache refuses a build without the forward
    });
  }
  if (e == cudaSuccess && attend && l.splits > 1) {
    step = "the split-KV combine kernel";
    e = decode::run_combine(k, p.dtype, stream);
  }
  e = release_workspace(ws, stream, e);
  if (e != cudaSuccess) return cuda_fail(e, cat("launching ", step));
  return FLARE_OK;
}

}  // namespace flare::cuda

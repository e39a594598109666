// flare.hpp — the C++ API of flare: type-safe tensor views, option structs with defaults and free
// functions that throw flare::Error, all header-only over the C ABI in flare.h (nothing here is compiled
// into the library, so the library's ABI stays the C one).
//
//   std::vector<flare::bf16> q(...), k(...), v(...), out(...);
//   auto tq = flare::TensorView::contiguous(q.data(), {batch, seqlen_q, nheads, headdim});
//   ...
//   flare::AttnOptions attn;
//   attn.causal = true;
//   flare::forward(tq, tk, tv, tout, /*softmax_lse=*/{}, attn);
//
// Semantics (scale, softcap, masks, ALiBi, GQA, varlen, KV cache) are those of flare.h; docs/semantics.md
// states them in full and docs/api.md documents every function.
#ifndef FLARE_FLARE_HPP
#define FLARE_FLARE_HPP

#include <bit>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <span>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "flare/flare.h"

namespace flare {

// ------------------------------------------------------------------------------------------------
// Errors
// ------------------------------------------------------------------------------------------------

// What every failing flare call throws: the status of the C ABI and its message (flare_last_error()).
class Error : public std::runtime_error {
 public:
  Error(flare_status status, const std::string& message) : std::runtime_error(message), status_(status) {}
  // The C ABI status (FLARE_INVALID_ARGUMENT, FLARE_UNSUPPORTED, ...); never FLARE_OK.
  flare_status status() const noexcept { return status_; }

 private:
  flare_status status_;
};

// Throws flare::Error carrying the thread's last error message when status is not FLARE_OK.
inline void check(flare_status status) {
  if (status != FLARE_OK) throw Error(status, flare_last_error());
}

// The library version, "major.minor.patch".
inline std::string version() { return flare_version(); }
// The SIMD level of the CPU backend on this machine, as flare_cpu_isa() names it (e.g. "avx2").
inline std::string cpu_isa() { return flare_cpu_isa(); }
// Whether this build of the library has a CUDA backend.
inline bool has_cuda() { return flare_has_cuda() != 0; }
// How the library was built, as flare_build_config() writes it ("key=value" lines).
inline std::string build_config() { return flare_build_config(); }

// ------------------------------------------------------------------------------------------------
// 16-bit floating-point storage types
// ------------------------------------------------------------------------------------------------

// bfloat16 storage (1 sign, 8 exponent, 7 mantissa bits). Converts from float with round-to-nearest-even
// (NaN stays NaN) and to float exactly. It is a storage type: convert to float to compute.
struct bf16 {
  uint16_t bits = 0;

  bf16() = default;
  bf16(float value) : bits(round(value)) {}  // NOLINT: implicit, so `bf16 x = 0.5f;` reads naturally
  explicit operator float() const { return to_float(); }
  float to_float() const { return std::bit_cast<float>(static_cast<uint32_t>(bits) << 16); }
  static bf16 from_bits(uint16_t bits) {
    bf16 b;
    b.bits = bits;
    return b;
  }

 private:
  static uint16_t round(float value) {
    const uint32_t u = std::bit_cast<uint32_t>(value);
    if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x0040u);  // quiet NaN
    const uint32_t rounding = 0x7fffu + ((u >> 16) & 1u);  // ties to even
    return static_cast<uint16_t>((u + rounding) >> 16);
  }
};

// IEEE half-precision storage (1 sign, 5 exponent, 10 mantissa bits). Converts from float with
// round-to-nearest-even (overflow to infinity, subnormals kept, NaN stays NaN) and to float exactly.
struct f16 {
  uint16_t bits = 0;

  f16() = default;
  f16(float value) : bits(round(value)) {}  // NOLINT: implicit, as for bf16
  explicit operator float() const { return to_float(); }
  float to_float() const {
    const uint32_t sign = static_cast<uint32_t>(bits & 0x8000u) << 16;
    uint32_t exponent = (bits >> 10) & 0x1fu;
    uint32_t mantissa = bits & 0x3ffu;
    uint32_t u;
    if (exponent == 0x1f) {
      u = sign | 0x7f800000u | (mantissa << 13);  // infinity or NaN
    } else if (exponent != 0) {
      u = sign | ((exponent + 112u) << 23) | (mantissa << 13);  // rebias 15 -> 127
    } else if (mantissa == 0) {
      u = sign;
    } else {  // subnormal: mantissa * 2^-24, normalised for float
      exponent = 113;
      while ((mantissa & 0x400u) == 0) {
        mantissa <<= 1;
        --exponent;
      }
      u = sign | (exponent << 23) | ((mantissa & 0x3ffu) << 13);
    }
    return std::bit_cast<float>(u);
  }
  static f16 from_bits(uint16_t bits) {
    f16 h;
    h.bits = bits;
    return h;
  }

 private:
  static uint16_t round(float value) {
    const uint32_t u = std::bit_cast<uint32_t>(value);
    const uint32_t sign = (u >> 16) & 0x8000u;
    const uint32_t a = u & 0x7fffffffu;
    if (a > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u);  // NaN
    if (a >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // rounds past 65504: infinity
    if (a >= 0x38800000u) {  // normal half: rebias 127 -> 15, round 13 mantissa bits away
      const uint32_t rebased = a - (112u << 23);
      return static_cast<uint16_t>(sign | ((rebased + 0x0fffu + ((rebased >> 13) & 1u)) >> 13));
    }
    if (a <= 0x33000000u) return static_cast<uint16_t>(sign);  // at most half the smallest subnormal
    // Subnormal half: value / 2^-24, rounded to nearest even.
    const uint32_t exponent = a >> 23;
    const uint32_t mantissa = (a & 0x7fffffu) | 0x800000u;
    const uint32_t shift = 126u - exponent;  // 14..24
    uint32_t q = mantissa >> shift;
    const uint32_t rest = mantissa & ((1u << shift) - 1u);
    const uint32_t half = 1u << (shift - 1u);
    if (rest > half || (rest == half && (q & 1u))) ++q;
    return static_cast<uint16_t>(sign | q);
  }
};

// The flare_dtype of an element type: float, double, flare::f16, flare::bf16, int32_t.
template <class T>
struct dtype_of;
template <>
struct dtype_of<float> {
  static constexpr flare_dtype value = FLARE_DTYPE_F32;
};
template <>
struct dtype_of<double> {
  static constexpr flare_dtype value = FLARE_DTYPE_F64;
};
template <>
struct dtype_of<f16> {
  static constexpr flare_dtype value = FLARE_DTYPE_F16;
};
template <>
struct dtype_of<bf16> {
  static constexpr flare_dtype value = FLARE_DTYPE_BF16;
};
template <>
struct dtype_of<int32_t> {
  static constexpr flare_dtype value = FLARE_DTYPE_I32;
};
template <class T>
inline constexpr flare_dtype dtype_of_v = dtype_of<std::remove_cv_t<T>>::value;

// ------------------------------------------------------------------------------------------------
// Devices and tensor views
// ------------------------------------------------------------------------------------------------

// Where a tensor lives: the CPU, or a CUDA device by ordinal.
struct Device {
  flare_device raw{FLARE_DEVICE_CPU, 0};

  static Device cpu() { return Device{}; }
  static Device cuda(int32_t index = 0) { return Device{flare_device{FLARE_DEVICE_CUDA, index}}; }
  operator flare_device() const { return raw; }  // NOLINT: views pass it straight to the C ABI
};

// A non-owning view of a strided tensor: data pointer, dtype, device, shape and strides (in elements).
// A default-constructed view is "absent" (rank 0), the way optional arguments are left out. The view does
// not check the layout rules of a call (last stride 1, shapes that agree, ...): the call does, and throws.
class TensorView {
 public:
  // An absent tensor.
  TensorView() = default;

  // A strided view. shape and strides have one length, 1..FLARE_MAX_RANK; throws flare::Error
  // (FLARE_INVALID_ARGUMENT) otherwise.
  TensorView(void* data, flare_dtype dtype, Device device, std::span<const int64_t> shape,
             std::span<const int64_t> strides) {
    init(data, dtype, device, shape, strides);
  }
  TensorView(void* data, flare_dtype dtype, Device device, std::initializer_list<int64_t> shape,
             std::initializer_list<int64_t> strides) {
    init(data, dtype, device, std::span(shape.begin(), shape.size()),
         std::span(strides.begin(), strides.size()));
  }

  // A contiguous (row-major) view of `shape`.
  static TensorView contiguous(void* data, flare_dtype dtype, Device device, std::span<const int64_t> shape) {
    int64_t strides[FLARE_MAX_RANK] = {};
    int64_t step = 1;
    for (size_t d = shape.size(); d-- > 0;) {
      if (d < FLARE_MAX_RANK) strides[d] = step;
      step *= shape[d] > 1 ? shape[d] : 1;
    }
    const size_t rank = shape.size() <= FLARE_MAX_RANK ? shape.size() : FLARE_MAX_RANK;
    TensorView t;
    t.init(data, dtype, device, shape, std::span<const int64_t>(strides, rank));
    return t;
  }
  static TensorView contiguous(void* data, flare_dtype dtype, Device device,
                               std::initializer_list<int64_t> shape) {
    return contiguous(data, dtype, device, std::span(shape.begin(), shape.size()));
  }

  // Typed views: the dtype comes from T (float, double, flare::f16, flare::bf16, int32_t); const T is
  // fine for inputs (flare never writes through an input view).
  template <class T>
  static TensorView contiguous(T* data, std::initializer_list<int64_t> shape, Device device = Device::cpu()) {
    return contiguous(erase(data), dtype_of_v<T>, device, shape);
  }
  template <class T>
  static TensorView contiguous(T* data, std::span<const int64_t> shape, Device device = Device::cpu()) {
    return contiguous(erase(data), dtype_of_v<T>, device, shape);
  }
  template <class T>
  static TensorView strided(T* data, std::initializer_list<int64_t> shape,
                            std::initializer_list<int64_t> strides, Device device = Device::cpu()) {
    return TensorView(erase(data), dtype_of_v<T>, device, shape, strides);
  }
  template <class T>
  static TensorView strided(T* data, std::span<const int64_t> shape, std::span<const int64_t> strides,
                            Device device = Device::cpu()) {
    return TensorView(erase(data), dtype_of_v<T>, device, shape, strides);
  }

  // Wraps a C view as is.
  static TensorView from_c(const flare_tensor& raw) {
    TensorView t;
    t.raw_ = raw;
    return t;
  }

  bool present() const { return raw_.rank != 0; }
  int rank() const { return raw_.rank; }
  int64_t size(int dim) const { return raw_.shape[dim]; }
  int64_t stride(int dim) const { return raw_.strides[dim]; }
  void* data() const { return raw_.data; }
  flare_dtype dtype() const { return static_cast<flare_dtype>(raw_.dtype); }
  Device device() const { return Device{raw_.device}; }
  // Number of elements (0 for an absent view).
  int64_t numel() const {
    if (!present()) return 0;
    int64_t n = 1;
    for (int d = 0; d < raw_.rank; ++d) n *= raw_.shape[d];
    return n;
  }
  // The C view handed to the C ABI.
  const flare_tensor& c() const { return raw_; }

 private:
  template <class T>
  static void* erase(T* data) {
    return const_cast<void*>(static_cast<const void*>(data));
  }

  void init(void* data, flare_dtype dtype, Device device, std::span<const int64_t> shape,
            std::span<const int64_t> strides) {
    if (shape.empty() || shape.size() > FLARE_MAX_RANK) {
      throw Error(FLARE_INVALID_ARGUMENT, "TensorView: rank " + std::to_string(shape.size()) +
                                              " is not in 1.." + std::to_string(FLARE_MAX_RANK));
    }
    if (strides.size() != shape.size()) {
      throw Error(FLARE_INVALID_ARGUMENT, "TensorView: " + std::to_string(strides.size()) +
                                              " strides for " + std::to_string(shape.size()) +
                                              " dims: give one stride per dim");
    }
    raw_ = flare_tensor{};
    raw_.data = data;
    raw_.dtype = dtype;
    raw_.device = device.raw;
    raw_.rank = static_cast<int32_t>(shape.size());
    for (size_t d = 0; d < shape.size(); ++d) {
      raw_.shape[d] = shape[d];
      raw_.strides[d] = strides[d];
    }
  }

  flare_tensor raw_{};
};

// ------------------------------------------------------------------------------------------------
// Options
// ------------------------------------------------------------------------------------------------

// How scores are formed and masked (flare_attn_options; docs/semantics.md).
struct AttnOptions {
  float softmax_scale = 0.0f;  // 0: 1/sqrt(headdim)
  float softcap = 0.0f;        // 0: off
  bool causal = false;         // bottom-right aligned; the same as window_right = 0
  int32_t window_left = -1;    // -1: unbounded
  int32_t window_right = -1;   // -1: unbounded
  TensorView alibi_slopes;     // fp32 (nheads) or (batch, nheads); absent: no ALiBi
  // Learnable sinks: fp32 (nheads), one logit per query head joining every softmax denominator; absent: none.
  // Given to every pass (the backward needs the forward's; its softmax_lse counts them). C ABI: the params'
  // sinks field, not flare_attn_options.
  TensorView sinks;
  // Backward only: fp32 (nheads), written with the sinks' gradient when present (needs sinks). A forward or
  // KV-cache call with dsinks throws FLARE_INVALID_ARGUMENT.
  TensorView dsinks;
  // Dropout (flare.h "Dropout"): dropout_p in [0, 1), 0 off; the backward must get the forward's three values.
  // A KV-cache call with dropout_p != 0 throws FLARE_INVALID_ARGUMENT.
  float dropout_p = 0.0f;
  uint64_t dropout_seed = 0;
  uint64_t dropout_offset = 0;

  flare_attn_options c() const {
    flare_attn_options o{};
    o.softmax_scale = softmax_scale;
    o.softcap = softcap;
    o.causal = causal ? 1 : 0;
    o.window_left = window_left;
    o.window_right = window_right;
    o.alibi_slopes = alibi_slopes.c();
    return o;
  }
};

// Which family of CUDA kernels runs a forward or backward call (flare_arch_path in flare.h): kAuto takes the
// sm90 kernels where the GPU (compute capability 9.0) and the call allow them, else the sm80 ones; kSm80 and
// kSm90 force one, and a forced sm90 call they cannot run throws flare::Error (FLARE_UNSUPPORTED) saying why.
// The backward always runs the sm80 kernels. The CPU ignores it.
enum class ArchPath : int32_t {
  kAuto = FLARE_ARCH_PATH_AUTO,
  kSm80 = FLARE_ARCH_PATH_SM80,
  kSm90 = FLARE_ARCH_PATH_SM90,
};

// How the work runs (flare_exec_options, plus the params' deterministic and arch_path).
struct ExecOptions {
  void* stream = nullptr;        // CUDA stream (cudaStream_t); ignored on the CPU
  int32_t num_threads = 0;       // CPU worker threads; 0: OpenMP's default
  void* workspace = nullptr;     // optional scratch; nullptr: flare allocates
  size_t workspace_size = 0;     // bytes at workspace
  bool deterministic = false;    // backward only: bitwise-identical results across runs
  ArchPath arch_path = ArchPath::kAuto;  // CUDA only: the kernel family (FLARE_CUDA_ARCH_PATH may replace kAuto)

  flare_exec_options c() const {
    flare_exec_options o{};
    o.stream = stream;
    o.num_threads = num_threads;
    o.workspace = workspace;
    o.workspace_size = workspace_size;
    return o;
  }
};

// The packed-sequence description of the varlen passes.
struct Varlen {
  TensorView cu_seqlens_q;   // int32 (batch + 1), from 0 to total_q
  TensorView cu_seqlens_k;   // int32 (batch + 1), from 0 to total_k
  TensorView seqused_k;      // optional int32 (batch): keys used per sequence
  int32_t max_seqlen_q = 0;  // 0: derived from cu_seqlens_q
  int32_t max_seqlen_k = 0;  // 0: derived from cu_seqlens_k / seqused_k
  // optional int32 (batch, max_blocks), forward only: k/v are a paged cache (num_blocks, block_size,
  // nheads_k, headdim[_v]); each sequence's keys from seqused_k, else cu_seqlens_k (which may then be absent)
  TensorView block_table;
};

// The optional inputs of the KV-cache pass (flare_kvcache_params).
struct KvCacheInputs {
  TensorView k_new, v_new;        // (batch, seqlen_new, nheads_k, headdim[_v]): appended in place
  TensorView cache_seqlens;       // int32 (batch): keys already cached per sequence
  TensorView cache_batch_idx;     // int32 (batch): cache row of each sequence (dense cache only)
  TensorView cache_leftpad;       // int32 (batch): first key position of each sequence
  TensorView block_table;         // int32 (batch, max_blocks): present for a paged cache
  TensorView rotary_cos, rotary_sin;  // (seqlen_ro, rotary_dim / 2), dtype of q
  bool rotary_interleaved = false;
  int32_t num_splits = 0;         // GPU split-KV hint; 0: heuristic
};

// ------------------------------------------------------------------------------------------------
// Params builders (what the functions below hand to the C ABI; public for callers that want the C
// structs, e.g. to call the C ABI themselves)
// ------------------------------------------------------------------------------------------------

// The forward passes take sinks but have no gradient to write.
inline void require_no_dsinks(const AttnOptions& attn) {
  if (attn.dsinks.present())
    throw Error(FLARE_INVALID_ARGUMENT, "AttnOptions::dsinks is the backward's output: leave it absent in forward calls");
}

// Copies dropout's three values into flare_fwd_params or flare_bwd_params.
template <class Params>
void set_dropout(Params& p, const AttnOptions& attn) {
  p.dropout_p = attn.dropout_p;
  p.dropout_seed = attn.dropout_seed;
  p.dropout_offset = attn.dropout_offset;
}

// Copies the varlen description into flare_fwd_params or flare_bwd_params (nothing when varlen is null).
template <class Params>
void set_varlen(Params& p, const Varlen* varlen) {
  if (varlen == nullptr) return;
  p.cu_seqlens_q = varlen->cu_seqlens_q.c();
  p.cu_seqlens_k = varlen->cu_seqlens_k.c();
  p.seqused_k = varlen->seqused_k.c();
  p.max_seqlen_q = varlen->max_seqlen_q;
  p.max_seqlen_k = varlen->max_seqlen_k;
  if constexpr (requires { p.block_table; }) {
    p.block_table = varlen->block_table.c();
  } else if (varlen->block_table.present()) {
    throw Error(FLARE_UNSUPPORTED, "Varlen::block_table: a paged varlen call has no backward");
  }
}

inline flare_fwd_params forward_params(const TensorView& q, const TensorView& k, const TensorView& v,
                                       const TensorView& out, const TensorView& softmax_lse,
                                       const AttnOptions& attn, const ExecOptions& exec,
                                       const Varlen* varlen = nullptr) {
  flare_fwd_params p;
  flare_fwd_params_init(&p);
  p.q = q.c();
  p.k = k.c();
  p.v = v.c();
  p.out = out.c();
  p.softmax_lse = softmax_lse.c();
  set_varlen(p, varlen);
  p.attn = attn.c();
  p.exec = exec.c();
  p.arch_path = static_cast<int32_t>(exec.arch_path);
  require_no_dsinks(attn);
  p.sinks = attn.sinks.c();
  set_dropout(p, attn);
  return p;
}

inline flare_bwd_params backward_params(const TensorView& q, const TensorView& k, const TensorView& v,
                                        const TensorView& out, const TensorView& dout,
                                        const TensorView& softmax_lse, const TensorView& dq,
                                        const TensorView& dk, const TensorView& dv, const AttnOptions& attn,
                                        const ExecOptions& exec, const Varlen* varlen = nullptr) {
  flare_bwd_params p;
  flare_bwd_params_init(&p);
  p.q = q.c();
  p.k = k.c();
  p.v = v.c();
  p.out = out.c();
  p.dout = dout.c();
  p.softmax_lse = softmax_lse.c();
  p.dq = dq.c();
  p.dk = dk.c();
  p.dv = dv.c();
  set_varlen(p, varlen);
  p.deterministic = exec.deterministic ? 1 : 0;
  p.attn = attn.c();
  p.exec = exec.c();
  p.arch_path = static_cast<int32_t>(exec.arch_path);
  p.sinks = attn.sinks.c();
  p.dsinks = attn.dsinks.c();
  set_dropout(p, attn);
  return p;
}

inline flare_kvcache_params kvcache_params(const TensorView& q, const TensorView& k_cache,
                                           const TensorView& v_cache, const TensorView& out,
                                           const KvCacheInputs& cache, const TensorView& softmax_lse,
                                           const AttnOptions& attn, const ExecOptions& exec) {
  flare_kvcache_params p;
  flare_kvcache_params_init(&p);
  p.q = q.c();
  p.k_cache = k_cache.c();
  p.v_cache = v_cache.c();
  p.k_new = cache.k_new.c();
  p.v_new = cache.v_new.c();
  p.cache_seqlens = cache.cache_seqlens.c();
  p.cache_batch_idx = cache.cache_batch_idx.c();
  p.cache_leftpad = cache.cache_leftpad.c();
  p.block_table = cache.block_table.c();
  p.rotary_cos = cache.rotary_cos.c();
  p.rotary_sin = cache.rotary_sin.c();
  p.rotary_interleaved = cache.rotary_interleaved ? 1 : 0;
  p.num_splits = cache.num_splits;
  p.out = out.c();
  p.softmax_lse = softmax_lse.c();
  p.attn = attn.c();
  p.exec = exec.c();
  require_no_dsinks(attn);
  if (attn.dropout_p != 0.0f)
    throw Error(FLARE_INVALID_ARGUMENT, "AttnOptions::dropout_p is for training passes: KV-cache attention has no dropout");
  p.sinks = attn.sinks.c();
  return p;
}

// ------------------------------------------------------------------------------------------------
// Passes. Each validates everything first; on a bad argument it throws flare::Error and writes nothing.
// ------------------------------------------------------------------------------------------------

// Forward attention, dense layout (flare_fwd): q (batch, seqlen_q, nheads, headdim),
// k (batch, seqlen_k, nheads_k, headdim), v (batch, seqlen_k, nheads_k, headdim_v); writes
// out (batch, seqlen_q, nheads, headdim_v) and, when present, softmax_lse fp32 (batch, nheads, seqlen_q).
inline void forward(const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& out,
                    const TensorView& softmax_lse = {}, const AttnOptions& attn = {},
                    const ExecOptions& exec = {}) {
  const flare_fwd_params p = forward_params(q, k, v, out, softmax_lse, attn, exec);
  check(flare_fwd(&p));
}

// Scratch bytes forward() would allocate for these arguments (flare_fwd_workspace_size).
inline size_t forward_workspace_size(const TensorView& q, const TensorView& k, const TensorView& v,
                                     const TensorView& out, const TensorView& softmax_lse = {},
                                     const AttnOptions& attn = {}, const ExecOptions& exec = {}) {
  const flare_fwd_params p = forward_params(q, k, v, out, softmax_lse, attn, exec);
  size_t bytes = 0;
  check(flare_fwd_workspace_size(&p, 0, &bytes));
  return bytes;
}

// Forward attention over packed sequences (flare_fwd_varlen): q (total_q, nheads, headdim),
// k/v (total_k, nheads_k, headdim[_v]), out (total_q, nheads, headdim_v), softmax_lse (nheads, total_q).
inline void forward_varlen(const TensorView& q, const TensorView& k, const TensorView& v,
                           const TensorView& out, const Varlen& varlen, const TensorView& softmax_lse = {},
                           const AttnOptions& attn = {}, const ExecOptions& exec = {}) {
  const flare_fwd_params p = forward_params(q, k, v, out, softmax_lse, attn, exec, &varlen);
  check(flare_fwd_varlen(&p));
}

// Scratch bytes forward_varlen() would allocate (flare_fwd_workspace_size with varlen = 1).
inline size_t forward_varlen_workspace_size(const TensorView& q, const TensorView& k, const TensorView& v,
                                            const TensorView& out, const Varlen& varlen,
                                            const TensorView& softmax_lse = {}, const AttnOptions& attn = {},
                                            const ExecOptions& exec = {}) {
  const flare_fwd_params p = forward_params(q, k, v, out, softmax_lse, attn, exec, &varlen);
  size_t bytes = 0;
  check(flare_fwd_workspace_size(&p, 1, &bytes));
  return bytes;
}

// Backward attention, dense layout (flare_bwd): from q, k, v, out, dout (like out) and the forward's
// softmax_lse (required), writes dq (like q), dk (like k) and dv (like v); dk/dv are summed over the query
// heads of a group. attn must be the forward's; exec.deterministic asks for run-to-run identical results.
inline void backward(const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& out,
                     const TensorView& dout, const TensorView& softmax_lse, const TensorView& dq,
                     const TensorView& dk, const TensorView& dv, const AttnOptions& attn = {},
                     const ExecOptions& exec = {}) {
  const flare_bwd_params p = backward_params(q, k, v, out, dout, softmax_lse, dq, dk, dv, attn, exec);
  check(flare_bwd(&p));
}

// Scratch bytes backward() would allocate (flare_bwd_workspace_size).
inline size_t backward_workspace_size(const TensorView& q, const TensorView& k, const TensorView& v,
                                      const TensorView& out, const TensorView& dout,
                                      const TensorView& softmax_lse, const TensorView& dq,
                                      const TensorView& dk, const TensorView& dv,
                                      const AttnOptions& attn = {}, const ExecOptions& exec = {}) {
  const flare_bwd_params p = backward_params(q, k, v, out, dout, softmax_lse, dq, dk, dv, attn, exec);
  size_t bytes = 0;
  check(flare_bwd_workspace_size(&p, 0, &bytes));
  return bytes;
}

// Backward attention over packed sequences (flare_bwd_varlen); layouts as in forward_varlen, softmax_lse
// (nheads, total_q) from the forward.
inline void backward_varlen(const TensorView& q, const TensorView& k, const TensorView& v,
                            const TensorView& out, const TensorView& dout, const TensorView& softmax_lse,
                            const TensorView& dq, const TensorView& dk, const TensorView& dv,
                            const Varlen& varlen,
                            const AttnOptions& attn = {}, const ExecOptions& exec = {}) {
  const flare_bwd_params p =
      backward_params(q, k, v, out, dout, softmax_lse, dq, dk, dv, attn, exec, &varlen);
  check(flare_bwd_varlen(&p));
}

// Scratch bytes backward_varlen() would allocate (flare_bwd_workspace_size with varlen = 1).
inline size_t backward_varlen_workspace_size(const TensorView& q, const TensorView& k, const TensorView& v,
                                             const TensorView& out, const TensorView& dout,
                                             const TensorView& softmax_lse, const TensorView& dq,
                                             const TensorView& dk, const TensorView& dv, const Varlen& varlen,
                                             const AttnOptions& attn = {}, const ExecOptions& exec = {}) {
  const flare_bwd_params p =
      backward_params(q, k, v, out, dout, softmax_lse, dq, dk, dv, attn, exec, &varlen);
  size_t bytes = 0;
  check(flare_bwd_workspace_size(&p, 1, &bytes));
  return bytes;
}

// Attention against a KV cache (flare_fwd_kvcache): q (batch, seqlen_q, nheads, headdim) attends to the
// dense cache (batch_cache, seqlen_cache, nheads_k, headdim[_v]) or, with cache.block_table, the paged cache
// (num_blocks, block_size, nheads_k, headdim[_v]); cache.k_new/v_new are first appended in place (rotated
// when cache.rotary_cos/sin are given). Writes out (batch, seqlen_q, nheads, headdim_v), the cache rows
// appended, and softmax_lse when present.
inline void forward_kvcache(const TensorView& q, const TensorView& k_cache, const TensorView& v_cache,
                            const TensorView& out, const KvCacheInputs& cache = {},
                            const TensorView& softmax_lse = {}, const AttnOptions& attn = {},
                            const ExecOptions& exec = {}) {
  const flare_kvcache_params p = kvcache_params(q, k_cache, v_cache, out, cache, softmax_lse, attn, exec);
  check(flare_fwd_kvcache(&p));
}

// Scratch bytes forward_kvcache() would allocate (flare_kvcache_workspace_size).
inline size_t forward_kvcache_workspace_size(const TensorView& q, const TensorView& k_cache,
                                             const TensorView& v_cache, const TensorView& out,
                                             const KvCacheInputs& cache = {},
                                             const TensorView& softmax_lse = {}, const AttnOptions& attn = {},
                                             const ExecOptions& exec = {}) {
  const flare_kvcache_params p = kvcache_params(q, k_cache, v_cache, out, cache, softmax_lse, attn, exec);
  size_t bytes = 0;
  check(flare_kvcache_workspace_size(&p, &bytes));
  return bytes;
}

// The attention result over the union of two disjoint key sets from each set's result and softmax_lse
// (flare_merge_states): out_a/out_b/out (batch, seqlen, nheads, headdim) with lse (batch, nheads, seqlen), or
// varlen (total, nheads, headdim) with (nheads, total). out may be out_a or out_b itself; lse is optional.
inline void merge_states(const TensorView& out_a, const TensorView& lse_a, const TensorView& out_b,
                         const TensorView& lse_b, const TensorView& out, const TensorView& lse = {},
                         const ExecOptions& exec = {}) {
  flare_merge_params p;
  flare_merge_params_init(&p);
  p.out_a = out_a.c();
  p.lse_a = lse_a.c();
  p.out_b = out_b.c();
  p.lse_b = lse_b.c();
  p.out = out.c();
  p.lse = lse.c();
  p.exec = exec.c();
  check(flare_merge_states(&p));
}

}  // namespace flare

#endif  // FLARE_FLARE_HPP

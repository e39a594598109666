// bad_input_cases.hpp — valid small calls of every pass, for the bad-input tests to break one rule at a
// time (test_bad_input*.cpp). Each case owns its buffers; expect_rejected() checks the status, that the
// message names the argument, and that not one byte of any buffer (outputs pre-filled with a sentinel,
// inputs, the KV cache) changed.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <random>
#include <string>
#include <vector>

#include "flare/flare.h"
#include "flare/flare.hpp"

namespace flare::badinput {

constexpr flare_device kCpu{FLARE_DEVICE_CPU, 0};
constexpr flare_device kCuda0{FLARE_DEVICE_CUDA, 0};
constexpr uint8_t kSentinel = 0xA5;

inline size_t element_bytes(flare_dtype dtype) {
  switch (dtype) {
    case FLARE_DTYPE_F64: return 8;
    case FLARE_DTYPE_F16:
    case FLARE_DTYPE_BF16: return 2;
    case FLARE_DTYPE_E4M3: return 1;
    default: return 4;
  }
}

// A contiguous host tensor with its own (8-byte aligned) buffer and a flare_tensor view of it.
class Tensor {
 public:
  Tensor() = default;
  Tensor(flare_dtype dtype, std::vector<int64_t> shape, uint32_t seed = 1) {
    int64_t n = 1;
    for (int64_t s : shape) n *= s;
    bytes_ = static_cast<size_t>(n) * element_bytes(dtype);
    storage_.assign(bytes_ / 8 + 1, 0);  // never empty, so data is non-null even for zero elements
    view = flare_tensor_contiguous(storage_.data(), dtype, kCpu, static_cast<int32_t>(shape.size()),
                                   shape.data());
    std::mt19937 rng(seed);
    std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
    for (int64_t i = 0; i < n; ++i) {
      const float x = dist(rng);
      switch (dtype) {
        case FLARE_DTYPE_F32: reinterpret_cast<float*>(bytes())[i] = x; break;
        case FLARE_DTYPE_F64: reinterpret_cast<double*>(bytes())[i] = x; break;
        case FLARE_DTYPE_F16: reinterpret_cast<uint16_t*>(bytes())[i] = flare::f16(x).bits; break;
        case FLARE_DTYPE_BF16: reinterpret_cast<uint16_t*>(bytes())[i] = flare::bf16(x).bits; break;
        case FLARE_DTYPE_E4M3: bytes()[i] = static_cast<uint8_t>(rng()) & 0x77; break;
        default: reinterpret_cast<int32_t*>(bytes())[i] = 0; break;
      }
    }
  }
  // An int32 tensor holding `values` with `shape` (default: rank 1 of values.size()).
  static Tensor ints(const std::vector<int32_t>& values, std::vector<int64_t> shape = {}) {
    if (shape.empty()) shape = {static_cast<int64_t>(values.size())};
    Tensor t(FLARE_DTYPE_I32, shape);
    std::memcpy(t.bytes(), values.data(), values.size() * 4);
    return t;
  }
  Tensor(Tensor&&) = default;
  Tensor& operator=(Tensor&&) = default;
  Tensor(const Tensor&) = delete;
  Tensor& operator=(const Tensor&) = delete;

  uint8_t* bytes() { return reinterpret_cast<uint8_t*>(storage_.data()); }
  int32_t* i32() { return reinterpret_cast<int32_t*>(storage_.data()); }
  float* f32() { return reinterpret_cast<float*>(storage_.data()); }
  void fill(uint8_t byte) { std::memset(storage_.data(), byte, storage_.size() * 8); }
  std::vector<uint8_t> snapshot() const {
    const auto* p = reinterpret_cast<const uint8_t*>(storage_.data());
    return {p, p + storage_.size() * 8};
  }

  flare_tensor view{};

 private:
  std::vector<uint64_t> storage_;
  size_t bytes_ = 0;
};

// The sizes of a case. Varlen cases give sequence b seqlen_q - b queries and seqlen_k - 2b keys (>= 1).
struct Dims {
  int64_t batch = 2, seqlen_q = 5, seqlen_k = 7, nheads = 4, nheads_k = 2, headdim = 16, headdim_v = 8;
};

struct VarlenLens {
  std::vector<int32_t> cu_q{0}, cu_k{0};
};
inline VarlenLens varlen_lens(const Dims& d) {
  VarlenLens l;
  for (int64_t b = 0; b < d.batch; ++b) {
    l.cu_q.push_back(l.cu_q.back() + static_cast<int32_t>(std::max<int64_t>(1, d.seqlen_q - b)));
    l.cu_k.push_back(l.cu_k.back() + static_cast<int32_t>(std::max<int64_t>(1, d.seqlen_k - 2 * b)));
  }
  return l;
}

// The q-side and k-side shapes of a dense or varlen case.
inline std::vector<int64_t> q_shape(const Dims& d, bool varlen, const VarlenLens& l, int64_t dim) {
  if (varlen) return {l.cu_q.back(), d.nheads, dim};
  return {d.batch, d.seqlen_q, d.nheads, dim};
}
inline std::vector<int64_t> k_shape(const Dims& d, bool varlen, const VarlenLens& l, int64_t dim) {
  if (varlen) return {l.cu_k.back(), d.nheads_k, dim};
  return {d.batch, d.seqlen_k, d.nheads_k, dim};
}
inline std::vector<int64_t> lse_shape(const Dims& d, bool varlen, const VarlenLens& l) {
  if (varlen) return {d.nheads, l.cu_q.back()};
  return {d.batch, d.nheads, d.seqlen_q};
}

// Checks one rejected call: status, message substrings, and that no buffer of the case changed.
template <class Case, class Call>
void expect_rejected(Case& c, Call call, flare_status status, std::initializer_list<const char*> names) {
  for (Tensor* t : c.outputs()) t->fill(kSentinel);
  std::vector<std::vector<uint8_t>> before;
  for (Tensor* t : c.tensors()) before.push_back(t->snapshot());
  const flare_status got = call(&c.params);
  const std::string message = flare_last_error();
  EXPECT_EQ(got, status) << "status " << flare_status_string(got) << ", message: " << message;
  EXPECT_FALSE(message.empty()) << "a failed call must set flare_last_error()";
  for (const char* name : names) {
    EXPECT_NE(message.find(name), std::string::npos) << "message should name '" << name << "': " << message;
  }
  size_t i = 0;
  for (Tensor* t : c.tensors()) {
    EXPECT_TRUE(t->snapshot() == before[i]) << "a rejected call wrote into tensor #" << i << ": " << message;
    ++i;
  }
}

// ---- forward (dense or varlen) ---------------------------------------------------------------------

struct FwdCase {
  bool varlen;
  Tensor q, k, v, out, lse, cu_q, cu_k;
  flare_fwd_params params;

  explicit FwdCase(bool varlen_ = false, Dims d = {}, flare_dtype dtype = FLARE_DTYPE_F32) : varlen(varlen_) {
    const VarlenLens l = varlen_lens(d);
    q = Tensor(dtype, q_shape(d, varlen, l, d.headdim), 11);
    k = Tensor(dtype, k_shape(d, varlen, l, d.headdim), 12);
    v = Tensor(dtype, k_shape(d, varlen, l, d.headdim_v), 13);
    out = Tensor(dtype, q_shape(d, varlen, l, d.headdim_v), 14);
    lse = Tensor(FLARE_DTYPE_F32, lse_shape(d, varlen, l), 15);
    flare_fwd_params_init(&params);
    params.q = q.view;
    params.k = k.view;
    params.v = v.view;
    params.out = out.view;
    params.softmax_lse = lse.view;
    if (varlen) {
      cu_q = Tensor::ints(l.cu_q);
      cu_k = Tensor::ints(l.cu_k);
      params.cu_seqlens_q = cu_q.view;
      params.cu_seqlens_k = cu_k.view;
    }
  }
  flare_status run() { return varlen ? flare_fwd_varlen(&params) : flare_fwd(&params); }
  std::vector<Tensor*> outputs() { return {&out, &lse}; }
  std::vector<Tensor*> tensors() { return {&q, &k, &v, &out, &lse, &cu_q, &cu_k}; }
};

inline flare_status call_fwd(const flare_fwd_params* p) { return flare_fwd(p); }
inline flare_status call_fwd_varlen(const flare_fwd_params* p) { return flare_fwd_varlen(p); }

// ---- backward (dense or varlen) --------------------------------------------------------------------

struct BwdCase {
  bool varlen;
  Tensor q, k, v, out, dout, lse, dq, dk, dv, cu_q, cu_k;
  flare_bwd_params params;

  explicit BwdCase(bool varlen_ = false, Dims d = {}, flare_dtype dtype = FLARE_DTYPE_F32) : varlen(varlen_) {
    const VarlenLens l = varlen_lens(d);
    q = Tensor(dtype, q_shape(d, varlen, l, d.headdim), 21);
    k = Tensor(dtype, k_shape(d, varlen, l, d.headdim), 22);
    v = Tensor(dtype, k_shape(d, varlen, l, d.headdim_v), 23);
    out = Tensor(dtype, q_shape(d, varlen, l, d.headdim_v), 24);
    dout = Tensor(dtype, q_shape(d, varlen, l, d.headdim_v), 25);
    lse = Tensor(FLARE_DTYPE_F32, lse_shape(d, varlen, l), 26);
    dq = Tensor(dtype, q_shape(d, varlen, l, d.headdim), 27);
    dk = Tensor(dtype, k_shape(d, varlen, l, d.headdim), 28);
    dv = Tensor(dtype, k_shape(d, varlen, l, d.headdim_v), 29);
    flare_bwd_params_init(&params);
    params.q = q.view;
    params.k = k.view;
    params.v = v.view;
    params.out = out.view;
    params.dout = dout.view;
    params.softmax_lse = lse.view;
    params.dq = dq.view;
    params.dk = dk.view;
    params.dv = dv.view;
    if (varlen) {
      cu_q = Tensor::ints(l.cu_q);
      cu_k = Tensor::ints(l.cu_k);
      params.cu_seqlens_q = cu_q.view;
      params.cu_seqlens_k = cu_k.view;
    }
  }
  // Makes out and lse those of a real forward, so a successful backward is meaningful.
  flare_status run_forward() {
    flare_fwd_params f;
    flare_fwd_params_init(&f);
    f.q = params.q;
    f.k = params.k;
    f.v = params.v;
    f.out = params.out;
    f.softmax_lse = params.softmax_lse;
    f.cu_seqlens_q = params.cu_seqlens_q;
    f.cu_seqlens_k = params.cu_seqlens_k;
    f.attn = params.attn;
    return varlen ? flare_fwd_varlen(&f) : flare_fwd(&f);
  }
  flare_status run() { return varlen ? flare_bwd_varlen(&params) : flare_bwd(&params); }
  std::vector<Tensor*> outputs() { return {&dq, &dk, &dv}; }
  std::vector<Tensor*> tensors() { return {&q, &k, &v, &out, &dout, &lse, &dq, &dk, &dv, &cu_q, &cu_k}; }
};

inline flare_status call_bwd(const flare_bwd_params* p) { return flare_bwd(p); }
inline flare_status call_bwd_varlen(const flare_bwd_params* p) { return flare_bwd_varlen(p); }

// ---- KV cache (dense or paged) ---------------------------------------------------------------------

// q (2, 3, 4, 16); dense cache (3, 12, 2, 16|8) or paged cache (7 blocks of 4) with block_table (2, 3);
// k_new/v_new (2, 2, 2, 16|8); cache_seqlens {4, 6} (paged {5, 9}); rotary (16 rows, 4 cols) when asked.
struct KvCase {
  static constexpr int64_t kBatch = 2, kSeqlenQ = 3, kHeads = 4, kHeadsK = 2, kDim = 16, kDimV = 8, kNew = 2;
  static constexpr int64_t kCacheRows = 3, kSeqlenCache = 12, kBlocks = 7, kBlockSize = 4, kMaxBlocks = 3;
  static constexpr int64_t kRotaryRows = 16, kRotaryDim = 8;

  bool paged;
  Tensor q, k_cache, v_cache, k_new, v_new, out, lse, cache_seqlens, block_table, rotary_cos, rotary_sin;
  flare_kvcache_params params;

  explicit KvCase(bool paged_ = false, bool rotary = false) : paged(paged_) {
    const flare_dtype dt = FLARE_DTYPE_F32;
    q = Tensor(dt, {kBatch, kSeqlenQ, kHeads, kDim}, 31);
    const int64_t rows = paged ? kBlocks : kCacheRows;
    const int64_t cols = paged ? kBlockSize : kSeqlenCache;
    k_cache = Tensor(dt, {rows, cols, kHeadsK, kDim}, 32);
    v_cache = Tensor(dt, {rows, cols, kHeadsK, kDimV}, 33);
    k_new = Tensor(dt, {kBatch, kNew, kHeadsK, kDim}, 34);
    v_new = Tensor(dt, {kBatch, kNew, kHeadsK, kDimV}, 35);
    out = Tensor(dt, {kBatch, kSeqlenQ, kHeads, kDimV}, 36);
    lse = Tensor(FLARE_DTYPE_F32, {kBatch, kHeads, kSeqlenQ}, 37);
    cache_seqlens = Tensor::ints(paged ? std::vector<int32_t>{5, 9} : std::vector<int32_t>{4, 6});
    flare_kvcache_params_init(&params);
    params.q = q.view;
    params.k_cache = k_cache.view;
    params.v_cache = v_cache.view;
    params.k_new = k_new.view;
    params.v_new = v_new.view;
    params.out = out.view;
    params.softmax_lse = lse.view;
    params.cache_seqlens = cache_seqlens.view;
    if (paged) {
      block_table = Tensor::ints({6, 0, 2, 1, 5, 3}, {kBatch, kMaxBlocks});
      params.block_table = block_table.view;
    }
    if (rotary) {
      rotary_cos = Tensor(dt, {kRotaryRows, kRotaryDim / 2}, 38);
      rotary_sin = Tensor(dt, {kRotaryRows, kRotaryDim / 2}, 39);
      params.rotary_cos = rotary_cos.view;
      params.rotary_sin = rotary_sin.view;
    }
  }
  flare_status run() { return flare_fwd_kvcache(&params); }
  std::vector<Tensor*> outputs() { return {&out, &lse}; }
  std::vector<Tensor*> tensors() {
    return {&q, &k_cache, &v_cache, &k_new, &v_new, &out, &lse, &cache_seqlens, &block_table, &rotary_cos,
            &rotary_sin};
  }
};

inline flare_status call_kvcache(const flare_kvcache_params* p) { return flare_fwd_kvcache(p); }

// Removes dimension d of a view, as if the caller had passed a tensor of one rank less.
inline void drop_dim(flare_tensor& t, int d) {
  for (int i = d; i + 1 < t.rank; ++i) {
    t.shape[i] = t.shape[i + 1];
    t.strides[i] = t.strides[i + 1];
  }
  --t.rank;
  t.shape[t.rank] = 0;
  t.strides[t.rank] = 0;
}

// Puts every present tensor of a params struct on `device`.
inline void move_all(std::initializer_list<flare_tensor*> tensors, flare_device device) {
  for (flare_tensor* t : tensors) {
    if (t->rank != 0) t->device = device;
  }
}

}  // namespace flare::badinput

// kernels.cu — the KV-cache kernels around the decode attention, compiled once for every arch of the build:
// the append of k_new / v_new into the cache (rotary on k), the rotated copy of q, and the combine of the
// split-KV partial results (the LSE merge of flare_merge_states, with the head's sink folded in).
#include <cuda_runtime.h>

#include <cmath>

#include "common/attention_policy.hpp"
#include "cuda/decode/elements.cuh"
#include "cuda/decode/entry.hpp"
#include "cuda/decode/plan.hpp"

namespace flare::cuda::decode {
namespace {

constexpr int kCopyThreads = 128;

// Element c of row x rotated by position `pos` (flare.h: halves (c, c + rd/2) or interleaved pairs
// (2c, 2c + 1)); elements past rotary_dim unchanged. fp32, rounded once by the caller's store.
template <class E>
__device__ __forceinline__ float rotated(KvCacheParams const& p, const E* x, int c, int64_t pos) {
  const float xc = to_float(x[c]);
  if (c >= p.rotary_dim) return xc;
  const int half = p.rotary_dim / 2;
  int pair, partner;
  bool first;
  if (p.rotary_interleaved) {
    pair = c / 2;
    first = c % 2 == 0;
    partner = first ? c + 1 : c - 1;
  } else {
    first = c < half;
    pair = first ? c : c - half;
    partner = first ? c + half : c - half;
  }
  const E* cos_row = static_cast<const E*>(p.rotary_cos) + pos * p.rotary_row_stride;
  const E* sin_row = static_cast<const E*>(p.rotary_sin) + pos * p.rotary_row_stride;
  const float cs = to_float(cos_row[pair]), sn = to_float(sin_row[pair]);
  const float xp = to_float(x[partner]);
  return first ? xc * cs - xp * sn : xc * cs + xp * sn;
}

__device__ __forceinline__ int cache_len_of(KvCacheParams const& p, int b) {
  return p.cache_seqlens != nullptr ? p.cache_seqlens[b] : p.seqlen_cache;
}

// One CTA per (new key i, kv head hk) of sequence b = blockIdx.y: its K row (rotated) and V row into the
// cache slot cache_len + i.
template <class E>
__global__ void __launch_bounds__(kCopyThreads) append_kernel(const __grid_constant__ KvCacheParams p) {
  const int i = blockIdx.x / p.nheads_k;
  const int hk = blockIdx.x % p.nheads_k;
  const int b = blockIdx.y;
  const int cache_len = cache_len_of(p, b);
  const int64_t slot = int64_t{cache_len} + i;
  const int32_t* table = p.block_table != nullptr ? p.block_table + b * p.block_table_stride : nullptr;
  Slot s = slot_of(table, p.block_size, slot);
  if (table == nullptr) s.block = p.cache_batch_idx != nullptr ? p.cache_batch_idx[b] : b;
  E* k = static_cast<E*>(p.k.data) + s.block * p.k.batch_stride + s.row * p.k.row_stride + hk * p.k.head_stride;
  E* v = static_cast<E*>(p.v.data) + s.block * p.v.batch_stride + s.row * p.v.row_stride + hk * p.v.head_stride;
  const E* kn = static_cast<const E*>(p.k_new.data) + b * p.k_new.batch_stride + i * p.k_new.row_stride +
                hk * p.k_new.head_stride;
  const E* vn = static_cast<const E*>(p.v_new.data) + b * p.v_new.batch_stride + i * p.v_new.row_stride +
                hk * p.v_new.head_stride;
  for (int c = threadIdx.x; c < p.headdim; c += kCopyThreads) {
    k[c] = p.rotary_dim > 0 ? from_float<E>(rotated(p, kn, c, slot)) : kn[c];
  }
  for (int c = threadIdx.x; c < p.headdim_v; c += kCopyThreads) v[c] = vn[c];
}

// One CTA per (query i, head h) of sequence b = blockIdx.y: q_source's row rotated into q.
template <class E>
__global__ void __launch_bounds__(kCopyThreads) rotary_q_kernel(const __grid_constant__ KvCacheParams p) {
  const int i = blockIdx.x / p.nheads;
  const int h = blockIdx.x % p.nheads;
  const int b = blockIdx.y;
  const int64_t pos = int64_t{cache_len_of(p, b)} + (p.rotary_per_query ? i : 0);
  const E* src = static_cast<const E*>(p.q_source.data) + b * p.q_source.batch_stride + i * p.q_source.row_stride +
                 h * p.q_source.head_stride;
  E* dst = static_cast<E*>(p.q.data) + b * p.q.batch_stride + i * p.q.row_stride + h * p.q.head_stride;
  for (int c = threadIdx.x; c < p.headdim; c += kCopyThreads) dst[c] = from_float<E>(rotated(p, src, c, pos));
}

// A warp per packed row (b, hk, r): the splits' lse merged (m = max, w_s = exp(lse_s - m)), the outputs
// weighted by w_s / sum w, the head's sink folded into both. Splits that saw no key (lse -inf) are skipped:
// their output rows were never written.
constexpr int kCombineWarps = 4;
template <class E>
__global__ void __launch_bounds__(32 * kCombineWarps) combine_kernel(const __grid_constant__ KvCacheParams p) {
  const int lane = threadIdx.x % 32;
  const int64_t row = int64_t{blockIdx.x} * kCombineWarps + threadIdx.x / 32;
  if (row >= int64_t{p.batch} * p.nheads_k * p.rows) return;
  const int r = static_cast<int>(row % p.rows);
  const int hk = static_cast<int>(row / p.rows % p.nheads_k);
  const int b = static_cast<int>(row / p.rows / p.nheads_k);
  const Sequence seq = sequence_of(p, b);
  if (r >= p.group * seq.seqlen_q) return;  // varlen: a row past this sequence's (its splits wrote nothing)
  const int i = seq.q_start + r % seq.seqlen_q;  // the query's token (dense: its position)
  const int h = hk * p.group + r / seq.seqlen_q;
  const int S = p.num_splits;
  const float* lse_s = p.part_lse + row * S;
  float m = -INFINITY;
  for (int s = lane; s < S; s += 32) m = fmaxf(m, lse_s[s]);
#pragma unroll
  for (int o = 16; o > 0; o /= 2) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
  float w_sum = 0.f;
  if (m != -INFINITY) {
    for (int s = lane; s < S; s += 32) w_sum += expf(lse_s[s] - m);
  }
#pragma unroll
  for (int o = 16; o > 0; o /= 2) w_sum += __shfl_xor_sync(0xffffffffu, w_sum, o);
  const float lse = m != -INFINITY ? m + logf(w_sum) : -INFINITY;
  const policy::SinkFold<float> fold = policy::fold_sink(lse, p.sinks != nullptr ? p.sinks[h] : -INFINITY);
  const float factor = m != -INFINITY ? fold.factor / w_sum : 0.f;
  E* out = static_cast<E*>(p.out.data) + b * p.out.batch_stride + int64_t{i} * p.out.row_stride +
           h * p.out.head_stride;
  for (int c = lane * 4; c < p.headdim_v; c += 32 * 4) {
    float o[4] = {0.f, 0.f, 0.f, 0.f};
    for (int s = 0; s < S; ++s) {
      const float l = lse_s[s];
      if (l == -INFINITY) continue;
      const float w = expf(l - m);
      const float4 part = *reinterpret_cast<const float4*>(p.part_o + (row * S + s) * p.headdim_v + c);
      o[0] += w * part.x;
      o[1] += w * part.y;
      o[2] += w * part.z;
      o[3] += w * part.w;
    }
    *reinterpret_cast<uint2*>(out + c) =
        make_uint2(from_float2<E>(o[0] * factor, o[1] * factor), from_float2<E>(o[2] * factor, o[3] * factor));
  }
  if (lane == 0 && p.lse != nullptr) p.lse[b * p.lse_batch_stride + h * p.lse_head_stride + i] = fold.lse;
}


}  // namespace

cudaError_t run_append(KvCacheParams const& p, flare_dtype dtype, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(p.seqlen_new * p.nheads_k), static_cast<unsigned>(p.batch));
  if (dtype == FLARE_DTYPE_F16) {
    append_kernel<__half><<<grid, kCopyThreads, 0, stream>>>(p);
  } else {
    append_kernel<__nv_bfloat16><<<grid, kCopyThreads, 0, stream>>>(p);
  }
  return cudaGetLastError();
}

cudaError_t run_rotary_q(KvCacheParams const& p, flare_dtype dtype, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(p.seqlen_q * p.nheads), static_cast<unsigned>(p.batch));
  if (dtype == FLARE_DTYPE_F16) {
    rotary_q_kernel<__half><<<grid, kCopyThreads, 0, stream>>>(p);
  } else {
    rotary_q_kernel<__nv_bfloat16><<<grid, kCopyThreads, 0, stream>>>(p);
  }
  return cudaGetLastError();
}

cudaError_t run_combine(KvCacheParams const& p, flare_dtype dtype, cudaStream_t stream) {
  const int64_t rows = int64_t{p.batch} * p.nheads_k * p.rows;
  const dim3 grid(static_cast<unsigned>((rows + kCombineWarps - 1) / kCombineWarps));
  if (dtype == FLARE_DTYPE_F16) {
    combine_kernel<__half><<<grid, 32 * kCombineWarps, 0, stream>>>(p);
  } else {
    combine_kernel<__nv_bfloat16><<<grid, 32 * kCombineWarps, 0, stream>>>(p);
  }
  return cudaGetLastError();
}

}  // namespace flare::cuda::decode

// attention.cuh — the split-KV decode attention kernel (flash decoding) for the sm80 family: one CTA per
// (sequence, kv head, split, chunk of kRows packed query rows). The query rows of the heads that share a kv
// head (GQA: group x seqlen_q of them) sit in one tile, so each byte of K and V is read from memory once for
// all of them. K and V tiles of kBlockN keys stream through a kStages-deep cp.async pipeline whose 16-byte row
// copies find each key's address through the page table (any page size; one table read per tile when the
// tile lies in one page). The products run on CUDA cores in fp32: decode has few rows per kv head (4 for a
// 32/8-head model at one token), where an m16n8k16 tile would idle most of its rows and the kernel is bound
// by memory, not arithmetic (docs/cuda-backend.md, "Decode").
//
// Per tile: S = q K^T (4 threads per key, each a quarter of the head dim, summed by shuffles), the online
// softmax (a warp per row, a lane per key: shapes, masks, running max and sum), O = O * alpha + P V (a thread
// per 4 output columns and a group of keys; the key groups' partial outputs are summed once at the end).
// With one split the CTA writes out and lse (the head's sink folded in); with more, its rows' normalised
// output and lse go to the workspace for combine_kernel (kernels.cu).
#pragma once

#include <cuda_runtime.h>

#include <cmath>

#include "common/attention_policy.hpp"
#include "cuda/common/fast_math.cuh"
#include "cuda/decode/elements.cuh"
#include "cuda/decode/params.hpp"
#include "cuda/decode/plan.hpp"

namespace flare::cuda::decode {

__device__ __forceinline__ float warp_max(float x) {
#pragma unroll
  for (int o = 16; o > 0; o /= 2) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
  return x;
}
__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int o = 16; o > 0; o /= 2) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}

// Where the keys of one (sequence, kv head) live: element bases of K and V (the cache row of a dense cache, or
// block 0 of a paged one, at the kv head) and the sequence's block_table row (null: dense).
template <class E>
struct CacheKeys {
  const E* k;
  const E* v;
  const int32_t* table;
  int leftpad;  // key j sits at cache slot leftpad + j
};

// Launch bounds (kThreads, 1): ptxas then takes up to 180 registers; with its default cap of 168 the fp16
// head-dim-64 kernel spilled 8 bytes. Two CTAs still fit an SM's registers (and its shared memory on sm_90).
template <flare_dtype D, int kHeadDim>
__global__ void __launch_bounds__(kThreads, 1) attention_kernel(const __grid_constant__ KvCacheParams p) {
  using E = typename ElementOf<D>::type;
  constexpr int kStages = stages_for(kHeadDim);
  constexpr int kLd = smem_row(kHeadDim);
  constexpr int kVecs = kHeadDim / 8;               // 16-byte vectors per K / V row
  constexpr int kRowsPerPass = kThreads / kVecs;    // rows one pass of copies covers
  constexpr int kSlices = kThreads / kBlockN;       // S: threads per key
  constexpr int kDimChunks = kHeadDim / 4;          // PV: 4 output columns per thread
  constexpr int kKeyGroups = kThreads / kDimChunks;
  constexpr int kKeysPerGroup = kBlockN / kKeyGroups;
  constexpr int kWarps = kThreads / 32;
  constexpr int kRowsPerWarp = kRows / kWarps;      // softmax rows owned by each warp
  static_assert(kHeadDim % 64 == 0 && kBlockN == 32, "decode tiles: head dims of 64k, a lane per key");
  static_assert(kThreads % kVecs == 0 && kBlockN % kRowsPerPass == 0, "copies tile the K / V rows");
  static_assert(kVecs % kSlices == 0, "the score slices split the head dim in whole vectors");
  static_assert(kThreads % kDimChunks == 0 && kKeysPerGroup % 4 == 0, "PV: whole key groups of 4-key steps");
  static_assert(kRows % kWarps == 0, "every warp owns as many rows");
  static_assert(kKeyGroups * kRows * kHeadDim * 4 <= 2 * kStages * kBlockN * kLd * int(sizeof(E)),
                "the key groups' partial outputs are summed in the K / V stages");

  const int tid = threadIdx.x;
  const int lane = tid % 32;
  const int warp = tid / 32;
  int x = blockIdx.x;
  const int split = x % p.num_splits;
  x /= p.num_splits;
  const int hk = x % p.nheads_k;
  const int r0 = x / p.nheads_k * kRows;
  const int b = blockIdx.y;
  const int rows_here = min(kRows, p.rows - r0);
  if (rows_here <= 0) return;

  // ---- the sequence: its keys, the part of them this split walks
  const int cache_len = p.cache_seqlens != nullptr ? p.cache_seqlens[b] : p.seqlen_cache;
  const int leftpad = p.cache_leftpad != nullptr ? p.cache_leftpad[b] : 0;
  const int len_k = cache_len + p.seqlen_new - leftpad;
  const policy::WindowMask mask{p.seqlen_q, len_k, p.window_left, p.window_right};
  const KeySpan mine =
      split_keys(keys_seen(mask, queries_of_rows(r0, r0 + rows_here, p.seqlen_q)), p.num_splits, split, kBlockN);
  const int n_tiles = (mine.size() + kBlockN - 1) / kBlockN;

  CacheKeys<E> keys;
  keys.k = static_cast<const E*>(p.k.data) + hk * p.k.head_stride;
  keys.v = static_cast<const E*>(p.v.data) + hk * p.v.head_stride;
  keys.table = p.block_table != nullptr ? p.block_table + b * p.block_table_stride : nullptr;
  keys.leftpad = leftpad;
  if (keys.table == nullptr) {
    const int64_t row = p.cache_batch_idx != nullptr ? p.cache_batch_idx[b] : b;
    keys.k += row * p.k.batch_stride;
    keys.v += row * p.v.batch_stride;
  }

  // ---- shared memory
  extern __shared__ __align__(16) char smem[];
  float* sQ = reinterpret_cast<float*>(smem);                            // (kRows, kHeadDim), scaled
  E* sK = reinterpret_cast<E*>(sQ + kRows * kHeadDim);                   // (kStages, kBlockN, kLd)
  E* sV = sK + kStages * kBlockN * kLd;                                  // (kStages, kBlockN, kLd)
  float* sS = reinterpret_cast<float*>(sV + kStages * kBlockN * kLd);   // (kRows, kBlockN): scores, then P
  float* sAlpha = sS + kRows * kBlockN;                                  // (kRows) this tile's rescale
  float* sM = sAlpha + kRows;                                            // (kRows) final max (log2 units)
  float* sL = sM + kRows;                                                // (kRows) final sum

  // ---- global -> shared: K and V rows of tile t into stage `stage`; rows past the split are zero-filled
  const int vcol = tid % kVecs;
  const int row_in_pass = tid / kVecs;
  const bool k_col = vcol * 8 < p.headdim;
  const bool v_col = vcol * 8 < p.headdim_v;
  const auto load_tile = [&](int t, int stage) {
    const int n0 = mine.begin + t * kBlockN;
    const int64_t slot0 = int64_t{keys.leftpad} + n0;
    const bool one_block = keys.table != nullptr && slots_in_one_block(slot0, kBlockN, p.block_size);
    const int64_t block0 = one_block ? keys.table[slot0 / p.block_size] : 0;
    const int64_t row0 = one_block ? slot0 % p.block_size : 0;
    E* sk = sK + stage * kBlockN * kLd;
    E* sv = sV + stage * kBlockN * kLd;
#pragma unroll
    for (int pass = 0; pass < kBlockN / kRowsPerPass; ++pass) {
      const int jj = pass * kRowsPerPass + row_in_pass;
      const bool in = n0 + jj < mine.end;
      int64_t k_off = 0, v_off = 0;
      if (in) {
        Slot s{0, slot0 + jj};  // dense: the row is the slot
        if (one_block) {
          s = {block0, row0 + jj};
        } else if (keys.table != nullptr) {
          s = slot_of(keys.table, p.block_size, slot0 + jj);
        }
        k_off = s.block * p.k.batch_stride + s.row * p.k.row_stride + vcol * 8;
        v_off = s.block * p.v.batch_stride + s.row * p.v.row_stride + vcol * 8;
      }
      cp_async_16(sk + jj * kLd + vcol * 8, keys.k + k_off, in && k_col ? 16 : 0);
      cp_async_16(sv + jj * kLd + vcol * 8, keys.v + v_off, in && v_col ? 16 : 0);
    }
  };
  // The first tiles go out before anything else is set up.
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < n_tiles) load_tile(s, s);
    cp_async_commit();
  }

  // ---- q rows, times the softmax scale; columns past headdim and rows past the chunk are 0
  const E* q = static_cast<const E*>(p.q.data);
  for (int idx = tid; idx < kRows * kHeadDim; idx += kThreads) {
    const int r = idx / kHeadDim, c = idx % kHeadDim;
    float val = 0.f;
    if (r < rows_here && c < p.headdim) {
      const int rr = r0 + r;
      const int h = hk * p.group + rr / p.seqlen_q;
      val = to_float(q[b * p.q.batch_stride + (rr % p.seqlen_q) * p.q.row_stride + h * p.q.head_stride + c]) *
            p.scale;
    }
    sQ[idx] = val;
  }

  // ---- the softmax rows this warp owns (r = warp + kWarps * k): state and per-row constants
  float row_m[kRowsPerWarp], row_l[kRowsPerWarp], row_slope[kRowsPerWarp];
  int row_lo[kRowsPerWarp], row_hi[kRowsPerWarp], row_diag[kRowsPerWarp];
#pragma unroll
  for (int k = 0; k < kRowsPerWarp; ++k) {
    const int rr = r0 + warp + kWarps * k;
    const int i = rr % p.seqlen_q;
    const int h = hk * p.group + rr / p.seqlen_q;
    row_m[k] = -INFINITY;
    row_l[k] = 0.f;
    const policy::KeyRange seen = mask.keys_of(i);
    row_lo[k] = static_cast<int>(seen.first > mine.begin ? seen.first : mine.begin);
    row_hi[k] = static_cast<int>(seen.last < mine.end - 1 ? seen.last : mine.end - 1);
    row_diag[k] = static_cast<int>(mask.diagonal(i));
    row_slope[k] = p.alibi_slopes != nullptr && rr < p.rows ? p.alibi_slopes[b * p.alibi_batch_stride + h] : 0.f;
  }
  const float softcap_inv = p.softcap > 0.f ? 1.f / p.softcap : 0.f;

  // ---- the output accumulator: rows x 4 columns (dc * 4 ..) over the keys of group kz
  const int dc = tid % kDimChunks;
  const int kz = tid / kDimChunks;
  float acc[kRows][4];
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
#pragma unroll
    for (int c = 0; c < 4; ++c) acc[r][c] = 0.f;
  }
  const int key = tid / kSlices;
  const int slice = tid % kSlices;

  for (int t = 0; t < n_tiles; ++t) {
    cp_async_wait<kStages - 2>();
    __syncthreads();  // tile t has landed; every warp is done with tile t - 1 (its stage and the scores)
    if (t + kStages - 1 < n_tiles) load_tile(t + kStages - 1, (t + kStages - 1) % kStages);
    cp_async_commit();
    const int stage = t % kStages;
    const int n0 = mine.begin + t * kBlockN;

    // S = q K^T: this thread's quarter of the head dim (vectors slice, slice + kSlices, ...) of one key
    {
      const E* sk = sK + (stage * kBlockN + key) * kLd;
      float s[kRows];
#pragma unroll
      for (int r = 0; r < kRows; ++r) s[r] = 0.f;
#pragma unroll
      for (int u = 0; u < kVecs / kSlices; ++u) {
        const int c = (slice + kSlices * u) * 8;
        float kf[8];
        to_float8<E>(*reinterpret_cast<const uint4*>(sk + c), kf);
#pragma unroll
        for (int r = 0; r < kRows; ++r) {
          if (r < rows_here) {
            const float4 a = *reinterpret_cast<const float4*>(sQ + r * kHeadDim + c);
            const float4 d = *reinterpret_cast<const float4*>(sQ + r * kHeadDim + c + 4);
            s[r] += a.x * kf[0] + a.y * kf[1] + a.z * kf[2] + a.w * kf[3] + d.x * kf[4] + d.y * kf[5] +
                    d.z * kf[6] + d.w * kf[7];
          }
        }
      }
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        if (r < rows_here) {
          float v = s[r];
          v += __shfl_xor_sync(0xffffffffu, v, 1);
          v += __shfl_xor_sync(0xffffffffu, v, 2);
          if (slice == 0) sS[r * kBlockN + key] = v;
        }
      }
    }
    __syncthreads();

    // Online softmax of the owned rows: lane = key n0 + lane
#pragma unroll
    for (int k = 0; k < kRowsPerWarp; ++k) {
      const int r = warp + kWarps * k;
      if (r < rows_here) {
        const int j = n0 + lane;
        float s = sS[r * kBlockN + lane];
        if (p.softcap > 0.f) s = p.softcap * tanh_approx(s * softcap_inv);
        if (row_slope[k] != 0.f) s += policy::alibi_bias(row_slope[k], row_diag[k], j);
        const float xv = j >= row_lo[k] && j <= row_hi[k] ? s * kLog2e : -INFINITY;
        const float m_new = fmaxf(row_m[k], warp_max(xv));
        float pr = 0.f, alpha = 1.f;
        if (m_new != -INFINITY) {
          pr = exp2_approx(xv - m_new);
          alpha = exp2_approx(row_m[k] - m_new);  // 0 on the first visible tile
        }
        row_l[k] = row_l[k] * alpha + warp_sum(pr);
        row_m[k] = m_new;
        sS[r * kBlockN + lane] = pr;
        if (lane == 0) sAlpha[r] = alpha;
      }
    }
    __syncthreads();

    // O = O * alpha + P V over this thread's key group
    {
      const E* sv = sV + stage * kBlockN * kLd + dc * 4;
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        if (r < rows_here) {
          const float a = sAlpha[r];
#pragma unroll
          for (int c = 0; c < 4; ++c) acc[r][c] *= a;
        }
      }
#pragma unroll
      for (int m4 = 0; m4 < kKeysPerGroup; m4 += 4) {
        const int n = kz * kKeysPerGroup + m4;
        float vf[4][4];
#pragma unroll
        for (int u = 0; u < 4; ++u) to_float4<E>(*reinterpret_cast<const uint2*>(sv + (n + u) * kLd), vf[u]);
#pragma unroll
        for (int r = 0; r < kRows; ++r) {
          if (r < rows_here) {
            const float4 pr = *reinterpret_cast<const float4*>(sS + r * kBlockN + n);
#pragma unroll
            for (int c = 0; c < 4; ++c) {
              acc[r][c] += pr.x * vf[0][c] + pr.y * vf[1][c] + pr.z * vf[2][c] + pr.w * vf[3][c];
            }
          }
        }
      }
    }
  }

  // ---- epilogue: the key groups' outputs summed through shared memory (the stages are free), normalised
  cp_async_wait<0>();
  __syncthreads();
  if (lane == 0) {
#pragma unroll
    for (int k = 0; k < kRowsPerWarp; ++k) {
      const int r = warp + kWarps * k;
      sM[r] = row_m[k];
      sL[r] = row_l[k];
    }
  }
  float* sO = reinterpret_cast<float*>(sK);  // (kKeyGroups, kRows, kHeadDim)
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    if (r < rows_here) {
      *reinterpret_cast<float4*>(sO + (kz * kRows + r) * kHeadDim + dc * 4) =
          make_float4(acc[r][0], acc[r][1], acc[r][2], acc[r][3]);
    }
  }
  __syncthreads();

  E* out = static_cast<E*>(p.out.data);
  for (int idx = tid; idx < rows_here * kDimChunks; idx += kThreads) {
    const int r = idx / kDimChunks;
    const int c = idx % kDimChunks * 4;
    if (c >= p.headdim_v) continue;
    float o[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int g = 0; g < kKeyGroups; ++g) {
      const float4 part = *reinterpret_cast<const float4*>(sO + (g * kRows + r) * kHeadDim + c);
      o[0] += part.x;
      o[1] += part.y;
      o[2] += part.z;
      o[3] += part.w;
    }
    const float l = sL[r];
    const float lse = l > 0.f ? (sM[r] + __log2f(l)) * kLn2 : -INFINITY;
    const int rr = r0 + r;
    const int i = rr % p.seqlen_q;
    const int h = hk * p.group + rr / p.seqlen_q;
    if (p.num_splits == 1) {
      const policy::SinkFold<float> fold =
          policy::fold_sink(lse, p.sinks != nullptr ? p.sinks[h] : -INFINITY);
      const float inv = l > 0.f ? fold.factor / l : 0.f;
      const uint2 packed = make_uint2(from_float2<E>(o[0] * inv, o[1] * inv), from_float2<E>(o[2] * inv, o[3] * inv));
      *reinterpret_cast<uint2*>(out + b * p.out.batch_stride + i * p.out.row_stride + h * p.out.head_stride + c) =
          packed;
      if (c == 0 && p.lse != nullptr) p.lse[b * p.lse_batch_stride + h * p.lse_head_stride + i] = fold.lse;
    } else {
      const int64_t part = ((int64_t{b} * p.nheads_k + hk) * p.rows + rr) * p.num_splits + split;
      const float inv = l > 0.f ? 1.f / l : 0.f;
      *reinterpret_cast<float4*>(p.part_o + part * p.headdim_v + c) =
          make_float4(o[0] * inv, o[1] * inv, o[2] * inv, o[3] * inv);
      if (c == 0) p.part_lse[part] = lse;
    }
  }
}

// Launches the attention kernel of one (dtype, head-dim tile) on `stream`: num_splits x nheads_k x row_chunks
// CTAs per sequence.
template <flare_dtype D, int kHeadDim>
cudaError_t launch_attention(KvCacheParams const& p, cudaStream_t stream) {
  const auto kernel = attention_kernel<D, kHeadDim>;
  constexpr int kSmem = smem_bytes(kHeadDim, 2);
  if constexpr (kSmem > 48 * 1024) {
    if (cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem);
        e != cudaSuccess) {
      return e;
    }
  }
  const dim3 grid(static_cast<unsigned>(p.num_splits * p.nheads_k * p.row_chunks), static_cast<unsigned>(p.batch));
  kernel<<<grid, kThreads, kSmem, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace flare::cuda::decode

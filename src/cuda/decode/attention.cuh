// attention.cuh — the split-KV decode attention kernel (flash decoding) for the sm80 family: one CTA per
// (sequence, kv head, split, chunk of kRows packed query rows). The query rows of the heads that share a kv
// head (GQA: group x seqlen_q of them) form one 16-row tile, so each byte of K and V is read from memory once
// for all of them. Each warp walks its own tiles of the split's keys (tile t goes to warp t % warps) through
// its own cp.async stages, with the sm80 kernels' tensor-core tile ops (src/cuda/sm80/tile_ops.cuh: ldmatrix-
// fed mma.sync m16n8k16, one warp per product) and no CTA barrier in the loop; each key row's address comes
// from the page table (any page size; one table read per tile when the tile lies in one page). At the end the
// warps' (max, sum, output) are merged through shared memory. With one split the CTA writes out and lse (the
// head's sink folded in); with more, its rows' normalised output and lse go to the workspace for
// combine_kernel (kernels.cu).
#pragma once

#include <cuda_runtime.h>

#include <cmath>

#include "common/attention_policy.hpp"
#include "cuda/common/fast_math.cuh"
#include "cuda/decode/elements.cuh"
#include "cuda/decode/params.hpp"
#include "cuda/decode/plan.hpp"
#include "cuda/sm80/traits.cuh"

namespace flare::cuda::decode {

// Types of the decode kernel of one (dtype, head-dim tile): a one-warp m16n8k16 tiled MMA (16 rows; 16-wide N
// tiles, so each B ldmatrix.x4 loads 16 keys x 16 dims), swizzled shared tiles as the sm80 forward's.
template <flare_dtype D, int kHeadDim_>
struct DecodeTraits {
  using Element = std::conditional_t<D == FLARE_DTYPE_F16, cutlass::half_t, cutlass::bfloat16_t>;
  using Storage = typename ElementOf<D>::type;  // the same bits as CUDA's type, for the output stores
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kWarps = warps_for(kHeadDim);
  static constexpr int kThreads = 32 * kWarps;
  static constexpr int kStages = warp_stages_for(kHeadDim);
  static constexpr int kTile = tile_elements(kHeadDim);
  static_assert(kHeadDim % 64 == 0, "decode tiles fill whole 64-element swizzle rows");

  using TiledMma = cute::TiledMMA<sm80::MmaAtom<Element>, cute::Layout<cute::Shape<cute::_1, cute::_1, cute::_1>>,
                                  cute::Tile<cute::_16, cute::_16, cute::_16>>;
  using Smem = sm80::SmemRowTile<Element, kHeadDim>;
  using SmemLayoutQ = typename Smem::template Layout<kRows>;
  using SmemLayoutKV = typename Smem::template Layout<kTileKeys>;
  using SmemLayoutVt = decltype(cute::composition(
      SmemLayoutKV{}, cute::make_layout(cute::Shape<cute::Int<kHeadDim>, cute::Int<kTileKeys>>{}, cute::GenRowMajor{})));
  using SmemCopyAtom = cute::Copy_Atom<cute::SM75_U32x4_LDSM_N, Element>;
  using SmemCopyAtomT = cute::Copy_Atom<cute::SM75_U16x8_LDSM_T, Element>;
  static_assert(cute::cosize(SmemLayoutKV{}) == kTile && cute::cosize(SmemLayoutQ{}) == kRows * kHeadDim);
};

template <flare_dtype D, int kHeadDim>
__global__ void __launch_bounds__(threads_for(kHeadDim), 1) attention_kernel(const __grid_constant__ KvCacheParams p) {
  using namespace cute;
  using T = DecodeTraits<D, kHeadDim>;
  using Element = typename T::Element;
  using Storage = typename T::Storage;
  constexpr int kWarps = T::kWarps;
  constexpr int kStages = T::kStages;
  constexpr int kTile = T::kTile;
  constexpr int kVecs = kHeadDim / 8;            // 16-byte vectors per K / V row
  constexpr int kRowsPerPass = 32 / kVecs;       // rows one pass of a warp's copies covers
  static_assert(32 % kVecs == 0 && kTileKeys % kRowsPerPass == 0, "a warp's copies tile its K / V rows");

  const int tid = threadIdx.x;
  const int lane = tid % 32;
  const int warp = tid / 32;
  int x = blockIdx.x;
  const int split = x % p.num_splits;
  x /= p.num_splits;
  const int hk = x % p.nheads_k;
  const int r0 = x / p.nheads_k * kRows;
  const int b = blockIdx.y;
  const Sequence seq = sequence_of(p, b);
  const int seqlen_q = seq.seqlen_q;
  const int rows_here = min(kRows, p.group * seqlen_q - r0);  // varlen: this sequence's rows, p.rows at most
  if (rows_here <= 0) return;

  // ---- the sequence: its keys, the part of them this split walks
  const int leftpad = seq.leftpad;
  const policy::WindowMask mask{seqlen_q, seq.len_k, p.window_left, p.window_right};
  const KeySpan mine =
      split_keys(keys_seen(mask, queries_of_rows(r0, r0 + rows_here, seqlen_q)), p.num_splits, split, kTileKeys);
  const int my_tiles = tiles_of_warp(mine, warp, kWarps);  // tiles warp, warp + kWarps, ...

  // Where the keys live: K and V at the kv head (the sequence's rows of a dense cache or varlen k / v, block 0
  // of a paged one).
  const Storage* k_base = static_cast<const Storage*>(p.k.data) + hk * p.k.head_stride + seq.k_offset;
  const Storage* v_base = static_cast<const Storage*>(p.v.data) + hk * p.v.head_stride + seq.v_offset;
  const int32_t* table = p.block_table != nullptr ? p.block_table + b * p.block_table_stride : nullptr;

  // ---- shared memory: q, then per warp kStages (K, V) tile pairs, then the warps' row maxima and sums
  extern __shared__ __align__(1024) char smem[];
  Element* q_smem = reinterpret_cast<Element*>(smem);
  Element* kv_smem = q_smem + kRows * kHeadDim;
  float* stats = reinterpret_cast<float*>(smem + q_smem_bytes(kHeadDim, 2) + kv_smem_bytes(kHeadDim, 2));
  float* warp_max = stats;                      // (kWarps, kRows), log2 units
  float* warp_sum = stats + kWarps * kRows;     // (kWarps, kRows)
  Element* my_stages = kv_smem + warp * kStages * 2 * kTile;
  Tensor sQ = make_tensor(make_smem_ptr(q_smem), typename T::SmemLayoutQ{});
  const auto sK_of = [&](int stage) {
    return make_tensor(make_smem_ptr(my_stages + stage * 2 * kTile), typename T::SmemLayoutKV{});
  };
  const auto sVt_of = [&](int stage) {
    return make_tensor(make_smem_ptr(my_stages + stage * 2 * kTile + kTile), typename T::SmemLayoutVt{});
  };

  // ---- global -> shared: this warp's k-th tile (keys mine.begin + (warp + k * kWarps) * kTileKeys ..) into
  // stage k % kStages; rows past the split and columns past the head dims are zero-filled.
  const int vcol = lane % kVecs;
  const int row_in_pass = lane / kVecs;
  const bool k_col = vcol * 8 < p.headdim;
  const bool v_col = vcol * 8 < p.headdim_v;
  const auto load_tile = [&](int k) {
    const int n0 = first_key_of_tile(mine, warp, kWarps, k);
    const int64_t slot0 = int64_t{leftpad} + n0;
    const bool one_block = table != nullptr && slots_in_one_block(slot0, kTileKeys, p.block_size);
    const int64_t block0 = one_block ? table[slot0 / p.block_size] : 0;
    const int64_t row0 = one_block ? slot0 % p.block_size : 0;
    Tensor sK = sK_of(k % kStages);
    Element* sv = my_stages + (k % kStages) * 2 * kTile + kTile;
    Tensor sV = make_tensor(make_smem_ptr(sv), typename T::SmemLayoutKV{});
    CUTE_UNROLL
    for (int pass = 0; pass < kTileKeys / kRowsPerPass; ++pass) {
      const int jj = pass * kRowsPerPass + row_in_pass;
      const bool in = n0 + jj < mine.end;
      int64_t k_off = 0, v_off = 0;
      if (in) {
        Slot s{0, slot0 + jj};  // dense: the row is the slot
        if (one_block) {
          s = {block0, row0 + jj};
        } else if (table != nullptr) {
          s = slot_of(table, p.block_size, slot0 + jj);
        }
        k_off = s.block * p.k.batch_stride + s.row * p.k.row_stride + vcol * 8;
        v_off = s.block * p.v.batch_stride + s.row * p.v.row_stride + vcol * 8;
      }
      cp_async_16(&sK(jj, vcol * 8), k_base + k_off, in && k_col ? 16 : 0);
      cp_async_16(&sV(jj, vcol * 8), v_base + v_off, in && v_col ? 16 : 0);
    }
  };
  // The first tiles go out before anything else is set up.
  CUTE_UNROLL
  for (int k = 0; k < kStages - 1; ++k) {
    if (k < my_tiles) load_tile(k);
    cp_async_fence();
  }

  // ---- q rows (packed: row r is query r % seqlen_q of head hk * group + r / seqlen_q); zeros past the chunk's
  // rows and past headdim
  for (int idx = tid; idx < kRows * kVecs; idx += T::kThreads) {
    const int r = idx / kVecs, c = idx % kVecs * 8;
    uint4 v = make_uint4(0, 0, 0, 0);
    if (r < rows_here && c < p.headdim) {
      const int rr = r0 + r;
      const int h = hk * p.group + rr / seqlen_q;
      v = *reinterpret_cast<const uint4*>(static_cast<const Storage*>(p.q.data) + b * p.q.batch_stride +
                                          int64_t{seq.q_start + rr % seqlen_q} * p.q.row_stride +
                                          h * p.q.head_stride + c);
    }
    *reinterpret_cast<uint4*>(&sQ(r, c)) = v;
  }
  __syncthreads();  // q is in place for every warp

  // ---- the warp's MMAs: S = q K^T (16 x kTileKeys), O += P V (16 x kHeadDim)
  typename T::TiledMma mma;
  auto thr_mma = mma.get_thread_slice(lane);
  Tensor tSrQ = thr_mma.partition_fragment_A(sm80::shape_only<Element>(Shape<Int<kRows>, Int<kHeadDim>>{}));
  Tensor tSrK = thr_mma.partition_fragment_B(sm80::shape_only<Element>(Shape<Int<kTileKeys>, Int<kHeadDim>>{}));
  Tensor tOrVt = thr_mma.partition_fragment_B(sm80::shape_only<Element>(Shape<Int<kHeadDim>, Int<kTileKeys>>{}));
  auto copy_q = make_tiled_copy_A(typename T::SmemCopyAtom{}, mma);
  auto thr_copy_q = copy_q.get_thread_slice(lane);
  Tensor tSsQ = thr_copy_q.partition_S(sQ);
  auto copy_k = make_tiled_copy_B(typename T::SmemCopyAtom{}, mma);
  auto thr_copy_k = copy_k.get_thread_slice(lane);
  auto copy_v = make_tiled_copy_B(typename T::SmemCopyAtomT{}, mma);
  auto thr_copy_v = copy_v.get_thread_slice(lane);

  Tensor acc_o = partition_fragment_C(mma, Shape<Int<kRows>, Int<kHeadDim>>{});
  clear(acc_o);
  Tensor o_rc = sm80::rowcol(acc_o);
  using ScoreCoords = sm80::AccCoords<typename T::TiledMma, Shape<Int<kRows>, Int<kTileKeys>>>;
  const ScoreCoords coords(mma, lane);
  Tensor coord_s = ScoreCoords::offsets();
  Tensor coord_rc = make_tensor(coord_s.data(), sm80::rowcol_layout(coord_s.layout()));
  using OutCoords = sm80::AccCoords<typename T::TiledMma, Shape<Int<kRows>, Int<kHeadDim>>>;
  const OutCoords out_coords(mma, lane);
  Tensor out_coord_s = OutCoords::offsets();
  Tensor out_coord_rc = make_tensor(out_coord_s.data(), sm80::rowcol_layout(out_coord_s.layout()));
  constexpr int kMyRows = decltype(size<0>(o_rc))::value;  // 2: rows lane / 4 and lane / 4 + 8

  // Per row this thread holds: the running max (log2 units) and its partial sum, and the row's constants.
  float row_max[kMyRows], row_sum[kMyRows], slope[kMyRows];
  int lo[kMyRows], hi[kMyRows], diag[kMyRows];
  CUTE_UNROLL
  for (int m = 0; m < kMyRows; ++m) {
    const int r = coords.row_base + get<0>(coord_rc(m, 0));
    const int rr = r0 + r;
    const int i = rr % seqlen_q;
    const int h = hk * p.group + rr / seqlen_q;
    row_max[m] = -INFINITY;
    row_sum[m] = 0.f;
    const policy::KeyRange seen = mask.keys_of(i);
    // Keys this row sees in the split; none for rows past the chunk.
    lo[m] = static_cast<int>(seen.first > mine.begin ? seen.first : mine.begin);
    hi[m] = r < rows_here ? static_cast<int>(seen.last < mine.end - 1 ? seen.last : mine.end - 1) : INT32_MIN;
    diag[m] = static_cast<int>(mask.diagonal(i));
    slope[m] = p.alibi_slopes != nullptr && r < rows_here ? p.alibi_slopes[b * p.alibi_batch_stride + h] : 0.f;
  }
  const float softcap_inv = p.softcap > 0.f ? 1.f / p.softcap : 0.f;

  for (int k = 0; k < my_tiles; ++k) {
    cp_async_wait<kStages - 2>();
    __syncwarp();  // tile k has landed for every lane; every lane is done with tile k - 1's stage
    if (k + kStages - 1 < my_tiles) load_tile(k + kStages - 1);
    cp_async_fence();
    const int n0 = first_key_of_tile(mine, warp, kWarps, k);

    Tensor acc_s = partition_fragment_C(mma, Shape<Int<kRows>, Int<kTileKeys>>{});
    clear(acc_s);
    Tensor tSsK = thr_copy_k.partition_S(sK_of(k % kStages));
    sm80::gemm_ss(acc_s, tSrQ, tSrK, tSsQ, tSsK, mma, copy_q, copy_k, thr_copy_q, thr_copy_k);

    // Scores to log2 logits: scale, softcap, ALiBi, then the row's visible keys; the online softmax.
    Tensor s = sm80::rowcol(acc_s);
    float correction[kMyRows];
    CUTE_UNROLL
    for (int m = 0; m < kMyRows; ++m) {
      float mx = -INFINITY;
      CUTE_UNROLL
      for (int c = 0; c < size<1>(s); ++c) {
        const int j = n0 + coords.col_base + get<1>(coord_rc(m, c));
        float v = s(m, c) * p.scale;
        if (p.softcap > 0.f) v = p.softcap * tanh_approx(v * softcap_inv);
        if (slope[m] != 0.f) v += policy::alibi_bias(slope[m], diag[m], j);
        v = j >= lo[m] && j <= hi[m] ? v * kLog2e : -INFINITY;
        s(m, c) = v;
        mx = fmaxf(mx, v);
      }
      const float m_new = fmaxf(row_max[m], quad_max(mx));
      correction[m] = m_new == -INFINITY ? 1.f : exp2_approx(row_max[m] - m_new);  // 0 on the first visible tile
      const float base = m_new == -INFINITY ? 0.f : m_new;
      float sum = 0.f;
      CUTE_UNROLL
      for (int c = 0; c < size<1>(s); ++c) {
        const float e = exp2_approx(s(m, c) - base);  // -inf -> 0
        s(m, c) = e;
        sum += e;
      }
      row_sum[m] = row_sum[m] * correction[m] + sum;
      row_max[m] = m_new;
    }
    CUTE_UNROLL
    for (int m = 0; m < kMyRows; ++m) {
      CUTE_UNROLL
      for (int c = 0; c < size<1>(o_rc); ++c) o_rc(m, c) *= correction[m];
    }
    Tensor p_tile = convert_fragment<Element>(acc_s);
    Tensor p_a = make_tensor(p_tile.data(), sm80::acc_as_a_layout(p_tile.layout()));
    Tensor tOsVt = thr_copy_v.partition_S(sVt_of(k % kStages));
    sm80::gemm_rs(acc_o, p_a, tOrVt, tOsVt, mma, copy_v, thr_copy_v);
  }

  // ---- merge the warps: each one's rows (max, sum, output) into shared memory (the stages are free once
  // every warp is past its loop), then one pass over (row, 4 columns) per thread
  cp_async_wait<0>();
  __syncthreads();
  float* merged = reinterpret_cast<float*>(kv_smem);  // (kWarps, kRows, kHeadDim)
  CUTE_UNROLL
  for (int m = 0; m < kMyRows; ++m) {
    const int r = coords.row_base + get<0>(coord_rc(m, 0));
    const float sum = quad_sum(row_sum[m]);
    if (lane % 4 == 0) {
      warp_max[warp * kRows + r] = row_max[m];
      warp_sum[warp * kRows + r] = sum;
    }
    const int out_r = out_coords.row_base + get<0>(out_coord_rc(m, 0));  // the same row as r
    CUTE_UNROLL
    for (int c = 0; c < size<1>(o_rc); ++c) {
      merged[(warp * kRows + out_r) * kHeadDim + out_coords.col_base + get<1>(out_coord_rc(m, c))] = o_rc(m, c);
    }
  }
  __syncthreads();

  Storage* out = static_cast<Storage*>(p.out.data);
  for (int idx = tid; idx < rows_here * (kHeadDim / 4); idx += T::kThreads) {
    const int r = idx / (kHeadDim / 4);
    const int c = idx % (kHeadDim / 4) * 4;
    if (c >= p.headdim_v) continue;
    float mx = -INFINITY;
    CUTE_UNROLL
    for (int w = 0; w < kWarps; ++w) mx = fmaxf(mx, warp_max[w * kRows + r]);
    float l = 0.f;
    float o[4] = {0.f, 0.f, 0.f, 0.f};
    if (mx != -INFINITY) {
      CUTE_UNROLL
      for (int w = 0; w < kWarps; ++w) {
        const float wm = warp_max[w * kRows + r];
        if (wm == -INFINITY) continue;  // a warp that saw no key of this row (its output is 0)
        const float f = exp2_approx(wm - mx);
        l += f * warp_sum[w * kRows + r];
        const float4 part = *reinterpret_cast<const float4*>(merged + (w * kRows + r) * kHeadDim + c);
        o[0] += f * part.x;
        o[1] += f * part.y;
        o[2] += f * part.z;
        o[3] += f * part.w;
      }
    }
    const float lse = l > 0.f ? (mx + __log2f(l)) * kLn2 : -INFINITY;
    const int rr = r0 + r;
    const int i = seq.q_start + rr % seqlen_q;  // the query's token (dense: its position)
    const int h = hk * p.group + rr / seqlen_q;
    if (p.num_splits == 1) {
      const policy::SinkFold<float> fold = policy::fold_sink(lse, p.sinks != nullptr ? p.sinks[h] : -INFINITY);
      const float inv = l > 0.f ? fold.factor / l : 0.f;
      *reinterpret_cast<uint2*>(out + b * p.out.batch_stride + int64_t{i} * p.out.row_stride +
                                h * p.out.head_stride + c) =
          make_uint2(from_float2<Storage>(o[0] * inv, o[1] * inv), from_float2<Storage>(o[2] * inv, o[3] * inv));
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
  kernel<<<grid, threads_for(kHeadDim), kSmem, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace flare::cuda::decode

// backward.cuh — the sm80 backward (FlashAttention-2 scheme). Three kernels per call:
//   1. dsum_kernel:     D_i = rowsum(dout_i * out_i), one fp32 per query row, and the dQ buffer zeroed;
//   2. backward_kernel: one CTA per (key tile, head, batch) keeps its K and V tiles in shared memory and walks
//                       the query tiles that see them, recomputing P = exp(s - lse) and accumulating dK and dV
//                       in registers; dQ partial products go to an fp32 buffer with atomicAdd;
//   3. dq_kernel (+ dkv_reduce_kernel for GQA/MQA): fp32 buffers -> the caller's dq (dk, dv) with the scale.
// The dQ buffer holds each kBlockM-row tile in fragment order: element i of thread t's dQ accumulator at
// i * kThreads + t, per column slice of kDqCols (the slices one after the other). Each atomicAdd instruction of
// a warp then covers 32 consecutive floats (one 128-byte line) instead of eight half-used 32-byte sectors;
// dq_kernel maps the order back to (row, column).
// Deterministic mode: each CTA walks several key tiles in a fixed order and owns one of `dq_splits` dq
// buffers, so every dq element receives its additions in the same order; the buffers are summed in order.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <type_traits>

#include "cuda/common/scores.cuh"
#include "cuda/sm80/configs.cuh"

namespace flare::cuda::sm80 {

// ---- programmatic dependent launch (sm_90+) -----------------------------------------------------------------
// A kernel launched chained (launch_chained) may be scheduled once every CTA of the kernel before it has
// called let_next_grid_start or exited; it must call wait_for_prior_grid, which returns once that kernel has
// finished and its writes are visible, before it reads any of them. Both are no-ops in unchained launches and
// in code compiled for older GPUs (which launch_backward_with never chains).
__device__ __forceinline__ void wait_for_prior_grid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void let_next_grid_start() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// ---- 1. D = rowsum(dout * out); the dQ buffer zeroed ----------------------------------------------------
// One CTA per kRowsPerCta query rows of a (head, batch). kLanes threads share a row, each reading 16 bytes of
// out and of dout (head dims are multiples of 8, rows 16-byte aligned: check_problem), and add up their
// products with shuffles. The same grid zeroes every dQ buffer in equal contiguous shares (16-byte stores),
// which the main kernel then accumulates into: one pass over memory instead of a memset and this kernel.
constexpr int kRowsPerCta = 64;
constexpr int kDsumThreads = 256;

template <class Element, int kHeadDim>
__global__ void __launch_bounds__(kDsumThreads) dsum_kernel(const __grid_constant__ BwdParams p) {
  constexpr int kVec = 16 / int(sizeof(Element));
  constexpr int kLanes = std::min(32, int(std::bit_ceil(unsigned(kHeadDim / kVec))));
  constexpr int kRowsPerStep = kDsumThreads / kLanes;
  // Vectors per lane and row: 1 up to 256 columns (fp16 / bf16), more for wide heads.
  constexpr int kChunks = (kHeadDim + kLanes * kVec - 1) / (kLanes * kVec);
  static_assert(kRowsPerCta % kRowsPerStep == 0);
  let_next_grid_start();  // the main kernel's CTAs take SMs as these leave them, then wait for this grid

  const int64_t zero4 = int64_t{p.dq_splits} * p.nheads * p.q_rows * p.headdim_rounded / 4;
  const int64_t ctas = int64_t{gridDim.x} * gridDim.y * gridDim.z;
  const int64_t cta = (int64_t{blockIdx.z} * gridDim.y + blockIdx.y) * gridDim.x + blockIdx.x;
  const int64_t share = (zero4 + ctas - 1) / ctas;
  float4* zero = reinterpret_cast<float4*>(p.dq_accum);
  for (int64_t i = cta * share + threadIdx.x; i < min(zero4, (cta + 1) * share); i += kDsumThreads) {
    zero[i] = make_float4(0.f, 0.f, 0.f, 0.f);
  }

  const int h = blockIdx.y;
  const int b = blockIdx.z;
  const Sequence seq(p, b);
  const Element* out = static_cast<const Element*>(p.out.data) + seq.q_offset(p.out, b, h);
  const Element* dout = static_cast<const Element*>(p.dout.data) + seq.q_offset(p.dout, b, h);
  float* dsum = p.dsum + h * p.q_rows + seq.q_row0(p, b);
  const int col = threadIdx.x % kLanes * kVec;
  const int end = min(seq.len_q, (blockIdx.x + 1) * kRowsPerCta);
  // A fixed trip count: the shuffles need every lane, and the loads of all steps can be in flight at once.
  CUTE_UNROLL
  for (int step = 0; step < kRowsPerCta / kRowsPerStep; ++step) {
    const int i = blockIdx.x * kRowsPerCta + step * kRowsPerStep + threadIdx.x / kLanes;
    float acc = 0.f;
    CUTE_UNROLL
    for (int chunk = 0; chunk < kChunks; ++chunk) {
      const int c = col + chunk * kLanes * kVec;
      if (i < end && c < p.headdim_v) {
        const uint4 o = *reinterpret_cast<const uint4*>(out + i * p.out.row_stride + c);
        const uint4 d = *reinterpret_cast<const uint4*>(dout + i * p.dout.row_stride + c);
        const Element* oe = reinterpret_cast<const Element*>(&o);
        const Element* de = reinterpret_cast<const Element*>(&d);
        CUTE_UNROLL
        for (int k = 0; k < kVec; ++k) acc += static_cast<float>(oe[k]) * static_cast<float>(de[k]);
      }
    }
    CUTE_UNROLL
    for (int o = kLanes / 2; o > 0; o /= 2) acc += __shfl_xor_sync(0xffffffff, acc, o);
    if (i < end && col == 0) dsum[i] = acc;
  }
}

// ---- 2. the main kernel -------------------------------------------------------------------------------------
// One float from global to shared memory, asynchronously (part of the thread's current cp.async group).
__device__ __forceinline__ void cp_async_float(float* to, const float* from) {
  const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(to));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(dst), "l"(from) : "memory");
}

// The column slices of dK, dV and dQ a call's CTAs split (T::kSliced; else 1): ceil(max(headdim, headdim_v) /
// T::kSliceD).
template <class T>
__host__ __device__ __forceinline__ int bwd_slices(BwdParams const& p) {
  if constexpr (T::kSliced) {
    return ((p.headdim > p.headdim_v ? p.headdim : p.headdim_v) + T::kSliceD - 1) / T::kSliceD;
  }
  return 1;
}

// Columns [slice * kCols, +kCols) of a (columns x rows) shared-memory view (Qt, dOt): the B operand of a
// column slice's dK / dV product. The whole view where there is one slice.
template <int kCols, class Tensor>
__device__ __forceinline__ auto column_slice(Tensor&& t, int slice) {
  if constexpr (kCols == decltype(size<0>(t))::value) {
    return t;
  } else {
    return local_tile(t, Shape<Int<kCols>, decltype(size<1>(t))>{}, make_coord(slice, 0));
  }
}

// The query tiles [m_first, m_last) whose rows see any key of tile [n0, n0 + block_n) (empty when none does).
__device__ __forceinline__ void query_tiles_of(policy::WindowMask const& mask, int n0, int block_n, int block_m,
                                               int& m_first, int& m_last) {
  const int len_q = static_cast<int>(mask.seqlen_q);
  const int len_k = static_cast<int>(mask.seqlen_k);
  const policy::KeyRange qs = mask.queries_of_keys(n0, min(n0 + block_n, len_k));
  const int64_t q_first = max<int64_t>(qs.first, 0);
  // No query sees a tile that starts at or past the used keys.
  const int64_t q_last = n0 < len_k ? min<int64_t>(qs.last, len_q - 1) : -1;
  m_first = q_last >= q_first ? static_cast<int>(q_first / block_m) : 0;
  m_last = q_last >= q_first ? static_cast<int>(q_last / block_m) + 1 : 0;
}

// kShaped: compiled for calls with softcap, ALiBi (shaped_scores) or dropout; the common kernel carries none of
// them, which keeps its registers within budget (the softcap path spilled ~1 KB per thread into every call's
// kernel; dropout, at head dim 128 on sm_90, 240 bytes per thread instead of 128 and a quarter more
// instructions: docs/tuning-sm80.md, "Dropout in one kernel").
template <class T, bool kShaped>
__device__ __forceinline__ void backward_body(BwdParams const& p) {
  using Element = typename T::Element;
  constexpr int kBlockM = T::kBlockM;
  constexpr int kBlockN = T::kBlockN;
  constexpr int kHeadDim = T::kHeadDim;
  constexpr int kSliceD = T::kSliceD;

  // With column slices (T::kSliced) grid y is (head, slice), the slices of a head side by side.
  const int slices = bwd_slices<T>(p);
  const int h = static_cast<int>(blockIdx.y) / slices;
  const int slice = static_cast<int>(blockIdx.y) % slices;
  const int col0 = slice * kSliceD;  // this CTA's columns of dK, dV and dQ: [col0, col0 + kSliceD)
  const int b = blockIdx.z;
  const int tid = threadIdx.x;
  const Sequence seq(p, b);
  // Key tiles past seqused_k still run: their dK and dV rows are written as zeros.
  const int n_blocks = (seq.len_k_stored + kBlockN - 1) / kBlockN;
  if (static_cast<int>(blockIdx.x) >= n_blocks) return;
  const int group = p.nheads / p.nheads_k;
  const int hk = h / group;
  const policy::WindowMask mask{seq.len_q, seq.len_k, p.window_left, p.window_right};

  using TileM = Shape<Int<kBlockM>, Int<kHeadDim>>;
  using TileN = Shape<Int<kBlockN>, Int<kHeadDim>>;
  using TileNS = Shape<Int<kBlockN>, Int<kSliceD>>;  // dK and dV of the slice

  extern __shared__ char smem[];
  Element* base = reinterpret_cast<Element*>(smem);
  constexpr int kQ = cosize(typename T::SmemLayoutQ{});
  constexpr int kKV = cosize(typename T::SmemLayoutKV{});
  constexpr int kP = cosize(typename T::SmemLayoutP{});
  // [Q0 (Q1) dO0 (dO1) K V P dS], then with T::kStatsInSmem, as floats, [lse0 D0 (lse1 D1)]
  constexpr int kBufs = T::kQBuffers;
  auto sQ_at = [&](int buf) { return make_tensor(make_smem_ptr(base + buf * kQ), typename T::SmemLayoutQ{}); };
  auto sQt_at = [&](int buf) { return make_tensor(make_smem_ptr(base + buf * kQ), typename T::SmemLayoutQt{}); };
  auto sdO_at = [&](int buf) {
    return make_tensor(make_smem_ptr(base + (kBufs + buf) * kQ), typename T::SmemLayoutQ{});
  };
  auto sdOt_at = [&](int buf) {
    return make_tensor(make_smem_ptr(base + (kBufs + buf) * kQ), typename T::SmemLayoutQt{});
  };
  Element* k_base = base + 2 * kBufs * kQ;
  Tensor sK = make_tensor(make_smem_ptr(k_base), typename T::SmemLayoutKV{});
  Tensor sKt = make_tensor(make_smem_ptr(k_base), typename T::SmemLayoutKt{});
  Tensor sV = make_tensor(make_smem_ptr(k_base + kKV), typename T::SmemLayoutKV{});
  Tensor sP = make_tensor(make_smem_ptr(k_base + 2 * kKV), typename T::SmemLayoutP{});
  Tensor sPt = make_tensor(make_smem_ptr(k_base + 2 * kKV), typename T::SmemLayoutPt{});
  Tensor sdS = make_tensor(make_smem_ptr(k_base + 2 * kKV + kP), typename T::SmemLayoutP{});
  Tensor sdSt = make_tensor(make_smem_ptr(k_base + 2 * kKV + kP), typename T::SmemLayoutPt{});
  float* const row_stats = reinterpret_cast<float*>(k_base + 2 * kKV + 2 * kP);

  typename T::GmemLoad gload;
  auto gthr = gload.get_thread_slice(tid);
  Tensor tQcQ = gthr.partition_S(make_identity_tensor(TileM{}));
  Tensor tKcK = gthr.partition_S(make_identity_tensor(TileN{}));
  // One tile of an operand into shared memory, from `offset` elements into it, `rows` rows of it existing;
  // unpredicated when the tile is whole (every tile but a sequence's last, at a compiled head dim).
  const auto load_tile = [&](Operand const& t, int64_t offset, int rows, int cols, Element* to, auto tile,
                             auto layout, auto const& coord) {
    constexpr int kRowsOfTile = decltype(size<0>(tile))::value;
    Tensor g = make_tensor(make_gmem_ptr(static_cast<const Element*>(t.data) + offset), tile,
                           make_stride(t.row_stride, _1{}));
    Tensor s = make_tensor(make_smem_ptr(to), layout);
    copy_tile(gload, gthr.partition_S(g), gthr.partition_D(s), coord, rows, cols,
              rows >= kRowsOfTile && cols == kHeadDim);
  };
  const auto load_kv = [&](Operand const& t, int64_t offset, int rows, int cols, Element* to) {
    load_tile(t, offset, rows, cols, to, TileN{}, typename T::SmemLayoutKV{}, tKcK);
  };
  const auto load_q = [&](Operand const& t, int64_t offset, int rows, int cols, int to) {
    load_tile(t, offset, rows, cols, base + to * kQ, TileM{}, typename T::SmemLayoutQ{}, tQcQ);
  };

  typename T::MmaSdP mma_sdp;
  auto thr_sdp = mma_sdp.get_thread_slice(tid);
  typename T::MmadKV mma_dkv;
  auto thr_dkv = mma_dkv.get_thread_slice(tid);
  typename T::MmadQ mma_dq;
  auto thr_dq = mma_dq.get_thread_slice(tid);

  // Register fragments of every operand.
  Tensor rQ = thr_sdp.partition_fragment_A(shape_only<Element>(TileM{}));
  Tensor rK = thr_sdp.partition_fragment_B(shape_only<Element>(TileN{}));
  Tensor rdO = thr_sdp.partition_fragment_A(shape_only<Element>(TileM{}));
  Tensor rV = thr_sdp.partition_fragment_B(shape_only<Element>(TileN{}));
  Tensor rPt = thr_dkv.partition_fragment_A(shape_only<Element>(Shape<Int<kBlockN>, Int<kBlockM>>{}));
  Tensor rdOt = thr_dkv.partition_fragment_B(shape_only<Element>(Shape<Int<kSliceD>, Int<kBlockM>>{}));
  Tensor rdSt = thr_dkv.partition_fragment_A(shape_only<Element>(Shape<Int<kBlockN>, Int<kBlockM>>{}));
  Tensor rQt = thr_dkv.partition_fragment_B(shape_only<Element>(Shape<Int<kSliceD>, Int<kBlockM>>{}));
  Tensor rdS = thr_dq.partition_fragment_A(shape_only<Element>(Shape<Int<kBlockM>, Int<kBlockN>>{}));
  constexpr int kDqCols = T::kDqCols;
  using TileDq = Shape<Int<kBlockM>, Int<kDqCols>>;
  Tensor rKt = thr_dq.partition_fragment_B(shape_only<Element>(Shape<Int<kDqCols>, Int<kBlockN>>{}));

  // Shared -> register copies.
  auto copy_a_sdp = make_tiled_copy_A(typename T::SmemCopyAtom{}, mma_sdp);
  auto thr_a_sdp = copy_a_sdp.get_thread_slice(tid);
  auto copy_b_sdp = make_tiled_copy_B(typename T::SmemCopyAtom{}, mma_sdp);
  auto thr_b_sdp = copy_b_sdp.get_thread_slice(tid);
  auto copy_a_dkv = make_tiled_copy_A(typename T::SmemCopyAtomT{}, mma_dkv);
  auto thr_a_dkv = copy_a_dkv.get_thread_slice(tid);
  auto copy_b_dkv = make_tiled_copy_B(typename T::SmemCopyAtomT{}, mma_dkv);
  auto thr_b_dkv = copy_b_dkv.get_thread_slice(tid);
  auto copy_a_dq = make_tiled_copy_A(typename T::SmemCopyAtom{}, mma_dq);
  auto thr_a_dq = copy_a_dq.get_thread_slice(tid);
  auto copy_b_dq = make_tiled_copy_B(typename T::SmemCopyAtomT{}, mma_dq);
  auto thr_b_dq = copy_b_dq.get_thread_slice(tid);
  auto copy_p = make_tiled_copy_C(typename T::SmemCopyAtomP{}, mma_sdp);
  auto thr_p = copy_p.get_thread_slice(tid);

  Tensor tSsK = thr_b_sdp.partition_S(sK);
  Tensor tSsV = thr_b_sdp.partition_S(sV);
  Tensor tPsPt = thr_a_dkv.partition_S(sPt);
  Tensor tdSsdSt = thr_a_dkv.partition_S(sdSt);
  Tensor tdQsdS = thr_a_dq.partition_S(sdS);
  Tensor sKt_slices = local_tile(sKt, Shape<Int<kDqCols>, Int<kBlockN>>{}, make_coord(_, 0));  // (cols, N, slice)
  Tensor tPsP = thr_p.partition_D(sP);
  Tensor tPsdS = thr_p.partition_D(sdS);

  // Accumulator coordinates as base + constant offsets (AccCoords).
  using ScoreCoords = AccCoords<typename T::MmaSdP, Shape<Int<kBlockM>, Int<kBlockN>>>;
  const ScoreCoords coords(mma_sdp, tid);
  Tensor coord_s = ScoreCoords::offsets();
  Tensor coord_rc = make_tensor(coord_s.data(), rowcol_layout(coord_s.layout()));
  constexpr int kRows = decltype(size<0>(coord_rc))::value;

  // Deterministic mode walks several key tiles, one after the other.
  for (int n_block = blockIdx.x; n_block < n_blocks; n_block += gridDim.x) {
    const int n0 = n_block * kBlockN;
    int m_first, m_last;
    query_tiles_of(mask, n0, kBlockN, kBlockM, m_first, m_last);
    // The tile's loads go first: the set-up below runs while they land.
    __syncthreads();  // the previous key tile (deterministic mode) is done with shared memory
    load_kv(p.k, seq.k_offset(p.k, b, hk) + int64_t{n0} * p.k.row_stride, seq.len_k - n0, p.headdim, k_base);
    load_kv(p.v, seq.k_offset(p.v, b, hk) + int64_t{n0} * p.v.row_stride, seq.len_k - n0, p.headdim_v,
            k_base + kKV);
    const int64_t q_offset = seq.q_offset(p.q, b, h);
    const int64_t dout_offset = seq.q_offset(p.dout, b, h);
    const int64_t q_row0 = seq.q_row0(p, b);
    const float* lse = p.lse + seq.lse_offset(p, b, h);
    const float* dsum = p.dsum + h * p.q_rows + q_row0;
    // kStatsInSmem: query tile m's lse (with_lse) and D (with_dsum) into statistics buffer `buf`, a float per
    // thread, in the caller's cp.async group; rows past the sequence are skipped (never read).
    const auto load_row_stats = [&](int m, int buf, bool with_lse, bool with_dsum) {
      if constexpr (T::kStatsInSmem) {
        float* to = row_stats + buf * 2 * kBlockM;
        for (int x = tid; x < 2 * kBlockM; x += T::kThreads) {
          const bool is_lse = x < kBlockM;
          const int i = m * kBlockM + (is_lse ? x : x - kBlockM);
          if (i < seq.len_q && (is_lse ? with_lse : with_dsum)) cp_async_float(to + x, is_lse ? lse + i : dsum + i);
        }
      }
    };
    if (m_last > m_first) {
      const int q_rows = seq.len_q - m_first * kBlockM;
      load_q(p.q, q_offset + int64_t{m_first} * kBlockM * p.q.row_stride, q_rows, p.headdim, 0);
      load_q(p.dout, dout_offset + int64_t{m_first} * kBlockM * p.dout.row_stride, q_rows, p.headdim_v, kBufs);
      load_row_stats(m_first, 0, true, false);
    }
    cp_async_fence();
    // dsum_kernel's D and zeroed dQ buffer (the loads above read only the call's inputs).
    wait_for_prior_grid();
    if constexpr (T::kStatsInSmem) {
      if (m_last > m_first) load_row_stats(m_first, 0, false, true);
      cp_async_fence();
    }

    const ScoreShape shape(p, b, h, seq.len_q, seq.len_k);
    const float f = shape.log2_factor;
    const bool dropping = kShaped && p.dropout_p > 0.f;  // compiled out of the common kernel
    const DropoutStream dropout(p, b, h);
    float* dq_accum = p.dq_accum +
                      ((static_cast<int64_t>(p.deterministic ? blockIdx.x : 0) * p.nheads + h) * p.q_rows + q_row0) *
                          kHeadDim;
    const Span seeing_all = shape.rows_seeing_all(n0, n0 + kBlockN);  // query tiles inside need no mask

    Tensor acc_dk = partition_fragment_C(mma_dkv, TileNS{});
    Tensor acc_dv = partition_fragment_C(mma_dkv, TileNS{});
    clear(acc_dk);
    clear(acc_dv);

    // The next query tile's Q or dO (operand t, its rows from `offset`) into buffer `to`.
    const auto load_next = [&](int m, auto const& t, int64_t offset, int to, int cols) {
      const int q_rows = seq.len_q - (m + 1) * kBlockM;
      load_q(t, offset + int64_t{m + 1} * kBlockM * t.row_stride, q_rows, cols, to);
      cp_async_fence();
    };
    // One query tile; `masked`: whether it takes the mask, a bool or (T::kMaskLoopApart) a compile-time
    // constant. Always inlined (the accumulators it captures by reference stay in registers).
    const auto visit = [&](int m, auto masked) __attribute__((always_inline)) {
      const bool is_masked = masked;
      const int buf = kBufs == 2 ? (m - m_first) & 1 : 0;
      const int m0 = m * kBlockM;
      const bool more = m + 1 < m_last;
      cp_async_wait<0>();
      __syncthreads();  // Q[m], dO[m] have landed; the other buffers, sP and sdS are free
      if (kBufs == 2 && more) {
        load_row_stats(m + 1, buf ^ 1, true, true);  // in load_next's cp.async group
        load_next(m, p.q, q_offset, buf ^ 1, p.headdim);
        load_next(m, p.dout, dout_offset, kBufs + (buf ^ 1), p.headdim_v);
      }

      // Per-row lse (log2 units; +inf makes P = 0 for fully masked rows and rows past the end) and D, from
      // shared memory with kStatsInSmem, else from global memory.
      const float* stats = row_stats + buf * 2 * kBlockM;
      float lse2[kRows];
      float dd[kRows];
      CUTE_UNROLL
      for (int r = 0; r < kRows; ++r) {
        const int row = coords.row_base + get<0>(coord_rc(r, 0));
        const int i = m0 + row;
        const bool in_seq = i < seq.len_q;
        const float l = !in_seq ? -INFINITY : T::kStatsInSmem ? stats[row] : lse[i];
        lse2[r] = l == -INFINITY ? INFINITY : l * kLog2e;
        dd[r] = !in_seq ? 0.f : T::kStatsInSmem ? stats[kBlockM + row] : dsum[i];
      }

      Tensor acc_s = partition_fragment_C(mma_sdp, Shape<Int<kBlockM>, Int<kBlockN>>{});
      clear(acc_s);
      gemm_ss(acc_s, rQ, rK, thr_a_sdp.partition_S(sQ_at(buf)), tSsK, mma_sdp, copy_a_sdp, copy_b_sdp, thr_a_sdp,
              thr_b_sdp);
      Tensor acc_dp = partition_fragment_C(mma_sdp, Shape<Int<kBlockM>, Int<kBlockN>>{});
      clear(acc_dp);
      gemm_ss(acc_dp, rdO, rV, thr_a_sdp.partition_S(sdO_at(buf)), tSsV, mma_sdp, copy_a_sdp, copy_b_sdp,
              thr_a_sdp, thr_b_sdp);

      // P = exp2(x - lse) and dS = P (dP - D) (times 1 - tanh² under softcap), element by element as the
      // scores are shaped. Both products come first: P computed between them (stored while dP runs) is slower
      // (docs/tuning-sm80.md, "Backward: the passes around the main kernel").
      Tensor s = rowcol(acc_s);
      Tensor dp = rowcol(acc_dp);
      // With dropout (factor z of the element, from its keep bit): P z for dV, and dS = P (dP z - D).
      uint64_t keep[kRows];
      if (dropping) {
        dropout_bits<T::kDropoutColumnsPerDraw>(dropout, coord_rc, m0 + coords.row_base, n0 + coords.col_base,
                                                keep);
      }
      const auto p_and_ds = [&](int r, int c, float x, float dtanh) {
        const float pr = exp2_approx(fmaf(x, f, -lse2[r]));
        const float z = !dropping ? 1.f : (keep[r] >> c) & 1 ? dropout.scale : 0.f;
        s(r, c) = pr * z;
        dp(r, c) = pr * (dp(r, c) * z - dd[r]) * dtanh;
      };
      if constexpr (kShaped) {
        shape_scores_each(s, coord_rc, m0 + coords.row_base, n0 + coords.col_base, shape, is_masked, p_and_ds);
      } else {
        if (is_masked) mask_scores(s, coord_rc, m0 + coords.row_base, n0 + coords.col_base, shape);
        CUTE_UNROLL
        for (int r = 0; r < kRows; ++r) {
          CUTE_UNROLL
          for (int c = 0; c < size<1>(s); ++c) p_and_ds(r, c, s(r, c), 1.f);
        }
      }
      // P and dS to shared memory: the dK/dV products read them transposed, the dQ product as they are.
      Tensor p_elem = convert_fragment<Element>(acc_s);
      copy(copy_p, thr_p.retile_S(p_elem), tPsP);
      Tensor ds_elem = convert_fragment<Element>(acc_dp);
      copy(copy_p, thr_p.retile_S(ds_elem), tPsdS);
      __syncthreads();

      gemm_ss(acc_dv, rPt, rdOt, tPsPt, thr_b_dkv.partition_S(column_slice<kSliceD>(sdOt_at(buf), slice)), mma_dkv,
              copy_a_dkv, copy_b_dkv, thr_a_dkv, thr_b_dkv);
      if (kBufs == 1 && more) {
        __syncthreads();  // every warp is done with dO[m]
        load_next(m, p.dout, dout_offset, kBufs, p.headdim_v);
      }
      // dQ before dK: its atomics then drain while the dK product keeps the tensor cores busy.
      CUTE_UNROLL
      for (int piece = 0; piece < kSliceD / kDqCols; ++piece) {
        // The dQ slice (kDqCols wide) of this piece of the CTA's columns.
        const int dq_slice = slice * (kSliceD / kDqCols) + piece;
        Tensor acc_dq = partition_fragment_C(mma_dq, TileDq{});
        clear(acc_dq);
        gemm_ss(acc_dq, rdS, rKt, tdQsdS, thr_b_dq.partition_S(sKt_slices(_, _, dq_slice)), mma_dq, copy_a_dq,
                copy_b_dq, thr_a_dq, thr_b_dq);
        // Fragment order within the slice; slices one after the other (top).
        float* dq_tile = dq_accum + static_cast<int64_t>(m0) * kHeadDim + dq_slice * (kBlockM * kDqCols) + tid;
        CUTE_UNROLL
        for (int i = 0; i < size(acc_dq); ++i) atomicAdd(dq_tile + i * T::kThreads, acc_dq(i));
      }
      gemm_ss(acc_dk, rdSt, rQt, tdSsdSt, thr_b_dkv.partition_S(column_slice<kSliceD>(sQt_at(buf), slice)), mma_dkv,
              copy_a_dkv, copy_b_dkv, thr_a_dkv, thr_b_dkv);
      if (kBufs == 1 && more) {
        __syncthreads();  // every warp is done with Q[m] (and read its row statistics at the top)
        load_row_stats(m + 1, 0, true, true);
        load_next(m, p.q, q_offset, 0, p.headdim);
      }
    };
    if constexpr (T::kMaskLoopApart && !kShaped) {
      // Tiles from the first up to the first that sees the whole key tile take the mask (the diagonal, under
      // a causal mask), then the whole ones run without it, then the rest (a window's far edge, the end of the
      // rows) take it again. Each loop is compiled for its case: with the mask under a run-time condition,
      // ptxas predicated its compares into the element loop, so that tiles without it still issued them (a
      // seventh of all instructions at head dim 64 without a mask; docs/tuning-sm80.md, "Backward: masked and
      // whole tiles apart"). The kernel with softcap or ALiBi keeps one loop: its score transform runs on
      // every tile anyway.
      int m = m_first;
      for (; m < m_last && !seeing_all.covers(m * kBlockM, kBlockM); ++m) visit(m, std::true_type{});
      for (; m < m_last && seeing_all.covers(m * kBlockM, kBlockM); ++m) visit(m, std::false_type{});
      for (; m < m_last; ++m) visit(m, std::true_type{});
    } else {
      for (int m = m_first; m < m_last; ++m) visit(m, !seeing_all.covers(m * kBlockM, kBlockM));
    }

    // dK (scaled) and dV: straight to the caller's tensors (MHA) or to per-query-head fp32 buffers (GQA).
    using KvCoords = AccCoords<typename T::MmadKV, TileNS>;
    const KvCoords kv_coords(mma_dkv, tid);
    Tensor coord_kv = KvCoords::offsets();
    CUTE_UNROLL
    for (int i = 0; i < size(acc_dk); ++i) acc_dk(i) *= p.scale;
    // Nothing may still be landing in shared memory: with no query tile to visit, the loop never waited
    // for the K and V copies (and the next key tile, in deterministic mode, reuses the buffers).
    cp_async_wait<0>();
    if (group == 1) {
      __syncthreads();  // shared memory is reused for the output tiles
      Tensor sdK = make_tensor(make_smem_ptr(k_base), typename T::SmemLayoutKVSlice{});
      Tensor sdV = make_tensor(make_smem_ptr(k_base + kKV), typename T::SmemLayoutKVSlice{});
      auto copy_o = make_tiled_copy_C(typename T::SmemCopyAtomO{}, mma_dkv);
      auto thr_o = copy_o.get_thread_slice(tid);
      Tensor dk_elem = convert_fragment<Element>(acc_dk);
      Tensor dv_elem = convert_fragment<Element>(acc_dv);
      copy(copy_o, thr_o.retile_S(dk_elem), thr_o.partition_D(sdK));
      copy(copy_o, thr_o.retile_S(dv_elem), thr_o.partition_D(sdV));
      __syncthreads();
      typename T::GmemStore gstore;
      auto sthr = gstore.get_thread_slice(tid);
      Tensor gdK = local_tile(gmem_rows<Element, kSliceD>(p.dk, seq.k_offset(p.dk, b, h) + col0, seq.len_k),
                              TileNS{}, make_coord(n_block, 0));
      Tensor gdV = local_tile(gmem_rows<Element, kSliceD>(p.dv, seq.k_offset(p.dv, b, h) + col0, seq.len_k),
                              TileNS{}, make_coord(n_block, 0));
      Tensor tOcO = sthr.partition_S(make_identity_tensor(TileNS{}));
      const int rows_out = seq.len_k_stored - n0;
      copy_rows<false>(gstore, sthr.partition_S(sdK), sthr.partition_D(gdK), tOcO, rows_out, p.headdim - col0);
      copy_rows<false>(gstore, sthr.partition_S(sdV), sthr.partition_D(gdV), tOcO, rows_out, p.headdim_v - col0);
    } else {
      const int64_t row0 = h * p.k_rows + seq.k_row0(p, b) + n0 + kv_coords.row_base;
      float* dk = p.dk_accum + row0 * kHeadDim + col0 + kv_coords.col_base;
      float* dv = p.dv_accum + row0 * kHeadDim + col0 + kv_coords.col_base;
      CUTE_UNROLL
      for (int i = 0; i < size(acc_dk); ++i) {
        const int64_t at = get<0>(coord_kv(i)) * kHeadDim + get<1>(coord_kv(i));
        dk[at] = acc_dk(i);
        dv[at] = acc_dv(i);
      }
    }
  }
}

// CTAs per SM the main kernel is compiled for: T::kMinBlocks where T has one (a tuning variant), else 1.
template <class T, class = void>
struct MinBlocksOf {
  static constexpr int value = 1;
};
template <class T>
struct MinBlocksOf<T, std::void_t<decltype(T::kMinBlocks)>> {
  static constexpr int value = T::kMinBlocks;
};

template <class T, bool kShaped>
__global__ void __launch_bounds__(T::kThreads, MinBlocksOf<T>::value) backward_kernel(const __grid_constant__ BwdParams p) {
  if constexpr (body_here<T::kClass>()) {
    let_next_grid_start();
    backward_body<T, kShaped>(p);
  } else {
    __trap();  // backend.cu never picks this class on the GPUs that run this cubin
  }
}

// ---- 3. fp32 buffers -> the caller's gradients ----------------------------------------------------------------
// dq = scale * (sum of the dq_splits buffers, in order). One CTA per (query tile, head, batch), with the main
// kernel's thread count. The buffer is read in 16-byte vectors: thread u reads floats 4u .. 4u + 3 of each
// block k of 4 x kThreads floats, which in the fragment order (top) are element i = 4u / kThreads + 4k of
// threads t = 4u mod kThreads .. t + 3, and puts them at those threads' (row, column) of a shared-memory tile;
// the tile goes out in 16-byte row vectors. One column slice at a time. (Read as four-byte words and written
// straight from the fragments two bytes at a time, the pass took 3.4 times as long: docs/tuning-sm80.md,
// "Backward: the passes around the main kernel".)
template <class T>
__global__ void __launch_bounds__(T::kThreads) dq_kernel(const __grid_constant__ BwdParams p) {
  using Element = typename T::Element;
  constexpr int kBlockM = T::kBlockM;
  constexpr int kHeadDim = T::kHeadDim;
  constexpr int kCols = T::kDqCols;
  constexpr int kThreads = T::kThreads;
  constexpr int kVec = 16 / int(sizeof(Element));
  // Rows padded by 16 bytes, to spread the rows that one store instruction writes over the banks.
  constexpr int kPitch = kCols + kVec;
  __shared__ alignas(16) Element tile[kBlockM * kPitch];
  const int h = blockIdx.y;
  const int b = blockIdx.z;
  const int tid = threadIdx.x;
  let_next_grid_start();
  wait_for_prior_grid();
  const Sequence seq(p, b);
  const int m0 = blockIdx.x * kBlockM;
  if (m0 >= seq.len_q) return;
  typename T::MmadQ mma_dq;
  using DqCoords = AccCoords<typename T::MmadQ, Shape<Int<kBlockM>, Int<kCols>>>;
  Tensor offsets = DqCoords::offsets();
  constexpr int kElems = decltype(size(offsets))::value;  // per thread and slice
  static_assert(kElems % 4 == 0);
  const int i0 = 4 * tid / kThreads;  // this thread's elements: i0, i0 + 4, ... of the four threads from t0
  const int t0 = 4 * tid % kThreads;
  const DqCoords owner[4] = {DqCoords(mma_dq, t0), DqCoords(mma_dq, t0 + 1), DqCoords(mma_dq, t0 + 2),
                             DqCoords(mma_dq, t0 + 3)};
  Element* dq = static_cast<Element*>(p.dq.data) + seq.q_offset(p.dq, b, h);
  const int64_t split_stride = static_cast<int64_t>(p.nheads) * p.q_rows * kHeadDim;
  const float* src = p.dq_accum + (h * p.q_rows + seq.q_row0(p, b) + m0) * kHeadDim + 4 * tid;
  const int rows = min(kBlockM, seq.len_q - m0);
  for (int slice = 0; slice < kHeadDim / kCols; ++slice) {
    const int col0 = slice * kCols;
    if (col0 >= p.headdim) break;
    // Every load of a buffer issued before any is used (the split loop outside the element loop).
    const float* at = src + slice * (kBlockM * kCols);
    float4 acc[kElems / 4];
    CUTE_UNROLL
    for (int k = 0; k < kElems / 4; ++k) acc[k] = *reinterpret_cast<const float4*>(at + k * 4 * kThreads);
    for (int s = 1; s < p.dq_splits; ++s) {
      CUTE_UNROLL
      for (int k = 0; k < kElems / 4; ++k) {
        const float4 v = *reinterpret_cast<const float4*>(at + s * split_stride + k * 4 * kThreads);
        acc[k].x += v.x;
        acc[k].y += v.y;
        acc[k].z += v.z;
        acc[k].w += v.w;
      }
    }
    CUTE_UNROLL
    for (int k = 0; k < kElems / 4; ++k) {
      const auto at_i = offsets(i0 + 4 * k);
      const int r = get<0>(at_i);
      const int c = get<1>(at_i);
      const float v[4] = {acc[k].x, acc[k].y, acc[k].z, acc[k].w};
      CUTE_UNROLL
      for (int j = 0; j < 4; ++j) {
        tile[(owner[j].row_base + r) * kPitch + owner[j].col_base + c] = static_cast<Element>(v[j] * p.scale);
      }
    }
    __syncthreads();
    const int cols = min(kCols, p.headdim - col0);
    for (int v = tid; v < kBlockM * (kCols / kVec); v += kThreads) {
      const int row = v / (kCols / kVec);
      const int col = v % (kCols / kVec) * kVec;
      if (row < rows && col < cols) {
        *reinterpret_cast<uint4*>(dq + static_cast<int64_t>(m0 + row) * p.dq.row_stride + col0 + col) =
            *reinterpret_cast<const uint4*>(&tile[row * kPitch + col]);
      }
    }
    __syncthreads();
  }
}

// GQA/MQA: dk and dv of kv head hk = the sum over its query heads, in head order.
template <class Element, int kHeadDim>
__global__ void __launch_bounds__(256) dkv_reduce_kernel(const __grid_constant__ BwdParams p) {
  wait_for_prior_grid();
  const int hk = blockIdx.y;
  const int b = blockIdx.z;
  const Sequence seq(p, b);
  const int group = p.nheads / p.nheads_k;
  const int64_t row0 = seq.k_row0(p, b);
  Element* dk = static_cast<Element*>(p.dk.data) + seq.k_offset(p.dk, b, hk);
  Element* dv = static_cast<Element*>(p.dv.data) + seq.k_offset(p.dv, b, hk);
  const int width = max(p.headdim, p.headdim_v);
  const int j_end = min(seq.len_k_stored, (blockIdx.x + 1) * kRowsPerCta);
  for (int idx = threadIdx.x; idx < kRowsPerCta * width; idx += blockDim.x) {
    const int j = blockIdx.x * kRowsPerCta + idx / width;
    const int c = idx % width;
    if (j >= j_end) break;
    float sk = 0.f, sv = 0.f;
    for (int g = 0; g < group; ++g) {
      const int64_t at = ((hk * group + g) * p.k_rows + row0 + j) * kHeadDim + c;
      sk += p.dk_accum[at];
      sv += p.dv_accum[at];
    }
    if (c < p.headdim) dk[j * p.dk.row_stride + c] = static_cast<Element>(sk);
    if (c < p.headdim_v) dv[j * p.dv.row_stride + c] = static_cast<Element>(sv);
  }
}

// The grids of the backward's kernels (launch_backward_with; x = 0: nothing to launch): dsum_kernel's
// (kRowsPerCta query rows per CTA), the main kernel's (a key tile per CTA, or deterministic, dq_splits CTAs per
// (head, sequence)) and dq_kernel's (a query tile per CTA).
template <class T>
struct BwdGrids {
  dim3 rows, main, dq;
  explicit BwdGrids(BwdParams const& p)
      : rows((p.seqlen_q + kRowsPerCta - 1) / kRowsPerCta, p.nheads, p.batch),
        main(p.seqlen_k == 0 ? 0 : p.deterministic ? p.dq_splits : (p.seqlen_k + T::kBlockN - 1) / T::kBlockN,
             p.nheads * bwd_slices<T>(p), p.batch),
        dq((p.seqlen_q + T::kBlockM - 1) / T::kBlockM, p.nheads, p.batch) {}
};

// Whether chained launches may run the backward's kernels of traits T on the current device: only where the
// cubin it runs is sm_90+ code, whose kernels carry the waits (an sm_80 cubin on a Hopper GPU has none).
// Looked up once per device.
template <class T>
bool chained_launch_allowed() {
  constexpr int kDevices = 64;
  static std::atomic<signed char> known[kDevices];  // 0 unknown, 1 no, 2 yes
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess || device < 0 || device >= kDevices) return false;
  signed char k = known[device].load(std::memory_order_relaxed);
  if (k == 0) {
    cudaFuncAttributes attr{};
    k = cudaFuncGetAttributes(&attr, dq_kernel<T>) == cudaSuccess && attr.binaryVersion >= 90 ? 2 : 1;
    known[device].store(k, std::memory_order_relaxed);
  }
  return k == 2;
}

// Launches `kernel` on `stream`, with programmatic dependent launch where `chained`: it may then start while
// the stream's previous kernel drains (the kernel waits for it: wait_for_prior_grid).
template <class Kernel>
cudaError_t launch_chained(Kernel kernel, dim3 grid, int threads, int smem, cudaStream_t stream, bool chained,
                           BwdParams const& p) {
  cudaLaunchAttribute attr{};
  attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr.val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = dim3(threads);
  config.dynamicSmemBytes = static_cast<size_t>(smem);
  config.stream = stream;
  config.attrs = &attr;
  config.numAttrs = chained ? 1 : 0;
  return cudaLaunchKernelEx(&config, kernel, p);
}

// Runs the whole backward with one traits type and score kernel on `stream`; the workspace in p is laid out by
// the caller (backend.cu) and needs no initialisation (dsum_kernel zeroes the dQ buffers). The kernels after
// dsum_kernel are launched chained where the device allows it and `chain` (the variants tool times both):
// each one's launch and first loads then overlap the previous one's last CTAs.
template <class T, bool kShaped>
cudaError_t launch_backward_with(BwdParams const& p, cudaStream_t stream, bool chain = true) {
  if (!kShaped && p.dropout_p > 0.f) return cudaErrorNotSupported;  // routed past launch_backward's rule
  using Element = typename T::Element;
  const BwdGrids<T> grids(p);
  const bool chained = chain && chained_launch_allowed<T>();
  if (grids.rows.x > 0) {
    dsum_kernel<Element, T::kHeadDim><<<grids.rows, kDsumThreads, 0, stream>>>(p);
    if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
  }

  const auto kernel = backward_kernel<T, kShaped>;
  constexpr int kSmem = T::kSmemBytes;
  if constexpr (kSmem > 48 * 1024) {
    if (cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem);
        e != cudaSuccess) {
      return e;
    }
  }
  if (grids.main.x > 0) {
    if (cudaError_t e = launch_chained(kernel, grids.main, T::kThreads, kSmem, stream, chained, p); e != cudaSuccess) {
      return e;
    }
  }
  if (grids.dq.x > 0) {
    if (cudaError_t e = launch_chained(dq_kernel<T>, grids.dq, T::kThreads, 0, stream, chained, p);
        e != cudaSuccess) {
      return e;
    }
  }
  if (p.nheads != p.nheads_k && grids.main.x > 0) {
    const dim3 kv_grid((p.seqlen_k + kRowsPerCta - 1) / kRowsPerCta, p.nheads_k, p.batch);
    if (cudaError_t e = launch_chained(dkv_reduce_kernel<Element, T::kHeadDim>, kv_grid, 256, 0, stream, chained, p);
        e != cudaSuccess) {
      return e;
    }
  }
  return cudaSuccess;
}

// The backward of a call: traits T, or TShaped for calls with softcap, ALiBi (shaped_scores) or dropout. Both
// must have the key-tile height the host sized the workspace for.
// Wide heads (column slices, T::kSliced) compile the kernel with the score transform alone and run every call
// on it: over 384-576 columns per score the transform's per-element cost is small, and one kernel per unit
// keeps the build within its budget.
template <class T, class TShaped = T>
cudaError_t launch_backward(BwdParams const& p, cudaStream_t stream) {
  static_assert(T::kBlockN == TShaped::kBlockN, "one key-tile height per head dim (backward_block_n)");
  if constexpr (T::kSliced) {
    return launch_backward_with<TShaped, true>(p, stream);
  } else {
    if (shaped_scores(p) || p.dropout_p > 0.f) return launch_backward_with<TShaped, true>(p, stream);
    using Short = typename BwdShortOf<T>::type;  // configs.cuh: short sequences, where it pays
    if constexpr (!std::is_void_v<Short>) {
      static_assert(Short::kBlockN == T::kBlockN && Short::kBlockM == T::kBlockM, "the same workspace");
      if (backward_short(p)) return launch_backward_with<Short, false>(p, stream);
    }
    return launch_backward_with<T, false>(p, stream);
  }
}

}  // namespace flare::cuda::sm80

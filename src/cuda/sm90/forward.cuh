// forward.cuh — the sm90a forward kernel (FlashAttention-3 scheme): one CTA per (query tile, head, batch),
// warp-specialised. Warpgroup 0 produces: one thread issues TMA copies of Q once and of K and V through two
// rings of shared-memory stages. Warpgroups 1.. consume: each owns 64 query rows of the tile and runs
// S = Q·Kᵀ and O += P·V on the tensor cores with wgmma, the online softmax in registers between them.
//
// Two overlaps hide the softmax: within a warpgroup, the P·V product of key block n + 1 runs while the softmax
// of block n is computed (each step issues S(n) and O += P(n+1)·V(n+1), then waits for S alone); across
// warpgroups, named barriers make them issue their products in turn, so one's softmax runs under the other's
// matmuls. Key blocks are walked from the last to the first, masked blocks apart from unmasked ones
// (policy::key_blocks_of), so the unmasked majority does no per-element mask work. O is staged in shared
// memory and written by one TMA store per tile; rows past the sequence are clipped by the copy engine.
//
// Varlen batches (cu_seqlens) and seqused_k: the TMA views of a varlen operand hold every token of the batch
// as one sequence, and a tile's box starts at its sequence's first token (sequence_view). Rows past the
// sequence's end are then another sequence's (or, past seqused_k, unwritten cache slots): their scores are
// masked, the V rows of the last key block past the end are zeroed in shared memory before P·V reads them
// (0 · NaN would reach the row), and O is written by the consumer threads with a row predicate instead of
// the TMA store, which would overwrite the next sequence's rows.
#pragma once

#include "cuda/sm90/cute_config.hpp"  // first: options for the CuTe headers

#include <cuda_runtime.h>

#include <algorithm>

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>

#include "common/attention_policy.hpp"
#include "cuda/common/scores.cuh"
#include "cuda/sm90/gmma_views.cuh"
#include "cuda/sm90/kernel_traits.cuh"
#include "cuda/sm90/tile_scheduler.hpp"

namespace flare::cuda::sm90 {

// Named barriers of the forward (ids after CUTLASS's reserved ones).
enum class FwdBarrier : uint32_t {
  kEpilogue = 0,      // every consumer warpgroup: Q is dead / O is staged
  kWarpgroupTurn = 1  // + consumer warpgroup index: its turn to issue matmuls
};

__device__ __forceinline__ uint32_t barrier_id(FwdBarrier b, int offset = 0) {
  return static_cast<uint32_t>(b) + static_cast<uint32_t>(offset);
}

// The same shared-memory descriptors with a base the compiler cannot see through. Q's descriptors are the
// same on every key block, so without this the compiler computes one per k step once and holds them all
// across the key loop: 2 registers each, 32 at head dim 256, which spilled the consumers (LDL/STL). Laundered
// at each use, each k step's descriptor is one add issued beside its wgmma. Used where FwdTraits::kOpaqueQ.
template <class TA>
__device__ __forceinline__ auto opaque_descriptors(TA const& a) {
  GMMA::DescriptorIterator it = a.data();
  asm volatile("" : "+r"(it.desc_.reg32_[0]));
  return make_tensor(it, a.layout());
}

// acc (+)= A·B over the k extent of the operands, issued as one wgmma batch (not waited for). A is a
// register fragment (P) or shared-memory descriptors (Q).
template <bool kZeroInit, bool kOpaqueA = false, class Mma, class TA, class TB, class TC>
__device__ __forceinline__ void wgmma(Mma& mma, TA const& a_in, TB const& b, TC& acc) {
  constexpr bool kRegA = !std::is_same_v<typename TA::value_type, GMMA::DescriptorIterator::value_type>;
  static_assert(!(kRegA && kOpaqueA), "only shared-memory descriptors are made opaque");
  if constexpr (kRegA) warpgroup_fence_operand(const_cast<TA&>(a_in));
  warpgroup_fence_operand(acc);
  warpgroup_arrive();
  mma.accumulate_ = kZeroInit ? GMMA::ScaleOut::Zero : GMMA::ScaleOut::One;
  auto&& a = [&]() -> decltype(auto) {
    if constexpr (kOpaqueA) {
      return opaque_descriptors(a_in);
    } else {
      return (a_in);
    }
  }();
  CUTE_UNROLL
  for (int k = 0; k < size<2>(a); ++k) {
    cute::gemm(mma, a(_, _, k), b(_, _, k), acc);
    mma.accumulate_ = GMMA::ScaleOut::One;
  }
  warpgroup_commit_batch();
  warpgroup_fence_operand(acc);
  if constexpr (kRegA) warpgroup_fence_operand(const_cast<TA&>(a_in));
}

// Converts fp32 accumulators into a 16-bit register tensor of the same size, element for element.
template <class Dst, class Src>
__device__ __forceinline__ void convert_into(Dst& dst, Src const& src) {
  using To = typename Dst::value_type;
  constexpr int N = decltype(size(src))::value;
  static_assert(N == decltype(size(dst))::value, "sizes differ");
  cutlass::NumericArrayConverter<To, float, N> conv;
  *reinterpret_cast<cutlass::Array<To, N>*>(dst.data()) =
      conv(*reinterpret_cast<const cutlass::Array<float, N>*>(src.data()));
}

// The (tokens, head dim) view of one (batch, head) of a TMA operand: a dense operand's batch mode indexed, a varlen
// operand's one batch offset to the sequence's first token.
template <class TmaTensor>
__device__ __forceinline__ auto sequence_view(TmaTensor const& m, int head, int batch, bool varlen, int token0) {
  return domain_offset(make_coord(token0, _0{}), m(_, _, head, varlen ? 0 : batch));
}

// State that carries from one tile of a persistent CTA to the next: where each side is in the K and V rings
// and the parity of the Q barriers' phase (one Q per non-empty tile).
template <int kStages>
struct CarriedState {
  RingPos<kStages> k;
  RingPos<kStages> v;
  uint32_t q_phase = 0;
};

// ---- producer: one thread of warpgroup 0, one tile
template <class T>
__device__ __forceinline__ void produce(typename T::Params const& params, typename T::SharedStorage& ss,
                                        FwdTileCoord tile, Sequence const& seq, policy::KeyBlocks const& blocks,
                                        CarriedState<T::kStages>& st) {
  AttnParams const& p = params.attn;
  const int hk = tile.head / (p.nheads / p.nheads_k);
  const bool varlen = p.cu_seqlens_q != nullptr;
  const int batches = varlen ? 1 : p.batch;
  Tensor mQ = params.tma_q.get_tma_tensor(make_shape(params.q_tokens, p.headdim, p.nheads, batches));
  Tensor mK = params.tma_k.get_tma_tensor(make_shape(params.k_tokens, p.headdim, p.nheads_k, batches));
  Tensor mV = params.tma_v.get_tma_tensor(make_shape(params.k_tokens, p.headdim_v, p.nheads_k, batches));
  const int q0 = static_cast<int>(seq.q_token0);
  const int k0 = static_cast<int>(seq.k_token0);
  Tensor gQ = local_tile(sequence_view(mQ, tile.head, tile.batch, varlen, q0),
                         Shape<typename T::BlockM, typename T::HeadDim>{}, make_coord(tile.m_block, _0{}));  // (M, D)
  Tensor gK = local_tile(sequence_view(mK, hk, tile.batch, varlen, k0), Shape<typename T::BlockN, typename T::HeadDim>{},
                         make_coord(_, _0{}));  // (N, D, n)
  Tensor gV = local_tile(sequence_view(mV, hk, tile.batch, varlen, k0), Shape<typename T::BlockN, typename T::HeadDimV>{},
                         make_coord(_, _0{}));  // (N, D, n)
  Tensor sQ = make_tensor(make_smem_ptr(ss.q.data()), typename T::SmemLayoutQ{});
  Tensor sK = make_tensor(make_smem_ptr(ss.k.data()), typename T::SmemLayoutKV{});
  Tensor sV = make_tensor(make_smem_ptr(ss.v.data()), typename T::SmemLayoutV{});
  auto [tQgQ, tQsQ] = tma_partition(params.tma_q, _0{}, Layout<_1>{}, group_modes<0, 2>(sQ), group_modes<0, 2>(gQ));
  auto [tKgK, tKsK] = tma_partition(params.tma_k, _0{}, Layout<_1>{}, group_modes<0, 2>(sK), group_modes<0, 2>(gK));
  auto [tVgV, tVsV] = tma_partition(params.tma_v, _0{}, Layout<_1>{}, group_modes<0, 2>(sV), group_modes<0, 2>(gV));

  const auto load_k = [&](int n) {
    uint64_t& full = ss.k_ring.acquire(st.k, T::kKBytes);
    copy(params.tma_k.with(full, 0, TMA::CacheHintSm90::EVICT_LAST), tKgK(_, n), tKsK(_, st.k.stage));
    st.k.advance();
  };
  const auto load_v = [&](int n) {
    uint64_t& full = ss.v_ring.acquire(st.v, T::kVBytes);
    copy(params.tma_v.with(full, 0, TMA::CacheHintSm90::EVICT_LAST), tVgV(_, n), tVsV(_, st.v.stage));
    st.v.advance();
  };
  // The consumers' order: S of the last block first; then each step needs K(n) before V(n + 1).
  const int first = static_cast<int>(blocks.first);
  const int last = static_cast<int>(blocks.last);
  load_k(last - 1);
  // Q's buffer is free once the previous tile's consumers are done with it (a fresh CTA's wait returns at once).
  cutlass::arch::ClusterBarrier::wait(&ss.q_empty, st.q_phase ^ 1);
  cutlass::arch::ClusterTransactionBarrier::arrive_and_expect_tx(&ss.q_full, T::kQBytes);
  copy(params.tma_q.with(ss.q_full, 0, TMA::CacheHintSm90::EVICT_FIRST), tQgQ, tQsQ);
  st.q_phase ^= 1;
  for (int n = last - 1; n > first; --n) {
    load_k(n - 1);
    load_v(n);
  }
  load_v(first);
}

// ---- consumers: warpgroups 1..kMmaWarpgroups, one tile
template <class T>
__device__ __forceinline__ void consume(typename T::Params const& params, typename T::SharedStorage& ss,
                                        FwdTileCoord tile, Sequence const& seq, policy::KeyBlocks const& blocks,
                                        CarriedState<T::kStages>& st) {
  using Element = typename T::Element;
  using BlockM = typename T::BlockM;
  using BlockN = typename T::BlockN;
  using HeadDimV = typename T::HeadDimV;
  AttnParams const& p = params.attn;
  const int ctid = threadIdx.x - 128;  // thread index among the consumers
  const int wg = ctid / 128;           // consumer warpgroup
  const bool leader = ctid % 128 == 0;
  const int m0 = tile.m_block * T::kBlockM;
  const int h = tile.head;
  const int b = tile.batch;
  if (m0 >= seq.len_q) return;  // a varlen batch's tile past its sequence: nothing to load or write

  Tensor sQ = make_tensor(make_smem_ptr(ss.q.data()), typename T::SmemLayoutQ{});
  Tensor sK = make_tensor(make_smem_ptr(ss.k.data()), typename T::SmemLayoutKV{});
  Tensor sVt = make_tensor(make_smem_ptr(ss.v.data()), typename T::SmemLayoutVt{});

  typename T::TiledMmaQK mma_qk;
  typename T::TiledMmaPV mma_pv;
  auto thr_qk = mma_qk.get_thread_slice(ctid);
  auto thr_pv = mma_pv.get_thread_slice(ctid);
  Tensor tSrQ = thr_qk.partition_fragment_A(sQ);   // (MMA, MMA_M, MMA_K) descriptors
  Tensor tSrK = thr_qk.partition_fragment_B(sK);   // (MMA, MMA_N, MMA_K, stages)
  Tensor tOrV = thr_pv.partition_fragment_B(sVt);  // (MMA, MMA_N, MMA_K, stages)
  Tensor tSrS = partition_fragment_C(mma_qk, Shape<BlockM, BlockN>{});   // ((2, 2, N/8), 1, 1)
  Tensor tOrO = partition_fragment_C(mma_pv, Shape<BlockM, HeadDimV>{});  // ((2, 2, Dv/8), 1, 1)
  Tensor tOrP = make_tensor<Element>(acc_as_a_layout(tSrS.layout()));    // ((2, 2, 2), 1, N/16)
  clear(tOrO);
  Tensor s_rc = acc_rowcol(tSrS);
  Tensor o_rc = acc_rowcol(tOrO);
  constexpr int kRows = decltype(size<0>(s_rc))::value;

  // Tile-local (row, key) of each score: this thread's base + thread 0's offsets (compile-time constants).
  Tensor coord_ref = typename T::TiledMmaQK{}.get_thread_slice(0).partition_C(
      make_identity_tensor(Shape<BlockM, BlockN>{}));
  Tensor coord_mine = thr_qk.partition_C(make_identity_tensor(Shape<BlockM, BlockN>{}));
  const int row_base = get<0>(coord_mine(0)) - get<0>(coord_ref(0));
  const int col_base = get<1>(coord_mine(0)) - get<1>(coord_ref(0));
  Tensor coord_rc = make_tensor(coord_ref.data(), acc_rowcol_layout(coord_ref.layout()));

  const ScoreShape shape(p, b, h, seq.len_q, seq.len_k);
  const float f = shape.log2_factor;
  float row_max[kRows];
  float row_sum[kRows];
  CUTE_UNROLL
  for (int r = 0; r < kRows; ++r) {
    row_max[r] = -INFINITY;
    row_sum[r] = 0.f;
  }

  // Matmul turns among the consumer warpgroups: each waits for its turn before issuing, and passes it on. The
  // first turn is handed to warpgroup 0 once per CTA (forward_kernel); turns run on across tiles.
  constexpr int kW = T::kMmaWarpgroups;
  const auto turn_wait = [&] {
    if constexpr (kW > 1) cutlass::arch::NamedBarrier::sync(256, barrier_id(FwdBarrier::kWarpgroupTurn, wg));
  };
  const auto turn_pass = [&] {
    if constexpr (kW > 1) {
      cutlass::arch::NamedBarrier::arrive(256, barrier_id(FwdBarrier::kWarpgroupTurn, (wg + 1) % kW));
    }
  };

  // Scores of key block n -> log2 logits (masked where `masked`), then the online softmax: new running max,
  // the factor that rescales what was accumulated, P in place of the scores.
  const auto softmax = [&](int n, bool masked, float (&correction)[kRows]) __attribute__((always_inline)) {
    const int n0 = n * T::kBlockN;
    if (shape.transform) {
      shape_scores(s_rc, coord_rc, m0 + row_base, n0 + col_base, shape, masked);
    } else if (masked) {
      mask_scores(s_rc, coord_rc, m0 + row_base, n0 + col_base, shape);
    }
    online_softmax(s_rc, f, row_max, row_sum, correction);
  };

  const int first = static_cast<int>(blocks.first);
  const int last = static_cast<int>(blocks.last);
  const int ulo = static_cast<int>(blocks.unmasked_lo);
  const int uhi = static_cast<int>(blocks.unmasked_hi);
  const bool any_keys = first < last;
  if (any_keys) {
    cutlass::arch::ClusterBarrier::wait(&ss.q_full, st.q_phase);
    // The last key block: S alone.
    {
      ss.k_ring.wait(st.k);
      turn_wait();
      wgmma<true, T::kOpaqueQ>(mma_qk, tSrQ, tSrK(_, _, _, st.k.stage), tSrS);
      turn_pass();
      warpgroup_wait<0>();
      ss.k_ring.release(st.k, leader);
      st.k.advance();
      float correction[kRows];
      softmax(last - 1, last - 1 >= uhi || last - 1 < ulo, correction);
      convert_into(tOrP, tSrS);
    }
    // Keys past the sequence's end in the last block: with varlen or seqused_k its V rows there are another
    // sequence's or unwritten (a dense tensor's are past the TMA view, filled with zeros). Zeroed before any
    // P·V reads them, by every consumer thread, outside the matmul turns (a warpgroup waiting at this barrier
    // holds none).
    if ((p.cu_seqlens_k != nullptr || p.seqused_k != nullptr) && seq.len_k < last * T::kBlockN) {
      ss.v_ring.wait(st.v);
      Tensor sV = make_tensor(make_smem_ptr(ss.v.data()), typename T::SmemLayoutV{});
      const int from = seq.len_k - (last - 1) * T::kBlockN;
      const int count = (T::kBlockN - from) * T::kHeadDimV;
      for (int i = ctid; i < count; i += T::kMmaThreads) {
        sV(from + i / T::kHeadDimV, i % T::kHeadDimV, st.v.stage) = Element(0.f);
      }
      cutlass::arch::fence_view_async_shared();  // wgmma reads what these threads wrote
      cutlass::arch::NamedBarrier::sync(T::kMmaThreads, barrier_id(FwdBarrier::kEpilogue));
    }
    // Block n: issue S(n) and O += P(n + 1)·V(n + 1), softmax of S(n) while the second runs.
    const auto step = [&](int n, bool masked) __attribute__((always_inline)) {
      ss.k_ring.wait(st.k);
      turn_wait();
      wgmma<true, T::kOpaqueQ>(mma_qk, tSrQ, tSrK(_, _, _, st.k.stage), tSrS);
      ss.v_ring.wait(st.v);
      wgmma<false>(mma_pv, tOrP, tOrV(_, _, _, st.v.stage), tOrO);
      turn_pass();
      warpgroup_wait<1>();
      ss.k_ring.release(st.k, leader);
      st.k.advance();
      float correction[kRows];
      softmax(n, masked, correction);
      warpgroup_wait<0>();
      ss.v_ring.release(st.v, leader);
      st.v.advance();
      CUTE_UNROLL
      for (int r = 0; r < kRows; ++r) {
        CUTE_UNROLL
        for (int c = 0; c < size<1>(o_rc); ++c) o_rc(r, c) *= correction[r];
      }
      convert_into(tOrP, tSrS);
    };
    int n = last - 2;
    for (; n >= first && n >= uhi; --n) step(n, true);
    for (; n >= first && n >= ulo; --n) step(n, false);
    for (; n >= first; --n) step(n, true);
    // O += P(first)·V(first).
    ss.v_ring.wait(st.v);
    turn_wait();
    wgmma<false>(mma_pv, tOrP, tOrV(_, _, _, st.v.stage), tOrO);
    turn_pass();
    warpgroup_wait<0>();
    ss.v_ring.release(st.v, leader);
    st.v.advance();
  }

  // ---- epilogue: normalise, write lse, stage O in shared memory, one TMA store
  float* lse = p.lse != nullptr ? p.lse + seq.lse_offset(p, b, h) : nullptr;
  const float sink = p.sinks != nullptr ? p.sinks[h] : -INFINITY;  // the head's sink, folded into each row
  CUTE_UNROLL
  for (int r = 0; r < kRows; ++r) {
    const float sum = quad_sum(row_sum[r]);
    const policy::SinkFold<float> row_end =
        policy::fold_sink(sum > 0.f ? (row_max[r] * f + __log2f(sum)) * kLn2 : -INFINITY, sink);
    const float inv = sum > 0.f ? row_end.factor / sum : 0.f;
    CUTE_UNROLL
    for (int c = 0; c < size<1>(o_rc); ++c) o_rc(r, c) *= inv;
    const int row = m0 + row_base + get<0>(coord_rc(r, 0));
    if (lse != nullptr && col_base + get<1>(coord_rc(r, 0)) == 0 && row < seq.len_q) lse[row] = row_end.lse;
  }
  if (!any_keys) {
    // No row of the tile sees a key: O is zeros, written straight to global memory (16 bytes a store). The
    // staging buffer is not touched: at head dims above 128 it is Q's, which the producer may already be
    // filling with the next tile's Q (it waits for nothing on a tile it did not load).
    constexpr int kChunks = T::kHeadDimV / 8;
    Element* out = static_cast<Element*>(p.out.data) + seq.q_offset(p.out, b, h);
    for (int i = ctid; i < T::kBlockM * kChunks; i += T::kMmaThreads) {
      const int row = m0 + i / kChunks;
      if (row < seq.len_q) {
        *reinterpret_cast<uint4*>(out + row * p.out.row_stride + (i % kChunks) * 8) = make_uint4(0, 0, 0, 0);
      }
    }
    return;
  }
  Tensor o_elem = make_tensor<Element>(tOrO.layout());
  convert_into(o_elem, tOrO);
  Element* o_buffer = T::kSeparateO ? ss.o.data() : ss.q.data();
  Tensor sO = make_tensor(make_smem_ptr(o_buffer), typename T::SmemLayoutO{});
  // The previous tile's store has read the staging buffer (only its issuing thread can wait for that).
  if (ctid == 0) tma_store_wait<0>();
  // Every warpgroup is done with Q (all its S products have completed) and the buffer is free.
  cutlass::arch::NamedBarrier::sync(T::kMmaThreads, barrier_id(FwdBarrier::kEpilogue));
  if (T::kSeparateO && ctid == 0) cutlass::arch::ClusterBarrier::arrive(&ss.q_empty);
  copy(o_elem, thr_pv.partition_C(sO));
  if (p.cu_seqlens_q != nullptr) {
    // Varlen: the rows of the sequence only, 16 bytes a store (8 elements of a row are contiguous in every
    // swizzle of the staging layout; read one by one all the same).
    cutlass::arch::NamedBarrier::sync(T::kMmaThreads, barrier_id(FwdBarrier::kEpilogue));
    constexpr int kChunks = T::kHeadDimV / 8;
    Element* out = static_cast<Element*>(p.out.data) + seq.q_offset(p.out, b, h);
    for (int i = ctid; i < T::kBlockM * kChunks; i += T::kMmaThreads) {
      const int r = i / kChunks;
      const int c = (i % kChunks) * 8;
      if (m0 + r < seq.len_q) {
        cutlass::Array<Element, 8> chunk;
        CUTE_UNROLL
        for (int e = 0; e < 8; ++e) chunk[e] = sO(r, c + e);
        *reinterpret_cast<cutlass::Array<Element, 8>*>(out + (m0 + r) * p.out.row_stride + c) = chunk;
      }
    }
    if constexpr (!T::kSeparateO) {
      // O sits in Q's buffer: the next tile's Q waits until every thread has read it.
      cutlass::arch::NamedBarrier::sync(T::kMmaThreads, barrier_id(FwdBarrier::kEpilogue));
      if (ctid == 0) cutlass::arch::ClusterBarrier::arrive(&ss.q_empty);
    }
    st.q_phase ^= 1;
    return;
  }
  cutlass::arch::fence_view_async_shared();  // the copy engine reads what these threads wrote
  cutlass::arch::NamedBarrier::sync(T::kMmaThreads, barrier_id(FwdBarrier::kEpilogue));
  if (ctid == 0) {
    Tensor mO = params.tma_o.get_tma_tensor(make_shape(p.seqlen_q, p.headdim_v, p.nheads, p.batch));
    Tensor gO = local_tile(mO(_, _, h, b), Shape<BlockM, HeadDimV>{}, make_coord(tile.m_block, _0{}));
    auto [tOgO, tOsO] = tma_partition(params.tma_o, _0{}, Layout<_1>{}, group_modes<0, 2>(sO),
                                      group_modes<0, 2>(gO));
    copy(params.tma_o, tOsO, tOgO);
    tma_store_arrive();
    if (!T::kSeparateO) {
      // O sits in Q's buffer: the next tile's Q waits until the copy engine has read it.
      tma_store_wait<0>();
      cutlass::arch::ClusterBarrier::arrive(&ss.q_empty);
    }
  }
  st.q_phase ^= 1;
}

// Each CTA walks its share of the tiles (FwdTileScheduler: many when tiles cost the same, else one), warpgroup 0
// loading, the others computing; the rings and barriers carry from one tile to the next, so the next tile's
// loads overlap this tile's last products and its epilogue.
template <class T>
__global__ void __launch_bounds__(T::kThreads, 1) forward_kernel(const __grid_constant__ typename T::Params params) {
  extern __shared__ char smem[];
  auto& ss = *reinterpret_cast<typename T::SharedStorage*>(smem);
  AttnParams const& p = params.attn;
  // Built by each role after its register reconfiguration: a value live across setmaxnreg is spilled.
  const auto tile_scheduler = [&] {
    return FwdTileScheduler{(p.seqlen_q + T::kBlockM - 1) / T::kBlockM, p.nheads, p.batch};
  };
  const auto key_blocks = [&](FwdTileCoord tile, Sequence const& seq) {
    const policy::WindowMask mask{seq.len_q, seq.len_k, p.window_left, p.window_right};
    const int m0 = tile.m_block * T::kBlockM;
    return policy::key_blocks_of(mask, m0, min(m0 + T::kBlockM, seq.len_q), T::kBlockN);
  };

  const int warp = cutlass::canonical_warp_idx_sync();
  if (warp == 0 && cute::elect_one_sync()) {
    cutlass::arch::ClusterTransactionBarrier::init(&ss.q_full, 1);
    cutlass::arch::ClusterBarrier::init(&ss.q_empty, 1);
    ss.k_ring.init(T::kMmaWarpgroups);
    ss.v_ring.init(T::kMmaWarpgroups);
    cutlass::arch::fence_barrier_init();
  }
  __syncthreads();

  CarriedState<T::kStages> st;
  if (warp / 4 == 0) {
    cutlass::arch::warpgroup_reg_dealloc<T::kTile.producer_regs>();
    if (warp == 0 && cute::elect_one_sync()) {
      cute::prefetch_tma_descriptor(params.tma_q.get_tma_descriptor());
      cute::prefetch_tma_descriptor(params.tma_k.get_tma_descriptor());
      cute::prefetch_tma_descriptor(params.tma_v.get_tma_descriptor());
      const FwdTileScheduler scheduler = tile_scheduler();
      for (int64_t t = blockIdx.x; t < scheduler.tiles(); t += gridDim.x) {
        const FwdTileCoord tile = scheduler.at(t);
        const Sequence seq(p, tile.batch);
        const policy::KeyBlocks blocks = key_blocks(tile, seq);
        if (blocks.first < blocks.last) produce<T>(params, ss, tile, seq, blocks, st);
      }
    }
  } else {
    cutlass::arch::warpgroup_reg_alloc<T::kTile.consumer_regs>();
    if constexpr (T::kMmaWarpgroups > 1) {  // warpgroup 0 takes the first matmul turn
      if (threadIdx.x / 128 == T::kMmaWarpgroups) {
        cutlass::arch::NamedBarrier::arrive(256, barrier_id(FwdBarrier::kWarpgroupTurn, 0));
      }
    }
    const FwdTileScheduler scheduler = tile_scheduler();
    for (int64_t t = blockIdx.x; t < scheduler.tiles(); t += gridDim.x) {
      const FwdTileCoord tile = scheduler.at(t);
      const Sequence seq(p, tile.batch);
      consume<T>(params, ss, tile, seq, key_blocks(tile, seq), st);
    }
    if (threadIdx.x == 128) tma_store_wait<0>();  // the last store has read shared memory before the CTA ends
  }
}

// The TMA view of one operand: (tokens, head dim, heads, batch). A mode of extent 1 takes a stride the copy
// engine accepts (any multiple of 16 bytes) whatever the caller's was: it is never stepped.
template <class Ptr>
auto gmem_view(Ptr ptr, Operand const& t, int tokens, int dim, int heads, int batch) {
  const int64_t fallback = int64_t{tokens} * t.row_stride + 8;
  const auto tidy = [&](int extent, int64_t stride) { return extent == 1 && stride <= 0 ? fallback : stride; };
  return make_tensor(make_gmem_ptr(ptr), make_layout(make_shape(tokens, dim, heads, batch),
                                                     make_stride(tidy(tokens, t.row_stride), _1{},
                                                                 tidy(heads, t.head_stride),
                                                                 tidy(batch, t.batch_stride))));
}

// q_tokens / k_tokens: the tokens of q and of k and v (varlen: every sequence's; dense: seqlen_q / seqlen_k).
template <class Element, int kHeadDim, int kHeadDimV>
cudaError_t launch_forward_as(AttnParams const& p, int q_tokens, int k_tokens, cudaStream_t stream) {
  using T = FwdTraits<Element, kHeadDim, kHeadDimV>;
  const bool varlen = p.cu_seqlens_q != nullptr;
  const int batches = varlen ? 1 : p.batch;  // a varlen operand is one batch of all its tokens
  const auto q = gmem_view(static_cast<Element const*>(p.q.data), p.q, q_tokens, p.headdim, p.nheads, batches);
  const auto k = gmem_view(static_cast<Element const*>(p.k.data), p.k, k_tokens, p.headdim, p.nheads_k, batches);
  const auto v =
      gmem_view(static_cast<Element const*>(p.v.data), p.v, k_tokens, p.headdim_v, p.nheads_k, batches);
  const auto o = gmem_view(static_cast<Element*>(p.out.data), p.out, q_tokens, p.headdim_v, p.nheads, batches);
  const typename T::Params params{
      p,
      q_tokens,
      k_tokens,
      make_tma_copy(SM90_TMA_LOAD{}, q, typename T::SmemLayoutQ{}, Shape<typename T::BlockM, typename T::HeadDim>{},
                    _1{}),
      make_tma_copy(SM90_TMA_LOAD{}, k, take<0, 2>(typename T::SmemLayoutKV{}),
                    Shape<typename T::BlockN, typename T::HeadDim>{}, _1{}),
      make_tma_copy(SM90_TMA_LOAD{}, v, take<0, 2>(typename T::SmemLayoutV{}),
                    Shape<typename T::BlockN, typename T::HeadDimV>{}, _1{}),
      make_tma_copy(SM90_TMA_STORE{}, o, typename T::SmemLayoutO{},
                    Shape<typename T::BlockM, typename T::HeadDimV>{}, _1{})};
  const auto kernel = forward_kernel<T>;
  if (cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, T::kSmemBytes);
      e != cudaSuccess) {
    return e;
  }
  int device = 0, sm_count = 0;
  if (cudaError_t e = cudaGetDevice(&device); e != cudaSuccess) return e;
  if (cudaError_t e = cudaDeviceGetAttribute(&sm_count, cudaDevAttrMultiProcessorCount, device); e != cudaSuccess) {
    return e;
  }
  // Varlen tiles differ in cost (and some are past their sequence): one CTA per tile, like a mask's.
  const FwdTileScheduler scheduler{(p.seqlen_q + T::kBlockM - 1) / T::kBlockM, p.nheads, p.batch};
  const int64_t grid = FwdTileScheduler::grid_size(scheduler.tiles(), sm_count, !windowed(p) && !varlen);
  if (grid == 0) return cudaSuccess;
  kernel<<<static_cast<unsigned>(grid), T::kThreads, T::kSmemBytes, stream>>>(params);
  return cudaGetLastError();
}

// The head dims whose unit also holds a configuration for a narrower V: head dim 192's, V's head dim 128.
constexpr int narrow_v_of(int head_dim) { return head_dim == 192 ? 128 : 0; }

// Runs the forward of the call's head dims: (kHeadDim, kHeadDim), or (kHeadDim, narrow_v_of(kHeadDim)).
template <class Element, int kHeadDim>
cudaError_t launch_forward(AttnParams const& p, int q_tokens, int k_tokens, cudaStream_t stream) {
  constexpr int kNarrowV = narrow_v_of(kHeadDim);
  if constexpr (kNarrowV != 0) {
    if (p.headdim_v == kNarrowV) return launch_forward_as<Element, kHeadDim, kNarrowV>(p, q_tokens, k_tokens, stream);
  }
  return launch_forward_as<Element, kHeadDim, kHeadDim>(p, q_tokens, k_tokens, stream);
}

// Shared memory the unit's configurations take per block (the largest, for the device-capacity check).
template <class Element, int kHeadDim>
int forward_smem_bytes_as() {
  constexpr int kNarrowV = narrow_v_of(kHeadDim);
  int bytes = FwdTraits<Element, kHeadDim>::kSmemBytes;
  if constexpr (kNarrowV != 0) bytes = std::max(bytes, FwdTraits<Element, kHeadDim, kNarrowV>::kSmemBytes);
  return bytes;
}

}  // namespace flare::cuda::sm90

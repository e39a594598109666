// tile_ops.cuh — CuTe building blocks of the sm80 kernels, tied to their instructions: register-layout views
// of mma.sync m16n8k16 accumulators, predicated global->shared copies (cp.async tiles), and shared->register
// GEMMs pipelined over ldmatrix. The arch-neutral helpers are in src/cuda/common/tile_utils.cuh.
#pragma once

#include <cute/tensor.hpp>

#include "cuda/common/tile_utils.cuh"

namespace flare::cuda::sm80 {

using namespace cute;

// ---- accumulator layouts -------------------------------------------------------------------------------
// An SM80 m16n8 accumulator fragment has layout ((2, 2), MMA_M, MMA_N): per thread, values (col, col + 1)
// of row r and of row r + 8. As a (rows, cols) matrix that is ((2, MMA_M), (2, MMA_N)). Host-callable, for
// tests/cuda's layout checks.
template <class L>
__host__ __device__ __forceinline__ constexpr auto rowcol_layout(L const& acc) {
  static_assert(rank(L{}) == 3, "expects an mma accumulator layout ((2,2),M,N)");
  return make_layout(make_layout(get<0, 1>(acc), get<1>(acc)), make_layout(get<0, 0>(acc), get<2>(acc)));
}

template <class T>
__device__ __forceinline__ auto rowcol(T&& t) {
  return make_tensor(t.data(), rowcol_layout(t.layout()));
}

// The accumulator of an m16n8k16 product reused as the A operand of the next one: two neighbouring n8
// tiles form one k16 slice, ((2,2), M, N) -> ((2,2,2), M, N/2).
template <class L>
__device__ __forceinline__ constexpr auto acc_as_a_layout(L const& acc) {
  static_assert(decltype(size<2>(acc))::value % 2 == 0, "the n extent must be even");
  auto n = logical_divide(get<2>(acc), Layout<_2>{});
  return make_layout(make_layout(get<0>(acc), get<0>(n)), get<1>(acc), get<1>(n));
}

// Tile-local coordinates of the accumulator elements a thread holds, split as (this thread's base) + (the
// element's offset in thread 0's partition). The offsets fold to compile-time constants, so no per-element
// coordinate occupies a register across a loop (the identity-tensor coordinates of every thread did, and
// spilled). Valid because an MMA partition is a translation of thread 0's: warp and lane only shift it.
template <class Mma, class TileShape>
struct AccCoords {
  int row_base;
  int col_base;

  __device__ __forceinline__ AccCoords(Mma const& mma, int tid) {
    auto mine = mma.get_thread_slice(tid).partition_C(make_identity_tensor(TileShape{}));
    auto ref = offsets();
    row_base = get<0>(mine(0)) - get<0>(ref(0));
    col_base = get<1>(mine(0)) - get<1>(ref(0));
  }
  // Thread 0's coordinates, in the accumulator's own layout.
  __device__ __forceinline__ static auto offsets() {
    return Mma{}.get_thread_slice(0).partition_C(make_identity_tensor(TileShape{}));
  }
};

// ---- views -------------------------------------------------------------------------------------------------
// A tensor with only a shape, for sizing register fragments (partition_fragment_A/B) without a real layout.
template <class Element, class Shape>
__device__ __forceinline__ auto shape_only(Shape shape) {
  return make_tensor(make_smem_ptr(static_cast<Element*>(nullptr)), make_layout(shape, GenRowMajor{}));
}

// ---- predicated copies -----------------------------------------------------------------------------------
// Copies a partitioned tile (CPY, M, K) where the coordinates (from an identity tensor partitioned the same
// way) say the row is < rows and the column < cols; other vectors of the destination are zeroed (clear)
// or left alone. Head dims are multiples of 8, so a 16-byte vector is wholly in or out.
template <bool kClear = true, class TiledCopy, class S, class D, class C>
__device__ __forceinline__ void copy_rows(TiledCopy const& tiled_copy, S const& src, D&& dst, C const& coord,
                                          int rows, int cols) {
  CUTE_UNROLL
  for (int m = 0; m < size<1>(src); ++m) {
    const bool row_ok = get<0>(coord(0, m, 0)) < rows;
    CUTE_UNROLL
    for (int k = 0; k < size<2>(src); ++k) {
      if (row_ok && get<1>(coord(0, m, k)) < cols) {
        copy(tiled_copy, src(_, m, k), dst(_, m, k));
      } else if constexpr (kClear) {
        clear(dst(_, m, k));
      }
    }
  }
}

// copy_rows when the tile may be partial, a plain copy (no predicates) when it is whole: `whole` says that all
// kRows rows exist and the head dim fills the tile.
template <class TiledCopy, class S, class D, class C>
__device__ __forceinline__ void copy_tile(TiledCopy const& tiled_copy, S const& src, D&& dst, C const& coord,
                                          int rows, int cols, bool whole) {
  if (whole) {
    copy(tiled_copy, src, dst);
  } else {
    copy_rows(tiled_copy, src, dst, coord, rows, cols);
  }
}

// ---- shared -> register GEMMs ----------------------------------------------------------------------------
// acc += A * B^T with both operands in shared memory, loading the k-slice k+1 into registers while the
// tensor cores work on slice k.
template <class Acc, class RA, class RB, class SA, class SB, class Mma, class CopyA, class CopyB, class ThrA,
          class ThrB>
__device__ __forceinline__ void gemm_ss(Acc& acc, RA& rA, RB& rB, SA const& sA, SB const& sB, Mma const& mma,
                                        CopyA const& copy_a, CopyB const& copy_b, ThrA const& thr_a,
                                        ThrB const& thr_b) {
  auto rA_view = thr_a.retile_D(rA);
  auto rB_view = thr_b.retile_D(rB);
  copy(copy_a, sA(_, _, _0{}), rA_view(_, _, _0{}));
  copy(copy_b, sB(_, _, _0{}), rB_view(_, _, _0{}));
  constexpr int K = decltype(size<2>(rA))::value;
  CUTE_UNROLL
  for (int k = 0; k < K; ++k) {
    if (k + 1 < K) {
      copy(copy_a, sA(_, _, k + 1), rA_view(_, _, k + 1));
      copy(copy_b, sB(_, _, k + 1), rB_view(_, _, k + 1));
    }
    gemm(mma, rA(_, _, k), rB(_, _, k), acc);
  }
}

// acc += A * B^T with A already in registers (e.g. the probabilities P) and B in shared memory.
template <class Acc, class RA, class RB, class SB, class Mma, class CopyB, class ThrB>
__device__ __forceinline__ void gemm_rs(Acc& acc, RA const& rA, RB& rB, SB const& sB, Mma const& mma,
                                        CopyB const& copy_b, ThrB const& thr_b) {
  auto rB_view = thr_b.retile_D(rB);
  copy(copy_b, sB(_, _, _0{}), rB_view(_, _, _0{}));
  constexpr int K = decltype(size<2>(rA))::value;
  CUTE_UNROLL
  for (int k = 0; k < K; ++k) {
    if (k + 1 < K) copy(copy_b, sB(_, _, k + 1), rB_view(_, _, k + 1));
    gemm(mma, rA(_, _, k), rB(_, _, k), acc);
  }
}

}  // namespace flare::cuda::sm80

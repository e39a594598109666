// traits.cuh — tile shapes, shared-memory layouts and copy/MMA atoms of the sm80 kernels (mma.sync m16n8k16,
// ldmatrix, cp.async). Everything here is a type; configs.cuh picks one per (pass, head dim) and the kernels in
// forward.cuh / backward.cuh use them.
#pragma once

#include <cute/tensor.hpp>

#include "cuda/sm80/tile_ops.cuh"

namespace flare::cuda::sm80 {

using namespace cute;

template <class Element>
using MmaAtom = std::conditional_t<std::is_same_v<Element, cutlass::half_t>,
                                   MMA_Atom<SM80_16x8x16_F32F16F16F32_TN>,
                                   MMA_Atom<SM80_16x8x16_F32BF16BF16F32_TN>>;

// Whether this compilation pass emits the body of a kernel of class `c`: a cubin holds the class its GPUs
// run — both for sm_80 (its cubin also runs on sm_86 / sm_89 when theirs are not built), the small one for
// sm_86..sm_89, the large one for sm_90 — unless FLARE_CUDA_ALL_CONFIGS (test builds). backend.cu's choice
// of class follows the same rule.
template <SmemClass c>
constexpr bool body_here() {
#if defined(__CUDA_ARCH__) && !defined(FLARE_CUDA_ALL_CONFIGS)
  constexpr bool small_arch = __CUDA_ARCH__ >= 860 && __CUDA_ARCH__ < 900;
  return c == SmemClass::kSmall ? __CUDA_ARCH__ < 900 : !small_arch;
#else
  return true;
#endif
}

// A row-major (rows x kHeadDim) shared tile, swizzled so that both 16-byte cp.async writes and ldmatrix
// reads of 8 rows hit distinct banks. Rows are stored in 64-element (128-byte) chunks when the head dim
// allows, else 32-element ones.
template <class Element, int kHeadDim>
struct SmemRowTile {
  static constexpr int kChunk = kHeadDim % 64 == 0 ? 64 : 32;
  static constexpr int kSwizzle = kChunk == 64 ? 3 : 2;
  using Atom = decltype(composition(Swizzle<kSwizzle, 3, 3>{},
                                    Layout<Shape<_8, Int<kChunk>>, Stride<Int<kChunk>, _1>>{}));
  template <int kRows>
  using Layout = decltype(tile_to_shape(Atom{}, Shape<Int<kRows>, Int<kHeadDim>>{}));
};

// 16-byte global<->shared copies for a (rows x kChunk)-wide tile, kThreads threads.
template <class Element, int kChunk, int kThreads, bool kAsync>
struct GmemCopy {
  static constexpr int kThreadsPerRow = kChunk / 8;
  using Atom = std::conditional_t<kAsync, Copy_Atom<SM80_CP_ASYNC_CACHEGLOBAL<cute::uint128_t>, Element>,
                                  Copy_Atom<UniversalCopy<cute::uint128_t>, Element>>;
  using Tiled = decltype(make_tiled_copy(
      Atom{}, Layout<Shape<Int<kThreads / kThreadsPerRow>, Int<kThreadsPerRow>>, Stride<Int<kThreadsPerRow>, _1>>{},
      Layout<Shape<_1, _8>>{}));
};

// The forward kernel: a CTA owns kBlockM query rows of one (batch, head) and walks the key tiles.
// kMaskLoopApart: the tiles that take the mask and the whole ones run in separate loops, each compiled for its
// case (forward.cuh); else one loop branches per tile.
// kPlain: the kernel is compiled with the mask alone, for calls without softcap and ALiBi (configs.cuh says
// which calls take it); else with the score transform too, for any call.
// kSkipSettledRescale: the output rescale is skipped while no row of a warp moved its maximum (forward.cuh).
// It keeps a correction per row live across a branch: with score and output accumulators of 192 registers
// per thread (head dim 64, 128-key tiles) that made ptxas spill 13 KB per thread, hence the default.
// kEarlyCopies: the prologue's copies (Q, the first key tile) are issued before the score shape and the MMA
// set-up are computed, which then run while they land; else after them. Faster at head dim 128 only
// (docs/tuning-sm80.md, "Forward: copy order in the prologue").
// kHeadDimV: the output columns one CTA computes. Below kHeadDim (wide heads, configs.cuh) V and the output are
// split into column slices of this width, one CTA per slice, each computing the scores and softmax whole.
template <class Element_, int kHeadDim_, int kBlockM_, int kBlockN_, int kWarps_, bool kMaskLoopApart_ = false,
          bool kPlain_ = false,
          bool kSkipSettledRescale_ = kBlockM_ * (kBlockN_ + kHeadDim_) / (32 * kWarps_) <= 160,
          bool kEarlyCopies_ = kHeadDim_ == 128, int kHeadDimV_ = kHeadDim_, bool kWholeDimsKernel_ = true>
struct FwdTraits {
  using Element = Element_;
  static constexpr bool kMaskLoopApart = kMaskLoopApart_;
  static constexpr bool kPlain = kPlain_;
  static constexpr bool kSkipSettledRescale = kSkipSettledRescale_;
  static constexpr bool kEarlyCopies = kEarlyCopies_;
  // Whether calls whose head dims fill the tile get a kernel of their own, with no column predicates on the K
  // and V copies (forward.cuh). Above head dim 128 ptxas schedules the loop with both copy paths slower; at 64
  // and 128 the twin timed within noise, so those compile one kernel (docs/tuning-sm80.md, "Forward: whole
  // head dims").
  static constexpr bool kWholeDimsKernel = kHeadDim_ > 128 && kWholeDimsKernel_;
  // Whether the prologue loads the first key tile's V with its K (in a copy group of its own, so that the
  // first visit waits for Q and K alone) instead of in the first visit: faster from head dim 128, slower at
  // head dim 64 (docs/tuning-sm80.md, "Forward: copy order in the prologue").
  static constexpr bool kFirstVEarly = kHeadDim_ >= 128;
  // Whether the kernel carries dropout: the short shape's kernel with the score transform alone, which dropout
  // calls take (launch_forward_as). Elsewhere its code cost registers that every call paid for, dropout or not:
  // at head dim 128 (ptxas, sm_90) the plain kernel spilled 728 bytes per thread instead of 136 and the 128-row
  // kernel with the transform 2576 instead of none; the short one keeps 205 registers and no spill with it.
  // docs/tuning-sm80.md, "Dropout in one kernel".
  static constexpr bool kDropout = !kPlain_ && kBlockM_ == 64;
  // How many of a thread's score columns (of a row, in order) one dropout draw of 16 keys covers
  // (dropout_bits); tests/cuda/test_sm80_dropout_groups.cu checks it against the MMA layout.
  static constexpr int kDropoutColumnsPerDraw = 4;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kHeadDimV = kHeadDimV_;
  static constexpr bool kSlicedV = kHeadDimV < kHeadDim;
  static_assert(kHeadDimV <= kHeadDim && (!kSlicedV || kHeadDimV % 64 == 0),
                "output slices are 64-column multiples, no wider than the tile");
  static constexpr int kBlockM = kBlockM_;
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kWarps = kWarps_;
  static constexpr int kThreads = kWarps * 32;
  static_assert(kBlockM % (16 * kWarps) == 0, "warps split the query rows in 16-row slices");

  // Warps tile the M dimension; the 16-wide N tile makes each B ldmatrix.x4 load 16 keys x 16 dims.
  using TiledMma = TiledMMA<MmaAtom<Element>, Layout<Shape<Int<kWarps>, _1, _1>>,
                            Tile<Int<16 * kWarps>, _16, _16>>;

  using Smem = SmemRowTile<Element, kHeadDim>;
  using SmemLayoutQ = typename Smem::template Layout<kBlockM>;
  using SmemLayoutKV = typename Smem::template Layout<kBlockN>;
  // V (kBlockN x kHeadDimV) and the output (kBlockM x kHeadDimV, over Q's storage in the epilogue).
  using SmemV = SmemRowTile<Element, kHeadDimV>;
  using SmemLayoutV = typename SmemV::template Layout<kBlockN>;
  using SmemLayoutO = typename SmemV::template Layout<kBlockM>;
  // V^T (kHeadDimV x kBlockN) viewed over V's storage, read with ldmatrix.trans.
  using SmemLayoutVt = decltype(composition(SmemLayoutV{},
                                            make_layout(Shape<Int<kHeadDimV>, Int<kBlockN>>{}, GenRowMajor{})));

  using SmemCopyAtom = Copy_Atom<SM75_U32x4_LDSM_N, Element>;
  using SmemCopyAtomT = Copy_Atom<SM75_U16x8_LDSM_T, Element>;
  using SmemCopyAtomO = Copy_Atom<DefaultCopy, Element>;

  using GmemLoad = typename GmemCopy<Element, Smem::kChunk, kThreads, true>::Tiled;
  using GmemLoadV = typename GmemCopy<Element, SmemV::kChunk, kThreads, true>::Tiled;
  using GmemStore = typename GmemCopy<Element, SmemV::kChunk, kThreads, false>::Tiled;

  static constexpr int kSmemBytes =
      int(sizeof(Element)) * (cosize(SmemLayoutQ{}) + cosize(SmemLayoutKV{}) + cosize(SmemLayoutV{}));
};

// The backward kernel: a CTA owns kBlockN keys of one (batch, head) and walks the query tiles that see them.
// kDoubleBuffer: Q and dO tiles double-buffered (the next pair loads during this one's products); single-
// buffered, the next dO loads once the dV product is done with this one and the next Q after the dK product.
// kClass: the shared-memory class the configuration belongs to (body_here).
// kDqCols: dQ = dS K is computed in column slices of this width (0 = the whole head dim), each accumulated
// into the dQ buffer before the next: a slice's accumulator is what the registers must hold at once.
// kMaskLoopApart: the query tiles that take the mask and the whole ones run in separate loops, each compiled
// for its case (backward.cuh); else one loop tests per tile.
// kStatsInSmem: each query tile's lse and D are copied into shared memory with its Q and dO (double-buffered
// like them) instead of read from global memory at the top of its visit (backward.cuh, configs.cuh).
// kSliceD: the columns of dK, dV and dQ one CTA computes. Below kHeadDim (wide heads, configs.cuh) they are
// split into slices of this width, one CTA each, each computing the scores and dP whole.
template <class Element_, int kHeadDim_, int kBlockM_, int kBlockN_, int kWarps_, int kAtomMSdP, int kAtomNdKV,
          int kAtomMdQ, bool kDoubleBuffer_ = true, SmemClass kClass_ = SmemClass::kLarge, int kDqCols_ = 0,
          bool kMaskLoopApart_ = true, bool kStatsInSmem_ = false, int kSliceD_ = kHeadDim_>
struct BwdTraits {
  static constexpr bool kMaskLoopApart = kMaskLoopApart_;
  static constexpr bool kStatsInSmem = kStatsInSmem_;
  static constexpr int kSliceD = kSliceD_;
  static constexpr bool kSliced = kSliceD < kHeadDim_;
  static constexpr int kDqCols = kDqCols_ == 0 ? kSliceD : kDqCols_;
  static_assert(kHeadDim_ % kDqCols == 0 && kSliceD % kDqCols == 0 && kDqCols % (16 * (kWarps_ / kAtomMdQ)) == 0,
                "dQ slices must tile the head dim, the CTA's column slice and the dQ product's columns");
  static_assert(!kSliced || (kSliceD % 64 == 0 && kHeadDim_ % kSliceD == 0),
                "column slices are 64-column multiples that tile the head dim");
  using Element = Element_;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockM = kBlockM_;
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kWarps = kWarps_;
  static constexpr int kThreads = kWarps * 32;
  static constexpr bool kDoubleBuffer = kDoubleBuffer_;
  static constexpr SmemClass kClass = kClass_;

  template <int kAtomM>
  using Mma = TiledMMA<MmaAtom<Element>, Layout<Shape<Int<kAtomM>, Int<kWarps / kAtomM>, _1>>,
                       Tile<Int<16 * kAtomM>, Int<16 * (kWarps / kAtomM)>, _16>>;
  using MmaSdP = Mma<kAtomMSdP>;  // S = Q K^T and dP = dO V^T:      (kBlockM x kBlockN)
  // How many of a thread's score columns (of a row, in order) one dropout draw of 16 keys covers
  // (dropout_bits): 2, the warps splitting the keys as well; tests/cuda/test_sm80_dropout_groups.cu
  // checks it against MmaSdP's layout.
  static constexpr int kDropoutColumnsPerDraw = 2;
  using MmadKV = Mma<kAtomNdKV>;  // dV += P^T dO and dK += dS^T Q:  (kBlockN x kSliceD)
  using MmadQ = Mma<kAtomMdQ>;    // dQ = dS K:                       (kBlockM x kDqCols) per slice

  using SmemD = SmemRowTile<Element, kHeadDim>;
  using SmemLayoutQ = typename SmemD::template Layout<kBlockM>;
  using SmemLayoutKV = typename SmemD::template Layout<kBlockN>;
  using SmemLayoutQt =
      decltype(composition(SmemLayoutQ{}, make_layout(Shape<Int<kHeadDim>, Int<kBlockM>>{}, GenRowMajor{})));
  using SmemLayoutKt =
      decltype(composition(SmemLayoutKV{}, make_layout(Shape<Int<kHeadDim>, Int<kBlockN>>{}, GenRowMajor{})));
  // dK and dV of a column slice, staged for the store over K's and V's storage.
  using SmemLayoutKVSlice = typename SmemRowTile<Element, kSliceD>::template Layout<kBlockN>;
  using SmemN = SmemRowTile<Element, kBlockN>;
  using SmemLayoutP = typename SmemN::template Layout<kBlockM>;
  using SmemLayoutPt =
      decltype(composition(SmemLayoutP{}, make_layout(Shape<Int<kBlockN>, Int<kBlockM>>{}, GenRowMajor{})));

  using SmemCopyAtom = Copy_Atom<SM75_U32x4_LDSM_N, Element>;
  using SmemCopyAtomT = Copy_Atom<SM75_U16x8_LDSM_T, Element>;
  using SmemCopyAtomP = Copy_Atom<AutoVectorizingCopyWithAssumedAlignment<32>, Element>;
  using SmemCopyAtomO = Copy_Atom<DefaultCopy, Element>;

  using GmemLoad = typename GmemCopy<Element, SmemD::kChunk, kThreads, true>::Tiled;
  using GmemStore = typename GmemCopy<Element, SmemD::kChunk, kThreads, false>::Tiled;

  static constexpr int kQBytes = int(sizeof(Element)) * cosize(SmemLayoutQ{});
  static constexpr int kKVBytes = int(sizeof(Element)) * cosize(SmemLayoutKV{});
  static constexpr int kPBytes = int(sizeof(Element)) * cosize(SmemLayoutP{});
  // Q and dO (one or two buffers each), K, V, P, dS, and with kStatsInSmem each Q buffer's lse and D (fp32).
  static constexpr int kQBuffers = kDoubleBuffer ? 2 : 1;
  static constexpr int kStatsBytes = kStatsInSmem ? kQBuffers * 2 * kBlockM * int(sizeof(float)) : 0;
  static constexpr int kSmemBytes = 2 * kQBuffers * kQBytes + 2 * kKVBytes + 2 * kPBytes + kStatsBytes;
  static_assert(kClass == SmemClass::kLarge || kSmemBytes <= kSmallSmemBytes, "a small configuration over 99 KB");
};

}  // namespace flare::cuda::sm80

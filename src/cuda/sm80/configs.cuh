// configs.cuh — the tile shape of each (pass, head dim) on sm80-class GPUs. One place, so the generated
// translation units (src/cuda/instantiations) and the workspace sizing agree. Types only (traits.cuh): the
// kernels include it, not the other way round, so a change to one pass's kernel rebuilds only that pass.
//
// Forward: 128 query rows per CTA, 32 per warp (4 warps) up to head dim 128 — fewer rows per warp would make
// shared-memory reads of K and V the bottleneck — and 16 per warp (8 warps) beyond, where a 32-row output
// accumulator alone would exceed the 255-register budget. Key tiles: 64, except 32 in head dim 128's kernel
// with the score transform (64 spills there; its kernel with the mask alone takes 64, FwdConfigOf::Plain).
// At head dim 64, 128-key tiles would leave no registers for the skipped rescale of forward.cuh, which is
// worth more. Short sequences take 64-row tiles instead (forward_shape).
// Backward: the K/V tile stays in shared memory while query tiles stream (Q and dO double-buffered);
// key tiles of 128 up to head dim 128, 64 beyond, where dK and dV accumulators grow with the head dim;
// query tiles of 128 at head dims <= 64 (half the passes over each K/V tile), 64 beyond. At head dims 192 and
// 256 the dK/dV and dQ products put 4 warps along the head dim (one third less shared-memory traffic than 2;
// 160 and 224 are not multiples of 64). From head dim 160, and at head dim 64 beyond backward_short, dQ is
// computed in column slices (kDqCols), each accumulated before the next, which leaves the dK/dV accumulators
// their registers.
// Every choice here was timed on the H200: docs/tuning-sm80.md, "Forward tile shapes" and "Backward tile
// shapes", has the figures. Each has a small-shared-memory twin for sm_86 / sm_89 (SmemClass, params.hpp).
#pragma once

#include <algorithm>
#include <climits>
#include <type_traits>

#include "cuda/common/scores.cuh"
#include "cuda/heuristics.hpp"
#include "cuda/sm80/traits.cuh"

namespace flare::cuda::sm80 {

// The forward's shapes per head dim. kLong: 128 query rows per CTA (above); kShort: 64 query rows, 64 keys,
// 4 warps, for short sequences (forward_shape says when). The small class (<= 99 KB of shared memory) keeps
// the long shape where it fits (head dims <= 192) and takes the short one beyond.
enum class FwdShape { kLong, kShort };

template <class Element, int kHeadDim, FwdShape kShape, SmemClass kClass, bool kWide = (kHeadDim > kSm80WideTile)>
struct FwdConfigOf {
  static constexpr int kBlockN = kHeadDim == 128 ? 32 : 64;
  static constexpr int kWarps = kHeadDim <= 128 ? 4 : 8;
  using Short = FwdTraits<Element, kHeadDim, 64, 64, 4>;
  // Head dim 128's long shape runs masked and whole key tiles in separate loops; at the other shapes the split
  // costs registers (occupancy, or spills) in the kernel that carries softcap and ALiBi, and is slower
  // (docs/tuning-sm80.md, "Forward: masked and whole tiles apart").
  using Long = FwdTraits<Element, kHeadDim, 128, kBlockN, kWarps, kHeadDim == 128>;
  using type = std::conditional_t<
      kShape == FwdShape::kShort, Short,
      std::conditional_t<kClass == SmemClass::kLarge || Long::kSmemBytes <= kSmallSmemBytes, Long, Short>>;

  // The kernel with the mask alone (FwdTraits::kPlain) for calls without softcap and ALiBi — with a mask
  // only where kPlainMaskedOnly — or void where `type` runs them too. It runs the masked and the whole key
  // tiles in separate loops (kMaskLoopApart), which only this kernel affords at most shapes.
  // - Head dim 128, long shape: 64-key tiles (spilling 208 bytes), the rescale never skipped.
  // - Head dims 32 and 64, long shape, masked calls only, the rescale never skipped; calls without a mask
  //   keep `type`, which is faster for them.
  // - Above head dim 128, short shape: faster than the kernel with the transform at every length and mask,
  //   and than the long shape, so these calls always take the short shape (forward_shape).
  // Elsewhere it is no faster. Figures: docs/tuning-sm80.md, "Forward: the kernel with the mask alone".
  static constexpr bool kPlainMaskedOnly = kHeadDim < 128;
  using LongPlain = std::conditional_t<kHeadDim <= 64 || kHeadDim == 128,
                                       FwdTraits<Element, kHeadDim, 128, 64, kWarps, true, true, false>, void>;
  using ShortPlain =
      std::conditional_t<(kHeadDim > 128), FwdTraits<Element, kHeadDim, 64, 64, 4, true, true>, void>;
  using Plain = std::conditional_t<std::is_same_v<type, Long>, LongPlain, ShortPlain>;

  // Plain's twin with the output rescale never skipped (kSkipSettledRescale false), for calls whose head dims
  // fill the tile and whose rows see few key tiles (forward_few_keys), or void. A warp skips the rescale only
  // when none of its rows moved its maximum, and over random scores a row's maximum moves in its k-th key tile
  // with chance 1/k: across the first few tiles nearly every tile rescales, and the skip's test and the
  // corrections it keeps live cost without saving (it also spills less). Head dim 256's short shape only:
  // elsewhere it was not timed, or slower (docs/tuning-sm80.md, "Forward: the skipped rescale").
  using PlainFewKeys =
      std::conditional_t<kHeadDim == 256 && std::is_same_v<type, Short>,
                         FwdTraits<Element, kHeadDim, 64, 64, 4, true, true, /*kSkipSettledRescale=*/false>, void>;
};

// Wide heads (tiles above 256: 384, 512, 576; heuristics.hpp has the slice rule): one kernel for every call and
// both shapes and classes, the score transform and dropout in: 64 query rows (4 warps of 16), 32-key tiles, the
// output in column slices of sm80_forward_slice(tile), one CTA each. A slice's accumulator is head dim 256's
// short shape's (128 registers per thread at 256 columns); 32-key tiles keep shared memory at 84 / 112 / 124 KB
// (Q whole, a K tile, a V slice tile), two CTAs per SM on sm_90's 227 KB, and 384's within the small class.
// No twin for whole head dims (kWholeDimsKernel): one kernel per unit keeps the build short.
template <class Element, int kHeadDim, FwdShape kShape, SmemClass kClass>
struct FwdConfigOf<Element, kHeadDim, kShape, kClass, true> {
  using type = FwdTraits<Element, kHeadDim, 64, 32, 4, /*kMaskLoopApart=*/false, /*kPlain=*/false,
                         /*kSkipSettledRescale=*/true, /*kEarlyCopies=*/false, sm80_forward_slice(kHeadDim),
                         /*kWholeDimsKernel=*/false>;
  static constexpr bool kPlainMaskedOnly = false;
  using Plain = void;
  using PlainFewKeys = void;
};

// Whether a call's rows see few enough key tiles for FwdConfigOf::PlainFewKeys (seqlen_k: the longest key
// sequence, varlen an upper bound).
inline bool forward_few_keys(AttnParams const& p) { return sm80_forward_few_keys(p); }

template <class Element, int kHeadDim, FwdShape kShape = FwdShape::kLong, SmemClass kClass = SmemClass::kLarge>
using FwdConfig = typename FwdConfigOf<Element, kHeadDim, kShape, kClass>::type;

// Which forward shape a call runs (a run-time choice: the shapes are compiled side by side). 64-row query
// tiles win where a 128-row CTA's work is short and, under a causal mask, a large part of it sits on the
// diagonal. The thresholds, as timed per head dim (docs/tuning-sm80.md, "Forward: short and long shapes"):
// - Head dims 32 and 64: the long shape's kernel with the mask alone (FwdConfigOf::Plain) matches the short
//   shape at causal 512 and beats it beyond, so masked calls without softcap and ALiBi take the short shape up
//   to 512 only, those with them up to 1024.
// - Head dim 128: the long shape's kernel with the mask alone beats the short shape at every length, so it
//   runs the long shape throughout.
// - Head dim 256, with the whole-dims kernels (FwdTraits::kWholeDimsKernel): calls without softcap and ALiBi
//   always take the short shape, whose kernel with the mask alone beats the long shape at every length
//   (FwdConfigOf::Plain). For the others the short shape wins under a causal mask up to 8192 and without a
//   mask up to 1024.
// Head dim 32 follows 64 and 160-224 follow 256; head dim 96 keeps the rule 128 had before its kernel with the
// mask alone, the short shape for masked calls up to 1024 (none timed separately).
// seqlen_q is the longest sequence (varlen: an upper bound).
inline FwdShape forward_shape(int head_dim_tile, AttnParams const& p) {
  return sm80_forward_rows(head_dim_tile, p) == 64 ? FwdShape::kShort : FwdShape::kLong;
}

template <class Element, int kHeadDim, SmemClass kClass>
constexpr int forward_smem_bytes_as() {
  int most = 0;
  const auto take = [&](auto config) {
    using C = decltype(config);
    most = std::max(most, C::type::kSmemBytes);
    if constexpr (!std::is_void_v<typename C::Plain>) most = std::max(most, C::Plain::kSmemBytes);
  };
  take(FwdConfigOf<Element, kHeadDim, FwdShape::kLong, kClass>{});
  take(FwdConfigOf<Element, kHeadDim, FwdShape::kShort, kClass>{});
  return most;
}

// Backward: BwdTraits<E, d, block_m, block_n, warps, atoms S/dP, atoms dK/dV, atoms dQ, double buffer, class,
// dQ slice width>.
// The large class double-buffers Q and dO (up to 208 KB at head dim 256); the small one (<= 99 KB) narrows
// the tiles and, from head dim 128, single-buffers.
template <class Element, int kHeadDim, SmemClass kClass>
struct BwdConfigOf;
template <class E> struct BwdConfigOf<E, 32, SmemClass::kLarge> { using type = BwdTraits<E, 32, 128, 128, 8, 4, 4, 4>; };
template <class E> struct BwdConfigOf<E, 64, SmemClass::kLarge> { using type = BwdTraits<E, 64, 128, 128, 8, 4, 4, 4, true, SmemClass::kLarge, 32>; };
template <class E> struct BwdConfigOf<E, 96, SmemClass::kLarge> { using type = BwdTraits<E, 96, 64, 128, 8, 2, 4, 4>; };
template <class E> struct BwdConfigOf<E, 128, SmemClass::kLarge> { using type = BwdTraits<E, 128, 64, 128, 8, 2, 4, 2>; };
template <class E> struct BwdConfigOf<E, 160, SmemClass::kLarge> { using type = BwdTraits<E, 160, 64, 64, 8, 4, 4, 4, true, SmemClass::kLarge, 32>; };
template <class E> struct BwdConfigOf<E, 192, SmemClass::kLarge> { using type = BwdTraits<E, 192, 64, 64, 8, 4, 2, 2, true, SmemClass::kLarge, 64>; };
template <class E> struct BwdConfigOf<E, 224, SmemClass::kLarge> { using type = BwdTraits<E, 224, 64, 64, 8, 4, 4, 4, true, SmemClass::kLarge, 32>; };
template <class E> struct BwdConfigOf<E, 256, SmemClass::kLarge> { using type = BwdTraits<E, 256, 64, 64, 8, 4, 2, 2, true, SmemClass::kLarge, 128>; };

template <class E, int d, int m, int n, int w, int a, int b, int c, bool dbl>
using BwdSmall = BwdTraits<E, d, m, n, w, a, b, c, dbl, SmemClass::kSmall>;
template <class E> struct BwdConfigOf<E, 32, SmemClass::kSmall> { using type = BwdSmall<E, 32, 64, 128, 8, 2, 4, 4, true>; };
template <class E> struct BwdConfigOf<E, 64, SmemClass::kSmall> { using type = BwdSmall<E, 64, 64, 128, 8, 2, 4, 4, true>; };
template <class E> struct BwdConfigOf<E, 96, SmemClass::kSmall> { using type = BwdSmall<E, 96, 64, 64, 8, 2, 4, 4, true>; };
template <class E> struct BwdConfigOf<E, 128, SmemClass::kSmall> { using type = BwdSmall<E, 128, 64, 64, 8, 2, 4, 2, false>; };
template <class E> struct BwdConfigOf<E, 160, SmemClass::kSmall> { using type = BwdSmall<E, 160, 64, 64, 8, 2, 4, 4, false>; };
template <class E> struct BwdConfigOf<E, 192, SmemClass::kSmall> { using type = BwdSmall<E, 192, 32, 64, 8, 2, 4, 2, false>; };
template <class E> struct BwdConfigOf<E, 224, SmemClass::kSmall> { using type = BwdSmall<E, 224, 32, 32, 4, 2, 2, 2, false>; };
template <class E> struct BwdConfigOf<E, 256, SmemClass::kSmall> { using type = BwdSmall<E, 256, 32, 32, 4, 2, 2, 2, false>; };

// Wide heads (tiles 384, 512, 576): dK, dV and dQ in column slices of sm80_backward_slice(tile), one CTA each
// (heuristics.hpp), every CTA computing S and dP whole; 32 query rows x 32 keys on 4 warps, single-buffered,
// dQ in 64-column pieces: a slice's dK and dV accumulators are head dim 256's small class's (128 registers per
// thread at 256 columns), and shared memory (Q, dO, K, V whole) is 100 / 132 / 148 KB, within sm_80's 163 KB.
// One configuration for both classes: none fits the small one, whose GPUs refuse the call (sm80_smem_class).
template <class E, int d>
using BwdWide = BwdTraits<E, d, 32, 32, 4, 2, 2, 2, false, SmemClass::kLarge, 64, true, false, sm80_backward_slice(d)>;
template <class E, SmemClass c> struct BwdConfigOf<E, 384, c> { using type = BwdWide<E, 384>; };
template <class E, SmemClass c> struct BwdConfigOf<E, 512, c> { using type = BwdWide<E, 512>; };
template <class E, SmemClass c> struct BwdConfigOf<E, 576, c> { using type = BwdWide<E, 576>; };

template <class Element, int kHeadDim, SmemClass kClass = SmemClass::kLarge>
using BwdConfig = typename BwdConfigOf<Element, kHeadDim, kClass>::type;

// The backward of calls with softcap or ALiBi (their own kernel, shaped_scores): the same shapes, but 64 query
// rows at head dims <= 64, where the 128-row kernel with the score transform spills ~1 KB per thread (ptxas,
// sm_90) and the 64-row one none.
template <class Element, int kHeadDim, SmemClass kClass>
struct BwdShapedConfigOf {
  using type = BwdConfig<Element, kHeadDim, kClass>;
};
template <class E> struct BwdShapedConfigOf<E, 32, SmemClass::kLarge> { using type = BwdTraits<E, 32, 64, 128, 8, 2, 4, 4>; };
template <class E> struct BwdShapedConfigOf<E, 64, SmemClass::kLarge> { using type = BwdTraits<E, 64, 64, 128, 8, 2, 4, 4>; };
template <class Element, int kHeadDim, SmemClass kClass = SmemClass::kLarge>
using BwdShapedConfig = typename BwdShapedConfigOf<Element, kHeadDim, kClass>::type;

// The backward of short sequences without softcap and ALiBi (backward_short): T with each query tile's lse and
// D copied into shared memory alongside its Q and dO (BwdTraits::kStatsInSmem) and dQ computed whole (kDqCols
// 0: slices are slower there), or void where T is kept. Head dim 64, large class: over a short sequence's
// few visits per CTA the global loads of lse and D are not hidden, over a long one's many they are, and
// there the configuration beyond the threshold is faster (docs/tuning-sm80.md, "Backward: short sequences
// at head dim 64").
template <class T>
struct BwdShortOf {
  using type = void;
};
template <class E, int m, int n, int w, int a, int b, int c, bool dbl, int dq, bool apart>
struct BwdShortOf<BwdTraits<E, 64, m, n, w, a, b, c, dbl, SmemClass::kLarge, dq, apart, false>> {
  using type = BwdTraits<E, 64, m, n, w, a, b, c, dbl, SmemClass::kLarge, 0, apart, true>;
};

// Whether a backward call takes BwdShortOf's configuration (where there is one): its longest query sequence
// (varlen: seqlen_q, an upper bound) is at most 512 rows.
inline bool backward_short(AttnParams const& p) { return sm80_backward_short(p); }

template <class Element, int kHeadDim, SmemClass kClass>
constexpr int backward_smem_bytes_as() {
  using T = BwdConfig<Element, kHeadDim, kClass>;
  using Short = typename BwdShortOf<T>::type;
  constexpr int a = T::kSmemBytes;
  constexpr int b = BwdShapedConfig<Element, kHeadDim, kClass>::kSmemBytes;
  int most = a > b ? a : b;
  if constexpr (!std::is_void_v<Short>) most = std::max(most, Short::kSmemBytes);
  return most;
}

}  // namespace flare::cuda::sm80

// configs.cuh — the tile shape of each (pass, head dim) on sm80-class GPUs. One place, so the generated
// translation units (src/cuda/instantiations) and the workspace sizing agree.
//
// Forward: 128 query rows per CTA, 32 per warp (4 warps) up to head dim 128 — fewer rows per warp would make
// shared-memory reads of K and V the bottleneck — and 16 per warp (8 warps) beyond, where a 32-row output
// accumulator alone would exceed the 255-register budget. Key tiles: 128 for head dims <= 64 without a mask
// (64 with one), 64 at 96, 32 at 128 (64 spilled registers there), 64 beyond. Chosen by timing
// variants on the H200 (bench/results/gpu-tuning-2026-12-01.json).
// Backward: the K/V tile stays in shared memory while query tiles stream (Q and dO double-buffered);
// key tiles of 128 up to head dim 128, 64 beyond, where dK and dV accumulators grow with the head dim;
// query tiles of 64. At head dims 192 and 256 the dK/dV and dQ products put 4 warps along the head dim
// (one third less shared-memory traffic than 2; 160 and 224 are not multiples of 64).
// Each has a small-shared-memory twin for sm_86 / sm_89 (SmemClass, params.hpp).
#pragma once

#include "cuda/sm80/backward.cuh"
#include "cuda/sm80/forward.cuh"

namespace flare::cuda::sm80 {

// FwdConfig<E, d, kWindowed, kClass>: kWindowed for calls with a causal or sliding-window mask, where
// narrower key tiles waste less work on the diagonal (head dims <= 64 only; larger ones use one shape for
// both). The small class (<= 99 KB of shared memory) keeps the large shape where it fits (head dims <= 192)
// and takes 64 x 64 tiles beyond.
template <class Element, int kHeadDim, bool kWindowed, SmemClass kClass>
struct FwdConfigOf {
  static constexpr int kBlockN =
      kHeadDim <= 64 ? (kWindowed ? 64 : 128) : kHeadDim <= 96 ? 64 : kHeadDim <= 128 ? 32 : 64;
  static constexpr int kWarps = kHeadDim <= 128 ? 4 : 8;
  using Large = FwdTraits<Element, kHeadDim, 128, kBlockN, kWarps>;
  using type = std::conditional_t<kClass == SmemClass::kLarge || Large::kSmemBytes <= kSmallSmemBytes, Large,
                                  FwdTraits<Element, kHeadDim, 64, 64, 4>>;
};
template <class Element, int kHeadDim, bool kWindowed = false, SmemClass kClass = SmemClass::kLarge>
using FwdConfig = typename FwdConfigOf<Element, kHeadDim, kWindowed, kClass>::type;

template <class Element, int kHeadDim, SmemClass kClass>
cudaError_t launch_forward_as(AttnParams const& p, cudaStream_t stream) {
  if constexpr (kHeadDim <= 64) {
    if (p.window_left >= 0 || p.window_right >= 0) {
      return launch_forward<FwdConfig<Element, kHeadDim, true, kClass>>(p, stream);
    }
  }
  return launch_forward<FwdConfig<Element, kHeadDim, false, kClass>>(p, stream);
}

// Runs the forward with the configuration for this call's mask and shared-memory class.
template <class Element, int kHeadDim>
cudaError_t launch_forward_for(AttnParams const& p, cudaStream_t stream, SmemClass c = SmemClass::kLarge) {
  return c == SmemClass::kLarge ? launch_forward_as<Element, kHeadDim, SmemClass::kLarge>(p, stream)
                                : launch_forward_as<Element, kHeadDim, SmemClass::kSmall>(p, stream);
}

template <class Element, int kHeadDim, SmemClass kClass>
constexpr int forward_smem_bytes_as() {
  constexpr int a = FwdConfig<Element, kHeadDim, false, kClass>::kSmemBytes;
  constexpr int b = FwdConfig<Element, kHeadDim, true, kClass>::kSmemBytes;
  return a > b ? a : b;
}

// Backward: BwdTraits<E, d, block_m, block_n, warps, atoms S/dP, atoms dK/dV, atoms dQ, double buffer, class>.
// The large class double-buffers Q and dO (up to 208 KB at head dim 256); the small one (<= 99 KB) narrows
// the tiles and, from head dim 128, single-buffers.
template <class Element, int kHeadDim, SmemClass kClass>
struct BwdConfigOf;
template <class E> struct BwdConfigOf<E, 32, SmemClass::kLarge> { using type = BwdTraits<E, 32, 128, 128, 8, 4, 4, 4>; };
template <class E> struct BwdConfigOf<E, 64, SmemClass::kLarge> { using type = BwdTraits<E, 64, 64, 128, 8, 2, 4, 4>; };
template <class E> struct BwdConfigOf<E, 96, SmemClass::kLarge> { using type = BwdTraits<E, 96, 64, 128, 8, 2, 4, 4>; };
template <class E> struct BwdConfigOf<E, 128, SmemClass::kLarge> { using type = BwdTraits<E, 128, 64, 128, 8, 2, 4, 2>; };
template <class E> struct BwdConfigOf<E, 160, SmemClass::kLarge> { using type = BwdTraits<E, 160, 64, 64, 8, 4, 4, 4>; };
template <class E> struct BwdConfigOf<E, 192, SmemClass::kLarge> { using type = BwdTraits<E, 192, 64, 64, 8, 4, 2, 2>; };
template <class E> struct BwdConfigOf<E, 224, SmemClass::kLarge> { using type = BwdTraits<E, 224, 64, 64, 8, 4, 4, 4>; };
template <class E> struct BwdConfigOf<E, 256, SmemClass::kLarge> { using type = BwdTraits<E, 256, 64, 64, 8, 4, 2, 2>; };

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

template <class Element, int kHeadDim, SmemClass kClass = SmemClass::kLarge>
using BwdConfig = typename BwdConfigOf<Element, kHeadDim, kClass>::type;

}  // namespace flare::cuda::sm80

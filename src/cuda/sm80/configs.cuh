// configs.cuh — the tile shape of each (pass, head dim) on sm80-class GPUs. One place, so the generated
// translation units (src/cuda/instantiations) and the workspace sizing agree.
//
// Forward: 128 query rows per CTA, 32 per warp (4 warps) up to head dim 128 — fewer rows per warp would make
// shared-memory reads of K and V the bottleneck — and 16 per warp (8 warps) beyond, where a 32-row output
// accumulator alone would exceed the 255-register budget. Key tiles: 128 for head dims <= 64 without a mask
// (64 with one), 64 at 96, 32 at 128 (64 spilled registers there), 64 beyond. Chosen by timing
// variants on the H200 (bench/results/gpu-tuning-2026-12-01.json).
// Backward: the K/V tile stays in shared memory while query tiles stream (Q and dO double-buffered);
// key tiles of 128 up to head dim 128, 64 beyond, where dK and dV accumulators grow with the head dim.
#pragma once

#include "cuda/sm80/backward.cuh"
#include "cuda/sm80/forward.cuh"

namespace flare::cuda::sm80 {

// FwdConfig<E, d, kWindowed>: kWindowed for calls with a causal or sliding-window mask, where narrower key
// tiles waste less work on the diagonal (head dims <= 64 only; larger ones use one shape for both).
template <class Element, int kHeadDim, bool kWindowed>
struct FwdConfigOf {
  static constexpr int kBlockN =
      kHeadDim <= 64 ? (kWindowed ? 64 : 128) : kHeadDim <= 96 ? 64 : kHeadDim <= 128 ? 32 : 64;
  static constexpr int kWarps = kHeadDim <= 128 ? 4 : 8;
  using type = FwdTraits<Element, kHeadDim, 128, kBlockN, kWarps>;
};
template <class Element, int kHeadDim, bool kWindowed = false>
using FwdConfig = typename FwdConfigOf<Element, kHeadDim, kWindowed>::type;

// Runs the forward with the configuration for this call's mask.
template <class Element, int kHeadDim>
cudaError_t launch_forward_for(AttnParams const& p, cudaStream_t stream) {
  if constexpr (kHeadDim <= 64) {
    if (p.window_left >= 0 || p.window_right >= 0) {
      return launch_forward<FwdConfig<Element, kHeadDim, true>>(p, stream);
    }
  }
  return launch_forward<FwdConfig<Element, kHeadDim, false>>(p, stream);
}

template <class Element, int kHeadDim>
constexpr int forward_smem_bytes_for() {
  constexpr int a = FwdConfig<Element, kHeadDim, false>::kSmemBytes;
  constexpr int b = FwdConfig<Element, kHeadDim, true>::kSmemBytes;
  return a > b ? a : b;
}

template <class Element, int kHeadDim>
struct BwdConfigOf;
template <class E> struct BwdConfigOf<E, 32> { using type = BwdTraits<E, 32, 128, 128, 8, 4, 4, 4>; };
template <class E> struct BwdConfigOf<E, 64> { using type = BwdTraits<E, 64, 128, 128, 8, 4, 2, 2>; };
template <class E> struct BwdConfigOf<E, 96> { using type = BwdTraits<E, 96, 64, 128, 8, 2, 4, 4>; };
template <class E> struct BwdConfigOf<E, 128> { using type = BwdTraits<E, 128, 64, 128, 8, 2, 4, 2>; };
template <class E> struct BwdConfigOf<E, 160> { using type = BwdTraits<E, 160, 64, 64, 8, 4, 4, 4>; };
template <class E> struct BwdConfigOf<E, 192> { using type = BwdTraits<E, 192, 64, 64, 8, 4, 4, 4>; };
template <class E> struct BwdConfigOf<E, 224> { using type = BwdTraits<E, 224, 64, 64, 8, 4, 4, 4>; };
template <class E> struct BwdConfigOf<E, 256> { using type = BwdTraits<E, 256, 64, 64, 8, 4, 4, 4>; };

template <class Element, int kHeadDim>
using BwdConfig = typename BwdConfigOf<Element, kHeadDim>::type;

}  // namespace flare::cuda::sm80

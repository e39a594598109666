// configs.cuh — the tile shape of each (pass, head dim) on sm80-class GPUs. One place, so the generated
// translation units (src/cuda/instantiations) and the workspace sizing agree.
//
// Forward: 128 query rows per CTA; key tiles of 128 for small head dims and 64 otherwise, keeping the
// scores, probabilities and output accumulators of a thread within the 255-register budget; 8 warps from
// head dim 160 up, where the output accumulator alone would exceed it with 4.
// Backward: the K/V tile stays in shared memory while query tiles stream (Q and dO double-buffered);
// key tiles of 128 up to head dim 128, 64 beyond, where dK and dV accumulators grow with the head dim.
#pragma once

#include "cuda/sm80/backward.cuh"
#include "cuda/sm80/forward.cuh"

namespace flare::cuda::sm80 {

template <class Element, int kHeadDim>
using FwdConfig = FwdTraits<Element, kHeadDim, 128, (kHeadDim <= 64 ? 128 : 64), (kHeadDim <= 128 ? 4 : 8)>;

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

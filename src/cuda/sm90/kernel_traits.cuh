// kernel_traits.cuh — the types of one sm90 forward configuration: tiled wgmma operations, shared-memory
// layouts, TMA copy types and the shared storage, all derived from the tile table (tile_shape.hpp).
#pragma once

#include "cuda/sm90/cute_config.hpp"  // first: options for the CuTe headers

#include <cute/tensor.hpp>
#include <cutlass/array.h>
#include <cutlass/gemm/collective/builders/sm90_common.inl>
#include <cutlass/numeric_types.h>

#include "cuda/common/params.hpp"
#include "cuda/sm90/pipeline.cuh"
#include "cuda/sm90/tile_shape.hpp"

namespace flare::cuda::sm90 {

using namespace cute;

// kHeadDim: Q's and K's head dim; kHeadDimV: V's and O's (forward_tile has the pairs with a configuration).
template <class Element_, int kHeadDim_, int kHeadDimV_ = kHeadDim_>
struct FwdTraits {
  using Element = Element_;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kHeadDimV = kHeadDimV_;
  static constexpr FwdTile kTile = forward_tile(kHeadDim, kHeadDimV);
  static_assert(kTile.block_m > 0, "no sm90 forward configuration for this head dim");
  static constexpr int kBlockM = kTile.block_m;
  static constexpr int kBlockN = kTile.block_n;
  static constexpr int kMmaWarpgroups = kTile.mma_warpgroups;
  static constexpr int kStages = kTile.stages;
  static_assert(kBlockM == 64 * kMmaWarpgroups, "each consumer warpgroup owns 64 query rows");
  static constexpr int kMmaThreads = 128 * kMmaWarpgroups;
  static constexpr int kThreads = kMmaThreads + 128;  // warpgroup 0 produces

  using BlockM = Int<kBlockM>;
  using BlockN = Int<kBlockN>;
  using HeadDim = Int<kHeadDim>;
  using HeadDimV = Int<kHeadDimV>;
  using WarpgroupLayout = Layout<Shape<Int<kMmaWarpgroups>, _1, _1>>;

  // S = Q·Kᵀ: both operands from shared memory, K-major. O += P·V: P from registers, V read through its
  // transposed view (MN-major B operand), so V lands as it is stored in memory.
  using TiledMmaQK = decltype(make_tiled_mma(
      GMMA::ss_op_selector<Element, Element, float, Shape<_64, BlockN, HeadDim>>(), WarpgroupLayout{}));
  using TiledMmaPV = decltype(make_tiled_mma(
      GMMA::rs_op_selector<Element, Element, float, Shape<_64, HeadDimV, BlockN>, GMMA::Major::K,
                           GMMA::Major::MN>(),
      WarpgroupLayout{}));

  static_assert(decltype(size<1>(typename TiledMmaQK::AtomShape_MNK{}))::value == kBlockN,
                "one wgmma spans the key tile (the softmax views S as a single MMA along N)");
  static_assert(decltype(size<1>(typename TiledMmaPV::AtomShape_MNK{}))::value == kHeadDimV,
                "one wgmma spans V's head dim");

  // Rows of head_dim elements, swizzled in the widest pattern the head dim allows.
  using SmemAtom =
      decltype(cutlass::gemm::collective::detail::ss_smem_selector<GMMA::Major::K, Element, BlockN, HeadDim>());
  using SmemLayoutQ = decltype(tile_to_shape(SmemAtom{}, Shape<BlockM, HeadDim>{}));
  using SmemLayoutKV = decltype(tile_to_shape(SmemAtom{}, Shape<BlockN, HeadDim, Int<kStages>>{}));  // K
  // V's rows (and O's staging) in the widest swizzle V's head dim allows: the K layout where the dims agree.
  using SmemAtomV =
      decltype(cutlass::gemm::collective::detail::ss_smem_selector<GMMA::Major::K, Element, BlockN, HeadDimV>());
  using SmemLayoutV = decltype(tile_to_shape(SmemAtomV{}, Shape<BlockN, HeadDimV, Int<kStages>>{}));
  using SmemLayoutO = decltype(tile_to_shape(SmemAtomV{}, Shape<BlockM, HeadDimV>{}));
  // V as the (head_dim_v, keys) B operand: the same bytes, the first two modes swapped.
  using SmemLayoutVt = decltype(composition(
      SmemLayoutV{}, make_ordered_layout(Shape<HeadDimV, BlockN, Int<kStages>>{}, Step<_2, _1, _3>{})));

  // Global views for TMA: (tokens, head dim, heads, batch) with element strides.
  using GmemShape = Shape<int32_t, int32_t, int32_t, int32_t>;
  using GmemStride = Stride<int64_t, _1, int64_t, int64_t>;
  using GmemLayout = Layout<GmemShape, GmemStride>;
  using TmaLoadQ = decltype(make_tma_copy(SM90_TMA_LOAD{},
                                          make_tensor(make_gmem_ptr(static_cast<Element const*>(nullptr)),
                                                      GmemLayout{}),
                                          SmemLayoutQ{}, Shape<BlockM, HeadDim>{}, _1{}));
  using TmaLoadK = decltype(make_tma_copy(SM90_TMA_LOAD{},
                                          make_tensor(make_gmem_ptr(static_cast<Element const*>(nullptr)),
                                                      GmemLayout{}),
                                          take<0, 2>(SmemLayoutKV{}), Shape<BlockN, HeadDim>{}, _1{}));
  using TmaLoadV = decltype(make_tma_copy(SM90_TMA_LOAD{},
                                          make_tensor(make_gmem_ptr(static_cast<Element const*>(nullptr)),
                                                      GmemLayout{}),
                                          take<0, 2>(SmemLayoutV{}), Shape<BlockN, HeadDimV>{}, _1{}));
  using TmaStoreO = decltype(make_tma_copy(SM90_TMA_STORE{},
                                           make_tensor(make_gmem_ptr(static_cast<Element*>(nullptr)),
                                                       GmemLayout{}),
                                           SmemLayoutO{}, Shape<BlockM, HeadDimV>{}, _1{}));

  static constexpr uint32_t kQBytes = kBlockM * kHeadDim * sizeof(Element);
  static constexpr uint32_t kKBytes = kBlockN * kHeadDim * sizeof(Element);
  static constexpr uint32_t kVBytes = kBlockN * kHeadDimV * sizeof(Element);

  static constexpr bool kSeparateO = forward_separate_o(kHeadDim, kHeadDimV);
  // Q's wgmma descriptors made afresh at each use (forward.cuh, opaque_descriptors) where holding them across
  // the key loop spilled: the configurations whose O accumulator is 192 or 256 wide. The others keep them.
  static constexpr bool kOpaqueQ = kHeadDim >= 192 && kHeadDimV >= 192;
  static_assert(kSeparateO || kHeadDimV <= kHeadDim, "O staged in Q's buffer must fit it");

  // O is staged for its TMA store in a buffer of its own where it fits, else in Q's (dead by then).
  struct SharedStorage {
    cute::array_aligned<Element, cosize_v<SmemLayoutQ>, 1024> q;
    cute::array_aligned<Element, kSeparateO ? cosize_v<SmemLayoutO> : 64, 1024> o;
    cute::array_aligned<Element, cosize_v<SmemLayoutKV>, 1024> k;
    cute::array_aligned<Element, cosize_v<SmemLayoutV>, 1024> v;
    alignas(8) uint64_t q_full;   // Q of the tile has landed
    uint64_t q_empty;             // Q's buffer may take the next tile's Q
    TmaRing<kStages> k_ring;
    TmaRing<kStages> v_ring;
  };
  static constexpr int kSmemBytes = sizeof(SharedStorage);
  static_assert(kSmemBytes <= forward_smem_estimate(kHeadDim, kHeadDimV), "tile_shape.hpp's estimate is too small");

  struct Params {
    AttnParams attn;
    // Token extents of the TMA views: dense, seqlen_q / seqlen_k (per batch); varlen, every token of q / k.
    int q_tokens;
    int k_tokens;
    TmaLoadQ tma_q;
    TmaLoadK tma_k;
    TmaLoadV tma_v;
    TmaStoreO tma_o;
  };
};

}  // namespace flare::cuda::sm90

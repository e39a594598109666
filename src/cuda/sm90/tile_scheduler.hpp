// tile_scheduler.hpp — which (query tile, head, batch) a persistent CTA of the sm90 forward works on next.
// CTA c takes tiles c, c + grid, c + 2·grid, ... in the order below. When every tile costs the same (no mask) the
// grid holds one CTA per SM (or fewer, for small problems), each walking many tiles; under a mask tiles cost
// different amounts, and a fixed stride hands some CTAs only long ones (with 132 SMs and 4 query tiles a head,
// CTA c always gets tile c mod 4), so the grid holds one CTA per tile and the hardware hands them out as SMs
// free up. Plain C++ with FLARE_HD, so tests/cpp check the order on the CPU.
#pragma once

#include <cstdint>

#include "common/attention_policy.hpp"  // FLARE_HD

namespace flare::cuda::sm90 {

struct FwdTileCoord {
  int m_block;
  int head;
  int batch;
};

// Tiles of one (batch, head) are consecutive, so CTAs running at once share that head's K and V in L2; within
// it, the last query tile comes first: under a causal mask it sees the most keys, and the longest tiles
// starting first leave the short ones to fill the end of the run.
struct FwdTileScheduler {
  int m_blocks;  // query tiles per (batch, head)
  int nheads;
  int batch;

  FLARE_HD int64_t tiles() const { return int64_t{m_blocks} * nheads * batch; }

  FLARE_HD FwdTileCoord at(int64_t t) const {
    const int64_t bh = t / m_blocks;
    const int m = static_cast<int>(t - bh * m_blocks);
    return {m_blocks - 1 - m, static_cast<int>(bh % nheads), static_cast<int>(bh / nheads)};
  }

  // CTAs to launch: one per tile when tiles differ in cost (`uniform_work` false), else one per SM, never more
  // than there are tiles.
  static int64_t grid_size(int64_t tiles, int sm_count, bool uniform_work) {
    return !uniform_work || tiles < sm_count ? tiles : sm_count;
  }
};

}  // namespace flare::cuda::sm90

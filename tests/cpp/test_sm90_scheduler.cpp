// The sm90 forward's persistent tile order (src/cuda/sm90/tile_scheduler.hpp), on the CPU: every (query tile,
// head, batch) is visited exactly once by the CTAs of the grid, the tiles of one head come together, and
// within a head the longest tile (the last, under a causal mask) comes first; under a mask, one CTA per tile.
#include <gtest/gtest.h>

#include <random>
#include <set>
#include <tuple>

#include "cuda/sm90/tile_scheduler.hpp"

namespace {

using flare::cuda::sm90::FwdTileCoord;
using flare::cuda::sm90::FwdTileScheduler;

TEST(Sm90TileScheduler, EveryTileOnceLongestFirst) {
  std::mt19937 rng(7);
  const auto pick = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
  for (int trial = 0; trial < 200; ++trial) {
    const FwdTileScheduler s{pick(1, 40), pick(1, 12), pick(1, 5)};
    const int sms = std::vector<int>{1, 7, 132, 1000}[trial % 4];
    const bool uniform = trial % 3 != 0;
    const int64_t grid = FwdTileScheduler::grid_size(s.tiles(), sms, uniform);
    ASSERT_EQ(grid, uniform ? std::min<int64_t>(s.tiles(), sms) : s.tiles());
    std::set<std::tuple<int, int, int>> seen;
    for (int64_t cta = 0; cta < grid; ++cta) {
      for (int64_t t = cta; t < s.tiles(); t += grid) {
        const FwdTileCoord c = s.at(t);
        ASSERT_GE(c.m_block, 0);
        ASSERT_LT(c.m_block, s.m_blocks);
        ASSERT_GE(c.head, 0);
        ASSERT_LT(c.head, s.nheads);
        ASSERT_GE(c.batch, 0);
        ASSERT_LT(c.batch, s.batch);
        ASSERT_TRUE(seen.insert({c.m_block, c.head, c.batch}).second) << "tile visited twice";
      }
    }
    ASSERT_EQ(static_cast<int64_t>(seen.size()), s.tiles());
    // In the global order: one head's tiles together, last query tile first.
    for (int64_t t = 1; t < s.tiles(); ++t) {
      const FwdTileCoord a = s.at(t - 1), b = s.at(t);
      if (a.head == b.head && a.batch == b.batch) {
        EXPECT_EQ(b.m_block, a.m_block - 1);
      } else {
        EXPECT_EQ(a.m_block, 0);
        EXPECT_EQ(b.m_block, s.m_blocks - 1);
      }
    }
  }
}

}  // namespace

// The masking phase split of the tiled kernels (policy::key_blocks_of) against a brute-force mask: for random
// lengths, windows and tiles, every key block a row of the tile sees is visited, and every block walked
// without the mask is seen whole by every row.
#include <gtest/gtest.h>

#include <random>

#include "common/attention_policy.hpp"

namespace {

using flare::policy::key_blocks_of;
using flare::policy::KeyBlocks;
using flare::policy::WindowMask;

bool visible(WindowMask const& m, int64_t i, int64_t j) {
  const int64_t d = i + m.seqlen_k - m.seqlen_q;  // the diagonal, written out again (not diagonal())
  if (j < 0 || j >= m.seqlen_k) return false;
  if (m.window_left >= 0 && j < d - m.window_left) return false;
  if (m.window_right >= 0 && j > d + m.window_right) return false;
  return true;
}

void check_tile(WindowMask const& m, int64_t i0, int64_t i1, int64_t bn) {
  const KeyBlocks kb = key_blocks_of(m, i0, i1, bn);
  const std::string where = "sq " + std::to_string(m.seqlen_q) + " sk " + std::to_string(m.seqlen_k) + " window (" +
                            std::to_string(m.window_left) + ", " + std::to_string(m.window_right) + ") rows [" +
                            std::to_string(i0) + ", " + std::to_string(i1) + ") block_n " + std::to_string(bn);
  ASSERT_LE(kb.first, kb.unmasked_lo) << where;
  ASSERT_LE(kb.unmasked_lo, kb.unmasked_hi) << where;
  ASSERT_LE(kb.unmasked_hi, kb.last) << where;
  const int64_t blocks = (m.seqlen_k + bn - 1) / bn;
  bool any_visible = false;
  for (int64_t n = 0; n < blocks; ++n) {
    bool some = false, whole = (n + 1) * bn <= m.seqlen_k;
    for (int64_t i = i0; i < i1; ++i) {
      for (int64_t j = n * bn; j < (n + 1) * bn; ++j) {
        const bool v = visible(m, i, j);
        some |= v;
        whole &= v;
      }
    }
    any_visible |= some;
    const bool walked = n >= kb.first && n < kb.last;
    if (some) {
      ASSERT_TRUE(walked) << where << ": block " << n << " has visible keys but is skipped";
    }
    if (n >= kb.unmasked_lo && n < kb.unmasked_hi) {
      ASSERT_TRUE(whole) << where << ": block " << n << " is walked unmasked but not every key is visible";
    }
  }
  if (!any_visible) {
    EXPECT_EQ(kb.first, kb.last) << where << ": no visible key, yet blocks are walked";
  }
}

TEST(KeyBlocks, AgreeWithBruteForceMask) {
  std::mt19937 rng(20261205);
  const auto pick = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
  int unmasked_seen = 0;
  for (int trial = 0; trial < 600; ++trial) {
    WindowMask m{pick(1, 300), pick(1, 300), -1, -1};
    switch (trial % 5) {
      case 0: break;                                               // no mask
      case 1: m.window_right = 0; break;                           // causal
      case 2: m.window_left = pick(0, 120); break;                 // left window
      case 3: m.window_left = pick(0, 90), m.window_right = pick(0, 40); break;
      case 4: m.window_right = pick(0, 70); m.window_left = pick(0, 1) ? 0 : -1; break;
    }
    const int64_t bm = std::vector<int>{16, 64, 128, 192}[trial % 4];
    const int64_t bn = std::vector<int>{8, 32, 80, 128}[(trial / 4) % 4];
    for (int64_t i0 = 0; i0 < m.seqlen_q; i0 += bm) {
      check_tile(m, i0, std::min<int64_t>(i0 + bm, m.seqlen_q), bn);
      const KeyBlocks kb = key_blocks_of(m, i0, std::min<int64_t>(i0 + bm, m.seqlen_q), bn);
      unmasked_seen += kb.unmasked_hi > kb.unmasked_lo;
      if (HasFatalFailure()) return;
    }
  }
  EXPECT_GT(unmasked_seen, 100) << "the random shapes hardly ever produce an unmasked phase";
}

TEST(KeyBlocks, EmptyRowsAndTiles) {
  // causal with more queries than keys: the top rows see nothing
  const WindowMask causal{300, 100, -1, 0};
  EXPECT_EQ(key_blocks_of(causal, 0, 128, 64).first, key_blocks_of(causal, 0, 128, 64).last);
  check_tile(causal, 128, 256, 64);
  // an empty row range
  const KeyBlocks none = key_blocks_of(WindowMask{10, 10, -1, -1}, 5, 5, 8);
  EXPECT_EQ(none.first, none.last);
  // no mask, whole blocks: everything unmasked except a partial last block
  const KeyBlocks plain = key_blocks_of(WindowMask{256, 200, -1, -1}, 0, 128, 64);
  EXPECT_EQ(plain.first, 0);
  EXPECT_EQ(plain.unmasked_lo, 0);
  EXPECT_EQ(plain.unmasked_hi, 3);
  EXPECT_EQ(plain.last, 4);
}

}  // namespace

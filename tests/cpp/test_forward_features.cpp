// test_forward_features.cpp — flare_fwd against the fp64 reference, feature by feature and combined:
// causal, sliding windows, softcap, ALiBi, GQA/MQA, explicit scales, rows left without keys, strided and
// packed-qkv layouts, and the optional lse.
#include <utility>
#include <vector>

#include "attention_harness.hpp"

namespace flare::test {
namespace {

const flare_dtype kFloatAndBf16[] = {FLARE_DTYPE_F32, FLARE_DTYPE_BF16};
const flare_dtype kAllDtypes[] = {FLARE_DTYPE_F32, FLARE_DTYPE_BF16, FLARE_DTYPE_F16, FLARE_DTYPE_F64};

// Length pairs that exercise the bottom-right alignment: equal, more keys, more queries (rows without
// keys under causal), one query, one key.
const std::vector<std::pair<int64_t, int64_t>> kLengths = {{17, 17}, {113, 203}, {203, 113}, {1, 203},
                                                           {97, 3},  {3, 97},    {64, 1},    {1, 1}};

TEST(ForwardFeatures, Causal) {
  Rng rng;
  for (flare_dtype dtype : kAllDtypes)
    for (auto [sq, sk] : kLengths) {
      AttnCase c = dense_case(dtype, 2, sq, sk, 2, 2, 64, 64);
      c.causal = true;
      check_forward(c, rng);
    }
}

TEST(ForwardFeatures, SlidingWindow) {
  Rng rng;
  const std::vector<std::pair<int32_t, int32_t>> windows = {{0, 0},  {3, 0},  {-1, 5}, {7, -1}, {16, 16},
                                                            {0, -1}, {-1, 0}, {1, 2},  {40, 3}, {200, 200}};
  for (flare_dtype dtype : kFloatAndBf16)
    for (auto [left, right] : windows)
      for (auto [sq, sk] : {std::pair<int64_t, int64_t>{77, 77}, {45, 130}, {130, 45}}) {
        AttnCase c = dense_case(dtype, 1, sq, sk, 2, 1, 32, 32);
        c.window_left = left;
        c.window_right = right;
        check_forward(c, rng);
      }
}

TEST(ForwardFeatures, CausalWithWindowLeft) {
  Rng rng;
  for (flare_dtype dtype : kAllDtypes)
    for (int32_t left : {0, 1, 9, 100}) {
      AttnCase c = dense_case(dtype, 2, 83, 121, 2, 2, 48, 48);
      c.causal = true;
      c.window_left = left;
      check_forward(c, rng);
    }
}

TEST(ForwardFeatures, RowsWithoutVisibleKeys) {
  // Every way a query row can end up with no key: out must be 0 and lse -inf, never NaN.
  Rng rng;
  struct Masked {
    int64_t sq, sk;
    bool causal;
    int32_t left, right;
  };
  const std::vector<Masked> cases = {
      {50, 10, true, -1, -1},  // causal, seqlen_q > seqlen_k: the first 40 rows see nothing
      {50, 10, false, 2, 1},   // window right of the keys for most rows
      {10, 50, false, 3, -1},  // left-bounded window, all rows have keys (control)
      {20, 20, false, -1, -1}, // control
      {30, 5, false, 0, 0},    // only the aligned diagonal, which lies before key 0 for most rows
      {300, 7, true, 2, -1},   // long query with a handful of keys
  };
  for (flare_dtype dtype : kAllDtypes)
    for (const Masked& m : cases) {
      AttnCase c = dense_case(dtype, 2, m.sq, m.sk, 3, 1, 16, 24);
      c.causal = m.causal;
      c.window_left = m.left;
      c.window_right = m.right;
      c.alibi = rng.coin() ? AlibiMode::kPerHead : AlibiMode::kNone;
      check_forward(c, rng);
    }
}

TEST(ForwardFeatures, Softcap) {
  Rng rng;
  for (flare_dtype dtype : kAllDtypes)
    for (float cap : {0.5f, 5.0f, 30.0f})
      for (bool causal : {false, true}) {
        AttnCase c = dense_case(dtype, 2, 71, 93, 2, 2, 64, 64);
        c.softcap = cap;
        c.causal = causal;
        c.softmax_scale = cap < 1.0f ? 0.6f : 0.0f;  // with scores ~N(0, 1) a small cap saturates
        check_forward(c, rng);
      }
}

TEST(ForwardFeatures, Alibi) {
  Rng rng;
  for (flare_dtype dtype : kAllDtypes)
    for (AlibiMode mode : {AlibiMode::kPerHead, AlibiMode::kPerBatchHead})
      for (bool causal : {false, true})
        for (auto [sq, sk] : {std::pair<int64_t, int64_t>{59, 59}, {37, 141}, {141, 37}}) {
          AttnCase c = dense_case(dtype, 3, sq, sk, 4, 2, 32, 32);
          c.alibi = mode;
          c.causal = causal;
          check_forward(c, rng);
        }
}

TEST(ForwardFeatures, GroupedAndMultiQuery) {
  Rng rng;
  const std::vector<std::pair<int64_t, int64_t>> heads = {{8, 2}, {6, 1}, {4, 4}, {9, 3}, {16, 1}};
  for (flare_dtype dtype : kFloatAndBf16)
    for (auto [h, hk] : heads)
      for (bool causal : {false, true}) {
        AttnCase c = dense_case(dtype, 2, 53, 67, h, hk, 40, 40);
        c.causal = causal;
        check_forward(c, rng);
      }
}

TEST(ForwardFeatures, ExplicitScale) {
  Rng rng;
  for (flare_dtype dtype : kAllDtypes)
    for (float scale : {0.01f, 0.3f, 1.0f, 2.5f}) {
      AttnCase c = dense_case(dtype, 1, 65, 65, 2, 2, 64, 64);
      c.softmax_scale = scale;
      c.causal = scale > 1.0f;
      check_forward(c, rng);
    }
}

// Scores of magnitude ~100: exp overflows unless the running maximum is subtracted.
void run_large_scores(Rng& rng) {
  for (flare_dtype dtype : kAllDtypes) {
    AttnCase c = dense_case(dtype, 2, 90, 150, 2, 2, 64, 64);
    c.softmax_scale = 12.0f;
    check_forward(c, rng);
    c.causal = true;
    check_forward(c, rng);
  }
}

TEST(ForwardFeatures, LargeScoresStayFinite) {
  Rng rng;
  run_large_scores(rng);
}

TEST(ForwardFeatures, LargeScoresStayFiniteKnownSeeds) {
  // A seed where fp32 out erred by 4.2x the error of a model that scaled q before the product, as flare sums
  // q·k unscaled: the models must form scores as flare does (attention_harness.hpp, expect_matches).
  for (uint32_t seed : {777722779u}) {
    Rng rng(seed);
    run_large_scores(rng);
  }
}

TEST(ForwardFeatures, WithoutLse) {
  Rng rng;
  for (flare_dtype dtype : kAllDtypes) {
    AttnCase c = dense_case(dtype, 2, 31, 47, 2, 2, 64, 64);
    c.with_lse = false;
    c.causal = true;
    check_forward(c, rng);
  }
}

TEST(ForwardFeatures, StridedLayouts) {
  // Every operand and output with permuted, padded strides (last dimension contiguous).
  Rng rng;
  for (flare_dtype dtype : kAllDtypes)
    for (int rep = 0; rep < 3; ++rep) {
      AttnCase c = dense_case(dtype, rng.integer(1, 3), rng.integer(1, 90), rng.integer(1, 90), 4, 2, 32, 48);
      c.layout = Layout::kScattered;
      c.causal = rep == 1;
      c.alibi = rep == 2 ? AlibiMode::kPerBatchHead : AlibiMode::kNone;
      check_forward(c, rng);
    }
}

TEST(ForwardFeatures, PackedQkv) {
  // q, k and v taken from one (batch, seqlen, nheads + 2 nheads_k, headdim) buffer.
  Rng rng;
  for (flare_dtype dtype : kAllDtypes)
    for (auto [h, hk] : {std::pair<int64_t, int64_t>{4, 4}, {6, 2}}) {
      AttnCase c = dense_case(dtype, 2, 73, 73, h, hk, 64, 64);
      c.layout = Layout::kPackedQkv;
      c.causal = hk == 2;
      check_forward(c, rng);
    }
}

TEST(ForwardFeatures, EverythingAtOnce) {
  Rng rng;
  for (flare_dtype dtype : kAllDtypes)
    for (auto [sq, sk] : {std::pair<int64_t, int64_t>{113, 203}, {203, 113}, {1, 257}}) {
      AttnCase c = dense_case(dtype, 2, sq, sk, 6, 2, 80, 48);
      c.causal = true;
      c.window_left = 37;
      c.softcap = 8.0f;
      c.softmax_scale = 0.2f;
      c.alibi = AlibiMode::kPerBatchHead;
      c.layout = Layout::kScattered;
      check_forward(c, rng);
    }
}

TEST(ForwardFeatures, FewKeys) {
  // One to nine keys per sequence (FlashAttention's race shapes run 239 queries against one key): each row's
  // keys padded to a block, most of it masked. Every option, dense and varlen (empty sequences included).
  Rng rng;
  for (flare_dtype dtype : kAllDtypes)
    for (int64_t sk : {1, 2, 3, 8, 9})
      for (int64_t sq : {1, 7, 239}) {
        const int64_t hk = rng.integer(1, 2);
        AttnCase c = dense_case(dtype, rng.integer(1, 3), sq, sk, hk * rng.integer(1, 3), hk, 8 * rng.integer(1, 12),
                                8 * rng.integer(1, 12));
        draw_score_options(c, rng, 4);
        c.sinks = rng.coin();
        c.with_lse = rng.integer(0, 3) != 0;
        check_forward(c, rng);
      }
  for (flare_dtype dtype : {FLARE_DTYPE_F32, FLARE_DTYPE_BF16, FLARE_DTYPE_F16}) {
    AttnCase c = varlen_case(dtype, {5, 0, 300, 1, 9}, {3, 4, 8, 0, 1}, 4, 2, 40, 24);
    c.causal = true;
    c.sinks = true;
    check_forward(c, rng);
  }
}

TEST(ForwardFeatures, RandomCombinations) {
  // A random draw over every option; the printed seed replays a failure.
  Rng rng;
  const flare_dtype dtypes[] = {FLARE_DTYPE_F32, FLARE_DTYPE_BF16, FLARE_DTYPE_F16, FLARE_DTYPE_F64};
  const int64_t headdims[] = {8, 16, 32, 40, 64, 80, 96, 128};
  for (int n = 0; n < 24; ++n) {
    const int64_t hk = rng.integer(1, 2);
    AttnCase c = dense_case(dtypes[rng.integer(0, 3)], rng.integer(1, 3), rng.integer(1, 130), rng.integer(1, 130),
                            hk * rng.integer(1, 3), hk, headdims[rng.integer(0, 7)], headdims[rng.integer(0, 7)]);
    draw_score_options(c, rng, 64);
    c.with_lse = rng.integer(0, 3) != 0;
    check_forward(c, rng);
  }
}

}  // namespace
}  // namespace flare::test

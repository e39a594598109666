// test_reference.cpp — checks of the checkers: the fp64 reference against finite differences and against
// properties that follow from the definition of attention, and the test's own fp16/bf16 conversions.
#include <cmath>
#include <limits>
#include <vector>

#include "cpu/reference.hpp"
#include "test_util.hpp"

namespace flare::test {
namespace {

using reference::Dims;
using reference::Options;
using reference::Sequence;

Sequence random_sequence(const Dims& d, int64_t seqlen_q, int64_t seqlen_k, Rng& rng) {
  Sequence s;
  s.seqlen_q = seqlen_q;
  s.seqlen_k = seqlen_k;
  s.q.resize(seqlen_q * d.nheads * d.headdim);
  s.k.resize(seqlen_k * d.nheads_k * d.headdim);
  s.v.resize(seqlen_k * d.nheads_k * d.headdim_v);
  for (auto* x : {&s.q, &s.k, &s.v})
    for (double& e : *x) e = rng.normal();
  return s;
}

std::vector<double> random_vector(size_t n, Rng& rng) {
  std::vector<double> x(n);
  for (double& e : x) e = rng.normal();
  return x;
}

double loss(const Dims& d, const Options& o, const Sequence& s, const std::vector<double>& dout) {
  const auto r = reference::forward(d, o, s);
  double l = 0.0;
  for (size_t i = 0; i < r.out.size(); ++i) l += r.out[i] * dout[i];
  return l;
}

// ---- conversions ----

TEST(Conversions, F16EveryBitPatternRoundTrips) {
  for (uint32_t b = 0; b < 0x10000; ++b) {
    const auto bits = static_cast<uint16_t>(b);
    const double x = from_f16_bits(bits);
    const bool nan_pattern = ((bits >> 10) & 0x1F) == 0x1F && (bits & 0x3FF) != 0;
    ASSERT_EQ(std::isnan(x), nan_pattern) << std::hex << b;
    if (nan_pattern) continue;
    ASSERT_EQ(round_f16(x), x) << std::hex << b;
    ASSERT_EQ(f16_bits(x), bits) << std::hex << b;
  }
}

TEST(Conversions, Bf16EveryBitPatternRoundTrips) {
  for (uint32_t b = 0; b < 0x10000; ++b) {
    const auto bits = static_cast<uint16_t>(b);
    const double x = from_bf16_bits(bits);
    if (std::isnan(x)) continue;
    ASSERT_EQ(round_bf16(x), x) << std::hex << b;
    ASSERT_EQ(bf16_bits(x), bits) << std::hex << b;
  }
}

// Between two neighbouring representable values a and b: below the midpoint goes to a, above to b, and the
// midpoint itself to whichever has an even last bit.
template <class FromBits, class Round>
void check_ties_to_even(FromBits from_bits, Round round, uint16_t max_finite_bits, Rng& rng) {
  for (int n = 0; n < 20000; ++n) {
    const auto bits = static_cast<uint16_t>(rng.integer(0, max_finite_bits - 1));
    const double a = from_bits(bits), b = from_bits(static_cast<uint16_t>(bits + 1));
    const double mid = 0.5 * (a + b);
    const double even = (bits & 1) == 0 ? a : b;
    ASSERT_EQ(round(mid), even) << std::hex << bits;
    ASSERT_EQ(round(-mid), -even) << std::hex << bits;
    const double eps = (b - a) * 1e-3;
    ASSERT_EQ(round(mid - eps), a) << std::hex << bits;
    ASSERT_EQ(round(mid + eps), b) << std::hex << bits;
  }
}

TEST(Conversions, RoundsToNearestEven) {
  Rng rng;
  check_ties_to_even(from_f16_bits, round_f16, 0x7BFF, rng);
  check_ties_to_even(from_bf16_bits, round_bf16, 0x7F7F, rng);
  // Past the largest finite value by half a unit or more overflows to infinity.
  EXPECT_TRUE(std::isinf(round_f16(65520.0)));
  EXPECT_EQ(round_f16(65519.0), 65504.0);
}

TEST(Conversions, F32RoundingAgreesWithTheHardware) {
  Rng rng;
  for (int n = 0; n < 100000; ++n) {
    const double x = rng.normal() * std::ldexp(1.0, static_cast<int>(rng.integer(-140, 120)));
    ASSERT_EQ(round_f32(x), static_cast<double>(static_cast<float>(x))) << x;
  }
}

// ---- the reference against its definition ----

struct GradCase {
  const char* name;
  Dims dims;
  int64_t seqlen_q, seqlen_k;
  Options opts;
};

TEST(Reference, GradientsMatchCentralFiniteDifferences) {
  Rng rng;
  std::vector<GradCase> cases;
  cases.push_back({"plain", {2, 2, 4, 4}, 3, 5, {}});
  cases.push_back({"causal sq>sk", {2, 1, 3, 5}, 5, 3, {.causal = true, .alibi_slopes = {}, .sinks = {}}});
  cases.push_back({"window", {1, 1, 4, 3}, 6, 6, {.window_left = 2, .window_right = 1, .alibi_slopes = {}, .sinks = {}}});
  cases.push_back({"softcap", {2, 2, 4, 4}, 4, 4, {.softmax_scale = 1.5, .softcap = 2.0, .alibi_slopes = {}, .sinks = {}}});
  cases.push_back({"alibi", {2, 2, 3, 3}, 3, 6, {.alibi_slopes = {0.25, 0.7}, .sinks = {}}});
  cases.push_back({"gqa all", {4, 2, 3, 2}, 4, 7,
                   {.softcap = 1.5, .causal = true, .window_left = 3, .alibi_slopes = {0.1, 0.2, 0.3, 0.4}, .sinks = {}}});
  cases.push_back({"sinks", {2, 2, 4, 3}, 3, 5, {.alibi_slopes = {}, .sinks = {0.5, 2.0}}});
  cases.push_back({"sinks gqa causal sq>sk", {4, 2, 3, 3}, 6, 4,
                   {.softcap = 2.5, .causal = true, .alibi_slopes = {}, .sinks = {-1.0, 0.0, 1.5, 3.0}}});
  for (const GradCase& gc : cases) {
    SCOPED_TRACE(gc.name);
    Sequence s = random_sequence(gc.dims, gc.seqlen_q, gc.seqlen_k, rng);
    const auto dout = random_vector(gc.seqlen_q * gc.dims.nheads * gc.dims.headdim_v, rng);
    Options opts = gc.opts;
    const auto g = reference::backward(gc.dims, opts, s, dout);
    const double h = 1e-5;
    auto check = [&](std::vector<double>& x, const std::vector<double>& grad, const char* what) {
      for (size_t i = 0; i < x.size(); ++i) {
        const double saved = x[i];
        x[i] = saved + h;
        const double up = loss(gc.dims, opts, s, dout);
        x[i] = saved - h;
        const double down = loss(gc.dims, opts, s, dout);
        x[i] = saved;
        const double numeric = (up - down) / (2 * h);
        // Central differences err by O(h^2) (~1e-10 here) plus cancellation (~1e-16 / h).
        EXPECT_NEAR(grad[i], numeric, 1e-7 * std::max(1.0, std::fabs(numeric))) << what << "[" << i << "]";
      }
    };
    check(s.q, g.dq, "dq");
    check(s.k, g.dk, "dk");
    check(s.v, g.dv, "dv");
    ASSERT_EQ(g.dsinks.size(), opts.sinks.size());
    check(opts.sinks, g.dsinks, "dsinks");
  }
}

TEST(Reference, EqualScoresAverageTheVisibleValues) {
  Rng rng;
  const Dims d{2, 1, 5, 3};
  Sequence s = random_sequence(d, 7, 9, rng);
  for (double& x : s.q) x = 0.0;  // every score 0: softmax is uniform over the visible keys
  const Options o{.window_left = 2, .window_right = 1, .alibi_slopes = {}, .sinks = {}};
  const auto r = reference::forward(d, o, s);
  for (int64_t h = 0; h < d.nheads; ++h) {
    for (int64_t i = 0; i < s.seqlen_q; ++i) {
      std::vector<double> mean(d.headdim_v, 0.0);
      int64_t n = 0;
      for (int64_t j = 0; j < s.seqlen_k; ++j) {
        if (!reference::key_visible(o, i, j, s.seqlen_q, s.seqlen_k)) continue;
        ++n;
        for (int64_t c = 0; c < d.headdim_v; ++c) mean[c] += s.v[j * d.headdim_v + c];
      }
      ASSERT_GT(n, 0);
      EXPECT_NEAR(r.lse[h * s.seqlen_q + i], std::log(static_cast<double>(n)), 1e-14);
      for (int64_t c = 0; c < d.headdim_v; ++c)
        EXPECT_NEAR(r.out[(i * d.nheads + h) * d.headdim_v + c], mean[c] / n, 1e-14);
    }
  }
}

TEST(Reference, MaskFollowsTheBottomRightRule) {
  // Exhaustive over small lengths and windows against the rule written as a set of allowed offsets.
  for (int64_t sq = 1; sq <= 6; ++sq)
    for (int64_t sk = 1; sk <= 6; ++sk)
      for (int64_t left = -1; left <= 3; ++left)
        for (int64_t right = -1; right <= 3; ++right)
          for (int causal = 0; causal <= 1; ++causal) {
            const Options o{.causal = causal == 1, .window_left = left, .window_right = right, .alibi_slopes = {}, .sinks = {}};
            for (int64_t i = 0; i < sq; ++i)
              for (int64_t j = 0; j < sk; ++j) {
                const int64_t offset = j - (i + sk - sq);  // key position relative to the aligned diagonal
                const int64_t r = causal ? 0 : right;
                const bool expected = (left < 0 || offset >= -left) && (r < 0 || offset <= r);
                ASSERT_EQ(reference::key_visible(o, i, j, sq, sk), expected)
                    << sq << " " << sk << " " << left << " " << right << " " << causal << " " << i << " " << j;
              }
          }
}

TEST(Reference, RowsWithoutKeysGiveZeroAndMinusInfinity) {
  Rng rng;
  const Dims d{1, 1, 4, 4};
  const Sequence s = random_sequence(d, 6, 2, rng);  // causal, 6 queries, 2 keys: rows 0..3 see nothing
  const auto r = reference::forward(d, Options{.causal = true, .alibi_slopes = {}, .sinks = {}}, s);
  for (int64_t i = 0; i < s.seqlen_q; ++i) {
    const bool empty = i < s.seqlen_q - s.seqlen_k;
    EXPECT_EQ(std::isinf(r.lse[i]) && r.lse[i] < 0, empty) << i;
    for (int64_t c = 0; c < d.headdim_v; ++c) {
      EXPECT_FALSE(std::isnan(r.out[i * d.headdim_v + c]));
      if (empty) {
        EXPECT_EQ(r.out[i * d.headdim_v + c], 0.0);
      }
    }
  }
}

TEST(Reference, GroupedQueryAttentionEqualsRepeatedKeyValueHeads) {
  Rng rng;
  const Dims gqa{6, 2, 5, 7}, mha{6, 6, 5, 7};
  Sequence s = random_sequence(gqa, 4, 9, rng);
  Sequence rep = s;
  rep.k.clear();
  rep.v.clear();
  for (int64_t j = 0; j < s.seqlen_k; ++j)
    for (int64_t h = 0; h < mha.nheads; ++h) {
      const int64_t hk = h / 3;
      for (int64_t c = 0; c < gqa.headdim; ++c) rep.k.push_back(s.k[(j * 2 + hk) * gqa.headdim + c]);
      for (int64_t c = 0; c < gqa.headdim_v; ++c) rep.v.push_back(s.v[(j * 2 + hk) * gqa.headdim_v + c]);
    }
  const Options o{.softcap = 3.0, .causal = true, .alibi_slopes = {}, .sinks = {}};
  const auto a = reference::forward(gqa, o, s), b = reference::forward(mha, o, rep);
  for (size_t i = 0; i < a.out.size(); ++i) EXPECT_DOUBLE_EQ(a.out[i], b.out[i]);
  for (size_t i = 0; i < a.lse.size(); ++i) EXPECT_DOUBLE_EQ(a.lse[i], b.lse[i]);
}

TEST(Reference, RotaryKeepsNormsAndDependsOnlyOnRelativePosition) {
  Rng rng;
  for (bool interleaved : {false, true}) {
    SCOPED_TRACE(interleaved ? "interleaved" : "halves");
    const int64_t headdim = 10, rotary_dim = 8, half = rotary_dim / 2, positions = 12;
    reference::Rotary ro{rotary_dim, interleaved, positions, {}, {}};
    std::vector<double> freq(half);
    for (double& f : freq) f = rng.uniform(0.05, 1.0);
    for (int64_t p = 0; p < positions; ++p)
      for (int64_t c = 0; c < half; ++c) {
        ro.cos.push_back(std::cos(p * freq[c]));
        ro.sin.push_back(std::sin(p * freq[c]));
      }
    const std::vector<double> q = random_vector(headdim, rng), k = random_vector(headdim, rng);
    auto rotated = [&](std::vector<double> x, int64_t pos) {
      reference::apply_rotary(x, 1, 1, headdim, ro, pos, 0);
      return x;
    };
    auto dot = [](const std::vector<double>& a, const std::vector<double>& b) {
      double s = 0.0;
      for (size_t i = 0; i < a.size(); ++i) s += a[i] * b[i];
      return s;
    };
    const auto q3 = rotated(q, 3);
    EXPECT_NEAR(dot(q3, q3), dot(q, q), 1e-12);
    EXPECT_EQ(q3[8], q[8]);  // beyond rotary_dim: untouched
    EXPECT_EQ(q3[9], q[9]);
    EXPECT_GT(std::fabs(q3[0] - q[0]) + std::fabs(q3[1] - q[1]), 1e-6);
    // <R(a) q, R(b) k> depends on a - b only.
    EXPECT_NEAR(dot(rotated(q, 7), rotated(k, 2)), dot(rotated(q, 9), rotated(k, 4)), 1e-12);
    EXPECT_NEAR(dot(rotated(q, 5), rotated(k, 5)), dot(q, k), 1e-12);
  }
}

TEST(Reference, KvCacheAppendsThenAttendsLikePlainAttention) {
  Rng rng;
  const Dims d{4, 2, 6, 5};
  reference::KvCacheSequence kv;
  kv.seqlen_q = 3;
  kv.q = random_vector(3 * d.nheads * d.headdim, rng);
  kv.capacity = 20;
  kv.k_cache = random_vector(kv.capacity * d.nheads_k * d.headdim, rng);
  kv.v_cache = random_vector(kv.capacity * d.nheads_k * d.headdim_v, rng);
  kv.cache_len = 9;
  kv.leftpad = 2;
  kv.seqlen_new = 4;
  kv.k_new = random_vector(kv.seqlen_new * d.nheads_k * d.headdim, rng);
  kv.v_new = random_vector(kv.seqlen_new * d.nheads_k * d.headdim_v, rng);
  const auto k_before = kv.k_cache;
  const Options o{.causal = true, .alibi_slopes = {}, .sinks = {}};
  const auto r = reference::kvcache(d, o, reference::Rotary{}, kv);

  const int64_t krow = d.nheads_k * d.headdim, vrow = d.nheads_k * d.headdim_v;
  for (int64_t slot = 0; slot < kv.capacity; ++slot) {
    const bool appended = slot >= 9 && slot < 13;
    for (int64_t c = 0; c < krow; ++c)
      EXPECT_EQ(kv.k_cache[slot * krow + c], appended ? kv.k_new[(slot - 9) * krow + c] : k_before[slot * krow + c]);
  }
  Sequence s;
  s.seqlen_q = 3;
  s.seqlen_k = 13 - 2;
  s.q = kv.q;
  s.k.assign(kv.k_cache.begin() + 2 * krow, kv.k_cache.begin() + 13 * krow);
  s.v.assign(kv.v_cache.begin() + 2 * vrow, kv.v_cache.begin() + 13 * vrow);
  const auto plain = reference::forward(d, o, s);
  EXPECT_EQ(r.out, plain.out);
  EXPECT_EQ(r.lse, plain.lse);
}

TEST(Reference, LowPrecisionModelStaysNearExact) {
  // The "same-dtype naive" model must differ from the exact result by about the dtype's rounding, no more:
  // it sets the tolerance of the fp16/bf16 tests.
  Rng rng;
  const Dims d{2, 2, 32, 32};
  const Sequence s = random_sequence(d, 40, 50, rng);
  const auto exact = reference::forward(d, Options{}, s);
  for (flare_dtype dt : {FLARE_DTYPE_F16, FLARE_DTYPE_BF16}) {
    const auto naive = reference::forward(d, Options{}, s, rounding_of(dt));
    const ErrorStats e = compare(naive.out, exact.out);
    EXPECT_GT(e.max_error, 0.0) << dtype_name(dt);
    EXPECT_LT(e.max_error, 8 * unit_roundoff(dt) * std::max(1.0, e.max_ref)) << dtype_name(dt);
  }
}

}  // namespace
}  // namespace flare::test

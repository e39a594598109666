// test_sinks.cpp — learnable attention sinks (flare.h "Sinks"): the forward's out and lse, the backward's
// dq/dk/dv and dsinks, dense and varlen, against the fp64 reference with the same sinks; rows that see no
// key (out = 0, lse = sink); a sink of -inf leaving results bit for bit as without sinks; determinism.
#include <cmath>
#include <cstring>
#include <limits>
#include <utility>
#include <vector>

#include "attention_harness.hpp"

namespace flare::test {
namespace {

constexpr double kFp32Tol = 1e-5;
const flare_dtype kAllDtypes[] = {FLARE_DTYPE_F32, FLARE_DTYPE_BF16, FLARE_DTYPE_F16, FLARE_DTYPE_F64};

// Lengths with rows that see every key, more keys than queries, and (causal) rows that see none.
const std::vector<std::pair<int64_t, int64_t>> kLengths = {{17, 17}, {113, 203}, {203, 113}, {1, 300}, {64, 1}};

TEST(Sinks, Forward) {
  Rng rng;
  for (flare_dtype dtype : kAllDtypes)
    for (auto [sq, sk] : kLengths)
      for (bool causal : {false, true}) {
        AttnCase c = dense_case(dtype, 2, sq, sk, 4, 2, 64, 48);
        c.causal = causal;
        c.sinks = true;
        check_forward(c, rng);
      }
}

TEST(Sinks, FarFromTheScores) {
  // Sinks 90 above the scores (their exponential overflows fp32 against a row's max: the CPU forward folds
  // them with fold_sink) and 90 below (they join a row's sum as exp(sink - max), which underflows to 0).
  Rng rng;
  for (flare_dtype dtype : {FLARE_DTYPE_F32, FLARE_DTYPE_BF16, FLARE_DTYPE_F64}) {
    for (double offset : {90.0, -90.0}) {
      AttnCase c = dense_case(dtype, 2, 37, 70, 4, 2, 64, 64);
      c.sinks = true;
      c.sink_offset = offset;
      c.causal = rng.coin();
      check_forward(c, rng);
    }
  }
}

TEST(Sinks, ForwardWithEveryScoreFeature) {
  Rng rng;
  for (flare_dtype dtype : kAllDtypes) {
    AttnCase c = dense_case(dtype, 2, 150, 190, 6, 2, 96, 96);
    c.sinks = true;
    c.causal = true;
    c.window_left = 40;
    c.softcap = 12.0f;
    c.alibi = AlibiMode::kPerBatchHead;
    c.layout = Layout::kScattered;
    check_forward(c, rng);
    c.causal = false;
    c.window_right = 7;
    c.alibi = AlibiMode::kPerHead;
    c.softmax_scale = 0.3f;
    check_forward(c, rng);
  }
}

TEST(Sinks, ForwardVarlen) {
  Rng rng;
  for (int n = 0; n < 12; ++n) {
    AttnCase c = random_varlen_case(rng, 4, 180);
    c.sinks = true;
    check_forward(c, rng);
  }
}

TEST(Sinks, RowsWithoutKeysGetTheSinkAsLse) {
  // Causal with more queries than keys: the first rows see no key. Their out is 0 and their lse is the sink
  // itself (the denominator holds exp(sink) alone), never NaN.
  Rng rng;
  AttnCase c = dense_case(FLARE_DTYPE_F32, 1, 40, 10, 3, 1, 32, 32);
  c.causal = true;
  c.sinks = true;
  const AttnProblem pb = make_problem(c, rng);
  HostTensor out = HostTensor::contiguous(c.dtype, pb.q_shape(c.nheads, c.headdim_v));
  HostTensor lse = HostTensor::contiguous(FLARE_DTYPE_F32, pb.lse_shape());
  out.poison_buffer();
  lse.poison_buffer();
  flare_fwd_params p = fwd_params(pb, out, lse, 0);
  FLARE_ASSERT_OK(flare_fwd(&p));
  const std::vector<double> o = out.values(), l = lse.values(), sinks = pb.sinks.values();
  const int64_t empty_rows = 40 - 10;  // query i sees keys 0..i - 30
  for (int64_t h = 0; h < c.nheads; ++h)
    for (int64_t i = 0; i < c.seqlens_q[0]; ++i) {
      const double row_lse = l[h * c.seqlens_q[0] + i];
      if (i < empty_rows) {
        EXPECT_EQ(row_lse, sinks[h]) << "head " << h << " row " << i;
        for (int64_t d = 0; d < c.headdim_v; ++d) EXPECT_EQ(o[(i * c.nheads + h) * c.headdim_v + d], 0.0);
      } else {
        EXPECT_GT(row_lse, sinks[h]) << "a row with keys has the sink and more in its denominator";
      }
    }
}

TEST(Sinks, MinusInfinityIsNoSink) {
  // Bit for bit the call without sinks, forward and backward (the fold changes nothing at -inf).
  Rng rng;
  for (flare_dtype dtype : {FLARE_DTYPE_F32, FLARE_DTYPE_BF16}) {
    AttnCase c = dense_case(dtype, 2, 70, 90, 4, 2, 64, 64);
    c.causal = true;
    const AttnProblem pb = make_problem(c, rng);
    HostTensor none = HostTensor::contiguous(FLARE_DTYPE_F32, {c.nheads});
    none.assign(std::vector<double>(c.nheads, -std::numeric_limits<double>::infinity()));
    std::vector<std::vector<double>> results;
    for (bool with_sinks : {false, true}) {
      HostTensor out = HostTensor::contiguous(dtype, pb.q_shape(c.nheads, c.headdim_v));
      HostTensor lse = HostTensor::contiguous(FLARE_DTYPE_F32, pb.lse_shape());
      flare_fwd_params f = fwd_params(pb, out, lse, 0);
      if (with_sinks) f.sinks = none.view();
      FLARE_ASSERT_OK(flare_fwd(&f));
      HostTensor dout = HostTensor::contiguous(dtype, pb.q_shape(c.nheads, c.headdim_v));
      Rng dout_rng(7);
      dout.fill_normal(dout_rng);
      HostTensor dq = HostTensor::contiguous(dtype, pb.q_shape(c.nheads, c.headdim));
      HostTensor dk = HostTensor::contiguous(dtype, pb.k_shape(c.nheads_k, c.headdim));
      HostTensor dv = HostTensor::contiguous(dtype, pb.k_shape(c.nheads_k, c.headdim_v));
      HostTensor dsinks = HostTensor::contiguous(FLARE_DTYPE_F32, {c.nheads});
      dsinks.poison_buffer();
      flare_bwd_params b = bwd_params(pb, out, dout, lse, dq, dk, dv, true, 2);
      if (with_sinks) {
        b.sinks = none.view();
        b.dsinks = dsinks.view();
      }
      FLARE_ASSERT_OK(flare_bwd(&b));
      if (with_sinks) {
        for (double g : dsinks.values()) EXPECT_EQ(g, 0.0) << "a sink of -inf has no weight, so no gradient";
      }
      std::vector<double> all = out.values();
      for (const HostTensor* t : {&lse, &dq, &dk, &dv}) {
        const std::vector<double> v = t->values();
        all.insert(all.end(), v.begin(), v.end());
      }
      results.push_back(std::move(all));
    }
    ASSERT_EQ(results[0].size(), results[1].size());
    EXPECT_EQ(std::memcmp(results[0].data(), results[1].data(), results[0].size() * sizeof(double)), 0)
        << dtype_name(dtype) << ": sinks of -inf changed the results";
  }
}

TEST(Sinks, Backward) {
  Rng rng;
  for (flare_dtype dtype : kAllDtypes)
    for (auto [sq, sk] : kLengths) {
      AttnCase c = dense_case(dtype, 2, sq, sk, 4, 2, 64, 64);
      c.causal = rng.coin();
      c.sinks = true;
      check_backward(c, rng, kFp32Tol);
    }
}

TEST(Sinks, BackwardWithFeaturesAndVarlen) {
  Rng rng;
  for (flare_dtype dtype : {FLARE_DTYPE_F32, FLARE_DTYPE_BF16, FLARE_DTYPE_F64}) {
    AttnCase c = dense_case(dtype, 2, 130, 170, 4, 1, 80, 48);
    c.sinks = true;
    c.causal = true;
    c.window_left = 50;
    c.softcap = 15.0f;
    c.alibi = AlibiMode::kPerHead;
    c.layout = Layout::kScattered;
    check_backward(c, rng, kFp32Tol);
  }
  for (int n = 0; n < 8; ++n) {
    AttnCase c = random_varlen_case(rng, 4, 150);
    c.sinks = true;
    c.deterministic = rng.coin();
    check_backward(c, rng, kFp32Tol);
  }
}

TEST(Sinks, DsinksIsBitwiseRepeatableAcrossThreadCounts) {
  // dsinks sums each head's rows in one fixed order: the same bits for any thread count.
  Rng rng;
  AttnCase c = dense_case(FLARE_DTYPE_F32, 3, 120, 120, 4, 2, 64, 64);
  c.causal = true;
  c.sinks = true;
  const AttnProblem pb = make_problem(c, rng);
  const auto ref = reference_forward(pb, nullptr);
  HostTensor out = HostTensor::contiguous(c.dtype, pb.q_shape(c.nheads, c.headdim_v));
  out.assign(concat_out(ref));
  HostTensor lse = HostTensor::contiguous(FLARE_DTYPE_F32, pb.lse_shape());
  lse.assign(lse_in_flare_layout(pb, ref));
  HostTensor dout = HostTensor::contiguous(c.dtype, pb.q_shape(c.nheads, c.headdim_v));
  dout.fill_normal(rng);
  std::vector<std::vector<double>> runs;
  for (int32_t threads : {1, 2, 3}) {
    HostTensor dq = HostTensor::contiguous(c.dtype, pb.q_shape(c.nheads, c.headdim));
    HostTensor dk = HostTensor::contiguous(c.dtype, pb.k_shape(c.nheads_k, c.headdim));
    HostTensor dv = HostTensor::contiguous(c.dtype, pb.k_shape(c.nheads_k, c.headdim_v));
    HostTensor dsinks = HostTensor::contiguous(FLARE_DTYPE_F32, {c.nheads});
    flare_bwd_params p = bwd_params(pb, out, dout, lse, dq, dk, dv, true, threads);
    p.dsinks = dsinks.view();
    FLARE_ASSERT_OK(flare_bwd(&p));
    runs.push_back(dsinks.values());
  }
  EXPECT_EQ(runs[0], runs[1]);
  EXPECT_EQ(runs[0], runs[2]);
}

}  // namespace
}  // namespace flare::test

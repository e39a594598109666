// test_properties.cpp — properties that hold whatever the reference says: attention over two halves of the
// keys, merged by their lse, equals attention over all keys; every output element is written (outputs are
// NaN-poisoned first) and nothing between the elements of a strided output is.
#include <cmath>
#include <limits>
#include <vector>

#include "attention_harness.hpp"

namespace flare::test {
namespace {

// out/lse of q against keys [first, first + count) of k/v, through flare_fwd on views into k and v.
struct Partial {
  std::vector<double> out, lse;  // out (batch, seqlen_q, nheads, headdim_v); lse (batch, nheads, seqlen_q)
};

Partial forward_on_keys(const AttnProblem& pb, int64_t first, int64_t count, flare_attn_options attn) {
  const AttnCase& c = pb.c;
  auto key_slice = [&](const HostTensor& t) {
    std::vector<int64_t> shape = t.shape();
    shape[1] = count;
    return HostTensor::view_of(t, first * t.strides()[1], shape, t.strides());
  };
  const HostTensor k = key_slice(pb.k), v = key_slice(pb.v);
  HostTensor out = HostTensor::contiguous(c.dtype, pb.q_shape(c.nheads, c.headdim_v));
  HostTensor lse = HostTensor::contiguous(FLARE_DTYPE_F32, pb.lse_shape());
  out.poison_buffer();
  lse.poison_buffer();
  flare_fwd_params p;
  flare_fwd_params_init(&p);
  p.q = pb.q.view();
  p.k = k.view();
  p.v = v.view();
  p.out = out.view();
  p.softmax_lse = lse.view();
  p.attn = attn;
  const flare_status status = flare_fwd(&p);
  EXPECT_EQ(status, FLARE_OK) << flare_last_error();
  return {out.values(), lse.values()};
}

TEST(Properties, MergingKeyHalvesByLseEqualsAttentionOverAllKeys) {
  Rng rng;
  for (flare_dtype dtype : {FLARE_DTYPE_F32, FLARE_DTYPE_F64})
    for (int rep = 0; rep < 4; ++rep) {
      // Non-causal, no window, no ALiBi: those align to seqlen_k, which the split changes.
      AttnCase c = dense_case(dtype, rng.integer(1, 3), rng.integer(1, 60), rng.integer(2, 300), 4, 2, 64, 32);
      c.softcap = rep % 2 ? 6.0f : 0.0f;
      c.layout = rep >= 2 ? Layout::kScattered : Layout::kContiguous;
      const AttnProblem pb = make_problem(c, rng);
      const int64_t n = c.seqlens_k[0], m = rng.integer(1, n - 1);
      SCOPED_TRACE(c.describe() + " split at " + std::to_string(m));
      flare_fwd_params defaults;
      flare_fwd_params_init(&defaults);
      const flare_attn_options attn = attn_options(pb, defaults.attn);
      const Partial a = forward_on_keys(pb, 0, m, attn), b = forward_on_keys(pb, m, n - m, attn);
      const Partial all = forward_on_keys(pb, 0, n, attn);

      // lse = logaddexp(l1, l2); out = exp(l1 - lse) o1 + exp(l2 - lse) o2, per (batch, head, query).
      const int64_t batch = c.batch(), sq = c.seqlens_q[0], h = c.nheads, dv = c.headdim_v;
      std::vector<double> out(a.out.size()), lse(a.lse.size());
      for (int64_t bi = 0; bi < batch; ++bi)
        for (int64_t hi = 0; hi < h; ++hi)
          for (int64_t i = 0; i < sq; ++i) {
            const int64_t li = (bi * h + hi) * sq + i;
            const double l1 = a.lse[li], l2 = b.lse[li];
            const double top = std::max(l1, l2);
            const double merged = top + std::log(std::exp(l1 - top) + std::exp(l2 - top));
            lse[li] = merged;
            for (int64_t e = 0; e < dv; ++e) {
              const int64_t oi = ((bi * sq + i) * h + hi) * dv + e;
              out[oi] = std::exp(l1 - merged) * a.out[oi] + std::exp(l2 - merged) * b.out[oi];
            }
          }
      // The merge weighs by lse, which is stored in fp32 even for fp64 inputs: there the check is as
      // fine as fp32 lse allows (a few units of fp32 roundoff in the lse, relative to |lse|).
      const ErrorStats eo = compare(out, all.out), el = compare(lse, all.lse);
      const double lse_mag = std::max(1.0, el.max_ref);
      const double tol = dtype == FLARE_DTYPE_F64 ? 4 * unit_roundoff(FLARE_DTYPE_F32) * lse_mag : 1e-5;
      EXPECT_LE(eo.max_error, tol * std::max(1.0, eo.max_ref)) << "merged out: " << describe(eo, out, all.out);
      const double lse_tol = dtype == FLARE_DTYPE_F64 ? 4 * unit_roundoff(FLARE_DTYPE_F32) : 1e-5;
      EXPECT_LE(el.max_error, lse_tol * lse_mag) << "merged lse: " << describe(el, lse, all.lse);
      EXPECT_EQ(eo.bad + el.bad, 0);
    }
}

TEST(Properties, PoisonedOutputsAreFullyOverwritten) {
  // Outputs (with padding between elements) are NaN before each call; afterwards every element holds a
  // number and the padding still holds NaN. The cases stress the rows a kernel might skip: rows without
  // keys, empty sequences, keys past seqused_k (zero gradient), and tails of tiles.
  Rng rng;
  for (flare_dtype dtype : {FLARE_DTYPE_F32, FLARE_DTYPE_BF16, FLARE_DTYPE_F16, FLARE_DTYPE_F64}) {
    AttnCase c = dense_case(dtype, 2, 70, 9, 2, 1, 24, 40);
    c.causal = true;  // rows 0..60 see no key
    c.layout = Layout::kScattered;
    check_forward(c, rng);
    check_backward(c, rng, 1e-5);
    c = varlen_case(dtype, {0, 7, 65, 3}, {5, 0, 66, 12}, 3, 3, 16, 16);
    c.seqused_k = {2, 0, 66, 5};
    c.layout = Layout::kScattered;
    c.window_left = 3;
    check_forward(c, rng);
    check_backward(c, rng, 1e-5);
  }
}

}  // namespace
}  // namespace flare::test

// test_properties.cpp — properties that hold whatever the reference says: attention over two halves of the
// keys, merged by their lse, equals attention over all keys; every output element is written (outputs are
// NaN-poisoned first) and nothing between the elements of a strided output is; neither a caller-provided
// workspace, whatever it holds, nor flare's kept scratch, nor calls at once change a bit of the result.
#include <cmath>
#include <limits>
#include <thread>
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

// A problem's forward and, from the reference's out and lse, its backward: the inputs fixed once so that
// runs with different scratch can be compared bit for bit.
struct TwoPasses {
  AttnCase c;
  AttnProblem pb;
  HostTensor dout, out_ref, lse_ref;

  TwoPasses(const AttnCase& c_, Rng& rng) : c(c_), pb(make_problem(c_, rng)) {
    const auto ref = reference_forward(pb, nullptr);
    dout = HostTensor::contiguous(c.dtype, pb.q_shape(c.nheads, c.headdim_v));
    dout.fill_normal(rng);
    out_ref = HostTensor::contiguous(c.dtype, pb.q_shape(c.nheads, c.headdim_v));
    out_ref.assign(concat_out(ref));
    lse_ref = HostTensor::contiguous(FLARE_DTYPE_F32, pb.lse_shape());
    lse_ref.assign(lse_in_flare_layout(pb, ref));
  }

  // Scratch bytes of each pass on `threads` threads.
  size_t forward_scratch(int threads) const {
    HostTensor out = HostTensor::contiguous(c.dtype, pb.q_shape(c.nheads, c.headdim_v));
    HostTensor lse = HostTensor::contiguous(FLARE_DTYPE_F32, pb.lse_shape());
    const flare_fwd_params f = fwd_params(pb, out, lse, threads);
    size_t bytes = 0;
    EXPECT_EQ(flare_fwd_workspace_size(&f, 0, &bytes), FLARE_OK) << flare_last_error();
    return bytes;
  }
  size_t backward_scratch(int threads) const {
    HostTensor dq = HostTensor::contiguous(c.dtype, pb.q_shape(c.nheads, c.headdim));
    HostTensor dk = HostTensor::contiguous(c.dtype, pb.k_shape(c.nheads_k, c.headdim));
    HostTensor dv = HostTensor::contiguous(c.dtype, pb.k_shape(c.nheads_k, c.headdim_v));
    const flare_bwd_params b = bwd_params(pb, out_ref, dout, lse_ref, dq, dk, dv, true, threads);
    size_t bytes = 0;
    EXPECT_EQ(flare_bwd_workspace_size(&b, 0, &bytes), FLARE_OK) << flare_last_error();
    return bytes;
  }

  // Gives p a workspace of `bytes` held in ws: one byte off 64-byte alignment, every byte `fill`.
  template <class Params>
  static void lend(Params& p, size_t bytes, std::vector<unsigned char>& ws, unsigned char fill) {
    ws.assign(bytes + 1, fill);
    p.exec.workspace = ws.data() + 1;
    p.exec.workspace_size = bytes;
  }

  // out, lse, dq, dk, dv in one vector, on `threads` threads (deterministic backward). With `workspace`, each
  // pass's scratch is the caller's, one byte off 64-byte alignment and every byte of it `fill` beforehand;
  // without, flare's own.
  std::vector<double> run(int threads, bool workspace, unsigned char fill = 0) const {
    HostTensor out = HostTensor::contiguous(c.dtype, pb.q_shape(c.nheads, c.headdim_v));
    HostTensor lse = HostTensor::contiguous(FLARE_DTYPE_F32, pb.lse_shape());
    flare_fwd_params f = fwd_params(pb, out, lse, threads);
    std::vector<unsigned char> fwd_ws;
    if (workspace) lend(f, forward_scratch(threads), fwd_ws, fill);
    EXPECT_EQ(flare_fwd(&f), FLARE_OK) << flare_last_error();
    std::vector<double> r = out.values();
    const std::vector<double> l = lse.values();
    r.insert(r.end(), l.begin(), l.end());

    HostTensor dq = HostTensor::contiguous(c.dtype, pb.q_shape(c.nheads, c.headdim));
    HostTensor dk = HostTensor::contiguous(c.dtype, pb.k_shape(c.nheads_k, c.headdim));
    HostTensor dv = HostTensor::contiguous(c.dtype, pb.k_shape(c.nheads_k, c.headdim_v));
    flare_bwd_params b = bwd_params(pb, out_ref, dout, lse_ref, dq, dk, dv, true, threads);
    std::vector<unsigned char> bwd_ws;
    if (workspace) lend(b, backward_scratch(threads), bwd_ws, fill);
    EXPECT_EQ(flare_bwd(&b), FLARE_OK) << flare_last_error();
    for (const HostTensor* t : {&dq, &dk, &dv}) {
      const std::vector<double> x = t->values();
      r.insert(r.end(), x.begin(), x.end());
    }
    return r;
  }
};

TEST(Properties, CallerWorkspaceGivesTheSameResult) {
  // Scratch from the caller (of the size the *_workspace_size query reports) instead of flare's own
  // allocation: the same bits come out. A workspace one byte off the 64-byte alignment is also accepted.
  Rng rng;
  for (flare_dtype dtype : {FLARE_DTYPE_F32, FLARE_DTYPE_BF16}) {
    AttnCase c = dense_case(dtype, 2, 77, 130, 4, 2, 64, 64);
    c.causal = true;
    c.softcap = 5.0f;
    const TwoPasses passes(c, rng);
    EXPECT_TRUE(passes.run(0, false) == passes.run(0, true, 0))
        << dtype_name(dtype) << ": the passes differ with a caller workspace";
  }
}

TEST(Properties, ScratchLeftoversAndConcurrentCallsChangeNothing) {
  // Scratch above 1 MiB comes from one block flare keeps between calls and lends to one call at a time
  // (dispatch.cpp): no pass may read scratch it has not written. The same bits come out of a workspace of
  // zeros, one of 0xff bytes (NaN in every float), flare's kept block after other problems have used it,
  // and four calls at once (one gets the block, the others allocate).
  Rng rng;
  constexpr int kThreads = 2;
  for (flare_dtype dtype : {FLARE_DTYPE_F32, FLARE_DTYPE_BF16}) {
    AttnCase c = dense_case(dtype, 1, 333, 700, 2, 1, 256, 256);
    c.causal = true;
    const TwoPasses passes(c, rng);
    ASSERT_GT(passes.backward_scratch(kThreads), size_t{1} << 20)
        << dtype_name(dtype) << ": the backward's scratch must be past the per-thread kept size";
    const std::vector<double> zeros = passes.run(kThreads, true, 0x00);
    EXPECT_TRUE(zeros == passes.run(kThreads, true, 0xff))
        << dtype_name(dtype) << ": a workspace of 0xff bytes changes the result";

    const TwoPasses other(dense_case(dtype, 2, 500, 900, 2, 2, 256, 128), rng);  // grows the kept block
    other.run(kThreads, false);
    EXPECT_TRUE(zeros == passes.run(kThreads, false)) << dtype_name(dtype) << ": the kept block changes the result";

    std::vector<std::vector<double>> results(4);
    std::vector<std::thread> callers;
    for (auto& r : results) callers.emplace_back([&passes, &r] { r = passes.run(kThreads, false); });
    for (std::thread& t : callers) t.join();
    for (size_t i = 0; i < results.size(); ++i)
      EXPECT_TRUE(zeros == results[i]) << dtype_name(dtype) << ": concurrent call " << i << " differs";
  }
}

}  // namespace
}  // namespace flare::test

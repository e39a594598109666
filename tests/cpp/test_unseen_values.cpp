// test_unseen_values.cpp — NaN and infinity in K or V at a key a row cannot see never reach that row's
// output, nor (backward) that row's dQ or the gradients of the keys no row sees: causal- and window-masked keys (which share key blocks with rows that see them), slots beyond
// cache_seqlens, varlen padding past seqused_k, and unused slots and blocks of a paged cache. Serving caches
// are allocated uninitialised, so this is correctness, not tidiness. Each output row is checked against
// the fp64 reference: rows that see a non-finite value must be non-finite, every other row must match.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "bad_input_cases.hpp"
#include "cpu/reference.hpp"

namespace flare::badinput {
namespace {

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
constexpr double kInf = std::numeric_limits<double>::infinity();

double get(Tensor& t, int64_t i) {
  if (t.view.dtype == FLARE_DTYPE_BF16) return flare::bf16::from_bits(reinterpret_cast<uint16_t*>(t.bytes())[i]).to_float();
  return t.f32()[i];
}
void put(Tensor& t, int64_t i, double x) {
  if (t.view.dtype == FLARE_DTYPE_BF16) {
    reinterpret_cast<uint16_t*>(t.bytes())[i] = flare::bf16(static_cast<float>(x)).bits;
  } else {
    t.f32()[i] = static_cast<float>(x);
  }
}
// Sets row `row` (all heads and dims) of a (rows, heads, dim)-contiguous tensor to x.
void fill_row(Tensor& t, int64_t row, int64_t width, double x) {
  for (int64_t c = 0; c < width; ++c) put(t, row * width + c, x);
}

using Value = std::function<double(int64_t, int64_t, int64_t)>;  // (position, head, dim)

// Compares out rows [0, seqlen_q) of one sequence (element (i, h, c) at out_at(i, h, c)) with the fp64
// reference over keys 0..seqlen_k-1 given by k/v.
void expect_matches_reference(const reference::Dims& dims, const reference::Options& opts, int64_t seqlen_q,
                              int64_t seqlen_k, const Value& q, const Value& k, const Value& v, const Value& out,
                              double tol) {
  reference::Sequence seq;
  seq.seqlen_q = seqlen_q;
  seq.seqlen_k = seqlen_k;
  for (int64_t i = 0; i < seqlen_q; ++i)
    for (int64_t h = 0; h < dims.nheads; ++h)
      for (int64_t c = 0; c < dims.headdim; ++c) seq.q.push_back(q(i, h, c));
  for (int64_t j = 0; j < seqlen_k; ++j) {
    for (int64_t h = 0; h < dims.nheads_k; ++h)
      for (int64_t c = 0; c < dims.headdim; ++c) seq.k.push_back(k(j, h, c));
    for (int64_t h = 0; h < dims.nheads_k; ++h)
      for (int64_t c = 0; c < dims.headdim_v; ++c) seq.v.push_back(v(j, h, c));
  }
  const reference::ForwardResult ref = reference::forward(dims, opts, seq);
  int64_t finite_rows = 0, poisoned_rows = 0;
  for (int64_t i = 0; i < seqlen_q; ++i) {
    for (int64_t h = 0; h < dims.nheads; ++h) {
      bool row_finite = true;
      for (int64_t c = 0; c < dims.headdim_v; ++c) row_finite &= std::isfinite(ref.out[(i * dims.nheads + h) * dims.headdim_v + c]);
      (row_finite ? finite_rows : poisoned_rows) += 1;
      for (int64_t c = 0; c < dims.headdim_v; ++c) {
        const double want = ref.out[(i * dims.nheads + h) * dims.headdim_v + c], got = out(i, h, c);
        if (std::isfinite(want)) {
          ASSERT_NEAR(got, want, tol) << "query " << i << " head " << h << " dim " << c;
        } else if (!row_finite) {
          ASSERT_FALSE(std::isfinite(got)) << "query " << i << " head " << h << " sees a non-finite value";
        }
      }
    }
  }
  EXPECT_GT(finite_rows, 0);
}

constexpr flare_dtype kDtypes[] = {FLARE_DTYPE_F32, FLARE_DTYPE_BF16};
double tolerance(flare_dtype dtype) { return dtype == FLARE_DTYPE_F32 ? 2e-5 : 2e-2; }

// Dense forward, one sequence of 300 queries and keys (two key blocks of every engine), 2 query heads on one
// kv head, head dim `dim`: key `bad` holds `v_value` in V and `k_value` in K.
void dense_case(flare_dtype dtype, int32_t causal, int32_t window_left, int64_t bad, double v_value, double k_value,
                int64_t dim = 32, int64_t nq = 300, int64_t nk = 300) {
  SCOPED_TRACE(std::string(dtype == FLARE_DTYPE_F32 ? "f32" : "bf16") + " causal " + std::to_string(causal) +
               " window_left " + std::to_string(window_left) + " bad key " + std::to_string(bad) + " dim " +
               std::to_string(dim) + " seqlens " + std::to_string(nq) + "x" + std::to_string(nk));
  const int64_t heads = 2;
  Tensor q(dtype, {1, nq, heads, dim}, 1), k(dtype, {1, nk, 1, dim}, 2), v(dtype, {1, nk, 1, dim}, 3),
      out(dtype, {1, nq, heads, dim}, 4);
  fill_row(v, bad, dim, v_value);
  fill_row(k, bad, dim, k_value);
  flare_fwd_params p;
  flare_fwd_params_init(&p);
  p.q = q.view;
  p.k = k.view;
  p.v = v.view;
  p.out = out.view;
  p.attn.causal = causal;
  p.attn.window_left = window_left;
  ASSERT_EQ(flare_fwd(&p), FLARE_OK) << flare_last_error();
  reference::Options opts;
  opts.causal = causal;
  opts.window_left = window_left;
  expect_matches_reference(
      {heads, 1, dim, dim}, opts, nq, nk, [&](int64_t i, int64_t h, int64_t c) { return get(q, (i * heads + h) * dim + c); },
      [&](int64_t j, int64_t, int64_t c) { return get(k, j * dim + c); },
      [&](int64_t j, int64_t, int64_t c) { return get(v, j * dim + c); },
      [&](int64_t i, int64_t h, int64_t c) { return get(out, (i * heads + h) * dim + c); }, tolerance(dtype));
}

TEST(UnseenValues, FewKeys) {
  // A few keys in one block, most of it past the sequence or masked. 40 queries against 5 keys, causal
  // (bottom-right): rows 0..34 see no key, row 35 + j sees keys 0..j; with a window of 1 row 39 sees keys 3
  // and 4 only.
  for (flare_dtype dtype : {FLARE_DTYPE_F32, FLARE_DTYPE_BF16}) {
    dense_case(dtype, 1, -1, 2, kNaN, kInf, 32, 40, 5);   // rows 35, 36 cannot see key 2
    dense_case(dtype, 1, -1, 4, kInf, kNaN, 40, 40, 5);   // only row 39 sees key 4 (odd head dim)
    dense_case(dtype, 1, 1, 1, kNaN, kNaN, 32, 40, 5);    // rows 37.. have slid past key 1
    dense_case(dtype, 1, -1, 1, -kInf, 1.0, 32, 17, 2);   // two keys: row 15 sees key 0, row 16 both
  }
}

TEST(UnseenValues, CausalMaskedKeys) {
  for (flare_dtype dtype : kDtypes) {
    dense_case(dtype, 1, -1, 150, kNaN, kInf);    // rows 0..149 cannot see key 150
    dense_case(dtype, 1, -1, 299, kInf, kNaN);    // only the last row sees it
    dense_case(dtype, 1, -1, 40, -kInf, 1.0);
  }
}

TEST(UnseenValues, WindowMaskedKeys) {
  for (flare_dtype dtype : kDtypes) {
    dense_case(dtype, 1, 16, 10, kNaN, kNaN);  // rows 27.. have slid past key 10
    dense_case(dtype, 0, 7, 200, kInf, kInf);  // non-causal: rows 0..199 see it, 208.. do not
  }
}

// A KV cache: sequences of `lengths` keys in a dense cache of 64 slots or a paged one of blocks of 16; every
// slot past a sequence's keys (and every block it does not use) holds NaN in K and V. k_new appends 2 keys.
// With window_left, key `bad` of every sequence (bad < 0: its key lengths[b] + bad) holds NaN in V and infinity
// in K as well.
void kvcache_case(flare_dtype dtype, bool paged, int64_t seqlen_q, int32_t window_left, int64_t bad,
                  int64_t dim = 16) {
  SCOPED_TRACE(std::string(dtype == FLARE_DTYPE_F32 ? "f32" : "bf16") + (paged ? " paged" : " dense") +
               " seqlen_q " + std::to_string(seqlen_q) + " window_left " + std::to_string(window_left) +
               " dim " + std::to_string(dim));
  const int64_t batch = 2, heads = 4, heads_k = 2, slots = 64, block = 16, blocks = 10, fresh = 2;
  const std::vector<int32_t> lengths{20, 37};
  const std::vector<int32_t> table{7, 2, 9, 0, 4, 6, 1, 8};  // (batch, 4): blocks 3 and 5 unused
  const int64_t rows = paged ? blocks : batch, cols = paged ? block : slots;
  Tensor q(dtype, {batch, seqlen_q, heads, dim}, 5), kc(dtype, {rows, cols, heads_k, dim}, 6),
      vc(dtype, {rows, cols, heads_k, dim}, 7), kn(dtype, {batch, fresh, heads_k, dim}, 8),
      vn(dtype, {batch, fresh, heads_k, dim}, 9), out(dtype, {batch, seqlen_q, heads, dim}, 10);
  Tensor seqlens = Tensor::ints(lengths), block_table = Tensor::ints(table, {batch, 4});
  // The cache row of (sequence b, position j): dense b * slots + j, paged through the block table.
  const auto slot = [&](int64_t b, int64_t j) { return paged ? table[b * 4 + j / block] * block + j % block : b * slots + j; };
  std::vector<bool> used(rows * cols, false);
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t j = 0; j < lengths[b]; ++j) used[slot(b, j)] = true;
  for (int64_t s = 0; s < rows * cols; ++s) {
    if (used[s]) continue;
    fill_row(kc, s, heads_k * dim, kNaN);
    fill_row(vc, s, heads_k * dim, kNaN);
  }
  if (window_left >= 0) {
    for (int64_t b = 0; b < batch; ++b) {
      const int64_t key = bad < 0 ? lengths[b] + bad : bad;
      fill_row(vc, slot(b, key), heads_k * dim, kNaN);
      fill_row(kc, slot(b, key), heads_k * dim, kInf);
    }
  }
  flare_kvcache_params p;
  flare_kvcache_params_init(&p);
  p.q = q.view;
  p.k_cache = kc.view;
  p.v_cache = vc.view;
  p.k_new = kn.view;
  p.v_new = vn.view;
  p.out = out.view;
  p.cache_seqlens = seqlens.view;
  if (paged) p.block_table = block_table.view;
  p.attn.causal = 1;
  p.attn.window_left = window_left;
  ASSERT_EQ(flare_fwd_kvcache(&p), FLARE_OK) << flare_last_error();
  reference::Options opts;
  opts.causal = true;
  opts.window_left = window_left;
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t keys = lengths[b] + fresh;  // the appended keys were copied into the cache
    expect_matches_reference(
        {heads, heads_k, dim, dim}, opts, seqlen_q, keys,
        [&](int64_t i, int64_t h, int64_t c) { return get(q, ((b * seqlen_q + i) * heads + h) * dim + c); },
        [&](int64_t j, int64_t h, int64_t c) { return get(kc, (slot(b, j) * heads_k + h) * dim + c); },
        [&](int64_t j, int64_t h, int64_t c) { return get(vc, (slot(b, j) * heads_k + h) * dim + c); },
        [&](int64_t i, int64_t h, int64_t c) { return get(out, ((b * seqlen_q + i) * heads + h) * dim + c); },
        tolerance(dtype));
  }
}

TEST(UnseenValues, KvCacheSlotsPastCacheSeqlens) {
  for (flare_dtype dtype : kDtypes) {
    kvcache_case(dtype, false, 3, -1, 0);
    kvcache_case(dtype, true, 3, -1, 0);  // unused slots of the last page, and unused blocks
    kvcache_case(dtype, true, 1, -1, 0, 64);  // a decode step; sequences of 22 and 39 keys (an odd last pair)
  }
}

TEST(UnseenValues, KvCacheKeysOutsideTheWindow) {
  for (flare_dtype dtype : kDtypes) {
    for (bool paged : {false, true}) {
      kvcache_case(dtype, paged, 1, 8, 5);  // a decode step: key 5 is far behind the window
      kvcache_case(dtype, paged, 4, 8, 5);
      // Head dim 64 (bf16: the decode path's dot-product tiles, which take keys in pairs): the last cached key
      // is seen by rows 1.. only, and row 0's window of 9 keys ends just before it, on an odd last pair.
      kvcache_case(dtype, paged, 4, 8, -1, 64);
    }
  }
}

// Varlen: keys past seqused_k (the rest of each sequence's cu_seqlens_k span) hold NaN in K and V.
TEST(UnseenValues, VarlenPaddingPastSeqused) {
  for (flare_dtype dtype : kDtypes) {
    SCOPED_TRACE(dtype == FLARE_DTYPE_F32 ? "f32" : "bf16");
    const int64_t heads = 2, dim = 24;
    const std::vector<int32_t> cu_q{0, 40, 47}, cu_k{0, 50, 100}, used{30, 45};
    Tensor q(dtype, {47, heads, dim}, 11), k(dtype, {100, 1, dim}, 12), v(dtype, {100, 1, dim}, 13),
        out(dtype, {47, heads, dim}, 14);
    Tensor cuq = Tensor::ints(cu_q), cuk = Tensor::ints(cu_k), seqused = Tensor::ints(used);
    for (int64_t b = 0; b < 2; ++b) {
      for (int64_t t = cu_k[b] + used[b]; t < cu_k[b + 1]; ++t) {
        fill_row(k, t, dim, kNaN);
        fill_row(v, t, dim, kNaN);
      }
    }
    flare_fwd_params p;
    flare_fwd_params_init(&p);
    p.q = q.view;
    p.k = k.view;
    p.v = v.view;
    p.out = out.view;
    p.cu_seqlens_q = cuq.view;
    p.cu_seqlens_k = cuk.view;
    p.seqused_k = seqused.view;
    p.attn.causal = 1;
    ASSERT_EQ(flare_fwd_varlen(&p), FLARE_OK) << flare_last_error();
    reference::Options opts;
    opts.causal = true;
    for (int64_t b = 0; b < 2; ++b) {
      expect_matches_reference(
          {heads, 1, dim, dim}, opts, cu_q[b + 1] - cu_q[b], used[b],
          [&](int64_t i, int64_t h, int64_t c) { return get(q, ((cu_q[b] + i) * heads + h) * dim + c); },
          [&](int64_t j, int64_t, int64_t c) { return get(k, (cu_k[b] + j) * dim + c); },
          [&](int64_t j, int64_t, int64_t c) { return get(v, (cu_k[b] + j) * dim + c); },
          [&](int64_t i, int64_t h, int64_t c) { return get(out, ((cu_q[b] + i) * heads + h) * dim + c); },
          tolerance(dtype));
    }
  }
}

// ---- backward ---------------------------------------------------------------------------------------------

// Compares gradient rows (`rows` of `width`, element (r, c) at got(r, c)) with the reference's: each row
// whose reference is finite (it depends on no non-finite value) must match it within tol * max(1, max
// |reference|). How a non-finite value spreads through the rows that see it (through their out, D and lse
// into every key they see) is not this test's subject. At least min_finite_rows rows are compared.
void expect_rows_match(const char* name, const std::vector<double>& want, int64_t rows, int64_t width,
                       const std::function<double(int64_t, int64_t)>& got, double tol, int64_t min_finite_rows) {
  double scale = 1.0;
  for (double x : want)
    if (std::isfinite(x)) scale = std::max(scale, std::abs(x));
  int64_t finite_rows = 0;
  for (int64_t r = 0; r < rows; ++r) {
    bool row_finite = true;
    for (int64_t c = 0; c < width; ++c) row_finite &= std::isfinite(want[r * width + c]);
    if (!row_finite) continue;
    ++finite_rows;
    for (int64_t c = 0; c < width; ++c)
      ASSERT_NEAR(got(r, c), want[r * width + c], tol * scale) << name << " row " << r << " dim " << c;
  }
  EXPECT_GE(finite_rows, min_finite_rows) << name;
}

// Dense backward, one sequence of 300 keys (three key blocks of the FMA engine, five of the bf16 ones) and
// `nq` queries (300; a few take the fp32 few-query backward), 2 query heads on one kv head, head dim `dim`: key
// `bad` holds `v_value` in V and `k_value` in K. out and lse come from flare's forward; dq (rows (query,
// head)), dk and dv (rows = keys) are checked against the reference, dq in at least `clean_rows` rows (the
// rows that cannot see key `bad`, both heads).
void dense_backward_case(flare_dtype dtype, int32_t causal, int32_t window_left, float softcap, int64_t bad,
                         double v_value, double k_value, int64_t clean_rows, int64_t dim = 32,
                         int64_t nq = 300) {
  SCOPED_TRACE(std::string(dtype == FLARE_DTYPE_F32 ? "f32" : "bf16") + " causal " + std::to_string(causal) +
               " window_left " + std::to_string(window_left) + " softcap " + std::to_string(softcap) + " bad key " +
               std::to_string(bad) + " dim " + std::to_string(dim) + " queries " + std::to_string(nq));
  const int64_t n = 300, heads = 2;
  Tensor q(dtype, {1, nq, heads, dim}, 21), k(dtype, {1, n, 1, dim}, 22), v(dtype, {1, n, 1, dim}, 23),
      out(dtype, {1, nq, heads, dim}, 24), dout(dtype, {1, nq, heads, dim}, 25), lse(FLARE_DTYPE_F32, {1, heads, nq}),
      dq(dtype, {1, nq, heads, dim}, 26), dk(dtype, {1, n, 1, dim}, 27), dv(dtype, {1, n, 1, dim}, 28);
  fill_row(v, bad, dim, v_value);
  fill_row(k, bad, dim, k_value);
  flare_fwd_params f;
  flare_fwd_params_init(&f);
  f.q = q.view;
  f.k = k.view;
  f.v = v.view;
  f.out = out.view;
  f.softmax_lse = lse.view;
  f.attn.causal = causal;
  f.attn.window_left = window_left;
  f.attn.softcap = softcap;
  ASSERT_EQ(flare_fwd(&f), FLARE_OK) << flare_last_error();
  flare_bwd_params b;
  flare_bwd_params_init(&b);
  b.q = q.view;
  b.k = k.view;
  b.v = v.view;
  b.out = out.view;
  b.dout = dout.view;
  b.softmax_lse = lse.view;
  b.dq = dq.view;
  b.dk = dk.view;
  b.dv = dv.view;
  b.attn = f.attn;
  ASSERT_EQ(flare_bwd(&b), FLARE_OK) << flare_last_error();

  reference::Options opts;
  opts.causal = causal;
  opts.window_left = window_left;
  opts.softcap = softcap;
  reference::Sequence seq;
  seq.seqlen_q = nq;
  seq.seqlen_k = n;
  std::vector<double> dout_ref;
  for (int64_t x = 0; x < nq * heads * dim; ++x) {
    seq.q.push_back(get(q, x));
    dout_ref.push_back(get(dout, x));
  }
  for (int64_t x = 0; x < n * dim; ++x) {
    seq.k.push_back(get(k, x));
    seq.v.push_back(get(v, x));
  }
  const reference::Gradients ref = reference::backward({heads, 1, dim, dim}, opts, seq, dout_ref);
  const double tol = dtype == FLARE_DTYPE_F32 ? 1e-4 : 3e-2;
  expect_rows_match("dq", ref.dq, nq * heads, dim, [&](int64_t r, int64_t c) { return get(dq, r * dim + c); }, tol,
                    clean_rows);
  expect_rows_match("dk", ref.dk, n, dim, [&](int64_t r, int64_t c) { return get(dk, r * dim + c); }, tol, 0);
  expect_rows_match("dv", ref.dv, n, dim, [&](int64_t r, int64_t c) { return get(dv, r * dim + c); }, tol, 0);
}

TEST(UnseenValues, BackwardCausalMaskedKeys) {
  for (flare_dtype dtype : kDtypes) {
    dense_backward_case(dtype, 1, -1, 0.0f, 150, kNaN, 1.0, 2 * 150);   // NaN in V: rows 0..149 cannot see key 150
    dense_backward_case(dtype, 1, -1, 0.0f, 200, 1.0, kNaN, 2 * 200);   // NaN in K
    dense_backward_case(dtype, 1, -1, 0.0f, 200, 1.0, kNaN, 2 * 200, 128);  // the bf16 Kᵀ written apart from K
    dense_backward_case(dtype, 1, -1, 0.0f, 299, kInf, -kInf, 2 * 299);  // only the last row sees it
    dense_backward_case(dtype, 1, -1, 30.0f, 100, kNaN, kInf, 2 * 100);  // softcap: the masked tanh is NaN
  }
}

TEST(UnseenValues, BackwardWindowMaskedKeys) {
  for (flare_dtype dtype : kDtypes) {
    dense_backward_case(dtype, 1, 16, 0.0f, 10, kNaN, kNaN, 2 * (10 + 273));  // rows 27.. slid past key 10
    dense_backward_case(dtype, 0, 7, 0.0f, 200, kInf, kInf, 2 * 92);  // non-causal: rows 208.. do not see it
  }
}

// Heads wider than 256: the rows that add a seen key's non-finite values back are as wide as the head.
TEST(UnseenValues, BackwardFewQueries) {
  // Three queries against 300 keys (fp32: the key-at-a-time backward of few_queries.hpp). Causal
  // (bottom-right): row i sees keys 0..297 + i; with a window of 5, keys 292 + i..297 + i.
  for (flare_dtype dtype : {FLARE_DTYPE_F32, FLARE_DTYPE_BF16}) {
    dense_backward_case(dtype, 1, -1, 0.0f, 299, kNaN, 1.0, 2 * 2, 32, 3);    // only row 2 sees key 299
    dense_backward_case(dtype, 1, -1, 30.0f, 298, 1.0, kNaN, 2 * 1, 40, 3);   // rows 1, 2 see key 298
    dense_backward_case(dtype, 1, 5, 0.0f, 100, kInf, kNaN, 2 * 3, 32, 3);    // no row sees key 100
    dense_backward_case(dtype, 1, 5, 0.0f, 291, kNaN, kNaN, 2 * 3, 32, 3);    // nor key 291
  }
}

TEST(UnseenValues, WideHeads) {
  for (flare_dtype dtype : kDtypes) {
    dense_case(dtype, 1, -1, 150, kNaN, kInf, 512);
    dense_backward_case(dtype, 1, 16, 0.0f, 10, kNaN, kNaN, 2 * (10 + 273), 512);
  }
}

}  // namespace
}  // namespace flare::badinput

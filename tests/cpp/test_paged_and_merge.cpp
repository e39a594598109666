// test_paged_and_merge.cpp — the inference entry points' paging and merging: flare_fwd_varlen with a
// block_table gives bit for bit what the same keys give as dense varlen tensors (page sizes 1, 3, 16, 256;
// ragged lengths with empty and full sequences); the KV-cache pass gives the same for paged and dense caches,
// appends included; every split count of the decode path agrees with the unsplit result; flare_merge_states
// against the fp64 reference over the union of the two key sets. Bad block tables write nothing.
#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <string>
#include <vector>

#include "attention_harness.hpp"
#include "flare/flare.hpp"

namespace flare::test {
namespace {

const int64_t kPageSizes[] = {1, 3, 16, 256};

// Copies dense key rows (total_k, nheads_k, d) into a paged cache (num_blocks, page, nheads_k, d) through a
// shuffled block table; unused blocks keep random values.
struct PagedCopy {
  HostTensor k, v, table;
  std::vector<int64_t> blocks;  // row-major (batch, max_blocks)
  int64_t max_blocks = 0;
};

PagedCopy page_keys(const HostTensor& k, const HostTensor& v, const std::vector<int64_t>& starts,
                    const std::vector<int64_t>& lens, int64_t page, Rng& rng) {
  const int64_t batch = static_cast<int64_t>(lens.size());
  const int64_t hk = k.shape()[1], d = k.shape()[2], dv = v.shape()[2];
  PagedCopy pc;
  for (int64_t n : lens) pc.max_blocks = std::max(pc.max_blocks, (n + page - 1) / page);
  pc.max_blocks += 1;  // a spare column no sequence reaches
  const int64_t num_blocks = batch * pc.max_blocks + 2;
  std::vector<int64_t> ids(num_blocks);
  std::iota(ids.begin(), ids.end(), 0);
  std::shuffle(ids.begin(), ids.end(), rng.engine());
  pc.blocks.assign(ids.begin(), ids.begin() + batch * pc.max_blocks);
  pc.k = HostTensor::contiguous(k.dtype(), {num_blocks, page, hk, d});
  pc.v = HostTensor::contiguous(v.dtype(), {num_blocks, page, hk, dv});
  pc.k.fill_normal(rng);
  pc.v.fill_normal(rng);
  const std::vector<double> kv = k.values(), vv = v.values();
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t j = 0; j < lens[b]; ++j) {
      const int64_t slot = pc.blocks[b * pc.max_blocks + j / page] * page + j % page;
      for (int64_t e = 0; e < hk * d; ++e) pc.k.set(slot * hk * d + e, kv[(starts[b] + j) * hk * d + e]);
      for (int64_t e = 0; e < hk * dv; ++e) pc.v.set(slot * hk * dv + e, vv[(starts[b] + j) * hk * dv + e]);
    }
  pc.table = HostTensor::contiguous(FLARE_DTYPE_I32, {batch, pc.max_blocks});
  for (size_t i = 0; i < pc.blocks.size(); ++i) pc.table.set(static_cast<int64_t>(i), static_cast<double>(pc.blocks[i]));
  return pc;
}

std::vector<int64_t> prefix_sums(const std::vector<int64_t>& lens) {
  std::vector<int64_t> cu(1, 0);
  for (int64_t n : lens) cu.push_back(cu.back() + n);
  return cu;
}

struct VarlenRun {
  std::vector<double> out, lse;
};

// Paged against dense varlen keys, bit for bit, at head dims d / dv for each dtype and page size.
void expect_paged_matches_dense(int64_t d, int64_t dv, const std::vector<flare_dtype>& dtypes,
                                const std::vector<int64_t>& pages) {
  Rng rng;
  const int64_t nheads = 4, nheads_k = 2;
  const std::vector<int64_t> lens_q = {3, 1, 0, 7, 1};
  const std::vector<int64_t> lens_k = {301, 0, 5, 260, 1};  // an empty sequence, and one past a page of 256
  for (flare_dtype dtype : dtypes) {
    const std::vector<int64_t> cu_q = prefix_sums(lens_q), cu_k = prefix_sums(lens_k);
    HostTensor q = HostTensor::contiguous(dtype, {cu_q.back(), nheads, d});
    HostTensor k = HostTensor::contiguous(dtype, {cu_k.back(), nheads_k, d});
    HostTensor v = HostTensor::contiguous(dtype, {cu_k.back(), nheads_k, dv});
    q.fill_normal(rng);
    k.fill_normal(rng);
    v.fill_normal(rng);
    HostTensor cu_q_t = int32_tensor(cu_q), cu_k_t = int32_tensor(cu_k);
    for (bool causal : {false, true}) {
      auto run = [&](const HostTensor& kk, const HostTensor& vv, const HostTensor* table, bool lengths_by_seqused) {
        HostTensor out = HostTensor::contiguous(dtype, {cu_q.back(), nheads, dv});
        HostTensor lse = HostTensor::contiguous(FLARE_DTYPE_F32, {nheads, cu_q.back()});
        out.poison_buffer();
        lse.poison_buffer();
        HostTensor used = int32_tensor(lens_k);
        flare_fwd_params p;
        flare_fwd_params_init(&p);
        p.q = q.view();
        p.k = kk.view();
        p.v = vv.view();
        p.out = out.view();
        p.softmax_lse = lse.view();
        p.cu_seqlens_q = cu_q_t.view();
        if (!lengths_by_seqused || table == nullptr) p.cu_seqlens_k = cu_k_t.view();
        if (lengths_by_seqused) p.seqused_k = used.view();
        if (table != nullptr) p.block_table = table->view();
        p.attn.causal = causal ? 1 : 0;
        VarlenRun r;
        [&] { FLARE_ASSERT_OK(flare_fwd_varlen(&p)); }();
        expect_fully_overwritten(out, "out");
        expect_fully_overwritten(lse, "softmax_lse");
        r.out = out.values();
        r.lse = lse.values();
        return r;
      };
      const VarlenRun dense = run(k, v, nullptr, false);
      for (int64_t page : pages) {
        for (bool by_seqused : {false, true}) {
          SCOPED_TRACE(std::string(dtype_name(dtype)) + " page " + std::to_string(page) + (causal ? " causal" : "") +
                       (by_seqused ? " seqused_k" : " cu_seqlens_k"));
          const PagedCopy pc = page_keys(k, v, std::vector<int64_t>(cu_k.begin(), cu_k.end() - 1), lens_k, page, rng);
          const VarlenRun paged = run(pc.k, pc.v, &pc.table, by_seqused);
          EXPECT_EQ(paged.out, dense.out);
          EXPECT_EQ(paged.lse, dense.lse);
        }
      }
    }
  }
}

TEST(PagedVarlen, MatchesDenseVarlenBitForBit) {
  expect_paged_matches_dense(40, 24, {FLARE_DTYPE_F32, FLARE_DTYPE_BF16, FLARE_DTYPE_F16, FLARE_DTYPE_F64},
                             {std::begin(kPageSizes), std::end(kPageSizes)});
}

TEST(PagedVarlen, WideHeadsMatchDenseVarlen) {
  // The MLA shape (the CPU backend's widest), pages of an odd size.
  expect_paged_matches_dense(576, 512, {FLARE_DTYPE_F32, FLARE_DTYPE_BF16}, {7});
}

// A valid paged varlen call; each test below breaks one rule of it.
struct PagedVarlenCase {
  HostTensor q, k, v, out, lse, cu_q, cu_k, used, table;
  flare_fwd_params p;
  PagedVarlenCase() {
    Rng rng;
    q = HostTensor::contiguous(FLARE_DTYPE_F32, {3, 2, 8});
    k = HostTensor::contiguous(FLARE_DTYPE_F32, {5, 3, 1, 8});  // 5 blocks of 3 keys
    v = HostTensor::contiguous(FLARE_DTYPE_F32, {5, 3, 1, 8});
    q.fill_normal(rng);
    k.fill_normal(rng);
    v.fill_normal(rng);
    out = HostTensor::contiguous(FLARE_DTYPE_F32, {3, 2, 8});
    lse = HostTensor::contiguous(FLARE_DTYPE_F32, {2, 3});
    out.poison_buffer();
    lse.poison_buffer();
    cu_q = int32_tensor({0, 1, 3});
    used = int32_tensor({4, 6});  // 2 blocks each
    table = int32_tensor({4, 0, 2, 1, 3, 2});
    table = HostTensor::view_of(table, 0, {2, 3}, {3, 1});
    flare_fwd_params_init(&p);
    p.q = q.view();
    p.k = k.view();
    p.v = v.view();
    p.out = out.view();
    p.softmax_lse = lse.view();
    p.cu_seqlens_q = cu_q.view();
    p.seqused_k = used.view();
    p.block_table = table.view();
  }
  void expect_rejected(flare_status status, const std::string& words) {
    EXPECT_EQ(flare_fwd_varlen(&p), status);
    EXPECT_NE(std::string(flare_last_error()).find(words), std::string::npos) << flare_last_error();
    EXPECT_EQ(out.nan_in_buffer(), out.buffer_elems()) << "out was written";
    EXPECT_EQ(lse.nan_in_buffer(), lse.buffer_elems()) << "softmax_lse was written";
  }
};

TEST(PagedVarlen, ValidCaseRuns) {
  PagedVarlenCase c;
  FLARE_ASSERT_OK(flare_fwd_varlen(&c.p));
  expect_fully_overwritten(c.out, "out");
}

TEST(PagedVarlen, BadBlockTablesWriteNothing) {
  {
    PagedVarlenCase c;
    c.table.set(4, 5);  // sequence 1, column 1: blocks are 0..4
    c.expect_rejected(FLARE_INVALID_ARGUMENT, "block_table[1][1] is 5");
  }
  {
    PagedVarlenCase c;
    c.table.set(0, -1);
    c.expect_rejected(FLARE_INVALID_ARGUMENT, "block_table[0][0] is -1");
  }
  {
    PagedVarlenCase c;  // column 2 is past both sequences' keys: never read, so any value is fine
    c.table.set(2, -7);
    EXPECT_EQ(flare_fwd_varlen(&c.p), FLARE_OK) << flare_last_error();
  }
  {
    PagedVarlenCase c;
    c.used.set(1, 10);  // 10 keys, 3 columns of 3
    c.expect_rejected(FLARE_INVALID_ARGUMENT, "sequence 1 has 10 keys but block_table has 3 columns of 3");
  }
  {
    PagedVarlenCase c;
    c.p.seqused_k = flare_tensor{};
    c.expect_rejected(FLARE_INVALID_ARGUMENT, "cu_seqlens_k and seqused_k are both absent");
  }
  {
    PagedVarlenCase c;
    c.p.k.rank = 3;
    c.expect_rejected(FLARE_INVALID_ARGUMENT, "paged cache (num_blocks, block_size, nheads_k, headdim): rank 4");
  }
  {
    PagedVarlenCase c;
    c.p.block_table.shape[0] = 3;
    c.expect_rejected(FLARE_INVALID_ARGUMENT, "block_table has shape (3, 3)");
  }
  {
    PagedVarlenCase c;  // an older caller's struct ends before block_table: it is not read
    c.p.struct_size = offsetof(flare_fwd_params, block_table);
    c.expect_rejected(FLARE_INVALID_ARGUMENT, "takes k as (total_k, nheads_k, headdim): rank 3");
  }
  {
    PagedVarlenCase c;
    for (flare_tensor* t : {&c.p.q, &c.p.k, &c.p.v, &c.p.out, &c.p.softmax_lse, &c.p.cu_seqlens_q, &c.p.seqused_k,
                            &c.p.block_table})
      t->device = {FLARE_DEVICE_CUDA, 0};
    c.expect_rejected(FLARE_UNSUPPORTED, "");
  }
}

TEST(PagedVarlen, DenseEntryRefusesBlockTable) {
  HostTensor q = HostTensor::contiguous(FLARE_DTYPE_F32, {1, 2, 1, 8});
  HostTensor out = HostTensor::contiguous(FLARE_DTYPE_F32, {1, 2, 1, 8});
  HostTensor table = int32_tensor({0});
  Rng rng;
  q.fill_normal(rng);
  flare_fwd_params p;
  flare_fwd_params_init(&p);
  p.q = p.k = p.v = q.view();
  p.out = out.view();
  p.block_table = table.view();
  EXPECT_EQ(flare_fwd(&p), FLARE_INVALID_ARGUMENT);
  EXPECT_NE(std::string(flare_last_error()).find("block_table"), std::string::npos) << flare_last_error();
}

// ---- the KV-cache pass: paged and dense caches, split counts -------------------------------------------

struct KvRun {
  std::vector<double> out, lse, k_cache, v_cache;  // the caches as (batch, capacity, ...) rows
};

struct KvSetup {
  flare_dtype dtype;
  int64_t batch, capacity, seqlen_q, nheads, nheads_k, d, dv, seqlen_new;
  std::vector<int64_t> cache_len;
  bool causal = false;
};

// One flare_fwd_kvcache call on a dense cache, or (page > 0) on the same cache paged; the caches read back
// densely afterwards. Inputs come from a fresh Rng with `seed`, so both layouts see the same numbers.
KvRun run_kvcache(const KvSetup& s, int64_t page, int32_t num_splits, uint32_t seed) {
  Rng rng(seed);
  HostTensor q = HostTensor::contiguous(s.dtype, {s.batch, s.seqlen_q, s.nheads, s.d});
  HostTensor kc = HostTensor::contiguous(s.dtype, {s.batch, s.capacity, s.nheads_k, s.d});
  HostTensor vc = HostTensor::contiguous(s.dtype, {s.batch, s.capacity, s.nheads_k, s.dv});
  HostTensor kn = HostTensor::contiguous(s.dtype, {s.batch, s.seqlen_new, s.nheads_k, s.d});
  HostTensor vn = HostTensor::contiguous(s.dtype, {s.batch, s.seqlen_new, s.nheads_k, s.dv});
  for (HostTensor* t : {&q, &kc, &vc, &kn, &vn}) t->fill_normal(rng);
  HostTensor out = HostTensor::contiguous(s.dtype, {s.batch, s.seqlen_q, s.nheads, s.dv});
  HostTensor lse = HostTensor::contiguous(FLARE_DTYPE_F32, {s.batch, s.nheads, s.seqlen_q});
  out.poison_buffer();
  lse.poison_buffer();
  HostTensor seqlens = int32_tensor(s.cache_len);
  flare_kvcache_params p;
  flare_kvcache_params_init(&p);
  p.q = q.view();
  p.k_new = s.seqlen_new ? kn.view() : flare_tensor{};
  p.v_new = s.seqlen_new ? vn.view() : flare_tensor{};
  p.cache_seqlens = seqlens.view();
  p.out = out.view();
  p.softmax_lse = lse.view();
  p.attn.causal = s.causal ? 1 : 0;
  p.num_splits = num_splits;
  PagedCopy pc;
  if (page > 0) {
    const HostTensor k_rows = HostTensor::view_of(kc, 0, {s.batch * s.capacity, s.nheads_k, s.d}, {s.nheads_k * s.d, s.d, 1});
    const HostTensor v_rows = HostTensor::view_of(vc, 0, {s.batch * s.capacity, s.nheads_k, s.dv}, {s.nheads_k * s.dv, s.dv, 1});
    std::vector<int64_t> starts(s.batch), lens(s.batch, s.capacity);
    for (int64_t b = 0; b < s.batch; ++b) starts[b] = b * s.capacity;
    pc = page_keys(k_rows, v_rows, starts, lens, page, rng);
    p.k_cache = pc.k.view();
    p.v_cache = pc.v.view();
    p.block_table = pc.table.view();
  } else {
    p.k_cache = kc.view();
    p.v_cache = vc.view();
  }
  KvRun r;
  [&] { FLARE_ASSERT_OK(flare_fwd_kvcache(&p)); }();
  expect_fully_overwritten(out, "out");
  expect_fully_overwritten(lse, "softmax_lse");
  r.out = out.values();
  r.lse = lse.values();
  if (page > 0) {
    const std::vector<double> pk = pc.k.values(), pv = pc.v.values();
    for (int64_t b = 0; b < s.batch; ++b)
      for (int64_t j = 0; j < s.capacity; ++j) {
        const int64_t slot = pc.blocks[b * pc.max_blocks + j / page] * page + j % page;
        r.k_cache.insert(r.k_cache.end(), pk.begin() + slot * s.nheads_k * s.d, pk.begin() + (slot + 1) * s.nheads_k * s.d);
        r.v_cache.insert(r.v_cache.end(), pv.begin() + slot * s.nheads_k * s.dv, pv.begin() + (slot + 1) * s.nheads_k * s.dv);
      }
  } else {
    r.k_cache = kc.values();
    r.v_cache = vc.values();
  }
  return r;
}

TEST(KvCachePaging, PagedMatchesDenseBitForBit) {
  const uint32_t seed = fresh_seed();
  SCOPED_TRACE(seed_message(seed));
  for (flare_dtype dtype : {FLARE_DTYPE_F32, FLARE_DTYPE_BF16, FLARE_DTYPE_F16}) {
    for (int64_t seqlen_q : {1, 3}) {
      // Ragged: an empty cache, one filled to the brim by the append, and appends that cross pages.
      KvSetup s{dtype, 4, 517, seqlen_q, 8, 2, 64, 48, 4, {0, 513, 254, 130}, seqlen_q > 1};
      const KvRun dense = run_kvcache(s, 0, 0, seed);
      for (int64_t page : kPageSizes) {
        SCOPED_TRACE(std::string(dtype_name(dtype)) + " seqlen_q " + std::to_string(seqlen_q) + " page " +
                     std::to_string(page));
        const KvRun paged = run_kvcache(s, page, 0, seed);
        EXPECT_EQ(paged.out, dense.out);
        EXPECT_EQ(paged.lse, dense.lse);
        EXPECT_EQ(paged.k_cache, dense.k_cache) << "the appended keys landed elsewhere";
        EXPECT_EQ(paged.v_cache, dense.v_cache) << "the appended values landed elsewhere";
      }
    }
  }
}

TEST(KvCacheSplits, EverySplitCountMatchesUnsplit) {
  const uint32_t seed = fresh_seed();
  SCOPED_TRACE(seed_message(seed));
  for (flare_dtype dtype : {FLARE_DTYPE_F32, FLARE_DTYPE_BF16}) {
    for (int64_t page : {int64_t{0}, int64_t{16}}) {
      KvSetup s{dtype, 2, 1201, 2, 8, 2, 128, 128, 1, {1199, 37}, true};
      const KvRun unsplit = run_kvcache(s, page, 1, seed);
      for (int32_t splits : {2, 3, 4, 7, 16, 64, 0}) {
        SCOPED_TRACE(std::string(dtype_name(dtype)) + " page " + std::to_string(page) + " num_splits " +
                     std::to_string(splits));
        const KvRun split = run_kvcache(s, page, splits, seed);
        // The merge is exact in real arithmetic; fp32 rounding of the partial results and of their weights
        // differs from the unsplit sums by a few units, and the stored output by one step of its dtype.
        const ErrorStats out_err = compare(split.out, unsplit.out), lse_err = compare(split.lse, unsplit.lse);
        const double out_tol = (2 * unit_roundoff(dtype) + 32 * unit_roundoff(FLARE_DTYPE_F32)) * std::max(1.0, out_err.max_ref);
        EXPECT_EQ(out_err.bad, 0);
        EXPECT_LE(out_err.max_error, out_tol) << describe(out_err, split.out, unsplit.out);
        EXPECT_LE(lse_err.max_error, 32 * unit_roundoff(FLARE_DTYPE_F32) * std::max(1.0, lse_err.max_ref))
            << describe(lse_err, split.lse, unsplit.lse);
        EXPECT_EQ(split.k_cache, unsplit.k_cache);
      }
    }
  }
}

// ---- flare_merge_states -------------------------------------------------------------------------------

// The params of one merge (lse optional).
flare_merge_params merge_params(const HostTensor& oa, const HostTensor& la, const HostTensor& ob, const HostTensor& lb,
                                const HostTensor& out, const HostTensor* lse) {
  flare_merge_params p;
  flare_merge_params_init(&p);
  p.out_a = oa.view();
  p.lse_a = la.view();
  p.out_b = ob.view();
  p.lse_b = lb.view();
  p.out = out.view();
  if (lse != nullptr) p.lse = lse->view();
  return p;
}

TEST(MergeStates, MatchesReferenceOverTheUnionOfKeys) {
  Rng rng;
  const int64_t seqlen = 3, nheads = 3, nheads_k = 1, d = 16, dv = 20;
  // Per batch row: keys in part A and in part B (an empty part, and both empty: out 0, lse -inf).
  const std::vector<int64_t> n_a = {7, 0, 0, 41}, n_b = {5, 9, 0, 1};
  const int64_t batch = static_cast<int64_t>(n_a.size());
  const reference::Dims dims{nheads, nheads_k, d, dv};
  reference::Options opts;
  opts.softmax_scale = 0.3;
  std::vector<double> ra_out, ra_lse, rb_out, rb_lse, ru_out, ru_lse;
  for (int64_t b = 0; b < batch; ++b) {
    auto normal = [&](int64_t n) {
      std::vector<double> x(n);
      for (double& e : x) e = rng.normal();
      return x;
    };
    const std::vector<double> q = normal(seqlen * nheads * d);
    const std::vector<double> ka = normal(n_a[b] * nheads_k * d), va = normal(n_a[b] * nheads_k * dv);
    const std::vector<double> kb = normal(n_b[b] * nheads_k * d), vb = normal(n_b[b] * nheads_k * dv);
    std::vector<double> ku = ka, vu = va;
    ku.insert(ku.end(), kb.begin(), kb.end());
    vu.insert(vu.end(), vb.begin(), vb.end());
    const auto a = reference::forward(dims, opts, {seqlen, n_a[b], q, ka, va});
    const auto bb = reference::forward(dims, opts, {seqlen, n_b[b], q, kb, vb});
    const auto u = reference::forward(dims, opts, {seqlen, n_a[b] + n_b[b], q, ku, vu});
    for (auto [dst, src] : {std::pair{&ra_out, &a.out}, {&ra_lse, &a.lse}, {&rb_out, &bb.out}, {&rb_lse, &bb.lse},
                            {&ru_out, &u.out}, {&ru_lse, &u.lse}})
      dst->insert(dst->end(), src->begin(), src->end());
  }
  for (flare_dtype dtype : {FLARE_DTYPE_F32, FLARE_DTYPE_BF16, FLARE_DTYPE_F16, FLARE_DTYPE_F64}) {
    for (bool in_place : {false, true}) {
      SCOPED_TRACE(std::string(dtype_name(dtype)) + (in_place ? " in place" : ""));
      HostTensor oa = HostTensor::scattered(dtype, {batch, seqlen, nheads, dv}, rng);
      HostTensor ob = HostTensor::contiguous(dtype, {batch, seqlen, nheads, dv});
      HostTensor la = HostTensor::contiguous(FLARE_DTYPE_F32, {batch, nheads, seqlen});
      HostTensor lb = HostTensor::scattered(FLARE_DTYPE_F32, {batch, nheads, seqlen}, rng);
      oa.assign(ra_out);
      ob.assign(rb_out);
      la.assign(ra_lse);
      lb.assign(rb_lse);
      HostTensor out = in_place ? oa : HostTensor::contiguous(dtype, {batch, seqlen, nheads, dv});
      HostTensor lse = HostTensor::contiguous(FLARE_DTYPE_F32, {batch, nheads, seqlen});
      if (!in_place) out.poison_buffer();
      lse.poison_buffer();
      flare_merge_params p = merge_params(oa, la, ob, lb, out, &lse);
      FLARE_ASSERT_OK(flare_merge_states(&p));
      if (!in_place) expect_fully_overwritten(out, "out");
      expect_fully_overwritten(lse, "lse");
      // Allowance: the inputs and the output rounded to the dtype, the lse to fp32 (whatever the dtype: its
      // rounding, times |lse|, moves the weights), fp32 arithmetic, and one unit in the output's last place (as
      // attention_harness.hpp's rule has it: the merge of two rounded inputs, rounded again, can land on the
      // neighbour of the reference's rounding; FLARE_TEST_SEED=2903725851 at fp16 did, by 1.3 units).
      std::vector<double> rounded(ru_out);
      for (double& x : rounded) x = round_to(dtype, x);
      const double naive = compare(rounded, ru_out).max_error;
      const double compute = 64 * unit_roundoff(FLARE_DTYPE_F32);
      const std::vector<double> got = out.values();
      const ErrorStats err = compare(got, ru_out);
      const double ulp = 2 * unit_roundoff(dtype);
      EXPECT_EQ(err.bad, 0) << describe(err, got, ru_out);
      EXPECT_LE(err.max_error, 3 * naive + (compute + ulp) * std::max(1.0, err.max_ref)) << describe(err, got, ru_out);
      const std::vector<double> got_lse = lse.values();
      for (size_t i = 0; i < got_lse.size(); ++i) {
        if (std::isinf(ru_lse[i])) {
          EXPECT_EQ(got_lse[i], ru_lse[i]) << "lse " << i;
        } else {
          EXPECT_NEAR(got_lse[i], ru_lse[i], 8 * unit_roundoff(FLARE_DTYPE_F32) * std::max(1.0, std::abs(ru_lse[i])));
        }
      }
    }
  }
}

TEST(MergeStates, VarlenLayoutAndBadInput) {
  Rng rng;
  HostTensor oa = HostTensor::contiguous(FLARE_DTYPE_BF16, {5, 2, 8}), ob = HostTensor::contiguous(FLARE_DTYPE_BF16, {5, 2, 8});
  HostTensor la = HostTensor::contiguous(FLARE_DTYPE_F32, {2, 5}), lb = HostTensor::contiguous(FLARE_DTYPE_F32, {2, 5});
  for (HostTensor* t : {&oa, &ob, &la, &lb}) t->fill_normal(rng);
  HostTensor out = HostTensor::contiguous(FLARE_DTYPE_BF16, {5, 2, 8});
  HostTensor lse = HostTensor::contiguous(FLARE_DTYPE_F32, {2, 5});
  out.poison_buffer();
  lse.poison_buffer();
  flare_merge_params p = merge_params(oa, la, ob, lb, out, &lse);
  auto rejected = [&](flare_status status, const char* words) {
    EXPECT_EQ(flare_merge_states(&p), status);
    EXPECT_NE(std::string(flare_last_error()).find(words), std::string::npos) << flare_last_error();
    EXPECT_EQ(out.nan_in_buffer(), out.buffer_elems()) << "out was written";
    EXPECT_EQ(lse.nan_in_buffer(), lse.buffer_elems()) << "lse was written";
  };
  p.lse_b.shape[1] = 4;
  rejected(FLARE_INVALID_ARGUMENT, "lse_b has shape (2, 4)");
  p.lse_b = lb.view();
  p.out_b.dtype = FLARE_DTYPE_F16;
  rejected(FLARE_INVALID_ARGUMENT, "out_b.dtype is F16");
  p.out_b = ob.view();
  p.lse_a = flare_tensor{};
  rejected(FLARE_INVALID_ARGUMENT, "lse_a is absent");
  p.lse_a = la.view();
  for (flare_tensor* t : {&p.out_a, &p.lse_a, &p.out_b, &p.lse_b, &p.out, &p.lse}) t->device = {FLARE_DEVICE_CUDA, 0};
  rejected(FLARE_UNSUPPORTED, "CPU only");
  for (flare_tensor* t : {&p.out_a, &p.lse_a, &p.out_b, &p.lse_b, &p.out, &p.lse}) t->device = {FLARE_DEVICE_CPU, 0};
  FLARE_ASSERT_OK(flare_merge_states(&p));
  expect_fully_overwritten(out, "out");
  // Row by row: out = (e^la oa + e^lb ob) / (e^la + e^lb), rounded to bf16 once.
  const std::vector<double> a = oa.values(), b = ob.values(), ra = la.values(), rb = lb.values(), got = out.values();
  for (int64_t t = 0; t < 5; ++t)
    for (int64_t h = 0; h < 2; ++h) {
      const double m = std::max(ra[h * 5 + t], rb[h * 5 + t]);
      const double wa = std::exp(ra[h * 5 + t] - m), wb = std::exp(rb[h * 5 + t] - m);
      for (int64_t c = 0; c < 8; ++c) {
        const int64_t i = (t * 2 + h) * 8 + c;
        const double want = (wa * a[i] + wb * b[i]) / (wa + wb);
        EXPECT_NEAR(got[i], want, 2 * unit_roundoff(FLARE_DTYPE_BF16) * std::max(1.0, std::abs(want)) + 1e-6);
      }
    }
}

TEST(MergeStates, CppApiIsTheCAbi) {
  Rng rng;
  HostTensor oa = HostTensor::contiguous(FLARE_DTYPE_F32, {2, 3, 2, 5}), ob = HostTensor::contiguous(FLARE_DTYPE_F32, {2, 3, 2, 5});
  HostTensor la = HostTensor::contiguous(FLARE_DTYPE_F32, {2, 2, 3}), lb = HostTensor::contiguous(FLARE_DTYPE_F32, {2, 2, 3});
  for (HostTensor* t : {&oa, &ob, &la, &lb}) t->fill_normal(rng);
  HostTensor c_out = HostTensor::contiguous(FLARE_DTYPE_F32, {2, 3, 2, 5}), cpp_out = HostTensor::contiguous(FLARE_DTYPE_F32, {2, 3, 2, 5});
  flare_merge_params p = merge_params(oa, la, ob, lb, c_out, nullptr);
  FLARE_ASSERT_OK(flare_merge_states(&p));
  const auto v = [](const HostTensor& t) { return flare::TensorView::from_c(t.view()); };
  flare::merge_states(v(oa), v(la), v(ob), v(lb), v(cpp_out));
  EXPECT_EQ(cpp_out.values(), c_out.values());
  HostTensor bad = HostTensor::contiguous(FLARE_DTYPE_F32, {2, 3, 2, 4});
  try {
    flare::merge_states(v(oa), v(la), v(ob), v(lb), v(bad));
    ADD_FAILURE() << "a wrong out shape was accepted";
  } catch (const flare::Error& e) {
    EXPECT_EQ(e.status(), FLARE_INVALID_ARGUMENT);
  }
}

TEST(PagedVarlen, CppApiTakesBlockTable) {
  PagedVarlenCase c;
  HostTensor out2 = HostTensor::contiguous(FLARE_DTYPE_F32, {3, 2, 8});
  FLARE_ASSERT_OK(flare_fwd_varlen(&c.p));
  flare::Varlen varlen;
  varlen.cu_seqlens_q = flare::TensorView::from_c(c.cu_q.view());
  varlen.seqused_k = flare::TensorView::from_c(c.used.view());
  varlen.block_table = flare::TensorView::from_c(c.table.view());
  flare::forward_varlen(flare::TensorView::from_c(c.q.view()), flare::TensorView::from_c(c.k.view()),
                        flare::TensorView::from_c(c.v.view()), flare::TensorView::from_c(out2.view()), varlen);
  EXPECT_EQ(out2.values(), c.out.values());
}

}  // namespace
}  // namespace flare::test

// test_kvcache.cpp — flare_fwd_kvcache against reference::kvcache: dense and paged caches (shuffled
// block tables), cache_batch_idx, cache_leftpad, appending k_new/v_new (and the cache contents after),
// rotary in both styles, decode (seqlen_q = 1) and seqlen_q > 1 with causal, plus the masking options.
#include <algorithm>
#include <numeric>
#include <utility>
#include <vector>

#include "attention_harness.hpp"

namespace flare::test {
namespace {

struct KvCase {
  flare_dtype dtype = FLARE_DTYPE_F32;
  int64_t batch = 2, seqlen_q = 1, nheads = 4, nheads_k = 2, headdim = 64, headdim_v = 64;
  int64_t capacity = 96;       // key slots per sequence (paged: max_blocks * block_size)
  int64_t block_size = 0;      // 0 = dense cache
  bool batch_idx = false;      // dense: the cache has more rows than the batch, picked by cache_batch_idx
  bool leftpad = false;
  bool cache_seqlens = true;   // absent = every sequence's cache is full (then nothing can be appended)
  int64_t seqlen_new = 0;
  int64_t rotary_dim = 0;
  bool interleaved = false;
  bool causal = false;
  int32_t window_left = -1, window_right = -1;
  float softcap = 0.0f;
  AlibiMode alibi = AlibiMode::kNone;
  bool with_lse = true;
  bool strided = false;  // q, k_new, v_new, out and the cache with permuted, padded strides
  int32_t num_splits = 0;  // split-KV parts of the decode path (0: its heuristic)
  bool sinks = false;      // learnable sinks, one random logit per query head

  std::string describe() const {
    std::string s = std::string(dtype_name(dtype)) + " batch=" + std::to_string(batch) + " seqlen_q=" +
                    std::to_string(seqlen_q) + " heads=" + std::to_string(nheads) + "/" + std::to_string(nheads_k) +
                    " headdim=" + std::to_string(headdim) + "/" + std::to_string(headdim_v) + " capacity=" +
                    std::to_string(capacity);
    s += block_size ? " paged(block " + std::to_string(block_size) + ")" : " dense";
    if (batch_idx) s += " cache_batch_idx";
    if (leftpad) s += " leftpad";
    if (!cache_seqlens) s += " no-cache_seqlens";
    if (seqlen_new) s += " new=" + std::to_string(seqlen_new);
    if (rotary_dim) s += " rotary=" + std::to_string(rotary_dim) + (interleaved ? "(interleaved)" : "(halves)");
    if (causal) s += " causal";
    if (window_left >= 0 || window_right >= 0)
      s += " window=(" + std::to_string(window_left) + "," + std::to_string(window_right) + ")";
    if (softcap) s += " softcap=" + std::to_string(softcap);
    if (alibi != AlibiMode::kNone) s += alibi == AlibiMode::kPerHead ? " alibi(h)" : " alibi(b,h)";
    if (strided) s += " strided";
    if (num_splits) s += " num_splits=" + std::to_string(num_splits);
    if (sinks) s += " sinks";
    return s;
  }
};

HostTensor make_tensor(bool strided, flare_dtype dtype, std::vector<int64_t> shape, Rng& rng) {
  return strided ? HostTensor::scattered(dtype, std::move(shape), rng) : HostTensor::contiguous(dtype, std::move(shape));
}

void check_kvcache(const KvCase& c, Rng& rng, double fp32_tol = 1e-5) {
  SCOPED_TRACE("kvcache " + c.describe());
  const bool paged = c.block_size > 0;
  const int64_t max_blocks = paged ? c.capacity / c.block_size : 0;
  const int64_t num_blocks = c.batch * max_blocks + 3;  // a few blocks no sequence uses
  const int64_t cache_rows = c.batch_idx ? c.batch + 2 : c.batch;

  // Per sequence: keys already cached and left padding.
  std::vector<int64_t> cache_len(c.batch), leftpad(c.batch, 0), row_of(c.batch);
  for (int64_t b = 0; b < c.batch; ++b) {
    cache_len[b] = c.cache_seqlens ? rng.integer(0, c.capacity - c.seqlen_new) : c.capacity;
    if (c.leftpad) leftpad[b] = rng.integer(0, cache_len[b]);
  }
  if (c.cache_seqlens && c.batch > 1) cache_len[1] = c.capacity - c.seqlen_new;  // one cache filled to the brim
  std::vector<int64_t> rows(cache_rows);
  std::iota(rows.begin(), rows.end(), 0);
  std::shuffle(rows.begin(), rows.end(), rng.engine());
  for (int64_t b = 0; b < c.batch; ++b) row_of[b] = c.batch_idx ? rows[b] : b;
  std::vector<int64_t> table(c.batch * max_blocks);
  {
    std::vector<int64_t> blocks(num_blocks);
    std::iota(blocks.begin(), blocks.end(), 0);
    std::shuffle(blocks.begin(), blocks.end(), rng.engine());
    std::copy(blocks.begin(), blocks.begin() + static_cast<int64_t>(table.size()), table.begin());
  }

  // Tensors.
  const std::vector<int64_t> kshape = paged ? std::vector<int64_t>{num_blocks, c.block_size, c.nheads_k, c.headdim}
                                            : std::vector<int64_t>{cache_rows, c.capacity, c.nheads_k, c.headdim};
  std::vector<int64_t> vshape = kshape;
  vshape[3] = c.headdim_v;
  HostTensor q = make_tensor(c.strided, c.dtype, {c.batch, c.seqlen_q, c.nheads, c.headdim}, rng);
  HostTensor k_cache = make_tensor(c.strided, c.dtype, kshape, rng);
  HostTensor v_cache = make_tensor(c.strided, c.dtype, vshape, rng);
  const std::vector<double> qv = q.fill_normal(rng);
  const std::vector<double> k_before = k_cache.fill_normal(rng);
  const std::vector<double> v_before = v_cache.fill_normal(rng);
  HostTensor k_new, v_new;
  std::vector<double> knv, vnv;
  if (c.seqlen_new > 0) {
    k_new = make_tensor(c.strided, c.dtype, {c.batch, c.seqlen_new, c.nheads_k, c.headdim}, rng);
    v_new = make_tensor(c.strided, c.dtype, {c.batch, c.seqlen_new, c.nheads_k, c.headdim_v}, rng);
    knv = k_new.fill_normal(rng);
    vnv = v_new.fill_normal(rng);
  }
  reference::Rotary rotary;
  HostTensor cos_t, sin_t;
  if (c.rotary_dim > 0) {
    const int64_t half = c.rotary_dim / 2, seqlen_ro = c.capacity + c.seqlen_q;
    cos_t = HostTensor::contiguous(c.dtype, {seqlen_ro, half});
    sin_t = HostTensor::contiguous(c.dtype, {seqlen_ro, half});
    std::vector<double> cs, sn;
    for (int64_t pos = 0; pos < seqlen_ro; ++pos)
      for (int64_t i = 0; i < half; ++i) {
        const double angle = pos * std::pow(10000.0, -static_cast<double>(i) / half);
        cs.push_back(std::cos(angle));
        sn.push_back(std::sin(angle));
      }
    rotary = {c.rotary_dim, c.interleaved, seqlen_ro, cos_t.assign(cs), sin_t.assign(sn)};
  }
  std::vector<double> slopes;
  HostTensor alibi;
  if (c.alibi != AlibiMode::kNone) {
    const bool per_batch = c.alibi == AlibiMode::kPerBatchHead;
    alibi = per_batch ? HostTensor::contiguous(FLARE_DTYPE_F32, {c.batch, c.nheads})
                      : HostTensor::contiguous(FLARE_DTYPE_F32, {c.nheads});
    std::vector<double> raw(alibi.numel());
    for (double& s : raw) s = rng.uniform(0.0, 0.5);
    const std::vector<double> stored = alibi.assign(raw);
    for (int64_t b = 0; b < c.batch; ++b)
      for (int64_t h = 0; h < c.nheads; ++h) slopes.push_back(stored[(per_batch ? b * c.nheads : 0) + h]);
  }
  HostTensor sinks_t;
  std::vector<double> sinks;
  if (c.sinks) {
    sinks_t = HostTensor::contiguous(FLARE_DTYPE_F32, {c.nheads});
    std::vector<double> raw(c.nheads);
    for (double& s : raw) s = rng.uniform(-1.0, 4.0);
    sinks = sinks_t.assign(raw);
  }
  HostTensor out = make_tensor(c.strided, c.dtype, {c.batch, c.seqlen_q, c.nheads, c.headdim_v}, rng);
  HostTensor lse;
  if (c.with_lse) lse = make_tensor(c.strided, FLARE_DTYPE_F32, {c.batch, c.nheads, c.seqlen_q}, rng);
  out.poison_buffer();
  if (lse.present()) lse.poison_buffer();
  HostTensor seqlens_t = int32_tensor(cache_len), batch_idx_t = int32_tensor(row_of), leftpad_t = int32_tensor(leftpad);
  HostTensor table_t = HostTensor::contiguous(FLARE_DTYPE_I32, {c.batch, max_blocks});
  for (size_t i = 0; i < table.size(); ++i) table_t.set(static_cast<int64_t>(i), static_cast<double>(table[i]));

  flare_kvcache_params p;
  flare_kvcache_params_init(&p);
  p.q = q.view();
  p.k_cache = k_cache.view();
  p.v_cache = v_cache.view();
  p.k_new = k_new.view();
  p.v_new = v_new.view();
  if (c.cache_seqlens) p.cache_seqlens = seqlens_t.view();
  if (c.batch_idx) p.cache_batch_idx = batch_idx_t.view();
  if (c.leftpad) p.cache_leftpad = leftpad_t.view();
  if (paged) p.block_table = table_t.view();
  p.rotary_cos = cos_t.view();
  p.rotary_sin = sin_t.view();
  p.rotary_interleaved = c.interleaved ? 1 : 0;
  p.num_splits = c.num_splits;
  p.out = out.view();
  p.softmax_lse = lse.view();
  // An explicit fp32 scale, so that the fp64 reference uses the very number flare does.
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(c.headdim)));
  p.attn.softmax_scale = scale;
  p.attn.softcap = c.softcap;
  p.attn.causal = c.causal ? 1 : 0;
  p.attn.window_left = c.window_left;
  p.attn.window_right = c.window_right;
  p.attn.alibi_slopes = alibi.view();
  p.sinks = sinks_t.view();
  FLARE_ASSERT_OK(flare_fwd_kvcache(&p));
  expect_fully_overwritten(out, "out");
  if (lse.present()) expect_fully_overwritten(lse, "softmax_lse");

  // Row-major index of (sequence b, slot s, kv head 0, dim 0) in the cache tensors, per head width.
  auto slot_base = [&](int64_t b, int64_t s, int64_t width) {
    const int64_t row = paged ? table[b * max_blocks + s / c.block_size] * c.block_size + s % c.block_size
                              : row_of[b] * c.capacity + s;
    return row * c.nheads_k * width;
  };
  const int64_t krow = c.nheads_k * c.headdim, vrow = c.nheads_k * c.headdim_v;
  const int64_t qrow = c.nheads * c.headdim;
  const std::vector<double> k_after = k_cache.values(), v_after = v_cache.values();
  std::vector<bool> k_may_change(k_after.size(), false), v_may_change(v_after.size(), false);

  std::vector<double> ref_out, naive_out, ref_lse, naive_lse, ref_k_new, got_k_new, ref_v_new, got_v_new;
  const reference::Dims dims{c.nheads, c.nheads_k, c.headdim, c.headdim_v};
  for (int64_t b = 0; b < c.batch; ++b) {
    reference::KvCacheSequence seq;
    seq.seqlen_q = c.seqlen_q;
    seq.q.assign(qv.begin() + b * c.seqlen_q * qrow, qv.begin() + (b + 1) * c.seqlen_q * qrow);
    seq.capacity = c.capacity;
    for (int64_t s = 0; s < c.capacity; ++s) {
      const int64_t kb = slot_base(b, s, c.headdim), vb = slot_base(b, s, c.headdim_v);
      seq.k_cache.insert(seq.k_cache.end(), k_before.begin() + kb, k_before.begin() + kb + krow);
      seq.v_cache.insert(seq.v_cache.end(), v_before.begin() + vb, v_before.begin() + vb + vrow);
    }
    seq.cache_len = cache_len[b];
    seq.leftpad = leftpad[b];
    seq.seqlen_new = c.seqlen_new;
    if (c.seqlen_new > 0) {
      seq.k_new.assign(knv.begin() + b * c.seqlen_new * krow, knv.begin() + (b + 1) * c.seqlen_new * krow);
      seq.v_new.assign(vnv.begin() + b * c.seqlen_new * vrow, vnv.begin() + (b + 1) * c.seqlen_new * vrow);
    }
    reference::Options o;
    o.softmax_scale = scale;
    o.softcap = c.softcap;
    o.causal = c.causal;
    o.window_left = c.window_left;
    o.window_right = c.window_right;
    if (!slopes.empty()) o.alibi_slopes.assign(slopes.begin() + b * c.nheads, slopes.begin() + (b + 1) * c.nheads);
    o.sinks = sinks;

    reference::KvCacheSequence naive_seq = seq;
    const auto r = reference::kvcache(dims, o, rotary, seq);
    ref_out.insert(ref_out.end(), r.out.begin(), r.out.end());
    ref_lse.insert(ref_lse.end(), r.lse.begin(), r.lse.end());
    if (is_low_precision(c.dtype)) {
      const auto n = reference::kvcache(dims, o, rotary, naive_seq, rounding_of(c.dtype));
      naive_out.insert(naive_out.end(), n.out.begin(), n.out.end());
      naive_lse.insert(naive_lse.end(), n.lse.begin(), n.lse.end());
    }
    for (int64_t s = cache_len[b]; s < cache_len[b] + c.seqlen_new; ++s) {
      const int64_t kb = slot_base(b, s, c.headdim), vb = slot_base(b, s, c.headdim_v);
      for (int64_t e = 0; e < krow; ++e) {
        k_may_change[kb + e] = true;
        ref_k_new.push_back(seq.k_cache[s * krow + e]);
        got_k_new.push_back(k_after[kb + e]);
      }
      for (int64_t e = 0; e < vrow; ++e) {
        v_may_change[vb + e] = true;
        ref_v_new.push_back(seq.v_cache[s * vrow + e]);
        got_v_new.push_back(v_after[vb + e]);
      }
    }
  }
  using Naive = std::function<std::vector<double>()>;
  const bool low = is_low_precision(c.dtype);
  expect_matches("out", c.dtype, out.values(), ref_out, low ? Naive([&] { return naive_out; }) : nullptr, fp32_tol);
  // lse is fp32, but with rotary its inputs are the rotated q and k_new stored in the dtype: the same-dtype
  // naive result (which rounds them too) is the allowance beyond the fp32 tolerance.
  if (lse.present())
    expect_matches("softmax_lse", FLARE_DTYPE_F32, lse.values(), ref_lse, low ? Naive([&] { return naive_lse; }) : nullptr,
                   lse_tolerance(c.dtype, fp32_tol));

  // The appended rows: v exactly as given; k as given, or rotated (computed in at least fp32, fp64 for fp64
  // inputs, then stored).
  EXPECT_EQ(got_v_new, ref_v_new) << "v_new was not copied into the cache as given";
  const double compute_roundoff = unit_roundoff(c.dtype == FLARE_DTYPE_F64 ? FLARE_DTYPE_F64 : FLARE_DTYPE_F32);
  const double k_tol = c.rotary_dim > 0 ? 2 * unit_roundoff(c.dtype) + 8 * compute_roundoff : 0.0;
  const ErrorStats k_err = compare(got_k_new, ref_k_new);
  EXPECT_LE(k_err.max_error, k_tol * std::max(1.0, k_err.max_ref)) << "appended k: " << describe(k_err, got_k_new, ref_k_new);
  // Everything else in the cache is untouched, bit for bit.
  int64_t k_changed = 0, v_changed = 0;
  for (size_t i = 0; i < k_after.size(); ++i) k_changed += !k_may_change[i] && k_after[i] != k_before[i];
  for (size_t i = 0; i < v_after.size(); ++i) v_changed += !v_may_change[i] && v_after[i] != v_before[i];
  EXPECT_EQ(k_changed, 0) << "k_cache elements outside the appended rows changed";
  EXPECT_EQ(v_changed, 0) << "v_cache elements outside the appended rows changed";
}

const flare_dtype kDtypes[] = {FLARE_DTYPE_F32, FLARE_DTYPE_BF16, FLARE_DTYPE_F16, FLARE_DTYPE_F64};

TEST(KvCache, DenseDecode) {
  Rng rng;
  for (flare_dtype dtype : kDtypes) {
    KvCase c;
    c.dtype = dtype;
    check_kvcache(c, rng);
    c.causal = true;
    c.batch = 3;
    c.nheads = 6;
    c.nheads_k = 1;
    check_kvcache(c, rng);
  }
}

TEST(KvCache, NoCacheSeqlensMeansFull) {
  Rng rng;
  KvCase c;
  c.cache_seqlens = false;
  c.capacity = 77;
  check_kvcache(c, rng);
  c.block_size = 16;
  c.capacity = 80;
  check_kvcache(c, rng);
}

TEST(KvCache, AppendNewKeys) {
  Rng rng;
  for (flare_dtype dtype : kDtypes)
    for (int64_t snew : {1, 5}) {
      KvCase c;
      c.dtype = dtype;
      c.seqlen_new = snew;
      c.seqlen_q = snew;
      c.causal = true;
      check_kvcache(c, rng);
    }
}

TEST(KvCache, CacheBatchIdx) {
  Rng rng;
  for (flare_dtype dtype : kDtypes) {
    KvCase c;
    c.dtype = dtype;
    c.batch = 3;
    c.batch_idx = true;
    c.seqlen_new = 2;
    c.seqlen_q = 2;
    c.causal = true;
    check_kvcache(c, rng);
  }
}

TEST(KvCache, Leftpad) {
  Rng rng;
  for (flare_dtype dtype : kDtypes) {
    KvCase c;
    c.dtype = dtype;
    c.batch = 3;
    c.leftpad = true;
    c.seqlen_q = 4;
    c.seqlen_new = 3;
    c.causal = true;
    check_kvcache(c, rng);
    c.rotary_dim = 32;  // rotary positions are cache slots, not shifted by the left pad
    check_kvcache(c, rng);
  }
}

TEST(KvCache, PagedShuffledBlockTable) {
  Rng rng;
  for (flare_dtype dtype : kDtypes)
    for (int64_t block : {16, 32, 256}) {
      KvCase c;
      c.dtype = dtype;
      c.block_size = block;
      c.capacity = block * (block == 256 ? 1 : 5);
      c.seqlen_new = 3;
      c.seqlen_q = 3;
      c.causal = block != 32;
      check_kvcache(c, rng);
    }
}

TEST(KvCache, Rotary) {
  Rng rng;
  for (flare_dtype dtype : kDtypes)
    for (bool interleaved : {false, true})
      for (int64_t rotary_dim : {16, 64}) {
        KvCase c;
        c.dtype = dtype;
        c.rotary_dim = rotary_dim;
        c.interleaved = interleaved;
        c.seqlen_new = 4;
        c.seqlen_q = 4;
        c.causal = rotary_dim == 64;  // causal: query i at position p + i; else every query at p
        check_kvcache(c, rng);
      }
}

TEST(KvCache, RotaryWithoutAppend) {
  Rng rng;
  for (bool causal : {false, true}) {
    KvCase c;
    c.rotary_dim = 48;
    c.seqlen_q = 3;
    c.causal = causal;
    check_kvcache(c, rng);
  }
}

TEST(KvCache, MaskingOptions) {
  Rng rng;
  for (flare_dtype dtype : {FLARE_DTYPE_F32, FLARE_DTYPE_BF16}) {
    KvCase c;
    c.dtype = dtype;
    c.seqlen_q = 6;
    c.seqlen_new = 2;
    c.window_left = 10;
    c.window_right = 0;
    c.softcap = 10.0f;
    c.alibi = AlibiMode::kPerBatchHead;
    check_kvcache(c, rng);
    c.window_left = -1;
    c.window_right = 2;
    c.alibi = AlibiMode::kPerHead;
    c.softcap = 0.0f;
    c.headdim_v = 32;
    check_kvcache(c, rng);
  }
}

TEST(KvCache, LongQueryMoreThanCachedKeys) {
  // seqlen_q beyond the keys: with causal the first rows see no key (out 0, lse -inf).
  Rng rng;
  KvCase c;
  c.capacity = 40;
  c.seqlen_q = 30;
  c.causal = true;
  c.leftpad = true;
  check_kvcache(c, rng);
}

TEST(KvCache, StridedEverything) {
  Rng rng;
  for (flare_dtype dtype : kDtypes) {
    KvCase c;
    c.dtype = dtype;
    c.strided = true;
    c.seqlen_new = 2;
    c.seqlen_q = 2;
    c.causal = true;
    c.rotary_dim = 32;
    c.interleaved = dtype == FLARE_DTYPE_BF16;
    check_kvcache(c, rng);
    c.block_size = 16;
    c.capacity = 64;
    check_kvcache(c, rng);
  }
}

// The decode path (few query rows per kv head: GQA heads packed) with its key range cut into 1..many splits
// merged through their lse, against the fp64 reference, with the options that shape and mask scores.
TEST(KvCache, DecodeSplitCounts) {
  Rng rng;
  for (flare_dtype dtype : {FLARE_DTYPE_F32, FLARE_DTYPE_BF16, FLARE_DTYPE_F16}) {
    for (int32_t splits : {1, 2, 3, 5, 16, 200}) {
      KvCase c;
      c.dtype = dtype;
      c.batch = 3;
      c.nheads = 8;
      c.nheads_k = 2;
      c.headdim = 72;
      c.headdim_v = 40;
      c.capacity = 301;
      c.seqlen_q = splits % 2 ? 1 : 3;
      c.seqlen_new = 2;
      c.causal = c.seqlen_q > 1;
      c.num_splits = splits;
      check_kvcache(c, rng);
      c.softcap = 8.0f;
      c.alibi = AlibiMode::kPerHead;
      c.window_left = 50;
      c.block_size = 7;
      c.capacity = 301;
      check_kvcache(c, rng);
    }
  }
}

// bf16 caches whose head dims are multiples of 32 take the decode path's dot-product tiles where the processor
// has AVX512_BF16 (P rounded to bf16, keys taken in pairs from any first key): 4 and 3 query rows per kv head
// (whole and partial four-row tiles), causal chunks of several query rows (each row its own key range, odd
// ones included), windows, paged blocks of 7, and splits.
TEST(KvCache, DecodeBf16HeadDimsOf32) {
  Rng rng;
  const std::pair<int64_t, int64_t> dims[] = {{64, 96}, {128, 128}, {32, 64}};
  for (const auto& [d, dv] : dims) {
    for (int32_t splits : {1, 3}) {
      for (int64_t group : {4, 3}) {
        KvCase c;
        c.dtype = FLARE_DTYPE_BF16;
        c.batch = 2;
        c.nheads_k = 2;
        c.nheads = 2 * group;
        c.headdim = d;
        c.headdim_v = dv;
        c.capacity = 301;
        c.num_splits = splits;
        check_kvcache(c, rng);
        c.seqlen_q = 3;
        c.seqlen_new = 3;
        c.causal = true;
        c.window_left = 45;
        c.block_size = 7;
        check_kvcache(c, rng);
      }
    }
  }
}

// Learnable sinks on both paths (decode: split parts merged before the sink joins; the forward's tiles for
// long query chunks), with rows that see no key (window 0 and leftpad) getting out = 0 and lse = sink.
TEST(KvCache, Sinks) {
  Rng rng;
  for (flare_dtype dtype : kDtypes) {
    for (int32_t splits : {1, 3}) {
      for (int64_t seqlen_q : {1, 4, 40}) {
        KvCase c;
        c.dtype = dtype;
        c.batch = 3;
        c.nheads = 6;
        c.nheads_k = 2;
        c.capacity = 157;
        c.seqlen_q = seqlen_q;
        c.seqlen_new = 1;
        c.causal = seqlen_q > 1;
        c.leftpad = true;
        c.num_splits = splits;
        c.sinks = true;
        check_kvcache(c, rng);
        c.block_size = 5;
        c.capacity = 160;
        c.window_left = 0;
        c.softcap = 10.0f;
        check_kvcache(c, rng);
      }
    }
  }
}

// Head dims past 256 (the CPU backend's range ends at 576 / 512): the decode path (split and not), the
// forward's tiles (many rows per kv head, and fp64), dense and paged caches, appends and rotary over the whole
// head (the rotation's fp64 rows are sized by the widest head).
TEST(KvCache, WideHeads) {
  Rng rng;
  const std::pair<int64_t, int64_t> dims[] = {{512, 512}, {576, 512}, {96, 512}};
  for (flare_dtype dtype : kDtypes) {
    for (auto [d, dv] : dims) {
      KvCase c;  // MLA-like decode: one kv head shared by 8 query heads
      c.dtype = dtype;
      c.nheads = 8;
      c.nheads_k = 1;
      c.headdim = d;
      c.headdim_v = dv;
      c.capacity = 301;
      c.seqlen_new = 1;
      c.rotary_dim = d == 576 ? 64 : d;
      c.interleaved = d == 576;
      c.num_splits = dtype == FLARE_DTYPE_F32 ? 3 : 0;
      check_kvcache(c, rng);
      c.block_size = 16;  // paged, a few query rows, causal with a window
      c.capacity = 96;
      c.seqlen_q = 3;
      c.seqlen_new = 3;
      c.causal = true;
      c.window_left = 40;
      c.num_splits = 0;
      check_kvcache(c, rng);
    }
    KvCase f;  // 2 x 40 rows per kv head: the forward's tiles instead of the decode path
    f.dtype = dtype;
    f.batch = 1;
    f.nheads = 2;
    f.nheads_k = 1;
    f.headdim = 576;
    f.headdim_v = 512;
    f.capacity = 90;
    f.seqlen_q = 40;
    f.seqlen_new = 40;
    f.causal = true;
    f.rotary_dim = 576;
    check_kvcache(f, rng);
  }
}

// Decode items cover a block of kv heads (as many as 64 query rows allow): blocks that split the kv heads
// unevenly (6 kv heads in blocks of 4 and 2, of 3 and 3, or one each), with splits, odd head dims (staged
// rows), paging, a window, and keys cut so the last chunk of a split is short.
TEST(KvCache, DecodeHeadBlocks) {
  Rng rng;
  for (flare_dtype dtype : {FLARE_DTYPE_F32, FLARE_DTYPE_BF16, FLARE_DTYPE_F16}) {
    for (int64_t seqlen_q : {4, 5, 16}) {  // 16, 20, 64 rows per kv head: 4, 3 and 1 kv heads per item
      KvCase c;
      c.dtype = dtype;
      c.batch = 2;
      c.nheads = 24;
      c.nheads_k = 6;
      c.seqlen_q = seqlen_q;
      c.capacity = 203;
      c.seqlen_new = 1;
      c.causal = true;
      check_kvcache(c, rng);
      c.num_splits = 3;
      c.headdim = 72;
      c.headdim_v = 40;
      c.block_size = 16;
      c.capacity = 208;
      c.window_left = 37;
      check_kvcache(c, rng);
    }
  }
}

TEST(KvCache, RandomCombinations) {
  Rng rng;
  const int64_t headdims[] = {32, 64, 80, 128};
  for (int n = 0; n < 16; ++n) {
    KvCase c;
    c.dtype = kDtypes[rng.integer(0, 3)];
    c.batch = rng.integer(1, 3);
    c.nheads_k = rng.integer(1, 2);
    c.nheads = c.nheads_k * rng.integer(1, 3);
    c.headdim = headdims[rng.integer(0, 3)];
    c.headdim_v = rng.coin() ? c.headdim : headdims[rng.integer(0, 3)];
    c.block_size = rng.coin() ? 16 * rng.integer(1, 4) : 0;
    c.capacity = c.block_size ? c.block_size * rng.integer(1, 4) : rng.integer(8, 150);
    c.batch_idx = !c.block_size && rng.coin();
    c.leftpad = rng.coin();
    c.seqlen_new = rng.coin() ? rng.integer(1, 4) : 0;
    c.seqlen_q = rng.coin() ? 1 : rng.integer(1, 8);
    c.causal = rng.coin();
    if (rng.coin()) c.window_left = static_cast<int32_t>(rng.integer(0, 40));
    if (rng.coin()) c.softcap = static_cast<float>(rng.uniform(2.0, 20.0));
    c.alibi = static_cast<AlibiMode>(rng.integer(0, 2));
    if (rng.coin()) {
      c.rotary_dim = 2 * rng.integer(1, c.headdim / 2);
      c.interleaved = rng.coin();
    }
    c.strided = rng.coin();
    c.with_lse = rng.coin();
    c.sinks = rng.coin();
    check_kvcache(c, rng);
  }
}

}  // namespace
}  // namespace flare::test

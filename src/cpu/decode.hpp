// decode.hpp — the CPU KV-cache pass when each (sequence, kv head) has few query rows (decoding: 1 token, or
// a few for speculative decoding). The forward's tiles would be mostly empty there; this path is bound by
// reading the cache, so it reads every byte of it once, front to back:
//   - an item of work is one sequence's keys [j0, j1) (all of them, or one split) for a block of kv heads
//     (all of them in GQA decoding), walked kDecodeChunk keys at a time with every head of the block done
//     per chunk. A cache laid out (seqlen, nheads_k, headdim) is then swept once, front to back, whole rows of
//     all heads (2 KiB at 8 kv heads x 128 x bf16), the next chunk requested into L2 while this one is used.
//     (Walking one head at a time read 256 of every 2048 bytes and crossed every page once per head: about
//     0.3x the copy bandwidth.)
//   - GQA heads packed: the nheads / nheads_k query heads sharing a kv head (x seqlen_q rows, R in all) run
//     together, each vector of a K or V row loaded once and used for four rows (decode_tiles.hpp);
//   - bf16 rows read in place: on vdpbf16ps where the processor has AVX512_BF16 but no AMX (Zen 4/5) and
//     the head dims are multiples of 32 (P rounded to bf16, as the bf16 forward rounds it), else widened to
//     fp32 as they are loaded; fp32 rows read in place; fp16 rows widened as they are loaded where the unit
//     converts in hardware (F16C, AVX-512); head dims that are not a whole number of vectors, and fp16 at the
//     generic level, go through an fp32 stage of kDecodeChunk rows;
//   - split-KV: with fewer (sequence, head block) items than about two per thread, each sequence's keys are
//     cut into splits that run on different cores; each split keeps its own output and lse, merged at the end
//     through the same LSE merge as flare_merge_states (merge_rows.hpp).
// Per chunk of keys, per row: s = scale q·k (softcap, ALiBi, mask), m' = max(m, max s), p = exp(s - m'),
// l = l exp(m - m') + sum p, o = o exp(m - m') + sum p v.
#pragma once

#include <omp.h>

#include <cmath>
#include <limits>
#include <type_traits>

#include "cpu/arena.hpp"
#include "cpu/decode_tiles.hpp"
#if defined(FLARE_AMX_LEVEL)
#include "cpu/decode_amx.hpp"
#endif
#include "cpu/merge_rows.hpp"
#include "cpu/sequences.hpp"
#include "cpu/simd.hpp"
#include "cpu/team.hpp"

namespace flare::cpu::FLARE_ISA {

inline constexpr int64_t kDecodeChunk = 32;     // keys per step (a multiple of every vector width)
inline constexpr int64_t kDecodeItemRows = 64;  // query rows of one item at most (its heads x R): its state

struct DecodeScratch {
  int64_t rows = 0, heads = 1, head_blocks = 1, splits = 1, dp = 0, dvp = 0;
  struct PerThread {
    float *k, *v;     // a chunk of staged key / value rows (fp16, odd head dims), padded to dp / dvp
    float *q, *o;     // per head of the item: R query rows (dp) and R output rows (dvp)
    float *m, *l;     // per head of the item: the R rows' running max and sum
    float* s;         // R x kDecodeChunk scores of one head
    RowPtr *krows, *vrows;  // per head of the item: where its K and V rows lie
    uint16_t* qb;     // DecodeTiles::kDot: per head of the item, R query rows in bf16 (dp)
    uint16_t* pb;     // kDot, kAmx: the R rows of s rounded to bf16, and 2 elements (0) past them
    uint16_t* qt;     // kAmx: per head of the item, its query rows packed as a tile operand
    uint16_t* vt;     // kAmx: a chunk's value rows interleaved in pairs
    uint16_t* kstage; // kAmx: key rows of a chunk not evenly spaced in the cache
    float* st;        // kAmx: the stored score tiles
  };
  PerThread* threads = nullptr;
  // splits > 1: per (b, hk, split) the split's normalised output (R x dvp) and lse (R).
  float* part_o = nullptr;
  float* part_lse = nullptr;

  void layout(Arena& a, const Problem& p, int nt) {
    constexpr int W = Simd<float>::W;
    constexpr int64_t C = kDecodeChunk;
    rows = decode_rows(p);
    heads = decode_heads_per_item(p);
    head_blocks = (p.nheads_k + heads - 1) / heads;
    splits = decode_splits(p, nt);
    dp = round_up(p.headdim, W);
    dvp = round_up(p.headdim_v, W);
    threads = a.take<PerThread>(nt);
    for (int t = 0; t < nt; ++t) {
      PerThread pt{a.take<float>(C * dp), a.take<float>(C * dvp), a.take<float>(heads * rows * dp),
                   a.take<float>(heads * rows * dvp), a.take<float>(heads * rows), a.take<float>(heads * rows),
                   a.take<float>(rows * C), a.take<RowPtr>(heads), a.take<RowPtr>(heads),
                   a.take<uint16_t>(heads * rows * dp), a.take<uint16_t>(rows * C + 2), nullptr, nullptr, nullptr,
                   nullptr};
#if defined(FLARE_AMX_LEVEL)
      if (p.dtype == FLARE_DTYPE_BF16 && decode_amx_fits(rows)) {
        pt.qt = a.take<uint16_t>(decode_amx_query_elems(heads, dp));
        pt.vt = a.take<uint16_t>(decode_amx_value_elems(dvp));
        pt.kstage = a.take<uint16_t>(decode_amx_stage_elems(dp));
        pt.st = a.take<float>(kDecodeAmxScoreFloats);
      }
#endif
      if (threads) threads[t] = pt;
    }
    if (splits > 1) {
      const int64_t parts = p.batch * p.nheads_k * splits;
      part_o = a.take<float>(parts * rows * dvp);
      part_lse = a.take<float>(parts * rows);
    }
  }

  // Query rows per (sequence, kv head): the group's heads times seqlen_q.
  static int64_t decode_rows(const Problem& p) { return p.nheads / p.nheads_k * p.seqlen_q; }

  // kv heads per item: as many as kDecodeItemRows query rows allow (every head of a GQA decode step).
  static int64_t decode_heads_per_item(const Problem& p) {
    return smax<int64_t>(1, smin<int64_t>(p.nheads_k, kDecodeItemRows / smax<int64_t>(1, decode_rows(p))));
  }

  // The splits per sequence: num_splits when given; else enough to give every thread about two (sequence,
  // head block, split) items, but no split shorter than kMinKeyRowsPerSplit key rows over the item's heads
  // (512 KiB of a bf16 cache at head dim 128: below that, the merge and a thread's start cost more than the
  // split saves). A pure function of the problem and nt.
  static int64_t decode_splits(const Problem& p, int nt) {
    if (p.num_splits > 0) return p.num_splits;
    constexpr int64_t kMinKeyRowsPerSplit = 2048;
    const int64_t heads = decode_heads_per_item(p);
    const int64_t groups = p.batch * ((p.nheads_k + heads - 1) / heads);
    if (groups == 0 || groups >= 2 * int64_t{nt}) return 1;
    const int64_t want = (2 * int64_t{nt} + groups - 1) / groups;
    const int64_t by_length = smax<int64_t>(1, longest_sequence(p).keys * heads / kMinKeyRowsPerSplit);
    return smin(want, by_length);
  }
};

// The next chunk's K and V rows, requested into L2 in memory order (key by key: a key's K rows of every head,
// then its V rows), a slice of 1 / nh of them per head step, spread over that step's tiles a few rows per
// call. Issued in one burst per head step, the slice's prefetches (256 at bf16, 8 kv heads) filled the
// reorder window and the line-fill buffers, and the tiles' arithmetic waited on them instead of running
// beside them (docs/tuning-cpu.md, "Overlapping the prefetch"). Each head step sizes its calls from the
// count of the previous one; what is left is issued when the next step begins. Where the heads' rows of a
// key lie side by side (FlashAttention's layout, dense or paged), each head's row is taken as the previous
// one's end instead of a RowPtr::row (a multiply, or a page lookup's division) per head: 7% less time for the
// bf16 dot-product tiles with the cache in L3 (one Zen 4 core).
class ChunkPrefetch {
 public:
  ChunkPrefetch(const RowPtr* k, const RowPtr* v, int64_t nh, int64_t kbytes, int64_t vbytes)
      : k_(k), v_(v), nh_(nh), kbytes_(kbytes), vbytes_(vbytes),
        adjacent_{heads_adjacent(k, nh, kbytes), heads_adjacent(v, nh, vbytes)} {}

  // A head step starts: its calls request the K and V rows of keys [j, j_end), every head.
  void begin_step(int64_t j, int64_t j_end) {
    finish_step();
    x_ = 0, j_ = j, j_end_ = j_end, v_side_ = false;
    const int64_t rows = 2 * nh_ * smax<int64_t>(0, j_end - j);
    per_call_ = (rows + calls_ - 1) / smax<int64_t>(1, calls_);
    calls_ = 0;
  }
  // Between two tiles.
  void operator()() {
    ++calls_;
    issue(per_call_);
  }
  // The rest of the step's rows.
  void finish_step() { issue(std::numeric_limits<int64_t>::max()); }

 private:
  // Whether head x's row of every key starts where head x - 1's ends.
  static bool heads_adjacent(const RowPtr* rows, int64_t nh, int64_t bytes) {
    for (int64_t x = 1; x < nh; ++x) {
      const RowPtr &a = rows[x - 1], &b = rows[x];
      if (b.base != a.base + bytes || b.row_bytes != a.row_bytes || b.blocks != a.blocks ||
          b.block_size != a.block_size || b.block_bytes != a.block_bytes || b.offset != a.offset)
        return false;
    }
    return true;
  }

  void issue(int64_t rows) {
    for (int64_t i = 0; i < rows && j_ < j_end_; ++i) {
      const int64_t bytes = v_side_ ? vbytes_ : kbytes_;
      at_ = x_ > 0 && adjacent_[v_side_] ? at_ + bytes : (v_side_ ? v_ : k_)[x_].row(j_);
      // Into L2 (prefetcht1): a chunk of every head (128 KiB of bf16 at 8 kv heads x 128) is more than L1 holds.
      prefetch_bytes<Fetch::kL2>(at_, bytes);
      if (++x_ == nh_) {
        x_ = 0;
        if (v_side_) ++j_;
        v_side_ = !v_side_;
      }
    }
  }

  const RowPtr* k_;
  const RowPtr* v_;
  int64_t nh_, kbytes_, vbytes_;
  bool adjacent_[2];  // K's heads, V's heads
  const char* at_ = nullptr;  // the row requested last
  int64_t x_ = 0, j_ = 0, j_end_ = 0;
  bool v_side_ = false;
  int64_t per_call_ = 0, calls_ = 8;  // calls_: the previous step's count (a first guess before any)
};

// Whether K and V rows are read where they lie (fp32, or bf16 and fp16 widened on load: head dims a whole
// number of vectors) rather than staged to fp32 (a write and a read of every row more: docs/tuning-cpu.md).
inline bool decode_reads_in_place(const Problem& p) {
  constexpr int W = Simd<float>::W;
  const bool widened = p.dtype == FLARE_DTYPE_F32 || p.dtype == FLARE_DTYPE_BF16 ||
                       (kDecodeF16InPlace && p.dtype == FLARE_DTYPE_F16);
  return widened && p.headdim % W == 0 && p.headdim_v % W == 0;
}

// ptrs[jj] = key row j0 + jj of rows, jj < n, as the tiles read it: where it lies (RT = float: fp32 rows,
// RT = uint16_t: bf16 rows, RT = Half: fp16 rows), or converted into `stage` (fp32 rows of ld floats,
// zero-padded past d). The list is padded to a multiple of W with its last row, so that tiles need no tail
// (their extra scores land past n and are never used).
template <class RT>
inline void chunk_rows(const Problem& p, const RowPtr& rows, int64_t j0, int64_t n, int64_t d, int64_t ld,
                       float* stage, const RT** ptrs) {
  constexpr int W = Simd<float>::W;
  if constexpr (std::is_same_v<RT, uint16_t> || std::is_same_v<RT, Half>) {
    for (int64_t jj = 0; jj < n; ++jj) ptrs[jj] = reinterpret_cast<const RT*>(rows.row(j0 + jj));
  } else if (p.dtype == FLARE_DTYPE_F32 && d == ld) {
    for (int64_t jj = 0; jj < n; ++jj) ptrs[jj] = reinterpret_cast<const float*>(rows.row(j0 + jj));
  } else {
    for (int64_t jj = 0; jj < n; ++jj) {
      float* dst = stage + jj * ld;
      load_row<float>(rows.row(j0 + jj), p.dtype, dst, d, 1.0f);
      for (int64_t c = d; c < ld; ++c) dst[c] = 0.0f;
      ptrs[jj] = dst;
    }
  }
  for (int64_t jj = n; jj < round_up(n, W); ++jj) ptrs[jj] = ptrs[n - 1];
}

// Row r of one head: its scores s[0..n) of keys jc.. become probabilities (s[n..kDecodeChunk) 0), and its
// running max m, sum l and output o (dvp) are rescaled to the new max. masked: some key of the chunk is
// outside some row's window (else every score is kept as it is).
inline void softmax_chunk_row(const Problem& p, const Sequence& seq, const policy::WindowMask& mask, int64_t h,
                              int64_t i, int64_t jc, int64_t n, bool masked, float* s, float& m, float& l, float* o,
                              int64_t dvp) {
  using V = vec_t<float>;
  constexpr int W = Simd<float>::W;
  constexpr int64_t C = kDecodeChunk;
  constexpr float kInf = std::numeric_limits<float>::infinity();
  for (int64_t jj = n; jj < C; ++jj) s[jj] = -kInf;
  if (p.score.softcap > 0 || p.score.alibi_slopes != nullptr) {
    const float slope = alibi_slope(p, seq, h);
    for (int64_t jj = 0; jj < n; ++jj) {
      if (p.score.softcap > 0) s[jj] = p.score.softcap * std::tanh(s[jj] / p.score.softcap);
      if (slope != 0) s[jj] += policy::alibi_bias(slope, mask.diagonal(i), jc + jj);
    }
  }
  if (masked) {
    const policy::KeyRange seen = mask.keys_of(i);
    for (int64_t jj = 0; jj < n; ++jj)
      if (jc + jj < seen.first || jc + jj > seen.last) s[jj] = -kInf;
  }
  V mx = vset(-kInf);
  for (int64_t jj = 0; jj < C; jj += W) mx = vmax(mx, vload(s + jj));
  const float m_new = smax(m, hmax(mx));
  if (m_new == -kInf) {  // nothing visible yet: p = 0
    for (int64_t jj = 0; jj < C; ++jj) s[jj] = 0.0f;
    return;
  }
  V sum{};
  for (int64_t jj = 0; jj < C; jj += W) {
    const V e = vexp(vload(s + jj) - vset(m_new));
    vstore(s + jj, e);
    sum += e;
  }
  const float alpha = std::exp(m - m_new);  // 0 when m was -inf
  if (alpha != 1.0f) {
    for (int64_t c = 0; c < dvp; c += W) vstore(o + c, vload(o + c) * alpha);
  }
  l = l * alpha + hsum(sum);
  m = m_new;
}

// Which tiles of decode_tiles.hpp an item runs on (run_decode picks):
//   kWiden  fp32 rows, bf16 rows widened on load, or the fp32 stage: every dtype, every head dim;
//   kSplit  bf16 rows read in place split into even and odd elements (AVX-512, head dims multiples of 32):
//           q and o are held in that order, and o is joined again at the end;
//   kDot    bf16 rows on vdpbf16ps (AVX512_BF16 without AMX, head dims multiples of 32): q held in bf16,
//           P rounded to bf16, o held in dot order and joined at the end;
//   kAmx    bf16 rows on AMX tiles (the AMX level, head dims multiples of 32, 2 to 16 rows per kv head:
//           decode_amx.hpp): q packed as a tile operand, P rounded to bf16, o held in dot order.
enum class DecodeTiles { kWiden, kSplit, kDot, kAmx };

// One item: keys [j0, j1) of one sequence for kv heads [hk0, hk0 + nh), against their R query rows each.
// Leaves each row's unnormalised output in t.o and its running max and sum in t.m, t.l (head h's rows at
// h * R). RT: how K and V rows are read (chunk_rows); kTiles: the tiles that do the arithmetic.
template <class RT, DecodeTiles kTiles = DecodeTiles::kWiden>
inline void decode_item(const Problem& p, const DecodeScratch& ws, const DecodeScratch::PerThread& t,
                        const Sequence& seq, int64_t hk0, int64_t nh, int64_t j0, int64_t j1) {
  using V = vec_t<float>;
  constexpr int W = Simd<float>::W;
  constexpr int64_t C = kDecodeChunk;
  const int64_t R = ws.rows, group = p.nheads / p.nheads_k, dp = ws.dp, dvp = ws.dvp;
  const float scale = static_cast<float>(p.score.scale);
  const policy::WindowMask mask = seq.mask(p);
  for (int64_t h = 0; h < nh; ++h) {
    for (int64_t r = 0; r < R; ++r) {
      const int64_t g = r / seq.seqlen_q, i = r % seq.seqlen_q;
      float* q = t.q + (h * R + r) * dp;
      load_row<float>(query_rows(p, p.q, seq, (hk0 + h) * group + g).row(i), p.dtype, q, p.headdim, 1.0f);
      for (int64_t c = p.headdim; c < dp; ++c) q[c] = 0.0f;
#if defined(__AVX512F__) && FLARE_VEC_BYTES == 64
      if constexpr (kTiles == DecodeTiles::kSplit) split_row(q, dp);
#endif
#if FLARE_DECODE_DOT_TILES || defined(FLARE_AMX_LEVEL)
      // q is bf16 in the call (or rotated into bf16), so rounding it back is exact.
      if constexpr (kTiles == DecodeTiles::kDot || kTiles == DecodeTiles::kAmx)
        round_to_bf16(q, t.qb + (h * R + r) * dp, dp);
#endif
      t.m[h * R + r] = -std::numeric_limits<float>::infinity();
      t.l[h * R + r] = 0.0f;
      for (int64_t c = 0; c < dvp; c += W) vstore(t.o + (h * R + r) * dvp + c, V{});
    }
  }
#if defined(FLARE_AMX_LEVEL)
  // Each head's bf16 query rows as the B operand of Sᵀ = K Qᵀ: one group of 16 columns (rows past R zero).
  if constexpr (kTiles == DecodeTiles::kAmx)
    for (int64_t h = 0; h < nh; ++h)
      pack_b_k_along_rows(t.qt + h * dp * 16, dp / 32, 0, 16, dp,
                          [&](int64_t r) { return r < R ? t.qb + (h * R + r) * dp : nullptr; });
#endif
  RowPtr* krows = t.krows;
  RowPtr* vrows = t.vrows;
  for (int64_t h = 0; h < nh; ++h) {
    krows[h] = key_rows(p, p.k, seq, hk0 + h);
    vrows[h] = key_rows(p, p.v, seq, hk0 + h);
  }
  const int64_t kbytes = p.headdim * dtype_size(p.dtype), vbytes = p.headdim_v * dtype_size(p.dtype);
  const RT* kp[C + W];
  const RT* vp[C + W];
  ChunkPrefetch prefetch(krows, vrows, nh, kbytes, vbytes);
  for (int64_t jc = j0; jc < j1; jc += C) {
    const int64_t n = smin(C, j1 - jc);
    // Whether some row cannot see some key of the chunk (a causal or window edge): then scores are masked
    // and each row's O += P V runs over its own keys, so that a masked key's value never reaches it.
    bool masked = false;
    for (int64_t i = 0; i < seq.seqlen_q; ++i) {
      const policy::KeyRange seen = mask.keys_of(i);
      masked |= seen.first > jc || seen.last < jc + n - 1;
    }
    for (int64_t h = 0; h < nh; ++h) {
      const int64_t hk = hk0 + h;
      float* q = t.q + h * R * dp;
      float* o = t.o + h * R * dvp;
      // The next chunk's rows of every head, a slice per head step (ChunkPrefetch). The loads below are then
      // L2 hits: without it the first touch of each head's rows missed to memory (bf16 0.65x as fast on one
      // core, fp32 0.85x), and requesting two chunks ahead, or each head's rows a chunk ahead of its own
      // step, was slower.
      prefetch.begin_step(smin(jc + C + C * h / nh, j1), smin(jc + C + C * (h + 1) / nh, j1));
      chunk_rows(p, krows[h], jc, n, p.headdim, dp, t.k, kp);
      if constexpr (kTiles == DecodeTiles::kSplit) {
#if defined(__AVX512F__) && FLARE_VEC_BYTES == 64
        score_block_split(q, dp, R, kp, n, dp, scale, t.s, C, prefetch);
#endif
      } else if constexpr (kTiles == DecodeTiles::kDot) {
#if FLARE_DECODE_DOT_TILES
        score_block_dot(t.qb + h * R * dp, dp, R, kp, n, dp, scale, t.s, C, prefetch);
#endif
      } else if constexpr (kTiles == DecodeTiles::kAmx) {
#if defined(FLARE_AMX_LEVEL)
        decode_amx_scores(t.qt + h * dp * 16, R, dp, kp, n, scale, t.s, C, t.st, t.kstage, prefetch);
#endif
      } else {
        score_block(q, dp, R, kp, n, dp, scale, t.s, C, prefetch);
      }
      for (int64_t r = 0; r < R; ++r)
        softmax_chunk_row(p, seq, mask, hk * group + r / seq.seqlen_q, r % seq.seqlen_q, jc, n, masked,
                          t.s + r * C, t.m[h * R + r], t.l[h * R + r], o + r * dvp, dvp);
#if FLARE_DECODE_DOT_TILES || defined(FLARE_AMX_LEVEL)
      if constexpr (kTiles == DecodeTiles::kDot || kTiles == DecodeTiles::kAmx) {
        round_to_bf16(t.s, t.pb, R * C);
        t.pb[R * C] = t.pb[R * C + 1] = 0;  // read beside an odd range's last key (accumulate_pv_dot)
      }
#endif
      chunk_rows(p, vrows[h], jc, n, p.headdim_v, dvp, t.v, vp);
      // O += P V for kRows rows from r over the chunk's keys [a, b): the split, dot-product or widening tiles
      // (kAmx: the widening ones for a masked chunk's rows; a whole chunk runs on AMX tiles below).
      const auto add_values = [&](auto rows, int64_t r, int64_t a, int64_t b) {
        constexpr int kRows = decltype(rows)::value;
        if constexpr (kTiles == DecodeTiles::kSplit) {
#if defined(__AVX512F__) && FLARE_VEC_BYTES == 64
          accumulate_pv_split<kRows>(t.s + r * C, C, vp, a, b, o + r * dvp, dvp, dvp, prefetch);
#endif
        } else if constexpr (kTiles == DecodeTiles::kDot) {
#if FLARE_DECODE_DOT_TILES
          accumulate_pv_dot<kRows>(t.pb + r * C, C, vp, a, b, o + r * dvp, dvp, dvp, prefetch);
#endif
        } else if constexpr (kTiles == DecodeTiles::kAmx) {
#if defined(FLARE_AMX_LEVEL)
          // Only rows on a causal or window edge come here (few): the widening tiles, in column order.
          for (int64_t x = r; x < r + kRows; ++x) join_dot_row(o + x * dvp, dvp);
          accumulate_pv<kRows>(t.s + r * C, C, vp, a, b, o + r * dvp, dvp, dvp, prefetch);
          for (int64_t x = r; x < r + kRows; ++x) split_dot_row(o + x * dvp, dvp);
#endif
        } else {
          accumulate_pv<kRows>(t.s + r * C, C, vp, a, b, o + r * dvp, dvp, dvp, prefetch);
        }
      };
      if (!masked) {
        if constexpr (kTiles == DecodeTiles::kAmx) {
#if defined(FLARE_AMX_LEVEL)
          decode_amx_values(t.pb, vp, n, dvp, o, dvp, t.vt, prefetch);
#endif
        } else {
          int64_t r = 0;
          for (; r + 4 <= R; r += 4) add_values(std::integral_constant<int, 4>{}, r, 0, n);
          for (; r < R; ++r) add_values(std::integral_constant<int, 1>{}, r, 0, n);
        }
        continue;
      }
      for (int64_t r = 0; r < R; ++r) {
        const policy::KeyRange seen = mask.keys_of(r % seq.seqlen_q);
        const int64_t a = smax(seen.first, jc) - jc, b = smin(seen.last + 1, jc + n) - jc;
        if (a < b) add_values(std::integral_constant<int, 1>{}, r, a, b);
      }
    }
  }
#if defined(__AVX512F__) && FLARE_VEC_BYTES == 64
  if constexpr (kTiles == DecodeTiles::kSplit)
    for (int64_t x = 0; x < nh * R; ++x) join_split_row(t.o + x * dvp, dvp);
#endif
#if FLARE_DECODE_DOT_TILES || defined(FLARE_AMX_LEVEL)
  if constexpr (kTiles == DecodeTiles::kDot || kTiles == DecodeTiles::kAmx)
    for (int64_t x = 0; x < nh * R; ++x) join_dot_row(t.o + x * dvp, dvp);
#endif
}

// Row r's out and lse from an output o (scaled by 1/l) and its lse, the head's sink folded into both.
inline void decode_store(const Problem& p, const Sequence& seq, int64_t hk, int64_t r, const float* o, float inv,
                         float lse) {
  const int64_t group = p.nheads / p.nheads_k, h = hk * group + r / seq.seqlen_q, i = r % seq.seqlen_q;
  const policy::SinkFold<float> row = policy::fold_sink(lse, sink_of(p, h));
  store_row<float>(o, inv * row.factor, query_rows(p, p.out, seq, h).row(i), p.dtype, p.headdim_v);
  if (float* lrow = lse_row(p, seq, h)) lrow[i] = row.lse;
}

inline void run_decode(const Problem& p, void* scratch, int nt) {
  Arena arena(scratch);
  DecodeScratch ws;
  ws.layout(arena, p, nt);
  const int64_t R = ws.rows, S = ws.splits, dvp = ws.dvp, HB = ws.head_blocks, items = p.batch * HB * S;
  const bool in_place = decode_reads_in_place(p);
  const bool bf16_in_32s =
      in_place && p.dtype == FLARE_DTYPE_BF16 && p.headdim % 32 == 0 && p.headdim_v % 32 == 0;
  constexpr float kInf = std::numeric_limits<float>::infinity();
  const bool amx = bf16_in_32s && ws.threads[0].qt != nullptr;  // qt: the AMX level's bf16 scratch (layout)
  on_team(nt, [&]() {
    const DecodeScratch::PerThread& t = ws.threads[omp_get_thread_num()];
#if defined(FLARE_AMX_LEVEL)
    if (amx) decode_amx_configure(R);
#endif
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < items; ++item) {
      const int64_t b = item / (HB * S), hk0 = (item / S) % HB * ws.heads, split = item % S;
      const int64_t nh = smin(ws.heads, p.nheads_k - hk0);
      const Sequence seq = sequence_of(p, b);
      if (seq.seqlen_q == 0) continue;
      // The keys any row sees, cut into S near-equal splits.
      const policy::KeyRange seen = seq.mask(p).keys_of_rows(0, seq.seqlen_q);
      const int64_t first = smax<int64_t>(seen.first, 0), end = smin(seen.last + 1, seq.seqlen_k);
      const int64_t len = smax<int64_t>(end - first, 0), per = (len + S - 1) / S;
      const int64_t j0 = first + smin(split * per, len), j1 = first + smin((split + 1) * per, len);
      if (amx) {
        decode_item<uint16_t, DecodeTiles::kAmx>(p, ws, t, seq, hk0, nh, j0, j1);
      } else if (kDecodeDotPairs && bf16_in_32s) {
        decode_item<uint16_t, DecodeTiles::kDot>(p, ws, t, seq, hk0, nh, j0, j1);
      } else if (kDecodeSplitsPairs && bf16_in_32s) {
        decode_item<uint16_t, DecodeTiles::kSplit>(p, ws, t, seq, hk0, nh, j0, j1);
      } else if (in_place && p.dtype == FLARE_DTYPE_BF16) {
        decode_item<uint16_t>(p, ws, t, seq, hk0, nh, j0, j1);
      } else if (in_place && p.dtype == FLARE_DTYPE_F16) {
        if constexpr (kDecodeF16InPlace) decode_item<Half>(p, ws, t, seq, hk0, nh, j0, j1);
      } else {
        decode_item<float>(p, ws, t, seq, hk0, nh, j0, j1);
      }
      for (int64_t h = 0; h < nh; ++h) {
        const int64_t hk = hk0 + h;
        for (int64_t r = 0; r < R; ++r) {
          const float l = t.l[h * R + r];
          const float lse = l > 0 ? t.m[h * R + r] + std::log(l) : -kInf;
          const float inv = l > 0 ? 1.0f / l : 0.0f;
          const float* o = t.o + (h * R + r) * dvp;
          if (S == 1) {
            decode_store(p, seq, hk, r, o, inv, lse);
          } else {
            const int64_t part = ((b * p.nheads_k + hk) * S + split) * R + r;
            for (int64_t c = 0; c < dvp; ++c) ws.part_o[part * dvp + c] = o[c] * inv;
            ws.part_lse[part] = lse;
          }
        }
      }
    }
    if (S > 1) {
      // Combine: fold the splits of each (sequence, kv head, row) in split order.
#pragma omp for schedule(static)
      for (int64_t gr = 0; gr < p.batch * p.nheads_k * R; ++gr) {
        const int64_t r = gr % R, group_item = gr / R, b = group_item / p.nheads_k, hk = group_item % p.nheads_k;
        const Sequence seq = sequence_of(p, b);
        if (seq.seqlen_q == 0) continue;
        float* acc = t.o;  // this thread's output row, free after the splits
        const int64_t base = group_item * S;
        float lse = ws.part_lse[base * R + r];
        for (int64_t c = 0; c < dvp; ++c) acc[c] = ws.part_o[(base * R + r) * dvp + c];
        for (int64_t s = 1; s < S; ++s) {
          const MergeWeights<float> w = merge_weights(lse, ws.part_lse[(base + s) * R + r]);
          merge_into(acc, ws.part_o + ((base + s) * R + r) * dvp, w.a, w.b, dvp);
          lse = w.lse;
        }
        decode_store(p, seq, hk, r, acc, 1.0f, lse);
      }
    }
#if defined(FLARE_AMX_LEVEL)
    if (amx) tile_release();
#endif
  });
}

inline size_t decode_scratch_bytes(const Problem& p, int nt) {
  Arena a;
  DecodeScratch ws;
  ws.layout(a, p, nt);
  return a.used();
}

}  // namespace flare::cpu::FLARE_ISA

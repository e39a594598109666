// decode.hpp — the CPU KV-cache pass when each (sequence, kv head) has few query rows (decoding: 1 token, or
// a few for speculative decoding). The forward's tiles would be mostly empty there; this path is bound by
// reading the cache once:
//   - GQA heads packed: the nheads / nheads_k query heads sharing a kv head (x seqlen_q rows, R in all) run
//     together, so each K and V row is read from memory once and used R times while it sits in L1;
//   - bf16/fp16 caches read once: a chunk of kChunk key rows is converted to fp32 into an L1 stage, then
//     scored against all R rows (fp32 rows are read where they lie);
//   - split-KV: with fewer (sequence, kv head) groups than threads, each group's keys are cut into splits
//     that run on different cores; each split keeps its own output and lse, merged at the end through the
//     same LSE merge as flare_merge_states (merge_rows.hpp).
// Per chunk of keys, per row: s = scale q·k (softcap, ALiBi, mask), m' = max(m, max s), p = exp(s - m'),
// l = l exp(m - m') + sum p, o = o exp(m - m') + sum p v.
#pragma once

#include <omp.h>

#include <cmath>
#include <limits>

#include "cpu/arena.hpp"
#include "cpu/merge_rows.hpp"
#include "cpu/sequences.hpp"
#include "cpu/simd.hpp"

namespace flare::cpu::FLARE_ISA {

inline constexpr int64_t kDecodeChunk = 32;  // keys per stage (a multiple of every vector width)

struct DecodeScratch {
  int64_t rows = 0, splits = 1, dp = 0, dvp = 0;
  struct PerThread {
    float *k, *v;     // kChunk converted key / value rows, padded to dp / dvp
    float *q, *s, *o, *m, *l;  // R query rows (dp), R x kChunk scores, R x dvp output, running max and sum
  };
  PerThread* threads = nullptr;
  // splits > 1: per (b, hk, split) the split's normalised output (R x dvp) and lse (R).
  float* part_o = nullptr;
  float* part_lse = nullptr;

  void layout(Arena& a, const Problem& p, int nt) {
    constexpr int W = Simd<float>::W;
    rows = decode_rows(p);
    splits = decode_splits(p, nt);
    dp = round_up(p.headdim, W);
    dvp = round_up(p.headdim_v, W);
    threads = a.take<PerThread>(nt);
    for (int t = 0; t < nt; ++t) {
      PerThread pt{a.take<float>(kDecodeChunk * dp), a.take<float>(kDecodeChunk * dvp), a.take<float>(rows * dp),
                   a.take<float>(rows * kDecodeChunk), a.take<float>(rows * dvp), a.take<float>(rows),
                   a.take<float>(rows)};
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

  // The splits per sequence: num_splits when given; else enough to give every thread about two
  // (sequence, kv head, split) items, but no split shorter than kMinKeysPerSplit keys (below that, the
  // merge and a thread's start cost more than the split saves). A pure function of the problem and nt.
  static int64_t decode_splits(const Problem& p, int nt) {
    if (p.num_splits > 0) return p.num_splits;
    constexpr int64_t kMinKeysPerSplit = 512;
    const int64_t groups = p.batch * p.nheads_k;
    if (groups == 0 || groups >= 2 * int64_t{nt}) return 1;
    const int64_t want = (2 * int64_t{nt} + groups - 1) / groups;
    const int64_t by_length = smax<int64_t>(1, longest_sequence(p).keys / kMinKeysPerSplit);
    return smin(want, by_length);
  }
};

// Key rows [j0, j0 + n) of rows as fp32 rows of `ld` floats (zero-padded past `d`): the stage, or, for fp32
// rows whose head dim is a whole number of vectors, the cache rows themselves (ptrs[jj]).
inline void stage_rows(const Problem& p, const RowPtr& rows, int64_t j0, int64_t n, int64_t d, int64_t ld,
                       float* stage, const float** ptrs) {
  constexpr int W = Simd<float>::W;
  if (p.dtype == FLARE_DTYPE_F32 && d == ld) {
    for (int64_t jj = 0; jj < n; ++jj) ptrs[jj] = reinterpret_cast<const float*>(rows.row(j0 + jj));
    return;
  }
  if (p.dtype == FLARE_DTYPE_BF16 && d == ld) {
    // bf16 -> fp32 is a 16-bit shift: W lanes widened and shifted per step (the scalar loop did not vectorise).
    typedef uint16_t Half __attribute__((vector_size(W * 2)));
    typedef uint32_t Word __attribute__((vector_size(W * 4)));
    for (int64_t jj = 0; jj < n; ++jj) {
      const char* src = rows.row(j0 + jj);
      float* dst = stage + jj * ld;
      for (int64_t c = 0; c < d; c += W) {
        Half h;
        std::memcpy(&h, src + c * 2, sizeof(h));
        const Word w = __builtin_convertvector(h, Word) << 16;
        std::memcpy(dst + c, &w, sizeof(w));
      }
      ptrs[jj] = dst;
    }
    return;
  }
  for (int64_t jj = 0; jj < n; ++jj) {
    float* dst = stage + jj * ld;
    load_row<float>(rows.row(j0 + jj), p.dtype, dst, d, 1.0f);
    for (int64_t c = d; c < ld; ++c) dst[c] = 0.0f;
    ptrs[jj] = dst;
  }
}

inline float dot_rows(const float* a, const float* b, int64_t n) {
  using V = vec_t<float>;
  constexpr int W = Simd<float>::W;
  V acc0{}, acc1{};
  int64_t c = 0;
  for (; c + 2 * W <= n; c += 2 * W) {
    acc0 += vload(a + c) * vload(b + c);
    acc1 += vload(a + c + W) * vload(b + c + W);
  }
  for (; c < n; c += W) acc0 += vload(a + c) * vload(b + c);
  return hsum(acc0 + acc1);
}

// s[r * ld + jj] = scale * q_r · k for rows r0..r0+3 (four rows share each load of k).
inline void dot_four_rows(const float* q, int64_t dp, const float* k, float scale, float* s, int64_t ld) {
  using V = vec_t<float>;
  constexpr int W = Simd<float>::W;
  V a0{}, a1{}, a2{}, a3{};
  for (int64_t c = 0; c < dp; c += W) {
    const V kv = vload(k + c);
    a0 += vload(q + c) * kv;
    a1 += vload(q + dp + c) * kv;
    a2 += vload(q + 2 * dp + c) * kv;
    a3 += vload(q + 3 * dp + c) * kv;
  }
  s[0] = scale * hsum(a0);
  s[ld] = scale * hsum(a1);
  s[2 * ld] = scale * hsum(a2);
  s[3 * ld] = scale * hsum(a3);
}

// One (sequence, kv head, split): keys [j0, j1) of the sequence against its R query rows. Leaves the split's
// unnormalised output in t.o and its running max and sum in t.m, t.l.
inline void decode_split(const Problem& p, const DecodeScratch& ws, const DecodeScratch::PerThread& t,
                         const Sequence& seq, int64_t hk, int64_t j0, int64_t j1) {
  using V = vec_t<float>;
  constexpr int W = Simd<float>::W;
  constexpr int64_t C = kDecodeChunk;
  const int64_t R = ws.rows, group = p.nheads / p.nheads_k, dp = ws.dp, dvp = ws.dvp;
  const float scale = static_cast<float>(p.score.scale);
  const policy::WindowMask mask = seq.mask(p);
  const bool shaped = p.score.softcap > 0 || p.score.alibi_slopes != nullptr;
  for (int64_t r = 0; r < R; ++r) {
    const int64_t g = r / seq.seqlen_q, i = r % seq.seqlen_q;
    float* q = t.q + r * dp;
    load_row<float>(query_rows(p, p.q, seq, hk * group + g).row(i), p.dtype, q, p.headdim, 1.0f);
    for (int64_t c = p.headdim; c < dp; ++c) q[c] = 0.0f;
    t.m[r] = -std::numeric_limits<float>::infinity();
    t.l[r] = 0.0f;
    for (int64_t c = 0; c < dvp; c += W) vstore(t.o + r * dvp + c, V{});
  }
  const RowPtr krows = key_rows(p, p.k, seq, hk), vrows = key_rows(p, p.v, seq, hk);
  const float* kp[C];
  const float* vp[C];
  const int64_t es = dtype_size(p.dtype);
  for (int64_t jc = j0; jc < j1; jc += C) {
    const int64_t n = smin(C, j1 - jc);
    // The next chunk's rows, requested now: a head's rows sit a head stride apart (kilobytes), which the
    // hardware prefetchers follow poorly, and decoding is bound by these reads.
    for (int64_t jj = jc + C; jj < smin(jc + 2 * C, j1); ++jj) {
      prefetch_row(krows.row(jj), p.headdim * es);
      prefetch_row(vrows.row(jj), p.headdim_v * es);
    }
    stage_rows(p, krows, jc, n, p.headdim, dp, t.k, kp);
    int64_t r4 = 0;
    for (; r4 + 4 <= R; r4 += 4)
      for (int64_t jj = 0; jj < n; ++jj) dot_four_rows(t.q + r4 * dp, dp, kp[jj], scale, t.s + r4 * C + jj, C);
    for (int64_t r = 0; r < R; ++r) {
      float* s = t.s + r * C;
      if (r >= r4) {
        for (int64_t jj = 0; jj < n; ++jj) s[jj] = scale * dot_rows(t.q + r * dp, kp[jj], dp);
      }
      for (int64_t jj = n; jj < C; ++jj) s[jj] = -std::numeric_limits<float>::infinity();
      const int64_t i = r % seq.seqlen_q;
      if (shaped) {
        const int64_t h = hk * group + r / seq.seqlen_q;
        const float slope = alibi_slope(p, seq, h);
        for (int64_t jj = 0; jj < n; ++jj) {
          if (p.score.softcap > 0) s[jj] = p.score.softcap * std::tanh(s[jj] / p.score.softcap);
          if (slope != 0) s[jj] += policy::alibi_bias(slope, mask.diagonal(i), jc + jj);
        }
      }
      const policy::KeyRange seen = mask.keys_of(i);
      if (jc < seen.first || jc + n - 1 > seen.last) {
        for (int64_t jj = 0; jj < n; ++jj)
          if (jc + jj < seen.first || jc + jj > seen.last) s[jj] = -std::numeric_limits<float>::infinity();
      }
      V mx = vset(-std::numeric_limits<float>::infinity());
      for (int64_t jj = 0; jj < C; jj += W) mx = vmax(mx, vload(s + jj));
      const float m_new = smax(t.m[r], hmax(mx));
      if (m_new == -std::numeric_limits<float>::infinity()) {  // nothing visible yet: p = 0
        for (int64_t jj = 0; jj < C; ++jj) s[jj] = 0.0f;
        continue;
      }
      V sum{};
      for (int64_t jj = 0; jj < C; jj += W) {
        const V e = vexp(vload(s + jj) - vset(m_new));
        vstore(s + jj, e);
        sum += e;
      }
      const float alpha = std::exp(t.m[r] - m_new);  // 0 when m was -inf
      if (alpha != 1.0f) {
        for (int64_t c = 0; c < dvp; c += W) vstore(t.o + r * dvp + c, vload(t.o + r * dvp + c) * alpha);
      }
      t.l[r] = t.l[r] * alpha + hsum(sum);
      t.m[r] = m_new;
    }
    stage_rows(p, vrows, jc, n, p.headdim_v, dvp, t.v, vp);
    // O += P V, four vectors of a row's output held in registers across the chunk's keys.
    for (int64_t r = 0; r < R; ++r) {
      const float* pr = t.s + r * C;
      float* o = t.o + r * dvp;
      int64_t c = 0;
      for (; c + 4 * W <= dvp; c += 4 * W) {
        V o0 = vload(o + c), o1 = vload(o + c + W), o2 = vload(o + c + 2 * W), o3 = vload(o + c + 3 * W);
        for (int64_t jj = 0; jj < n; ++jj) {
          if (pr[jj] == 0.0f) continue;  // unseen (masked) keys: their values never reach o, even NaN ones
          const V pv = vset(pr[jj]);
          const float* v = vp[jj] + c;
          o0 += pv * vload(v);
          o1 += pv * vload(v + W);
          o2 += pv * vload(v + 2 * W);
          o3 += pv * vload(v + 3 * W);
        }
        vstore(o + c, o0);
        vstore(o + c + W, o1);
        vstore(o + c + 2 * W, o2);
        vstore(o + c + 3 * W, o3);
      }
      for (; c < dvp; c += W) {
        V acc = vload(o + c);
        for (int64_t jj = 0; jj < n; ++jj)
          if (pr[jj] != 0.0f) acc += vset(pr[jj]) * vload(vp[jj] + c);
        vstore(o + c, acc);
      }
    }
  }
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
  const int64_t R = ws.rows, S = ws.splits, dvp = ws.dvp, items = p.batch * p.nheads_k * S;
  constexpr float kInf = std::numeric_limits<float>::infinity();
#pragma omp parallel num_threads(nt)
  {
    const DecodeScratch::PerThread& t = ws.threads[omp_get_thread_num()];
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < items; ++item) {
      const int64_t b = item / (p.nheads_k * S), hk = (item / S) % p.nheads_k, split = item % S;
      const Sequence seq = sequence_of(p, b);
      if (seq.seqlen_q == 0) continue;
      // The keys any row sees, cut into S near-equal splits.
      const policy::KeyRange seen = seq.mask(p).keys_of_rows(0, seq.seqlen_q);
      const int64_t first = smax<int64_t>(seen.first, 0), end = smin(seen.last + 1, seq.seqlen_k);
      const int64_t len = smax<int64_t>(end - first, 0), per = (len + S - 1) / S;
      const int64_t j0 = first + smin(split * per, len), j1 = first + smin((split + 1) * per, len);
      decode_split(p, ws, t, seq, hk, j0, j1);
      for (int64_t r = 0; r < R; ++r) {
        const float l = t.l[r];
        const float lse = l > 0 ? t.m[r] + std::log(l) : -kInf;
        const float inv = l > 0 ? 1.0f / l : 0.0f;
        if (S == 1) {
          decode_store(p, seq, hk, r, t.o + r * dvp, inv, lse);
        } else {
          float* po = ws.part_o + (item * R + r) * dvp;
          for (int64_t c = 0; c < dvp; ++c) po[c] = t.o[r * dvp + c] * inv;
          ws.part_lse[item * R + r] = lse;
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
  }
}

inline size_t decode_scratch_bytes(const Problem& p, int nt) {
  Arena a;
  DecodeScratch ws;
  ws.layout(a, p, nt);
  return a.used();
}

}  // namespace flare::cpu::FLARE_ISA

// few_queries.hpp — the fp32 backward of calls whose sequences all have at most kFewQueries query rows
// (FlashAttention's race tests run 1 query against 239 keys and 3 against 799; cross-attention of a few
// queries, a decode-like step's gradient look the same). There the tile engines pack every key block as
// panels (K, Kᵀ, Vᵀ) for one to eight rows of products, and the call is the reading of K and V and the
// writing of dK and dV. Here one task per (sequence, kv head) group holds its few query rows (Q scaled, dO,
// lse, D) and streams the keys once: each key's K and V rows are read where they lie, requested a few keys
// ahead, its dK and dV rows written as soon as its rows have been seen, and dQ accumulates in key order
// (so the result does not depend on the thread count). The mirror of few_keys.hpp, which streams the
// queries of calls with few keys.
//
// Semantics are the tile engines': scale, softcap, ALiBi and the mask shape the scores (score_tile.hpp's
// order), P is recomputed from the saved lse (which carries any sink), rows that saw no key get dQ = 0, keys
// no row sees and keys past seqused_k get dK = dV = 0. Only keys a row sees enter its sums, so a NaN or
// infinity at a key a row cannot see never reaches it. Dropout stays with the tile engines, and so do bf16
// and fp16 (their few-query backward runs on the FMA engine after conversion, product_dot.hpp).
#pragma once

#include <omp.h>

#include <cmath>

#include "cpu/arena.hpp"
#include "cpu/cpu_backend.hpp"
#include "cpu/groups.hpp"
#include "cpu/score_tile.hpp"
#include "cpu/sequences.hpp"
#include "cpu/simd.hpp"
#include "cpu/sinks.hpp"

namespace flare::cpu::FLARE_ISA {

inline constexpr int64_t kFewQueries = 8;
// How far ahead the key rows are requested for reading (K, V) and for writing (dK, dV): the rows of one kv
// head lie a row of every kv head apart, which the hardware prefetchers do not follow. 3 x 799 at head dim
// 64, fp32, 2 threads on the EPYC: writes requested 8 ahead 1.21-1.26x the tile engines, none 1.10x.
inline constexpr int64_t kFewQueriesPrefetchRows = 4, kFewQueriesWritePrefetchRows = 8;

// Whether a backward call takes this path: fp32, every sequence has at most kFewQueries query rows, no
// dropout, and at least as many (sequence, kv head) groups as threads (one task per group). Calls of at most
// kFewKeys keys take few_keys.hpp's path first.
inline bool few_queries_applies(const Problem& p, int nt) {
  return p.pass == Pass::kBackward && p.dropout_p == 0.0f && p.dtype == FLARE_DTYPE_F32 &&
         p.batch * p.nheads_k >= nt && longest_sequence(p).queries <= kFewQueries;
}

// The backward (FlashAttention 2's, P recomputed from the saved lse): per key j and row i of head h that sees
// it, s = softcap(scale q.k_j) + alibi, P = exp(s - lse), dP = dO.v_j, dS = P (dP - D) (* (1 - tanh^2)),
// dK_j += scale dS q, dV_j += P dO, dQ += scale dS k_j, with D = rowsum(dO * O).
struct FewQueriesBackward {
  struct Scratch {
    int64_t dp = 0, dvp = 0, rows = 0;  // rows: the group's query rows, query heads x longest seqlen_q
    struct PerThread {
      float *q, *dout, *dq;  // the group's rows: Q scaled, dO, dQ (unscaled)
      float *lse, *delta;    // per row
      int64_t *first, *last;  // the keys each row sees (first > last: none)
      ScoreShape* shape;      // per query head of the group: softcap, ALiBi slope
      float *k, *v;           // the key being worked on
      float *dk, *dv;         // its gradients
    };
    PerThread* threads = nullptr;

    void layout(Arena& a, const Problem& p, int nt) {
      constexpr int W = Simd<float>::W;
      dp = round_up(p.headdim, W);
      dvp = round_up(p.headdim_v, W);
      const int64_t group = p.nheads / p.nheads_k;
      rows = group * longest_sequence(p).queries;
      threads = a.take<PerThread>(nt);
      for (int t = 0; t < nt; ++t) {
        PerThread pt{a.take<float>(rows * dp), a.take<float>(rows * dvp), a.take<float>(rows * dp),
                     a.take<float>(rows), a.take<float>(rows), a.take<int64_t>(rows), a.take<int64_t>(rows),
                     a.take<ScoreShape>(group), a.take<float>(dp), a.take<float>(dvp), a.take<float>(dp),
                     a.take<float>(dvp)};
        if (threads) threads[t] = pt;
      }
    }
  };

  // Group (seq, hk): its query rows gathered, then every key in order.
  static void group(const Problem& p, const Sequence& seq, int64_t hk, const Scratch& ws,
                    const Scratch::PerThread& t) {
    using V = vec_t<float>;
    constexpr int W = Simd<float>::W;
    const int64_t d = p.headdim, dv = p.headdim_v, dp = ws.dp, dvp = ws.dvp, nq = seq.seqlen_q;
    const int64_t group = p.nheads / p.nheads_k;
    const float scale = static_cast<float>(p.score.scale);
    const policy::WindowMask mask = seq.mask(p);
    for (int64_t g = 0; g < group; ++g) {
      const int64_t h = hk * group + g;
      const RowPtr qrows = query_rows(p, p.q, seq, h), dorows = query_rows(p, p.dout, seq, h),
                   orows = query_rows(p, p.out, seq, h);
      const float* lse = lse_row(p, seq, h);
      t.shape[g] = score_shape(p, seq, h);
      for (int64_t i = 0; i < nq; ++i) {
        const int64_t r = g * nq + i;
        float *q = t.q + r * dp, *dout = t.dout + r * dvp, *o = t.dv;  // O staged in dV's row (zeroed below)
        for (int64_t c = 0; c < dp; ++c) t.dq[r * dp + c] = 0.0f;
        const policy::KeyRange keys = mask.keys_of(i);
        t.first[r] = smax<int64_t>(keys.first, 0);
        t.last[r] = smin<int64_t>(keys.last, seq.seqlen_k - 1);
        t.lse[r] = lse[i];
        if (t.first[r] > t.last[r] || lse[i] == kNegInf) {  // the row sees no key: it takes no part
          t.first[r] = 1;
          t.last[r] = 0;
          continue;
        }
        load_row<float>(qrows.row(i), p.dtype, q, d, scale);
        load_row<float>(dorows.row(i), p.dtype, dout, dv, 1.0f);
        load_row<float>(orows.row(i), p.dtype, o, dv, 1.0f);
        for (int64_t c = d; c < dp; ++c) q[c] = 0.0f;
        for (int64_t c = dv; c < dvp; ++c) dout[c] = o[c] = 0.0f;
        V acc{};
        for (int64_t c = 0; c < dvp; c += W) acc += vload(dout + c) * vload(o + c);
        t.delta[r] = hsum(acc);
      }
    }
    const RowPtr krows = key_rows(p, p.k, seq, hk), vrows = key_rows(p, p.v, seq, hk);
    const RowPtr dkrows = key_rows(p, p.dk, seq, hk), dvrows = key_rows(p, p.dv, seq, hk);
    const int64_t es = dtype_size(p.dtype);
    for (int64_t c = d; c < dp; ++c) t.k[c] = 0.0f;
    for (int64_t c = dv; c < dvp; ++c) t.v[c] = 0.0f;
    for (int64_t j = 0; j < seq.seqlen_k; ++j) {
      if (j + kFewQueriesPrefetchRows < seq.seqlen_k) {
        prefetch_bytes(krows.row(j + kFewQueriesPrefetchRows), d * es);
        prefetch_bytes(vrows.row(j + kFewQueriesPrefetchRows), dv * es);
      }
      if (j + kFewQueriesWritePrefetchRows < seq.seqlen_k) {
        prefetch_bytes<Fetch::kWrite>(dkrows.row(j + kFewQueriesWritePrefetchRows), d * es);
        prefetch_bytes<Fetch::kWrite>(dvrows.row(j + kFewQueriesWritePrefetchRows), dv * es);
      }
      load_row<float>(krows.row(j), p.dtype, t.k, d, 1.0f);
      load_row<float>(vrows.row(j), p.dtype, t.v, dv, 1.0f);
      for (int64_t c = 0; c < dp; c += W) vstore(t.dk + c, V{});
      for (int64_t c = 0; c < dvp; c += W) vstore(t.dv + c, V{});
      for (int64_t g = 0; g < group; ++g) {
        for (int64_t i = 0; i < nq; ++i) {
          const int64_t r = g * nq + i;
          if (j < t.first[r] || j > t.last[r]) continue;
          const float* q = t.q + r * dp;
          const float* dout = t.dout + r * dvp;
          V sacc{}, pacc{};
          for (int64_t c = 0; c < dp; c += W) sacc += vload(q + c) * vload(t.k + c);
          for (int64_t c = 0; c < dvp; c += W) pacc += vload(dout + c) * vload(t.v + c);
          const auto [pr, ds] =
              backward_element(hsum(sacc), hsum(pacc), t.lse[r], t.delta[r], t.shape[g], mask.diagonal(i), j);
          float* dq = t.dq + r * dp;
          for (int64_t c = 0; c < dp; c += W) {
            vstore(t.dk + c, vload(t.dk + c) + ds * vload(q + c));
            vstore(dq + c, vload(dq + c) + ds * vload(t.k + c));
          }
          for (int64_t c = 0; c < dvp; c += W) vstore(t.dv + c, vload(t.dv + c) + pr * vload(dout + c));
        }
      }
      store_row<float>(t.dk, 1.0f, dkrows.row(j), p.dtype, d);
      store_row<float>(t.dv, 1.0f, dvrows.row(j), p.dtype, dv);
    }
    static constexpr float kZeros[kMaxHeaddim] = {};  // keys past seqlen_k (varlen padding) get zeros
    for (int64_t j = seq.seqlen_k; j < seq.stored_k; ++j) {
      store_row<float>(kZeros, 1.0f, dkrows.row(j), p.dtype, d);
      store_row<float>(kZeros, 1.0f, dvrows.row(j), p.dtype, dv);
    }
    for (int64_t g = 0; g < group; ++g) {
      const RowPtr dqrows = query_rows(p, p.dq, seq, hk * group + g);
      for (int64_t i = 0; i < nq; ++i) store_row<float>(t.dq + (g * nq + i) * dp, scale, dqrows.row(i), p.dtype, d);
    }
  }
};

inline size_t few_queries_backward_scratch(const Problem& p, int nt) {
  return scratch_bytes<FewQueriesBackward>(p, nt);
}

// One task per (sequence, kv head) group (run_group_tasks); then the sinks' gradient (sinks.hpp).
inline void few_queries_backward(const Problem& p, void* scratch, int nt) {
  run_group_tasks<FewQueriesBackward>(p, scratch, nt);
  sink_gradient(p, nt);
}

}  // namespace flare::cpu::FLARE_ISA

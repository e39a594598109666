// backward.hpp — the CPU backward pass (FlashAttention-2 style: recompute P from the saved lse).
//
// For each (sequence, kv head) group, K, K^T panels and V^T panels are packed once and dK/dV accumulate in
// the compute type. For each query head of the group, Q (scaled), dO, D = rowsum(dO * O) and lse are packed;
// key blocks are spread over the threads (each block owned by one thread, so dK/dV need no atomics), and
// each thread sums its share of dQ in a private buffer; the buffers are then added in thread order, so a
// fixed thread count gives bitwise-identical results. Per (query tile, key block):
//   S = Q K^T -> softcap/ALiBi/mask -> P = exp(S - lse);  dV += P^T dO;  dP = dO V^T;
//   dS = P * (dP - D) (* (1 - tanh^2) under softcap);  dK += dS^T Q;  dQ += dS K.
// Q carries the softmax scale, so dK needs no extra factor and dQ is scaled once at the end.
#pragma once

#include <omp.h>

#include "cpu/arena.hpp"
#include "cpu/score_tile.hpp"
#include "cpu/sequences.hpp"
#include "cpu/tile_gemm.hpp"

namespace flare::cpu::FLARE_ISA {

template <class T>
struct BackwardTiles {
  static constexpr int64_t kBq = 64;
  static constexpr int64_t kBk = 64;
};

template <class T>
struct BackwardScratch {
  int64_t dp = 0, dvp = 0, nkb = 0, nqb = 0;
  T *k = nullptr, *kt = nullptr, *vt = nullptr, *dk = nullptr, *dv = nullptr;  // per group
  T *q = nullptr, *dout = nullptr, *delta = nullptr, *lse = nullptr;           // per query head
  struct PerThread {
    T *dq, *s, *dp, *pt, *tanh;
  };
  PerThread* threads = nullptr;

  void layout(Arena& a, const Problem& p, int nt) {
    using Tiles = BackwardTiles<T>;
    constexpr int W = Simd<T>::W;
    dp = round_up(p.headdim, W);
    dvp = round_up(p.headdim_v, W);
    nkb = (p.seqlen_k + Tiles::kBk - 1) / Tiles::kBk;
    nqb = (p.seqlen_q + Tiles::kBq - 1) / Tiles::kBq;
    const int64_t nk = nkb * Tiles::kBk, nq = nqb * Tiles::kBq;
    k = a.take<T>(nk * dp);
    kt = a.take<T>(nk * p.headdim);
    vt = a.take<T>(nk * p.headdim_v);
    dk = a.take<T>(nk * dp);
    dv = a.take<T>(nk * dvp);
    q = a.take<T>(nq * dp);
    dout = a.take<T>(nq * dvp);
    delta = a.take<T>(nq);
    lse = a.take<T>(nq);
    threads = a.take<PerThread>(nt);
    for (int t = 0; t < nt; ++t) {
      const int64_t tile = Tiles::kBq * Tiles::kBk;
      PerThread pt{a.take<T>(nq * dp), a.take<T>(tile), a.take<T>(tile), a.take<T>(tile), a.take<T>(tile)};
      if (threads) threads[t] = pt;
    }
  }
};

// Packs key block kb of one kv head: K rows (padded to dp), K^T and V^T panels, and zeroes dK/dV.
template <class T>
inline void pack_backward_keys(const Problem& p, const RowPtr& krows, const RowPtr& vrows, int64_t seqlen_k,
                               int64_t kb, BackwardScratch<T>& ws, T* row_buf) {
  constexpr int64_t Bk = BackwardTiles<T>::kBk;
  const int64_t d = p.headdim, dv = p.headdim_v;
  T* kt = ws.kt + kb * Bk * d;
  T* vt = ws.vt + kb * Bk * dv;
  for (int64_t jj = 0; jj < Bk; ++jj) {
    const int64_t j = kb * Bk + jj;
    T* kr = ws.k + j * ws.dp;
    for (int64_t c = 0; c < ws.dp; ++c) kr[c] = T(0);
    if (j < seqlen_k) load_row<T>(krows.row(j), p.dtype, kr, d, T(1));
    for (int64_t c = 0; c < d; ++c) kt[c * Bk + jj] = kr[c];
    if (j < seqlen_k) {
      load_row<T>(vrows.row(j), p.dtype, row_buf, dv, T(1));
    } else {
      for (int64_t c = 0; c < dv; ++c) row_buf[c] = T(0);
    }
    for (int64_t c = 0; c < dv; ++c) vt[c * Bk + jj] = row_buf[c];
    for (int64_t c = 0; c < ws.dp; ++c) ws.dk[j * ws.dp + c] = T(0);
    for (int64_t c = 0; c < ws.dvp; ++c) ws.dv[j * ws.dvp + c] = T(0);
  }
}

// Packs query tile qt of head h: scaled Q, dO, D = rowsum(dO * O) and lse (rows that see no key, and
// padding rows, get lse = +inf so that P = exp(S - lse) is 0 there).
template <class T>
inline void pack_backward_queries(const Problem& p, const Sequence& seq, int64_t h, int64_t qt,
                                  BackwardScratch<T>& ws, T* row_buf) {
  constexpr int64_t Bq = BackwardTiles<T>::kBq;
  const int64_t d = p.headdim, dv = p.headdim_v;
  const RowPtr qrows = query_rows(p, p.q, seq, h), dorows = query_rows(p, p.dout, seq, h),
               orows = query_rows(p, p.out, seq, h);
  const float* lse = lse_row(p, seq, h);
  for (int64_t ii = 0; ii < Bq; ++ii) {
    const int64_t i = qt * Bq + ii;
    T* qr = ws.q + i * ws.dp;
    T* dor = ws.dout + i * ws.dvp;
    for (int64_t c = 0; c < ws.dp; ++c) qr[c] = T(0);
    for (int64_t c = 0; c < ws.dvp; ++c) dor[c] = T(0);
    ws.delta[i] = T(0);
    ws.lse[i] = static_cast<T>(__builtin_inff());
    if (i >= seq.seqlen_q) continue;
    load_row<T>(qrows.row(i), p.dtype, qr, d, static_cast<T>(p.score.scale));
    load_row<T>(dorows.row(i), p.dtype, dor, dv, T(1));
    load_row<T>(orows.row(i), p.dtype, row_buf, dv, T(1));
    T delta = 0;
    for (int64_t c = 0; c < dv; ++c) delta += dor[c] * row_buf[c];
    ws.delta[i] = delta;
    if (lse[i] != kNegInf) ws.lse[i] = static_cast<T>(lse[i]);
  }
}

// Key block kb against query tile qt: accumulates dK/dV of the block and this thread's dQ of the tile.
template <class T>
inline void backward_tile(const Problem& p, const Sequence& seq, int64_t h, int64_t kb, int64_t qt,
                          const BackwardScratch<T>& ws, const typename BackwardScratch<T>::PerThread& t) {
  using V = vec_t<T>;
  constexpr int W = Simd<T>::W;
  constexpr int64_t Bq = BackwardTiles<T>::kBq, Bk = BackwardTiles<T>::kBk;
  const int64_t d = p.headdim, dv = p.headdim_v, dp = ws.dp, dvp = ws.dvp;
  const int64_t i0 = qt * Bq, j0 = kb * Bk;
  const int64_t rows = smin(Bq, seq.seqlen_q - i0);
  const policy::WindowMask mask = seq.mask(p);
  const T* q = ws.q + i0 * dp;
  const T* dout = ws.dout + i0 * dvp;

  gemm_tile<T, false>(Bq, Bk, d, q, dp, ws.kt + kb * Bk * d, Bk, t.s, Bk);
  ScoreShape shape;
  shape.softcap = p.score.softcap;
  shape.alibi = p.score.alibi_slopes != nullptr;
  shape.slope = alibi_slope(p, seq, h);
  shape_scores<T>(t.s, Bk, rows, Bk, i0, j0, mask, shape, t.tanh);
  // Keys past the sequence end sit in the last block; rows past it have lse = +inf (P = 0).
  for (int64_t r = 0; r < Bq; ++r) {
    T* srow = t.s + r * Bk;
    const T lse = ws.lse[i0 + r];
    for (int64_t c = 0; c < Bk; c += W) {
      const V j = viota<T>() + static_cast<T>(j0 + c);
      const V e = vexp(vload(srow + c) - lse);
      vstore(srow + c, j < static_cast<T>(seq.seqlen_k) ? e : V{});
    }
  }
  transpose_tile<T>(t.s, Bq, Bk, Bk, t.pt, Bq);                                  // P^T (Bk x Bq)
  gemm_tile<T, true>(Bk, dvp, Bq, t.pt, Bq, dout, dvp, ws.dv + j0 * dvp, dvp);    // dV += P^T dO
  gemm_tile<T, false>(Bq, Bk, dv, dout, dvp, ws.vt + kb * Bk * dv, Bk, t.dp, Bk);  // dP = dO V^T
  for (int64_t r = 0; r < Bq; ++r) {
    T* ds = t.dp + r * Bk;
    const T* pr = t.s + r * Bk;
    const T delta = ws.delta[i0 + r];
    if (shape.softcap > 0) {
      const T* th = t.tanh + r * Bk;
      for (int64_t c = 0; c < Bk; c += W) {
        const V tv = vload(th + c);
        vstore(ds + c, vload(pr + c) * (vload(ds + c) - delta) * (T(1) - tv * tv));
      }
    } else {
      for (int64_t c = 0; c < Bk; c += W) vstore(ds + c, vload(pr + c) * (vload(ds + c) - delta));
    }
  }
  transpose_tile<T>(t.dp, Bq, Bk, Bk, t.pt, Bq);                                 // dS^T (Bk x Bq)
  gemm_tile<T, true>(Bk, dp, Bq, t.pt, Bq, q, dp, ws.dk + j0 * dp, dp);          // dK += dS^T Q
  gemm_tile<T, true>(Bq, dp, Bk, t.dp, Bk, ws.k + j0 * dp, dp, t.dq + i0 * dp, dp);  // dQ += dS K
}

template <class T>
inline size_t backward_scratch_bytes(const Problem& p, int nt) {
  Arena a;
  BackwardScratch<T> ws;
  ws.layout(a, p, nt);
  return a.used();
}

template <class T>
inline void backward_impl(const Problem& p, void* scratch, int nt) {
  using V = vec_t<T>;
  constexpr int W = Simd<T>::W;
  constexpr int64_t Bq = BackwardTiles<T>::kBq, Bk = BackwardTiles<T>::kBk;
  Arena arena(scratch);
  BackwardScratch<T> ws;
  ws.layout(arena, p, nt);
  const int64_t group = p.nheads / p.nheads_k;
  const int64_t dp = ws.dp;

#pragma omp parallel num_threads(nt)
  {
    const int tid = omp_get_thread_num();
    const auto& mine = ws.threads[tid];
    for (int64_t b = 0; b < p.batch; ++b) {
      const Sequence seq = sequence_of(p, b);
      const policy::WindowMask mask = seq.mask(p);
      const int64_t nkb = (seq.seqlen_k + Bk - 1) / Bk, nqb = (seq.seqlen_q + Bq - 1) / Bq;
      for (int64_t hk = 0; hk < p.nheads_k; ++hk) {
        const RowPtr krows = key_rows(p, p.k, seq, hk), vrows = key_rows(p, p.v, seq, hk);
#pragma omp for schedule(static)
        for (int64_t kb = 0; kb < nkb; ++kb) pack_backward_keys<T>(p, krows, vrows, seq.seqlen_k, kb, ws, mine.s);
        for (int64_t g = 0; g < group; ++g) {
          const int64_t h = hk * group + g;
#pragma omp for schedule(static)
          for (int64_t qt = 0; qt < nqb; ++qt) pack_backward_queries<T>(p, seq, h, qt, ws, mine.s);
          for (int64_t x = 0; x < nqb * Bq * dp; x += W) vstore(mine.dq + x, V{});
          // Round-robin blocks: under a causal mask late key blocks have fewer queries.
#pragma omp for schedule(static, 1)
          for (int64_t kb = 0; kb < nkb; ++kb) {
            const policy::KeyRange queries = mask.queries_of_keys(kb * Bk, smin((kb + 1) * Bk, seq.seqlen_k));
            const int64_t first = smax<int64_t>(queries.first, 0);
            const int64_t last = smin<int64_t>(queries.last, seq.seqlen_q - 1);
            for (int64_t qt = first / Bq; first <= last && qt <= last / Bq; ++qt)
              backward_tile<T>(p, seq, h, kb, qt, ws, mine);
          }
          // dq = scale * sum over threads, in thread order.
          const RowPtr dqrows = query_rows(p, p.dq, seq, h);
#pragma omp for schedule(static)
          for (int64_t i = 0; i < seq.seqlen_q; ++i) {
            T* acc = ws.threads[0].dq + i * dp;
            for (int other = 1; other < nt; ++other) {
              const T* src = ws.threads[other].dq + i * dp;
              for (int64_t c = 0; c < dp; c += W) vstore(acc + c, vload(acc + c) + vload(src + c));
            }
            store_row<T>(acc, static_cast<T>(p.score.scale), dqrows.row(i), p.dtype, p.headdim);
          }
        }
        const RowPtr dkrows = key_rows(p, p.dk, seq, hk), dvrows = key_rows(p, p.dv, seq, hk);
#pragma omp for schedule(static)
        for (int64_t j = 0; j < seq.seqlen_k; ++j) {
          store_row<T>(ws.dk + j * dp, T(1), dkrows.row(j), p.dtype, p.headdim);
          store_row<T>(ws.dv + j * ws.dvp, T(1), dvrows.row(j), p.dtype, p.headdim_v);
        }
      }
    }
  }
}

}  // namespace flare::cpu::FLARE_ISA

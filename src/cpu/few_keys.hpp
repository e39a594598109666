// few_keys.hpp — the backward of calls whose sequences all have at most kFewKeys keys (FlashAttention's
// race tests run 239 queries against one key and 799 against three; encoder-decoder calls with a few
// memory slots look the same). The tile engines would pad each row's keys to a block of 16-32 columns and
// pay per tile for the products, the recomputed softmax and the dS passes for one to eight real keys. Here
// one task per (sequence, kv head) group walks every row of its query heads against the keys that row
// sees, in fp32, with the group's few K and V rows converted once: dQ is written per row, and the keys' dK
// and dV accumulate in row order (so the result does not depend on the thread count).
//
// Semantics are the tile engines': scale, softcap, ALiBi and the mask shape the scores (score_tile.hpp's
// order), P is recomputed from the saved lse (which carries any sink), rows that saw no key get dQ = 0, keys
// past seqused_k get dK = dV = 0. Only keys a row sees enter its sums, so a NaN or infinity at a key a row
// cannot see never reaches it. Dropout stays with the tile engines (few_keys_applies). (A row-at-a-time
// forward was tried as well: no faster than the tile engines' forward at these shapes, so not kept;
// docs/tuning-cpu.md.)
#pragma once

#include <omp.h>

#include <cmath>
#include <type_traits>

#include "cpu/arena.hpp"
#include "cpu/cpu_backend.hpp"
#include "cpu/groups.hpp"
#include "cpu/score_tile.hpp"
#include "cpu/sequences.hpp"
#include "cpu/simd.hpp"
#include "cpu/sinks.hpp"

namespace flare::cpu::FLARE_ISA {

inline constexpr int64_t kFewKeys = 8;
// How far ahead the backward requests query rows: 799 x 3 at head dim 64, fp32, 2 threads on the EPYC took
// 36-37 ms with none, 30-32 at 1, 28-31 at 2 to 16 (docs/tuning-cpu.md).
inline constexpr int64_t kFewKeysPrefetchRows = 4;

// Whether a backward call takes this path: every sequence has at most kFewKeys keys, no dropout, a compute
// type of fp32 (fp64 keeps the FMA engine in double), and at least as many (sequence, kv head) groups as
// threads (one task per group).
inline bool few_keys_applies(const Problem& p, int nt) {
  return p.pass == Pass::kBackward && p.dropout_p == 0.0f && p.dtype != FLARE_DTYPE_F64 &&
         p.batch * p.nheads_k >= nt && longest_sequence(p).keys <= kFewKeys;
}

// Calls f(std::integral_constant<int, n>) for n visible keys (1 <= n <= kFewKeys): one instantiation of a
// row per count keeps its accumulators in registers. Always inlined: when GCC left it out of line (the unit
// grew by few_queries.hpp), the fp32 239 x 1 backward took 6.6-8.1 ms instead of 5.0-5.9.
template <class F>
[[gnu::always_inline]] inline void with_key_count(int64_t n, F f) {
  static_assert(kFewKeys == 8, "one case per count");
  switch (n) {
    case 1: return f(std::integral_constant<int, 1>{});
    case 2: return f(std::integral_constant<int, 2>{});
    case 3: return f(std::integral_constant<int, 3>{});
    case 4: return f(std::integral_constant<int, 4>{});
    case 5: return f(std::integral_constant<int, 5>{});
    case 6: return f(std::integral_constant<int, 6>{});
    case 7: return f(std::integral_constant<int, 7>{});
    default: return f(std::integral_constant<int, 8>{});
  }
}

// The backward (FlashAttention 2's, P recomputed from the saved lse): per row i of head h and key j it sees,
//   s = softcap(scale q.k_j) + alibi,  P = exp(s - lse),  dP = dO.v_j,  dS = P (dP - D) (* (1 - tanh^2)),
//   dQ += scale dS k_j,  dK_j += scale dS q,  dV_j += P dO,  with D = rowsum(dO * O).
struct FewKeysBackward {
  struct Scratch {
    int64_t dp = 0, dvp = 0;
    struct PerThread {
      float *k, *v;      // the group's keys (kFewKeys x dp) and values (kFewKeys x dvp)
      float *dk, *dv;    // their gradients
      float *q, *dout;   // one row of Q (scaled) and dO
      float *o, *dq;     // one row of O and of dQ
    };
    PerThread* threads = nullptr;

    void layout(Arena& a, const Problem& p, int nt) {
      constexpr int W = Simd<float>::W;
      dp = round_up(p.headdim, W);
      dvp = round_up(p.headdim_v, W);
      threads = a.take<PerThread>(nt);
      for (int t = 0; t < nt; ++t) {
        PerThread pt{a.take<float>(kFewKeys * dp), a.take<float>(kFewKeys * dvp), a.take<float>(kFewKeys * dp),
                     a.take<float>(kFewKeys * dvp), a.take<float>(dp), a.take<float>(dvp), a.take<float>(dvp),
                     a.take<float>(dp)};
        if (threads) threads[t] = pt;
      }
    }
  };

  // Group (seq, hk): every row of its query heads, then its dK and dV rows.
  static void group(const Problem& p, const Sequence& seq, int64_t hk, const Scratch& ws, const Scratch::PerThread& t) {
    const int64_t d = p.headdim, dv = p.headdim_v, dp = ws.dp, dvp = ws.dvp;
    const float scale = static_cast<float>(p.score.scale);
    const RowPtr krows = key_rows(p, p.k, seq, hk), vrows = key_rows(p, p.v, seq, hk);
    for (int64_t j = 0; j < seq.seqlen_k; ++j) {
      load_row<float>(krows.row(j), p.dtype, t.k + j * dp, d, 1.0f);
      load_row<float>(vrows.row(j), p.dtype, t.v + j * dvp, dv, 1.0f);
      for (int64_t c = d; c < dp; ++c) t.k[j * dp + c] = 0.0f;
      for (int64_t c = dv; c < dvp; ++c) t.v[j * dvp + c] = 0.0f;
    }
    for (int64_t x = 0; x < kFewKeys * dp; ++x) t.dk[x] = 0.0f;
    for (int64_t x = 0; x < kFewKeys * dvp; ++x) t.dv[x] = 0.0f;
    for (int64_t c = d; c < dp; ++c) t.q[c] = 0.0f;
    for (int64_t c = dv; c < dvp; ++c) t.dout[c] = t.o[c] = 0.0f;
    const policy::WindowMask mask = seq.mask(p);
    const int64_t group = p.nheads / p.nheads_k, es = dtype_size(p.dtype);
    for (int64_t h = hk * group; h < (hk + 1) * group; ++h) {
      const RowPtr qrows = query_rows(p, p.q, seq, h), dorows = query_rows(p, p.dout, seq, h),
                   orows = query_rows(p, p.out, seq, h), dqrows = query_rows(p, p.dq, seq, h);
      const float* lse = lse_row(p, seq, h);
      const ScoreShape shape = score_shape(p, seq, h);
      for (int64_t i = 0; i < seq.seqlen_q; ++i) {
        // A row's Q, dO and O rows are requested kFewKeysPrefetchRows ahead: with the work of a few keys
        // between them, the loads of one row after another are otherwise waited on one at a time.
        if (i + kFewKeysPrefetchRows < seq.seqlen_q) {
          prefetch_bytes(qrows.row(i + kFewKeysPrefetchRows), d * es);
          prefetch_bytes(dorows.row(i + kFewKeysPrefetchRows), dv * es);
          prefetch_bytes(orows.row(i + kFewKeysPrefetchRows), dv * es);
        }
        const policy::KeyRange keys = mask.keys_of(i);
        const int64_t first = smax<int64_t>(keys.first, 0), last = smin<int64_t>(keys.last, seq.seqlen_k - 1);
        for (int64_t c = 0; c < dp; ++c) t.dq[c] = 0.0f;
        if (first <= last && lse[i] != kNegInf) {
          load_row<float>(qrows.row(i), p.dtype, t.q, d, scale);
          load_row<float>(dorows.row(i), p.dtype, t.dout, dv, 1.0f);
          with_key_count(last - first + 1, [&](auto count) {
            row<decltype(count)::value>(p, mask, shape, orows, lse[i], i, first, ws, t);
          });
        }
        store_row<float>(t.dq, scale, dqrows.row(i), p.dtype, d);
      }
    }
    const RowPtr dkrows = key_rows(p, p.dk, seq, hk), dvrows = key_rows(p, p.dv, seq, hk);
    static constexpr float kZeros[kMaxHeaddim] = {};  // keys past seqlen_k (varlen padding) get zeros
    for (int64_t j = 0; j < seq.stored_k; ++j) {
      const bool used = j < seq.seqlen_k;
      store_row<float>(used ? t.dk + j * dp : kZeros, 1.0f, dkrows.row(j), p.dtype, d);
      store_row<float>(used ? t.dv + j * dvp : kZeros, 1.0f, dvrows.row(j), p.dtype, dv);
    }
  }

  // Row i (t.q scaled, t.dout) against its C visible keys from `first`: adds to t.dq (unscaled) and the keys'
  // dK and dV.
  template <int C>
  static void row(const Problem& p, const policy::WindowMask& mask, const ScoreShape& shape, const RowPtr& orows,
                  float lse, int64_t i, int64_t first, const Scratch& ws, const Scratch::PerThread& t) {
    using V = vec_t<float>;
    constexpr int W = Simd<float>::W;
    const int64_t dp = ws.dp, dvp = ws.dvp, dv = p.headdim_v;
    const float* k = t.k + first * dp;
    const float* v = t.v + first * dvp;
    float* dk = t.dk + first * dp;
    float* dvv = t.dv + first * dvp;
    V sacc[C] = {}, pacc[C] = {};
    for (int64_t c = 0; c < dp; c += W) {
      const V q = vload(t.q + c);
      for (int j = 0; j < C; ++j) sacc[j] += q * vload(k + j * dp + c);
    }
    // D = rowsum(dO * O), O read back from the forward's output.
    float* o = t.o;
    load_row<float>(orows.row(i), p.dtype, o, dv, 1.0f);
    V dacc{};
    for (int64_t c = 0; c < dvp; c += W) {
      const V g = vload(t.dout + c);
      dacc += g * vload(o + c);
      for (int j = 0; j < C; ++j) pacc[j] += g * vload(v + j * dvp + c);
    }
    const float delta = hsum(dacc);
    float pr[C], ds[C];
    for (int j = 0; j < C; ++j) {
      const ProbAndGrad e = backward_element(hsum(sacc[j]), hsum(pacc[j]), lse, delta, shape, mask.diagonal(i), first + j);
      pr[j] = e.p;
      ds[j] = e.ds;
    }
    for (int64_t c = 0; c < dp; c += W) {
      const V q = vload(t.q + c);
      V g{};
      for (int j = 0; j < C; ++j) {
        g += ds[j] * vload(k + j * dp + c);
        vstore(dk + j * dp + c, vload(dk + j * dp + c) + ds[j] * q);
      }
      vstore(t.dq + c, g);
    }
    for (int64_t c = 0; c < dvp; c += W) {
      const V g = vload(t.dout + c);
      for (int j = 0; j < C; ++j) vstore(dvv + j * dvp + c, vload(dvv + j * dvp + c) + pr[j] * g);
    }
  }
};

inline size_t few_keys_backward_scratch(const Problem& p, int nt) { return scratch_bytes<FewKeysBackward>(p, nt); }

// One task per (sequence, kv head) group (run_group_tasks); then the sinks' gradient (sinks.hpp).
inline void few_keys_backward(const Problem& p, void* scratch, int nt) {
  run_group_tasks<FewKeysBackward>(p, scratch, nt);
  sink_gradient(p, nt);
}

}  // namespace flare::cpu::FLARE_ISA

// few_keys.hpp — the forward of calls whose sequences all have at most kFewKeys keys (FlashAttention's
// race tests run 239 queries against one key and 799 against three; encoder-decoder calls with a few
// memory slots look the same). The tile engines would pad each row's keys to a block of 16-32 columns and
// pay per tile for the products, the online softmax's passes and its reductions, for one to eight real
// keys; here each query row takes its scores against the keys it sees, their softmax and the weighted sum
// of their values directly, in fp32, with the kv head's few K and V rows converted once per task.
//
// Semantics are the tile engines': scale, softcap, ALiBi and the mask shape the scores (score_tile.hpp's
// order), a sink is folded into out and lse (policy::fold_sink), a row that sees no key gets out = 0 and
// lse = -inf (or the sink). Only keys a row sees enter its sums, so a NaN or infinity in V reaches exactly
// the rows that see its key. Dropout stays with the tile engines (few_keys_applies).
#pragma once

#include <omp.h>

#include <cmath>

#include "cpu/arena.hpp"
#include "cpu/score_tile.hpp"
#include "cpu/sequences.hpp"
#include "cpu/simd.hpp"

namespace flare::cpu::FLARE_ISA {

inline constexpr int64_t kFewKeys = 8;

// Whether a forward call takes this path: every sequence has at most kFewKeys keys, no dropout, and a
// compute type of fp32 (fp64 keeps the FMA engine in double).
inline bool few_keys_applies(const Problem& p) {
  return p.pass == Pass::kForward && p.dropout_p == 0.0f && p.dtype != FLARE_DTYPE_F64 &&
         longest_sequence(p).keys <= kFewKeys;
}

struct FewKeysForward {
  static constexpr int64_t kRowsPerTask = 256;  // a task: one head of one sequence, this many query rows

  struct Scratch {
    int64_t dp = 0, dvp = 0;  // head dims padded to the vector width
    struct PerThread {
      float* k;  // the kv head's keys, kFewKeys x dp
      float* v;  // and values, kFewKeys x dvp
      float* q;  // one query row, dp
      float* o;  // one output row, dvp
    };
    PerThread* threads = nullptr;

    void layout(Arena& a, const Problem& p, int nt) {
      constexpr int W = Simd<float>::W;
      dp = round_up(p.headdim, W);
      dvp = round_up(p.headdim_v, W);
      threads = a.take<PerThread>(nt);
      for (int t = 0; t < nt; ++t) {
        PerThread pt{a.take<float>(kFewKeys * dp), a.take<float>(kFewKeys * dvp), a.take<float>(dp),
                     a.take<float>(dvp)};
        if (threads) threads[t] = pt;
      }
    }
  };

  // Rows [i0, i1) of head h of sequence seq.
  static void rows(const Problem& p, const Sequence& seq, int64_t h, int64_t i0, int64_t i1, const Scratch& ws,
                   const Scratch::PerThread& t) {
    const int64_t d = p.headdim, dv = p.headdim_v, dp = ws.dp, dvp = ws.dvp;
    const int64_t hk = h / (p.nheads / p.nheads_k);
    const RowPtr krows = key_rows(p, p.k, seq, hk), vrows = key_rows(p, p.v, seq, hk);
    for (int64_t j = 0; j < seq.seqlen_k; ++j) {
      float* kr = t.k + j * dp;
      float* vr = t.v + j * dvp;
      load_row<float>(krows.row(j), p.dtype, kr, d, 1.0f);
      load_row<float>(vrows.row(j), p.dtype, vr, dv, 1.0f);
      for (int64_t c = d; c < dp; ++c) kr[c] = 0.0f;
      for (int64_t c = dv; c < dvp; ++c) vr[c] = 0.0f;
    }
    for (int64_t c = d; c < dp; ++c) t.q[c] = 0.0f;

    const RowPtr qrows = query_rows(p, p.q, seq, h), orows = query_rows(p, p.out, seq, h);
    float* lse = lse_row(p, seq, h);
    const policy::WindowMask mask = seq.mask(p);
    const ScoreShape shape = score_shape(p, seq, h);
    const float sink = sink_of(p, h);
    for (int64_t i = i0; i < i1; ++i) {
      const policy::KeyRange keys = mask.keys_of(i);
      const int64_t first = smax<int64_t>(keys.first, 0), last = smin<int64_t>(keys.last, seq.seqlen_k - 1);
      float m = kNegInf, l = 0.0f;
      if (first <= last) {
        load_row<float>(qrows.row(i), p.dtype, t.q, d, 1.0f);
        // One instantiation per count of visible keys: its accumulators stay in registers.
        switch (last - first + 1) {
          case 1: row<1>(p, mask, shape, i, first, ws, t, m, l); break;
          case 2: row<2>(p, mask, shape, i, first, ws, t, m, l); break;
          case 3: row<3>(p, mask, shape, i, first, ws, t, m, l); break;
          case 4: row<4>(p, mask, shape, i, first, ws, t, m, l); break;
          case 5: row<5>(p, mask, shape, i, first, ws, t, m, l); break;
          case 6: row<6>(p, mask, shape, i, first, ws, t, m, l); break;
          case 7: row<7>(p, mask, shape, i, first, ws, t, m, l); break;
          default: row<8>(p, mask, shape, i, first, ws, t, m, l); break;
        }
      }
      const bool empty = l == 0.0f;
      if (empty)
        for (int64_t c = 0; c < dv; ++c) t.o[c] = 0.0f;
      const auto folded = policy::fold_sink<float>(empty ? kNegInf : m + std::log(l), sink);
      store_row<float>(t.o, empty ? 0.0f : folded.factor / l, orows.row(i), p.dtype, dv);
      if (lse) lse[i] = folded.lse;
    }
  }

  // Query row i (in t.q) against its C visible keys from `first`: t.o = sum_j exp(s_j - m) v_j, with the row's
  // max m and sum l. Left as they came (m = -inf, l = 0) when every visible score is -inf: the row then sees
  // no key, as in online_softmax_row.
  template <int C>
  static void row(const Problem& p, const policy::WindowMask& mask, const ScoreShape& shape,
                  int64_t i, int64_t first, const Scratch& ws, const Scratch::PerThread& t, float& m, float& l) {
    using V = vec_t<float>;
    constexpr int W = Simd<float>::W;
    constexpr int kLanes = (kFewKeys + W - 1) / W * W;
    const int64_t dp = ws.dp, dvp = ws.dvp;
    const float* k = t.k + first * dp;
    const float* v = t.v + first * dvp;
    V acc[C] = {};
    for (int64_t c = 0; c < dp; c += W) {
      const V q = vload(t.q + c);
      for (int j = 0; j < C; ++j) acc[j] += q * vload(k + j * dp + c);
    }
    alignas(64) float s[kLanes];
    for (int j = C; j < kLanes; ++j) s[j] = kNegInf;
    const float scale = static_cast<float>(p.score.scale);
    float mx = kNegInf;
    for (int j = 0; j < C; ++j) {
      float x = hsum(acc[j]) * scale;
      if (shape.softcap > 0) x = shape.softcap * std::tanh(x / shape.softcap);
      if (shape.alibi) x += policy::alibi_bias(shape.slope, mask.diagonal(i), first + j);
      s[j] = x;
      mx = x > mx ? x : mx;
    }
    if (mx == kNegInf) return;
    // exp(s - m) for all lanes at once; the padding lanes (-inf) give 0.
    for (int j = 0; j < kLanes; j += W) vstore(s + j, vexp(vload(s + j) - mx));
    float sum = 0.0f;
    for (int j = 0; j < C; ++j) sum += s[j];
    for (int64_t c = 0; c < dvp; c += W) {
      V o = s[0] * vload(v + c);
      for (int j = 1; j < C; ++j) o += s[j] * vload(v + j * dvp + c);
      vstore(t.o + c, o);
    }
    m = mx;
    l = sum;
  }
};

inline size_t few_keys_scratch(const Problem& p, int nt) {
  Arena a;
  FewKeysForward::Scratch ws;
  ws.layout(a, p, nt);
  return a.used();
}

// Tasks are (sequence, head, block of kRowsPerTask rows), handed out dynamically: sequences of any lengths
// and any number of heads keep every thread busy.
inline void few_keys_forward(const Problem& p, void* scratch, int nt) {
  constexpr int64_t R = FewKeysForward::kRowsPerTask;
  Arena arena(scratch);
  FewKeysForward::Scratch ws;
  ws.layout(arena, p, nt);
  const int64_t blocks = (longest_sequence(p).queries + R - 1) / R;
#pragma omp parallel for num_threads(nt) schedule(dynamic, 1) collapse(3)
  for (int64_t b = 0; b < p.batch; ++b)
    for (int64_t h = 0; h < p.nheads; ++h)
      for (int64_t blk = 0; blk < blocks; ++blk) {
        const Sequence seq = sequence_of(p, b);
        const int64_t i0 = blk * R;
        if (i0 >= seq.seqlen_q) continue;
        FewKeysForward::rows(p, seq, h, i0, smin(seq.seqlen_q, i0 + R), ws, ws.threads[omp_get_thread_num()]);
      }
}

}  // namespace flare::cpu::FLARE_ISA

// backward.hpp — the CPU backward pass (FlashAttention-2 style: recompute P from the saved lse).
//
// For each (sequence, kv head) group, K, K^T panels and V^T panels are packed once and dK/dV accumulate in
// the compute type. For each query head of the group, Q (scaled), dO, D = rowsum(dO * O) and lse are packed.
// With many groups (use_private_groups) each thread takes whole groups with packs of its own; the result then
// does not depend on the thread count. With few, the threads share a group: key blocks are spread over them
// (each block owned by one thread, so dK/dV need no atomics), each sums its share of dQ in a private buffer,
// and the buffers are added in thread order, so a fixed thread count gives bitwise-identical results.
// Per (query tile, key block):
//   S = Q K^T -> softcap/ALiBi/mask -> P = exp(S - lse);  dV += P^T dO;  dP = dO V^T;
//   dS = P * (dP - D) (* (1 - tanh^2) under softcap);  dK += dS^T Q;  dQ += dS K.
// With dropout (factors z, dropout.hpp): dV += (P z)^T dO and dS = P (dP z - D).
// Q carries the softmax scale, so dK needs no extra factor and dQ is scaled once at the end.
// Masked scores get dS = 0 by selection, not as P · (dP - D) with P = 0: a NaN or infinity in V at a key a row
// cannot see makes its dP NaN, and 0 x NaN would carry it into the row's dQ and the key's dK. K's
// non-finite values are zeroed in the pack that dQ += dS K reads and added back, times dS, to the rows that
// see their key (unseen_values.hpp), so they reach dQ only there.
#pragma once

#include "cpu/arena.hpp"
#include "cpu/cpu_backend.hpp"
#include "cpu/dropout.hpp"
#include "cpu/groups.hpp"
#include "cpu/score_tile.hpp"
#include "cpu/sequences.hpp"
#include "cpu/sinks.hpp"
#include "cpu/tile_gemm.hpp"
#include "cpu/unseen_values.hpp"

namespace flare::cpu::FLARE_ISA {

// Tile shapes of the FMA backward, by head width (HeadWidth, cpu_backend.hpp).
template <class T, HeadWidth Width = HeadWidth::kNarrow>
struct BackwardTiles {
  static constexpr bool kNarrow = Width == HeadWidth::kNarrow;
  static constexpr int64_t kBq = 64;
  // 128 keys: dQ += dS K runs a k loop of 128, each K^T / V^T panel serves twice the rows, and each query
  // tile's Q, dO and dQ rows are read once per 128 keys. Narrow heads: ~5% ahead of 64 at head dim 128 from
  // seqlen 1024 on (~2% behind at 512). Wide heads: ~7% ahead of 64 at head dim 512 (Zen 4, 2 threads),
  // although the block's K rows, K^T, V^T, dK and dV (1.3 MB) then outgrow its 1 MB L2: the query tiles'
  // rows, 400 KB a tile at head dim 512, cost more streamed twice as often (docs/tuning-cpu.md).
  static constexpr int64_t kBk = 128;
  // Key blocks per visit of a query tile: its Q, dO and dQ rows, which stream from L3 at long sequences,
  // are read once for all of them. Narrow heads, four: measured on Zen 4, head dim 128, +5-8% at seqlen 8192
  // against one block per visit, within 2% at 512-1024. Wide heads, one: a block is 1.3 MB at head dim 512,
  // and a tile's rows are wide enough to be worth their stream (with 64-key blocks on Sapphire Rapids, fp32,
  // one thread: +19% at seqlen 1024, level at 2048; docs/tuning-cpu.md).
  static constexpr int64_t kKeyBlocksPerStep = kNarrow ? 4 : 1;
};

template <class T, class Tiles>
struct BackwardScratch {
  int64_t dp = 0, dvp = 0;  // head dims padded to the vector width: the width of every product
  int64_t ld = 0, ldv = 0;  // row strides of K, Q, dK, dQ (ld) and dO, dV (ldv): padded_ld, B operands
  // One group's packs: shared by all threads, or one per thread with private groups.
  struct Pack {
    // Per group: K rows, K^T and V^T (headdim x kBk per key block, in the B-panel layout: PanelsB), dK and
    // dV accumulators.
    T *k, *kt, *vt, *dk, *dv;
    T *q, *dout, *delta, *lse;    // per query head: scaled Q, dO, rowsum(dO * O), lse
    uint8_t* k_flags;             // per key: its K row holds a NaN or infinity (zeroed in k)
  };
  struct PerThread {
    Pack* pack;
    T *dq, *s, *dp, *tanh;  // dQ accumulator (whole sequence), then tiles: P, dP/dS, tanh of softcap
    T* z;                   // the tile's dropout factors
  };
  PerThread* threads = nullptr;

  void layout(Arena& a, const Problem& p, int nt) {
    constexpr int W = Simd<T>::W;
    dp = round_up(p.headdim, W);
    dvp = round_up(p.headdim_v, W);
    ld = padded_ld<T>(p.headdim);
    ldv = padded_ld<T>(p.headdim_v);
    const Lengths most = longest_sequence(p);
    const int64_t nk = round_up(most.keys, Tiles::kBk), nq = round_up(most.queries, Tiles::kBq);
    const int packs = use_private_groups(p, nt) ? nt : 1;
    Pack* pack = a.take<Pack>(packs);
    for (int i = 0; i < packs; ++i) {
      Pack pk{a.take<T>(nk * ld), a.take<T>(nk * p.headdim), a.take<T>(nk * p.headdim_v), a.take<T>(nk * ld),
              a.take<T>(nk * ldv), a.take<T>(nq * ld), a.take<T>(nq * ldv), a.take<T>(nq), a.take<T>(nq),
              a.take<uint8_t>(nk)};
      if (pack) pack[i] = pk;
    }
    threads = a.take<PerThread>(nt);
    for (int t = 0; t < nt; ++t) {
      const int64_t tile = Tiles::kBq * Tiles::kBk;
      // The P tile doubles as the stage of W value rows (pack_backward_keys) and of one output row
      // (pack_backward_queries): at headdim_v 512 on AVX-512 the stage is exactly the tile's 8192 floats.
      PerThread pt{pack ? &pack[t < packs ? t : 0] : nullptr, a.take<T>(nq * ld), a.take<T>(smax(tile, W * dvp)),
                   a.take<T>(tile), a.take<T>(tile), a.take<T>(tile)};
      if (threads) threads[t] = pt;
    }
  }
};

// Packs key block kb of one kv head: K rows (padded to dp), K^T and V^T panels, and zeroes dK/dV. K^T and
// V^T are transposed W keys at a time (transpose_square): K from its packed rows; V straight from the input
// when it is stored in the compute type, densely, with whole vectors per row, else from rows staged in the
// scores tile.
template <class T, class Tiles>
inline void pack_backward_keys(const Problem& p, const RowPtr& krows, const RowPtr& vrows, int64_t seqlen_k,
                               int64_t kb, const BackwardScratch<T, Tiles>& ws,
                               const typename BackwardScratch<T, Tiles>::PerThread& t) {
  constexpr int64_t Bk = Tiles::kBk;
  constexpr int W = Simd<T>::W;
  constexpr int64_t w = kPanelCols<T>;
  const int64_t d = p.headdim, dv = p.headdim_v;
  const auto& pk = *t.pack;
  T* vstage = t.s;  // W value rows of dvp
  T* kt = pk.kt + kb * d * Bk;
  T* vt = pk.vt + kb * dv * Bk;
  const int64_t kbytes = d * dtype_size(p.dtype), vbytes = dv * dtype_size(p.dtype);
  const bool v_in_place = p.dtype == dtype_of<T>() && vrows.blocks == nullptr && dv % W == 0;
  for (int64_t jj0 = 0; jj0 < Bk; jj0 += W) {
    const bool v_direct = v_in_place && kb * Bk + jj0 + W <= seqlen_k;
    for (int64_t i = 0; i < W; ++i) {
      const int64_t j = kb * Bk + jj0 + i;
      prefetch_ahead(krows, j, seqlen_k, kbytes);
      prefetch_ahead(vrows, j, seqlen_k, vbytes);
      T* kr = pk.k + j * ws.ld;
      const bool key = j < seqlen_k;
      if (key) load_row<T>(krows.row(j), p.dtype, kr, d, T(1));
      for (int64_t c = key ? d : 0; c < ws.dp; ++c) kr[c] = T(0);
      if (!v_direct) {
        T* vr = vstage + i * ws.dvp;
        if (key) load_row<T>(vrows.row(j), p.dtype, vr, dv, T(1));
        for (int64_t c = key ? dv : 0; c < ws.dvp; ++c) vr[c] = T(0);
      }
      for (int64_t c = 0; c < ws.dp; c += W) vstore(pk.dk + j * ws.ld + c, vec_t<T>{});
      for (int64_t c = 0; c < ws.dvp; c += W) vstore(pk.dv + j * ws.ldv + c, vec_t<T>{});
    }
    // Columns jj0 .. jj0 + W of K^T and V^T: a W-wide piece of each row, whose stride is the panel's width.
    const int64_t stride = panel_width(jj0, Bk, w);
    transpose_rows<T>(pk.k + (kb * Bk + jj0) * ws.ld, ws.ld, d, kt + panel_offset(0, jj0, d, Bk, w), stride);
    const T* vsrc = v_direct ? reinterpret_cast<const T*>(vrows.row(kb * Bk + jj0)) : vstage;
    const int64_t vld = v_direct ? vrows.row_bytes / static_cast<int64_t>(sizeof(T)) : ws.dvp;
    transpose_rows<T>(vsrc, vld, dv, vt + panel_offset(0, jj0, dv, Bk, w), stride);
  }
  // K^T (the scores' operand) keeps every value; the rows dQ += dS K reads lose their non-finite ones.
  for (int64_t jj = 0; jj < Bk; ++jj) {
    const int64_t j = kb * Bk + jj;
    T* kr = pk.k + j * ws.ld;
    pk.k_flags[j] = j < seqlen_k && any_nonfinite(kr, dtype_of<T>(), d);
    if (pk.k_flags[j]) zero_nonfinite(kr, dtype_of<T>(), d);
  }
}

// Packs query tile qt of head h: scaled Q, dO, D = rowsum(dO * O) and lse (rows that see no key, and
// padding rows, get lse = +inf so that P = exp(S - lse) is 0 there).
template <class T, class Tiles>
inline void pack_backward_queries(const Problem& p, const Sequence& seq, int64_t h, int64_t qt,
                                  const BackwardScratch<T, Tiles>& ws,
                                  const typename BackwardScratch<T, Tiles>::PerThread& t) {
  constexpr int64_t Bq = Tiles::kBq;
  const auto& pk = *t.pack;
  T* row_buf = t.s;
  const int64_t d = p.headdim, dv = p.headdim_v;
  const RowPtr qrows = query_rows(p, p.q, seq, h), dorows = query_rows(p, p.dout, seq, h),
               orows = query_rows(p, p.out, seq, h);
  const float* lse = lse_row(p, seq, h);
  const int64_t qbytes = d * dtype_size(p.dtype), obytes = dv * dtype_size(p.dtype);
  for (int64_t ii = 0; ii < Bq; ++ii) {
    const int64_t i = qt * Bq + ii;
    prefetch_ahead(qrows, i, seq.seqlen_q, qbytes);
    prefetch_ahead(dorows, i, seq.seqlen_q, obytes);
    prefetch_ahead(orows, i, seq.seqlen_q, obytes);
    T* qr = pk.q + i * ws.ld;
    T* dor = pk.dout + i * ws.ldv;
    const bool query = i < seq.seqlen_q;
    if (query) {
      load_row<T>(qrows.row(i), p.dtype, qr, d, static_cast<T>(p.score.scale));
      load_row<T>(dorows.row(i), p.dtype, dor, dv, T(1));
    }
    for (int64_t c = query ? d : 0; c < ws.dp; ++c) qr[c] = T(0);
    for (int64_t c = query ? dv : 0; c < ws.dvp; ++c) dor[c] = T(0);
    pk.delta[i] = T(0);
    pk.lse[i] = static_cast<T>(__builtin_inff());
    if (!query) continue;
    load_row<T>(orows.row(i), p.dtype, row_buf, dv, T(1));
    for (int64_t c = dv; c < ws.dvp; ++c) row_buf[c] = T(0);
    vec_t<T> delta{};
    for (int64_t c = 0; c < ws.dvp; c += Simd<T>::W) delta += vload(dor + c) * vload(row_buf + c);
    pk.delta[i] = hsum(delta);
    if (lse[i] != kNegInf) pk.lse[i] = static_cast<T>(lse[i]);
  }
}

// Key block kb against query tile qt: accumulates dK/dV of the block and this thread's dQ of the tile.
// `ahead`: the input rows of the query tile packed next, requested a row per row of P.
template <class T, class Tiles>
inline void backward_tile(const Problem& p, const Sequence& seq, int64_t h, int64_t kb, int64_t qt,
                          const BackwardScratch<T, Tiles>& ws, const typename BackwardScratch<T, Tiles>::PerThread& t,
                          const RowsAhead& ahead) {
  using V = vec_t<T>;
  constexpr int W = Simd<T>::W;
  constexpr int64_t Bq = Tiles::kBq, Bk = Tiles::kBk;
  const int64_t d = p.headdim, dv = p.headdim_v, dp = ws.dp, dvp = ws.dvp, ld = ws.ld, ldv = ws.ldv;
  const int64_t i0 = qt * Bq, j0 = kb * Bk;
  const int64_t rows = smin(Bq, seq.seqlen_q - i0);
  // The products cover the tile's rows and the block's keys up to the sequence's last (rounded up to W): a
  // short sequence's tile costs its rows and keys, not Bq x Bk. Keys past the end within those columns are
  // masked (their packed K and V are 0); rows and keys past them are never read.
  const int64_t cols = smin(Bk, round_up(seq.seqlen_k - j0, W));
  const policy::WindowMask mask = seq.mask(p);
  const auto& pk = *t.pack;
  const T* q = pk.q + i0 * ld;
  const T* dout = pk.dout + i0 * ldv;

  gemm_tile_panels<T, false>(rows, cols, d, q, ld, PanelsB<T>{pk.kt + kb * d * Bk, d, Bk}, t.s, Bk);
  const ScoreShape shape = score_shape(p, seq, h);
  const bool masked = !block_fully_visible(mask, i0, rows, j0, cols);
  if (shape.softcap > 0 || shape.alibi || masked) shape_scores<T>(t.s, Bk, rows, cols, i0, j0, mask, shape, t.tanh);
  // Masked keys (including those past the sequence end) are -inf.
  for (int64_t r = 0; r < rows; ++r) {
    T* srow = t.s + r * Bk;
    const T lse = pk.lse[i0 + r];
    for (int64_t c = 0; c < cols; c += W) vstore(srow + c, RowExpFull::apply(vload(srow + c), T(1), lse));
    ahead.request(r);
  }
  for (int64_t r = rows; r < ahead.count; ++r) ahead.request(r);
  // Dropout (factors z: 0 or 1 / (1 - p)): dV += (P z)^T dO and dS = P (dP z - D), so dV waits for P z.
  const bool dropping = p.dropout_p > 0.0f;
  if (!dropping) gemm_tile<T, true, true>(cols, dvp, rows, t.s, Bk, dout, ldv, pk.dv + j0 * ldv, ldv);  // dV += P^T dO
  gemm_tile_panels<T, false>(rows, cols, dv, dout, ldv, PanelsB<T>{pk.vt + kb * dv * Bk, dv, Bk}, t.dp, Bk);  // dP = dO V^T
  const DropoutDraw draw = dropout_draw(p);
  if (dropping) {
    const int64_t zcols = smin(Bk, round_up(cols, 16));  // the draw takes whole groups of 16 keys
    if constexpr (std::is_same_v<T, float>) {
      dropout_tile(draw, dropout_stream(p, seq, h), i0, rows, j0, zcols, t.z, Bk);
    } else {
      for (int64_t r = 0; r < rows; ++r) dropout_row<T>(draw, dropout_stream(p, seq, h), i0 + r, j0, zcols, t.z + r * Bk);
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    const T* z = t.z + r * Bk;
    T* ds = t.dp + r * Bk;
    T* pr = t.s + r * Bk;
    const T delta = pk.delta[i0 + r];
    if (dropping) {
      for (int64_t c = 0; c < cols; c += W) vstore(ds + c, vload(ds + c) * vload(z + c));
    }
    if (shape.softcap > 0) {
      const T* th = t.tanh + r * Bk;
      for (int64_t c = 0; c < cols; c += W) {
        const V tv = vload(th + c);
        vstore(ds + c, vload(pr + c) * (vload(ds + c) - delta) * (T(1) - tv * tv));
      }
    } else {
      for (int64_t c = 0; c < cols; c += W) vstore(ds + c, vload(pr + c) * (vload(ds + c) - delta));
    }
    if (masked) {
      const policy::KeyRange keys = mask.keys_of(i0 + r);
      fill_outside<T>(ds, cols, keys.first - j0, keys.last - j0, T(0));
    }
    if (dropping)
      for (int64_t c = 0; c < cols; c += W) vstore(pr + c, vload(pr + c) * vload(z + c));
  }
  if (dropping) gemm_tile<T, true, true>(cols, dvp, rows, t.s, Bk, dout, ldv, pk.dv + j0 * ldv, ldv);  // dV += (P z)^T dO
  gemm_tile<T, true, true>(cols, dp, rows, t.dp, Bk, q, ld, pk.dk + j0 * ld, ld);        // dK += dS^T Q
  gemm_tile<T, true>(rows, dp, cols, t.dp, Bk, pk.k + j0 * ld, ld, t.dq + i0 * ld, ld);  // dQ += dS K
  add_seen_nonfinite_keys<T>(p, seq, h, pk.k_flags + j0, j0, cols, i0, rows, t.dp, Bk, t.dq + i0 * ld, ld);
}

// The fp32/fp64 FMA engine: what run_backward needs from a compute path. One instantiation per head width.
template <class T, HeadWidth Width = HeadWidth::kNarrow>
struct FmaBackward {
  using Tiles = BackwardTiles<T, Width>;
  using Scratch = BackwardScratch<T, Tiles>;
  static constexpr int64_t kBq = Tiles::kBq, kBk = Tiles::kBk;
  static constexpr int64_t kKeyBlocksPerStep = Tiles::kKeyBlocksPerStep;
  static void thread_begin() {}
  static void thread_end() {}
  static void pack_keys(const Problem& p, const Sequence& seq, int64_t hk, int64_t kb, const Scratch& ws, int tid) {
    pack_backward_keys<T, Tiles>(p, key_rows(p, p.k, seq, hk), key_rows(p, p.v, seq, hk), seq.seqlen_k, kb, ws,
                          ws.threads[tid]);
  }
  static void pack_queries(const Problem& p, const Sequence& seq, int64_t h, int64_t qt, const Scratch& ws,
                           int tid) {
    pack_backward_queries<T, Tiles>(p, seq, h, qt, ws, ws.threads[tid]);
  }
  static void clear_dq(const Sequence& seq, const Scratch& ws, int tid) {
    using V = vec_t<T>;
    constexpr int W = Simd<T>::W;
    const int64_t n = round_up(seq.seqlen_q, kBq) * ws.ld;
    for (int64_t x = 0; x < n; x += W) vstore(ws.threads[tid].dq + x, V{});
  }
  static void tile(const Problem& p, const Sequence& seq, int64_t h, int64_t kb, int64_t qt, const Scratch& ws,
                   int tid, const RowsAhead& ahead) {
    backward_tile<T, Tiles>(p, seq, h, kb, qt, ws, ws.threads[tid], ahead);
  }
  // dq row i = scale * (this thread's dQ, or with Shared the sum of the team's buffers in thread order).
  template <bool Shared>
  static void write_dq(const Problem& p, const RowPtr& dqrows, int64_t i, const Scratch& ws, int tid, int nt) {
    constexpr int W = Simd<T>::W;
    T* acc = ws.threads[tid].dq + i * ws.ld;
    if constexpr (Shared) {
      acc = ws.threads[0].dq + i * ws.ld;
      for (int other = 1; other < nt; ++other) {
        const T* src = ws.threads[other].dq + i * ws.ld;
        for (int64_t c = 0; c < ws.dp; c += W) vstore(acc + c, vload(acc + c) + vload(src + c));
      }
    }
    store_row<T>(acc, static_cast<T>(p.score.scale), dqrows.row(i), p.dtype, p.headdim);
  }
  // dk/dv row j; keys past seqused_k took no part: their gradients are 0.
  static void write_dkdv(const Problem& p, const Sequence& seq, const RowPtr& dkrows, const RowPtr& dvrows,
                         int64_t j, const Scratch& ws, int tid) {
    static constexpr T kZeros[kMaxHeaddim] = {};  // wide enough for headdim and headdim_v (cpu_backend.hpp)
    const auto& pk = *ws.threads[tid].pack;
    const bool used = j < seq.seqlen_k;
    store_row<T>(used ? pk.dk + j * ws.ld : kZeros, T(1), dkrows.row(j), p.dtype, p.headdim);
    store_row<T>(used ? pk.dv + j * ws.ldv : kZeros, T(1), dvrows.row(j), p.dtype, p.headdim_v);
  }
};

// Key blocks a thread takes together against each query tile: Engine::kKeyBlocksPerStep, else 1 (the most a
// step takes); a call's own count where the engine picks one per call (Engine::key_blocks_for), else that.
template <class Engine>
constexpr int64_t key_blocks_per_step() {
  if constexpr (requires { Engine::kKeyBlocksPerStep; }) {
    return Engine::kKeyBlocksPerStep;
  } else {
    return 1;
  }
}
template <class Engine>
inline int64_t key_blocks_per_step(const Problem& p) {
  if constexpr (requires { Engine::key_blocks_for(p); }) {
    return smin(Engine::key_blocks_for(p), key_blocks_per_step<Engine>());
  } else {
    return key_blocks_per_step<Engine>();
  }
}

// The whole backward of one (sequence, kv head) group, by the team (Shared) or by one thread.
template <class Engine, bool Shared>
inline void backward_group(const Problem& p, const Sequence& seq, int64_t hk, const typename Engine::Scratch& ws,
                           int tid, int nt) {
  constexpr int64_t Bq = Engine::kBq, Bk = Engine::kBk, G = key_blocks_per_step<Engine>();
  const int64_t group = p.nheads / p.nheads_k, es = dtype_size(p.dtype);
  const policy::WindowMask mask = seq.mask(p);
  const int64_t nkb = (seq.seqlen_k + Bk - 1) / Bk, nqb = (seq.seqlen_q + Bq - 1) / Bq;
  team_loop<Shared>(nkb, [&](int64_t kb) { Engine::pack_keys(p, seq, hk, kb, ws, tid); });
  for (int64_t g = 0; g < group; ++g) {
    const int64_t h = hk * group + g;
    // Shared, the team packs every query tile first. Alone, a thread packs each tile when the steps first
    // reach it (they reach tiles in increasing order: a later step's blocks see later queries, or the same)
    // and, while a tile computes, requests the input rows of the tile it will pack next. The packs' reads,
    // a head stride apart in memory, then come from the cache instead of stalling one row at a time.
    int64_t packed = 0;  // tiles below it are packed or never visited (the tiles a step visits, in order, are
                         // at or past those of the steps before it, but for the ones they share)
    if constexpr (Shared) {
      team_loop<Shared>(nqb, [&](int64_t qt) { Engine::pack_queries(p, seq, h, qt, ws, tid); });
      packed = nqb;
    }
    const auto rows_ahead = [&](int64_t qt) {
      RowsAhead a;
      if (Shared || qt >= nqb || qt < packed) return a;
      a.first = qt * Bq;
      a.count = smin(Bq, seq.seqlen_q - a.first);
      a.add(query_rows(p, p.q, seq, h), p.headdim * es);
      a.add(query_rows(p, p.dout, seq, h), p.headdim_v * es);
      a.add(query_rows(p, p.out, seq, h), p.headdim_v * es);
      return a;
    };
    Engine::clear_dq(seq, ws, tid);
    // Round-robin steps of G key blocks: under a causal mask late key blocks have fewer queries. A step walks
    // the union of its blocks' query tiles, each tile against each of its blocks that it sees, so that a
    // query tile's packs and dQ rows are read once per step rather than once per block.
    const int64_t per_step = units_per_task<Shared>(key_blocks_per_step<Engine>(p), nkb, nt);
    const int64_t nsteps = (nkb + per_step - 1) / per_step;
    team_loop<Shared, Schedule::kRoundRobin>(nsteps, [&](int64_t step) {
      const int64_t kb0 = step * per_step, kb1 = smin(kb0 + per_step, nkb);
      int64_t tiles_first[G] = {}, tiles_last[G] = {};  // each block's query tiles (first > last: none)
      int64_t lo = nqb, hi = -1;
      for (int64_t kb = kb0; kb < kb1; ++kb) {
        const policy::KeyRange queries = mask.queries_of_keys(kb * Bk, smin((kb + 1) * Bk, seq.seqlen_k));
        const int64_t first = smax<int64_t>(queries.first, 0);
        const int64_t last = smin<int64_t>(queries.last, seq.seqlen_q - 1);
        tiles_first[kb - kb0] = first <= last ? first / Bq : 1;
        tiles_last[kb - kb0] = first <= last ? last / Bq : 0;
        lo = smin(lo, tiles_first[kb - kb0]);
        hi = smax(hi, tiles_last[kb - kb0]);
      }
      for (int64_t qt = lo; qt <= hi; ++qt) {
        bool first = true;  // before the first of the tile's blocks: pack it if need be; that block requests
                            // the next tile's rows
        for (int64_t kb = kb0; kb < kb1; ++kb) {
          if (qt < tiles_first[kb - kb0] || qt > tiles_last[kb - kb0]) continue;
          if (!Shared && first && qt >= packed) {
            Engine::pack_queries(p, seq, h, qt, ws, tid);
            packed = qt + 1;
          }
          Engine::tile(p, seq, h, kb, qt, ws, tid, first ? rows_ahead(qt + 1) : RowsAhead{});
          first = false;
        }
      }
    });
    const RowPtr dqrows = query_rows(p, p.dq, seq, h);
    team_loop<Shared>(seq.seqlen_q, [&](int64_t i) { Engine::template write_dq<Shared>(p, dqrows, i, ws, tid, nt); });
  }
  const RowPtr dkrows = key_rows(p, p.dk, seq, hk), dvrows = key_rows(p, p.dv, seq, hk);
  team_loop<Shared>(seq.stored_k, [&](int64_t j) { Engine::write_dkdv(p, seq, dkrows, dvrows, j, ws, tid); });
}

template <class Engine>
inline void run_backward(const Problem& p, void* scratch, int nt) {
  run_groups<Engine>(p, scratch, nt, [&](const auto& ws, const Sequence& seq, int64_t hk, int tid, auto shared) {
    backward_group<Engine, decltype(shared)::value>(p, seq, hk, ws, tid, nt);
  });
  sink_gradient(p, nt);
}

// The FMA backward of compute type T with the tile shapes of the problem's head width.
template <class T>
inline size_t fma_backward_scratch(const Problem& p, int nt) {
  return head_width(p) == HeadWidth::kWide ? scratch_bytes<FmaBackward<T, HeadWidth::kWide>>(p, nt)
                                           : scratch_bytes<FmaBackward<T>>(p, nt);
}
template <class T>
inline void fma_backward(const Problem& p, void* scratch, int nt) {
  if (head_width(p) == HeadWidth::kWide) {
    run_backward<FmaBackward<T, HeadWidth::kWide>>(p, scratch, nt);
  } else {
    run_backward<FmaBackward<T>>(p, scratch, nt);
  }
}

}  // namespace flare::cpu::FLARE_ISA

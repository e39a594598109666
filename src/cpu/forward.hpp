// forward.hpp — the CPU forward pass: tiles of queries against blocks of keys with online softmax.
//
// For each (sequence, kv head) group the keys are packed once (K transposed into per-block panels, V padded)
// in the compute type; then the group's query heads x query tiles run over it, spread over the threads as
// groups.hpp decides. A tile keeps its output accumulator, running max m and running sum l; per key block:
//   S = Q K^T (scaled Q)  ->  softcap / ALiBi / mask  ->  m' = max(m, rowmax S), P = exp(S - m'),
//   l = l * exp(m - m') + rowsum P,  O = O * exp(m - m') + P V.
// With dropout each row's P is multiplied by its keep factors (dropout.hpp) as it is written, after l took
// the undropped sum. At the end O / l is written and lse = m + log l, a sink folded into both. Scratch is a pack of the longest sequence's keys
// (longest_sequence) per thread or per team (groups.hpp) plus O(tile) per thread: no seqlen_q x seqlen_k
// buffer exists, and a KV cache's unused capacity costs nothing. Rows that see no key get out = 0 and lse = -inf.
#pragma once

#include <cmath>

#include "cpu/arena.hpp"
#include "cpu/cpu_backend.hpp"
#include "cpu/dropout.hpp"
#include "cpu/groups.hpp"
#include "cpu/score_tile.hpp"
#include "cpu/sequences.hpp"
#include "cpu/tile_gemm.hpp"
#include "cpu/unseen_values.hpp"

namespace flare::cpu::FLARE_ISA {

// Tile shapes of the FMA forward, by head width (HeadWidth, cpu_backend.hpp).
template <class T, HeadWidth Width = HeadWidth::kNarrow>
struct ForwardTiles {
  static constexpr int64_t kBq = 64;   // query rows per tile
  // Keys per block (a multiple of every vector width). Narrow heads, 256 against 128: the per-block costs of
  // each row (the softmax's reductions, the rescale test, the output's load and store around P V) are paid
  // half as often; +0.6-1.6% on fp32 at 512-2048, causal included (Zen 4). Wide heads, 128: at head dim 512
  // a block of 256 keys packs 512 KB of K^T and 512 KB of V, and with the two visiting tiles' Q and output
  // (256 KB each) a thread works on 1.6 MB, most of a 2 MB L2 and more than its share where two threads
  // share one; 128 keys bring that to 1 MB (docs/tuning-cpu.md).
  static constexpr int64_t kBk = Width == HeadWidth::kNarrow ? 256 : 128;
  // Query tiles that visit each key block together (one task): a block's packed K and V, which stream from
  // L3 once a head's pack outgrows L2 (1024 keys at head dim 128), are then read once for two tiles. Each
  // tile keeps its own visible range, so causal diagonals cost what they cost with single tiles. Measured
  // on Zen 4 (hd 128): see forward_tiles.
  static constexpr int64_t kTilesPerVisit = 2;
};

template <class T, class Tiles>
struct ForwardScratch {
  int64_t dp = 0, dvp = 0;  // head dims padded to the vector width
  struct PerThread {
    // The key pack in use (shared or private), per block of kBk keys: K^T (headdim x kBk) and V (kBk x dvp),
    // both in the B-panel layout of the products that read them (PanelsB, tile_gemm.hpp).
    T* kt;
    T* v;
    uint8_t* v_flags;  // per key of the pack: its V row holds a NaN or infinity (unseen_values.hpp)
    // Per tile of a visit (kTilesPerVisit x): Q, output accumulator, running max and sum; shared by them:
    // the scores and probabilities of the tile being worked on, and one row's dropout factors.
    T *q, *s, *p, *o, *m, *l, *z;
  };
  PerThread* threads = nullptr;

  void layout(Arena& a, const Problem& p, int nt) {
    constexpr int W = Simd<T>::W;
    dp = round_up(p.headdim, W);
    dvp = round_up(p.headdim_v, W);
    const int64_t keys = round_up(longest_sequence(p).keys, Tiles::kBk);
    const int packs = use_private_groups(p, nt) ? nt : 1;
    threads = a.take<PerThread>(nt);
    for (int t = 0; t < nt; ++t) {
      T* kt = t < packs ? a.take<T>(keys * p.headdim) : threads ? threads[0].kt : nullptr;
      T* v = t < packs ? a.take<T>(keys * dvp) : threads ? threads[0].v : nullptr;
      uint8_t* v_flags = t < packs ? a.take<uint8_t>(keys) : threads ? threads[0].v_flags : nullptr;
      constexpr int64_t rows = Tiles::kBq * Tiles::kTilesPerVisit;
      // The scores tile doubles as pack_key_block's stage of W key rows: wider heads than kBq * kBk / W
      // (1024 floats on AVX-512) would not fit the tile alone.
      PerThread pt{kt,
                   v,
                   v_flags,
                   a.take<T>(rows * dp),
                   a.take<T>(smax(Tiles::kBq * Tiles::kBk, W * dp)),
                   a.take<T>(Tiles::kBq * Tiles::kBk),
                   a.take<T>(rows * dvp),
                   a.take<T>(rows),
                   a.take<T>(rows),
                   a.take<T>(Tiles::kBk)};
      if (threads) threads[t] = pt;
    }
  }
};

// The packed K^T and V of key block kb, as B operands of S = Q K^T and O += P V.
template <class T, class Tiles>
inline PanelsB<T> key_panels(const Problem& p, const typename ForwardScratch<T, Tiles>::PerThread& t, int64_t kb) {
  constexpr int64_t Bk = Tiles::kBk;
  return {t.kt + kb * p.headdim * Bk, p.headdim, Bk};
}
template <class T, class Tiles>
inline PanelsB<T> value_panels(const ForwardScratch<T, Tiles>& ws,
                               const typename ForwardScratch<T, Tiles>::PerThread& t, int64_t kb) {
  constexpr int64_t Bk = Tiles::kBk;
  return {t.v + kb * Bk * ws.dvp, Bk, ws.dvp};
}

// Packs keys [j0, j0 + kBk) of one kv head: K^T (headdim x kBk) and V (kBk x dvp), zero-padded, in panels.
// A sequence's last block is packed up to its last key, rounded up to W: the products never read further
// (forward_tiles cuts each block there), so a short sequence does not pay for a whole block of padding.
// K is transposed W keys at a time (transpose_square): straight from the input when it is stored in the
// compute type, densely, with whole vectors per row; else from rows converted into the scores tile. V rows
// are converted straight into their panel pieces.
template <class T, class Tiles>
inline void pack_key_block(const Problem& p, const RowPtr& krows, const RowPtr& vrows, int64_t seqlen_k,
                           int64_t kb, const ForwardScratch<T, Tiles>& ws,
                           const typename ForwardScratch<T, Tiles>::PerThread& t) {
  constexpr int64_t Bk = Tiles::kBk;
  constexpr int W = Simd<T>::W;
  constexpr int64_t w = kPanelCols<T>;
  const int64_t d = p.headdim, dv = p.headdim_v, dp = ws.dp, dvp = ws.dvp, es = dtype_size(p.dtype);
  T* panel = t.kt + kb * d * Bk;
  T* vblock = t.v + kb * Bk * dvp;
  T* stage = t.s;  // W key rows of dp
  const bool k_in_place = p.dtype == dtype_of<T>() && krows.blocks == nullptr && d % W == 0;
  const int64_t packed = smin(Bk, round_up(seqlen_k - kb * Bk, W));
  for (int64_t jj0 = 0; jj0 < packed; jj0 += W) {
    const bool direct = k_in_place && kb * Bk + jj0 + W <= seqlen_k;
    for (int64_t i = 0; i < W; ++i) {
      const int64_t jj = jj0 + i, j = kb * Bk + jj;
      prefetch_ahead(krows, j, seqlen_k, d * es);
      prefetch_ahead(vrows, j, seqlen_k, dv * es);
      if (!direct) {
        T* kr = stage + i * dp;
        if (j < seqlen_k) {
          load_row<T>(krows.row(j), p.dtype, kr, d, T(1));
        } else {
          for (int64_t c = 0; c < d; ++c) kr[c] = T(0);
        }
        for (int64_t c = d; c < dp; ++c) kr[c] = T(0);
      }
      // Row jj of V: a piece of each panel.
      const char* vsrc = j < seqlen_k ? vrows.row(j) : nullptr;
      for (int64_t c0 = 0; c0 < dvp; c0 += w) {
        T* vr = vblock + panel_offset(jj, c0, Bk, dvp, w);
        const int64_t n = vsrc ? smin(w, dv - c0) : 0;
        if (n > 0) load_row<T>(vsrc + c0 * es, p.dtype, vr, n, T(1));
        for (int64_t c = n; c < panel_width(c0, dvp, w); ++c) vr[c] = T(0);
      }
    }
    // Columns jj0 .. jj0 + W of K^T: a W-wide piece of each of its rows, whose stride is the panel's width.
    const T* src = direct ? reinterpret_cast<const T*>(krows.row(kb * Bk + jj0)) : stage;
    const int64_t ld = direct ? krows.row_bytes / static_cast<int64_t>(sizeof(T)) : dp;
    transpose_rows<T>(src, ld, d, panel + panel_offset(0, jj0, d, Bk, w), panel_width(jj0, Bk, w));
  }
  // Each V panel holds its packed keys' rows first, contiguously.
  screen_value_pieces(p, vrows, seqlen_k, kb * Bk, Bk, dtype_of<T>(), t.v_flags + kb * Bk, [&](auto f) {
    for (int64_t c0 = 0; c0 < dvp; c0 += w) f(vblock + c0 * Bk, packed * panel_width(c0, dvp, w));
  });
}

// Online softmax over one block of a row. The row's scores are scale * s[c] (scale > 0, so the max can be
// taken before scaling); emit(c, p) receives p = exp(scale * s - m') for each vector at column c, the
// running max m and sum l are updated, and the factor the row's accumulator must be multiplied by is
// returned: exp(m - m'), or 1 while the row has seen no visible key (its p are then all 0).
//
// Once a row has a max, a block is first tried in one pass against that max (m' = m): the exponentials
// may then exceed 1, which is harmless while the block's max stays within kRescaleMargin of m (e^8 ≈ 3000
// cannot overflow any sum). Only a block that rises further is redone with its own max. Random or trained
// scores rarely rise by that much after the first blocks, so most blocks need one pass and no rescaling.
// RowExp::apply(x, scale, m) forms the exponentials (a path may trade accuracy it does not keep for speed).
template <class T, class Emit, class RowExp = RowExpFull>
inline T online_softmax_row(const T* s, int64_t n, T scale, T& m, T& l, Emit emit, RowExp = {}) {
  using V = vec_t<T>;
  constexpr int W = Simd<T>::W;
  constexpr T kRescaleMargin = 8;
  const T neg_inf = static_cast<T>(kNegInf);
  if (m != neg_inf) {
    V mx = vset<T>(neg_inf), sum{};
    for (int64_t c = 0; c < n; c += W) {
      const V x = vload(s + c);
      mx = vmax(mx, x);
      const V e = RowExp::apply(x, scale, m);
      sum += e;
      emit(c, e);
    }
    if (all_at_most(mx, (m + kRescaleMargin) / scale)) {
      l += hsum(sum);
      return T(1);
    }
  }
  V mx = vload(s);
  for (int64_t c = W; c < n; c += W) mx = vmax(mx, vload(s + c));
  const T m_new = smax(m, hmax(mx) * scale);
  if (m_new == neg_inf) {
    for (int64_t c = 0; c < n; c += W) emit(c, V{});
    return T(1);
  }
  const T alpha = m == neg_inf ? T(0) : static_cast<T>(std::exp(m - m_new));
  V sum{};
  for (int64_t c = 0; c < n; c += W) {
    const V e = RowExp::apply(vload(s + c), scale, m_new);
    sum += e;
    emit(c, e);
  }
  l = l * alpha + hsum(sum);
  m = m_new;
  return alpha;
}

template <class T>
inline void scale_row(T* x, int64_t n, T factor) {
  constexpr int W = Simd<T>::W;
  for (int64_t c = 0; c < n; c += W) vstore(x + c, vload(x + c) * factor);
}

// Writes out = out_scale * o / l (0 where the row saw no key) and lse = m + log l (-inf there) for rows
// [i0, i0 + rows), with the head's sink (-inf: none) folded into both (policy::fold_sink).
template <class T>
inline void finish_rows(const Problem& p, T* o, int64_t ldo, const T* m, const T* l, int64_t rows,
                        const RowPtr& orows, float* lse, int64_t i0, float sink, T out_scale = T(1)) {
  const int64_t obytes = p.headdim_v * dtype_size(p.dtype);
  for (int64_t r = 0; r < rows; ++r) {
    // Output rows lie a row of every head apart, in memory a call has often just allocated: each is requested
    // for writing kPrefetchRows ahead.
    if (r + kPrefetchRows < rows) prefetch_bytes<Fetch::kWrite>(orows.row(i0 + r + kPrefetchRows), obytes);
    const bool empty = l[r] == T(0);
    T* orow = o + r * ldo;
    if (empty) for (int64_t c = 0; c < p.headdim_v; ++c) orow[c] = T(0);
    // A sink within range of the row's max joins its sum directly: exp(sink - max) in the sum's own scale,
    // then one log, the same as without a sink (fold_sink's exp, log1p and exp cost 3-4% of a bf16 forward
    // at head dim 128). Far above the max (exp would overflow), or for an empty row, fold_sink.
    const T x = static_cast<T>(sink) - m[r];
    if (!empty && sink != kNegInf && x < T(64)) {
      const T total = l[r] + std::exp(x);
      store_row<T>(orow, out_scale / total, orows.row(i0 + r), p.dtype, p.headdim_v);
      if (lse) lse[i0 + r] = static_cast<float>(m[r] + std::log(total));
      continue;
    }
    const auto row = policy::fold_sink<T>(empty ? static_cast<T>(kNegInf) : m[r] + std::log(l[r]), sink);
    store_row<T>(orow, empty ? T(0) : out_scale * row.factor / l[r], orows.row(i0 + r), p.dtype, p.headdim_v);
    if (lse) lse[i0 + r] = static_cast<float>(row.lse);
  }
}

// Blocks a tile sees this few keys of take few_key_scores rather than the tile product: at 16 columns (one
// AVX-512 vector of fp32) the product broadcasts every query element for a single panel row, where a dot
// product per key costs head dim / W multiply-adds and a horizontal sum (FlashAttention's race shapes, 239
// queries against 1 key and 799 against 3; docs/tuning-cpu.md).
inline constexpr int64_t kDotKeys = 4;

// S[r][c] = q_r . k_c for the n (<= kDotKeys) keys of a block a tile sees, zero for columns [n, cols), which
// the mask then hides. The keys' rows are gathered once from the K^T panel into `stage` (n x d).
template <class T>
inline void few_key_scores(int64_t rows, int64_t d, const T* q, int64_t ldq, const PanelsB<T>& kt, int64_t n,
                           int64_t cols, T* stage, T* s, int64_t lds) {
  constexpr int W = Simd<T>::W;
  constexpr int64_t w = kPanelCols<T>;
  for (int64_t c = 0; c < n; ++c) {
    for (int64_t k = 0; k < d; ++k) stage[c * d + k] = kt.b[panel_offset(k, c, kt.k_stored, kt.n_stored, w)];
  }
  const int64_t whole = d / W * W;
  for (int64_t r = 0; r < rows; ++r) {
    const T* qr = q + r * ldq;
    if (r + 8 < rows) {
      prefetch_bytes(qr + 8 * ldq, d * static_cast<int64_t>(sizeof(T)));
    }
    T* sr = s + r * lds;
    for (int64_t c = 0; c < n; ++c) {
      const T* kr = stage + c * d;
      vec_t<T> acc{};
      for (int64_t k = 0; k < whole; k += W) acc += vload(qr + k) * vload(kr + k);
      T x = hsum(acc);
      for (int64_t k = whole; k < d; ++k) x += qr[k] * kr[k];
      sr[c] = x;
    }
    for (int64_t c = n; c < cols; ++c) sr[c] = T(0);
  }
}

// The query tiles of one visit: ntiles (<= kTilesPerVisit) tiles of kBq rows from i0 (those past the
// sequence end are skipped) of head h, each against every key block it sees, the tiles taking each key
// block in turn. Against one tile per task: +3-5% at seqlen 8192 and level at 512-2048, causal too (Zen 4,
// hd 128).
template <class T, class Tiles>
inline void forward_tiles(const Problem& p, const Sequence& seq, int64_t h, int64_t i0, int64_t ntiles_wanted,
                          const ForwardScratch<T, Tiles>& ws, const typename ForwardScratch<T, Tiles>::PerThread& t) {
  constexpr int W = Simd<T>::W;
  constexpr int64_t Bq = Tiles::kBq, Bk = Tiles::kBk, G = Tiles::kTilesPerVisit;
  const int64_t d = p.headdim, dp = ws.dp, dvp = ws.dvp;
  const policy::WindowMask mask = seq.mask(p);
  const RowPtr qrows = query_rows(p, p.q, seq, h);
  const RowPtr orows = query_rows(p, p.out, seq, h);
  float* lse = lse_row(p, seq, h);
  const ScoreShape shape = score_shape(p, seq, h);
  const bool plain = shape.plain();
  // Queries stored in the compute type feed the product where they lie, unscaled, when the scores need no
  // shaping beyond the mask (which the scale does not change): the softmax then applies the scale.
  const bool in_place = plain && p.dtype == dtype_of<T>();
  const T softmax_scale = in_place ? static_cast<T>(p.score.scale) : T(1);
  // Dropout multiplies each row's P by its keep factors before O += P V; the sum l stays undropped.
  const DropoutDraw draw = dropout_draw(p);
  const uint32_t stream = dropout_stream(p, seq, h);
  const T* z = p.dropout_p > 0.0f ? t.z : nullptr;
  const int64_t ldq = in_place ? qrows.row_bytes / static_cast<int64_t>(sizeof(T)) : dp;

  struct Tile {
    int64_t i0, rows;
    policy::KeyRange keys;  // visible keys (first > last: none)
    const T* q;
    T *o, *m, *l;
    // Whether o holds anything yet: the first block's product writes it (nothing to zero or rescale first).
    bool started;
  };
  Tile tiles[G];
  int64_t ntiles = 0, first_block = INT64_MAX, last_block = -1;
  for (int64_t g = 0; g < smin(G, ntiles_wanted) && i0 + g * Bq < seq.seqlen_q; ++g, ++ntiles) {
    Tile& tl = tiles[g];
    T* qbuf = t.q + g * Bq * dp;  // the tile's converted, scaled queries (unused in place)
    tl = {i0 + g * Bq, smin(Bq, seq.seqlen_q - i0 - g * Bq), {}, qbuf, t.o + g * Bq * dvp, t.m + g * Bq,
          t.l + g * Bq, false};
    tl.keys = visible_keys(mask, tl.i0, tl.rows, seq.seqlen_k);
    if (tl.keys.first <= tl.keys.last) {
      first_block = smin(first_block, tl.keys.first / Bk);
      last_block = smax(last_block, tl.keys.last / Bk);
    }
    if (in_place) tl.q = reinterpret_cast<const T*>(qrows.row(tl.i0));
    for (int64_t r = 0; r < Bq; ++r) {
      tl.m[r] = static_cast<T>(kNegInf);
      tl.l[r] = T(0);
      if (in_place) continue;
      T* qr = qbuf + r * dp;
      if (r < tl.rows) {
        load_row<T>(qrows.row(tl.i0 + r), p.dtype, qr, d, static_cast<T>(p.score.scale));
        for (int64_t c = d; c < dp; ++c) qr[c] = T(0);
      } else {
        for (int64_t c = 0; c < dp; ++c) qr[c] = T(0);
      }
    }
  }

  for (int64_t kb = first_block; kb <= last_block; ++kb) {
    const int64_t j0 = kb * Bk;
    for (int64_t g = 0; g < ntiles; ++g) {
      Tile& tl = tiles[g];
      const int64_t first = tl.keys.first, last = tl.keys.last, rows = tl.rows;
      if (first > last || kb < first / Bk || kb > last / Bk) continue;
      // The last block is cut after the last visible key (causal diagonals, short sequences): the scores to
      // its vector width, P V to the key itself (P is 0 past it, and a product step per key is what P V costs).
      const int64_t seen = smin(Bk, last + 1 - j0);
      const int64_t cols = smin(Bk, round_up(seen, W));
      // Products over the tile's rows alone: a short sequence's tile (a decode-like query or the end of one)
      // costs its rows, not kBq. A block the tile sees at most kDotKeys keys of takes dot products instead.
      if (seen <= kDotKeys) {
        few_key_scores<T>(rows, d, tl.q, ldq, key_panels<T, Tiles>(p, t, kb), seen, cols, t.p, t.s, Bk);
      } else {
        gemm_tile_panels<T, false>(rows, cols, d, tl.q, ldq, key_panels<T, Tiles>(p, t, kb), t.s, Bk);
      }
      if (!plain || !block_fully_visible(mask, tl.i0, rows, j0, cols))
        shape_scores<T>(t.s, Bk, rows, cols, tl.i0, j0, mask, shape, nullptr);
      for (int64_t r = 0; r < rows; ++r) {
        T* prow = t.p + r * Bk;
        if (z) dropout_row<T>(draw, stream, tl.i0 + r, j0, cols, t.z);
        const T alpha = online_softmax_row<T>(t.s + r * Bk, cols, softmax_scale, tl.m[r], tl.l[r],
                                              [prow, z](int64_t c, vec_t<T> e) {
                                                vstore(prow + c, z ? e * vload(z + c) : e);
                                              });
        if (alpha != T(1) && tl.started) scale_row<T>(tl.o + r * dvp, dvp, alpha);
      }
      if (tl.started) {
        gemm_tile_panels<T, true>(rows, dvp, seen, t.p, Bk, value_panels<T, Tiles>(ws, t, kb), tl.o, dvp);
      } else {
        gemm_tile_panels<T, false>(rows, dvp, seen, t.p, Bk, value_panels<T, Tiles>(ws, t, kb), tl.o, dvp);
        tl.started = true;
      }
      add_seen_nonfinite_values<T>(p, seq, h, t.v_flags + j0, j0, cols, tl.i0, rows, tl.o, dvp);
    }
  }

  for (int64_t g = 0; g < ntiles; ++g)
    finish_rows<T>(p, tiles[g].o, dvp, tiles[g].m, tiles[g].l, tiles[g].rows, orows, lse, tiles[g].i0,
                   sink_of(p, h));
}

// The fp32/fp64 FMA engine: what run_forward needs from a compute path. One instantiation per head width.
template <class T, HeadWidth Width = HeadWidth::kNarrow>
struct FmaForward {
  using Tiles = ForwardTiles<T, Width>;
  using Scratch = ForwardScratch<T, Tiles>;
  static constexpr int64_t kBq = Tiles::kBq, kBk = Tiles::kBk;
  static constexpr int64_t kTilesPerVisit = Tiles::kTilesPerVisit;
  static void thread_begin() {}
  static void thread_end() {}
  static void pack(const Problem& p, const RowPtr& k, const RowPtr& v, int64_t seqlen_k, int64_t kb,
                   const Scratch& ws, int tid) {
    pack_key_block<T, Tiles>(p, k, v, seqlen_k, kb, ws, ws.threads[tid]);
  }
  // Tiles [i0, i0 + ntiles kBq) of head h: one visit (ntiles <= kTilesPerVisit).
  static void tile(const Problem& p, const Sequence& seq, int64_t h, int64_t i0, int64_t ntiles, const Scratch& ws,
                   int tid) {
    forward_tiles<T, Tiles>(p, seq, h, i0, ntiles, ws, ws.threads[tid]);
  }
};

// Query tiles an engine runs per task, visiting each key block together: Engine::kTilesPerVisit, else 1.
template <class Engine>
constexpr int64_t tiles_per_visit() {
  if constexpr (requires { Engine::kTilesPerVisit; }) {
    return Engine::kTilesPerVisit;
  } else {
    return 1;
  }
}

// Per (sequence, kv head) group: pack the keys once, then run the group's query heads x query tiles.
template <class Engine>
inline void run_forward(const Problem& p, void* scratch, int nt) {
  constexpr int64_t Bq = Engine::kBq, Bk = Engine::kBk, G = tiles_per_visit<Engine>();
  const int64_t group = p.nheads / p.nheads_k;
  run_groups<Engine>(p, scratch, nt, [&](const auto& ws, const Sequence& seq, int64_t hk, int tid, auto shared) {
    constexpr bool Shared = decltype(shared)::value;
    if (seq.seqlen_q == 0) return;
    const int64_t nkb = (seq.seqlen_k + Bk - 1) / Bk, nqt = (seq.seqlen_q + Bq - 1) / Bq;
    const RowPtr krows = key_rows(p, p.k, seq, hk), vrows = key_rows(p, p.v, seq, hk);
    team_loop<Shared>(nkb, [&](int64_t kb) { Engine::pack(p, krows, vrows, seq.seqlen_k, kb, ws, tid); });
    const int64_t per_task = units_per_task<Shared>(G, group * nqt, nt);
    const int64_t ntasks = (nqt + per_task - 1) / per_task;
    // Tiles near the end of a causal sequence see the most keys: hand them out first.
    team_loop<Shared, Schedule::kDynamic>(group * ntasks, [&](int64_t task) {
      const int64_t i0 = (ntasks - 1 - task / group) * per_task * Bq, h = hk * group + task % group;
      if constexpr (G > 1) {
        Engine::tile(p, seq, h, i0, per_task, ws, tid);
      } else {
        Engine::tile(p, seq, h, i0, ws, tid);
      }
    });
  });
}

// The FMA forward of compute type T with the tile shapes of the problem's head width.
template <class T>
inline size_t fma_forward_scratch(const Problem& p, int nt) {
  return head_width(p) == HeadWidth::kWide ? scratch_bytes<FmaForward<T, HeadWidth::kWide>>(p, nt)
                                           : scratch_bytes<FmaForward<T>>(p, nt);
}
template <class T>
inline void fma_forward(const Problem& p, void* scratch, int nt) {
  if (head_width(p) == HeadWidth::kWide) {
    run_forward<FmaForward<T, HeadWidth::kWide>>(p, scratch, nt);
  } else {
    run_forward<FmaForward<T>>(p, scratch, nt);
  }
}

}  // namespace flare::cpu::FLARE_ISA

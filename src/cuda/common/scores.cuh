// scores.cuh — shaping one tile of raw scores q·k in registers: scale, softcap, ALiBi and the causal /
// sliding-window mask, with the same policy objects as the CPU backend (src/common/attention_policy.hpp).
//
// After shape_scores the tile holds "log2 logits": values x with P ∝ exp2(x). In the plain case (no softcap,
// no ALiBi) the tile keeps the raw q·k and the softmax folds scale·log2(e) into its exp2 argument
// (ScoreShape::log2_factor), which saves a multiply per element; otherwise the tile is rewritten as
// log2(e) · (softcap·tanh(scale·s / softcap) + alibi) and log2_factor is 1.
#pragma once

#include <cmath>

#include "common/attention_policy.hpp"
#include "common/philox.hpp"
#include "cuda/common/fast_math.cuh"
#include "cuda/common/tile_utils.cuh"

namespace flare::cuda {

// Dropout's keep decisions of the call's (sequence, head) stream (b * nheads + h): flare.h's mapping, one
// Philox draw per (query i, group of 16 keys), of which key j uses byte j % 16.
struct DropoutStream {
  philox::DropoutKey key;
  uint32_t stream, threshold;
  float scale;  // the kept elements' factor 1 / (1 - p)

  __device__ __forceinline__ DropoutStream(AttnParams const& p, int b, int h)
      : key{p.dropout_k0, p.dropout_k1, p.dropout_offset},
        stream(static_cast<uint32_t>(b) * static_cast<uint32_t>(p.nheads) + static_cast<uint32_t>(h)),
        threshold(p.dropout_threshold),
        scale(p.dropout_scale) {}

  // The draw that holds the keep bytes of query i's keys 16 * group .. 16 * group + 15.
  __device__ __forceinline__ philox::Words draw(uint32_t i, uint32_t group) const {
    return philox::dropout_words(key, stream, i, group);
  }
  // Whether key j is kept, from the draw of its group. (dropout_byte selects its word: an index known only
  // at run time would put the words in local memory.)
  __device__ __forceinline__ bool kept(philox::Words const& w, uint32_t j) const {
    return philox::dropout_byte(w, j & 15u) >= threshold;
  }
};

// Dropout's keep bits of the scores a thread holds: bit c of bits[r] for element (r, c) of a (row, col) view
// whose tile-local coordinates coord_rc gives, at (row0, col0) in the sequence (col0 a multiple of 16). A
// draw covers 16 keys of a row (a Philox draw is rounds of two wide multiplies: drawn per element, at ten rounds,
// it cost the sm80 forward 7-10x its time without dropout). The thread's columns kPerDraw * g .. kPerDraw * (g + 1)
// - 1 of a row lie in one group of 16 keys, so it draws once per such group: kPerDraw is a property of the
// MMA layout (4 in the forward, whose warps split the rows only; 2 in the backward, whose warps split the
// keys too), which tests/cuda/test_sm80_dropout_groups.cu checks for every configuration on the CPU.
// (Written as a walk over the columns that drew again when a column left the last draw's group, ptxas
// (sm_90) if-converted it and issued the draw's work for every column: docs/tuning-sm80.md, "Dropout's
// draws".) The loop over groups stays rolled: the draws then keep few registers live, and the kernel
// around them its own (unrolled, they spilled the sm80 forward at head dim 64). The caller applies the
// bits in its unrolled loops.
template <int kPerDraw, int kRows, class Coords>
__device__ __forceinline__ void dropout_bits(DropoutStream const& d, Coords const& coord_rc, int row0, int col0,
                                             uint64_t (&bits)[kRows]) {
  constexpr int kCols = decltype(size<1>(coord_rc))::value;
  static_assert(kCols <= 64, "a thread's row of scores must fit the 64 bits of its mask");
  static_assert(kCols % kPerDraw == 0 && 16 % kPerDraw == 0, "a thread's columns come in whole groups");
  CUTE_UNROLL
  for (int r = 0; r < kRows; ++r) {
    uint64_t b = 0;
    const uint32_t i = static_cast<uint32_t>(row0 + get<0>(coord_rc(r, 0)));
#pragma unroll 1
    for (int g = 0; g < kCols / kPerDraw; ++g) {
      const int c0 = g * kPerDraw;
      const philox::Words w = d.draw(i, static_cast<uint32_t>(col0 + get<1>(coord_rc(r, c0))) >> 4);
      CUTE_UNROLL
      for (int e = 0; e < kPerDraw; ++e) {
        if (d.kept(w, static_cast<uint32_t>(col0 + get<1>(coord_rc(r, c0 + e))))) b |= uint64_t{1} << (c0 + e);
      }
    }
    bits[r] = b;
  }
}

__device__ __forceinline__ int clamp_to_int(int64_t x) {
  return static_cast<int>(max<int64_t>(min<int64_t>(x, INT32_MAX), INT32_MIN));
}

// A range [first, last] of key or query positions, clamped to int: covers(x0, n) says whether all of
// [x0, x0 + n) lies inside it.
struct Span {
  int first;
  int last;
  __device__ __forceinline__ static Span of(int64_t first, int64_t last) {
    return {clamp_to_int(first), clamp_to_int(last)};
  }
  __device__ __forceinline__ static Span everything() { return {INT32_MIN, INT32_MAX}; }
  __device__ __forceinline__ static Span none() { return {INT32_MAX, INT32_MIN}; }
  __device__ __forceinline__ bool covers(int x0, int n) const {
    return x0 >= first && static_cast<int64_t>(x0) + n - 1 <= last;
  }
};

struct ScoreShape {
  policy::WindowMask mask;
  float scale = 1.f;
  float softcap = 0.f;
  float softcap_inv = 0.f; // 1 / softcap
  float slope = 0.f;      // ALiBi slope of this (batch, head); 0 = none
  bool transform = false;  // softcap or ALiBi: the tile is rewritten
  float log2_factor = 1.f; // multiply the tile by this to get log2 logits
  // The mask per element, in int32: key j of row i is visible iff lo_diag <= j - i <= hi_diag and j < len_k.
  // (The window's keys_of(i) = [i + shift - window_left, i + shift + window_right] clipped to [0, len_k);
  // j - i always fits in int, and clamping the bounds to int keeps every comparison's outcome.)
  int lo_diag = INT32_MIN;
  int hi_diag = INT32_MAX;
  int len_k = 0;

  ScoreShape() = default;  // for a kernel that builds its shape later (forward_kernel)
  __device__ __forceinline__ ScoreShape(AttnParams const& p, int b, int h, int len_q, int len_k) {
    mask = policy::WindowMask{len_q, len_k, p.window_left, p.window_right};
    scale = p.scale;
    softcap = p.softcap;
    softcap_inv = softcap > 0.f ? 1.f / softcap : 0.f;
    if (p.alibi_slopes != nullptr) slope = p.alibi_slopes[b * p.alibi_batch_stride + h];
    transform = softcap > 0.f || slope != 0.f;
    log2_factor = transform ? 1.f : p.scale_log2;
    const int64_t shift = int64_t{len_k} - len_q;
    if (p.window_left >= 0) lo_diag = clamp_to_int(shift - p.window_left);
    if (p.window_right >= 0) hi_diag = clamp_to_int(shift + p.window_right);
    this->len_k = len_k;
  }

  // The keys that every query row of [m0, m1) sees (rows past len_q count as seeing everything: their
  // results are discarded), for Span::covers of a key tile. Computed once per CTA: per tile it is then two
  // compares (the int64 window arithmetic per tile cost ~85 instructions per iteration).
  __device__ __forceinline__ Span keys_seen_by_all(int m0, int m1) const {
    const int64_t m_last = min<int64_t>(m1, mask.seqlen_q) - 1;
    if (m_last < m0) return Span::everything();
    // Ranges slide monotonically: the first row has the smallest last key, the last row the largest first.
    return Span::of(mask.keys_of(m_last).first, mask.keys_of(m0).last);
  }

  // The query rows that see every key of [n0, n1) (none when the tile runs past len_k), for Span::covers of a
  // query tile (rows past len_q count as covered).
  __device__ __forceinline__ Span rows_seeing_all(int n0, int n1) const {
    if (n1 > mask.seqlen_k) return Span::none();
    // Row i sees all of them iff first(i) <= n0 and last(i) >= n1 - 1: the queries of key n0's window
    // that also reach key n1 - 1.
    const policy::KeyRange a = mask.queries_of_keys(n1 - 1, n1);
    const policy::KeyRange b = mask.queries_of_keys(n0, n0 + 1);
    Span span = Span::of(a.first, b.last);
    if (span.last >= mask.seqlen_q - 1) span.last = INT32_MAX;  // rows past len_q are covered too
    return span;
  }
};

// Shapes the tile `s` (an accumulator in (rows, cols) view) whose element coordinates are `coord` (tile-local,
// same view), with the tile's first row m0 and first key n0, and hands each element to
// emit(row, col, x, dtanh): x the shaped value (-inf where masked), dtanh = d(softcap·tanh(u/softcap))/du =
// 1 - tanh² under softcap, else 1. `masked`: apply the window mask (boundary tiles); otherwise only the
// transform. The backward consumes x and dtanh at once (no per-element dtanh array lives in registers).
// kTransform = false compiles the mask alone: for kernels launched only for calls without softcap and ALiBi
// (shaped_scores(p) false).
template <bool kTransform = true, class S, class C, class Emit>
__device__ __forceinline__ void shape_scores_each(S const& s, C const& coord, int m0, int n0, ScoreShape const& sh,
                                                  bool masked, Emit&& emit) {
  constexpr int kRows = decltype(size<0>(s))::value;
  constexpr int kCols = decltype(size<1>(s))::value;
  if (!(kTransform && sh.transform) && !masked) {
    CUTE_UNROLL
    for (int mi = 0; mi < kRows; ++mi) {
      CUTE_UNROLL
      for (int ni = 0; ni < kCols; ++ni) emit(mi, ni, s(mi, ni), 1.f);
    }
    return;
  }
  CUTE_UNROLL
  for (int mi = 0; mi < kRows; ++mi) {
    const int i = m0 + get<0>(coord(mi, 0));
    CUTE_UNROLL
    for (int ni = 0; ni < kCols; ++ni) {
      const int j = n0 + get<1>(coord(mi, ni));
      float x = s(mi, ni);
      float dtanh = 1.f;
      if (kTransform && sh.transform) {
        x *= sh.scale;
        if (sh.softcap > 0.f) {
          const float t = tanh_approx(x * sh.softcap_inv);
          x = sh.softcap * t;
          dtanh = 1.f - t * t;
        }
        if (sh.slope != 0.f) x += policy::alibi_bias(sh.slope, sh.mask.diagonal(i), j);
        x *= kLog2e;
      }
      if (masked && (j - i < sh.lo_diag || j - i > sh.hi_diag || j >= sh.len_k)) x = -INFINITY;
      emit(mi, ni, x, dtanh);
    }
  }
}

// The online softmax's step over one tile of log2 logits s (a row/column view: kRows rows of this thread, each
// row spread over the four threads of a quad) with exp2 factor f: each row's new running max, the factor that
// rescales what the row had accumulated (correction: exp2((old max - new max) * f), 0 on its first visible
// tile), P = exp2(s * f - max * f) in place of the scores, and the running sums rescaled and added to.
// Returns whether any of the thread's rows moved its max.
template <int kRows, class S>
__device__ __forceinline__ bool online_softmax(S& s, float f, float (&row_max)[kRows], float (&row_sum)[kRows],
                                               float (&correction)[kRows]) {
  bool moved = false;
  CUTE_UNROLL
  for (int r = 0; r < kRows; ++r) {
    float mx = row_max[r];
    CUTE_UNROLL
    for (int c = 0; c < cute::size<1>(s); ++c) mx = fmaxf(mx, s(r, c));
    mx = quad_max(mx);
    const float base = (mx == -INFINITY ? 0.f : mx) * f;
    correction[r] = exp2_approx(row_max[r] * f - base);
    moved |= mx != row_max[r];
    row_max[r] = mx;
    float sum = 0.f;
    CUTE_UNROLL
    for (int c = 0; c < cute::size<1>(s); ++c) {
      const float e = exp2_approx(fmaf(s(r, c), f, -base));
      s(r, c) = e;
      sum += e;
    }
    row_sum[r] = row_sum[r] * correction[r] + sum;
  }
  return moved;
}

// The window mask alone, in place: -inf where key j of row i is outside it. For kernels without the transform,
// called only on boundary tiles, before the exponentials. Key j = n0 + c of row i is visible iff
// lo_diag - (n0 - i) <= c <= hi_diag - (n0 - i) and c < len_k - n0: two bounds per row and one per tile
// against each element's column offset c, a compile-time constant (an immediate operand): an element costs
// its compares and a select, no index arithmetic.
template <class S, class C>
__device__ __forceinline__ void mask_scores(S& s, C const& coord, int m0, int n0, ScoreShape const& sh) {
  const int c_end = sh.len_k - n0;
  CUTE_UNROLL
  for (int mi = 0; mi < decltype(size<0>(s))::value; ++mi) {
    const int64_t base = int64_t{n0} - (m0 + get<0>(coord(mi, 0)));  // j - i = base + c
    const int lo = clamp_to_int(sh.lo_diag - base);
    const int hi = clamp_to_int(sh.hi_diag - base);
    CUTE_UNROLL
    for (int ni = 0; ni < decltype(size<1>(s))::value; ++ni) {
      const int c = get<1>(coord(mi, ni));
      if (c < lo || c > hi || c >= c_end) s(mi, ni) = -INFINITY;
    }
  }
}

// shape_scores_each, writing the shaped values back into s (the forward).
template <class S, class C>
__device__ __forceinline__ void shape_scores(S& s, C const& coord, int m0, int n0, ScoreShape const& sh,
                                             bool masked) {
  shape_scores_each(s, coord, m0, n0, sh, masked, [&](int mi, int ni, float x, float) { s(mi, ni) = x; });
}

}  // namespace flare::cuda

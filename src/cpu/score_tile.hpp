// score_tile.hpp — turns a tile of raw scores (scale * q·k) into what the softmax sees: softcap, ALiBi and
// the key-range mask of each row (common/attention_policy.hpp), vectorised over the tile's columns.
#pragma once

#include <cmath>

#include "common/attention_policy.hpp"
#include "cpu/sequences.hpp"
#include "cpu/simd.hpp"

namespace flare::cpu::FLARE_ISA {

struct ScoreShape {
  float softcap = 0.0f;  // 0 = off
  float slope = 0.0f;    // ALiBi slope of this head
  bool alibi = false;
  // Whether the scores need neither softcap nor ALiBi (only the mask may change them).
  bool plain() const { return softcap == 0 && !alibi; }
};

// One element of the row- and key-at-a-time backwards (few_keys.hpp, few_queries.hpp): the raw score x =
// scale q.k of query row i (diagonal = mask.diagonal(i)) and key j shaped as the tiles shape it (softcap, then
// ALiBi), P = exp(x - lse) and dS = P (dP - D), times 1 - tanh^2 under softcap.
struct ProbAndGrad {
  float p, ds;
};
// Out of line: inlined into few_keys.hpp's rows, it made them larger and 799 x 3 backwards ~9% slower (EPYC).
[[gnu::noinline]] inline ProbAndGrad backward_element(float x, float dp, float lse, float delta,
                                                      const ScoreShape& shape, int64_t diagonal, int64_t j) {
  float slope = 1.0f;
  if (shape.softcap > 0) {
    const float th = std::tanh(x / shape.softcap);
    x = shape.softcap * th;
    slope = 1.0f - th * th;
  }
  if (shape.alibi) x += policy::alibi_bias(shape.slope, diagonal, j);
  const float pr = std::exp(x - lse);
  return {pr, pr * (dp - delta) * slope};
}

// The shaping of head h's scores in sequence seq: the problem's softcap, and ALiBi with this head's slope.
inline ScoreShape score_shape(const Problem& p, const Sequence& seq, int64_t h) {
  ScoreShape shape;
  shape.softcap = p.score.softcap;
  shape.alibi = p.score.alibi_slopes != nullptr;
  shape.slope = alibi_slope(p, seq, h);
  return shape;
}

// The keys some query of [i0, i0 + rows) sees, clipped to [0, seqlen_k): first > last when there are none.
inline policy::KeyRange visible_keys(const policy::WindowMask& mask, int64_t i0, int64_t rows, int64_t seqlen_k) {
  const policy::KeyRange keys = mask.keys_of_rows(i0, i0 + rows);
  return {smax<int64_t>(keys.first, 0), smin<int64_t>(keys.last, seqlen_k - 1)};
}

// Whether every query in [i0, i0 + rows) sees every key in [j0, j0 + n): then only the softmax is needed.
inline bool block_fully_visible(const policy::WindowMask& mask, int64_t i0, int64_t rows, int64_t j0, int64_t n) {
  // Ranges slide monotonically with i: the last row has the largest first key, the first row the smallest last.
  return mask.keys_of(i0 + rows - 1).first <= j0 && mask.keys_of(i0).last >= j0 + n - 1;
}

// Sets the columns of a row of `cols` (a multiple of W) outside [first, last] to value, by selection: what
// was there, NaN included, does not matter.
template <class T>
inline void fill_outside(T* row, int64_t cols, int64_t first, int64_t last, T value) {
  using V = vec_t<T>;
  constexpr int W = Simd<T>::W;
  if (first <= 0 && last >= cols - 1) return;
  const V iota = viota<T>(), fill = vset<T>(value);
  const T lo = static_cast<T>(first), hi = static_cast<T>(last);
  for (int64_t c = 0; c < cols; c += W) {
    const V x = iota + static_cast<T>(c);
    vstore(row + c, ((x < lo) | (x > hi)) ? fill : vload(row + c));
  }
}

// Shapes one row of `cols` scores (a multiple of W): softcap (saving tanh to trow when given), ALiBi with
// |diagonal - key| = |dist0 + step * c| at column c, then -inf outside the visible columns [first, last].
template <class T>
inline void shape_row(T* row, T* trow, int64_t cols, const ScoreShape& shape, T dist0, T step, int64_t first,
                      int64_t last) {
  using V = vec_t<T>;
  constexpr int W = Simd<T>::W;
  const V iota = viota<T>();
  if (shape.softcap > 0) {
    const T inv_cap = T(1) / T(shape.softcap);
    for (int64_t c = 0; c < cols; c += W) {
      const V t = vtanh<T>(vload(row + c) * inv_cap);
      if (trow) vstore(trow + c, t);
      vstore(row + c, t * T(shape.softcap));
    }
  }
  if (shape.alibi) {
    const T slope = static_cast<T>(shape.slope);
    for (int64_t c = 0; c < cols; c += W) {
      const V dist = (iota + static_cast<T>(c)) * step + dist0;
      vstore(row + c, vload(row + c) - slope * (dist < 0 ? -dist : dist));
    }
  }
  fill_outside<T>(row, cols, first, last, static_cast<T>(kNegInf));
}

// s: rows x cols (cols a multiple of W) with leading dimension ld; row r is query i0 + r, column c is key
// j0 + c. Masked entries become -inf. With softcap, tanh_out (same layout) receives tanh(raw / softcap) for
// the backward pass's derivative (may be null).
template <class T>
inline void shape_scores(T* s, int64_t ld, int64_t rows, int64_t cols, int64_t i0, int64_t j0,
                         const policy::WindowMask& mask, const ScoreShape& shape, T* tanh_out) {
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t i = i0 + r;
    const policy::KeyRange keys = mask.keys_of(i);
    shape_row<T>(s + r * ld, tanh_out ? tanh_out + r * ld : nullptr, cols, shape,
                 static_cast<T>(mask.diagonal(i) - j0), T(-1), keys.first - j0, keys.last - j0);
  }
}

// The same shaping on a keys-major tile (the backward's Sᵀ): row r is key j0 + r, column c is query i0 + c.
// Keys at or past seqlen_k are masked whole.
template <class T>
inline void shape_scores_keys_major(T* s, int64_t ld, int64_t rows, int64_t cols, int64_t i0, int64_t j0,
                                    const policy::WindowMask& mask, const ScoreShape& shape, T* tanh_out) {
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t j = j0 + r;
    policy::KeyRange queries = mask.queries_of_keys(j, j + 1);
    if (j >= mask.seqlen_k) queries = {1, 0};
    shape_row<T>(s + r * ld, tanh_out ? tanh_out + r * ld : nullptr, cols, shape,
                 static_cast<T>(mask.diagonal(i0) - j), T(1), queries.first - i0, queries.last - i0);
  }
}

}  // namespace flare::cpu::FLARE_ISA

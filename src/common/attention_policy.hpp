// attention_policy.hpp — which keys a query sees and how a score is shaped: the small policy objects shared
// by the CPU and CUDA backends, so all paths agree by construction.
//
// Positions are relative to one sequence: query i in [0, seqlen_q), key j in [0, seqlen_k). The diagonal
// of query i is key i + seqlen_k - seqlen_q (bottom-right alignment, as in FlashAttention).
#pragma once

#include <cmath>
#include <cstdint>

#if defined(__CUDACC__)
#  define FLARE_HD __host__ __device__ __forceinline__
#else
// always_inline: these are compiled into several per-ISA translation units; no out-of-line copy may be
// shared between them.
#  define FLARE_HD inline __attribute__((always_inline))
#endif

namespace flare::policy {

// The visible keys of a query row form one contiguous range [first, last] (empty when first > last):
// the intersection of [0, seqlen_k) with the (causal-folded) sliding window around the diagonal.
struct KeyRange {
  int64_t first;
  int64_t last;
};

struct WindowMask {
  int64_t seqlen_q;
  int64_t seqlen_k;
  int64_t window_left;   // -1 = unbounded
  int64_t window_right;  // -1 = unbounded; causal is window_right = 0

  FLARE_HD int64_t diagonal(int64_t i) const { return i + seqlen_k - seqlen_q; }

  FLARE_HD KeyRange keys_of(int64_t i) const {
    int64_t first = 0;
    int64_t last = seqlen_k - 1;
    const int64_t d = diagonal(i);
    if (window_left >= 0 && d - window_left > first) first = d - window_left;
    if (window_right >= 0 && d + window_right < last) last = d + window_right;
    return {first, last};
  }

  // Keys visible to any query in [i0, i1): the union of the rows' ranges (they slide monotonically).
  FLARE_HD KeyRange keys_of_rows(int64_t i0, int64_t i1) const {
    const KeyRange a = keys_of(i0);
    const KeyRange b = keys_of(i1 - 1);
    return {a.first < b.first ? a.first : b.first, a.last > b.last ? a.last : b.last};
  }

  // Queries that see key j: the inverse of keys_of, used by the backward pass to skip query tiles.
  FLARE_HD KeyRange queries_of_keys(int64_t j0, int64_t j1) const {
    // query i sees key j iff d(i) - wl <= j <= d(i) + wr, i.e. j - wr <= d(i) <= j + wl
    int64_t first = 0;
    int64_t last = seqlen_q - 1;
    const int64_t shift = seqlen_k - seqlen_q;  // d(i) = i + shift
    if (window_right >= 0 && j0 - window_right - shift > first) first = j0 - window_right - shift;
    if (window_left >= 0 && j1 - 1 + window_left - shift < last) last = j1 - 1 + window_left - shift;
    return {first, last};
  }
};

// The key blocks (of block_n keys) that query rows [i0, i1) visit, split into the phases a kernel walks from
// the last block to the first: [unmasked_hi, last) need the mask (the diagonal or the end of the keys),
// [unmasked_lo, unmasked_hi) are seen whole by every row, [first, unmasked_lo) need it again (a window's left
// edge). first <= unmasked_lo <= unmasked_hi <= last; first == last when no row sees any key.
struct KeyBlocks {
  int64_t first;
  int64_t unmasked_lo;
  int64_t unmasked_hi;
  int64_t last;
};

FLARE_HD KeyBlocks key_blocks_of(WindowMask const& mask, int64_t i0, int64_t i1, int64_t block_n) {
  const KeyRange any = mask.keys_of_rows(i0, i1);
  if (i1 <= i0 || any.last < any.first) return {0, 0, 0, 0};
  const int64_t first = any.first / block_n;  // any.first >= 0
  const int64_t last = any.last / block_n + 1;
  // Keys every row sees: the ranges slide monotonically, so the last row's first key to the first row's last.
  const int64_t lo = mask.keys_of(i1 - 1).first;
  const int64_t hi = mask.keys_of(i0).last;  // <= seqlen_k - 1
  int64_t ulo = (lo + block_n - 1) / block_n;
  int64_t uhi = (hi + 1) / block_n;
  if (hi < lo || uhi <= ulo) ulo = uhi = last;  // no whole block: everything is walked masked
  if (ulo < first) ulo = first;
  if (uhi > last) uhi = last;
  return {first, ulo, uhi, last};
}

// A learnable sink (flare.h) folded into a finished row: lse = log(sum of the row's exponentials) and the
// sink's logit give the row's lse with the sink in its denominator, and the factor its normalised output is
// multiplied by (exp(lse - new lse) <= 1). A row that saw no key (lse = -inf) gets lse = sink, factor 0;
// a sink of -inf changes nothing. Computed as max + log1p(exp(-|difference|)): no overflow either way.
template <class T>
struct SinkFold {
  T lse;
  T factor;
};
template <class T>
FLARE_HD SinkFold<T> fold_sink(T lse, T sink) {
  using std::exp;
  using std::log1p;
  if (sink == -INFINITY) return {lse, T(1)};
  if (lse == -INFINITY) return {sink, T(0)};
  const T hi = lse > sink ? lse : sink, lo = lse > sink ? sink : lse;
  const T folded = hi + log1p(exp(lo - hi));
  return {folded, exp(lse - folded)};
}

// ALiBi bias of query i and key j: -slope * |diagonal(i) - j|.
FLARE_HD float alibi_bias(float slope, int64_t diagonal_i, int64_t j) {
  const int64_t dist = diagonal_i > j ? diagonal_i - j : j - diagonal_i;
  return -slope * static_cast<float>(dist);
}

}  // namespace flare::policy

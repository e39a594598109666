// merge_rows.hpp — the LSE merge of two partial attention results over disjoint key sets, for one row:
// flare_merge_states (merge.cpp) and the split-KV decode's combine (decode.hpp) both use it.
// Per-ISA like the kernels (see simd.hpp for why).
#pragma once

#include <cmath>
#include <limits>

#include "cpu/simd.hpp"

namespace flare::cpu::FLARE_ISA {

// The weights of the two parts of a row and the merged lse:
//   m = max(lse_a, lse_b), w_a = exp(lse_a - m) / s, w_b = exp(lse_b - m) / s, s = sum of the exponentials,
//   lse = m + log s.
// A part with lse -inf (no visible key) gets weight 0; both -inf: weights 0, lse -inf (out = 0, never NaN).
template <class T>
struct MergeWeights {
  T a = 0, b = 0, lse = -std::numeric_limits<T>::infinity();
};
template <class T>
inline MergeWeights<T> merge_weights(T lse_a, T lse_b) {
  MergeWeights<T> w;
  const T m = lse_a > lse_b ? lse_a : lse_b;
  if (m == -std::numeric_limits<T>::infinity()) return w;
  const T ea = std::exp(lse_a - m);
  const T eb = std::exp(lse_b - m);
  const T s = ea + eb;
  w.a = ea / s;
  w.b = eb / s;
  w.lse = m + std::log(s);
  return w;
}

// acc[c] = w_a * acc[c] + w_b * part[c] for c < n: folding one more part into a running merge.
template <class T>
inline void merge_into(T* acc, const T* part, T wa, T wb, int64_t n) {
  for (int64_t c = 0; c < n; ++c) acc[c] = wa * acc[c] + wb * part[c];
}

}  // namespace flare::cpu::FLARE_ISA

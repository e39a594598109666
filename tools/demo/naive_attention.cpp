// naive_attention.cpp — see naive_attention.hpp. Three passes over a materialised score matrix.
#include "naive_attention.hpp"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <limits>

namespace flare_demo {
namespace {

// The row kernels are compiled for several instruction sets (target_clones) and picked at load time, so
// the foil gets the vector width of this machine rather than baseline SSE2.

// srow[j] = scale * q_i . k_j for the visible keys j < visible, -inf for the rest.
[[gnu::target_clones("arch=skylake-avx512", "arch=haswell", "default")]] void scores_row(
    const float* qi, const float* k, int64_t k_row_stride, int64_t seqlen_k, int64_t visible, int64_t headdim,
    float scale, float* srow) {
  for (int64_t j = 0; j < seqlen_k; ++j) {
    if (j >= visible) {
      srow[j] = -std::numeric_limits<float>::infinity();
      continue;
    }
    const float* kj = k + j * k_row_stride;
    float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
    for (int64_t t = 0; t < headdim; ++t) dot += qi[t] * kj[t];
    srow[j] = scale * dot;
  }
}

// In place: srow <- softmax(srow). A row with no visible key becomes all zeros.
[[gnu::target_clones("arch=skylake-avx512", "arch=haswell", "default")]] void softmax_row(float* srow,
                                                                                          int64_t seqlen_k) {
  float row_max = -std::numeric_limits<float>::infinity();
  for (int64_t j = 0; j < seqlen_k; ++j) row_max = std::fmax(row_max, srow[j]);
  if (row_max == -std::numeric_limits<float>::infinity()) {
    for (int64_t j = 0; j < seqlen_k; ++j) srow[j] = 0.0f;
    return;
  }
  float sum = 0.0f;
  for (int64_t j = 0; j < seqlen_k; ++j) {
    srow[j] = std::exp(srow[j] - row_max);
    sum += srow[j];
  }
  const float inv_sum = 1.0f / sum;
  for (int64_t j = 0; j < seqlen_k; ++j) srow[j] *= inv_sum;
}

// orow = sum_j prow[j] * v_j
[[gnu::target_clones("arch=skylake-avx512", "arch=haswell", "default")]] void pv_row(
    const float* prow, const float* v, int64_t v_row_stride, int64_t seqlen_k, int64_t headdim, float* orow) {
  for (int64_t t = 0; t < headdim; ++t) orow[t] = 0.0f;
  for (int64_t j = 0; j < seqlen_k; ++j) {
    const float p = prow[j];
    const float* vj = v + j * v_row_stride;
#pragma omp simd
    for (int64_t t = 0; t < headdim; ++t) orow[t] += p * vj[t];
  }
}

}  // namespace

size_t naive_scores_bytes(const AttentionShape& s) {
  return static_cast<size_t>(s.batch) * s.nheads * s.seqlen_q * s.seqlen_k * sizeof(float);
}

bool naive_attention(const AttentionShape& s, const float* q, const float* k, const float* v, float* out) {
  float* scores = static_cast<float*>(std::malloc(naive_scores_bytes(s)));  // (batch, nheads, sq, sk)
  if (scores == nullptr) return false;
  const float scale = 1.0f / std::sqrt(static_cast<float>(s.headdim));
  const int64_t row_stride = s.nheads * s.headdim;  // between consecutive tokens of one head
  const int64_t rows = s.batch * s.nheads * s.seqlen_q;

  // Row r of the score matrix is (b, h, i) = (r / (nheads * sq), (r / sq) % nheads, r % sq).
  auto token_row = [&](int64_t b, int64_t i, int64_t h, int64_t seqlen) {  // offset of (b, i, h, 0)
    return ((b * seqlen + i) * s.nheads + h) * s.headdim;
  };

#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t b = r / (s.nheads * s.seqlen_q), h = (r / s.seqlen_q) % s.nheads, i = r % s.seqlen_q;
    // causal, bottom-right aligned: query i sees keys j <= i + seqlen_k - seqlen_q
    const int64_t last_visible = i + s.seqlen_k - s.seqlen_q;
    const int64_t visible = s.causal ? std::clamp<int64_t>(last_visible + 1, 0, s.seqlen_k) : s.seqlen_k;
    scores_row(q + token_row(b, i, h, s.seqlen_q), k + token_row(b, 0, h, s.seqlen_k), row_stride, s.seqlen_k,
               visible, s.headdim, scale, scores + r * s.seqlen_k);
  }

#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < rows; ++r) softmax_row(scores + r * s.seqlen_k, s.seqlen_k);

#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t b = r / (s.nheads * s.seqlen_q), h = (r / s.seqlen_q) % s.nheads, i = r % s.seqlen_q;
    pv_row(scores + r * s.seqlen_k, v + token_row(b, 0, h, s.seqlen_k), row_stride, s.seqlen_k, s.headdim,
           out + token_row(b, i, h, s.seqlen_q));
  }

  std::free(scores);
  return true;
}

}  // namespace flare_demo

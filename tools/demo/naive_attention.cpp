// naive_attention.cpp — see naive_attention.hpp. Three passes over a materialised score matrix.
#include "naive_attention.hpp"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <limits>

namespace flare_demo {
namespace {

// Query rows that share each key (value) row read from memory; without this, every query row would
// stream all of K and V from outer caches and the foil would be slow for a reason that is not the point.
constexpr int64_t kRowBlock = 8;

// The block kernels are compiled for several instruction sets (target_clones) and picked at load time,
// so the foil gets this machine's vector width rather than baseline SSE2.

// s[r][j] = scale * q_r . k_j for the nrows query rows of a block, -inf for j >= visible[r].
[[gnu::target_clones("arch=skylake-avx512", "arch=haswell", "default")]] void scores_block(
    const float* q, int64_t q_stride, int64_t nrows, const int64_t* visible, const float* k, int64_t k_stride,
    int64_t seqlen_k, int64_t headdim, float scale, float* s, int64_t s_stride) {
  for (int64_t j = 0; j < seqlen_k; ++j) {
    const float* kj = k + j * k_stride;
    for (int64_t r = 0; r < nrows; ++r) {
      if (j >= visible[r]) {
        s[r * s_stride + j] = -std::numeric_limits<float>::infinity();
        continue;
      }
      const float* qr = q + r * q_stride;
      float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
      for (int64_t t = 0; t < headdim; ++t) dot += qr[t] * kj[t];
      s[r * s_stride + j] = scale * dot;
    }
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

// o[r] = sum_j p[r][j] * v_j for the nrows rows of a block.
[[gnu::target_clones("arch=skylake-avx512", "arch=haswell", "default")]] void pv_block(
    const float* p, int64_t p_stride, int64_t nrows, const float* v, int64_t v_stride, int64_t seqlen_k,
    int64_t headdim, float* o, int64_t o_stride) {
  for (int64_t r = 0; r < nrows; ++r)
    for (int64_t t = 0; t < headdim; ++t) o[r * o_stride + t] = 0.0f;
  for (int64_t j = 0; j < seqlen_k; ++j) {
    const float* vj = v + j * v_stride;
    for (int64_t r = 0; r < nrows; ++r) {
      const float pr = p[r * p_stride + j];
      float* orow = o + r * o_stride;
#pragma omp simd
      for (int64_t t = 0; t < headdim; ++t) orow[t] += pr * vj[t];
    }
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
  const int64_t token_stride = s.nheads * s.headdim;  // between consecutive tokens of one head
  const int64_t blocks_per_head = (s.seqlen_q + kRowBlock - 1) / kRowBlock;
  const int64_t blocks = s.batch * s.nheads * blocks_per_head;
  auto offset = [&](int64_t b, int64_t i, int64_t h, int64_t seqlen) {  // of element (b, i, h, 0)
    return ((b * seqlen + i) * s.nheads + h) * s.headdim;
  };
  // Block n covers query rows i0 .. i0 + nrows - 1 of head h in batch b; its score rows start at
  // row (b * nheads + h) * seqlen_q + i0 of the score matrix.
  struct Block {
    int64_t b, h, i0, nrows;
    float* s;
  };
  auto block = [&](int64_t n) {
    const int64_t bh = n / blocks_per_head, i0 = (n % blocks_per_head) * kRowBlock;
    return Block{bh / s.nheads, bh % s.nheads, i0, std::min(kRowBlock, s.seqlen_q - i0),
                 scores + (bh * s.seqlen_q + i0) * s.seqlen_k};
  };

#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < blocks; ++n) {
    const Block blk = block(n);
    int64_t visible[kRowBlock];
    for (int64_t r = 0; r < blk.nrows; ++r) {
      // causal, bottom-right aligned: query i sees keys j <= i + seqlen_k - seqlen_q
      const int64_t last_visible = blk.i0 + r + s.seqlen_k - s.seqlen_q;
      visible[r] = s.causal ? std::clamp<int64_t>(last_visible + 1, 0, s.seqlen_k) : s.seqlen_k;
    }
    scores_block(q + offset(blk.b, blk.i0, blk.h, s.seqlen_q), token_stride, blk.nrows, visible,
                 k + offset(blk.b, 0, blk.h, s.seqlen_k), token_stride, s.seqlen_k, s.headdim, scale, blk.s,
                 s.seqlen_k);
  }

  const int64_t rows = s.batch * s.nheads * s.seqlen_q;
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < rows; ++r) softmax_row(scores + r * s.seqlen_k, s.seqlen_k);

#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < blocks; ++n) {
    const Block blk = block(n);
    pv_block(blk.s, s.seqlen_k, blk.nrows, v + offset(blk.b, 0, blk.h, s.seqlen_k), token_stride, s.seqlen_k,
             s.headdim, out + offset(blk.b, blk.i0, blk.h, s.seqlen_q), token_stride);
  }

  std::free(scores);
  return true;
}

}  // namespace flare_demo

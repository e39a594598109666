// naive_attention.hpp — the demo's foil: attention the naive way, materialising every score.
//
//   S = scale * Q K^T          fp32, (batch, nheads, seqlen_q, seqlen_k): the n x n matrix flare avoids
//   S[i][j] = -inf where causal masking hides key j from query i (bottom-right aligned)
//   P = softmax(S) row-wise    in place
//   O = P V
// Written with plain loops (OpenMP over blocks of query rows, compiler-vectorised inner loops),
// independently of flare.
#pragma once

#include <cstddef>
#include <cstdint>

namespace flare_demo {

struct AttentionShape {
  int64_t batch, seqlen_q, seqlen_k, nheads, headdim;
  bool causal;
};

// Bytes of the score matrix the naive way needs: batch * nheads * seqlen_q * seqlen_k fp32 values.
size_t naive_scores_bytes(const AttentionShape& s);

// q (batch, seqlen_q, nheads, headdim), k/v (batch, seqlen_k, nheads, headdim), out like q; all fp32 and
// contiguous. Allocates the score matrix itself and frees it before returning. Returns false if that
// allocation fails.
bool naive_attention(const AttentionShape& s, const float* q, const float* k, const float* v, float* out);

}  // namespace flare_demo

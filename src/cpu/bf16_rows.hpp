// bf16_rows.hpp — what the bf16 tile loops (forward_bf16.hpp, backward_bf16.hpp) need around their products,
// whichever product runs them (AMX tiles or AVX512_BF16 dot products): the softmax's exponentials at the
// precision a bf16 P keeps, rounding fp32 rows to bf16, and the backward's per-query values and elementwise
// step. Included only by translation units compiled with AVX512_BF16 (isa_amx.cpp, isa_avx512bf16.cpp).
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "cpu/score_tile.hpp"
#include "cpu/sequences.hpp"

namespace flare::cpu::FLARE_ISA {

// Tile shapes of the bf16 engines, whichever product runs them: the forward's query tiles and key blocks
// (forward_bf16.hpp), the backward's (backward_bf16.hpp). Multiples of 32: the AMX products run on whole
// 32 x 32 blocks, and P is rounded to bf16 32 columns at a time (Bf16PairWriter).
struct Bf16Tiles {
  static constexpr int64_t kForwardBq = 64, kForwardBk = 128;
  static constexpr int64_t kBackwardBq = 64, kBackwardBk = 64;
};

// The softmax's exponentials on the bf16 paths: RowExpFull's (vexp2, 1.9e-7 relative, far finer than the
// bf16 rounding of P that follows).
using RowExpBf16 = RowExpFull;

// Rounds n floats (a multiple of 16) to bf16 (nearest even), vectorised.
inline void round_to_bf16(const float* src, uint16_t* dst, int64_t n) {
  for (int64_t c = 0; c < n; c += 16) {
    const __m256bh b = _mm512_cvtneps_pbh(_mm512_loadu_ps(src + c));
    std::memcpy(dst + c, &b, sizeof(b));
  }
}

// An emit for online_softmax_row that writes the row's probabilities to `row` as bf16, 32 columns (two
// vectors, one vcvtne2ps2bf16) at a time: the row's length must be a multiple of 32.
class Bf16PairWriter {
 public:
  // keep, when given: each value is zeroed where bit c % 16 of keep[c / 16] is clear (dropout's keep bits,
  // dropout_tile_bits), in the rounding itself; the kept ones' factor 1 / (1 - p) is left to the output
  // (finish_rows' out_scale), as FlashAttention 2 leaves it.
  explicit Bf16PairWriter(uint16_t* row, const uint16_t* keep = nullptr) : row_(row), keep_(keep) {}
  void operator()(int64_t c, vec_t<float> e) {
    if (c % 32 == 0) {
      even_ = static_cast<__m512>(e);
    } else {
      const __m512bh pair =
          keep_ ? _mm512_maskz_cvtne2ps_pbh(keep_[c / 16 - 1] | (static_cast<__mmask32>(keep_[c / 16]) << 16),
                                            static_cast<__m512>(e), even_)
                : _mm512_cvtne2ps_pbh(static_cast<__m512>(e), even_);
      std::memcpy(row_ + c - 16, &pair, sizeof(pair));
    }
  }

 private:
  uint16_t* row_;
  const uint16_t* keep_;
  __m512 even_ = _mm512_setzero_ps();
};

// The backward's per-query values for queries [i0, i0 + n) of one head (written at delta[i], lse_out[i]):
// D = rowsum(dO * O) from the bf16 rows, and the forward's lse, or +inf where a query sees no key or lies
// past the sequence (its P is then 0).
inline void bf16_delta_and_lse(const Problem& p, const Sequence& seq, const RowPtr& dorows, const RowPtr& orows,
                               const float* lse, int64_t i0, int64_t n, float* delta, float* lse_out) {
  for (int64_t i = i0; i < i0 + n; ++i) {
    const bool in = i < seq.seqlen_q;
    float sum = 0.0f;
    if (in) {
      const uint16_t* dout = reinterpret_cast<const uint16_t*>(dorows.row(i));
      const uint16_t* out = reinterpret_cast<const uint16_t*>(orows.row(i));
      for (int64_t c = 0; c < p.headdim_v; ++c) sum += bf16_to_float(dout[c]) * bf16_to_float(out[c]);
    }
    delta[i] = sum;
    lse_out[i] = (in && lse[i] != kNegInf) ? lse[i] : __builtin_inff();
  }
}

// The backward's elementwise step on one keys-major tile (row r is key j0 + r, column c query i0 + c; keys
// x queries fp32 with leading dimension queries): Pᵀ = exp(scale · Sᵀ - lse) and dSᵀ = Pᵀ ∘ (dPᵀ - D)
// (∘ (1 - tanh²) under softcap), written back to s and dp and rounded to bf16 into p and ds. Softcap, ALiBi
// and masks are applied first where the block needs them (tanh receives the softcap's tanh); lse and delta
// are the tile's queries' (lse = +inf where a query sees no key or is padding, so that its P is 0). Where a
// query cannot see a key, or is padding, dS is 0 by selection: 0 x (dP - D) would be NaN when the key's V
// (and so dP) holds a NaN or infinity, and would carry it into the query's dQ and the key's dK.
// With dropout, zt holds the tile's keep factors z (keys-major like s): Pᵀ becomes Pᵀ z (for dV) and
// dSᵀ = Pᵀ ∘ (dPᵀ z - D); zt is null without dropout.
inline void bf16_backward_elementwise(const Problem& p, const Sequence& seq, int64_t h, int64_t i0, int64_t j0,
                                      int64_t keys, int64_t queries, const float* lse, const float* delta, float* s,
                                      float* dp, float* tanh, uint16_t* pb, uint16_t* ds, const float* zt) {
  using V = vec_t<float>;
  constexpr int W = Simd<float>::W;
  const policy::WindowMask mask = seq.mask(p);
  const float scale = static_cast<float>(p.score.scale);
  const ScoreShape shape = score_shape(p, seq, h);
  const bool clipped = seq.seqlen_k - j0 < keys || !block_fully_visible(mask, i0, smin(queries, seq.seqlen_q - i0), j0, keys);
  const bool shaped = shape.softcap > 0 || shape.alibi || clipped;
  const bool padded = seq.seqlen_q - i0 < queries;
  float row_scale = scale;
  if (shaped) {
    for (int64_t r = 0; r < keys * queries; r += W) vstore(s + r, vload(s + r) * scale);
    shape_scores_keys_major<float>(s, queries, keys, queries, i0, j0, mask, shape, tanh);
    row_scale = 1.0f;
  }
  for (int64_t r = 0; r < keys; ++r) {
    float* srow = s + r * queries;
    float* dsrow = dp + r * queries;
    const float* th = tanh + r * queries;
    for (int64_t c = 0; c < queries; c += W) {
      V pv = vexp(vload(srow + c) * row_scale - vload(lse + c));
      V dpv = vload(dsrow + c);
      V zv{};
      if (zt) {
        zv = vload(zt + r * queries + c);
        dpv = dpv * zv;
      }
      V d = pv * (dpv - vload(delta + c));
      if (shape.softcap > 0) {
        const V tv = vload(th + c);
        d = d * (1.0f - tv * tv);
      }
      if (zt) pv = pv * zv;
      vstore(srow + c, pv);
      vstore(dsrow + c, d);
    }
    if (clipped || padded) {
      const int64_t j = j0 + r;
      const policy::KeyRange seen = j < seq.seqlen_k ? mask.queries_of_keys(j, j + 1) : policy::KeyRange{1, 0};
      fill_outside<float>(dsrow, queries, seen.first - i0, smin(seen.last, seq.seqlen_q - 1) - i0, 0.0f);
    }
    round_to_bf16(srow, pb + r * queries, queries);
    round_to_bf16(dsrow, ds + r * queries, queries);
  }
}

}  // namespace flare::cpu::FLARE_ISA

// bf16_rows.hpp — what the bf16 engines (AMX tiles, forward_amx.hpp / backward_amx.hpp, and AVX512_BF16 dot
// products, forward_dot.hpp) share around their products: the softmax's exponentials at the precision a bf16
// P keeps, and rounding fp32 rows to bf16. Included only by translation units compiled with AVX512_BF16
// (isa_amx.cpp, isa_avx512bf16.cpp).
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "cpu/simd.hpp"

namespace flare::cpu::FLARE_ISA {

// The softmax's exponentials on the bf16 paths: exp(scale * s - m) = 2^(s * scale log2 e - m log2 e) by
// vexp2<5> (5e-6 relative, hundreds of times finer than the bf16 rounding of P that follows).
struct RowExpBf16 {
  static vec_t<float> apply(vec_t<float> x, float scale, float m) {
    return vexp2<5>(x * (scale * kLog2e) - m * kLog2e);
  }
};

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
  explicit Bf16PairWriter(uint16_t* row) : row_(row) {}
  void operator()(int64_t c, vec_t<float> e) {
    if (c % 32 == 0) {
      even_ = static_cast<__m512>(e);
    } else {
      const __m512bh pair = _mm512_cvtne2ps_pbh(static_cast<__m512>(e), even_);
      std::memcpy(row_ + c - 16, &pair, sizeof(pair));
    }
  }

 private:
  uint16_t* row_;
  __m512 even_ = _mm512_setzero_ps();
};

}  // namespace flare::cpu::FLARE_ISA

// dot_bf16.hpp — bf16 matrix products on AVX512_BF16 dot products (vdpbf16ps), for processors without AMX.
// Included only by isa_avx512bf16.cpp (compiled with -mavx512bf16): its bf16 engine and the decode path's
// dot-product tiles (decode_tiles.hpp).
//
// vdpbf16ps adds to each fp32 lane i the two products a[2i] b[2i] + a[2i+1] b[2i+1] of bf16 pairs: one step
// of the reduction dimension K is a pair of bf16 held in one 32-bit word. The register blocking is
// tile_gemm.hpp's (6 rows x 4 vectors of fp32 C); per step of K it broadcasts one A word (a pair along K
// of one row) and loads B words laid out as pairs along K: word (kp, n) = (B[2 kp][n], B[2 kp + 1][n]),
// low half first, rows kp at stride ldb words ("pair rows"). A is bf16 row-major, so an A row read as
// words is already pairs along K; the packers below build the B layouts, zero-padding an odd K.
// Each instruction does 32 multiply-adds against an fp32 FMA's 16: twice the arithmetic per issue slot.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "cpu/bf16_rows.hpp"
#include "cpu/tile_gemm.hpp"

namespace flare::cpu::FLARE_ISA {

// The micro-kernel's arithmetic on bf16 pairs (see tile_gemm.hpp's FmaOps): In is a pair word, C is fp32.
// The pairs travel as integer vectors (__m512i) and become __m512bh only inside madd: clang 16 mishandles
// values of bf16 vector type between functions. At -O0 a call taking two __m512bh arguments passes both in
// zmm1 and leaves the callee's zmm2 unset (run-to-run garbage in B), and at -O1 and above its VectorCombine
// recurses without end on a bitcast of the A broadcast to __m512bh (LLVM issue 68117) and crashes. Under
// clang, vdpbf16ps is written as inline assembly on the integer vectors, so no bf16 vector value exists.
struct Bf16PairOps {
  using In = uint32_t;
  using Acc = float;
  using VA = __m512i;
  using VB = __m512i;
  using VC = __m512;
  static constexpr int W = 16;
  static VA broadcast(In a) { return _mm512_set1_epi32(static_cast<int>(a)); }
  static VB load_b(const In* p) { return _mm512_loadu_si512(p); }
  static VC load_c(const Acc* p) { return _mm512_loadu_ps(p); }
  static void store_c(Acc* p, VC v) { _mm512_storeu_ps(p, v); }
  static VC madd(VC c, VA a, VB b) {
#if defined(__clang__)
    __asm__("vdpbf16ps %2, %1, %0" : "+v"(c) : "v"(a), "v"(b));
    return c;
#else
    return _mm512_dpbf16_ps(c, reinterpret_cast<__m512bh>(a), reinterpret_cast<__m512bh>(b));
#endif
  }
};

// C (m x n fp32, ldc) = or += A · B: A has m rows of k_pairs pair words (lda words apart; with TransA stored
// as k_pairs rows of m words), B k_pairs pair rows of n words (ldb apart); n a multiple of 16.
template <bool Accumulate, bool TransA = false>
inline void dot_gemm(int64_t m, int64_t n, int64_t k_pairs, const uint32_t* a, int64_t lda, const uint32_t* b,
                     int64_t ldb, float* c, int64_t ldc) {
  gemm_tile_of<Bf16PairOps, Accumulate, TransA>(m, n, k_pairs, a, lda, RowsB<uint32_t>{b, ldb}, c, ldc);
}

// The pair word of src[2 q], src[2 q + 1] where src has len elements (0 past the end, nullptr: 0).
inline uint32_t pair_at(const uint16_t* src, int64_t q, int64_t len) {
  if (src == nullptr || 2 * q >= len) return 0u;
  const uint32_t hi = 2 * q + 1 < len ? src[2 * q + 1] : 0u;
  return src[2 * q] | (hi << 16);
}

// Copies a bf16 row of len elements as `pairs` A words (zero-padded: an odd len's last pair, and beyond).
inline void copy_row_pairs(uint32_t* dst, const uint16_t* src, int64_t len, int64_t pairs) {
  const int64_t full = src == nullptr ? 0 : smin(len / 2, pairs);
  if (full > 0) std::memcpy(dst, src, full * sizeof(uint32_t));
  for (int64_t q = full; q < pairs; ++q) dst[q] = pair_at(src, q, len);
}

// Packs rows whose elements run along K into pair rows (K for S = Q Kᵀ: row n is key n, K the head
// dimension): dst word (q, n) = pair q of row(n), for n in [0, n_count) and q in [0, pairs); row(n) gives
// row n's first len bf16 (nullptr: a zero row).
template <class RowFn>
inline void pack_pairs_along_rows(uint32_t* dst, int64_t ldb, int64_t n_count, int64_t len, int64_t pairs,
                                  RowFn row) {
  const int64_t full = smin(len / 2, pairs);
  for (int64_t n = 0; n < n_count; ++n) {
    const uint16_t* src = row(n);
    int64_t q = 0;
    if (src != nullptr) {
      for (; q < full; ++q) {
        uint32_t v;
        std::memcpy(&v, src + 2 * q, sizeof(v));
        dst[q * ldb + n] = v;
      }
    }
    for (; q < pairs; ++q) dst[q * ldb + n] = pair_at(src, q, len);
  }
}

// Packs rows that run along K into pair rows (V for O += P V: row k is key k, n the column): dst word
// (kp, n) = (row(2 kp)[n], row(2 kp + 1)[n]) for kp in [0, k_count / 2) (k_count even) and n in
// [0, n_pad) (a multiple of 16), zero past len columns; row(k) gives row k's first len bf16 (nullptr: zeros).
template <class RowFn>
inline void pack_pairs_across_rows(uint32_t* dst, int64_t ldb, int64_t k_count, int64_t len, int64_t n_pad,
                                   RowFn row) {
  for (int64_t kp = 0; kp < k_count / 2; ++kp) {
    const uint16_t* even = row(2 * kp);
    const uint16_t* odd = row(2 * kp + 1);
    uint32_t* out = dst + kp * ldb;
    int64_t n = 0;
    if (even != nullptr && odd != nullptr) {
      // 16 columns of both rows widened to words, the odd row's in the high halves. (Zero-masked forms with
      // a full mask: GCC 12 warns on the unmasked ones' undefined pass-through operand.)
      const auto widen = [](const uint16_t* src) {
        return _mm512_maskz_cvtepu16_epi32(0xffff, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src)));
      };
      for (; n + 16 <= len; n += 16)
        _mm512_storeu_si512(out + n, _mm512_or_si512(widen(even + n), _mm512_maskz_slli_epi32(0xffff, widen(odd + n), 16)));
    }
    for (; n < n_pad; ++n) {
      const uint32_t lo = (even != nullptr && n < len) ? even[n] : 0u;
      const uint32_t hi = (odd != nullptr && n < len) ? odd[n] : 0u;
      out[n] = lo | (hi << 16);
    }
  }
}

}  // namespace flare::cpu::FLARE_ISA

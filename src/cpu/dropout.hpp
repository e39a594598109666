// dropout.hpp — attention dropout's keep factors on the CPU, drawn from common/philox.hpp's stream.
//
// A kernel asks for the factors of a piece of one (sequence, head)'s probability matrix: z = 1 / (1 - p) where
// the element is kept, 0 where it is dropped. Philox runs on as many counters at once as a vector holds
// (GCC/clang vector extensions: the 32x32->64 multiplies become the ISA's widening multiply), one counter
// per four keys of one query. Two layouts:
//   dropout_row          queries-major: one query's keys j0 .. j0 + n (the forward's P rows, the FMA
//                        backward's): counters vary in their key group, their words are consecutive keys;
//   dropout_keys_major   a tile with keys as rows, queries as columns (the bf16 backward engines' Pᵀ):
//                        counters vary in their query, word w of a counter is key row 4 * group + w, so
//                        each word vector is a row segment, stored whole.
#pragma once

#if defined(__AVX2__) || defined(__AVX512F__)
#  include <immintrin.h>
#endif

#include <cstdint>
#include <type_traits>

#include "common/philox.hpp"
#include "cpu/sequences.hpp"

namespace flare::cpu::FLARE_ISA {

// Philox counters, one per 32-bit lane of the ISA's vector.
inline constexpr int kPhiloxLanes = FLARE_VEC_BYTES / 4;
typedef uint32_t PhiloxU32 __attribute__((vector_size(FLARE_VEC_BYTES)));
typedef uint64_t PhiloxU64 __attribute__((vector_size(2 * FLARE_VEC_BYTES)));

struct PhiloxLanes {
  PhiloxU32 w[4];
};

// The 64-bit products m * a of every lane, as their high and low halves.
inline void mulhilo(PhiloxU32 a, uint32_t m, PhiloxU32& hi, PhiloxU32& lo) {
#if FLARE_VEC_BYTES == 64 && defined(__AVX512F__)
  // vpmuludq on the even and the odd lanes: what the generic form below becomes is vpmullq, three times slower.
  // (The maskz forms with every lane set: GCC 12 warns about the plain ones' undefined pass-through operand.)
  constexpr __mmask8 kAll = 0xFF;
  const __m512i av = reinterpret_cast<__m512i>(a), mv = _mm512_set1_epi32(static_cast<int>(m));
  const __m512i even = _mm512_maskz_mul_epu32(kAll, av, mv);
  const __m512i odd = _mm512_maskz_mul_epu32(kAll, _mm512_maskz_srli_epi64(kAll, av, 32), mv);
  lo = reinterpret_cast<PhiloxU32>(_mm512_mask_blend_epi32(0xAAAA, even, _mm512_maskz_slli_epi64(kAll, odd, 32)));
  hi = reinterpret_cast<PhiloxU32>(_mm512_mask_blend_epi32(0xAAAA, _mm512_maskz_srli_epi64(kAll, even, 32), odd));
#else
  const PhiloxU64 p = __builtin_convertvector(a, PhiloxU64) * uint64_t{m};
  hi = __builtin_convertvector(p >> 32, PhiloxU32);
  lo = __builtin_convertvector(p, PhiloxU32);
#endif
}

// philox::philox4x32_10 on every lane.
inline PhiloxLanes philox_lanes(PhiloxLanes c, uint32_t k0, uint32_t k1) {
  for (int round = 0; round < philox::kRounds; ++round) {
    PhiloxU32 hi0{}, lo0{}, hi1{}, lo1{};
    mulhilo(c.w[0], philox::kMul0, hi0, lo0);
    mulhilo(c.w[2], philox::kMul1, hi1, lo1);
    c = PhiloxLanes{{hi1 ^ c.w[1] ^ k0, lo1, hi0 ^ c.w[3] ^ k1, lo0}};
    k0 += philox::kWeyl0;
    k1 += philox::kWeyl1;
  }
  return c;
}

inline PhiloxU32 philox_iota(uint32_t first) {
  PhiloxU32 v;
  for (int l = 0; l < kPhiloxLanes; ++l) v[l] = first + static_cast<uint32_t>(l);
  return v;
}

// The call's dropout, as a kernel uses it: off when p is 0.
struct DropoutDraw {
  philox::DropoutKey key;
  uint32_t threshold = 0;  // words below it drop their element
  double scale = 1.0;     // 1 / (1 - p): the factor of a kept element (rounded to the compute type)
};

inline DropoutDraw dropout_draw(const Problem& p) {
  return {philox::dropout_key(p.dropout_seed, p.dropout_offset), philox::dropout_threshold(p.dropout_p),
          1.0 / (1.0 - static_cast<double>(p.dropout_p))};
}

// The stream of (sequence, query head): b * nheads + h, modulo 2^32.
inline uint32_t dropout_stream(const Problem& p, const Sequence& seq, int64_t h) {
  return static_cast<uint32_t>(seq.b * p.nheads + h);
}

// Lane l's words are keys 4l .. 4l + 3 of a batch: stores the 4 * kPhiloxLanes factors in key order (z[4l + w]
// from word w of lane l). The AVX2 and AVX-512 forms transpose the words in registers (unpacks within
// 128-bit lanes, then whole 128-bit lanes moved) and store whole vectors of factors.
inline void store_factors(const PhiloxLanes& r, uint32_t threshold, float kept, float* z) {
#if FLARE_VEC_BYTES == 64 && defined(__AVX512F__)
  // The maskz forms with every lane set, as in mulhilo.
  constexpr __mmask16 kAll = 0xFFFF;
  constexpr __mmask8 kAll64 = 0xFF;
  const auto w = [&](int x) { return reinterpret_cast<__m512i>(r.w[x]); };
  const __m512i a = _mm512_maskz_unpacklo_epi32(kAll, w(0), w(1)), b = _mm512_maskz_unpackhi_epi32(kAll, w(0), w(1));
  const __m512i c = _mm512_maskz_unpacklo_epi32(kAll, w(2), w(3)), e = _mm512_maskz_unpackhi_epi32(kAll, w(2), w(3));
  // q_s, 128-bit lane k: the four words of lane (group) 4k + s.
  const __m512i q0 = _mm512_maskz_unpacklo_epi64(kAll64, a, c), q1 = _mm512_maskz_unpackhi_epi64(kAll64, a, c);
  const __m512i q2 = _mm512_maskz_unpacklo_epi64(kAll64, b, e), q3 = _mm512_maskz_unpackhi_epi64(kAll64, b, e);
  // Whole 128-bit lanes moved: out[q], lane t = q_t's lane q (a 4 x 4 transpose of lanes).
  const __m512i t0 = _mm512_maskz_shuffle_i32x4(kAll, q0, q1, _MM_SHUFFLE(1, 0, 1, 0));
  const __m512i t1 = _mm512_maskz_shuffle_i32x4(kAll, q2, q3, _MM_SHUFFLE(1, 0, 1, 0));
  const __m512i t2 = _mm512_maskz_shuffle_i32x4(kAll, q0, q1, _MM_SHUFFLE(3, 2, 3, 2));
  const __m512i t3 = _mm512_maskz_shuffle_i32x4(kAll, q2, q3, _MM_SHUFFLE(3, 2, 3, 2));
  const __m512i out[4] = {_mm512_maskz_shuffle_i32x4(kAll, t0, t1, _MM_SHUFFLE(2, 0, 2, 0)),
                          _mm512_maskz_shuffle_i32x4(kAll, t0, t1, _MM_SHUFFLE(3, 1, 3, 1)),
                          _mm512_maskz_shuffle_i32x4(kAll, t2, t3, _MM_SHUFFLE(2, 0, 2, 0)),
                          _mm512_maskz_shuffle_i32x4(kAll, t2, t3, _MM_SHUFFLE(3, 1, 3, 1))};
  const __m512i thr = _mm512_set1_epi32(static_cast<int>(threshold));
  const __m512 k = _mm512_set1_ps(kept);
  for (int x = 0; x < 4; ++x) _mm512_storeu_ps(z + 16 * x, _mm512_maskz_mov_ps(_mm512_cmpge_epu32_mask(out[x], thr), k));
#elif FLARE_VEC_BYTES == 32 && defined(__AVX2__)
  const auto w = [&](int x) { return reinterpret_cast<__m256i>(r.w[x]); };
  const __m256i a = _mm256_unpacklo_epi32(w(0), w(1)), b = _mm256_unpackhi_epi32(w(0), w(1));
  const __m256i c = _mm256_unpacklo_epi32(w(2), w(3)), e = _mm256_unpackhi_epi32(w(2), w(3));
  const __m256i q0 = _mm256_unpacklo_epi64(a, c), q1 = _mm256_unpackhi_epi64(a, c);
  const __m256i q2 = _mm256_unpacklo_epi64(b, e), q3 = _mm256_unpackhi_epi64(b, e);
  const __m256i out[4] = {_mm256_permute2x128_si256(q0, q1, 0x20), _mm256_permute2x128_si256(q2, q3, 0x20),
                          _mm256_permute2x128_si256(q0, q1, 0x31), _mm256_permute2x128_si256(q2, q3, 0x31)};
  const __m256i thr = _mm256_set1_epi32(static_cast<int>(threshold));
  const __m256 k = _mm256_set1_ps(kept);
  for (int x = 0; x < 4; ++x) {
    const __m256i keep = _mm256_cmpeq_epi32(_mm256_max_epu32(out[x], thr), out[x]);  // word >= threshold
    _mm256_storeu_ps(z + 8 * x, _mm256_and_ps(_mm256_castsi256_ps(keep), k));
  }
#else
  for (int x = 0; x < 4 * kPhiloxLanes; ++x) z[x] = r.w[x % 4][x / 4] >= threshold ? kept : 0.0f;
#endif
}

// z[c] = the factor of (query i, key j0 + c) for c < n: scale where kept, 0 where dropped. j0 % 4 == 0.
template <class T>
inline void dropout_row(const DropoutDraw& d, uint32_t stream, int64_t i, int64_t j0, int64_t n, T* z) {
  const T kept = static_cast<T>(d.scale);
  const uint32_t g0 = static_cast<uint32_t>(j0 / 4);
  for (int64_t c0 = 0; c0 < n; c0 += 4 * kPhiloxLanes) {
    PhiloxLanes ctr;
    ctr.w[0] = philox_iota(g0 + static_cast<uint32_t>(c0 / 4));
    ctr.w[1] = PhiloxU32{} + static_cast<uint32_t>(i);
    ctr.w[2] = PhiloxU32{} + stream;
    ctr.w[3] = PhiloxU32{} + d.key.offset;
    const PhiloxLanes r = philox_lanes(ctr, d.key.k0, d.key.k1);
    const int64_t end = smin<int64_t>(4 * kPhiloxLanes, n - c0);
    if constexpr (std::is_same_v<T, float>) {
      if (end == 4 * kPhiloxLanes) {  // a whole batch: vector stores
        store_factors(r, d.threshold, kept, z + c0);
        continue;
      }
    }
    for (int64_t x = 0; x < end; ++x) z[c0 + x] = r.w[x % 4][x / 4] >= d.threshold ? kept : T(0);
  }
}

// zt[r * ld + c] = the factor of (query i0 + c, key j0 + r) for r < keys, c < queries: keys as rows. j0 % 4 == 0
// and keys % 4 == 0, queries a multiple of kPhiloxLanes.
inline void dropout_keys_major(const DropoutDraw& d, uint32_t stream, int64_t i0, int64_t queries, int64_t j0,
                               int64_t keys, float* zt, int64_t ld) {
  typedef float FloatLanes __attribute__((vector_size(FLARE_VEC_BYTES)));
  typedef int32_t IntLanes __attribute__((vector_size(FLARE_VEC_BYTES)));
  const FloatLanes kept = FloatLanes{} + static_cast<float>(d.scale);
  for (int64_t r = 0; r < keys; r += 4) {
    for (int64_t c = 0; c < queries; c += kPhiloxLanes) {
      PhiloxLanes ctr;
      ctr.w[0] = PhiloxU32{} + static_cast<uint32_t>((j0 + r) / 4);
      ctr.w[1] = philox_iota(static_cast<uint32_t>(i0 + c));
      ctr.w[2] = PhiloxU32{} + stream;
      ctr.w[3] = PhiloxU32{} + d.key.offset;
      const PhiloxLanes words = philox_lanes(ctr, d.key.k0, d.key.k1);
      for (int w = 0; w < 4; ++w) {
        const IntLanes keep = words.w[w] >= d.threshold;  // all ones where kept
        FloatLanes z = reinterpret_cast<FloatLanes>(reinterpret_cast<IntLanes>(kept) & keep);
        __builtin_memcpy(zt + (r + w) * ld + c, &z, sizeof z);
      }
    }
  }
}

}  // namespace flare::cpu::FLARE_ISA

// dropout.hpp — attention dropout's keep factors on the CPU, drawn from common/philox.hpp's stream.
//
// A kernel asks for the factors of a piece of one (sequence, head)'s probability matrix: z = 1 / (1 - p) where
// the element is kept, 0 where it is dropped. Philox runs on as many counters at once as a vector holds
// (GCC/clang vector extensions, the widening multiplies spelt out for AVX-512), one counter per 16 keys of
// one query, each key decided by one byte of the draw. Two layouts:
//   dropout_row          queries-major: one query's keys j0 .. j0 + n (the forward's P rows, the FMA
//                        backward's): counters vary in their key group; a lane's 16 bytes are 16 consecutive
//                        keys once the words are transposed across lanes;
//   dropout_keys_major   a tile with keys as rows, queries as columns (the bf16 backward engines' Pᵀ):
//                        counters vary in their query, byte x of a counter is key row 16 * group + x, so
//                        each byte position gives a row segment, stored whole.
#pragma once

#if defined(__AVX2__) || defined(__AVX512F__)
#  include <immintrin.h>
#endif

#include <cstdint>
#include <cstring>
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
  // The halves are moved by swapping the 32-bit words of each 64-bit lane (a shuffle, port 5) rather than by
  // 64-bit shifts, which share port 0 with the multiplies. (The maskz forms with every lane set: GCC 12 warns
  // about the plain ones' undefined pass-through operand.)
  constexpr __mmask8 kAll = 0xFF;
  constexpr __mmask16 kAll32 = 0xFFFF;
  const auto swap = [](__m512i x) { return _mm512_maskz_shuffle_epi32(kAll32, x, _MM_PERM_CDAB); };
  const __m512i av = reinterpret_cast<__m512i>(a), mv = _mm512_set1_epi32(static_cast<int>(m));
  const __m512i even = _mm512_maskz_mul_epu32(kAll, av, mv);
  const __m512i odd = _mm512_maskz_mul_epu32(kAll, swap(av), mv);
  lo = reinterpret_cast<PhiloxU32>(_mm512_mask_blend_epi32(0xAAAA, even, swap(odd)));
  hi = reinterpret_cast<PhiloxU32>(_mm512_mask_blend_epi32(0xAAAA, swap(even), odd));
#else
  const PhiloxU64 p = __builtin_convertvector(a, PhiloxU64) * uint64_t{m};
  hi = __builtin_convertvector(p >> 32, PhiloxU32);
  lo = __builtin_convertvector(p, PhiloxU32);
#endif
}

// philox::philox4x32 on every lane.
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

// Lane l's 16 bytes (words w0..w3, little-endian) decide 16 consecutive keys: stores their factors at
// dst[l] (16 floats; lanes with a null dst are skipped). The AVX2 and AVX-512 forms transpose the words across
// lanes in registers (unpacks within 128-bit lanes, then whole 128-bit lanes moved), so that each vector's
// bytes are whole lanes in order, compare the bytes at once and expand the keep bits into factors.
// Byte x of lane l's draw (little-endian across its words w0..w3): the one deciding the lane's key x.
inline uint32_t draw_byte(const PhiloxLanes& r, int l, int x) { return (r.w[x / 4][l] >> (8 * (x % 4))) & 0xFFu; }

#if FLARE_VEC_BYTES == 64 && defined(__AVX512F__)
// out[x]: the bytes of lanes 4x .. 4x + 3 in key order (lane 4x + y's 16 bytes at bytes 16y .. 16y + 15).
inline void lane_bytes(const PhiloxLanes& r, __m512i out[4]) {
  // The maskz forms with every lane set, as in mulhilo.
  constexpr __mmask16 kAll = 0xFFFF;
  constexpr __mmask8 kAll64 = 0xFF;
  const auto w = [&](int x) { return reinterpret_cast<__m512i>(r.w[x]); };
  const __m512i a = _mm512_maskz_unpacklo_epi32(kAll, w(0), w(1)), b = _mm512_maskz_unpackhi_epi32(kAll, w(0), w(1));
  const __m512i c = _mm512_maskz_unpacklo_epi32(kAll, w(2), w(3)), e = _mm512_maskz_unpackhi_epi32(kAll, w(2), w(3));
  // q_s, 128-bit lane k: the four words of lane (group) 4k + s.
  const __m512i q0 = _mm512_maskz_unpacklo_epi64(kAll64, a, c), q1 = _mm512_maskz_unpackhi_epi64(kAll64, a, c);
  const __m512i q2 = _mm512_maskz_unpacklo_epi64(kAll64, b, e), q3 = _mm512_maskz_unpackhi_epi64(kAll64, b, e);
  // Whole 128-bit lanes moved: out[x], 128-bit lane t = q_t's lane x (a 4 x 4 transpose): lanes 4x .. 4x + 3.
  const __m512i t0 = _mm512_maskz_shuffle_i32x4(kAll, q0, q1, _MM_SHUFFLE(1, 0, 1, 0));
  const __m512i t1 = _mm512_maskz_shuffle_i32x4(kAll, q2, q3, _MM_SHUFFLE(1, 0, 1, 0));
  const __m512i t2 = _mm512_maskz_shuffle_i32x4(kAll, q0, q1, _MM_SHUFFLE(3, 2, 3, 2));
  const __m512i t3 = _mm512_maskz_shuffle_i32x4(kAll, q2, q3, _MM_SHUFFLE(3, 2, 3, 2));
  out[0] = _mm512_maskz_shuffle_i32x4(kAll, t0, t1, _MM_SHUFFLE(2, 0, 2, 0));
  out[1] = _mm512_maskz_shuffle_i32x4(kAll, t0, t1, _MM_SHUFFLE(3, 1, 3, 1));
  out[2] = _mm512_maskz_shuffle_i32x4(kAll, t2, t3, _MM_SHUFFLE(2, 0, 2, 0));
  out[3] = _mm512_maskz_shuffle_i32x4(kAll, t2, t3, _MM_SHUFFLE(3, 1, 3, 1));
}
#endif

inline void store_factors(const PhiloxLanes& r, uint32_t threshold, float kept, float* const* dst) {
#if FLARE_VEC_BYTES == 64 && defined(__AVX512F__)
  __m512i out[4];
  lane_bytes(r, out);
  const __m512i thr = _mm512_set1_epi8(static_cast<char>(threshold));
  const __m512 k = _mm512_set1_ps(kept);
  for (int x = 0; x < 4; ++x) {
    if (!dst[4 * x] && !dst[4 * x + 1] && !dst[4 * x + 2] && !dst[4 * x + 3]) continue;
    const __mmask64 keep = _mm512_cmpge_epu8_mask(out[x], thr);  // 4 lanes x 16 keys, one bit each
    for (int y = 0; y < 4; ++y) {
      if (float* to = dst[4 * x + y]) {
        _mm512_storeu_ps(to, _mm512_maskz_mov_ps(static_cast<__mmask16>(keep >> (16 * y)), k));
      }
    }
  }
#elif FLARE_VEC_BYTES == 32 && defined(__AVX2__)
  const auto w = [&](int x) { return reinterpret_cast<__m256i>(r.w[x]); };
  const __m256i a = _mm256_unpacklo_epi32(w(0), w(1)), b = _mm256_unpackhi_epi32(w(0), w(1));
  const __m256i c = _mm256_unpacklo_epi32(w(2), w(3)), e = _mm256_unpackhi_epi32(w(2), w(3));
  const __m256i q0 = _mm256_unpacklo_epi64(a, c), q1 = _mm256_unpackhi_epi64(a, c);
  const __m256i q2 = _mm256_unpacklo_epi64(b, e), q3 = _mm256_unpackhi_epi64(b, e);
  // out[x]: lanes 2x, 2x + 1, their bytes in key order.
  const __m256i out[4] = {_mm256_permute2x128_si256(q0, q1, 0x20), _mm256_permute2x128_si256(q2, q3, 0x20),
                          _mm256_permute2x128_si256(q0, q1, 0x31), _mm256_permute2x128_si256(q2, q3, 0x31)};
  const __m256i thr = _mm256_set1_epi8(static_cast<char>(threshold));
  const __m256 k = _mm256_set1_ps(kept);
  const __m256i bit = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
  for (int x = 0; x < 4; ++x) {
    if (!dst[2 * x] && !dst[2 * x + 1]) continue;
    const __m256i ge = _mm256_cmpeq_epi8(_mm256_max_epu8(out[x], thr), out[x]);  // byte >= threshold
    const uint32_t keep = static_cast<uint32_t>(_mm256_movemask_epi8(ge));     // 2 lanes x 16 keys
    for (int y = 0; y < 4; ++y) {
      float* to = dst[2 * x + y / 2];
      if (!to) continue;
      const __m256i lanes = _mm256_and_si256(_mm256_set1_epi32(static_cast<int>(keep >> (8 * y))), bit);
      const __m256 on = _mm256_castsi256_ps(_mm256_cmpeq_epi32(lanes, bit));
      _mm256_storeu_ps(to + 8 * (y % 2), _mm256_and_ps(on, k));
    }
  }
#else
  for (int l = 0; l < kPhiloxLanes; ++l) {
    if (!dst[l]) continue;
    for (int x = 0; x < 16; ++x) dst[l][x] = draw_byte(r, l, x) >= threshold ? kept : 0.0f;
  }
#endif
}

// Lane l's 16 bytes decide 16 consecutive keys, as in store_factors: stores their keep bits at *dst[l] (bit x:
// key x kept; lanes with a null dst are skipped).
inline void store_bits(const PhiloxLanes& r, uint32_t threshold, uint16_t* const* dst) {
#if FLARE_VEC_BYTES == 64 && defined(__AVX512F__)
  __m512i out[4];
  lane_bytes(r, out);
  const __m512i thr = _mm512_set1_epi8(static_cast<char>(threshold));
  for (int x = 0; x < 4; ++x) {
    const __mmask64 keep = _mm512_cmpge_epu8_mask(out[x], thr);  // 4 lanes x 16 keys
    for (int y = 0; y < 4; ++y)
      if (uint16_t* to = dst[4 * x + y]) *to = static_cast<uint16_t>(keep >> (16 * y));
  }
#else
  for (int l = 0; l < kPhiloxLanes; ++l) {
    if (!dst[l]) continue;
    uint16_t bits = 0;
    for (int x = 0; x < 16; ++x) bits |= static_cast<uint16_t>((draw_byte(r, l, x) >= threshold ? 1u : 0u) << x);
    *dst[l] = bits;
  }
#endif
}

// Where dropout_tile's draws go: each (row, 16 keys) piece's 16 factors (Factors) or 16 keep bits (Bits).
struct DropoutFactors {
  float* z;
  int64_t ld;  // floats per row
  using Dst = float*;
  Dst at(int64_t r, int64_t group) const { return z + r * ld + 16 * group; }
  void store(const PhiloxLanes& w, const DropoutDraw& d, Dst const* dst) const {
    store_factors(w, d.threshold, static_cast<float>(d.scale), dst);
  }
};
struct DropoutBits {
  uint16_t* bits;
  int64_t ld;  // masks per row
  using Dst = uint16_t*;
  Dst at(int64_t r, int64_t group) const { return bits + r * ld + group; }
  void store(const PhiloxLanes& w, const DropoutDraw& d, Dst const* dst) const { store_bits(w, d.threshold, dst); }
};

// The draws of a tile, (query i0 + r, key j0 + c) for r < rows, c < cols; j0 % 16 == 0 and cols % 16 == 0, into
// out (DropoutFactors or DropoutBits). Each lane draws one (row, 16 keys) piece, so rows of few key groups share
// a draw's lanes (a 128-key block fills the 16 lanes of AVX-512 with two rows).
template <class Out>
inline void dropout_pieces(const DropoutDraw& d, uint32_t stream, int64_t i0, int64_t rows, int64_t j0,
                           int64_t cols, const Out& out) {
  const int64_t groups = cols / 16, pieces = rows * groups;
  // The counters of a batch's lanes: piece p is (row p / groups, group p % groups). When a batch holds whole
  // rows (groups divides kPhiloxLanes) or rows hold whole batches (the reverse), the pattern repeats from
  // batch to batch: it is set up once and moved along by vector adds.
  const bool periodic = kPhiloxLanes % groups == 0 || groups % kPhiloxLanes == 0;
  PhiloxLanes ctr{};
  ctr.w[2] = PhiloxU32{} + stream;
  ctr.w[3] = PhiloxU32{} + d.key.offset;
  for (int l = 0; l < kPhiloxLanes; ++l) {
    ctr.w[0][l] = static_cast<uint32_t>(j0 / 16 + l % groups);
    ctr.w[1][l] = static_cast<uint32_t>(i0 + l / groups);
  }
  int64_t row = 0, group = 0;  // piece p0's (p0 / groups, p0 % groups), stepped along without divisions
  for (int64_t p0 = 0; p0 < pieces; p0 += kPhiloxLanes) {
    typename Out::Dst dst[kPhiloxLanes];
    for (int l = 0; l < kPhiloxLanes; ++l) {
      dst[l] = p0 + l < pieces ? out.at(row, group) : nullptr;
      if (!periodic) {
        ctr.w[0][l] = static_cast<uint32_t>(j0 / 16 + group);
        ctr.w[1][l] = static_cast<uint32_t>(i0 + row);
      }
      if (++group == groups) group = 0, ++row;
    }
    out.store(philox_lanes(ctr, d.key.k0, d.key.k1), d, dst);
    if (periodic) {
      if (kPhiloxLanes % groups == 0) {
        ctr.w[1] += static_cast<uint32_t>(kPhiloxLanes / groups);  // the next batch's rows
      } else if ((p0 + kPhiloxLanes) % groups == 0) {
        ctr.w[0] -= static_cast<uint32_t>(groups - kPhiloxLanes);  // back to the first group, next row
        ctr.w[1] += 1u;
      } else {
        ctr.w[0] += static_cast<uint32_t>(kPhiloxLanes);
      }
    }
  }
}

#if FLARE_VEC_BYTES == 64 && defined(__AVX512F__)
// Philox on 16 counters held as two sets of eight 64-bit lanes, each word in the low half of its lane (the
// high halves carry what a round left there and are never read). A round's 32x32->64 multiply is then one
// vpmuludq with the product's halves already in place, and the high half comes down with one shuffle: 12
// vector operations a round for 16 counters (4 multiplies, 4 shuffles, 4 three-way xors), where philox_lanes'
// 32-bit lanes take 18. Its key schedule is broadcast once per tile (PhiloxRoundKeys).
struct PhiloxWide {
  __m512i w[4];
};
struct PhiloxRoundKeys {
  __m512i k0[philox::kRounds], k1[philox::kRounds];
};

inline PhiloxRoundKeys philox_round_keys(const philox::DropoutKey& key) {
  PhiloxRoundKeys k;
  uint32_t k0 = key.k0, k1 = key.k1;
  for (int round = 0; round < philox::kRounds; ++round, k0 += philox::kWeyl0, k1 += philox::kWeyl1) {
    k.k0[round] = _mm512_set1_epi64(k0);
    k.k1[round] = _mm512_set1_epi64(k1);
  }
  return k;
}

// The steps of a round on 64-bit lanes (the maskz forms with every lane set, as in mulhilo): the 64-bit
// products of the lanes' low words, a lane's high word moved to its low half, and a ^ b ^ c.
inline __m512i mul_low_words(__m512i a, __m512i m) { return _mm512_maskz_mul_epu32(0xFF, a, m); }
inline __m512i high_halves_down(__m512i x) { return _mm512_maskz_shuffle_epi32(0xFFFF, x, _MM_PERM_CDAB); }
inline __m512i xor3(__m512i a, __m512i b, __m512i c) { return _mm512_ternarylogic_epi32(a, b, c, 0x96); }

// Rounds first .. kRounds - 1 of dropout's Philox on c.
inline PhiloxWide philox_wide(PhiloxWide c, const PhiloxRoundKeys& k, int first = 0) {
  const __m512i m0 = _mm512_set1_epi64(philox::kMul0), m1 = _mm512_set1_epi64(philox::kMul1);
  for (int round = first; round < philox::kRounds; ++round) {
    const __m512i p0 = mul_low_words(c.w[0], m0), p1 = mul_low_words(c.w[2], m1);
    c = PhiloxWide{{xor3(high_halves_down(p1), c.w[1], k.k0[round]), p1,
                    xor3(high_halves_down(p0), c.w[3], k.k1[round]), p0}};
  }
  return c;
}

// Counters (G, x, stream, offset) whose group word G stays while x moves on (the rows of a lane's key group, or
// the queries of a keys-major group): through the first three rounds every multiply's operand depends on x
// alone or on G alone, so G's part is taken once (philox_group_rounds) and each counter reaches round 3 after
// two multiplies on x (philox_of_x: 8 operations a set for rounds 0-2 where philox_wide takes 18). Round r maps
// (w0, w1, w2, w3) to (hi(w2 M1) ^ w1 ^ k0[r], lo(w2 M1), hi(w0 M0) ^ w3 ^ k1[r], lo(w0 M0)):
//   round 0: (hi(stream M1) ^ x ^ k0[0], lo(stream M1), hi(G M0) ^ offset ^ k1[0], lo(G M0))
//   round 1: w0 M0 depends on x (p), w2 M1 on G (c): (hi(c) ^ lo(stream M1) ^ k0[1], lo(c), hi(p) ^ lo(G M0) ^
//            k1[1], lo(p))
//   round 2: w0 M0 = P depends on G, w2 M1 = p2 on both: (hi(p2) ^ lo(c) ^ k0[2], lo(p2), hi(P) ^ lo(p) ^ k1[2],
//            lo(P)).
struct PhiloxGroupRounds {
  __m512i x_key;           // round 0's w0 = x ^ x_key
  __m512i d2, e0, e2, f3;  // G's terms of rounds 1 and 2
};

inline PhiloxGroupRounds philox_group_rounds(__m512i group, uint32_t stream, uint32_t offset,
                                             const PhiloxRoundKeys& k) {
  const __m512i m0 = _mm512_set1_epi64(philox::kMul0), m1 = _mm512_set1_epi64(philox::kMul1);
  const __m512i sm = mul_low_words(_mm512_set1_epi64(stream), m1);
  const __m512i gm = mul_low_words(group, m0);
  const __m512i c = mul_low_words(xor3(high_halves_down(gm), _mm512_set1_epi64(offset), k.k1[0]), m1);
  const __m512i big_p = mul_low_words(xor3(high_halves_down(c), sm, k.k0[1]), m0);
  return {_mm512_xor_si512(high_halves_down(sm), k.k0[0]), _mm512_xor_si512(gm, k.k1[1]),
          _mm512_xor_si512(c, k.k0[2]), _mm512_xor_si512(high_halves_down(big_p), k.k1[2]), big_p};
}

// The draws of counters (G, x, stream, offset), x in the low word of each 64-bit lane, G's part in g.
inline PhiloxWide philox_of_x(__m512i x, const PhiloxGroupRounds& g, const PhiloxRoundKeys& k) {
  const __m512i m0 = _mm512_set1_epi64(philox::kMul0), m1 = _mm512_set1_epi64(philox::kMul1);
  const __m512i p = mul_low_words(_mm512_xor_si512(x, g.x_key), m0);
  const __m512i p2 = mul_low_words(_mm512_xor_si512(high_halves_down(p), g.d2), m1);
  return philox_wide(PhiloxWide{{_mm512_xor_si512(high_halves_down(p2), g.e0), p2, _mm512_xor_si512(p, g.e2), g.f3}},
                     k, 3);
}

// The draws of a tile whose pieces (row, 16 keys) lie row after row: piece q = r * groups + g is (query i0 + r,
// keys j0 + 16 g ..), j0 % 16 == 0. 16 pieces per batch, in piece order: their counters step from batch to
// batch by vector adds (16 pieces further on: 16 / groups rows and 16 % groups groups, carrying past the row's
// last group), and the keep bits come out of the registers in piece order, no lane handled on its own.
// sink(q0, masks, n): pieces q0 .. q0 + n (n <= 16), piece q0 + x's 16 keep bits at bits 16 (x % 4) of
// masks[x / 4].
template <class Sink>
inline void dropout_rows_wide(const DropoutDraw& d, uint32_t stream, int64_t i0, int64_t rows, int64_t j0,
                              int64_t groups, Sink sink) {
  constexpr __mmask8 kAll64 = 0xFF;
  const int64_t pieces = rows * groups;
  const PhiloxRoundKeys keys = philox_round_keys(d.key);
  // In each set of eight lanes, lane 2k draws piece k and lane 2k + 1 piece 4 + k: the unpacks at the end then
  // leave pieces 0-3 and 4-7 in order.
  alignas(64) int64_t group_of[16], row_of[16];
  for (int l = 0; l < 16; ++l) {
    const int64_t piece = 8 * (l / 8) + (l % 2 ? 4 : 0) + (l % 8) / 2;
    group_of[l] = j0 / 16 + piece % groups;
    row_of[l] = i0 + piece / groups;
  }
  __m512i group[2] = {_mm512_load_si512(group_of), _mm512_load_si512(group_of + 8)};
  __m512i row[2] = {_mm512_load_si512(row_of), _mm512_load_si512(row_of + 8)};
  const __m512i group_step = _mm512_set1_epi64(16 % groups), row_step = _mm512_set1_epi64(16 / groups);
  const __m512i group_end = _mm512_set1_epi64(j0 / 16 + groups), width = _mm512_set1_epi64(groups);
  const __m512i one = _mm512_set1_epi64(1), thr = _mm512_set1_epi8(static_cast<char>(d.threshold));
  const __m512i stream_w = _mm512_set1_epi64(stream), offset_w = _mm512_set1_epi64(d.key.offset);
  // Set s's draws w as keep bits: lane i's 16 bytes (words w0..w3: w0 w1 in the 64 bits of lo, w2 w3 in those
  // of hi), unpacked into pieces 0-3 and 4-7 of the set and compared.
  const auto keep_bits = [&](const PhiloxWide& w, uint64_t* masks) {
    const __m512i lo = _mm512_mask_shuffle_epi32(w.w[0], 0xAAAA, w.w[1], _MM_PERM_CDAB);
    const __m512i hi = _mm512_mask_shuffle_epi32(w.w[2], 0xAAAA, w.w[3], _MM_PERM_CDAB);
    masks[0] = _mm512_cmpge_epu8_mask(_mm512_maskz_unpacklo_epi64(kAll64, lo, hi), thr);
    masks[1] = _mm512_cmpge_epu8_mask(_mm512_maskz_unpackhi_epi64(kAll64, lo, hi), thr);
  };
  if (16 % groups == 0) {
    // A batch is whole rows, so each lane keeps its key group from batch to batch: the groups' part of rounds
    // 0-2 is taken once per tile, and a batch starts from round 3 after two multiplies on its rows.
    const PhiloxGroupRounds terms[2] = {philox_group_rounds(group[0], stream, d.key.offset, keys),
                                        philox_group_rounds(group[1], stream, d.key.offset, keys)};
    for (int64_t q0 = 0; q0 < pieces; q0 += 16) {
      uint64_t masks[4];
      for (int s = 0; s < 2; ++s) {
        keep_bits(philox_of_x(row[s], terms[s], keys), masks + 2 * s);
        row[s] = _mm512_add_epi64(row[s], row_step);
      }
      sink(q0, masks, smin<int64_t>(16, pieces - q0));
    }
    return;
  }
  for (int64_t q0 = 0; q0 < pieces; q0 += 16) {
    uint64_t masks[4];
    for (int s = 0; s < 2; ++s) {
      keep_bits(philox_wide(PhiloxWide{{group[s], row[s], stream_w, offset_w}}, keys), masks + 2 * s);
      group[s] = _mm512_add_epi64(group[s], group_step);
      row[s] = _mm512_add_epi64(row[s], row_step);
      const __mmask8 carry = _mm512_cmpge_epi64_mask(group[s], group_end);
      group[s] = _mm512_mask_sub_epi64(group[s], carry, group[s], width);
      row[s] = _mm512_mask_add_epi64(row[s], carry, row[s], one);
    }
    sink(q0, masks, smin<int64_t>(16, pieces - q0));
  }
}
#endif

// The factors of a tile: z[r * ld + c] for (query i0 + r, key j0 + c): scale where kept, 0 where dropped.
inline void dropout_tile(const DropoutDraw& d, uint32_t stream, int64_t i0, int64_t rows, int64_t j0, int64_t cols,
                         float* z, int64_t ld) {
#if FLARE_VEC_BYTES == 64 && defined(__AVX512F__)
  if (ld == cols) {  // rows packed: piece q's 16 factors at z + 16 q
    const __m512 kept = _mm512_set1_ps(static_cast<float>(d.scale));
    return dropout_rows_wide(d, stream, i0, rows, j0, cols / 16, [&](int64_t q0, const uint64_t* masks, int64_t n) {
      for (int64_t x = 0; x < n; ++x) {
        const auto bits = static_cast<__mmask16>(masks[x / 4] >> (16 * (x % 4)));
        _mm512_storeu_ps(z + 16 * (q0 + x), _mm512_maskz_mov_ps(bits, kept));
      }
    });
  }
#endif
  dropout_pieces(d, stream, i0, rows, j0, cols, DropoutFactors{z, ld});
}

// The keep bits of a tile: bit x of bits[r * ld + g] for (query i0 + r, key j0 + 16 g + x).
inline void dropout_tile_bits(const DropoutDraw& d, uint32_t stream, int64_t i0, int64_t rows, int64_t j0,
                              int64_t cols, uint16_t* bits, int64_t ld) {
#if FLARE_VEC_BYTES == 64 && defined(__AVX512F__)
  if (ld == cols / 16) {  // the rows' masks packed: a batch's 16 masks are 32 consecutive bytes
    return dropout_rows_wide(d, stream, i0, rows, j0, cols / 16, [&](int64_t q0, const uint64_t* masks, int64_t n) {
      std::memcpy(bits + q0, masks, sizeof(uint16_t) * static_cast<size_t>(n));
    });
  }
#endif
  dropout_pieces(d, stream, i0, rows, j0, cols, DropoutBits{bits, ld});
}

// z[c] = the factor of (query i, key j0 + c) for c < n: scale where kept, 0 where dropped. j0 % 16 == 0.
template <class T>
inline void dropout_row(const DropoutDraw& d, uint32_t stream, int64_t i, int64_t j0, int64_t n, T* z) {
  if constexpr (std::is_same_v<T, float>) {
    if (n % 16 == 0) return dropout_tile(d, stream, i, 1, j0, n, z, n);
  }
  const T kept = static_cast<T>(d.scale);
  for (int64_t c0 = 0; c0 < n; c0 += 16) {
    const philox::Words w = philox::dropout_words(d.key, stream, static_cast<uint32_t>(i),
                                                  static_cast<uint32_t>((j0 + c0) / 16));
    for (int64_t x = 0; x < 16 && c0 + x < n; ++x)
      z[c0 + x] = philox::dropout_byte(w, static_cast<uint32_t>(x)) >= d.threshold ? kept : T(0);
  }
}

#if FLARE_VEC_BYTES == 64 && defined(__AVX512F__)
// dropout_keys_major on AVX-512: per key group (16 key rows), 16 queries a batch as two sets of eight 64-bit lanes.
// A batch's counters (G, i, stream, offset) differ only in the query i, so G's part of rounds 0-2 is taken once
// per key group (philox_group_rounds) and each set reaches round 3 after two multiplies (philox_of_x). The words
// then come out in query order (the two sets' low words merged), their bytes regrouped so that byte b of query l
// is byte 16 b + l: one compare gives four key rows' keep bits, 16 queries each.
inline void dropout_keys_major_wide(const DropoutDraw& d, uint32_t stream, int64_t i0, int64_t queries, int64_t j0,
                                    int64_t keys, float* zt, int64_t ld) {
  const PhiloxRoundKeys round_keys = philox_round_keys(d.key);
  const __m512i lane = _mm512_setr_epi64(0, 1, 2, 3, 4, 5, 6, 7);
  // The low words of set 0's lanes, then set 1's; bytes regrouped within each 128-bit lane (byte b of its four
  // queries together: bytes 0, 4, 8, 12, then 1, 5, 9, 13, ...), then those dwords transposed across the
  // 128-bit lanes. (The maskz forms with every lane set, as in mulhilo.)
  const __m512i merge = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const __m512i by_byte = _mm512_setr_epi32(0x0c080400, 0x0d090501, 0x0e0a0602, 0x0f0b0703, 0x0c080400, 0x0d090501,
                                            0x0e0a0602, 0x0f0b0703, 0x0c080400, 0x0d090501, 0x0e0a0602, 0x0f0b0703,
                                            0x0c080400, 0x0d090501, 0x0e0a0602, 0x0f0b0703);
  const __m512i transpose = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  const __m512i thr = _mm512_set1_epi8(static_cast<char>(d.threshold));
  const __m512 kept = _mm512_set1_ps(static_cast<float>(d.scale));
  for (int64_t r = 0; r < keys; r += 16) {
    const __m512i group = _mm512_set1_epi64((j0 + r) / 16);
    const PhiloxGroupRounds g = philox_group_rounds(group, stream, d.key.offset, round_keys);
    for (int64_t c = 0; c < queries; c += 16) {
      PhiloxWide w[2];  // queries c .. c + 7, c + 8 .. c + 15
      for (int s = 0; s < 2; ++s)
        w[s] = philox_of_x(_mm512_add_epi64(_mm512_set1_epi64(i0 + c + 8 * s), lane), g, round_keys);
      for (int x = 0; x < 4; ++x) {  // word x: key rows r + 4 x .. r + 4 x + 3
        const __m512i words = _mm512_permutex2var_epi32(w[0].w[x], merge, w[1].w[x]);
        const __m512i bytes = _mm512_maskz_permutexvar_epi32(0xFFFF, transpose, _mm512_shuffle_epi8(words, by_byte));
        const __mmask64 keep = _mm512_cmpge_epu8_mask(bytes, thr);  // bit 16 b + l: byte b of query c + l
        for (int b = 0; b < 4; ++b) {
          _mm512_storeu_ps(zt + (r + 4 * x + b) * ld + c,
                           _mm512_maskz_mov_ps(static_cast<__mmask16>(keep >> (16 * b)), kept));
        }
      }
    }
  }
}
#endif

// zt[r * ld + c] = the factor of (query i0 + c, key j0 + r) for r < keys, c < queries: keys as rows. j0 % 16 == 0
// and keys % 16 == 0, queries a multiple of kPhiloxLanes.
inline void dropout_keys_major(const DropoutDraw& d, uint32_t stream, int64_t i0, int64_t queries, int64_t j0,
                               int64_t keys, float* zt, int64_t ld) {
#if FLARE_VEC_BYTES == 64 && defined(__AVX512F__)
  return dropout_keys_major_wide(d, stream, i0, queries, j0, keys, zt, ld);
#else
  typedef float FloatLanes __attribute__((vector_size(FLARE_VEC_BYTES)));
  typedef int32_t IntLanes __attribute__((vector_size(FLARE_VEC_BYTES)));
  const IntLanes kept = reinterpret_cast<IntLanes>(FloatLanes{} + static_cast<float>(d.scale));
  const PhiloxU32 threshold = PhiloxU32{} + d.threshold;
  for (int64_t r = 0; r < keys; r += 16) {
    for (int64_t c = 0; c < queries; c += kPhiloxLanes) {
      PhiloxLanes ctr;
      ctr.w[0] = PhiloxU32{} + static_cast<uint32_t>((j0 + r) / 16);
      ctr.w[1] = philox_iota(static_cast<uint32_t>(i0 + c));
      ctr.w[2] = PhiloxU32{} + stream;
      ctr.w[3] = PhiloxU32{} + d.key.offset;
      const PhiloxLanes words = philox_lanes(ctr, d.key.k0, d.key.k1);
      for (int x = 0; x < 16; ++x) {  // byte x of every lane: key row r + x
        const IntLanes keep = ((words.w[x / 4] >> (8 * (x % 4))) & 0xFFu) >= threshold;  // all ones where kept
        const FloatLanes z = reinterpret_cast<FloatLanes>(kept & keep);
        __builtin_memcpy(zt + (r + x) * ld + c, &z, sizeof z);
      }
    }
  }
#endif
}

}  // namespace flare::cpu::FLARE_ISA

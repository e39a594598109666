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

#include <cstdint>

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

// philox::philox4x32_10 on every lane.
inline PhiloxLanes philox_lanes(PhiloxLanes c, uint32_t k0, uint32_t k1) {
  for (int round = 0; round < philox::kRounds; ++round) {
    const PhiloxU64 p0 = __builtin_convertvector(c.w[0], PhiloxU64) * uint64_t{philox::kMul0};
    const PhiloxU64 p1 = __builtin_convertvector(c.w[2], PhiloxU64) * uint64_t{philox::kMul1};
    const PhiloxU32 hi0 = __builtin_convertvector(p0 >> 32, PhiloxU32), lo0 = __builtin_convertvector(p0, PhiloxU32);
    const PhiloxU32 hi1 = __builtin_convertvector(p1 >> 32, PhiloxU32), lo1 = __builtin_convertvector(p1, PhiloxU32);
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

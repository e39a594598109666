// philox.hpp — the counter-based random numbers behind attention dropout, shared by every backend.
//
// Philox4x32 (Salmon, Moraes, Dror, Shaw: "Parallel random numbers: as easy as 1, 2, 3", SC 2011): a 128-bit
// counter and a 64-bit key give four 32-bit words through rounds of two 32x32->64 multiplies. Dropout runs
// seven rounds (Philox4x32-7), as FlashAttention 2's CUDA kernels do: the fewest at which the paper found
// Philox4x32 to pass TestU01's BigCrush (its default of ten adds a safety margin). Three rounds fewer make the
// CPU's draw about a third cheaper (docs/tuning-cpu.md). Any element's word is computed from its coordinates
// alone, so the CPU and CUDA backends, any tiling and any thread count draw the same mask, and the backward
// recomputes the forward's mask instead of storing it.
//
// Dropout's mapping (flare.h states it as the contract): the keep decision of (sequence b, query head h,
// query i, key j), i and j counted within the sequence, is byte j % 16 of the 16 output bytes (words w0..w3,
// each little-endian: byte x is bits 8 (x % 4) .. of word x / 4) of
//   philox4x32_7(counter = {j / 16, i, b * nheads + h, low 32 bits of offset},
//                key     = {low 32 bits of seed, high 32 bits of seed ^ high 32 bits of offset})
// and the element is kept when that byte is >= dropout_threshold(p) = round(256 p), at most 255 (so p has
// FlashAttention 2's resolution of 1/256). One draw serves 16 elements.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#  define FLARE_PHILOX_HD __host__ __device__ __forceinline__
#else
#  define FLARE_PHILOX_HD inline __attribute__((always_inline))
#endif

namespace flare::philox {

inline constexpr uint32_t kMul0 = 0xD2511F53u, kMul1 = 0xCD9E8D57u;   // round multipliers
inline constexpr uint32_t kWeyl0 = 0x9E3779B9u, kWeyl1 = 0xBB67AE85u;  // key schedule increments
inline constexpr int kRounds = 7;  // dropout's rounds (Philox4x32-7)

struct Words {
  uint32_t w[4];
};

// Philox4x32-Rounds of counter c under key (k0, k1).
template <int Rounds = kRounds>
FLARE_PHILOX_HD Words philox4x32(Words c, uint32_t k0, uint32_t k1) {
  for (int round = 0; round < Rounds; ++round) {
    const uint64_t p0 = uint64_t{kMul0} * c.w[0];
    const uint64_t p1 = uint64_t{kMul1} * c.w[2];
    const uint32_t hi0 = static_cast<uint32_t>(p0 >> 32), lo0 = static_cast<uint32_t>(p0);
    const uint32_t hi1 = static_cast<uint32_t>(p1 >> 32), lo1 = static_cast<uint32_t>(p1);
    c = Words{{hi1 ^ c.w[1] ^ k0, lo1, hi0 ^ c.w[3] ^ k1, lo0}};
    k0 += kWeyl0;
    k1 += kWeyl1;
  }
  return c;
}

// The dropout stream of one call: seed and offset as the C ABI takes them (flare_fwd_params' dropout_seed,
// dropout_offset), split into Philox's key and the counter's last word.
struct DropoutKey {
  uint32_t k0 = 0, k1 = 0, offset = 0;
};
FLARE_PHILOX_HD DropoutKey dropout_key(uint64_t seed, uint64_t offset) {
  return {static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32) ^ static_cast<uint32_t>(offset >> 32),
          static_cast<uint32_t>(offset)};
}

// Bytes below the threshold drop their element: round(256 p), at most 255 (p < 1 is checked).
inline uint32_t dropout_threshold(double p) {
  const double t = p * 256.0 + 0.5;
  return t >= 255.0 ? 255u : static_cast<uint32_t>(t);
}

// The keep bytes of keys 16 * group .. 16 * group + 15 of query i in (sequence, head) row stream `stream`
// (b * nheads + h), as four words.
FLARE_PHILOX_HD Words dropout_words(const DropoutKey& key, uint32_t stream, uint32_t i, uint32_t group) {
  return philox4x32(Words{{group, i, stream, key.offset}}, key.k0, key.k1);
}

// Byte x (0..15) of a draw: the keep byte of key 16 * group + x.
FLARE_PHILOX_HD uint32_t dropout_byte(const Words& w, uint32_t x) {
  const uint32_t word = x < 8 ? (x < 4 ? w.w[0] : w.w[1]) : (x < 12 ? w.w[2] : w.w[3]);
  return (word >> (8 * (x % 4))) & 0xFFu;
}

}  // namespace flare::philox

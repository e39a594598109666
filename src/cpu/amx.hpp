// amx.hpp — AMX tile primitives (Intel Sapphire Rapids and later): tile configuration, named tile
// registers, loads/stores/dot products, the VNNI packing of B operands and one blocked product on top.
// Included only by the AMX translation unit (isa_amx.cpp, compiled with -mamx-tile -mamx-bf16).
//
// Layouts. A operands are bf16 rows (16 rows x 32 elements per tile, any stride). B operands of a K x N
// product are stored as "VNNI" tiles: tile (n_group, k_chunk) covers n in [16 n_group, +16) and k in
// [32 k_chunk, +32), laid out [k / 2][n][k % 2] (512 bf16), and tiles are stored n_group-major:
// tile (ng, kc) at b + (ng * b_chunks + kc) * kTileElems.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "cpu/bf16_rows.hpp"

namespace flare::cpu::FLARE_ISA {

// Tile register numbers. Tile instructions encode them as immediates, so the wrappers below take them as
// template arguments (GCC's _tile_* macros would paste the enum's name, not its value, into the assembly).
enum AmxTile : int { kC00 = 0, kC01 = 1, kC10 = 2, kC11 = 3, kA0 = 4, kA1 = 5, kB0 = 6, kB1 = 7 };

template <int T>
inline void tile_zero() {
  asm volatile("tilezero %%tmm%c0" ::"i"(T));
}
template <int T>
inline void tile_load(const void* base, int64_t stride_bytes) {
  asm volatile("tileloadd (%0,%1,1), %%tmm%c2" ::"r"(base), "r"(stride_bytes), "i"(T) : "memory");
}
template <int T>
inline void tile_store(void* base, int64_t stride_bytes) {
  asm volatile("tilestored %%tmm%c2, (%0,%1,1)" ::"r"(base), "r"(stride_bytes), "i"(T) : "memory");
}
// C += A * B with bf16 pairs accumulated in fp32.
template <int C, int A, int B>
inline void tile_dot_bf16() {
  asm volatile("tdpbf16ps %%tmm%c2, %%tmm%c1, %%tmm%c0" ::"i"(C), "i"(A), "i"(B));
}

struct alignas(64) AmxTileConfig {
  uint8_t palette;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

inline void amx_configure() {
  AmxTileConfig cfg{};
  cfg.palette = 1;
  for (int t = 0; t < 8; ++t) {
    cfg.colsb[t] = 64;
    cfg.rows[t] = 16;
  }
  _tile_loadconfig(&cfg);
}

constexpr int64_t kTileElems = 16 * 32;  // bf16 elements in one 16 x 64-byte tile

// Packs rows as a B operand whose k runs along each row (K for S = Q Kᵀ: row n is key n, k the head
// dimension): row(n) gives row n's first k_len bf16 elements (nullptr: a zero row), for n in
// [n0, n0 + n_count); k is zero-padded to b_chunks * 32. Each pair (k, k + 1) is one 32-bit word.
template <class RowFn>
inline void pack_b_k_along_rows(uint16_t* dst, int64_t b_chunks, int64_t n0, int64_t n_count, int64_t k_len,
                                RowFn row) {
  uint32_t* words = reinterpret_cast<uint32_t*>(dst);
  const int64_t pairs = b_chunks * 16, full = k_len / 2 < pairs ? k_len / 2 : pairs;  // pairs with both k
  for (int64_t n = n0; n < n0 + n_count; ++n) {
    const uint16_t* src = row(n);
    uint32_t* base = words + (n / 16) * b_chunks * (kTileElems / 2) + n % 16;
    // Pair q (k = 2q, 2q + 1) goes to word (q / 16) * 256 + (q % 16) * 16 of the row's tiles.
    const auto put = [base](int64_t q, uint32_t v) { base[(q / 16) * (kTileElems / 2) + (q % 16) * 16] = v; };
    int64_t q = 0;
    if (src != nullptr) {
      for (; q < full; ++q) {
        uint32_t v;
        std::memcpy(&v, src + 2 * q, sizeof(v));
        put(q, v);
      }
      if (q < pairs && 2 * q < k_len) {  // an odd k_len's last element
        put(q, src[2 * q]);
        ++q;
      }
    }
    for (; q < pairs; ++q) put(q, 0u);
  }
}

// Packs rows as a B operand whose rows run along k (V for O += P V: row k is key k, n the column): row(k)
// gives row k's first n_len bf16 elements (nullptr: a zero row), for k in [k0, k0 + k_count) (k0 and
// k_count even); n is zero-padded to n_pad (a multiple of 16). Rows k and k + 1 interleave into words.
template <class RowFn>
inline void pack_b_n_along_rows(uint16_t* dst, int64_t b_chunks, int64_t k0, int64_t k_count, int64_t n_len,
                                int64_t n_pad, RowFn row) {
  uint32_t* words = reinterpret_cast<uint32_t*>(dst);
  for (int64_t k = k0; k < k0 + k_count; k += 2) {
    const uint16_t* even = row(k);
    const uint16_t* odd = row(k + 1);
    uint32_t* base = words + (k / 32) * (kTileElems / 2) + (k % 32) / 2 * 16;
    // Column n goes to word (n / 16) * b_chunks * 256 + n % 16: runs of 16 consecutive words (one vector).
    int64_t n = 0;
    if (even != nullptr && odd != nullptr) {
      for (; n + 16 <= n_len; n += 16) {
        uint32_t* run = base + (n / 16) * b_chunks * (kTileElems / 2);
        for (int64_t i = 0; i < 16; ++i) run[i] = even[n + i] | (static_cast<uint32_t>(odd[n + i]) << 16);
      }
    }
    for (; n < n_pad; ++n) {
      const uint32_t lo = (even != nullptr && n < n_len) ? even[n] : 0u;
      const uint32_t hi = (odd != nullptr && n < n_len) ? odd[n] : 0u;
      base[(n / 16) * b_chunks * (kTileElems / 2) + n % 16] = lo | (hi << 16);
    }
  }
}

// C (m x n, fp32, leading dimension ldc) = or += A (m x k, bf16 rows, leading dimension lda) times the B
// tiles starting at n_group n0 and k_chunk k0 of a VNNI operand with b_chunks chunks per n_group.
// m, n and k are multiples of 32; each 32 x 32 block of C lives in four accumulator tiles. Tile registers
// are not renamed, so a load into A0 waits until the last product reading A0 is done: each operand of the
// next k chunk is loaded right after its last use in this one, overlapping the remaining products.
// Operands must be 64-byte aligned (rows and strides): a tile load that splits cache lines costs ~7x.
template <bool Accumulate>
inline void amx_gemm(int64_t m, int64_t n, int64_t k, const uint16_t* a, int64_t lda, const uint16_t* b,
                     int64_t b_chunks, int64_t n0, int64_t k0, float* c, int64_t ldc) {
  const int64_t nk = k / 32;
  for (int64_t rb = 0; rb < m / 32; ++rb) {
    for (int64_t cb = 0; cb < n / 32; ++cb) {
      float* cblk = c + rb * 32 * ldc + cb * 32;
      const uint16_t* b0 = b + ((n0 + cb * 2) * b_chunks + k0) * kTileElems;
      const uint16_t* b1 = b0 + b_chunks * kTileElems;
      const uint16_t* a0 = a + rb * 32 * lda;
      const uint16_t* a1 = a0 + 16 * lda;
      tile_load<kA0>(a0, lda * 2);
      tile_load<kB0>(b0, 64);
      if constexpr (Accumulate) {
        tile_load<kC00>(cblk, ldc * 4);
        tile_load<kC01>(cblk + 16, ldc * 4);
        tile_load<kC10>(cblk + 16 * ldc, ldc * 4);
        tile_load<kC11>(cblk + 16 * ldc + 16, ldc * 4);
      } else {
        tile_zero<kC00>();
        tile_zero<kC01>();
        tile_zero<kC10>();
        tile_zero<kC11>();
      }
      tile_load<kB1>(b1, 64);
      tile_load<kA1>(a1, lda * 2);
      for (int64_t kc = 0; kc < nk; ++kc) {
        const bool more = kc + 1 < nk;
        tile_dot_bf16<kC00, kA0, kB0>();
        tile_dot_bf16<kC01, kA0, kB1>();
        if (more) tile_load<kA0>(a0 + (kc + 1) * 32, lda * 2);
        tile_dot_bf16<kC10, kA1, kB0>();
        if (more) tile_load<kB0>(b0 + (kc + 1) * kTileElems, 64);
        tile_dot_bf16<kC11, kA1, kB1>();
        if (more) {
          tile_load<kB1>(b1 + (kc + 1) * kTileElems, 64);
          tile_load<kA1>(a1 + (kc + 1) * 32, lda * 2);
        }
      }
      tile_store<kC00>(cblk, ldc * 4);
      tile_store<kC01>(cblk + 16, ldc * 4);
      tile_store<kC10>(cblk + 16 * ldc, ldc * 4);
      tile_store<kC11>(cblk + 16 * ldc + 16, ldc * 4);
    }
  }
}

}  // namespace flare::cpu::FLARE_ISA

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
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <type_traits>

#include "cpu/bf16_rows.hpp"

namespace flare::cpu::FLARE_ISA {

// Tile register numbers. Tile instructions encode them as immediates, so the wrappers below take them as
// template arguments (GCC's _tile_* macros would paste the enum's name, not its value, into the assembly).
enum AmxTile : int { kC00 = 0, kC01 = 1, kC10 = 2, kC11 = 3, kA0 = 4, kA1 = 5, kB0 = 6, kB1 = 7 };

struct alignas(64) AmxTileConfig {
  uint8_t palette;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

#if !defined(FLARE_AMX_EMULATE)
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
// C += A * B with bf16 pairs accumulated in fp32. The three registers must differ (else #UD).
template <int C, int A, int B>
inline void tile_dot_bf16() {
  static_assert(C != A && C != B && A != B, "tdpbf16ps faults when two of its tiles are the same register");
  asm volatile("tdpbf16ps %%tmm%c2, %%tmm%c1, %%tmm%c0" ::"i"(C), "i"(A), "i"(B));
}
inline void tile_configure(const AmxTileConfig& cfg) { _tile_loadconfig(&cfg); }
inline void tile_release() { _tile_release(); }
#else
// FLARE_AMX_EMULATE (tests only: flare_tests_amx_emulated, src/CMakeLists.txt): the tile instructions in
// software, so that the AMX level's code runs and is tested on processors without tiles. Eight 16 x 64-byte
// tiles per thread, shaped by the last configuration; loads zero what lies outside a tile's shape, as the
// hardware does. Where the hardware raises #UD (no configuration loaded, a product whose three shapes do not
// agree), and where code touches a tile its configuration leaves empty, the emulation stops the process with
// the reason: a mistake that would fault on a Xeon fails the emulated tests instead of computing on a guess.
struct EmulatedTiles {
  AmxTileConfig cfg{};
  alignas(64) uint8_t t[8][16][64];
};
inline thread_local EmulatedTiles emulated_tiles;

[[noreturn]] inline void emulated_fault(const char* instruction, int tile, const char* why) {
  std::fprintf(stderr, "flare AMX emulation: %s on tmm%d: %s\n", instruction, tile, why);
  std::abort();
}
// The configured shape of tile T, checked as the hardware checks it before any tile instruction.
inline void emulated_check_tile(const char* instruction, int t) {
  const AmxTileConfig& c = emulated_tiles.cfg;
  if (c.palette != 1) emulated_fault(instruction, t, "no tile configuration is loaded on this thread (#UD)");
  if (c.rows[t] == 0 || c.colsb[t] == 0) emulated_fault(instruction, t, "the configuration leaves the tile empty");
  if (c.rows[t] > 16 || c.colsb[t] > 64)
    emulated_fault(instruction, t, "the tile is larger than palette 1 allows (#UD at ldtilecfg)");
}
// Row r of a tile operand, computed on addresses as the instructions compute it: the rows may lie in different
// allocations (pages of a KV cache), where pointer arithmetic between them is undefined.
inline const void* row_address(const void* base, int r, int64_t stride_bytes) {
  return reinterpret_cast<const void*>(reinterpret_cast<uintptr_t>(base) + static_cast<uintptr_t>(r * stride_bytes));
}

template <int T>
inline void tile_zero() {
  emulated_check_tile("tilezero", T);
  std::memset(emulated_tiles.t[T], 0, sizeof(emulated_tiles.t[T]));
}
template <int T>
inline void tile_load(const void* base, int64_t stride_bytes) {
  EmulatedTiles& e = emulated_tiles;
  emulated_check_tile("tileloadd", T);
  std::memset(e.t[T], 0, sizeof(e.t[T]));
  for (int r = 0; r < e.cfg.rows[T]; ++r)
    std::memcpy(e.t[T][r], row_address(base, r, stride_bytes), e.cfg.colsb[T]);
}
template <int T>
inline void tile_store(void* base, int64_t stride_bytes) {
  EmulatedTiles& e = emulated_tiles;
  emulated_check_tile("tilestored", T);
  for (int r = 0; r < e.cfg.rows[T]; ++r)
    std::memcpy(const_cast<void*>(row_address(base, r, stride_bytes)), e.t[T][r], e.cfg.colsb[T]);
}
template <int C, int A, int B>
inline void tile_dot_bf16() {
  static_assert(C != A && C != B && A != B, "tdpbf16ps faults when two of its tiles are the same register");
  EmulatedTiles& e = emulated_tiles;
  for (const int t : {C, A, B}) emulated_check_tile("tdpbf16ps", t);
  const AmxTileConfig& c = e.cfg;
  if (c.colsb[C] % 4 != 0 || c.colsb[A] % 4 != 0 || c.colsb[B] % 4 != 0)
    emulated_fault("tdpbf16ps", C, "a row of some operand is not a whole number of bf16 pairs (#UD)");
  if (c.rows[C] != c.rows[A]) emulated_fault("tdpbf16ps", C, "C and A have different row counts (#UD)");
  if (c.colsb[A] != 4 * c.rows[B]) emulated_fault("tdpbf16ps", A, "A's pairs per row differ from B's rows (#UD)");
  if (c.colsb[C] != c.colsb[B]) emulated_fault("tdpbf16ps", C, "C and B have different row widths (#UD)");
  const auto bf16 = [](const uint8_t* at) {
    uint16_t h;
    std::memcpy(&h, at, 2);
    const uint32_t w = uint32_t{h} << 16;
    float f;
    std::memcpy(&f, &w, 4);
    return f;
  };
  const int m_rows = e.cfg.rows[C], n_cols = e.cfg.colsb[C] / 4, k_pairs = e.cfg.colsb[A] / 4;
  for (int m = 0; m < m_rows; ++m)
    for (int n = 0; n < n_cols; ++n) {
      float acc;
      std::memcpy(&acc, &e.t[C][m][4 * n], 4);
      for (int k = 0; k < k_pairs; ++k)
        acc += bf16(&e.t[A][m][4 * k]) * bf16(&e.t[B][k][4 * n]) +
               bf16(&e.t[A][m][4 * k + 2]) * bf16(&e.t[B][k][4 * n + 2]);
      std::memcpy(&e.t[C][m][4 * n], &acc, 4);
    }
}
inline void tile_configure(const AmxTileConfig& cfg) { emulated_tiles.cfg = cfg; }
inline void tile_release() { emulated_tiles.cfg = AmxTileConfig{}; }  // back to the init state
#endif

inline void amx_configure() {
  AmxTileConfig cfg{};
  cfg.palette = 1;
  for (int t = 0; t < 8; ++t) {
    cfg.colsb[t] = 64;
    cfg.rows[t] = 16;
  }
  tile_configure(cfg);
}

constexpr int64_t kTileElems = 16 * 32;  // bf16 elements in one 16 x 64-byte tile

// Transposes the 16 x 16 words of r[0..15] (row i in r[i]) in place: unpacks pair the rows' words within
// 128-bit lanes, then two rounds of lane shuffles move each lane to its row. (Zero-masked forms with full
// masks: GCC 12 warns on the unmasked ones' undefined pass-through operand.)
inline void transpose_words_16x16(__m512i r[16]) {
  constexpr __mmask16 kAll = 0xffff;
  constexpr __mmask8 kAll64 = 0xff;
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_maskz_unpacklo_epi32(kAll, r[i], r[i + 1]);      // per lane: a0 b0 a1 b1
    t[i + 1] = _mm512_maskz_unpackhi_epi32(kAll, r[i], r[i + 1]);  //           a2 b2 a3 b3
  }
  for (int i = 0; i < 16; i += 4) {  // r[4g + j], lane L: word 4L + j of rows 4g .. 4g + 3
    r[i] = _mm512_maskz_unpacklo_epi64(kAll64, t[i], t[i + 2]);
    r[i + 1] = _mm512_maskz_unpackhi_epi64(kAll64, t[i], t[i + 2]);
    r[i + 2] = _mm512_maskz_unpacklo_epi64(kAll64, t[i + 1], t[i + 3]);
    r[i + 3] = _mm512_maskz_unpackhi_epi64(kAll64, t[i + 1], t[i + 3]);
  }
  const auto lanes = [](__m512i a, __m512i b, auto imm) { return _mm512_maskz_shuffle_i32x4(kAll, a, b, imm()); };
  using Even = std::integral_constant<int, 0x88>;  // lanes 0, 2 of a, then of b
  using Odd = std::integral_constant<int, 0xdd>;   // lanes 1, 3
  for (int j = 0; j < 4; ++j) {  // word 4L + j of all rows: lane m from r[4m + j]'s lane L
    const __m512i x0 = lanes(r[j], r[4 + j], Even{}), x1 = lanes(r[j], r[4 + j], Odd{});
    const __m512i y0 = lanes(r[8 + j], r[12 + j], Even{}), y1 = lanes(r[8 + j], r[12 + j], Odd{});
    t[j] = lanes(x0, y0, Even{});
    t[4 + j] = lanes(x1, y1, Even{});
    t[8 + j] = lanes(x0, y0, Odd{});
    t[12 + j] = lanes(x1, y1, Odd{});
  }
  for (int i = 0; i < 16; ++i) r[i] = t[i];
}

// The mask of the first n (clamped to [0, 32]) of 32 lanes.
inline __mmask32 first_lanes(int64_t n) {
  return n >= 32 ? ~__mmask32{0} : n > 0 ? (__mmask32{1} << n) - 1 : __mmask32{0};
}

// Packs rows as a B operand whose k runs along each row (K for S = Q Kᵀ: row n is key n, k the head
// dimension): row(n) gives row n's first k_len bf16 elements (nullptr: a zero row), for n in
// [n0, n0 + n_count) (both multiples of 16; rows are asked for in order); k is zero-padded to
// b_chunks * 32. Each pair (k, k + 1) is one 32-bit word, so a tile is a 16 x 16 transpose of words:
// 16 rows' 32 elements of one k chunk are loaded (zero past k_len) and transposed in registers.
template <class RowFn>
inline void pack_b_k_along_rows(uint16_t* dst, int64_t b_chunks, int64_t n0, int64_t n_count, int64_t k_len,
                                RowFn row) {
  for (int64_t n = n0; n < n0 + n_count; n += 16) {
    const uint16_t* src[16];
    for (int i = 0; i < 16; ++i) src[i] = row(n + i);
    uint16_t* group = dst + (n / 16) * b_chunks * kTileElems;
    for (int64_t kc = 0; kc < b_chunks; ++kc) {
      const __mmask32 live = first_lanes(k_len - kc * 32);
      __m512i r[16];
      for (int i = 0; i < 16; ++i)
        r[i] = src[i] != nullptr ? _mm512_maskz_loadu_epi16(live, src[i] + kc * 32) : _mm512_setzero_si512();
      transpose_words_16x16(r);
      for (int q = 0; q < 16; ++q) _mm512_storeu_si512(group + kc * kTileElems + q * 32, r[q]);
    }
  }
}

// Packs rows as a B operand whose rows run along k (V for O += P V: row k is key k, n the column): row(k)
// gives row k's first n_len bf16 elements (nullptr: a zero row), for k in [k0, k0 + k_count) (k0 and
// k_count even); n is zero-padded to n_pad (a multiple of 16). Rows k and k + 1 interleave into words:
// 32 columns of both rows at a time, zero past n_len, one word permutation per 16 columns.
template <class RowFn>
inline void pack_b_n_along_rows(uint16_t* dst, int64_t b_chunks, int64_t k0, int64_t k_count, int64_t n_len,
                                int64_t n_pad, RowFn row) {
  // Word i of the first 16 columns takes element i of the even row and element i of the odd row (32 + i);
  // the next 16 columns' words take elements 16 + i.
  alignas(64) static constexpr uint16_t kLow[32] = {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
                                                    8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
  alignas(64) static constexpr uint16_t kHigh[32] = {16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21, 53, 22, 54, 23, 55,
                                                     24, 56, 25, 57, 26, 58, 27, 59, 28, 60, 29, 61, 30, 62, 31, 63};
  const __m512i low = _mm512_load_si512(kLow), high = _mm512_load_si512(kHigh);
  for (int64_t k = k0; k < k0 + k_count; k += 2) {
    const uint16_t* even = row(k);
    const uint16_t* odd = row(k + 1);
    uint16_t* base = dst + (k / 32) * kTileElems + (k % 32) * 16;
    // Column n goes to word (n / 16) * b_chunks * 256 + n % 16: runs of 16 consecutive words (one vector).
    for (int64_t n = 0; n < n_pad; n += 32) {
      const __mmask32 live = first_lanes(n_len - n);
      const __m512i e = even != nullptr ? _mm512_maskz_loadu_epi16(live, even + n) : _mm512_setzero_si512();
      const __m512i o = odd != nullptr ? _mm512_maskz_loadu_epi16(live, odd + n) : _mm512_setzero_si512();
      _mm512_storeu_si512(base + (n / 16) * b_chunks * kTileElems, _mm512_permutex2var_epi16(e, low, o));
      if (n + 16 < n_pad)
        _mm512_storeu_si512(base + (n / 16 + 1) * b_chunks * kTileElems, _mm512_permutex2var_epi16(e, high, o));
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

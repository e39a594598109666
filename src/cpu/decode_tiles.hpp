// decode_tiles.hpp — the decode path's arithmetic on one block of keys of one kv head (decode.hpp):
// scores of the head's query rows against the block's key rows, and O += P V. Key and value rows are read
// where they lie in the cache (fp32 rows as they are, bf16 and fp16 rows widened on load) or from an fp32 stage, and
// every vector of a key or value row loaded is used by four query rows.
// Per-ISA like the kernels (see simd.hpp for why).
#pragma once

#include <cstring>
#include <type_traits>
#include <utility>

#include "cpu/simd.hpp"

// Whether this unit has the dot-product tiles (below): AVX512_BF16 without AMX.
#if defined(__AVX512BF16__) && !defined(FLARE_AMX_LEVEL)
#define FLARE_DECODE_DOT_TILES 1
#include "cpu/dot_bf16.hpp"
#else
#define FLARE_DECODE_DOT_TILES 0
#endif

namespace flare::cpu::FLARE_ISA {

// W lanes of a row as fp32: fp32 rows as they are; bf16 rows widened (a bf16 is the top half of its fp32),
// one zero-extending load and one shift. (AVX-512: the zero-masked forms with a full mask, as GCC 12 warns on
// the unmasked ones' undefined pass-through operand.)
inline vec_t<float> load_lanes(const float* p) { return vload(p); }
inline vec_t<float> load_lanes(const uint16_t* p) {
#if defined(__AVX512F__) && FLARE_VEC_BYTES == 64
  const __m512i w = _mm512_maskz_cvtepu16_epi32(0xffff, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return static_cast<vec_t<float>>(_mm512_castsi512_ps(_mm512_maskz_slli_epi32(0xffff, w, 16)));
#elif defined(__AVX2__) && FLARE_VEC_BYTES == 32
  const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return static_cast<vec_t<float>>(_mm256_castsi256_ps(_mm256_slli_epi32(w, 16)));
#else
  constexpr int W = Simd<float>::W;
  typedef uint16_t Half __attribute__((vector_size(W * 2)));
  typedef uint32_t Word __attribute__((vector_size(W * 4)));
  Half h;
  std::memcpy(&h, p, sizeof(h));
  const Word w = __builtin_convertvector(h, Word) << 16;
  vec_t<float> f;
  std::memcpy(&f, &w, sizeof(f));
  return f;
#endif
}

// An fp16 element of a key or value row read in place (the tiles' KT / VT = Half): widened on load where the
// unit converts in hardware (F16C, or AVX-512's vcvtph2ps on 16 lanes); without it (the generic level) fp16 rows
// are staged to fp32 instead (decode.hpp, kDecodeF16InPlace).
struct Half {
  uint16_t bits;
};
#if defined(__AVX512F__) && FLARE_VEC_BYTES == 64
inline constexpr bool kDecodeF16InPlace = true;
inline vec_t<float> load_lanes(const Half* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return static_cast<vec_t<float>>(_mm512_maskz_cvtph_ps(0xffff, h));
}
#elif defined(__F16C__) && FLARE_VEC_BYTES == 32
inline constexpr bool kDecodeF16InPlace = true;
inline vec_t<float> load_lanes(const Half* p) {
  return static_cast<vec_t<float>>(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
#else
inline constexpr bool kDecodeF16InPlace = false;
#endif

// ---- W dot products at once: W accumulators folded into one vector of their W sums -----------------------
//
// A vector holding m sums keeps sum i in lanes [i s, (i + 1) s), s = W / m. Folding two such vectors x, y
// adds each segment's halves and interleaves the results: segment 2i of the result is x's sum i, segment
// 2i + 1 is y's. Folding the W accumulators pairwise, then the results pairwise, ... leaves one vector whose
// lane i holds the sum of input bitrev(i); feeding the inputs in bit-reversed order gives lane i = sum i.
// Each fold is two shuffles and an add for two vectors (AVX2: vperm2f128, then vshufps within 128-bit
// lanes), log2(W) levels in all, instead of log2(W) shuffle-add pairs for each of the W sums.
template <int S, size_t... L>
inline vec_t<float> fold_pair(vec_t<float> x, vec_t<float> y, std::index_sequence<L...>) {
  constexpr int W = Simd<float>::W;
  constexpr int H = S / 2;
  return __builtin_shufflevector(x, y, ((L / H) % 2 * W + L / H / 2 * S + L % H)...) +
         __builtin_shufflevector(x, y, ((L / H) % 2 * W + L / H / 2 * S + L % H + H)...);
}

// v[0..N): N vectors of W / N sums each (segments of N lanes); returns the single vector they fold into.
template <int N>
inline vec_t<float> fold_sums(vec_t<float>* v) {
  constexpr int W = Simd<float>::W;
  if constexpr (N == 1) {
    return v[0];
  } else {
#pragma GCC unroll 16
    for (int i = 0; i < N / 2; ++i) v[i] = fold_pair<N>(v[2 * i], v[2 * i + 1], std::make_index_sequence<W>{});
    return fold_sums<N / 2>(v);
  }
}

constexpr int bit_reversed(int i, int bits) {
  int r = 0;
  for (int b = 0; b < bits; ++b) r |= ((i >> b) & 1) << (bits - 1 - b);
  return r;
}
constexpr int log2_of(int n) { return n <= 1 ? 0 : 1 + log2_of(n / 2); }

// Lane i = the lane sum of acc[i], for the W accumulators acc[0..W).
inline vec_t<float> lane_sums(const vec_t<float>* acc) {
  constexpr int W = Simd<float>::W;
  vec_t<float> v[W];
#pragma GCC unroll 16
  for (int i = 0; i < W; ++i) v[i] = acc[bit_reversed(i, log2_of(W))];
  return fold_sums<W>(v);
}

// A score tile's W accumulators (kRows rows x W / kRows keys, row-major) folded into their W sums, scaled,
// and stored: s[r * lds + j] for the tile's rows r and keys j.
template <int kRows>
inline void store_tile_scores(const vec_t<float>* acc, float scale, float* s, int64_t lds) {
  constexpr int kKeys = Simd<float>::W / kRows;
  const vec_t<float> sums = lane_sums(acc) * scale;
#pragma GCC unroll 4
  for (int r = 0; r < kRows; ++r)
#pragma GCC unroll 16
    for (int j = 0; j < kKeys; ++j) s[r * lds + j] = sums[r * kKeys + j];
}

// A tile loop's hook between tiles (decode.hpp's ChunkPrefetch issues the next chunk's loads there).
struct NoPrefetch {
  void operator()() const {}
};

// ---- scores ----------------------------------------------------------------------------------------------

// Scores of kRows query rows (fp32, ldq apart) against W / kRows keys (rows k[0..)), head dim d (a multiple
// of W): s[r * lds + j] = scale * q_r · k_j. Each vector of a key row is loaded once for the kRows rows.
template <int kRows, class KT>
inline void score_tile(const float* q, int64_t ldq, const KT* const* k, int64_t d, float scale, float* s,
                       int64_t lds) {
  using V = vec_t<float>;
  constexpr int W = Simd<float>::W;
  constexpr int kKeys = W / kRows;
  V acc[W] = {};
  for (int64_t c = 0; c < d; c += W) {
    V kv[kKeys];
#pragma GCC unroll 16
    for (int j = 0; j < kKeys; ++j) kv[j] = load_lanes(k[j] + c);
#pragma GCC unroll 4
    for (int r = 0; r < kRows; ++r) {
      const V qv = vload(q + r * ldq + c);
#pragma GCC unroll 16
      for (int j = 0; j < kKeys; ++j) acc[r * kKeys + j] += qv * kv[j];
    }
  }
  store_tile_scores<kRows>(acc, scale, s, lds);
}

// Scores of rows query rows against keys k[0..n): s[r * lds + j]. k holds pointers up to n rounded up to W
// (the extra ones valid rows, whose scores land past n and are never used).
// between(): called before each tile.
template <class KT, class Between = NoPrefetch>
inline void score_block(const float* q, int64_t ldq, int64_t rows, const KT* const* k, int64_t n, int64_t d,
                        float scale, float* s, int64_t lds, Between&& between = {}) {
  constexpr int W = Simd<float>::W;
  constexpr int kRows = W >= 4 ? 4 : W;
  int64_t r = 0;
  for (; r + kRows <= rows; r += kRows)
    for (int64_t j = 0; j < n; j += W / kRows) {
      between();
      score_tile<kRows>(q + r * ldq, ldq, k + j, d, scale, s + r * lds + j, lds);
    }
  for (; r < rows; ++r)
    for (int64_t j = 0; j < n; j += W) {
      between();
      score_tile<1>(q + r * ldq, ldq, k + j, d, scale, s + r * lds + j, lds);
    }
}

// ---- O += P V ----------------------------------------------------------------------------------------------

// o_r += sum_j p[r * ldp + j] v_j for kRows rows and keys j in [j0, j1), head dim dv (a multiple of W). kCols
// vectors of each row's o stay in registers across the keys; each vector of a value row is loaded once for
// the kRows rows. between(): called before each block of kCols vectors.
template <int kRows, class VT, class Between = NoPrefetch>
inline void accumulate_pv(const float* p, int64_t ldp, const VT* const* v, int64_t j0, int64_t j1, float* o,
                          int64_t ldo, int64_t dv, Between&& between = {}) {
  using V = vec_t<float>;
  constexpr int W = Simd<float>::W;
  constexpr int kCols = FLARE_VEC_BYTES == 64 ? 4 : 2;  // kRows x kCols accumulators + kCols values in registers
  int64_t c = 0;
  for (; c + kCols * W <= dv; c += kCols * W) {
    between();
    V acc[kRows][kCols];
#pragma GCC unroll 4
    for (int r = 0; r < kRows; ++r)
#pragma GCC unroll 4
      for (int x = 0; x < kCols; ++x) acc[r][x] = vload(o + r * ldo + c + x * W);
    for (int64_t j = j0; j < j1; ++j) {
      V vv[kCols];
#pragma GCC unroll 4
      for (int x = 0; x < kCols; ++x) vv[x] = load_lanes(v[j] + c + x * W);
#pragma GCC unroll 4
      for (int r = 0; r < kRows; ++r) {
        const V pr = vset(p[r * ldp + j]);
#pragma GCC unroll 4
        for (int x = 0; x < kCols; ++x) acc[r][x] += pr * vv[x];
      }
    }
#pragma GCC unroll 4
    for (int r = 0; r < kRows; ++r)
#pragma GCC unroll 4
      for (int x = 0; x < kCols; ++x) vstore(o + r * ldo + c + x * W, acc[r][x]);
  }
  for (; c < dv; c += W) {
    between();
    V acc[kRows];
#pragma GCC unroll 4
    for (int r = 0; r < kRows; ++r) acc[r] = vload(o + r * ldo + c);
    for (int64_t j = j0; j < j1; ++j) {
      const V vv = load_lanes(v[j] + c);
#pragma GCC unroll 4
      for (int r = 0; r < kRows; ++r) acc[r] += vset(p[r * ldp + j]) * vv;
    }
#pragma GCC unroll 4
    for (int r = 0; r < kRows; ++r) vstore(o + r * ldo + c, acc[r]);
  }
}

#if defined(__AVX512F__) && FLARE_VEC_BYTES == 64
// ---- bf16 rows split into even and odd elements (AVX-512) ------------------------------------------------
//
// A bf16 is the top half of its fp32, so one 64-byte load of 32 bf16 gives both halves of a pair of fp32
// vectors in two single-port instructions: the even elements shifted up (x << 16) and the odd ones masked in
// place (x & 0xffff0000). load_lanes' widening took a shuffle and a shift per 16 elements, on the ports the
// FMAs need. The price is an order: the 32 elements c.. come as (c, c + 2, ..., c + 30) then
// (c + 1, ..., c + 31). Q·K does not care once q is split the same way (split_row); P·V's output columns come
// split, 32 at a time, and are joined again once per item (join_split_row).
constexpr bool kDecodeSplitsPairs = true;

struct SplitPair {
  __m512 even, odd;
};
inline SplitPair load_split(const uint16_t* p) {
  const __m512i w = _mm512_loadu_si512(p);
  // (Zero-masked forms with a full mask: GCC 12 warns on the unmasked ones' undefined pass-through operand.)
  return {_mm512_castsi512_ps(_mm512_maskz_slli_epi32(0xffff, w, 16)),
          _mm512_castsi512_ps(_mm512_maskz_and_epi32(0xffff, w, _mm512_set1_epi32(static_cast<int>(0xffff0000u))))};
}

// Row x (n floats, a multiple of 32) rewritten 32 columns at a time: the block's first 16 become lanes `first`
// of its two halves (as _mm512_permutex2var_ps indexes them), the next 16 lanes `second`.
inline void permute_row_blocks(float* x, int64_t n, __m512i first, __m512i second) {
  for (int64_t c = 0; c < n; c += 32) {
    const __m512 a = _mm512_loadu_ps(x + c), b = _mm512_loadu_ps(x + c + 16);
    _mm512_storeu_ps(x + c, _mm512_permutex2var_ps(a, first, b));
    _mm512_storeu_ps(x + c + 16, _mm512_permutex2var_ps(a, second, b));
  }
}

// Row x in split order: per 32 columns, the even ones, then the odd.
inline void split_row(float* x, int64_t n) {
  const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  permute_row_blocks(x, n, even, _mm512_add_epi32(even, _mm512_set1_epi32(1)));
}

// The inverse of split_row.
inline void join_split_row(float* x, int64_t n) {
  const __m512i low = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
  permute_row_blocks(x, n, low, _mm512_add_epi32(low, _mm512_set1_epi32(8)));
}

// "Dot order" (the dot-product and AMX tiles: two value rows interleaved by vpunpcklwd / vpunpckhwd, which
// work within 128-bit lanes): per 32 columns, first columns 0-3, 8-11, 16-19, 24-27, then 4-7, 12-15, 20-23,
// 28-31. Row x (n floats, a multiple of 32) from dot order back to column order, and the reverse.
inline void join_dot_row(float* x, int64_t n) {
  const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  permute_row_blocks(x, n, first, _mm512_add_epi32(first, _mm512_set1_epi32(8)));
}
inline void split_dot_row(float* x, int64_t n) {
  const __m512i low = _mm512_setr_epi32(0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27);
  permute_row_blocks(x, n, low, _mm512_add_epi32(low, _mm512_set1_epi32(4)));
}

// The 64-byte tiles' block loops (split and dot-product tiles alike). score_blocks_16: tile(r, j, 4-rows) over
// the rows in fours against 4 keys at a time, then tile(r, j, 1-row) over the rest against 16 at a time;
// between() before each tile.
template <class Tile, class Between>
inline void score_blocks_16(int64_t rows, int64_t n, Tile&& tile, Between&& between) {
  int64_t r = 0;
  for (; r + 4 <= rows; r += 4)
    for (int64_t j = 0; j < n; j += 4) {
      between();
      tile(r, j, std::integral_constant<int, 4>{});
    }
  for (; r < rows; ++r)
    for (int64_t j = 0; j < n; j += 16) {
      between();
      tile(r, j, std::integral_constant<int, 1>{});
    }
}

// column_passes_32: o's kRows rows (ldo apart, dv columns, a multiple of 32) in passes of two blocks of 32
// columns (one at the end where dv is an odd number of blocks): each pass loads the 2 B accumulators of each
// row (acc[r][x]: columns c + 16 x ..), runs keys(acc, c, B), and stores them back; between() before each.
template <int kRows, class Keys, class Between>
inline void column_passes_32(float* o, int64_t ldo, int64_t dv, Keys&& keys, Between&& between) {
  using V = vec_t<float>;
  constexpr int kBlocks = 2;  // kRows x 2 kBlocks accumulators + 2 kBlocks values in registers
  const auto pass = [&](int64_t c, auto blocks) {
    constexpr int B = decltype(blocks)::value;
    between();
    V acc[kRows][2 * B];
#pragma GCC unroll 4
    for (int r = 0; r < kRows; ++r)
#pragma GCC unroll 4
      for (int x = 0; x < 2 * B; ++x) acc[r][x] = vload(o + r * ldo + c + 16 * x);
    keys(acc, c, blocks);
#pragma GCC unroll 4
    for (int r = 0; r < kRows; ++r)
#pragma GCC unroll 4
      for (int x = 0; x < 2 * B; ++x) vstore(o + r * ldo + c + 16 * x, acc[r][x]);
  };
  int64_t c = 0;
  for (; c + 32 * kBlocks <= dv; c += 32 * kBlocks) pass(c, std::integral_constant<int, kBlocks>{});
  for (; c < dv; c += 32) pass(c, std::integral_constant<int, 1>{});
}

// score_tile on bf16 key rows, q rows in split order; d a multiple of 32.
template <int kRows>
inline void score_tile_split(const float* q, int64_t ldq, const uint16_t* const* k, int64_t d, float scale,
                             float* s, int64_t lds) {
  using V = vec_t<float>;
  constexpr int kKeys = 16 / kRows;
  V acc[16] = {};
  for (int64_t c = 0; c < d; c += 32) {
    SplitPair kv[kKeys];
#pragma GCC unroll 16
    for (int j = 0; j < kKeys; ++j) kv[j] = load_split(k[j] + c);
#pragma GCC unroll 4
    for (int r = 0; r < kRows; ++r) {
      const V qe = vload(q + r * ldq + c), qo = vload(q + r * ldq + c + 16);
#pragma GCC unroll 16
      for (int j = 0; j < kKeys; ++j) {  // two statements: two FMAs (one expression: a multiply, an FMA, an add)
        acc[r * kKeys + j] += qe * static_cast<V>(kv[j].even);
        acc[r * kKeys + j] += qo * static_cast<V>(kv[j].odd);
      }
    }
  }
  store_tile_scores<kRows>(acc, scale, s, lds);
}

// score_block on bf16 key rows, q rows in split order (d a multiple of 32; k padded as score_block's).
template <class Between = NoPrefetch>
inline void score_block_split(const float* q, int64_t ldq, int64_t rows, const uint16_t* const* k, int64_t n,
                              int64_t d, float scale, float* s, int64_t lds, Between&& between = {}) {
  const auto tile = [&](int64_t r, int64_t j, auto tile_rows) {
    score_tile_split<decltype(tile_rows)::value>(q + r * ldq, ldq, k + j, d, scale, s + r * lds + j, lds);
  };
  score_blocks_16(rows, n, tile, between);
}

// accumulate_pv on bf16 value rows with o's rows in split order (dv a multiple of 32): kBlocks blocks of 32
// columns per pass, each as an even and an odd accumulator.
template <int kRows, class Between = NoPrefetch>
inline void accumulate_pv_split(const float* p, int64_t ldp, const uint16_t* const* v, int64_t j0, int64_t j1,
                                float* o, int64_t ldo, int64_t dv, Between&& between = {}) {
  using V = vec_t<float>;
  const auto keys = [&](auto& acc, int64_t c, auto blocks) {
    constexpr int B = decltype(blocks)::value;
    for (int64_t j = j0; j < j1; ++j) {
      V vv[2 * B];
#pragma GCC unroll 2
      for (int x = 0; x < B; ++x) {
        const SplitPair w = load_split(v[j] + c + 32 * x);
        vv[2 * x] = static_cast<V>(w.even), vv[2 * x + 1] = static_cast<V>(w.odd);
      }
#pragma GCC unroll 4
      for (int r = 0; r < kRows; ++r) {
        const V pr = vset(p[r * ldp + j]);
#pragma GCC unroll 4
        for (int x = 0; x < 2 * B; ++x) acc[r][x] += pr * vv[x];
      }
    }
  };
  column_passes_32<kRows>(o, ldo, dv, keys, between);
}
#else
constexpr bool kDecodeSplitsPairs = false;
#endif

#if FLARE_DECODE_DOT_TILES
// ---- bf16 rows on bf16 dot products (AVX512_BF16 without AMX: Zen 4/5) -----------------------------------
//
// vdpbf16ps adds two bf16 products to each fp32 lane: 32 multiply-adds per instruction against an FMA's 16,
// with no widening at all. On two Zen 4 cores the widening FMA tiles above ran a bf16 decode at about 25 GB/s
// of cache with the cache in L3, no faster than memory: the pass was bound by its arithmetic, not by reading;
// these tiles compute it about 1.3x as fast. Not on the AMX level: on the Xeon with AMX vdpbf16ps retired one
// per ~2 cycles against two FMAs per cycle, and a dot-product decode computed 15.5 GB/s of an L2-resident
// cache against the FMA tiles' 17.7 (docs/tuning-cpu.md).
//   Q·K: a q row and a key row read as pair words are already pairs along the head dim: acc += dot(q, k),
//        folded per key as score_tile's are. q is kept in bf16 (it is bf16 in the call).
//   P·V: pairs along the keys: two value rows j, j + 1 interleaved (vpunpcklwd / vpunpckhwd, within each
//        128-bit lane) against the pair word (p_j, p_j+1) broadcast. P is rounded to bf16 for it, as the bf16
//        forward rounds it (and FlashAttention on the GPU); the row sum l stays the fp32 sum.
// The interleave leaves each 32 output columns in "dot order": the low accumulator holds columns
// 0-3, 8-11, 16-19, 24-27, the high one 4-7, 12-15, 20-23, 28-31; join_dot_row restores the order once per
// item.
constexpr bool kDecodeDotPairs = true;

inline vec_t<float> dot_madd(vec_t<float> acc, __m512i a, __m512i b) {
  return static_cast<vec_t<float>>(Bf16PairOps::madd(static_cast<__m512>(acc), a, b));
}

// Scores of kRows bf16 query rows (ldq elements apart) against 16 / kRows bf16 key rows, head dim d (a
// multiple of 32): s[r * lds + j] = scale * q_r · k_j.
template <int kRows>
inline void score_tile_dot(const uint16_t* q, int64_t ldq, const uint16_t* const* k, int64_t d, float scale,
                           float* s, int64_t lds) {
  using V = vec_t<float>;
  constexpr int kKeys = 16 / kRows;
  V acc[16] = {};
  for (int64_t c = 0; c < d; c += 32) {
    __m512i kv[kKeys];
#pragma GCC unroll 16
    for (int j = 0; j < kKeys; ++j) kv[j] = _mm512_loadu_si512(k[j] + c);
#pragma GCC unroll 4
    for (int r = 0; r < kRows; ++r) {
      const __m512i qv = _mm512_loadu_si512(q + r * ldq + c);
#pragma GCC unroll 16
      for (int j = 0; j < kKeys; ++j) acc[r * kKeys + j] = dot_madd(acc[r * kKeys + j], qv, kv[j]);
    }
  }
  store_tile_scores<kRows>(acc, scale, s, lds);
}

// score_block on bf16 query and key rows (d a multiple of 32; k padded as score_block's).
template <class Between = NoPrefetch>
inline void score_block_dot(const uint16_t* q, int64_t ldq, int64_t rows, const uint16_t* const* k, int64_t n,
                            int64_t d, float scale, float* s, int64_t lds, Between&& between = {}) {
  const auto tile = [&](int64_t r, int64_t j, auto tile_rows) {
    score_tile_dot<decltype(tile_rows)::value>(q + r * ldq, ldq, k + j, d, scale, s + r * lds + j, lds);
  };
  score_blocks_16(rows, n, tile, between);
}

// o_r += sum_j p_r[j] v_j for kRows rows over keys [j0, j1), p as bf16 rows (ldp apart), o in dot order (dv a
// multiple of 32). Keys go in pairs from j0, p's as one 32-bit load; an odd count's last key is paired with a
// zero row, so no value outside [j0, j1) is read (one there may be NaN: an unseen key), and the p element
// after it is read but meets zeros: it must be finite and readable (p_r[j1] may be the next row's first, or
// one element past the last row). between(): before each pass.
template <int kRows, class Between = NoPrefetch>
inline void accumulate_pv_dot(const uint16_t* p, int64_t ldp, const uint16_t* const* v, int64_t j0, int64_t j1,
                              float* o, int64_t ldo, int64_t dv, Between&& between = {}) {
  const auto keys = [&](auto& acc, int64_t c, auto blocks) {
    constexpr int B = decltype(blocks)::value;
    // Keys j and j + 1 (second: whether j + 1 is one of them).
    const auto step = [&](int64_t j, bool second) {
      __m512i lo[B], hi[B];
#pragma GCC unroll 2
      for (int x = 0; x < B; ++x) {
        const __m512i a = _mm512_loadu_si512(v[j] + c + 32 * x);
        const __m512i b = second ? _mm512_loadu_si512(v[j + 1] + c + 32 * x) : _mm512_setzero_si512();
        lo[x] = _mm512_unpacklo_epi16(a, b);
        hi[x] = _mm512_unpackhi_epi16(a, b);
      }
#pragma GCC unroll 4
      for (int r = 0; r < kRows; ++r) {
        uint32_t word;  // (p_j, p_j+1); without a second key its half meets the zero row
        std::memcpy(&word, p + r * ldp + j, sizeof(word));
        const __m512i w = _mm512_set1_epi32(static_cast<int>(word));
#pragma GCC unroll 4
        for (int x = 0; x < B; ++x) {
          acc[r][2 * x] = dot_madd(acc[r][2 * x], w, lo[x]);
          acc[r][2 * x + 1] = dot_madd(acc[r][2 * x + 1], w, hi[x]);
        }
      }
    };
    int64_t j = j0;
    for (; j + 2 <= j1; j += 2) step(j, true);
    if (j < j1) step(j, false);
  };
  column_passes_32<kRows>(o, ldo, dv, keys, between);
}
#else
constexpr bool kDecodeDotPairs = false;
#endif

}  // namespace flare::cpu::FLARE_ISA

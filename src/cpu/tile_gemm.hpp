// tile_gemm.hpp — the register-blocked matrix products every CPU pass is made of.
//
// C (M x N) = A (M x K) * B (K x N), or C += A * B, for small tiles that live in L1/L2. A is row-major with
// leading dimension lda (or, with TransA, stored as its transpose: K rows of M, so Aᵀ products need no
// transposed copy); B is row-major (K rows of N) with leading dimension ldb; C likewise with ldc.
// Callers pad: M is a multiple of kRows and N a multiple of the vector width W (padding holds zeros or is
// ignored), so the inner loop never branches. The micro-kernel keeps a kRows x (kCols * W) block of C in
// registers, broadcasting one A element per row and loading kCols vectors of B per step of K. The
// arithmetic of a step is a policy: FmaOps (fp32/fp64 FMA) here, Bf16PairOps in dot_bf16.hpp (one step is a
// pair of bf16 along K in each 32-bit lane, vdpbf16ps), on the same blocking.
#pragma once

#include "cpu/simd.hpp"

namespace flare::cpu::FLARE_ISA {

template <class T>
struct GemmShape {
#if FLARE_VEC_BYTES == 64
  // AVX-512, 32 registers: 6 x 4 accumulators + 4 B vectors + 1 broadcast; 10 loads feed 24 FMAs.
  static constexpr int kRows = 6;
  static constexpr int kCols = 4;  // vectors
#else
  // 16 registers: 4 x 3 accumulators + 3 B vectors + 1 broadcast.
  static constexpr int kRows = 4;
  static constexpr int kCols = 3;
#endif
};

// A leading dimension for a packed row-major operand of n columns: n rounded up to the vector width, plus
// one cache line where a row would be an even number of lines. The micro-kernel walks a column panel of B
// (kCols vectors wide, one or a few lines of each row) down all its rows; at a power-of-two stride such as
// 512 bytes those lines fall into a fraction of the L1 sets, and a 128-row panel that would fit L1 evicts
// itself (measured on Sapphire Rapids: 128-float rows ran the product ~15% slower than 144-float rows).
template <class T>
inline int64_t padded_ld(int64_t n) {
  constexpr int64_t kLine = 64 / static_cast<int64_t>(sizeof(T));  // elements per cache line
  constexpr int64_t W = Simd<T>::W;
  const int64_t ld = (n + W - 1) / W * W;
  return (ld * static_cast<int64_t>(sizeof(T))) % 128 == 0 ? ld + kLine : ld;
}

// A B operand stored row-major: row k at b + k * ldb (padded_ld for packed operands).
template <class In>
struct RowsB {
  const In* b;
  int64_t ldb;
  // The column panel that starts at column col, `width` columns wide (the micro-kernel's): its first row,
  // and the distance between its rows.
  const In* panel(int64_t col) const { return b + col; }
  int64_t panel_ld(int64_t /*col*/, int64_t /*width*/) const { return ldb; }
};

// The width of the panel holding column n of an n_stored-column PanelsB operand: `width`, or what is left
// for the last one. Its rows are that far apart.
inline int64_t panel_width(int64_t n, int64_t n_stored, int64_t width) {
  const int64_t col = n / width * width;
  return n_stored - col < width ? n_stored - col : width;
}

// A B operand packed as the micro-kernel walks it: column panels of `width` columns (the micro-kernel's
// kCols vectors; the last panel narrower), one after the other, each with its k_stored rows contiguous. A
// panel is then one sequential stream: no set conflicts in L1 and nothing for the hardware prefetcher to
// guess. Measured on a 64 x 128 x 128 product whose B blocks stream from L3 (Zen 4, the forward's key and
// value packs at seqlen 8192): 2-15% faster than rows at padded_ld from run to run; in the forward at
// seqlen 8192, 7-14%. Element (k, n) lies at
// panel_offset(k, n, k_stored, n_stored, width).
template <class In>
struct PanelsB {
  const In* b;
  int64_t k_stored, n_stored;
  const In* panel(int64_t col) const { return b + col * k_stored; }
  int64_t panel_ld(int64_t col, int64_t width) const { return panel_width(col, n_stored, width); }
};

inline int64_t panel_offset(int64_t k, int64_t n, int64_t k_stored, int64_t n_stored, int64_t width) {
  const int64_t col = n / width * width;
  return col * k_stored + k * panel_width(n, n_stored, width) + (n - col);
}

// dst[x * dst_ld + i] = src[i * src_ld + x] for i < W and x < n_out (n_out <= W): the transpose of a W x W
// square, as the key packs need it (W keys' rows in, W-key pieces of K^T / V^T rows out). For float lanes on
// AVX-512 in registers: 64 shuffles and 16 vector stores for what takes 256 scalar stores, one at a time,
// otherwise.
template <class T>
inline void transpose_square(const T* src, int64_t src_ld, T* dst, int64_t dst_ld, int64_t n_out) {
  constexpr int W = Simd<T>::W;
#if defined(__AVX512F__) && FLARE_VEC_BYTES == 64
  if constexpr (std::is_same_v<T, float>) {
    // The masked forms with a full mask and explicit pass-through: GCC 12 warns on the unmasked ones'
    // undefined operand (as in simd.hpp).
    const auto lo_ps = [](__m512 a, __m512 b) { return _mm512_mask_unpacklo_ps(a, 0xffff, a, b); };
    const auto hi_ps = [](__m512 a, __m512 b) { return _mm512_mask_unpackhi_ps(a, 0xffff, a, b); };
    const auto lo_pd = [](__m512 a, __m512 b) {
      const __m512d x = _mm512_castps_pd(a);
      return _mm512_castpd_ps(_mm512_mask_unpacklo_pd(x, 0xff, x, _mm512_castps_pd(b)));
    };
    const auto hi_pd = [](__m512 a, __m512 b) {
      const __m512d x = _mm512_castps_pd(a);
      return _mm512_castpd_ps(_mm512_mask_unpackhi_pd(x, 0xff, x, _mm512_castps_pd(b)));
    };
    // Lanes 0 and 2 of a then of b (0x88), or lanes 1 and 3 (0xdd).
    const auto even_lanes = [](__m512 a, __m512 b) { return _mm512_mask_shuffle_f32x4(a, 0xffff, a, b, 0x88); };
    const auto odd_lanes = [](__m512 a, __m512 b) { return _mm512_mask_shuffle_f32x4(a, 0xffff, a, b, 0xdd); };
    __m512 r[16], t[16];
    for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_ps(src + i * src_ld);
    // Pairs of rows interleaved by element, then pairs of pairs by element pair: t[4 q + k] holds, in each
    // 128-bit lane L, column 4 L + k of rows 4 q .. 4 q + 3.
    for (int q = 0; q < 4; ++q) {
      const __m512 lo01 = lo_ps(r[4 * q], r[4 * q + 1]), hi01 = hi_ps(r[4 * q], r[4 * q + 1]);
      const __m512 lo23 = lo_ps(r[4 * q + 2], r[4 * q + 3]), hi23 = hi_ps(r[4 * q + 2], r[4 * q + 3]);
      t[4 * q + 0] = lo_pd(lo01, lo23);
      t[4 * q + 1] = hi_pd(lo01, lo23);
      t[4 * q + 2] = lo_pd(hi01, hi23);
      t[4 * q + 3] = hi_pd(hi01, hi23);
    }
    // Then the 128-bit lanes: column 4 L + k is lane L of t[k], t[4 + k], t[8 + k], t[12 + k].
    for (int k = 0; k < 4; ++k) {
      const __m512 a02 = even_lanes(t[k], t[4 + k]), a13 = odd_lanes(t[k], t[4 + k]);
      const __m512 b02 = even_lanes(t[8 + k], t[12 + k]), b13 = odd_lanes(t[8 + k], t[12 + k]);
      const __m512 col[4] = {even_lanes(a02, b02), even_lanes(a13, b13), odd_lanes(a02, b02), odd_lanes(a13, b13)};
      for (int l = 0; l < 4; ++l)
        if (4 * l + k < n_out) _mm512_storeu_ps(dst + (4 * l + k) * dst_ld, col[l]);
    }
    return;
  }
#endif
  for (int64_t x = 0; x < n_out; ++x)
    for (int i = 0; i < W; ++i) dst[x * dst_ld + i] = src[i * src_ld + x];
}

// The same for W rows of n columns: dst[x * dst_ld + i] = src[i * src_ld + x] for i < W and x < n, a square
// at a time (src rows are read up to n rounded up to W).
template <class T>
inline void transpose_rows(const T* src, int64_t src_ld, int64_t n, T* dst, int64_t dst_ld) {
  constexpr int W = Simd<T>::W;
  for (int64_t c0 = 0; c0 < n; c0 += W)
    transpose_square<T>(src + c0, src_ld, dst + c0 * dst_ld, dst_ld, n - c0 < W ? n - c0 : W);
}

// The arithmetic of one product, as the micro-kernel sees it: In is one element of A and B along k (fp32 /
// fp64 here; a pair of bf16 in dot_bf16.hpp), Acc an element of C; VA, VB and VC the vectors of a
// broadcast A element, of W columns of B and of W columns of C; madd(c, a, b) accumulates one step of k.
template <class T>
struct FmaOps {
  using In = T;
  using Acc = T;
  using VA = vec_t<T>;
  using VB = vec_t<T>;
  using VC = vec_t<T>;
  static constexpr int W = Simd<T>::W;
  static VA broadcast(In a) { return vset(a); }
  static VB load_b(const In* p) { return vload(p); }
  static VC load_c(const Acc* p) { return vload(p); }
  static void store_c(Acc* p, VC v) { vstore(p, v); }
  static VC madd(VC c, VA a, VB b) { return c + a * b; }
};

template <class Ops, int R, int NV, bool Accumulate, bool TransA = false>
inline void gemm_micro(const typename Ops::In* __restrict a, int64_t lda, const typename Ops::In* __restrict b,
                       int64_t ldb, typename Ops::Acc* __restrict c, int64_t ldc, int64_t k_len) {
  constexpr int W = Ops::W;
  // The block starts from zero even when accumulating: C is added once, after the k loop. Loaded first, C
  // put its load latency (often an L2 miss: the B panel streams through L1 between visits to C) in front
  // of every accumulator's first multiply-add; measured 6-9% slower on a 64 x 128 x 128 tile (Zen 4,
  // bench/results/cpu-gemm-micro-2026-12-04-294207c.json).
  typename Ops::VC acc[R][NV];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 16
    for (int v = 0; v < NV; ++v) acc[r][v] = typename Ops::VC{};
  for (int64_t k = 0; k < k_len; ++k) {
    typename Ops::VB bv[NV];
#pragma GCC unroll 16
    for (int v = 0; v < NV; ++v) bv[v] = Ops::load_b(b + k * ldb + v * W);
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const typename Ops::VA av = Ops::broadcast(TransA ? a[k * lda + r] : a[r * lda + k]);
#pragma GCC unroll 16
      for (int v = 0; v < NV; ++v) acc[r][v] = Ops::madd(acc[r][v], av, bv[v]);
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 16
    for (int v = 0; v < NV; ++v)
      Ops::store_c(c + r * ldc + v * W, Accumulate ? acc[r][v] + Ops::load_c(c + r * ldc + v * W) : acc[r][v]);
}

// Rows [row, row + rows) of C against one column panel of NV vectors; rows <= kRows picks the micro-kernel.
template <class Ops, int NV, bool Accumulate, bool TransA>
inline void gemm_rows(int64_t rows, const typename Ops::In* a, int64_t lda, const typename Ops::In* b, int64_t ldb,
                      typename Ops::Acc* c, int64_t ldc, int64_t k_len) {
  constexpr int R = GemmShape<typename Ops::Acc>::kRows;
  switch (rows) {
    case 1: gemm_micro<Ops, 1, NV, Accumulate, TransA>(a, lda, b, ldb, c, ldc, k_len); break;
    case 2: gemm_micro<Ops, 2, NV, Accumulate, TransA>(a, lda, b, ldb, c, ldc, k_len); break;
    case 3: gemm_micro<Ops, 3, NV, Accumulate, TransA>(a, lda, b, ldb, c, ldc, k_len); break;
    case 4: gemm_micro<Ops, 4, NV, Accumulate, TransA>(a, lda, b, ldb, c, ldc, k_len); break;
    case 5: gemm_micro<Ops, 5, NV, Accumulate, TransA>(a, lda, b, ldb, c, ldc, k_len); break;
    default: gemm_micro<Ops, R, NV, Accumulate, TransA>(a, lda, b, ldb, c, ldc, k_len); break;
  }
}

// Runs the micro-kernels over an M x N tile with the arithmetic of Ops: full kRows x kCols blocks, then the
// last rows and the last, narrower column panel. k_len counts Ops::In elements (steps of k). B is a RowsB
// or a PanelsB (whose panels are kCols * W wide: kPanelCols).
template <class Ops, bool Accumulate, bool TransA = false, class B>
inline void gemm_tile_of(int64_t m, int64_t n, int64_t k_len, const typename Ops::In* a, int64_t lda, const B& b,
                         typename Ops::Acc* c, int64_t ldc) {
  // Row `row` of A starts at a + row * lda, or at column `row` of the stored transpose.
  const auto a_rows = [&](int64_t row) { return TransA ? a + row : a + row * lda; };
  constexpr int R = GemmShape<typename Ops::Acc>::kRows;
  constexpr int NV = GemmShape<typename Ops::Acc>::kCols;
  constexpr int W = Ops::W;
  static_assert(R <= 6, "gemm_rows handles up to 6 rows");
  int64_t col = 0;
  for (; col + NV * W <= n; col += NV * W) {
    const auto* bp = b.panel(col);
    const int64_t ldb = b.panel_ld(col, NV * W);
    for (int64_t row = 0; row < m; row += R)
      gemm_rows<Ops, NV, Accumulate, TransA>(smin<int64_t>(R, m - row), a_rows(row), lda, bp, ldb,
                                            c + row * ldc + col, ldc, k_len);
  }
  const int64_t rest = (n - col) / W;
  const auto* bp = b.panel(col);
  const int64_t ldb = b.panel_ld(col, NV * W);
  for (int64_t row = 0; row < m && rest > 0; row += R) {
    const int64_t rows = smin<int64_t>(R, m - row);
    const auto* ar = a_rows(row);
    auto* cr = c + row * ldc + col;
    switch (rest) {
      case 1: gemm_rows<Ops, 1, Accumulate, TransA>(rows, ar, lda, bp, ldb, cr, ldc, k_len); break;
      case 2: gemm_rows<Ops, 2, Accumulate, TransA>(rows, ar, lda, bp, ldb, cr, ldc, k_len); break;
      default: gemm_rows<Ops, 3, Accumulate, TransA>(rows, ar, lda, bp, ldb, cr, ldc, k_len); break;
    }
  }
}

// The width of a PanelsB panel for the FMA product of T.
template <class T>
inline constexpr int64_t kPanelCols = GemmShape<T>::kCols * Simd<T>::W;

// The fp32/fp64 FMA product: C (+)= A * B in the compute type T.
template <class T, bool Accumulate, bool TransA = false>
inline void gemm_tile(int64_t m, int64_t n, int64_t k_len, const T* a, int64_t lda, const T* b, int64_t ldb,
                      T* c, int64_t ldc) {
  gemm_tile_of<FmaOps<T>, Accumulate, TransA>(m, n, k_len, a, lda, RowsB<T>{b, ldb}, c, ldc);
}

// The same with B packed in panels of kPanelCols<T> columns (k_stored x n_stored: PanelsB).
template <class T, bool Accumulate, bool TransA = false>
inline void gemm_tile_panels(int64_t m, int64_t n, int64_t k_len, const T* a, int64_t lda, const PanelsB<T>& b, T* c,
                             int64_t ldc) {
  gemm_tile_of<FmaOps<T>, Accumulate, TransA>(m, n, k_len, a, lda, b, c, ldc);
}

}  // namespace flare::cpu::FLARE_ISA

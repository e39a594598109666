// decode_amx.hpp — the decode path's arithmetic on AMX tiles (the AMX level; bf16 caches, head dims multiples of
// 32, 2 to 16 query rows per kv head). On a Xeon with two threads the FMA tiles of decode_tiles.hpp read a bf16
// cache at 0.72-0.83x the copy bandwidth where fp32 caches, with half the arithmetic per byte, read at
// 0.88-0.91x; by instruction count those tiles spend about 40 cycles on a key row (K and V, head dim 128, four
// query rows), where the tile products take about 8 (one 16 x 16 x 32 product retires every 16 cycles: four
// per 16 keys for Sᵀ, eight per 32 keys for O). The tiles take both products off the vector units
// (docs/tuning-cpu.md):
//   Sᵀ = K Qᵀ   A = 16 key rows read where they lie in the cache (any stride; staged only where a group's rows
//               are not evenly spaced: pages, the chunk's tail), B = the query rows as VNNI pairs along the
//               head dim, packed once per item; C = 16 keys x R rows, turned into R score rows by a permute.
//   O += P V    A = P (R rows of 32 keys, rounded to bf16 as the bf16 forward rounds it), B = two value rows
//               interleaved by vpunpcklwd / vpunpckhwd (within 128-bit lanes: o is held in the dot order of
//               decode_tiles.hpp and joined at the end), C = 16 columns of the R output rows.
// Tile registers are configured once per thread for the call's R (decode_amx_configure).
#pragma once

#include "cpu/amx.hpp"

namespace flare::cpu::FLARE_ISA {

// kKeys0/1: 16 key rows x 32 elements (A of Sᵀ = K Qᵀ), then 16 key pairs x 16 value columns (B of O += P V).
enum DecodeTile : int {
  kScores0 = 0, kScores1 = 1, kQueryT = 2, kProbs = 3, kOut0 = 4, kOut1 = 5, kKeys0 = 6, kKeys1 = 7
};

// Whether an item of R query rows per kv head runs on the tiles. A tile product costs the same for 1 row as for
// 16 (about 16 cycles), where the FMA tiles' cost grows with R: at R = 1 (one token, no GQA) both come to about
// 8 cycles a key row at head dim 128 and the tiles add the packing, so one row stays on the FMA tiles.
inline bool decode_amx_fits(int64_t R) { return R >= 2 && R <= 16; }

// R rounded up to a power of two: the pitch, in floats, of a key's scores as the score tiles are stored.
inline int64_t decode_amx_pitch(int64_t R) {
  int64_t p = 1;
  while (p < R) p *= 2;
  return p;
}

// Scratch of one thread (bf16 elements or floats), for head dims dp, dvp (multiples of 32) and `heads` kv heads.
inline int64_t decode_amx_query_elems(int64_t heads, int64_t dp) { return heads * dp * 16; }
inline int64_t decode_amx_value_elems(int64_t dvp) { return dvp * 32; }
inline int64_t decode_amx_stage_elems(int64_t dp) { return 32 * dp; }
inline constexpr int64_t kDecodeAmxScoreFloats = 32 * 16;

inline void decode_amx_configure(int64_t R) {
  AmxTileConfig cfg{};
  cfg.palette = 1;
  const auto shape = [&](int t, int64_t rows, int64_t colsb) {
    cfg.rows[t] = static_cast<uint8_t>(rows);
    cfg.colsb[t] = static_cast<uint16_t>(colsb);
  };
  shape(kScores0, 16, 4 * R);
  shape(kScores1, 16, 4 * R);
  shape(kQueryT, 16, 4 * R);
  shape(kProbs, R, 64);
  shape(kOut0, R, 64);
  shape(kOut1, R, 64);
  shape(kKeys0, 16, 64);
  shape(kKeys1, 16, 64);
  tile_configure(cfg);
}

// s[r * lds + k] = scale * st[k * pitch + r] for the R rows and 16 keys of one stored score tile. Each
// permute gathers column r from two vectors (32 / pitch keys); the vectors' pairs are blended by key.
inline void decode_amx_score_rows(const float* st, int64_t R, int64_t pitch, float scale, float* s, int64_t lds) {
  const __m512 sc = _mm512_set1_ps(scale);
  if (pitch == 1) {
    _mm512_storeu_ps(s, _mm512_mul_ps(_mm512_loadu_ps(st), sc));
    return;
  }
  const int64_t keys_per_pair = 32 / pitch;
  const __m512i first =
      _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                         _mm512_set1_epi32(static_cast<int>(pitch)));
  for (int64_t r = 0; r < R; ++r) {
    const __m512i idx = _mm512_add_epi32(first, _mm512_set1_epi32(static_cast<int>(r)));  // low 5 bits used
    __m512 out = _mm512_permutex2var_ps(_mm512_loadu_ps(st), idx, _mm512_loadu_ps(st + 16));
    for (int64_t m = 1; m < pitch / 2; ++m) {
      const auto keys = static_cast<__mmask16>(((1u << keys_per_pair) - 1) << (m * keys_per_pair));
      out = _mm512_mask_blend_ps(
          keys, out, _mm512_permutex2var_ps(_mm512_loadu_ps(st + 32 * m), idx, _mm512_loadu_ps(st + 32 * m + 16)));
    }
    _mm512_storeu_ps(s + r * lds, _mm512_mul_ps(out, sc));
  }
}

// Scores of the R query rows (qt: packed by pack_b_k_along_rows, 16 columns, those past R zero) against the keys
// k[0..n) (n <= 32; k padded to a multiple of 16 with valid rows): s[r * lds + j] = scale * q_r · k_j for
// j < round_up(n, 16). A group of 16 keys is loaded from the cache where its rows are evenly spaced, else from
// `stage` (32 x d). st: kDecodeAmxScoreFloats floats. between(): after each 32 elements of the head dim.
template <class Between>
inline void decode_amx_scores(const uint16_t* qt, int64_t R, int64_t d, const uint16_t* const* k, int64_t n,
                              float scale, float* s, int64_t lds, float* st, uint16_t* stage, Between&& between) {
  const int64_t groups = (n + 15) / 16;
  const uint16_t* base[2] = {};
  int64_t stride[2] = {};
  for (int64_t g = 0; g < groups; ++g) {
    const uint16_t* const* rows = k + 16 * g;
    // As addresses: the rows may lie in different pages (blocks), where pointer differences are undefined.
    const auto at = [&](int i) { return static_cast<int64_t>(reinterpret_cast<uintptr_t>(rows[i])); };
    const int64_t step = at(1) - at(0);
    bool even = true;
    for (int i = 2; i < 16; ++i) even &= at(i) == at(0) + i * step;
    if (even) {
      base[g] = rows[0], stride[g] = step;
    } else {
      uint16_t* dst = stage + g * 16 * d;
      for (int i = 0; i < 16; ++i) std::memcpy(dst + i * d, rows[i], static_cast<size_t>(d) * 2);
      base[g] = dst, stride[g] = d * 2;
    }
  }
  tile_zero<kScores0>();
  if (groups > 1) tile_zero<kScores1>();
  for (int64_t c = 0; c < d; c += 32) {
    tile_load<kQueryT>(qt + c * 16, 64);
    tile_load<kKeys0>(base[0] + c, stride[0]);
    tile_dot_bf16<kScores0, kKeys0, kQueryT>();
    if (groups > 1) {
      tile_load<kKeys1>(base[1] + c, stride[1]);
      tile_dot_bf16<kScores1, kKeys1, kQueryT>();
    }
    between();
  }
  const int64_t pitch = decode_amx_pitch(R);
  tile_store<kScores0>(st, pitch * 4);
  if (groups > 1) tile_store<kScores1>(st + 16 * pitch, pitch * 4);
  for (int64_t g = 0; g < groups; ++g) decode_amx_score_rows(st + 16 * g * pitch, R, pitch, scale, s + 16 * g, lds);
}

// o (R rows, ldo floats apart, dv columns in dot order) += P V over keys v[0..n) (n <= 32): pb holds the R rows
// of P as 32 bf16 each (keys n.. zero). The value rows are interleaved in pairs into vt (dv / 16 tiles; keys
// past n zero). between(): after each tile of 16 columns.
template <class Between>
inline void decode_amx_values(const uint16_t* pb, const uint16_t* const* v, int64_t n, int64_t dv, float* o,
                              int64_t ldo, uint16_t* vt, Between&& between) {
  for (int64_t i = 0; i < 16; ++i) {
    const int64_t j = 2 * i;
    const uint16_t* a = j < n ? v[j] : nullptr;
    const uint16_t* b = j + 1 < n ? v[j + 1] : nullptr;
    for (int64_t c = 0; c < dv; c += 32) {
      const __m512i x = a != nullptr ? _mm512_loadu_si512(a + c) : _mm512_setzero_si512();
      const __m512i y = b != nullptr ? _mm512_loadu_si512(b + c) : _mm512_setzero_si512();
      _mm512_storeu_si512(vt + c * 32 + i * 32, _mm512_unpacklo_epi16(x, y));
      _mm512_storeu_si512(vt + c * 32 + 512 + i * 32, _mm512_unpackhi_epi16(x, y));
    }
  }
  tile_load<kProbs>(pb, 64);
  for (int64_t t = 0; t < dv / 16; t += 2) {
    tile_load<kOut0>(o + 16 * t, ldo * 4);
    tile_load<kKeys0>(vt + t * 512, 64);
    tile_dot_bf16<kOut0, kProbs, kKeys0>();
    tile_store<kOut0>(o + 16 * t, ldo * 4);
    tile_load<kOut1>(o + 16 * (t + 1), ldo * 4);
    tile_load<kKeys1>(vt + (t + 1) * 512, 64);
    tile_dot_bf16<kOut1, kProbs, kKeys1>();
    tile_store<kOut1>(o + 16 * (t + 1), ldo * 4);
    between();
  }
}

}  // namespace flare::cpu::FLARE_ISA

// product_amx.hpp — the matrix products of the bf16 engines on AMX tile units (Intel Sapphire Rapids and
// later): how each operand is packed and which tile product computes each of S = Q Kᵀ, O += P V and the
// backward's five. The tile loops around them are forward_bf16.hpp's and backward_bf16.hpp's.
//
// A operands are bf16 rows; B operands are VNNI tiles (amx.hpp): pairs along the reduction interleaved
// into 32-bit words, 16 columns x 16 pairs per tile. Products run on whole 32 x 32 blocks of C (four
// accumulator tiles), so head dims are padded to 32 and a forward tile's query rows to whole 32-row halves.
//   forward   S = Q Kᵀ     A = Q rows             B = K as VNNI pairs along d
//             O += P V     A = P (bf16)           B = V as VNNI pairs along keys
//   backward  Sᵀ = K Qᵀ    A = K rows             B = Q as VNNI pairs along d
//             dPᵀ = V dOᵀ  A = V rows             B = dO as VNNI pairs along dv
//             dV += Pᵀ dO  A = Pᵀ (bf16)          B = dO as VNNI pairs along queries
//             dK += dSᵀ Q  A = dSᵀ (bf16)         B = Q as VNNI pairs along queries
//             dQᵀ += Kᵀ dSᵀ  A = Kᵀ rows          B = dSᵀ as VNNI pairs along keys
// so no tile is ever transposed, and dQ accumulates transposed (dQᵀ: dpad rows of nq queries).
#pragma once

#include "cpu/amx.hpp"

namespace flare::cpu::FLARE_ISA {

struct AmxProduct {
  using Word = uint16_t;                    // packed operands hold bf16 (pairs interleaved by position)
  static constexpr int64_t kRowBlock = 32;  // A operands run in whole 32-row halves (padding rows zero)
  // Key blocks a backward step takes against each query tile (backward_group): at most kKeyBlocksPerStep,
  // key_blocks_for(p) per call. Two from head dim 128: a query tile's packs and dQ rows are then read once per
  // two blocks, 5-9% faster at head dims 128-512 (seqlens 2048-8192, causal or not, two threads); at head dim
  // 64 and on the race shapes one is level or 1-3% faster (docs/tuning-cpu.md).
  static constexpr int64_t kKeyBlocksPerStep = 2;
  // Every bf16 backward runs on the tiles (DotProduct hands sequences of few query rows to the FMA engine;
  // not measured with AMX).
  static constexpr int64_t kBackwardFewQueries = 0;
  static int64_t key_blocks_for(const Problem& p) { return p.headdim >= 128 ? 2 : 1; }

  static void thread_begin() { amx_configure(); }
  static void thread_end() { tile_release(); }

  // ---- forward: blocks of kBk keys

  struct ForwardDims {
    static constexpr int64_t kBk = Bf16Tiles::kForwardBk;  // keys per block
    int64_t dpad = 0, dvpad = 0;                         // head dims padded to 32
    int64_t q_row() const { return dpad; }               // words of a Q row
    int64_t k_block() const { return kBk * dpad; }       // words of a block's K pack
    int64_t v_block() const { return kBk * dvpad; }      // and V pack
    int64_t o_width() const { return dvpad; }            // floats of an output row
  };
  static ForwardDims forward_dims(const Problem& p) {
    return {round_up(p.headdim, 32), round_up(p.headdim_v, 32)};
  }

  // One query row (nullptr: a padding row of zeros), zero-padded to dpad: 32 elements per masked load.
  static void load_query_row(const ForwardDims& dm, const Problem& p, Word* dst, const uint16_t* src) {
    for (int64_t c = 0; c < dm.dpad; c += 32) {
      const __m512i x = src != nullptr ? _mm512_maskz_loadu_epi16(first_lanes(p.headdim - c), src + c)
                                       : _mm512_setzero_si512();
      _mm512_storeu_si512(dst + c, x);
    }
  }

  // The first `keys` (a multiple of 32) keys of one block: K as the B operand of S = Q Kᵀ (k = head dim,
  // n = key), V as that of O += P V (k = key, n = column); key_row(jj) / value_row(jj) give key jj's row,
  // nullptr past the sequence.
  template <class RowFn>
  static void pack_key_block(const ForwardDims& dm, const Problem& p, int64_t keys, Word* k, Word* v,
                             RowFn key_row, RowFn value_row) {
    pack_b_k_along_rows(k, dm.dpad / 32, 0, keys, p.headdim, key_row);
    pack_b_n_along_rows(v, dm.kBk / 32, 0, keys, p.headdim_v, dm.dvpad, value_row);
  }
  // Calls f(start, count) for each run of bf16 that the first `keys` keys of a V pack occupy: their k
  // chunks in every 16-column group.
  template <class F>
  static void value_pieces(const ForwardDims& dm, int64_t keys, Word* v, F f) {
    for (int64_t g = 0; g < dm.dvpad / 16; ++g) f(v + g * (dm.kBk / 32) * kTileElems, keys / 32 * kTileElems);
  }

  // S (rows x cols, ld lds) = Q Kᵀ against the block's first cols keys (rows, cols multiples of 32).
  static void scores(const ForwardDims& dm, int64_t rows, int64_t cols, const Word* q, const Word* k, float* s,
                     int64_t lds) {
    amx_gemm<false>(rows, cols, dm.dpad, q, dm.dpad, k, dm.dpad / 32, 0, 0, s, lds);
  }

  // O (rows x dvpad) += P V over the block's first cols keys; P rows are ldp apart.
  static void add_values(const ForwardDims& dm, int64_t rows, int64_t cols, const uint16_t* p, int64_t ldp,
                         const Word* v, float* o) {
    amx_gemm<true>(rows, dm.dvpad, cols, p, ldp, v, dm.kBk / 32, 0, 0, o, dm.dvpad);
  }

  // ---- backward: blocks of kBk keys against tiles of kBq queries, keys-major

  struct BackwardDims {
    static constexpr int64_t kBq = Bf16Tiles::kBackwardBq, kBk = Bf16Tiles::kBackwardBk;
    int64_t dpad = 0, dvpad = 0;   // head dims padded to 32
    int64_t nk = 0, nq = 0;        // sequence lengths padded to whole blocks and tiles
    // Row strides of Kᵀ (words) and dQᵀ (floats): the lengths and one cache line more. Power-of-two lengths
    // would put the dpad rows a tile load or store walks power-of-two bytes apart, in the same cache sets.
    int64_t nk_ld = 0, nq_ld = 0;
    // Words of each pack (per group: K, V rows and Kᵀ; per query head: Q and dO along d / dv and along
    // queries), of the tile's dSᵀ repacked for dQ, and the shapes of the fp32 accumulators.
    int64_t k_rows() const { return nk * dpad; }
    int64_t v_rows() const { return nk * dvpad; }
    int64_t k_for_dq() const { return dpad * nk_ld; }
    int64_t q_by_d() const { return nq * dpad; }
    int64_t do_by_dv() const { return nq * dvpad; }
    int64_t q_by_query() const { return nq * dpad; }
    int64_t do_by_query() const { return nq * dvpad; }
    int64_t ds_for_dq() const { return kBk * kBq; }
    // dK and dV rows: the head dims and one cache line more (the same set conflict at head dims 256 and 512).
    int64_t dk_ld() const { return dpad + 16; }
    int64_t dv_ld() const { return dvpad + 16; }
    int64_t dq_size() const { return dpad * nq_ld; }
    int64_t dq_at(int64_t i, int64_t c) const { return c * nq_ld + i; }  // dQᵀ
  };
  static BackwardDims backward_dims(const Problem& p, int64_t nq, int64_t nk) {
    return {round_up(p.headdim, 32), round_up(p.headdim_v, 32), nk, nq, nk + 32, nq + 16};
  }

  // Keys [j0, j0 + kBk): K and V rows and Kᵀ (zero-padded), the last the operand of the dQ product. Kᵀ takes
  // no NaN or infinity (masked keys' K meets dS = 0 there; the shared loop adds the values back for the
  // queries that see them). Each value is tested as it is stored: with that select GCC vectorises the loop,
  // without it the loop stays scalar and the backward runs up to 20% slower at seqlen 512.
  static void pack_keys(const BackwardDims& dm, const Problem& p, const RowPtr& krows, const RowPtr& vrows,
                        int64_t seqlen_k, int64_t j0, Word* k, Word* v, Word* kt) {
    // Kᵀ's rows are dm.nk_ld words apart: a key's column written whole touches dpad lines one stride apart,
    // which share cache sets at power-of-two key counts. Up to 64 columns that is cheap and Kᵀ is written
    // with K; from 128 it is written afterwards from the packed rows in 16 x 16 blocks (head dims 128-512:
    // 7-20% faster backward; docs/tuning-cpu.md).
    const auto finite = [](uint16_t x) { return (x & 0x7f80) == 0x7f80 ? uint16_t(0) : x; };
    const auto rows = [&](auto kt_with_k) {
      for (int64_t j = j0; j < j0 + dm.kBk; ++j) {
        const bool in = j < seqlen_k;
        const uint16_t* ksrc = in ? reinterpret_cast<const uint16_t*>(krows.row(j)) : nullptr;
        const uint16_t* vsrc = in ? reinterpret_cast<const uint16_t*>(vrows.row(j)) : nullptr;
        for (int64_t c = 0; c < dm.dpad; ++c) {
          const uint16_t x = (in && c < p.headdim) ? ksrc[c] : uint16_t(0);
          k[j * dm.dpad + c] = x;
          if constexpr (decltype(kt_with_k)::value) kt[c * dm.nk_ld + j] = finite(x);
        }
        for (int64_t c = 0; c < dm.dvpad; ++c) v[j * dm.dvpad + c] = (in && c < p.headdim_v) ? vsrc[c] : uint16_t(0);
      }
    };
    if (dm.dpad < 128) return rows(std::true_type{});
    rows(std::false_type{});
    for (int64_t c0 = 0; c0 < dm.dpad; c0 += 16) {
      for (int64_t jb = j0; jb < j0 + dm.kBk; jb += 16) {
        for (int64_t c = c0; c < smin(c0 + 16, dm.dpad); ++c) {
          for (int64_t j = jb; j < jb + 16; ++j) kt[c * dm.nk_ld + j] = finite(k[j * dm.dpad + c]);
        }
      }
    }
  }
  // Nothing left to zero: pack_keys kept the non-finite values out of Kᵀ.
  static void zero_nonfinite_keys(const BackwardDims&, Word*, int64_t) {}

  // Queries [i0, i0 + kBq) of one head: Q and dO as VNNI pairs along d / dv and along queries; q_row(i) and
  // do_row(i) give query i's rows, nullptr past the sequence.
  template <class RowFn>
  static void pack_queries(const BackwardDims& dm, const Problem& p, int64_t i0, RowFn q_row, RowFn do_row,
                           Word* q_by_d, Word* do_by_dv, Word* q_by_query, Word* do_by_query) {
    pack_b_k_along_rows(q_by_d, dm.dpad / 32, i0, dm.kBq, p.headdim, q_row);
    pack_b_k_along_rows(do_by_dv, dm.dvpad / 32, i0, dm.kBq, p.headdim_v, do_row);
    pack_b_n_along_rows(q_by_query, dm.nq / 32, i0, dm.kBq, p.headdim, dm.dpad, q_row);
    pack_b_n_along_rows(do_by_query, dm.nq / 32, i0, dm.kBq, p.headdim_v, dm.dvpad, do_row);
  }

  // Sᵀ (kBk x kBq, ld kBq) = K Qᵀ for keys from j0 and the query tile at i0.
  static void scores_t(const BackwardDims& dm, const Word* k, const Word* q_by_d, int64_t j0, int64_t i0, float* s) {
    keys_by_queries(dm, dm.dpad, k, q_by_d, j0, i0, s);
  }
  // dPᵀ (kBk x kBq) = V dOᵀ.
  static void dp_t(const BackwardDims& dm, const Word* v, const Word* do_by_dv, int64_t j0, int64_t i0, float* dp) {
    keys_by_queries(dm, dm.dvpad, v, do_by_dv, j0, i0, dp);
  }
  // dSᵀ (kBk x kBq bf16 rows) as the B operand of dQᵀ += Kᵀ dSᵀ: VNNI pairs along keys.
  static void pack_ds(const BackwardDims& dm, const uint16_t* ds, Word* ds_for_dq) {
    pack_b_n_along_rows(ds_for_dq, dm.kBk / 32, 0, dm.kBk, dm.kBq, dm.kBq, [&](int64_t r) { return ds + r * dm.kBq; });
  }
  // dV (the block's rows, dv_ld() apart) += Pᵀ dO.
  static void add_dv(const BackwardDims& dm, const uint16_t* p, const Word* do_by_query, int64_t i0, float* dv) {
    amx_gemm<true>(dm.kBk, dm.dvpad, dm.kBq, p, dm.kBq, do_by_query, dm.nq / 32, 0, i0 / 32, dv, dm.dv_ld());
  }
  // dK (the block's rows, dk_ld() apart) += dSᵀ Q.
  static void add_dk(const BackwardDims& dm, const uint16_t* ds, const Word* q_by_query, int64_t i0, float* dk) {
    amx_gemm<true>(dm.kBk, dm.dpad, dm.kBq, ds, dm.kBq, q_by_query, dm.nq / 32, 0, i0 / 32, dk, dm.dk_ld());
  }
  // dQᵀ (the whole sequence's) += Kᵀ dSᵀ for keys from j0 and the query tile at i0.
  static void add_dq(const BackwardDims& dm, const Word* kt, const Word* ds_for_dq, int64_t j0, int64_t i0,
                     float* dq) {
    amx_gemm<true>(dm.dpad, dm.kBq, dm.kBk, kt + j0, dm.nk_ld, ds_for_dq, dm.kBk / 32, 0, 0, dq + i0, dm.nq_ld);
  }

 private:
  // kBk x kBq (ld kBq) = rows of A (keys from j0, width wpad) times B (VNNI along the width) of the tile at i0.
  static void keys_by_queries(const BackwardDims& dm, int64_t wpad, const Word* a, const Word* b, int64_t j0,
                              int64_t i0, float* out) {
    amx_gemm<false>(dm.kBk, dm.kBq, wpad, a + j0 * wpad, wpad, b, wpad / 32, i0 / 16, 0, out, dm.kBq);
  }
};

}  // namespace flare::cpu::FLARE_ISA

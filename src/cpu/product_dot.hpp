// product_dot.hpp — the matrix products of the bf16 engines on AVX512_BF16 dot products (vdpbf16ps), for
// processors with AVX-512 but no AMX (AMD Zen 4/5, Intel Cooper Lake): how each operand is packed and which
// dot_bf16.hpp product computes each of S = Q Kᵀ, O += P V and the backward's five. The tile loops around
// them are forward_bf16.hpp's and backward_bf16.hpp's.
//
// A operands are bf16 rows read as pair words along the reduction; B operands are pair rows (dot_bf16.hpp):
// word (kp, n) = (B[2 kp][n], B[2 kp + 1][n]). An odd head dimension is padded with a zero to whole pairs.
//   forward   S = Q Kᵀ     A = Q rows             B = K as pair rows along d
//             O += P V     A = P (bf16)           B = V as pair rows along keys
//   backward  Sᵀ = K Qᵀ    A = K rows             B = Q as pair rows along d (one panel per query tile)
//             dPᵀ = V dOᵀ  A = V rows             B = dO as pair rows along dv (likewise)
//             dV += Pᵀ dO  A = Pᵀ (bf16)          B = dO as pair rows along queries
//             dK += dSᵀ Q  A = dSᵀ (bf16)         B = Q as pair rows along queries
//             dQ += dS K   A = dSᵀ interleaved into pairs along keys, read transposed
//                                                 B = K as pair rows along keys
// so dQ accumulates row-major, as in the FMA engine.
#pragma once

#include "cpu/dot_bf16.hpp"
#include "cpu/unseen_values.hpp"

namespace flare::cpu::FLARE_ISA {

struct DotProduct {
  using Word = uint32_t;                   // packed operands hold pair words
  static constexpr int64_t kRowBlock = 1;  // A operands run on any number of rows
  // Key blocks the backward runs together against each query tile (backward_group): a query tile's packs
  // and dQ rows are then read once per two blocks. At seqlen 8192 a head's query packs outgrow the caches;
  // there this measured 12-20% faster on one core (hd64 and hd128, non-causal), elsewhere the same; 4 was
  // no better.
  static constexpr int64_t kKeyBlocksPerStep = 2;
  // Query rows per sequence up to which a bf16 backward runs on the FMA engine instead (isa_kernels.inc). With
  // that few rows the pair products' k loops over query rows (dK += dS^T Q, dV += P^T dO) are one or two
  // pairs long, and each pair stores a whole accumulator block: at FlashAttention's race shapes 3 x 799 and
  // 1 x 239 the FMA engine ran faster (Zen 4, docs/tuning-cpu.md).
  static constexpr int64_t kBackwardFewQueries = 8;

  // Nothing to set up per thread (AMX configures its tile registers here).
  static void thread_begin() {}
  static void thread_end() {}

  // ---- forward: blocks of kBk keys

  struct ForwardDims {
    static constexpr int64_t kBk = Bf16Tiles::kForwardBk;  // keys per block
    int64_t dpairs = 0;  // head-dim pairs: the reduction length of S = Q Kᵀ
    int64_t dvpad = 0;   // headdim_v padded to 16: the width of O
    int64_t ldk = 0;     // words between K pair rows (padded_ld: B operand)
    int64_t ldv = 0;     // words between V pair rows
    int64_t q_row() const { return dpairs; }             // words of a Q row
    int64_t k_block() const { return dpairs * ldk; }     // words of a block's K pack
    int64_t v_block() const { return kBk / 2 * ldv; }    // and V pack
    int64_t o_width() const { return dvpad; }            // floats of an output row
  };
  static ForwardDims forward_dims(const Problem& p) {
    const int64_t dvpad = round_up(p.headdim_v, 16);
    return {(p.headdim + 1) / 2, dvpad, padded_ld<uint32_t>(ForwardDims::kBk), padded_ld<uint32_t>(dvpad)};
  }

  // One query row as pair words (nullptr: zeros), unscaled: the scale goes into the exponent.
  static void load_query_row(const ForwardDims& dm, const Problem& p, Word* dst, const uint16_t* src) {
    copy_row_pairs(dst, src, p.headdim, dm.dpairs);
  }

  // The first `keys` (a multiple of 32) keys of one block: K as pair rows along the head dimension, V as
  // pair rows along keys; key_row(jj) / value_row(jj) give key jj's row, nullptr past the sequence.
  template <class RowFn>
  static void pack_key_block(const ForwardDims& dm, const Problem& p, int64_t keys, Word* k, Word* v,
                             RowFn key_row, RowFn value_row) {
    pack_pairs_along_rows(k, dm.ldk, keys, p.headdim, dm.dpairs, key_row);
    pack_pairs_across_rows(v, dm.ldv, keys, p.headdim_v, dm.dvpad, value_row);
  }
  // Calls f(start, count) for the run of bf16 that the first `keys` keys of a V pack occupy: their pair rows.
  template <class F>
  static void value_pieces(const ForwardDims& dm, int64_t keys, Word* v, F f) {
    f(v, keys / 2 * dm.ldv * 2);
  }

  // S (rows x cols, ld lds) = Q Kᵀ against the block's first cols keys.
  static void scores(const ForwardDims& dm, int64_t rows, int64_t cols, const Word* q, const Word* k, float* s,
                     int64_t lds) {
    dot_gemm<false>(rows, cols, dm.dpairs, q, dm.dpairs, k, dm.ldk, s, lds);
  }

  // O (rows x dvpad) += P V over the block's first cols keys (even); P rows are ldp apart.
  static void add_values(const ForwardDims& dm, int64_t rows, int64_t cols, const uint16_t* p, int64_t ldp,
                         const Word* v, float* o) {
    dot_gemm<true>(rows, dm.dvpad, cols / 2, words(p), ldp / 2, v, dm.ldv, o, dm.dvpad);
  }

  // ---- backward: blocks of kBk keys against tiles of kBq queries, keys-major

  struct BackwardDims {
    static constexpr int64_t kBq = Bf16Tiles::kBackwardBq, kBk = Bf16Tiles::kBackwardBk;
    int64_t dpairs = 0, dvpairs = 0;   // head-dim pairs: reductions of Sᵀ and dPᵀ, and the words of K, V rows
    int64_t dpad = 0, dvpad = 0;       // head dims padded to 16: widths of dK, dQ and dV
    int64_t ldd = 0, lddv = 0;         // strides of rows dpad / dvpad wide (pair rows and fp32 accumulators)
    int64_t ldt = 0;                   // stride of the per-tile query pair rows (kBq queries)
    int64_t nk = 0, nq = 0;            // sequence lengths padded to whole blocks and tiles
    // Words of each pack (per group: K, V rows and K along keys; per query head: Q and dO along d / dv and
    // along queries), of the tile's dSᵀ repacked for dQ, and the shapes of the fp32 accumulators.
    int64_t k_rows() const { return nk * dpairs; }
    int64_t v_rows() const { return nk * dvpairs; }
    int64_t k_for_dq() const { return nk / 2 * ldd; }
    int64_t q_by_d() const { return nq / kBq * dpairs * ldt; }
    int64_t do_by_dv() const { return nq / kBq * dvpairs * ldt; }
    int64_t q_by_query() const { return nq / 2 * ldd; }
    int64_t do_by_query() const { return nq / 2 * lddv; }
    int64_t ds_for_dq() const { return kBk * kBq / 2; }
    int64_t dk_ld() const { return ldd; }
    int64_t dv_ld() const { return lddv; }
    int64_t dq_size() const { return nq * ldd; }
    int64_t dq_at(int64_t i, int64_t c) const { return i * ldd + c; }
  };
  static BackwardDims backward_dims(const Problem& p, int64_t nq, int64_t nk) {
    const int64_t dpad = round_up(p.headdim, 16), dvpad = round_up(p.headdim_v, 16);
    return {(p.headdim + 1) / 2, (p.headdim_v + 1) / 2, dpad, dvpad, padded_ld<uint32_t>(dpad),
            padded_ld<uint32_t>(dvpad), padded_ld<uint32_t>(BackwardDims::kBq), nk, nq};
  }

  // Keys [j0, j0 + kBk): K and V rows as pair words and K as pair rows along keys (all zero-padded), the
  // last the operand of the dQ product.
  static void pack_keys(const BackwardDims& dm, const Problem& p, const RowPtr& krows, const RowPtr& vrows,
                        int64_t seqlen_k, int64_t j0, Word* k, Word* v, Word* k_by_key) {
    const auto key_row = [&](const RowPtr& rows, int64_t j) {
      return j < seqlen_k ? reinterpret_cast<const uint16_t*>(rows.row(j)) : nullptr;
    };
    for (int64_t j = j0; j < j0 + dm.kBk; ++j) {
      prefetch_ahead(krows, j, seqlen_k, p.headdim * 2);
      prefetch_ahead(vrows, j, seqlen_k, p.headdim_v * 2);
      copy_row_pairs(k + j * dm.dpairs, key_row(krows, j), p.headdim, dm.dpairs);
      copy_row_pairs(v + j * dm.dvpairs, key_row(vrows, j), p.headdim_v, dm.dvpairs);
    }
    pack_pairs_across_rows(k_by_key + j0 / 2 * dm.ldd, dm.ldd, dm.kBk, p.headdim, dm.dpad,
                           [&](int64_t jj) { return key_row(krows, j0 + jj); });
  }
  // Zeroes the NaN and infinities of keys [j0, j0 + kBk) in K along keys: masked keys' K meets dS = 0 there
  // (the shared loop adds the values back for the queries that see them).
  static void zero_nonfinite_keys(const BackwardDims& dm, Word* k_by_key, int64_t j0) {
    zero_nonfinite(k_by_key + j0 / 2 * dm.ldd, FLARE_DTYPE_BF16, dm.kBk * dm.ldd);  // kBk / 2 rows of ldd words
  }

  // Queries [i0, i0 + kBq) of one head: Q and dO as pair rows along d / dv (this tile's panel) and along
  // queries; q_row(i) and do_row(i) give query i's rows, nullptr past the sequence.
  template <class RowFn>
  static void pack_queries(const BackwardDims& dm, const Problem& p, int64_t i0, RowFn q_row, RowFn do_row,
                           Word* q_by_d, Word* do_by_dv, Word* q_by_query, Word* do_by_query) {
    const auto from_i0 = [i0](RowFn row) { return [i0, row](int64_t ii) { return row(i0 + ii); }; };
    const int64_t qt = i0 / dm.kBq, d = p.headdim, dv = p.headdim_v;
    pack_pairs_along_rows(q_by_d + qt * dm.dpairs * dm.ldt, dm.ldt, dm.kBq, d, dm.dpairs, from_i0(q_row));
    pack_pairs_along_rows(do_by_dv + qt * dm.dvpairs * dm.ldt, dm.ldt, dm.kBq, dv, dm.dvpairs, from_i0(do_row));
    pack_pairs_across_rows(q_by_query + i0 / 2 * dm.ldd, dm.ldd, dm.kBq, d, dm.dpad, from_i0(q_row));
    pack_pairs_across_rows(do_by_query + i0 / 2 * dm.lddv, dm.lddv, dm.kBq, dv, dm.dvpad, from_i0(do_row));
  }

  // Sᵀ (kBk x kBq, ld kBq) = K Qᵀ for keys from j0 and the query tile at i0.
  static void scores_t(const BackwardDims& dm, const Word* k, const Word* q_by_d, int64_t j0, int64_t i0, float* s) {
    keys_by_queries(dm, dm.dpairs, k, q_by_d, j0, i0, s);
  }
  // dPᵀ (kBk x kBq) = V dOᵀ.
  static void dp_t(const BackwardDims& dm, const Word* v, const Word* do_by_dv, int64_t j0, int64_t i0, float* dp) {
    keys_by_queries(dm, dm.dvpairs, v, do_by_dv, j0, i0, dp);
  }
  // dSᵀ (kBk x kBq bf16 rows) as the A operand of dQ += dS K: pairs along keys, read transposed.
  static void pack_ds(const BackwardDims& dm, const uint16_t* ds, Word* ds_for_dq) {
    pack_pairs_across_rows(ds_for_dq, dm.kBq, dm.kBk, dm.kBq, dm.kBq, [&](int64_t r) { return ds + r * dm.kBq; });
  }
  // dV (the block's rows, ld lddv) += Pᵀ dO.
  static void add_dv(const BackwardDims& dm, const uint16_t* p, const Word* do_by_query, int64_t i0, float* dv) {
    dot_gemm<true>(dm.kBk, dm.dvpad, dm.kBq / 2, words(p), dm.kBq / 2, do_by_query + i0 / 2 * dm.lddv, dm.lddv, dv,
                   dm.lddv);
  }
  // dK (the block's rows, ld ldd) += dSᵀ Q.
  static void add_dk(const BackwardDims& dm, const uint16_t* ds, const Word* q_by_query, int64_t i0, float* dk) {
    dot_gemm<true>(dm.kBk, dm.dpad, dm.kBq / 2, words(ds), dm.kBq / 2, q_by_query + i0 / 2 * dm.ldd, dm.ldd, dk, dm.ldd);
  }
  // dQ (the whole sequence's) += dS K for keys from j0 and the query tile at i0.
  static void add_dq(const BackwardDims& dm, const Word* k_by_key, const Word* ds_for_dq, int64_t j0, int64_t i0,
                     float* dq) {
    dot_gemm<true, true>(dm.kBq, dm.dpad, dm.kBk / 2, ds_for_dq, dm.kBq, k_by_key + j0 / 2 * dm.ldd, dm.ldd,
                         dq + i0 * dm.ldd, dm.ldd);
  }

 private:
  // bf16 rows read as pair words along them.
  static const Word* words(const uint16_t* x) { return reinterpret_cast<const Word*>(x); }

  // kBk x kBq (ld kBq) = rows of A (keys from j0, `pairs` words each) times the query tile at i0 of B (pair
  // rows along the same width, one panel of pairs x ldt words per tile).
  static void keys_by_queries(const BackwardDims& dm, int64_t pairs, const Word* a, const Word* b, int64_t j0,
                              int64_t i0, float* out) {
    dot_gemm<false>(dm.kBk, dm.kBq, pairs, a + j0 * pairs, pairs, b + i0 / dm.kBq * pairs * dm.ldt, dm.ldt, out, dm.kBq);
  }
};

}  // namespace flare::cpu::FLARE_ISA

// forward_bf16.hpp — the bf16 forward pass: one tile loop over a product policy, AmxProduct (product_amx.hpp,
// tile units) or DotProduct (product_dot.hpp, vdpbf16ps).
//
// Same algorithm and driver as forward.hpp (run_forward). Per key block of a query tile:
//   S = Q Kᵀ (Product::scores)  ->  softcap / ALiBi / mask  ->  online softmax in fp32, P rounded to bf16
//   (dropout's dropped elements zeroed)  ->  O += P V (Product::add_values)  ->  the seen keys' non-finite V.
// Q stays bf16 and unscaled: on plain, fully visible blocks the scale goes into the exponent, elsewhere S is
// scaled before it is shaped. Accumulation is fp32; the softmax, masks and the running max/sum stay fp32 on
// AVX-512. The product decides how Q, K and V are packed and how many rows a product runs on
// (Product::kRowBlock: rows past the tile's queries are zero and their P is zero).
#pragma once

#include "cpu/bf16_rows.hpp"
#include "cpu/forward.hpp"

namespace flare::cpu::FLARE_ISA {

template <class Product>
struct Bf16Forward {
  using Word = typename Product::Word;
  static constexpr int64_t kBq = Bf16Tiles::kForwardBq, kBk = Bf16Tiles::kForwardBk;

  struct Scratch {
    typename Product::ForwardDims dims;
    struct PerThread {
      Word* kpack;       // the key pack in use: per key block dims.k_block() words of K
      Word* vpack;       // and dims.v_block() words of V
      uint8_t* v_flags;  // per key of the pack: its V row holds a NaN or infinity (unseen_values.hpp)
      Word* q;           // Q tile: kBq rows of dims.q_row() words
      float* s;          // scores, kBq x kBk
      uint16_t* p;       // probabilities in bf16, kBq x kBk
      float* o;          // output accumulator, kBq x dims.o_width()
      float *m, *l;      // running max and sum
      uint16_t* keep;    // the tile's dropout keep bits, kBq x kBk / 16 masks
    };
    PerThread* threads = nullptr;

    // Carves this problem's scratch for nt threads out of a (see groups.hpp's scratch_bytes).
    void layout(Arena& a, const Problem& pr, int nt) {
      dims = Product::forward_dims(pr);
      const int64_t nkb = (longest_sequence(pr).keys + kBk - 1) / kBk;
      const int packs = use_private_groups(pr, nt) ? nt : 1;
      threads = a.take<PerThread>(nt);
      for (int t = 0; t < nt; ++t) {
        Word* kp = t < packs ? a.take<Word>(nkb * dims.k_block()) : threads ? threads[0].kpack : nullptr;
        Word* vp = t < packs ? a.take<Word>(nkb * dims.v_block()) : threads ? threads[0].vpack : nullptr;
        uint8_t* vf = t < packs ? a.take<uint8_t>(nkb * kBk) : threads ? threads[0].v_flags : nullptr;
        PerThread pt{kp, vp, vf, a.take<Word>(kBq * dims.q_row()), a.take<float>(kBq * kBk), a.take<uint16_t>(kBq * kBk),
                     a.take<float>(kBq * dims.o_width()), a.take<float>(kBq), a.take<float>(kBq),
                     a.take<uint16_t>(kBq * kBk / 16)};
        if (threads) threads[t] = pt;
      }
    }
  };

  static void thread_begin() { Product::thread_begin(); }
  static void thread_end() { Product::thread_end(); }

  // Packs key block kb of one kv head (Product::pack_key_block) and screens its values for NaN and infinity.
  // A sequence's last block is packed up to its last key, rounded up to 32: tile cuts each block there, so a
  // short sequence does not pay for a whole block of padding.
  static void pack(const Problem& p, const RowPtr& krows, const RowPtr& vrows, int64_t seqlen_k, int64_t kb,
                   const Scratch& ws, int tid) {
    const auto& t = ws.threads[tid];
    Word* kblock = t.kpack + kb * ws.dims.k_block();
    Word* vblock = t.vpack + kb * ws.dims.v_block();
    const int64_t keys = smin(kBk, round_up(seqlen_k - kb * kBk, 32));
    // Rows are asked for in order, so each request also prefetches the row kPrefetchRows ahead.
    const auto key_row = [&](const RowPtr& rows, int64_t bytes) {
      return [&, rows, bytes](int64_t jj) {
        const int64_t j = kb * kBk + jj;
        prefetch_ahead(rows, j, seqlen_k, bytes);
        return j < seqlen_k ? reinterpret_cast<const uint16_t*>(rows.row(j)) : nullptr;
      };
    };
    Product::pack_key_block(ws.dims, p, keys, kblock, vblock, key_row(krows, p.headdim * 2),
                            key_row(vrows, p.headdim_v * 2));
    screen_value_pieces(p, vrows, seqlen_k, kb * kBk, kBk, FLARE_DTYPE_BF16, t.v_flags + kb * kBk,
                        [&](auto f) { Product::value_pieces(ws.dims, keys, vblock, f); });
  }

  // One query tile [i0, i0 + kBq) of head h against every visible key block.
  static void tile(const Problem& p, const Sequence& seq, int64_t h, int64_t i0, const Scratch& ws, int tid) {
    using V = vec_t<float>;
    constexpr int W = Simd<float>::W;
    const auto& t = ws.threads[tid];
    const int64_t q_row = ws.dims.q_row(), ldo = ws.dims.o_width();
    const int64_t rows = smin(kBq, seq.seqlen_q - i0);
    const int64_t product_rows = round_up(rows, Product::kRowBlock);  // rows past `rows`: zero Q, zero P
    const policy::WindowMask mask = seq.mask(p);
    const RowPtr qrows = query_rows(p, p.q, seq, h);
    const float scale = static_cast<float>(p.score.scale);

    for (int64_t r = 0; r < product_rows; ++r) {
      // Query rows lie a row of every head apart: requested 8 ahead, which the hardware prefetcher does not.
      if (r + 8 < rows) {
        prefetch_bytes(qrows.row(i0 + r + 8), p.headdim * 2);
      }
      const uint16_t* src = r < rows ? reinterpret_cast<const uint16_t*>(qrows.row(i0 + r)) : nullptr;
      Product::load_query_row(ws.dims, p, t.q + r * q_row, src);
      t.m[r] = kNegInf;
      t.l[r] = 0.0f;
    }
    for (int64_t x = 0; x < product_rows * ldo; x += W) vstore(t.o + x, V{});

    const ScoreShape shape = score_shape(p, seq, h);
    const bool plain = shape.plain();
    const auto [first, last] = visible_keys(mask, i0, rows, seq.seqlen_k);
    const bool dropping = p.dropout_p > 0.0f;  // dropped P zeroed before O += P V, O / (1 - p) at the end (l undropped)
    const DropoutDraw draw = dropout_draw(p);
    const uint32_t stream = dropout_stream(p, seq, h);

    for (int64_t kb = first / kBk; first <= last && kb <= last / kBk; ++kb) {
      const int64_t j0 = kb * kBk;
      // The last block is cut after the last visible key, to whole pairs of vectors (Bf16PairWriter).
      const int64_t cols = smin(kBk, round_up(last + 1 - j0, 32));
      const Word* kblock = t.kpack + kb * ws.dims.k_block();
      const Word* vblock = t.vpack + kb * ws.dims.v_block();
      Product::scores(ws.dims, product_rows, cols, t.q, kblock, t.s, kBk);  // S = Q Kᵀ
      // Plain, fully visible blocks fold the scale into the exponent; others are scaled and shaped first.
      float row_scale = scale;
      if (!plain || !block_fully_visible(mask, i0, rows, j0, cols)) {
        for (int64_t r = 0; r < rows; ++r) scale_row<float>(t.s + r * kBk, cols, scale);
        shape_scores<float>(t.s, kBk, rows, cols, i0, j0, mask, shape, nullptr);
        row_scale = 1.0f;
      }
      if (dropping) dropout_tile_bits(draw, stream, i0, rows, j0, cols, t.keep, cols / 16);  // rows packed
      for (int64_t r = 0; r < product_rows; ++r) {
        uint16_t* prow = t.p + r * kBk;
        if (r >= rows) {
          std::memset(prow, 0, cols * sizeof(uint16_t));
          continue;
        }
        const Bf16PairWriter write(prow, dropping ? t.keep + r * (cols / 16) : nullptr);
        const float alpha = online_softmax_row<float>(t.s + r * kBk, cols, row_scale, t.m[r], t.l[r], write,
                                                      RowExpBf16{});
        if (alpha != 1.0f) scale_row<float>(t.o + r * ldo, ldo, alpha);
      }
      Product::add_values(ws.dims, product_rows, cols, t.p, kBk, vblock, t.o);  // O += P V
      add_seen_nonfinite_values<float>(p, seq, h, t.v_flags + j0, j0, cols, i0, rows, t.o, ldo);
    }
    finish_rows<float>(p, t.o, ldo, t.m, t.l, rows, query_rows(p, p.out, seq, h), lse_row(p, seq, h), i0,
                       sink_of(p, h), dropping ? static_cast<float>(draw.scale) : 1.0f);
  }
};

}  // namespace flare::cpu::FLARE_ISA

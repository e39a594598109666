// forward_amx.hpp — the bf16 forward pass on AMX tile units (Intel Sapphire Rapids and later).
//
// Same algorithm and driver as forward.hpp (run_forward), with both matrix products on tiles (amx.hpp):
//   S = Q Kᵀ : A = Q tile rows (bf16), B = K as VNNI pairs along the head dimension,
//   O += P V : A = P (bf16, rounded from the fp32 softmax), B = V as VNNI pairs along keys.
// Accumulation is fp32 in the tile registers; softmax, masks and the running max/sum stay fp32 on AVX-512.
#pragma once

#include "cpu/amx.hpp"
#include "cpu/forward.hpp"

namespace flare::cpu::FLARE_ISA {

struct AmxForward {
  static constexpr int64_t kBq = 64, kBk = 128;

  struct Scratch {
    int64_t dpad = 0, dvpad = 0, nchunks = 0, ncol16 = 0;
    struct PerThread {
      uint16_t* kpack;  // the key pack in use: per key block (kBk / 16) n-groups x nchunks tiles of K
      uint16_t* vpack;  // and ncol16 n-groups x (kBk / 32) chunks of V
      uint8_t* v_flags;  // per key of the pack: its V row holds a NaN or infinity (unseen_values.hpp)
      uint16_t* q;
      float* s;
      uint16_t* p;
      float* o;
      float* m;
      float* l;
      float* z;  // the tile's dropout factors, kBq x kBk
    };
    PerThread* threads = nullptr;

    void layout(Arena& a, const Problem& pr, int nt) {
      dpad = round_up(pr.headdim, 32);
      dvpad = round_up(pr.headdim_v, 32);
      nchunks = dpad / 32;
      ncol16 = dvpad / 16;
      const int64_t nkb = (longest_sequence(pr).keys + kBk - 1) / kBk;
      const int packs = use_private_groups(pr, nt) ? nt : 1;
      threads = a.take<PerThread>(nt);
      for (int t = 0; t < nt; ++t) {
        uint16_t* kp = t < packs ? a.take<uint16_t>(nkb * (kBk / 16) * nchunks * kTileElems)
                                 : threads ? threads[0].kpack : nullptr;
        uint16_t* vp = t < packs ? a.take<uint16_t>(nkb * (kBk / 32) * ncol16 * kTileElems)
                                 : threads ? threads[0].vpack : nullptr;
        uint8_t* vf = t < packs ? a.take<uint8_t>(nkb * kBk) : threads ? threads[0].v_flags : nullptr;
        PerThread pt{kp, vp, vf, a.take<uint16_t>(kBq * dpad), a.take<float>(kBq * kBk), a.take<uint16_t>(kBq * kBk),
                     a.take<float>(kBq * dvpad), a.take<float>(kBq), a.take<float>(kBq), a.take<float>(kBq * kBk)};
        if (threads) threads[t] = pt;
      }
    }
  };

  static void thread_begin() { amx_configure(); }
  static void thread_end() { _tile_release(); }

  static void pack(const Problem& p, const RowPtr& krows, const RowPtr& vrows, int64_t seqlen_k, int64_t kb,
                   const Scratch& ws, int tid) {
    const int64_t d = p.headdim, dv = p.headdim_v;
    const auto& t = ws.threads[tid];
    // Per key block: K as the B operand of S = Q Kᵀ (k = head dim, n = key), V as the B operand of
    // O += P V (k = key, n = column); both in the VNNI tile layout of amx.hpp.
    uint16_t* kblock = t.kpack + kb * (kBk / 16) * ws.nchunks * kTileElems;
    uint16_t* vblock = t.vpack + kb * (kBk / 32) * ws.ncol16 * kTileElems;
    // Rows are asked for in order, so each request also prefetches the row kPrefetchRows ahead.
    const auto key_row = [&](const RowPtr& rows, int64_t bytes) {
      return [&, rows, bytes](int64_t jj) {
        const int64_t j = kb * kBk + jj;
        prefetch_ahead(rows, j, seqlen_k, bytes);
        return j < seqlen_k ? reinterpret_cast<const uint16_t*>(rows.row(j)) : nullptr;
      };
    };
    pack_b_k_along_rows(kblock, ws.nchunks, 0, kBk, d, key_row(krows, d * 2));
    pack_b_n_along_rows(vblock, kBk / 32, 0, kBk, dv, ws.dvpad, key_row(vrows, dv * 2));
    screen_value_block(p, vrows, seqlen_k, kb * kBk, kBk, vblock, FLARE_DTYPE_BF16,
                       (kBk / 32) * ws.ncol16 * kTileElems, t.v_flags + kb * kBk);
  }

  static void tile(const Problem& p, const Sequence& seq, int64_t h, int64_t i0, const Scratch& ws, int tid) {
    using V = vec_t<float>;
    constexpr int W = Simd<float>::W;
    const auto& t = ws.threads[tid];
    const int64_t d = p.headdim, dpad = ws.dpad, dvpad = ws.dvpad;
    const int64_t rows = smin(kBq, seq.seqlen_q - i0);
    const int64_t row_blocks = (rows + 31) / 32;  // 32-row halves of the tile that hold queries
    const policy::WindowMask mask = seq.mask(p);
    const RowPtr qrows = query_rows(p, p.q, seq, h);
    const float scale = static_cast<float>(p.score.scale);

    for (int64_t r = 0; r < row_blocks * 32; ++r) {
      uint16_t* qr = t.q + r * dpad;
      const uint16_t* src = r < rows ? reinterpret_cast<const uint16_t*>(qrows.row(i0 + r)) : nullptr;
      for (int64_t c = 0; c < dpad; ++c) qr[c] = (src && c < d) ? src[c] : uint16_t(0);
      t.m[r] = kNegInf;
      t.l[r] = 0.0f;
    }
    for (int64_t x = 0; x < row_blocks * 32 * dvpad; x += W) vstore(t.o + x, V{});

    const ScoreShape shape = score_shape(p, seq, h);
    const bool plain = shape.plain();
    const auto [first, last] = visible_keys(mask, i0, rows, seq.seqlen_k);
    const bool dropping = p.dropout_p > 0.0f;  // P times its keep factors before O += P V (l stays undropped)
    const DropoutDraw draw = dropout_draw(p);
    const uint32_t stream = dropout_stream(p, seq, h);

    for (int64_t kb = first / kBk; first <= last && kb <= last / kBk; ++kb) {
      const int64_t j0 = kb * kBk;
      // The last block is cut after the last visible key (causal diagonals, short sequences).
      const int64_t cols = smin(kBk, round_up(last + 1 - j0, 32));
      const uint16_t* kblock = t.kpack + kb * (kBk / 16) * ws.nchunks * kTileElems;
      const uint16_t* vblock = t.vpack + kb * (kBk / 32) * ws.ncol16 * kTileElems;
      amx_gemm<false>(row_blocks * 32, cols, dpad, t.q, dpad, kblock, ws.nchunks, 0, 0, t.s, kBk);  // S = Q Kᵀ
      // Plain, fully visible blocks fold the scale into the exponent; others are scaled and shaped first.
      float row_scale = scale;
      if (!plain || !block_fully_visible(mask, i0, rows, j0, cols)) {
        for (int64_t r = 0; r < rows; ++r) scale_row<float>(t.s + r * kBk, cols, scale);
        shape_scores<float>(t.s, kBk, rows, cols, i0, j0, mask, shape, nullptr);
        row_scale = 1.0f;
      }
      if (dropping) dropout_tile(draw, stream, i0, rows, j0, cols, t.z, kBk);
      for (int64_t r = 0; r < row_blocks * 32; ++r) {
        uint16_t* prow = t.p + r * kBk;
        if (r >= rows) {
          std::memset(prow, 0, cols * sizeof(uint16_t));
          continue;
        }
        // P is written 32 columns at a time (Bf16PairWriter): cols is a multiple of 32.
        const float alpha = online_softmax_row<float>(t.s + r * kBk, cols, row_scale, t.m[r], t.l[r],
                                                      Bf16PairWriter(prow, dropping ? t.z + r * kBk : nullptr),
                                                      RowExpBf16{});
        if (alpha != 1.0f) scale_row<float>(t.o + r * dvpad, dvpad, alpha);
      }
      amx_gemm<true>(row_blocks * 32, dvpad, cols, t.p, kBk, vblock, kBk / 32, 0, 0, t.o, dvpad);  // O += P V
      add_seen_nonfinite_values<float>(p, seq, h, t.v_flags + j0, j0, cols, i0, rows, t.o, dvpad);
    }
    finish_rows<float>(p, t.o, dvpad, t.m, t.l, rows, query_rows(p, p.out, seq, h), lse_row(p, seq, h), i0,
                       sink_of(p, h));
  }
};

}  // namespace flare::cpu::FLARE_ISA

// forward_dot.hpp — the bf16 forward pass on AVX512_BF16 dot products (vdpbf16ps), for processors with
// AVX-512 but no AMX (AMD Zen 4/5, Intel Cooper Lake).
//
// Same algorithm and driver as forward.hpp (run_forward) and the same steps as the AMX engine
// (forward_amx.hpp), with both products on dot_bf16.hpp's register-blocked vdpbf16ps kernel:
//   S = Q Kᵀ : A = Q rows (bf16, unscaled: the scale goes into the exponent), B = K as pair rows along the
//              head dimension (pairs (K[n][2q], K[n][2q + 1]) for key n),
//   O += P V : A = P rows (bf16, rounded from the fp32 softmax), B = V as pair rows along keys.
// Accumulation is fp32; the softmax, masks and the running max/sum stay fp32 on AVX-512. An odd head
// dimension is padded with a zero to whole pairs.
#pragma once

#include "cpu/dot_bf16.hpp"
#include "cpu/forward.hpp"

namespace flare::cpu::FLARE_ISA {

struct DotForward {
  static constexpr int64_t kBq = 64, kBk = 128;

  struct Scratch {
    int64_t dpairs = 0;  // head-dim pairs: the reduction length of S = Q Kᵀ
    int64_t dvpad = 0;   // headdim_v padded to 16: the width of O
    int64_t ldk = 0;     // words between K pair rows (padded_ld: B operand)
    int64_t ldv = 0;     // words between V pair rows
    struct PerThread {
      uint32_t* kpack;  // the key pack in use: per key block dpairs pair rows of kBk keys (ldk apart)
      uint32_t* vpack;  // and kBk / 2 pair rows of dvpad columns (ldv apart)
      uint8_t* v_flags;  // per key of the pack: its V row holds a NaN or infinity (unseen_values.hpp)
      uint32_t* q;      // Q tile: kBq rows of dpairs words
      float* s;         // scores, kBq x kBk
      uint16_t* p;      // probabilities in bf16, kBq x kBk
      float* o;         // output accumulator, kBq x dvpad
      float *m, *l;     // running max and sum
      float* z;         // the tile's dropout factors, kBq x kBk
    };
    PerThread* threads = nullptr;

    // Carves this problem's scratch for nt threads out of a (see groups.hpp's scratch_bytes).
    void layout(Arena& a, const Problem& pr, int nt) {
      dpairs = (pr.headdim + 1) / 2;
      dvpad = round_up(pr.headdim_v, 16);
      ldk = padded_ld<uint32_t>(kBk);
      ldv = padded_ld<uint32_t>(dvpad);
      const int64_t nkb = (longest_sequence(pr).keys + kBk - 1) / kBk;
      const int packs = use_private_groups(pr, nt) ? nt : 1;
      threads = a.take<PerThread>(nt);
      for (int t = 0; t < nt; ++t) {
        uint32_t* kp = t < packs ? a.take<uint32_t>(nkb * dpairs * ldk) : threads ? threads[0].kpack : nullptr;
        uint32_t* vp = t < packs ? a.take<uint32_t>(nkb * (kBk / 2) * ldv) : threads ? threads[0].vpack : nullptr;
        uint8_t* vf = t < packs ? a.take<uint8_t>(nkb * kBk) : threads ? threads[0].v_flags : nullptr;
        PerThread pt{kp, vp, vf, a.take<uint32_t>(kBq * dpairs), a.take<float>(kBq * kBk), a.take<uint16_t>(kBq * kBk),
                     a.take<float>(kBq * dvpad), a.take<float>(kBq), a.take<float>(kBq), a.take<float>(kBq * kBk)};
        if (threads) threads[t] = pt;
      }
    }
  };

  // Nothing to set up per thread (the AMX engines configure their tile registers here).
  static void thread_begin() {}
  static void thread_end() {}

  // Packs key block kb of one kv head: K as pair rows along the head dimension, V as pair rows along keys.
  static void pack(const Problem& p, const RowPtr& krows, const RowPtr& vrows, int64_t seqlen_k, int64_t kb,
                   const Scratch& ws, int tid) {
    const auto& t = ws.threads[tid];
    // Rows are asked for in order, so each request also prefetches the row kPrefetchRows ahead.
    const auto key_row = [&](const RowPtr& rows, int64_t bytes) {
      return [&, rows, bytes](int64_t jj) {
        const int64_t j = kb * kBk + jj;
        prefetch_ahead(rows, j, seqlen_k, bytes);
        return j < seqlen_k ? reinterpret_cast<const uint16_t*>(rows.row(j)) : nullptr;
      };
    };
    pack_pairs_along_rows(t.kpack + kb * ws.dpairs * ws.ldk, ws.ldk, kBk, p.headdim, ws.dpairs,
                          key_row(krows, p.headdim * 2));
    uint32_t* vblock = t.vpack + kb * (kBk / 2) * ws.ldv;
    pack_pairs_across_rows(vblock, ws.ldv, kBk, p.headdim_v, ws.dvpad, key_row(vrows, p.headdim_v * 2));
    screen_value_block(p, vrows, seqlen_k, kb * kBk, kBk, vblock, FLARE_DTYPE_BF16, kBk * ws.ldv,
                       t.v_flags + kb * kBk);  // kBk / 2 pair rows of ldv words: kBk * ldv bf16 values
  }

  // One query tile [i0, i0 + kBq) of head h against every visible key block.
  static void tile(const Problem& p, const Sequence& seq, int64_t h, int64_t i0, const Scratch& ws, int tid) {
    using V = vec_t<float>;
    constexpr int W = Simd<float>::W;
    const auto& t = ws.threads[tid];
    const int64_t dpairs = ws.dpairs, dvpad = ws.dvpad;
    const int64_t rows = smin(kBq, seq.seqlen_q - i0);
    const policy::WindowMask mask = seq.mask(p);
    const RowPtr qrows = query_rows(p, p.q, seq, h);
    const float scale = static_cast<float>(p.score.scale);

    for (int64_t r = 0; r < rows; ++r) {
      copy_row_pairs(t.q + r * dpairs, reinterpret_cast<const uint16_t*>(qrows.row(i0 + r)), p.headdim, dpairs);
      t.m[r] = kNegInf;
      t.l[r] = 0.0f;
    }
    for (int64_t x = 0; x < rows * dvpad; x += W) vstore(t.o + x, V{});

    const ScoreShape shape = score_shape(p, seq, h);
    const bool plain = shape.plain();
    const auto [first, last] = visible_keys(mask, i0, rows, seq.seqlen_k);
    const bool dropping = p.dropout_p > 0.0f;  // P times its keep factors before O += P V (l stays undropped)
    const DropoutDraw draw = dropout_draw(p);
    const uint32_t stream = dropout_stream(p, seq, h);

    for (int64_t kb = first / kBk; first <= last && kb <= last / kBk; ++kb) {
      const int64_t j0 = kb * kBk;
      // The last block is cut after the last visible key, to whole pairs of vectors (Bf16PairWriter).
      const int64_t cols = smin(kBk, round_up(last + 1 - j0, 32));
      dot_gemm<false>(rows, cols, dpairs, t.q, dpairs, t.kpack + kb * dpairs * ws.ldk, ws.ldk, t.s, kBk);
      // Plain, fully visible blocks fold the scale into the exponent; others are scaled and shaped first.
      float row_scale = scale;
      if (!plain || !block_fully_visible(mask, i0, rows, j0, cols)) {
        for (int64_t r = 0; r < rows; ++r) scale_row<float>(t.s + r * kBk, cols, scale);
        shape_scores<float>(t.s, kBk, rows, cols, i0, j0, mask, shape, nullptr);
        row_scale = 1.0f;
      }
      if (dropping) dropout_tile(draw, stream, i0, rows, j0, cols, t.z, kBk);
      for (int64_t r = 0; r < rows; ++r) {
        const float alpha = online_softmax_row<float>(t.s + r * kBk, cols, row_scale, t.m[r], t.l[r],
                                                      Bf16PairWriter(t.p + r * kBk, dropping ? t.z + r * kBk : nullptr),
                                                      RowExpBf16{});
        if (alpha != 1.0f) scale_row<float>(t.o + r * dvpad, dvpad, alpha);
      }
      dot_gemm<true>(rows, dvpad, cols / 2, reinterpret_cast<const uint32_t*>(t.p), kBk / 2,
                     t.vpack + kb * (kBk / 2) * ws.ldv, ws.ldv, t.o, dvpad);  // O += P V
      add_seen_nonfinite_values<float>(p, seq, h, t.v_flags + j0, j0, cols, i0, rows, t.o, dvpad);
    }
    finish_rows<float>(p, t.o, dvpad, t.m, t.l, rows, query_rows(p, p.out, seq, h), lse_row(p, seq, h), i0,
                       sink_of(p, h));
  }
};

}  // namespace flare::cpu::FLARE_ISA

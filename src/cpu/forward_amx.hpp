// forward_amx.hpp — the bf16 forward pass on AMX tile units (Intel Sapphire Rapids and later).
//
// Same algorithm and driver as forward.hpp (run_forward), with both matrix products on tiles:
//   S = Q K^T : A = Q tile rows (bf16, row-major), B = K packed as [d pair][key][2] ("VNNI"),
//   O += P V  : A = P (bf16, rounded from the fp32 softmax), B = V packed as [key pair][column][2].
// Accumulation is fp32 in the tile registers; softmax, masks and the running max/sum stay fp32 on AVX-512.
// Tiles are 16 rows x 64 bytes; a 32 x 32 block of C uses four accumulators, two A and two B tiles.
#pragma once

#include "cpu/amx.hpp"
#include "cpu/forward.hpp"

namespace flare::cpu::FLARE_ISA {

struct AmxForward {
  static constexpr int64_t kBq = 64, kBk = 128;

  struct Scratch {
    int64_t dpad = 0, dvpad = 0, nchunks = 0, ncol16 = 0;
    struct PerThread {
      uint16_t* kpack;  // the key pack in use: per key block (kBk / 16) key groups x nchunks tiles
      uint16_t* vpack;  // and (kBk / 32) key chunks x ncol16 tiles
      uint16_t* q;
      float* s;
      uint16_t* p;
      float* o;
      float* m;
      float* l;
    };
    PerThread* threads = nullptr;

    void layout(Arena& a, const Problem& pr, int nt) {
      dpad = round_up(pr.headdim, 32);
      dvpad = round_up(pr.headdim_v, 32);
      nchunks = dpad / 32;
      ncol16 = dvpad / 16;
      const int64_t nkb = (max_keys(pr) + kBk - 1) / kBk;
      const int packs = use_private_groups(pr, nt) ? nt : 1;
      threads = a.take<PerThread>(nt);
      for (int t = 0; t < nt; ++t) {
        uint16_t* kp = t < packs ? a.take<uint16_t>(nkb * (kBk / 16) * nchunks * kTileElems)
                                 : threads ? threads[0].kpack : nullptr;
        uint16_t* vp = t < packs ? a.take<uint16_t>(nkb * (kBk / 32) * ncol16 * kTileElems)
                                 : threads ? threads[0].vpack : nullptr;
        PerThread pt{kp, vp, a.take<uint16_t>(kBq * dpad), a.take<float>(kBq * kBk), a.take<uint16_t>(kBq * kBk),
                     a.take<float>(kBq * dvpad), a.take<float>(kBq), a.take<float>(kBq)};
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
    // K: tile (group g, chunk c) holds [pair r][key n][2] = K[key g*16+n][c*32 + 2r + e].
    for (int64_t g = 0; g < kBk / 16; ++g) {
      for (int64_t n = 0; n < 16; ++n) {
        const int64_t j = kb * kBk + g * 16 + n;
        const uint16_t* src = j < seqlen_k ? reinterpret_cast<const uint16_t*>(krows.row(j)) : nullptr;
        for (int64_t c = 0; c < ws.nchunks; ++c) {
          uint16_t* tile = t.kpack + ((kb * (kBk / 16) + g) * ws.nchunks + c) * kTileElems;
          for (int64_t e = 0; e < 32; ++e) {
            const int64_t col = c * 32 + e;
            tile[(e / 2 * 16 + n) * 2 + e % 2] = (src && col < d) ? src[col] : uint16_t(0);
          }
        }
      }
    }
    // V: tile (chunk c, column group cg) holds [pair r][column n][2] = V[key c*32 + 2r + e][cg*16 + n].
    for (int64_t c = 0; c < kBk / 32; ++c) {
      for (int64_t kk = 0; kk < 32; ++kk) {
        const int64_t j = kb * kBk + c * 32 + kk;
        const uint16_t* src = j < seqlen_k ? reinterpret_cast<const uint16_t*>(vrows.row(j)) : nullptr;
        for (int64_t cg = 0; cg < ws.ncol16; ++cg) {
          uint16_t* tile = t.vpack + ((kb * (kBk / 32) + c) * ws.ncol16 + cg) * kTileElems;
          for (int64_t n = 0; n < 16; ++n) {
            const int64_t col = cg * 16 + n;
            tile[(kk / 2 * 16 + n) * 2 + kk % 2] = (src && col < dv) ? src[col] : uint16_t(0);
          }
        }
      }
    }
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
    const float scale = p.score.scale;

    for (int64_t r = 0; r < row_blocks * 32; ++r) {
      uint16_t* qr = t.q + r * dpad;
      const uint16_t* src = r < rows ? reinterpret_cast<const uint16_t*>(qrows.row(i0 + r)) : nullptr;
      for (int64_t c = 0; c < dpad; ++c) qr[c] = (src && c < d) ? src[c] : uint16_t(0);
      t.m[r] = kNegInf;
      t.l[r] = 0.0f;
    }
    for (int64_t x = 0; x < row_blocks * 32 * dvpad; x += W) vstore(t.o + x, V{});

    ScoreShape shape;
    shape.softcap = p.score.softcap;
    shape.alibi = p.score.alibi_slopes != nullptr;
    shape.slope = alibi_slope(p, seq, h);
    const bool plain = shape.softcap == 0 && !shape.alibi;
    const policy::KeyRange keys = mask.keys_of_rows(i0, i0 + rows);
    const int64_t first = smax<int64_t>(keys.first, 0), last = smin<int64_t>(keys.last, seq.seqlen_k - 1);

    for (int64_t kb = first / kBk; first <= last && kb <= last / kBk; ++kb) {
      const int64_t j0 = kb * kBk;
      // The last block is cut after the last visible key (causal diagonals, short sequences).
      const int64_t cols = smin(kBk, round_up(last + 1 - j0, 32));
      // S = Q K^T, 32 x 32 at a time.
      for (int64_t rb = 0; rb < row_blocks; ++rb) {
        for (int64_t cb = 0; cb < cols / 32; ++cb) {
          tile_zero<kC00>();
          tile_zero<kC01>();
          tile_zero<kC10>();
          tile_zero<kC11>();
          const uint16_t* b0 = t.kpack + (kb * (kBk / 16) + cb * 2) * ws.nchunks * kTileElems;
          const uint16_t* b1 = b0 + ws.nchunks * kTileElems;
          for (int64_t c = 0; c < ws.nchunks; ++c) {
            tile_load<kA0>(t.q + rb * 32 * dpad + c * 32, dpad * 2);
            tile_load<kA1>(t.q + (rb * 32 + 16) * dpad + c * 32, dpad * 2);
            tile_load<kB0>(b0 + c * kTileElems, 64);
            tile_load<kB1>(b1 + c * kTileElems, 64);
            tile_dot_bf16<kC00, kA0, kB0>();
            tile_dot_bf16<kC01, kA0, kB1>();
            tile_dot_bf16<kC10, kA1, kB0>();
            tile_dot_bf16<kC11, kA1, kB1>();
          }
          float* s = t.s + rb * 32 * kBk + cb * 32;
          tile_store<kC00>(s, kBk * 4);
          tile_store<kC01>(s + 16, kBk * 4);
          tile_store<kC10>(s + 16 * kBk, kBk * 4);
          tile_store<kC11>(s + 16 * kBk + 16, kBk * 4);
        }
      }
      // Plain, fully visible blocks fold the scale into the exponent; others are scaled and shaped first.
      float row_scale = scale;
      if (!plain || !block_fully_visible(mask, i0, rows, j0, cols)) {
        for (int64_t r = 0; r < rows; ++r) scale_row<float>(t.s + r * kBk, cols, scale);
        shape_scores<float>(t.s, kBk, rows, cols, i0, j0, mask, shape, nullptr);
        row_scale = 1.0f;
      }
      for (int64_t r = 0; r < row_blocks * 32; ++r) {
        uint16_t* prow = t.p + r * kBk;
        if (r >= rows) {
          std::memset(prow, 0, cols * sizeof(uint16_t));
          continue;
        }
        const float alpha = online_softmax_row<float>(t.s + r * kBk, cols, row_scale, t.m[r], t.l[r],
                                                      [prow](int64_t c, V e) {
                                                        const __m256bh b = _mm512_cvtneps_pbh(static_cast<__m512>(e));
                                                        std::memcpy(prow + c, &b, sizeof(b));
                                                      });
        if (alpha != 1.0f) scale_row<float>(t.o + r * dvpad, dvpad, alpha);
      }
      // O += P V, 32 x 32 at a time, accumulating through memory.
      for (int64_t rb = 0; rb < row_blocks; ++rb) {
        for (int64_t cb = 0; cb < dvpad / 32; ++cb) {
          float* o = t.o + rb * 32 * dvpad + cb * 32;
          tile_load<kC00>(o, dvpad * 4);
          tile_load<kC01>(o + 16, dvpad * 4);
          tile_load<kC10>(o + 16 * dvpad, dvpad * 4);
          tile_load<kC11>(o + 16 * dvpad + 16, dvpad * 4);
          for (int64_t c = 0; c < cols / 32; ++c) {
            const uint16_t* b0 = t.vpack + ((kb * (kBk / 32) + c) * ws.ncol16 + cb * 2) * kTileElems;
            tile_load<kA0>(t.p + rb * 32 * kBk + c * 32, kBk * 2);
            tile_load<kA1>(t.p + (rb * 32 + 16) * kBk + c * 32, kBk * 2);
            tile_load<kB0>(b0, 64);
            tile_load<kB1>(b0 + kTileElems, 64);
            tile_dot_bf16<kC00, kA0, kB0>();
            tile_dot_bf16<kC01, kA0, kB1>();
            tile_dot_bf16<kC10, kA1, kB0>();
            tile_dot_bf16<kC11, kA1, kB1>();
          }
          tile_store<kC00>(o, dvpad * 4);
          tile_store<kC01>(o + 16, dvpad * 4);
          tile_store<kC10>(o + 16 * dvpad, dvpad * 4);
          tile_store<kC11>(o + 16 * dvpad + 16, dvpad * 4);
        }
      }
    }
    finish_rows<float>(p, t.o, dvpad, t.m, t.l, rows, query_rows(p, p.out, seq, h), lse_row(p, seq, h), i0);
  }
};

}  // namespace flare::cpu::FLARE_ISA

// backward_amx.hpp — the bf16 backward pass on AMX tile units, in the keys-major ("transposed") domain.
//
// Same algorithm and driver as backward.hpp (run_backward). Working with Sᵀ (keys as rows) makes every
// product's A operand a plain row-major bf16 matrix that is already at hand, so no tile is transposed:
//   Sᵀ  = K · Qᵀ      A = K rows            B = Q as VNNI pairs along d
//   dPᵀ = V · dOᵀ     A = V rows            B = dO as VNNI pairs along dv
//   dV += Pᵀ · dO     A = Pᵀ (bf16)         B = dO as VNNI pairs along queries
//   dK += dSᵀ · Q     A = dSᵀ (bf16)        B = Q as VNNI pairs along queries
//   dQᵀ += Kᵀ · dSᵀ   A = Kᵀ rows           B = dSᵀ as VNNI pairs along keys
// with Pᵀ = exp(scale·Sᵀ - lse) and dSᵀ = Pᵀ ∘ (dPᵀ - D) (∘ (1 - tanh²) under softcap), fp32 on AVX-512
// (bf16_backward_elementwise in bf16_rows.hpp, shared with the dot-product engine).
// dK and dQ carry the softmax scale once, when written. P and dS are rounded to bf16 for the products, as
// GPU FlashAttention does; every accumulator is fp32.
#pragma once

#include "cpu/amx.hpp"
#include "cpu/backward.hpp"
#include "cpu/forward.hpp"  // scale_row

namespace flare::cpu::FLARE_ISA {

struct AmxBackward {
  static constexpr int64_t kBq = 64, kBk = 64;

  struct Scratch {
    int64_t dpad = 0, dvpad = 0, nk = 0, nq = 0;  // padded head dims and sequence lengths
    struct Pack {
      uint16_t *k, *v, *kt;  // per group: K rows (nk x dpad), V rows (nk x dvpad), Kᵀ rows (dpad x nk)
      float *dk, *dv;        // dK (nk x dpad), dV (nk x dvpad)
      uint16_t *q_by_d, *do_by_dv, *q_by_i, *do_by_i;  // per head: Q and dO as VNNI along d/dv and along i
      float *delta, *lse;                              // D = rowsum(dO * O), lse (+inf: no visible key)
      uint8_t* k_flags;  // per key: its K row holds a NaN or infinity (zeroed in kt; unseen_values.hpp)
    };
    struct PerThread {
      Pack* pack;
      float* dqt;  // dQᵀ (dpad x nq)
      float *s, *dp, *tanh;
      uint16_t *p, *ds, *ds_vnni;
      float* zt;  // dropout's keep factors of the tile, keys x queries
    };
    PerThread* threads = nullptr;

    void layout(Arena& a, const Problem& pr, int nt) {
      dpad = round_up(pr.headdim, 32);
      dvpad = round_up(pr.headdim_v, 32);
      const Lengths most = longest_sequence(pr);
      nk = round_up(most.keys, kBk);
      nq = round_up(most.queries, kBq);
      const int packs = use_private_groups(pr, nt) ? nt : 1;
      Pack* pack = a.take<Pack>(packs);
      for (int i = 0; i < packs; ++i) {
        Pack pk{a.take<uint16_t>(nk * dpad), a.take<uint16_t>(nk * dvpad), a.take<uint16_t>(dpad * nk),
                a.take<float>(nk * dpad),    a.take<float>(nk * dvpad),    a.take<uint16_t>(nq * dpad),
                a.take<uint16_t>(nq * dvpad), a.take<uint16_t>(nq * dpad), a.take<uint16_t>(nq * dvpad),
                a.take<float>(nq),           a.take<float>(nq),            a.take<uint8_t>(nk)};
        if (pack) pack[i] = pk;
      }
      threads = a.take<PerThread>(nt);
      for (int t = 0; t < nt; ++t) {
        const int64_t tile = kBk * kBq;
        PerThread pt{pack ? &pack[t < packs ? t : 0] : nullptr,
                     a.take<float>(dpad * nq),
                     a.take<float>(tile),
                     a.take<float>(tile),
                     a.take<float>(tile),
                     a.take<uint16_t>(tile),
                     a.take<uint16_t>(tile),
                     a.take<uint16_t>(tile),
                     a.take<float>(tile)};
        if (threads) threads[t] = pt;
      }
    }
  };

  static void thread_begin() { amx_configure(); }
  static void thread_end() { _tile_release(); }

  // Key block kb: K, V and Kᵀ rows in bf16 (zero-padded), dK/dV cleared. dQᵀ += Kᵀ dSᵀ multiplies the masked
  // keys' K by dS = 0: Kᵀ holds 0 for their NaN and infinities (flagged keys; added back in tile()).
  static void pack_keys(const Problem& p, const Sequence& seq, int64_t hk, int64_t kb, const Scratch& ws, int tid) {
    const auto& pk = *ws.threads[tid].pack;
    const RowPtr krows = key_rows(p, p.k, seq, hk), vrows = key_rows(p, p.v, seq, hk);
    flag_nonfinite_keys(p, krows, seq.seqlen_k, kb * kBk, kBk, pk.k_flags + kb * kBk);
    for (int64_t j = kb * kBk; j < (kb + 1) * kBk; ++j) {
      const bool in = j < seq.seqlen_k;
      const uint16_t* ksrc = in ? reinterpret_cast<const uint16_t*>(krows.row(j)) : nullptr;
      const uint16_t* vsrc = in ? reinterpret_cast<const uint16_t*>(vrows.row(j)) : nullptr;
      for (int64_t c = 0; c < ws.dpad; ++c) {
        const uint16_t x = (in && c < p.headdim) ? ksrc[c] : uint16_t(0);
        pk.k[j * ws.dpad + c] = x;
        pk.kt[c * ws.nk + j] = (x & 0x7f80) == 0x7f80 ? uint16_t(0) : x;
        pk.dk[j * ws.dpad + c] = 0.0f;
      }
      for (int64_t c = 0; c < ws.dvpad; ++c) {
        pk.v[j * ws.dvpad + c] = (in && c < p.headdim_v) ? vsrc[c] : uint16_t(0);
        pk.dv[j * ws.dvpad + c] = 0.0f;
      }
    }
  }

  // Query tile qt of head h: Q and dO in both VNNI layouts, D and lse.
  static void pack_queries(const Problem& p, const Sequence& seq, int64_t h, int64_t qt, const Scratch& ws,
                           int tid) {
    const auto& pk = *ws.threads[tid].pack;
    const RowPtr qrows = query_rows(p, p.q, seq, h), dorows = query_rows(p, p.dout, seq, h),
                 orows = query_rows(p, p.out, seq, h);
    const auto rows_of = [&](const RowPtr& rows) {
      return [&, rows](int64_t i) {
        return i < seq.seqlen_q ? reinterpret_cast<const uint16_t*>(rows.row(i)) : nullptr;
      };
    };
    const int64_t i0 = qt * kBq;
    pack_b_k_along_rows(pk.q_by_d, ws.dpad / 32, i0, kBq, p.headdim, rows_of(qrows));
    pack_b_k_along_rows(pk.do_by_dv, ws.dvpad / 32, i0, kBq, p.headdim_v, rows_of(dorows));
    pack_b_n_along_rows(pk.q_by_i, ws.nq / 32, i0, kBq, p.headdim, ws.dpad, rows_of(qrows));
    pack_b_n_along_rows(pk.do_by_i, ws.nq / 32, i0, kBq, p.headdim_v, ws.dvpad, rows_of(dorows));
    bf16_delta_and_lse(p, seq, dorows, orows, lse_row(p, seq, h), i0, kBq, pk.delta, pk.lse);
  }

  static void clear_dq(const Sequence&, const Scratch& ws, int tid) {
    std::memset(ws.threads[tid].dqt, 0, sizeof(float) * ws.dpad * ws.nq);
  }

  static void tile(const Problem& p, const Sequence& seq, int64_t h, int64_t kb, int64_t qt, const Scratch& ws,
                   int tid) {
    const auto& t = ws.threads[tid];
    const auto& pk = *t.pack;
    const int64_t i0 = qt * kBq, j0 = kb * kBk;

    // Sᵀ (keys x queries) and dPᵀ.
    amx_gemm<false>(kBk, kBq, ws.dpad, pk.k + j0 * ws.dpad, ws.dpad, pk.q_by_d, ws.dpad / 32, i0 / 16, 0, t.s, kBq);
    amx_gemm<false>(kBk, kBq, ws.dvpad, pk.v + j0 * ws.dvpad, ws.dvpad, pk.do_by_dv, ws.dvpad / 32, i0 / 16, 0,
                    t.dp, kBq);

    const bool dropping = p.dropout_p > 0.0f;
    if (dropping) dropout_keys_major(dropout_draw(p), dropout_stream(p, seq, h), i0, kBq, j0, kBk, t.zt, kBq);
    bf16_backward_elementwise(p, seq, h, i0, j0, kBk, kBq, pk.lse + i0, pk.delta + i0, t.s, t.dp, t.tanh, t.p,
                              t.ds, dropping ? t.zt : nullptr);  // Pᵀ, dSᵀ
    // dSᵀ as VNNI pairs along keys (the B operand of dQᵀ): interleave rows 2r and 2r + 1.
    pack_b_n_along_rows(t.ds_vnni, kBk / 32, 0, kBk, kBq, kBq, [&](int64_t r) { return t.ds + r * kBq; });

    amx_gemm<true>(kBk, ws.dvpad, kBq, t.p, kBq, pk.do_by_i, ws.nq / 32, 0, i0 / 32, pk.dv + j0 * ws.dvpad,
                   ws.dvpad);
    amx_gemm<true>(kBk, ws.dpad, kBq, t.ds, kBq, pk.q_by_i, ws.nq / 32, 0, i0 / 32, pk.dk + j0 * ws.dpad, ws.dpad);
    amx_gemm<true>(ws.dpad, kBq, kBk, pk.kt + j0, ws.nk, t.ds_vnni, kBk / 32, 0, 0, t.dqt + i0, ws.nq);
    // The non-finite K values of flagged keys, for the queries that see them (dSᵀ in fp32 is in t.dp).
    add_seen_nonfinite<float>(
        p, seq, h, p.k, p.headdim, pk.k_flags + j0, j0, kBk, i0, smin(kBq, seq.seqlen_q - i0),
        [&](int64_t r, int64_t jj) { return t.dp[jj * kBq + r]; },
        [&](int64_t r, int64_t c, float x) { t.dqt[c * ws.nq + i0 + r] += x; });
  }

  template <bool Shared>
  static void write_dq(const Problem& p, const RowPtr& dqrows, int64_t i, const Scratch& ws, int tid, int nt) {
    float row[kMaxHeaddim];  // headdim (cpu_backend.hpp's bound)
    const float* first = ws.threads[Shared ? 0 : tid].dqt;
    for (int64_t c = 0; c < p.headdim; ++c) row[c] = first[c * ws.nq + i];
    if constexpr (Shared)
      for (int other = 1; other < nt; ++other)
        for (int64_t c = 0; c < p.headdim; ++c) row[c] += ws.threads[other].dqt[c * ws.nq + i];
    store_row<float>(row, static_cast<float>(p.score.scale), dqrows.row(i), p.dtype, p.headdim);
  }

  static void write_dkdv(const Problem& p, const Sequence& seq, const RowPtr& dkrows, const RowPtr& dvrows,
                         int64_t j, const Scratch& ws, int tid) {
    static constexpr float kZeros[kMaxHeaddim] = {};  // wide enough for headdim and headdim_v
    const auto& pk = *ws.threads[tid].pack;
    const bool used = j < seq.seqlen_k;
    store_row<float>(used ? pk.dk + j * ws.dpad : kZeros, static_cast<float>(p.score.scale), dkrows.row(j), p.dtype, p.headdim);
    store_row<float>(used ? pk.dv + j * ws.dvpad : kZeros, 1.0f, dvrows.row(j), p.dtype, p.headdim_v);
  }
};

}  // namespace flare::cpu::FLARE_ISA

// backward_dot.hpp — the bf16 backward pass on AVX512_BF16 dot products (vdpbf16ps), for processors with
// AVX-512 but no AMX, in the keys-major ("transposed") domain of the AMX engine (backward_amx.hpp).
//
// Same algorithm and driver as backward.hpp (run_backward). A operands are bf16 rows read as pairs along
// the reduction, B operands pair rows (dot_bf16.hpp); with Sᵀ (keys as rows) the A operands of dV and dK,
// Pᵀ and dSᵀ, come out of the softmax step as plain rows:
//   Sᵀ  = K · Qᵀ      A = K rows       B = Q as pair rows along d (one panel per query tile)
//   dPᵀ = V · dOᵀ     A = V rows       B = dO as pair rows along dv (likewise)
//   dV += Pᵀ · dO     A = Pᵀ (bf16)    B = dO as pair rows along queries
//   dK += dSᵀ · Q     A = dSᵀ (bf16)   B = Q as pair rows along queries
//   dQ += dS · K      A = dSᵀ interleaved into pairs along keys, read transposed   B = K as pair rows along keys
// with Pᵀ = exp(scale·Sᵀ - lse) and dSᵀ = Pᵀ ∘ (dPᵀ - D) (∘ (1 - tanh²) under softcap) in fp32
// (bf16_backward_elementwise). dK and dQ carry the softmax scale once, when written. P and dS are rounded
// to bf16 for the products, as the AMX engine and GPU FlashAttention do; every accumulator is fp32.
#pragma once

#include "cpu/backward.hpp"
#include "cpu/dot_bf16.hpp"

namespace flare::cpu::FLARE_ISA {

struct DotBackward {
  static constexpr int64_t kBq = 64, kBk = 64;
  // Key blocks a thread runs together against each query tile (backward_group): a query tile's packs and dQ
  // rows are then read once per two blocks. At seqlen 8192 a head's query packs outgrow the caches; there
  // this measured 12-20% faster on one core (hd64 and hd128, non-causal), elsewhere the same; 4 was no better.
  static constexpr int64_t kKeyBlocksPerStep = 2;

  struct Scratch {
    int64_t dpairs = 0, dvpairs = 0;  // head-dim pairs: reductions of Sᵀ and dPᵀ, and the words of K, V rows
    int64_t dpad = 0, dvpad = 0;      // head dims padded to 16: widths of dK, dQ and dV
    int64_t ldd = 0, lddv = 0;        // strides of rows dpad / dvpad wide (pair rows and fp32 accumulators)
    int64_t ldt = 0;                  // stride of the per-tile query pair rows (kBq queries)
    int64_t nk = 0, nq = 0;           // sequence lengths padded to whole blocks
    struct Pack {
      uint32_t *k, *v;      // per group: K rows (nk x dpairs words), V rows (nk x dvpairs)
      uint32_t* k_by_key;   // K as pair rows along keys (nk / 2 x ldd)
      float *dk, *dv;       // dK (nk x ldd), dV (nk x lddv)
      uint32_t *q_by_d, *do_by_dv;  // per head, per query tile: dpairs (dvpairs) pair rows of kBq queries
      uint32_t *q_by_query, *do_by_query;  // Q (nq / 2 x ldd) and dO (nq / 2 x lddv) as pair rows along queries
      float *delta, *lse;   // D = rowsum(dO * O), lse (+inf: no visible key, or padding)
      uint8_t* k_flags;     // per key: its K row holds a NaN or infinity (zeroed in k_by_key; unseen_values.hpp)
    };
    struct PerThread {
      Pack* pack;
      float* dq;                    // dQ accumulator (nq x ldd)
      float *s, *dp, *tanh;         // keys x queries tiles: Sᵀ then Pᵀ, dPᵀ then dSᵀ, softcap's tanh
      uint16_t *p, *ds;             // Pᵀ and dSᵀ in bf16
      uint32_t* ds_pairs;           // dSᵀ as pair rows along keys (kBk / 2 x kBq)
      float* zt;                    // dropout's keep factors of the tile, keys x queries
    };
    PerThread* threads = nullptr;

    // Carves this problem's scratch for nt threads out of a (see groups.hpp's scratch_bytes).
    void layout(Arena& a, const Problem& pr, int nt) {
      dpairs = (pr.headdim + 1) / 2;
      dvpairs = (pr.headdim_v + 1) / 2;
      dpad = round_up(pr.headdim, 16);
      dvpad = round_up(pr.headdim_v, 16);
      ldd = padded_ld<uint32_t>(dpad);
      lddv = padded_ld<uint32_t>(dvpad);
      ldt = padded_ld<uint32_t>(kBq);
      const Lengths most = longest_sequence(pr);
      nk = round_up(most.keys, kBk);
      nq = round_up(most.queries, kBq);
      const int64_t nqt = nq / kBq;
      const int packs = use_private_groups(pr, nt) ? nt : 1;
      Pack* pack = a.take<Pack>(packs);
      for (int i = 0; i < packs; ++i) {
        Pack pk{a.take<uint32_t>(nk * dpairs),        a.take<uint32_t>(nk * dvpairs),
                a.take<uint32_t>(nk / 2 * ldd),       a.take<float>(nk * ldd),
                a.take<float>(nk * lddv),             a.take<uint32_t>(nqt * dpairs * ldt),
                a.take<uint32_t>(nqt * dvpairs * ldt), a.take<uint32_t>(nq / 2 * ldd),
                a.take<uint32_t>(nq / 2 * lddv),      a.take<float>(nq),
                a.take<float>(nq),                    a.take<uint8_t>(nk)};
        if (pack) pack[i] = pk;
      }
      threads = a.take<PerThread>(nt);
      for (int t = 0; t < nt; ++t) {
        const int64_t tile = kBk * kBq;
        PerThread pt{pack ? &pack[t < packs ? t : 0] : nullptr,
                     a.take<float>(nq * ldd),
                     a.take<float>(tile),
                     a.take<float>(tile),
                     a.take<float>(tile),
                     a.take<uint16_t>(tile),
                     a.take<uint16_t>(tile),
                     a.take<uint32_t>(tile / 2),
                     a.take<float>(tile)};
        if (threads) threads[t] = pt;
      }
    }
  };

  // Nothing to set up per thread (the AMX engines configure their tile registers here).
  static void thread_begin() {}
  static void thread_end() {}

  // Key block kb: K and V rows as pair words, K as pair rows along keys (all zero-padded), dK/dV cleared.
  static void pack_keys(const Problem& p, const Sequence& seq, int64_t hk, int64_t kb, const Scratch& ws, int tid) {
    const auto& pk = *ws.threads[tid].pack;
    const RowPtr krows = key_rows(p, p.k, seq, hk), vrows = key_rows(p, p.v, seq, hk);
    const int64_t j0 = kb * kBk;
    const auto key_row = [&](const RowPtr& rows, int64_t j) {
      return j < seq.seqlen_k ? reinterpret_cast<const uint16_t*>(rows.row(j)) : nullptr;
    };
    for (int64_t j = j0; j < j0 + kBk; ++j) {
      prefetch_ahead(krows, j, seq.seqlen_k, p.headdim * 2);
      prefetch_ahead(vrows, j, seq.seqlen_k, p.headdim_v * 2);
      copy_row_pairs(pk.k + j * ws.dpairs, key_row(krows, j), p.headdim, ws.dpairs);
      copy_row_pairs(pk.v + j * ws.dvpairs, key_row(vrows, j), p.headdim_v, ws.dvpairs);
      std::memset(pk.dk + j * ws.ldd, 0, sizeof(float) * ws.dpad);
      std::memset(pk.dv + j * ws.lddv, 0, sizeof(float) * ws.dvpad);
    }
    pack_pairs_across_rows(pk.k_by_key + j0 / 2 * ws.ldd, ws.ldd, kBk, p.headdim, ws.dpad,
                           [&](int64_t jj) { return key_row(krows, j0 + jj); });
    // dQ += dS K multiplies the masked keys' K by dS = 0: their NaN or infinity must not be in the pack.
    if (flag_nonfinite_keys(p, krows, seq.seqlen_k, j0, kBk, pk.k_flags + j0))
      zero_nonfinite(pk.k_by_key + j0 / 2 * ws.ldd, FLARE_DTYPE_BF16, kBk * ws.ldd);  // kBk / 2 rows of ldd words
  }

  // Query tile qt of head h: Q and dO as pair rows along the head dims and along queries, D and lse.
  static void pack_queries(const Problem& p, const Sequence& seq, int64_t h, int64_t qt, const Scratch& ws,
                           int tid) {
    const auto& pk = *ws.threads[tid].pack;
    const RowPtr qrows = query_rows(p, p.q, seq, h), dorows = query_rows(p, p.dout, seq, h),
                 orows = query_rows(p, p.out, seq, h);
    const int64_t i0 = qt * kBq;
    const auto rows_of = [&](const RowPtr& rows) {
      return [&, rows](int64_t ii) {
        const int64_t i = i0 + ii;
        return i < seq.seqlen_q ? reinterpret_cast<const uint16_t*>(rows.row(i)) : nullptr;
      };
    };
    const int64_t d = p.headdim, dv = p.headdim_v;
    pack_pairs_along_rows(pk.q_by_d + qt * ws.dpairs * ws.ldt, ws.ldt, kBq, d, ws.dpairs, rows_of(qrows));
    pack_pairs_along_rows(pk.do_by_dv + qt * ws.dvpairs * ws.ldt, ws.ldt, kBq, dv, ws.dvpairs, rows_of(dorows));
    pack_pairs_across_rows(pk.q_by_query + i0 / 2 * ws.ldd, ws.ldd, kBq, d, ws.dpad, rows_of(qrows));
    pack_pairs_across_rows(pk.do_by_query + i0 / 2 * ws.lddv, ws.lddv, kBq, dv, ws.dvpad, rows_of(dorows));
    bf16_delta_and_lse(p, seq, dorows, orows, lse_row(p, seq, h), i0, kBq, pk.delta, pk.lse);
  }

  // Zeroes this thread's dQ accumulator before a query head's key blocks.
  static void clear_dq(const Sequence&, const Scratch& ws, int tid) {
    std::memset(ws.threads[tid].dq, 0, sizeof(float) * ws.nq * ws.ldd);
  }

  // Key block kb against query tile qt: accumulates dK/dV of the block and this thread's dQ of the tile.
  static void tile(const Problem& p, const Sequence& seq, int64_t h, int64_t kb, int64_t qt, const Scratch& ws,
                   int tid) {
    const auto& t = ws.threads[tid];
    const auto& pk = *t.pack;
    const int64_t i0 = qt * kBq, j0 = kb * kBk;

    dot_gemm<false>(kBk, kBq, ws.dpairs, pk.k + j0 * ws.dpairs, ws.dpairs, pk.q_by_d + qt * ws.dpairs * ws.ldt,
                    ws.ldt, t.s, kBq);  // Sᵀ = K Qᵀ
    dot_gemm<false>(kBk, kBq, ws.dvpairs, pk.v + j0 * ws.dvpairs, ws.dvpairs,
                    pk.do_by_dv + qt * ws.dvpairs * ws.ldt, ws.ldt, t.dp, kBq);  // dPᵀ = V dOᵀ
    const bool dropping = p.dropout_p > 0.0f;
    if (dropping) dropout_keys_major(dropout_draw(p), dropout_stream(p, seq, h), i0, kBq, j0, kBk, t.zt, kBq);
    bf16_backward_elementwise(p, seq, h, i0, j0, kBk, kBq, pk.lse + i0, pk.delta + i0, t.s, t.dp, t.tanh, t.p,
                              t.ds, dropping ? t.zt : nullptr);
    pack_pairs_across_rows(t.ds_pairs, kBq, kBk, kBq, kBq, [&](int64_t r) { return t.ds + r * kBq; });

    const auto words = [](const uint16_t* x) { return reinterpret_cast<const uint32_t*>(x); };
    dot_gemm<true>(kBk, ws.dvpad, kBq / 2, words(t.p), kBq / 2, pk.do_by_query + i0 / 2 * ws.lddv, ws.lddv,
                   pk.dv + j0 * ws.lddv, ws.lddv);  // dV += Pᵀ dO
    dot_gemm<true>(kBk, ws.dpad, kBq / 2, words(t.ds), kBq / 2, pk.q_by_query + i0 / 2 * ws.ldd, ws.ldd,
                   pk.dk + j0 * ws.ldd, ws.ldd);  // dK += dSᵀ Q
    dot_gemm<true, true>(kBq, ws.dpad, kBk / 2, t.ds_pairs, kBq, pk.k_by_key + j0 / 2 * ws.ldd, ws.ldd,
                         t.dq + i0 * ws.ldd, ws.ldd);  // dQ += dS K
    // The non-finite K values of flagged keys, for the queries that see them (dSᵀ in fp32 is in t.dp).
    float* dq = t.dq + i0 * ws.ldd;
    add_seen_nonfinite<float>(
        p, seq, h, p.k, p.headdim, pk.k_flags + j0, j0, kBk, i0, smin(kBq, seq.seqlen_q - i0),
        [&](int64_t r, int64_t jj) { return t.dp[jj * kBq + r]; },
        [&](int64_t r, int64_t c, float x) { dq[r * ws.ldd + c] += x; });
  }

  // dq row i = scale * (this thread's dQ, or with Shared the sum of the team's buffers in thread order).
  template <bool Shared>
  static void write_dq(const Problem& p, const RowPtr& dqrows, int64_t i, const Scratch& ws, int tid, int nt) {
    float* acc = ws.threads[Shared ? 0 : tid].dq + i * ws.ldd;
    if constexpr (Shared)
      for (int other = 1; other < nt; ++other) {
        const float* src = ws.threads[other].dq + i * ws.ldd;
        for (int64_t c = 0; c < ws.dpad; ++c) acc[c] += src[c];
      }
    store_row<float>(acc, static_cast<float>(p.score.scale), dqrows.row(i), p.dtype, p.headdim);
  }

  // dk/dv row j (dK carries the scale); keys past seqused_k took no part: their gradients are 0.
  static void write_dkdv(const Problem& p, const Sequence& seq, const RowPtr& dkrows, const RowPtr& dvrows,
                         int64_t j, const Scratch& ws, int tid) {
    static constexpr float kZeros[kMaxHeaddim] = {};  // wide enough for headdim and headdim_v (cpu_backend.hpp)
    const auto& pk = *ws.threads[tid].pack;
    const bool used = j < seq.seqlen_k;
    store_row<float>(used ? pk.dk + j * ws.ldd : kZeros, static_cast<float>(p.score.scale), dkrows.row(j), p.dtype,
                     p.headdim);
    store_row<float>(used ? pk.dv + j * ws.lddv : kZeros, 1.0f, dvrows.row(j), p.dtype, p.headdim_v);
  }
};

}  // namespace flare::cpu::FLARE_ISA

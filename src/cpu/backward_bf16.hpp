// backward_bf16.hpp — the bf16 backward pass in the keys-major ("transposed") domain: one tile loop over a
// product policy, AmxProduct (product_amx.hpp, tile units) or DotProduct (product_dot.hpp, vdpbf16ps).
//
// Same algorithm and driver as backward.hpp (run_backward). Working with Sᵀ (keys as rows) makes the A
// operands of dV and dK, Pᵀ and dSᵀ, plain bf16 rows straight out of the elementwise step. Per (key block,
// query tile):
//   Sᵀ = K Qᵀ, dPᵀ = V dOᵀ  ->  Pᵀ = exp(scale·Sᵀ - lse), dSᵀ = Pᵀ ∘ (dPᵀ - D) (∘ (1 - tanh²) under softcap)
//   in fp32, rounded to bf16 (bf16_backward_elementwise)  ->  dV += Pᵀ dO, dK += dSᵀ Q, dQ += dS K
//   ->  the seen keys' non-finite K, times dS, into dQ.
// The product decides how K, V, Q and dO are packed and how dQ is laid out (Product::BackwardDims::dq_at).
// dK and dQ carry the softmax scale once, when written. P and dS are rounded to bf16 for the products, as GPU
// FlashAttention does; every accumulator is fp32.
#pragma once

#include "cpu/backward.hpp"
#include "cpu/bf16_rows.hpp"

namespace flare::cpu::FLARE_ISA {

template <class Product>
struct Bf16Backward {
  using Word = typename Product::Word;
  static constexpr int64_t kBq = Bf16Tiles::kBackwardBq, kBk = Bf16Tiles::kBackwardBk;
  static constexpr int64_t kKeyBlocksPerStep = Product::kKeyBlocksPerStep;
  static int64_t key_blocks_for(const Problem& p) {
    if constexpr (requires { Product::key_blocks_for(p); }) {
      return Product::key_blocks_for(p);
    } else {
      return kKeyBlocksPerStep;
    }
  }

  struct Scratch {
    typename Product::BackwardDims dims;
    struct Pack {
      Word *k, *v, *k_for_dq;  // per group: K and V rows, K as the dQ product's operand (dims' sizes)
      float *dk, *dv;          // dK (nk rows, dims.dk_ld() apart), dV (dims.dv_ld() apart)
      Word *q_by_d, *do_by_dv;        // per head: Q and dO packed along the head dims (Sᵀ, dPᵀ)
      Word *q_by_query, *do_by_query;  // and along queries (dK, dV)
      float *delta, *lse;  // D = rowsum(dO * O), lse (+inf: no visible key, or padding)
      uint8_t* k_flags;    // per key: its K row holds a NaN or infinity (zeroed in k_for_dq; unseen_values.hpp)
    };
    struct PerThread {
      Pack* pack;
      float* dq;             // dQ accumulator of the whole sequence (element (i, c) at dims.dq_at(i, c))
      float *s, *dp, *tanh;  // keys x queries tiles: Sᵀ then Pᵀ, dPᵀ then dSᵀ, softcap's tanh
      uint16_t *p, *ds;      // Pᵀ and dSᵀ in bf16
      Word* ds_for_dq;       // dSᵀ as the dQ product's operand
      float* zt;             // dropout's keep factors of the tile, keys x queries
    };
    PerThread* threads = nullptr;

    // Carves this problem's scratch for nt threads out of a (see groups.hpp's scratch_bytes).
    void layout(Arena& a, const Problem& pr, int nt) {
      const Lengths most = longest_sequence(pr);
      const int64_t nk = round_up(most.keys, kBk), nq = round_up(most.queries, kBq);
      dims = Product::backward_dims(pr, nq, nk);
      const int packs = use_private_groups(pr, nt) ? nt : 1;
      Pack* pack = a.take<Pack>(packs);
      for (int i = 0; i < packs; ++i) {
        Pack pk{a.take<Word>(dims.k_rows()),     a.take<Word>(dims.v_rows()),      a.take<Word>(dims.k_for_dq()),
                a.take<float>(nk * dims.dk_ld()), a.take<float>(nk * dims.dv_ld()), a.take<Word>(dims.q_by_d()),
                a.take<Word>(dims.do_by_dv()),   a.take<Word>(dims.q_by_query()),  a.take<Word>(dims.do_by_query()),
                a.take<float>(nq),               a.take<float>(nq),                a.take<uint8_t>(nk)};
        if (pack) pack[i] = pk;
      }
      threads = a.take<PerThread>(nt);
      for (int t = 0; t < nt; ++t) {
        const int64_t tile = kBk * kBq;
        PerThread pt{pack ? &pack[t < packs ? t : 0] : nullptr,
                     a.take<float>(dims.dq_size()),
                     a.take<float>(tile),
                     a.take<float>(tile),
                     a.take<float>(tile),
                     a.take<uint16_t>(tile),
                     a.take<uint16_t>(tile),
                     a.take<Word>(dims.ds_for_dq()),
                     a.take<float>(tile)};
        if (threads) threads[t] = pt;
      }
    }
  };

  static void thread_begin() { Product::thread_begin(); }
  static void thread_end() { Product::thread_end(); }

  // Key block kb: packs K and V (Product::pack_keys), flags the keys whose K holds a NaN or infinity and has
  // the product zero those values in the dQ product's operand, clears the block's dK/dV.
  static void pack_keys(const Problem& p, const Sequence& seq, int64_t hk, int64_t kb, const Scratch& ws, int tid) {
    const auto& pk = *ws.threads[tid].pack;
    const RowPtr krows = key_rows(p, p.k, seq, hk), vrows = key_rows(p, p.v, seq, hk);
    const int64_t j0 = kb * kBk;
    Product::pack_keys(ws.dims, p, krows, vrows, seq.seqlen_k, j0, pk.k, pk.v, pk.k_for_dq);
    if (flag_nonfinite_keys(p, krows, seq.seqlen_k, j0, kBk, pk.k_flags + j0))
      Product::zero_nonfinite_keys(ws.dims, pk.k_for_dq, j0);
    std::memset(pk.dk + j0 * ws.dims.dk_ld(), 0, sizeof(float) * kBk * ws.dims.dk_ld());
    std::memset(pk.dv + j0 * ws.dims.dv_ld(), 0, sizeof(float) * kBk * ws.dims.dv_ld());
  }

  // Query tile qt of head h: Q and dO in the product's layouts (Product::pack_queries), D and lse.
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
    Product::pack_queries(ws.dims, p, i0, rows_of(qrows), rows_of(dorows), pk.q_by_d, pk.do_by_dv, pk.q_by_query,
                          pk.do_by_query);
    bf16_delta_and_lse(p, seq, dorows, orows, lse_row(p, seq, h), i0, kBq, pk.delta, pk.lse);
  }

  // Zeroes this thread's dQ accumulator before a query head's key blocks.
  static void clear_dq(const Sequence&, const Scratch& ws, int tid) {
    std::memset(ws.threads[tid].dq, 0, sizeof(float) * ws.dims.dq_size());
  }

  // Key block kb against query tile qt: accumulates dK/dV of the block and this thread's dQ of the tile.
  // `ahead`: the input rows of the query tile packed next, requested a part between products.
  static void tile(const Problem& p, const Sequence& seq, int64_t h, int64_t kb, int64_t qt, const Scratch& ws,
                   int tid, const RowsAhead& ahead) {
    const auto& t = ws.threads[tid];
    const auto& pk = *t.pack;
    const auto& dm = ws.dims;
    const int64_t i0 = qt * kBq, j0 = kb * kBk;

    Product::scores_t(dm, pk.k, pk.q_by_d, j0, i0, t.s);    // Sᵀ = K Qᵀ
    ahead.request_part(0, 4);
    Product::dp_t(dm, pk.v, pk.do_by_dv, j0, i0, t.dp);     // dPᵀ = V dOᵀ
    ahead.request_part(1, 4);
    const bool dropping = p.dropout_p > 0.0f;
    if (dropping) dropout_keys_major(dropout_draw(p), dropout_stream(p, seq, h), i0, kBq, j0, kBk, t.zt, kBq);
    bf16_backward_elementwise(p, seq, h, i0, j0, kBk, kBq, pk.lse + i0, pk.delta + i0, t.s, t.dp, t.tanh, t.p,
                              t.ds, dropping ? t.zt : nullptr);  // Pᵀ, dSᵀ
    Product::pack_ds(dm, t.ds, t.ds_for_dq);

    Product::add_dv(dm, t.p, pk.do_by_query, i0, pk.dv + j0 * dm.dv_ld());   // dV += Pᵀ dO
    ahead.request_part(2, 4);
    Product::add_dk(dm, t.ds, pk.q_by_query, i0, pk.dk + j0 * dm.dk_ld());   // dK += dSᵀ Q
    ahead.request_part(3, 4);
    Product::add_dq(dm, pk.k_for_dq, t.ds_for_dq, j0, i0, t.dq);             // dQ += dS K
    // The non-finite K values of flagged keys, for the queries that see them (dSᵀ in fp32 is in t.dp).
    add_seen_nonfinite<float>(
        p, seq, h, p.k, p.headdim, pk.k_flags + j0, j0, kBk, i0, smin(kBq, seq.seqlen_q - i0),
        [&](int64_t r, int64_t jj) { return t.dp[jj * kBq + r]; },
        [&](int64_t r, int64_t c, float x) { t.dq[dm.dq_at(i0 + r, c)] += x; });
  }

  // dq row i = scale * (this thread's dQ, or with Shared the sum of the team's buffers in thread order).
  template <bool Shared>
  static void write_dq(const Problem& p, const RowPtr& dqrows, int64_t i, const Scratch& ws, int tid, int nt) {
    float row[kMaxHeaddim];  // headdim (cpu_backend.hpp's bound)
    const float* first = ws.threads[Shared ? 0 : tid].dq;
    for (int64_t c = 0; c < p.headdim; ++c) row[c] = first[ws.dims.dq_at(i, c)];
    if constexpr (Shared)
      for (int other = 1; other < nt; ++other)
        for (int64_t c = 0; c < p.headdim; ++c) row[c] += ws.threads[other].dq[ws.dims.dq_at(i, c)];
    store_row<float>(row, static_cast<float>(p.score.scale), dqrows.row(i), p.dtype, p.headdim);
  }

  // dk/dv row j (dK carries the scale); keys past seqused_k took no part: their gradients are 0.
  static void write_dkdv(const Problem& p, const Sequence& seq, const RowPtr& dkrows, const RowPtr& dvrows,
                         int64_t j, const Scratch& ws, int tid) {
    static constexpr float kZeros[kMaxHeaddim] = {};  // wide enough for headdim and headdim_v (cpu_backend.hpp)
    const auto& pk = *ws.threads[tid].pack;
    const bool used = j < seq.seqlen_k;
    store_row<float>(used ? pk.dk + j * ws.dims.dk_ld() : kZeros, static_cast<float>(p.score.scale), dkrows.row(j),
                     p.dtype, p.headdim);
    store_row<float>(used ? pk.dv + j * ws.dims.dv_ld() : kZeros, 1.0f, dvrows.row(j), p.dtype, p.headdim_v);
  }
};

}  // namespace flare::cpu::FLARE_ISA

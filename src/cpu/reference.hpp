// reference.hpp — the naive fp64 attention reference that the tests (and tools) check the kernels against.
//
// Written independently of the kernels in src/cpu: it materialises the scores of one query row at a time,
// loops in the most direct order and computes in fp64. It shares no code with the kernels (no mask or
// softcap policy objects), so a misreading of the semantics in one place does not hide in both.
//
// One call handles one sequence; a dense batch or a varlen batch is a list of sequences, each with its own
// lengths. Every array is contiguous in a canonical layout:
//   q   [seqlen_q][nheads][headdim]        k [seqlen_k][nheads_k][headdim]   v [seqlen_k][nheads_k][headdim_v]
//   out [seqlen_q][nheads][headdim_v]      lse [nheads][seqlen_q]            (natural log)
// Semantics are FlashAttention's, as written in include/flare/flare.h:
//   score(i, j) = scale * q_i·k_j;  softcap > 0: score = softcap * tanh(score / softcap);
//   ALiBi:       score += -slope_h * |i + seqlen_k - seqlen_q - j|;
//   mask:        key j visible to query i iff  i + sk - sq - left <= j <= i + sk - sq + right
//                (a side of -1 is unbounded; causal sets right = 0);
//   GQA:         query head h reads kv head h / (nheads / nheads_k);
//   sinks:       exp(sink_h) joins every row's softmax denominator (no value): lse = log(sum_j exp(score_j)
//                + exp(sink_h)), P_j = exp(score_j - lse);
//   dropout:     out = sum_j P_ij z_ij v_j with z_ij = 1 / (1 - p) where kept, 0 where dropped (lse undropped);
//   a query row with no visible key gets out = 0 and lse = -inf (sink_h with sinks).
#pragma once

#include <cstdint>
#include <vector>

namespace flare::reference {

struct Dims {
  int64_t nheads = 1;
  int64_t nheads_k = 1;
  int64_t headdim = 1;
  int64_t headdim_v = 1;
};

struct Options {
  double softmax_scale = 0.0;  // 0 = 1 / sqrt(headdim)
  double softcap = 0.0;        // 0 = off
  bool causal = false;         // folds into window_right = 0
  int64_t window_left = -1;    // -1 = unbounded
  int64_t window_right = -1;   // -1 = unbounded
  std::vector<double> alibi_slopes;  // this sequence's slope per query head (nheads); empty = no ALiBi
  std::vector<double> sinks;         // learnable sink logit per query head (nheads); empty = none
  // Dropout (flare.h's contract): P_ij of query head h kept with probability 1 - dropout_p and scaled by
  // 1 / (1 - dropout_p), by the Philox mask of (seed, offset, sequence, h, i, j); 0 = off.
  double dropout_p = 0.0;
  uint64_t dropout_seed = 0, dropout_offset = 0;
  int64_t sequence = 0;  // this sequence's index b in its call
};

// Whether dropout keeps (h, i, j) of this sequence (call with dims.nheads heads): flare.h's Philox mapping.
bool dropout_keeps(const Options& opts, int64_t nheads, int64_t h, int64_t i, int64_t j);

// Models a computation that keeps its intermediates in a low-precision dtype ("same-dtype naive"): when
// set, it rounds the probabilities P (after normalisation) and the output in the forward; in the backward
// it rounds where FlashAttention does, on the operands of its low-precision products: P (times dropout's
// factor) where it meets dO in dV, dS (after the softcap factor) where it meets K and Q, and the gradients.
// dP = dO Vᵀ and the P inside dS = P (dP - D) stay unrounded, as they stay in fp32 accumulators there.
// The kv-cache pass also rounds rotated q and rotated k_new (they are stored in that dtype).
// nullptr = exact fp64 throughout.
using RoundFn = double (*)(double);

struct Sequence {
  int64_t seqlen_q = 0;
  int64_t seqlen_k = 0;
  std::vector<double> q, k, v;
};

struct ForwardResult {
  std::vector<double> out;  // [seqlen_q][nheads][headdim_v]
  std::vector<double> lse;  // [nheads][seqlen_q]
};

struct Gradients {
  std::vector<double> dq;  // like q
  std::vector<double> dk;  // like k, summed over the query heads of a group
  std::vector<double> dv;  // like v, likewise
  std::vector<double> dsinks;  // per query head (nheads) when Options::sinks is set, else empty
};

// Whether query i sees key j in a sequence of these lengths (the mask only; ALiBi and softcap aside).
bool key_visible(const Options& opts, int64_t i, int64_t j, int64_t seqlen_q, int64_t seqlen_k);

// Where a model of scores computed in a dtype (forward's round_scores) applies the softmax scale: to q·k
// once it is summed (FlashAttention's S = QKᵀ, the scale applied in the exponent), or to q before the sum
// (a pass that stores scaled queries). The two sum differently rounded partial sums.
enum class ScaleOrder { kAfterProduct, kFoldedIntoQ };

// round_scores (forward only) also rounds every operation that forms a score, for checks where large
// scores make the output sensitive to their rounding: a model of scores computed in that dtype. q·k is
// summed in key-dimension order by fused multiply-adds (each partial sum rounded, the products exact), the
// scale applied where scale_order says (scale * q rounded; scale times the sum exact, as in an exponent
// formed by a fused multiply-add), then softcap and ALiBi, each operation rounded.
ForwardResult forward(const Dims& dims, const Options& opts, const Sequence& seq, RoundFn round = nullptr,
                      RoundFn round_scores = nullptr, ScaleOrder scale_order = ScaleOrder::kAfterProduct);

// Exact gradients of sum(out * dout) with respect to q, k and v; dout is [seqlen_q][nheads][headdim_v].
// given_lse ([nheads][seqlen_q]), when set, replaces the exact lse in P = exp(score - lse), as a backward
// pass handed a stored (e.g. fp32-rounded) lse computes it. given_out (like out), when set, replaces the
// forward's out in D = dout · out, as a backward pass handed a stored (e.g. bf16-rounded) out computes it.
// magnitudes, when set, receives per entry of dq and dk the sum of the magnitudes that cancel in it: each
// dS = P (dP - D) taken as P (sum_c |dout_c v_c| z + sum_c |dout_c out_c|) (times 1 + t^2 through softcap's
// 1 - t^2), q and k as |q| and |k|. Forming dP and D in a dtype errs by about its unit roundoff times these,
// which is all of the result where dS nearly vanishes (a row that sees one key); dv and dsinks stay empty.
Gradients backward(const Dims& dims, const Options& opts, const Sequence& seq, const std::vector<double>& dout,
                   RoundFn round = nullptr, const std::vector<double>* given_lse = nullptr,
                   const std::vector<double>* given_out = nullptr, Gradients* magnitudes = nullptr);

// ---- KV-cache attention (flash_attn_with_kvcache semantics, see flare_kvcache_params in flare.h) ----

struct Rotary {
  int64_t rotary_dim = 0;    // 0 = no rotary; else even and <= headdim
  bool interleaved = false;  // rotate pairs (0,1),(2,3)... instead of halves (c, c + rotary_dim / 2)
  int64_t seqlen_ro = 0;     // rows of cos/sin
  std::vector<double> cos, sin;  // [seqlen_ro][rotary_dim / 2]
};

// Rotates x ([rows][heads][headdim]) in place; row r uses the cos/sin row first_position + r * position_step.
void apply_rotary(std::vector<double>& x, int64_t rows, int64_t heads, int64_t headdim, const Rotary& rotary,
                  int64_t first_position, int64_t position_step);

// One sequence's view of the cache: its logical key slots 0..capacity-1, whatever the physical storage
// (dense row, cache_batch_idx, or paged blocks) is.
struct KvCacheSequence {
  int64_t seqlen_q = 0;
  std::vector<double> q;                 // [seqlen_q][nheads][headdim]
  int64_t capacity = 0;                  // key slots of this sequence's cache
  std::vector<double> k_cache, v_cache;  // [capacity][nheads_k][headdim(_v)]; updated by the append
  int64_t cache_len = 0;                 // keys already in the cache (cache_seqlens[b])
  int64_t leftpad = 0;                   // the sequence's keys start at this slot (cache_leftpad[b])
  int64_t seqlen_new = 0;
  std::vector<double> k_new, v_new;      // [seqlen_new][nheads_k][headdim(_v)]; empty when seqlen_new = 0
};

// Appends k_new/v_new (k_new rotated) at slot cache_len, rotates q, then attends to the keys in slots
// [leftpad, cache_len + seqlen_new). Rotary positions are cache slots (FlashAttention's rule; leftpad does
// not shift them): k_new row t sits at position p + t with p = cache_len; query i uses row p + i when the
// mask is causal or windowed, else row p.
ForwardResult kvcache(const Dims& dims, const Options& opts, const Rotary& rotary, KvCacheSequence& seq,
                      RoundFn round = nullptr);

}  // namespace flare::reference

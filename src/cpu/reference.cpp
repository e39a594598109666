// reference.cpp — the naive fp64 attention reference (see reference.hpp for layouts and semantics).
//
// Deliberately plain: one query row at a time, every score materialised, fp64 everywhere. Speed is not a
// goal beyond keeping the tests affordable; obviousness is.
#include "cpu/reference.hpp"

#include "common/philox.hpp"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <stdexcept>
#include <string>

namespace flare::reference {
namespace {

constexpr double kNegInf = -std::numeric_limits<double>::infinity();

double apply_round(RoundFn round, double x) { return round ? round(x) : x; }

void require(bool ok, const char* what) {
  if (!ok) throw std::invalid_argument(std::string("flare::reference: ") + what);
}

void check_sequence(const Dims& dims, const Options& opts, const Sequence& seq) {
  require(dims.nheads > 0 && dims.nheads_k > 0 && dims.nheads % dims.nheads_k == 0,
          "nheads must be a positive multiple of nheads_k");
  require(dims.headdim > 0 && dims.headdim_v > 0, "head dims must be positive");
  require(seq.seqlen_q >= 0 && seq.seqlen_k >= 0, "sequence lengths must be >= 0");
  require(static_cast<int64_t>(seq.q.size()) == seq.seqlen_q * dims.nheads * dims.headdim, "q has the wrong size");
  require(static_cast<int64_t>(seq.k.size()) == seq.seqlen_k * dims.nheads_k * dims.headdim, "k has the wrong size");
  require(static_cast<int64_t>(seq.v.size()) == seq.seqlen_k * dims.nheads_k * dims.headdim_v,
          "v has the wrong size");
  require(opts.alibi_slopes.empty() || static_cast<int64_t>(opts.alibi_slopes.size()) == dims.nheads,
          "alibi_slopes must have nheads entries");
  require(opts.sinks.empty() || static_cast<int64_t>(opts.sinks.size()) == dims.nheads,
          "sinks must have nheads entries");
}

double resolved_scale(const Dims& dims, const Options& opts) {
  return opts.softmax_scale != 0.0 ? opts.softmax_scale : 1.0 / std::sqrt(static_cast<double>(dims.headdim));
}

// Scores of query row i of head h against every key: raw[j] is the raw scaled dot product (needed for
// the softcap derivative), score[j] the final score, -inf where masked. With rd set, every operation of
// the score is rounded by it, the scale applied where scale_order says (see reference.hpp's forward).
struct RowScores {
  std::vector<double> raw;
  std::vector<double> score;
};

void row_scores(const Dims& dims, const Options& opts, const Sequence& seq, int64_t h, int64_t i, RowScores& rs,
                RoundFn rd = nullptr, ScaleOrder scale_order = ScaleOrder::kAfterProduct) {
  const int64_t group = dims.nheads / dims.nheads_k;
  const int64_t hk = h / group;
  const double scale = resolved_scale(dims, opts);
  rs.raw.assign(seq.seqlen_k, 0.0);
  rs.score.assign(seq.seqlen_k, kNegInf);
  const double* qi = &seq.q[(i * dims.nheads + h) * dims.headdim];
  for (int64_t j = 0; j < seq.seqlen_k; ++j) {
    if (!key_visible(opts, i, j, seq.seqlen_q, seq.seqlen_k)) continue;
    const double* kj = &seq.k[(j * dims.nheads_k + hk) * dims.headdim];
    double s = 0.0;
    if (rd) {
      // A sequential sum of fused multiply-adds: each partial sum rounded, the products (of two values of
      // the dtype) exact in fp64.
      const bool folded = scale_order == ScaleOrder::kFoldedIntoQ;
      for (int64_t c = 0; c < dims.headdim; ++c) s = rd(s + (folded ? rd(scale * qi[c]) : qi[c]) * kj[c]);
      if (!folded) s *= scale;
    } else {
      double dot = 0.0;
      for (int64_t c = 0; c < dims.headdim; ++c) dot += qi[c] * kj[c];
      s = scale * dot;
    }
    rs.raw[j] = s;
    if (opts.softcap > 0.0) {
      s = apply_round(rd, opts.softcap * apply_round(rd, std::tanh(apply_round(rd, s / opts.softcap))));
    }
    if (!opts.alibi_slopes.empty()) {
      const int64_t distance = std::llabs(i + seq.seqlen_k - seq.seqlen_q - j);
      s = apply_round(rd, s - apply_round(rd, opts.alibi_slopes[h] * static_cast<double>(distance)));
    }
    rs.score[j] = s;
  }
}

// Log-sum-exp of a score row and an extra term `sink` (-inf: none); -inf when every entry is -inf.
double log_sum_exp(const std::vector<double>& s, double sink) {
  double m = sink;
  for (double x : s) m = std::max(m, x);
  if (m == kNegInf) return kNegInf;
  double sum = std::exp(sink - m);
  for (double x : s) sum += std::exp(x - m);
  return m + std::log(sum);
}

double sink_of(const Options& opts, int64_t h) { return opts.sinks.empty() ? kNegInf : opts.sinks[h]; }

// The dropout factor of (h, i, j): 1 without dropout; else 1 / (1 - p) where kept, 0 where dropped.
double dropout_factor(const Options& opts, int64_t nheads, int64_t h, int64_t i, int64_t j) {
  if (opts.dropout_p == 0.0) return 1.0;
  return dropout_keeps(opts, nheads, h, i, j) ? 1.0 / (1.0 - opts.dropout_p) : 0.0;
}

}  // namespace

bool dropout_keeps(const Options& opts, int64_t nheads, int64_t h, int64_t i, int64_t j) {
  // Written out from flare.h's statement of the mapping, apart from the kernels' vectorised draw.
  const uint32_t k0 = static_cast<uint32_t>(opts.dropout_seed);
  const uint32_t k1 = static_cast<uint32_t>(opts.dropout_seed >> 32) ^ static_cast<uint32_t>(opts.dropout_offset >> 32);
  const philox::Words counter{{static_cast<uint32_t>(j / 16), static_cast<uint32_t>(i),
                               static_cast<uint32_t>(opts.sequence * nheads + h),
                               static_cast<uint32_t>(opts.dropout_offset)}};
  const philox::Words words = philox::philox4x32(counter, k0, k1);
  const int64_t x = j % 16;  // byte x of the 16 output bytes, the words little-endian
  const uint32_t byte = (words.w[x / 4] >> (8 * (x % 4))) & 0xFFu;
  const double threshold = std::min(std::floor(opts.dropout_p * 256.0 + 0.5), 255.0);
  return static_cast<double>(byte) >= threshold;
}

bool key_visible(const Options& opts, int64_t i, int64_t j, int64_t seqlen_q, int64_t seqlen_k) {
  const int64_t diagonal = i + seqlen_k - seqlen_q;  // the key aligned with query i (bottom-right)
  const int64_t right = opts.causal ? 0 : opts.window_right;
  const int64_t left = opts.window_left;
  if (left >= 0 && j < diagonal - left) return false;
  if (right >= 0 && j > diagonal + right) return false;
  return true;
}

ForwardResult forward(const Dims& dims, const Options& opts, const Sequence& seq, RoundFn round,
                      RoundFn round_scores, ScaleOrder scale_order) {
  check_sequence(dims, opts, seq);
  const int64_t group = dims.nheads / dims.nheads_k;
  ForwardResult r;
  r.out.assign(seq.seqlen_q * dims.nheads * dims.headdim_v, 0.0);
  r.lse.assign(dims.nheads * seq.seqlen_q, kNegInf);
  RowScores rs;
  std::vector<double> p(seq.seqlen_k);
  for (int64_t h = 0; h < dims.nheads; ++h) {
    const int64_t hk = h / group;
    for (int64_t i = 0; i < seq.seqlen_q; ++i) {
      row_scores(dims, opts, seq, h, i, rs, round_scores, scale_order);
      const double lse = log_sum_exp(rs.score, sink_of(opts, h));
      r.lse[h * seq.seqlen_q + i] = lse;
      if (lse == kNegInf) continue;  // no visible key (nor sink): out stays 0
      for (int64_t j = 0; j < seq.seqlen_k; ++j)
        p[j] = apply_round(round, std::exp(rs.score[j] - lse) * dropout_factor(opts, dims.nheads, h, i, j));
      double* oi = &r.out[(i * dims.nheads + h) * dims.headdim_v];
      for (int64_t j = 0; j < seq.seqlen_k; ++j) {
        if (p[j] == 0.0) continue;
        const double* vj = &seq.v[(j * dims.nheads_k + hk) * dims.headdim_v];
        for (int64_t c = 0; c < dims.headdim_v; ++c) oi[c] += p[j] * vj[c];
      }
      for (int64_t c = 0; c < dims.headdim_v; ++c) oi[c] = apply_round(round, oi[c]);
    }
  }
  return r;
}

Gradients backward(const Dims& dims, const Options& opts, const Sequence& seq, const std::vector<double>& dout,
                   RoundFn round, const std::vector<double>* given_lse, const std::vector<double>* given_out,
                   Gradients* magnitudes) {
  check_sequence(dims, opts, seq);
  require(static_cast<int64_t>(dout.size()) == seq.seqlen_q * dims.nheads * dims.headdim_v,
          "dout has the wrong size");
  const int64_t group = dims.nheads / dims.nheads_k;
  const double scale = resolved_scale(dims, opts);
  const ForwardResult fwd = forward(dims, opts, seq, round);
  require(given_lse == nullptr || given_lse->size() == fwd.lse.size(), "given_lse has the wrong size");
  const std::vector<double>& lse_of_row = given_lse ? *given_lse : fwd.lse;
  require(given_out == nullptr || given_out->size() == fwd.out.size(), "given_out has the wrong size");
  const std::vector<double>& out = given_out ? *given_out : fwd.out;

  Gradients g;
  g.dq.assign(seq.q.size(), 0.0);
  g.dk.assign(seq.k.size(), 0.0);
  g.dv.assign(seq.v.size(), 0.0);
  if (!opts.sinks.empty()) g.dsinks.assign(dims.nheads, 0.0);
  if (magnitudes) *magnitudes = Gradients{g.dq, g.dk, {}, {}};
  RowScores rs;
  std::vector<double> p(seq.seqlen_k), dp(seq.seqlen_k), zs(seq.seqlen_k, 1.0), dp_magnitude(seq.seqlen_k);
  for (int64_t h = 0; h < dims.nheads; ++h) {
    const int64_t hk = h / group;
    for (int64_t i = 0; i < seq.seqlen_q; ++i) {
      const double lse = lse_of_row[h * seq.seqlen_q + i];
      if (lse == kNegInf) continue;  // no visible key: out = 0 does not depend on q, k or v
      row_scores(dims, opts, seq, h, i, rs);
      const double* qi = &seq.q[(i * dims.nheads + h) * dims.headdim];
      const double* doi = &dout[(i * dims.nheads + h) * dims.headdim_v];
      const double* oi = &out[(i * dims.nheads + h) * dims.headdim_v];
      // D_i = sum_j P_ij dP_ij = dout_i · out_i
      double d_row = 0.0, d_magnitude = 0.0;
      for (int64_t c = 0; c < dims.headdim_v; ++c) {
        d_row += doi[c] * oi[c];
        d_magnitude += std::fabs(doi[c] * oi[c]);
      }
      // The sink's share of the row, exp(sink - lse), shrinks out: d out / d sink = -P_sink out.
      if (!opts.sinks.empty()) g.dsinks[h] -= std::exp(opts.sinks[h] - lse) * d_row;
      for (int64_t j = 0; j < seq.seqlen_k; ++j) {
        p[j] = dp[j] = 0.0;
        if (rs.score[j] == kNegInf) continue;
        // p: the undropped probability (the softmax's Jacobian); dp: the gradient reaching it, through dropout's
        // factor z (out = sum_j p_j z_j v_j). Neither is rounded: only the products' operands are (RoundFn).
        const double z = dropout_factor(opts, dims.nheads, h, i, j);
        p[j] = std::exp(rs.score[j] - lse);
        const double* vj = &seq.v[(j * dims.nheads_k + hk) * dims.headdim_v];
        double acc = 0.0, acc_magnitude = 0.0;
        for (int64_t c = 0; c < dims.headdim_v; ++c) {
          acc += doi[c] * vj[c];
          acc_magnitude += std::fabs(doi[c] * vj[c]);
        }
        dp[j] = acc * z;
        dp_magnitude[j] = acc_magnitude * z;
        zs[j] = z;
      }
      double* dqi = &g.dq[(i * dims.nheads + h) * dims.headdim];
      for (int64_t j = 0; j < seq.seqlen_k; ++j) {
        if (rs.score[j] == kNegInf) continue;  // masked: P = 0 and no gradient
        // dS = P (dP - D) is the gradient with respect to the final score; through softcap the raw score's
        // gradient picks up d/dx [cap tanh(x / cap)] = 1 - tanh^2(x / cap). ALiBi is additive: factor 1.
        // What cancels in dS (magnitudes): each term of dP and of D, and 1 and t^2 in softcap's factor.
        double ds = p[j] * (dp[j] - d_row);
        double ds_magnitude = p[j] * (dp_magnitude[j] + d_magnitude);
        if (opts.softcap > 0.0) {
          const double t = std::tanh(rs.raw[j] / opts.softcap);
          ds *= 1.0 - t * t;
          ds_magnitude *= 1.0 + t * t;
        }
        ds = apply_round(round, ds);
        const double* kj = &seq.k[(j * dims.nheads_k + hk) * dims.headdim];
        double* dkj = &g.dk[(j * dims.nheads_k + hk) * dims.headdim];
        for (int64_t c = 0; c < dims.headdim; ++c) {
          dqi[c] += scale * ds * kj[c];
          dkj[c] += scale * ds * qi[c];
        }
        double* dvj = &g.dv[(j * dims.nheads_k + hk) * dims.headdim_v];
        const double pz = apply_round(round, p[j] * zs[j]);
        for (int64_t c = 0; c < dims.headdim_v; ++c) dvj[c] += pz * doi[c];
        if (magnitudes) {
          double* mqi = &magnitudes->dq[(i * dims.nheads + h) * dims.headdim];
          double* mkj = &magnitudes->dk[(j * dims.nheads_k + hk) * dims.headdim];
          for (int64_t c = 0; c < dims.headdim; ++c) {
            mqi[c] += scale * ds_magnitude * std::fabs(kj[c]);
            mkj[c] += scale * ds_magnitude * std::fabs(qi[c]);
          }
        }
      }
    }
  }
  if (round) {
    for (double& x : g.dq) x = round(x);
    for (double& x : g.dk) x = round(x);
    for (double& x : g.dv) x = round(x);
  }
  return g;
}

void apply_rotary(std::vector<double>& x, int64_t rows, int64_t heads, int64_t headdim, const Rotary& rotary,
                  int64_t first_position, int64_t position_step) {
  if (rotary.rotary_dim == 0) return;
  require(rotary.rotary_dim % 2 == 0 && rotary.rotary_dim <= headdim, "rotary_dim must be even and <= headdim");
  require(static_cast<int64_t>(x.size()) == rows * heads * headdim, "rotary input has the wrong size");
  const int64_t half = rotary.rotary_dim / 2;
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t pos = first_position + r * position_step;
    require(pos >= 0 && pos < rotary.seqlen_ro, "rotary position outside cos/sin");
    const double* cos_row = &rotary.cos[pos * half];
    const double* sin_row = &rotary.sin[pos * half];
    for (int64_t h = 0; h < heads; ++h) {
      double* xr = &x[(r * heads + h) * headdim];
      for (int64_t c = 0; c < half; ++c) {
        // The pair (a, b) turns by the angle of cos/sin entry c: (a cos - b sin, b cos + a sin).
        const int64_t ia = rotary.interleaved ? 2 * c : c;
        const int64_t ib = rotary.interleaved ? 2 * c + 1 : c + half;
        const double a = xr[ia], b = xr[ib];
        xr[ia] = a * cos_row[c] - b * sin_row[c];
        xr[ib] = b * cos_row[c] + a * sin_row[c];
      }
    }
  }
}

ForwardResult kvcache(const Dims& dims, const Options& opts, const Rotary& rotary, KvCacheSequence& seq,
                      RoundFn round) {
  require(seq.leftpad >= 0 && seq.leftpad <= seq.cache_len, "leftpad must be in [0, cache_len]");
  require(seq.cache_len + seq.seqlen_new <= seq.capacity, "the cache has no room for k_new");
  require(static_cast<int64_t>(seq.k_cache.size()) == seq.capacity * dims.nheads_k * dims.headdim &&
              static_cast<int64_t>(seq.v_cache.size()) == seq.capacity * dims.nheads_k * dims.headdim_v,
          "k_cache/v_cache have the wrong size");
  require(static_cast<int64_t>(seq.k_new.size()) == seq.seqlen_new * dims.nheads_k * dims.headdim &&
              static_cast<int64_t>(seq.v_new.size()) == seq.seqlen_new * dims.nheads_k * dims.headdim_v,
          "k_new/v_new have the wrong size");
  const int64_t first_new = seq.cache_len;  // rotary position (cache slot) of the first new key
  const bool windowed = opts.causal || opts.window_left >= 0 || opts.window_right >= 0;

  std::vector<double> q = seq.q;
  std::vector<double> k_new = seq.k_new;
  apply_rotary(q, seq.seqlen_q, dims.nheads, dims.headdim, rotary, first_new, windowed ? 1 : 0);
  apply_rotary(k_new, seq.seqlen_new, dims.nheads_k, dims.headdim, rotary, first_new, 1);
  if (round && rotary.rotary_dim > 0) {
    for (double& x : q) x = round(x);
    for (double& x : k_new) x = round(x);
  }

  const int64_t krow = dims.nheads_k * dims.headdim, vrow = dims.nheads_k * dims.headdim_v;
  for (int64_t t = 0; t < seq.seqlen_new; ++t) {
    for (int64_t c = 0; c < krow; ++c) seq.k_cache[(seq.cache_len + t) * krow + c] = k_new[t * krow + c];
    for (int64_t c = 0; c < vrow; ++c) seq.v_cache[(seq.cache_len + t) * vrow + c] = seq.v_new[t * vrow + c];
  }

  Sequence s;
  s.seqlen_q = seq.seqlen_q;
  s.seqlen_k = seq.cache_len + seq.seqlen_new - seq.leftpad;
  s.q = std::move(q);
  s.k.assign(seq.k_cache.begin() + seq.leftpad * krow, seq.k_cache.begin() + (seq.leftpad + s.seqlen_k) * krow);
  s.v.assign(seq.v_cache.begin() + seq.leftpad * vrow, seq.v_cache.begin() + (seq.leftpad + s.seqlen_k) * vrow);
  return forward(dims, opts, s, round);
}

}  // namespace flare::reference

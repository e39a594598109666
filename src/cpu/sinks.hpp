// sinks.hpp — the gradient of learnable sinks (flare.h) in the backward pass.
//
// A sink s_h joins the softmax denominator of every row of head h, so P_sink = exp(s_h - lse) with the
// forward's lse (which counts it), and out = sum_j P_j v_j shrinks as the sink grows: d out / d s_h =
// -P_sink out. The gradient of sum(out * dout) is therefore
//   dsinks[h] = -sum over the rows of head h (every sequence) of exp(s_h - lse) * D,  D = rowsum(dout * out),
// the same D the kernels form for dS. The key-side gradients need nothing more: P = exp(S - lse) already
// carries the sink through the lse. O(rows x headdim_v) reads, accumulated in fp64 in a fixed order per head
// (bitwise reproducible for any thread count).
#pragma once

#include <cmath>

#include "cpu/sequences.hpp"

namespace flare::cpu::FLARE_ISA {

inline void sink_gradient(const Problem& p, int nt) {
  if (p.dsinks == nullptr) return;
  constexpr int64_t kChunk = 64;  // row elements converted at a time
#pragma omp parallel for num_threads(nt) schedule(static)
  for (int64_t h = 0; h < p.nheads; ++h) {
    const float sink = p.sinks[h];
    double acc = 0.0;
    for (int64_t b = 0; sink != -__builtin_inff() && b < p.batch; ++b) {
      const Sequence seq = sequence_of(p, b);
      const RowPtr orows = query_rows(p, p.out, seq, h), dorows = query_rows(p, p.dout, seq, h);
      const float* lse = lse_row(p, seq, h);
      for (int64_t i = 0; i < seq.seqlen_q; ++i) {
        double o[kChunk], dout[kChunk], d = 0.0;
        const int64_t es = dtype_size(p.dtype);
        for (int64_t c0 = 0; c0 < p.headdim_v; c0 += kChunk) {
          const int64_t n = smin(kChunk, p.headdim_v - c0);
          load_row<double>(orows.row(i) + c0 * es, p.dtype, o, n, 1.0);
          load_row<double>(dorows.row(i) + c0 * es, p.dtype, dout, n, 1.0);
          for (int64_t c = 0; c < n; ++c) d += o[c] * dout[c];
        }
        acc -= std::exp(static_cast<double>(sink) - static_cast<double>(lse[i])) * d;
      }
    }
    p.dsinks[h] = static_cast<float>(acc);
  }
}

}  // namespace flare::cpu::FLARE_ISA

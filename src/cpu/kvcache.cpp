// kvcache.cpp — the KV-cache step before attention: append k_new/v_new into the cache in place (applying
// rotary to k_new) and rotate q into scratch. Runs after validation, so every index is in range.

#include <cstring>

#define FLARE_ISA kvcache_prep
#define FLARE_VEC_BYTES 16
#include "cpu/cpu_backend.hpp"
#include "cpu/sequences.hpp"
#include "cpu/team.hpp"

namespace flare::cpu {
namespace {

using namespace kvcache_prep;
using detail::Problem;

// Rotates x (headdim values) in place by rotary row `pos`: halves (i, i + rd/2) or interleaved pairs.
// Computed in fp64 so that every storage dtype, fp64 included, is rounded once.
void rotate(const Problem& p, double* x, int64_t pos) {
  const int64_t half = p.rotary_dim / 2;
  const int64_t es = dtype_size(p.dtype);
  double cos_row[kMaxHeaddim / 2], sin_row[kMaxHeaddim / 2];
  load_row<double>(static_cast<const char*>(p.rotary_cos) + pos * p.rotary_row_stride * es, p.dtype, cos_row,
                   half, 1.0);
  load_row<double>(static_cast<const char*>(p.rotary_sin) + pos * p.rotary_row_stride * es, p.dtype, sin_row,
                   half, 1.0);
  for (int64_t c = 0; c < half; ++c) {
    const int64_t a = p.rotary_interleaved ? 2 * c : c;
    const int64_t b = p.rotary_interleaved ? 2 * c + 1 : c + half;
    const double xa = x[a], xb = x[b];
    x[a] = xa * cos_row[c] - xb * sin_row[c];
    x[b] = xb * cos_row[c] + xa * sin_row[c];
  }
}

int64_t cached_len(const Problem& p, int64_t b) { return p.cache_seqlens ? p.cache_seqlens[b] : p.seqlen_cache; }

}  // namespace

size_t kvcache_extra_scratch(const Problem& p) {
  if (p.rotary_dim == 0) return 0;
  // The rotated q, (batch, seqlen_q, nheads, headdim) in q's dtype, + alignment slack. q may be a broadcast
  // (stride 0) view of far fewer elements, so the product is checked.
  size_t bytes = dtype_size(p.dtype);
  for (const int64_t n : {p.batch, p.seqlen_q, p.nheads, p.headdim})
    if (__builtin_mul_overflow(bytes, static_cast<size_t>(n), &bytes)) return SIZE_MAX;
  return bytes > SIZE_MAX - 64 ? SIZE_MAX : bytes + 64;
}

Problem kvcache_prepare(const Problem& p, char* scratch, int nt) {
  const int64_t es = dtype_size(p.dtype);
  // Append: new key i of sequence b goes to cache slot cache_len + i (logical row cache_len - leftpad + i).
  if (p.seqlen_new > 0) {
    on_team(nt, [&]() {
#pragma omp for collapse(2) schedule(static)
      for (int64_t b = 0; b < p.batch; ++b) {
        for (int64_t hk = 0; hk < p.nheads_k; ++hk) {
          const Sequence seq = sequence_of(p, b);
          const int64_t first = cached_len(p, b) - seq.leftpad;  // logical row of the first new key
          const RowPtr kc = key_rows(p, p.k, seq, hk), vc = key_rows(p, p.v, seq, hk);
          const char* kn = static_cast<const char*>(p.k_new.data) +
                              (b * p.k_new.batch_stride + hk * p.k_new.head_stride) * es;
          const char* vn = static_cast<const char*>(p.v_new.data) +
                              (b * p.v_new.batch_stride + hk * p.v_new.head_stride) * es;
          double row[kMaxHeaddim];
          for (int64_t i = 0; i < p.seqlen_new; ++i) {
            const char* ksrc = kn + i * p.k_new.row_stride * es;
            if (p.rotary_dim > 0) {
              load_row<double>(ksrc, p.dtype, row, p.headdim, 1.0);
              rotate(p, row, cached_len(p, b) + i);  // rotary positions are cache slots
              store_row<double>(row, 1.0, kc.row(first + i), p.dtype, p.headdim);
            } else {
              std::memcpy(kc.row(first + i), ksrc, p.headdim * es);
            }
            std::memcpy(vc.row(first + i), vn + i * p.v_new.row_stride * es, p.headdim_v * es);
          }
        }
      }
    });
  }
  if (p.rotary_dim == 0) return p;

  // Rotary q into scratch, laid out (batch, seqlen_q, nheads, headdim). Query i sits at cache slot
  // cache_len + i when causal or windowed, else every query at cache_len (FlashAttention's rule).
  Problem attend = p;
  char* q_rot = reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(scratch) + 63) / 64 * 64);
  attend.q = {q_rot, p.seqlen_q * p.nheads * p.headdim, p.nheads * p.headdim, p.headdim};
  const bool per_query = p.score.window_left >= 0 || p.score.window_right >= 0;
  on_team(nt, [&]() {
#pragma omp for collapse(2) schedule(static)
    for (int64_t b = 0; b < p.batch; ++b) {
      for (int64_t h = 0; h < p.nheads; ++h) {
        const Sequence seq = sequence_of(p, b);
        const int64_t first = cached_len(p, b);
        const RowPtr src = query_rows(p, p.q, seq, h), dst = query_rows(attend, attend.q, seq, h);
        double row[kMaxHeaddim];
        for (int64_t i = 0; i < p.seqlen_q; ++i) {
          load_row<double>(src.row(i), p.dtype, row, p.headdim, 1.0);
          rotate(p, row, first + (per_query ? i : 0));
          store_row<double>(row, 1.0, dst.row(i), p.dtype, p.headdim);
        }
      }
    }
  });
  return attend;
}

}  // namespace flare::cpu

// merge.cpp — flare_merge_states on the CPU: each (batch, token, head) row of the two parts is read once,
// converted to the compute type (fp32, fp64 for fp64), merged through merge_rows.hpp and stored. Memory
// bound; compiled for baseline x86-64 (no ISA dispatch), which the compiler vectorises well enough.
#define FLARE_ISA merge_portable
#define FLARE_VEC_BYTES 16
#include <omp.h>

#include <type_traits>

#include "cpu/cpu_backend.hpp"
#include "cpu/merge_rows.hpp"
#include "cpu/team.hpp"

namespace flare::cpu {
namespace {

using detail::MergeProblem;
using FLARE_ISA::dtype_size;

constexpr int64_t kChunk = 256;               // row elements converted at a time
constexpr double kElementsPerThread = 1 << 20;  // below this much work per thread, fewer threads

template <class T>
void merge_row(const MergeProblem& p, int64_t b, int64_t t, int64_t h) {
  const int64_t es = dtype_size(p.dtype);
  const auto at = [&](const detail::Operand& op) {
    return static_cast<char*>(op.data) + (b * op.batch_stride + t * op.row_stride + h * op.head_stride) * es;
  };
  const auto lse_at = [&](const detail::LseRows& l) { return l.data + b * l.batch_stride + h * l.head_stride + t; };
  const FLARE_ISA::MergeWeights<T> w = FLARE_ISA::merge_weights<T>(*lse_at(p.lse_a), *lse_at(p.lse_b));
  const char* a = at(p.out_a);
  const char* bb = at(p.out_b);
  char* o = at(p.out);
  T acc[kChunk], part[kChunk];
  for (int64_t c = 0; c < p.headdim; c += kChunk) {
    const int64_t n = p.headdim - c < kChunk ? p.headdim - c : kChunk;
    FLARE_ISA::load_row<T>(a + c * es, p.dtype, acc, n, T(1));
    FLARE_ISA::load_row<T>(bb + c * es, p.dtype, part, n, T(1));
    FLARE_ISA::merge_into<T>(acc, part, w.a, w.b, n);
    FLARE_ISA::store_row<T>(acc, T(1), o + c * es, p.dtype, n);
  }
  if (p.lse.data != nullptr) *lse_at(p.lse) = static_cast<float>(w.lse);
}

template <class T>
void merge_all(const MergeProblem& p, int nt) {
  const int64_t rows = p.batch * p.seqlen * p.nheads;
  on_team(nt, [&]() {
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t h = r % p.nheads;
      const int64_t t = (r / p.nheads) % p.seqlen;
      const int64_t b = r / (p.nheads * p.seqlen);
      merge_row<T>(p, b, t, h);
    }
  });
}

}  // namespace

flare_status merge_states(const MergeProblem& p) {
  int nt = p.num_threads;
  if (nt == 0) {
    const double elements = static_cast<double>(p.batch) * p.seqlen * p.nheads * (p.headdim + 1);
    const int most = omp_get_max_threads();
    nt = elements / kElementsPerThread < most ? static_cast<int>(elements / kElementsPerThread) : most;
    if (nt < 1) nt = 1;
  }
  // Both parts of a row are read before its output is stored, so out may be out_a or out_b itself.
  if (p.dtype == FLARE_DTYPE_F64) {
    merge_all<double>(p, nt);
  } else {
    merge_all<float>(p, nt);
  }
  return FLARE_OK;
}

}  // namespace flare::cpu

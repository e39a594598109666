// gmma_views.cuh — register views of warpgroup MMA (wgmma) accumulators: as a (rows, cols) matrix for the
// softmax, and as the A operand of the next wgmma (P·V with P in registers). Pure layout algebra, callable on
// the host: tests/cpp/test_sm90_layouts.cpp checks on the CPU that each view addresses the elements it claims.
#pragma once

#include "cuda/sm90/cute_config.hpp"  // first: options for the CuTe headers

#include <cute/tensor.hpp>

namespace flare::cuda::sm90 {

using namespace cute;

// A wgmma accumulator fragment (fp32, M=64 per warpgroup) has layout ((2, 2, N/8), MMA_M, MMA_N): per thread,
// columns (c, c + 1) of rows r and r + 8, for each of the N/8 column groups. As a (rows, cols) matrix that is
// ((2, MMA_M), (2, N/8, MMA_N)).
template <class L>
CUTE_HOST_DEVICE constexpr auto acc_rowcol_layout(L const& acc) {
  static_assert(rank(L{}) == 3 && rank(get<0>(L{})) == 3, "expects a wgmma accumulator layout ((2,2,V),M,N)");
  return make_layout(make_layout(get<0, 1>(acc), get<1>(acc)),
                     make_layout(get<0, 0>(acc), get<0, 2>(acc), get<2>(acc)));
}

template <class T>
CUTE_HOST_DEVICE auto acc_rowcol(T&& t) {
  return make_tensor(t.data(), acc_rowcol_layout(t.layout()));
}

// The accumulator of S = Q·Kᵀ reused, after conversion to 16 bits, as the register A operand of O += P·V: a
// k16 slice of A is two neighbouring n8 column groups of S, ((2, 2, N/8), M, 1) -> ((2, 2, 2), M, N/16).
template <class L>
CUTE_HOST_DEVICE constexpr auto acc_as_a_layout(L const& acc) {
  static_assert(decltype(size<0, 2>(L{}))::value % 2 == 0, "the accumulator's column groups must pair up");
  static_assert(decltype(size<2>(L{}))::value == 1, "expects one MMA along N (the whole key tile)");
  auto v = logical_divide(get<0>(acc), Shape<Underscore, Underscore, _2>{});  // ((2, 2, (2, N/16)), ...)
  return make_layout(make_layout(get<0>(v), get<1>(v), get<2, 0>(v)), get<1>(acc), get<2, 1>(v));
}

}  // namespace flare::cuda::sm90

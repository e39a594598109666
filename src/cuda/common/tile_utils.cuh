// tile_utils.cuh — CuTe building blocks that do not depend on the architecture's MMA or copy instructions,
// shared by the kernels of every arch (sm80/, sm90/): type conversion of register fragments, views of an
// operand's rows in global memory, reductions over the four threads that share an accumulator row, and the
// per-sequence bounds of one CTA. What is tied to an instruction family (mma.sync accumulator layouts,
// cp.async copies, ldmatrix-pipelined GEMMs) lives with its arch (src/cuda/sm80/tile_ops.cuh).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cute/tensor.hpp>
#include <cutlass/array.h>
#include <cutlass/numeric_conversion.h>
#include <cutlass/numeric_types.h>

#include "cuda/common/params.hpp"

namespace flare::cuda {

using namespace cute;

// ---- conversions ------------------------------------------------------------------------------------------
// Elementwise conversion of a register fragment (e.g. fp32 accumulators to half/bf16 operands).
template <class To, class Engine, class Layout>
__device__ __forceinline__ auto convert_fragment(Tensor<Engine, Layout> const& src) {
  using From = typename Engine::value_type;
  constexpr int N = decltype(size(src))::value;
  auto dst = make_tensor<To>(src.layout());
  cutlass::NumericArrayConverter<To, From, N> conv;
  *reinterpret_cast<cutlass::Array<To, N>*>(dst.data()) =
      conv(*reinterpret_cast<const cutlass::Array<From, N>*>(src.data()));
  return dst;
}

// ---- views -------------------------------------------------------------------------------------------------
// The (rows x kHeadDim) rows of one (sequence, head) of an operand, starting `offset` elements into it.
template <class Element, int kHeadDim>
__device__ __forceinline__ auto gmem_rows(Operand const& t, int64_t offset, int rows) {
  return make_tensor(make_gmem_ptr(static_cast<Element*>(t.data) + offset), make_shape(rows, Int<kHeadDim>{}),
                     make_stride(t.row_stride, _1{}));
}

// ---- reductions over the four threads that share an accumulator row (mma.sync and wgmma layouts alike) --
__device__ __forceinline__ float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffff, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffff, x, 2));
}
__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffff, x, 1);
  return x + __shfl_xor_sync(0xffffffff, x, 2);
}

// ---- one CTA's sequence ----------------------------------------------------------------------------------
// Where sequence b starts in q (k) and how long it is; the lse row and workspace row offsets.
struct Sequence {
  int64_t q_token0;  // first token of the sequence in the varlen token dimension (0 when dense)
  int64_t k_token0;
  int len_q;
  int len_k;         // keys attended: the sequence's keys, cut to seqused_k[b] when given
  int len_k_stored;  // keys the tensors hold for this sequence (dK/dV rows to write; zeros past len_k)

  __device__ __forceinline__ Sequence(AttnParams const& p, int b) {
    if (p.cu_seqlens_q != nullptr) {
      q_token0 = p.cu_seqlens_q[b];
      k_token0 = p.cu_seqlens_k[b];
      len_q = p.cu_seqlens_q[b + 1] - static_cast<int>(q_token0);
      len_k = p.cu_seqlens_k[b + 1] - static_cast<int>(k_token0);
    } else {
      q_token0 = 0;
      k_token0 = 0;
      len_q = p.seqlen_q;
      len_k = p.seqlen_k;
    }
    len_k_stored = len_k;
    if (p.seqused_k != nullptr) len_k = min(len_k, p.seqused_k[b]);
  }

  // Element offset of (b, token 0, head h) in an operand.
  __device__ __forceinline__ int64_t q_offset(Operand const& t, int b, int h) const {
    return b * t.batch_stride + q_token0 * t.row_stride + h * t.head_stride;
  }
  __device__ __forceinline__ int64_t k_offset(Operand const& t, int b, int h) const {
    return b * t.batch_stride + k_token0 * t.row_stride + h * t.head_stride;
  }
  __device__ __forceinline__ int64_t lse_offset(AttnParams const& p, int b, int h) const {
    return b * p.lse_batch_stride + h * p.lse_head_stride + q_token0;
  }
  // First workspace row of this sequence (see BwdParams).
  __device__ __forceinline__ int64_t q_row0(BwdParams const& p, int b) const {
    return p.cu_seqlens_q != nullptr ? q_token0 + int64_t{b} * kRowPad : int64_t{b} * p.seqlen_q_rounded;
  }
  __device__ __forceinline__ int64_t k_row0(BwdParams const& p, int b) const {
    return p.cu_seqlens_q != nullptr ? k_token0 + int64_t{b} * kRowPad : int64_t{b} * p.seqlen_k_rounded;
  }
};

}  // namespace flare::cuda

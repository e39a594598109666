// elements.cuh — the decode kernels' view of fp16 / bf16 storage: the element type of a flare_dtype and the
// conversions of 16-byte (8-element) and 8-byte (4-element) vectors to and from fp32 registers. Plain CUDA
// types (no CuTe): the decode units compile in seconds.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "flare/flare.h"

namespace flare::cuda::decode {

template <flare_dtype D>
struct ElementOf;
template <>
struct ElementOf<FLARE_DTYPE_F16> {
  using type = __half;
};
template <>
struct ElementOf<FLARE_DTYPE_BF16> {
  using type = __nv_bfloat16;
};

// Two packed elements (one 32-bit word) to fp32.
template <class E>
__device__ __forceinline__ float2 to_float2(uint32_t w) {
  if constexpr (std::is_same_v<E, __nv_bfloat16>) {
    return make_float2(__uint_as_float(w << 16), __uint_as_float(w & 0xffff0000u));
  } else {
    __half2 h;
    *reinterpret_cast<uint32_t*>(&h) = w;
    return __half22float2(h);
  }
}

template <class E>
__device__ __forceinline__ uint32_t from_float2(float a, float b) {
  uint32_t w;
  if constexpr (std::is_same_v<E, __nv_bfloat16>) {
    __nv_bfloat162 h = __floats2bfloat162_rn(a, b);
    w = *reinterpret_cast<uint32_t*>(&h);
  } else {
    __half2 h = __floats2half2_rn(a, b);
    w = *reinterpret_cast<uint32_t*>(&h);
  }
  return w;
}

template <class E>
__device__ __forceinline__ void to_float8(uint4 v, float (&f)[8]) {
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 x = to_float2<E>(w[i]);
    f[2 * i] = x.x;
    f[2 * i + 1] = x.y;
  }
}

template <class E>
__device__ __forceinline__ void to_float4(uint2 v, float (&f)[4]) {
  const float2 a = to_float2<E>(v.x), b = to_float2<E>(v.y);
  f[0] = a.x;
  f[1] = a.y;
  f[2] = b.x;
  f[3] = b.y;
}

template <class E>
__device__ __forceinline__ float to_float(E x) {
  if constexpr (std::is_same_v<E, __nv_bfloat16>) {
    return __bfloat162float(x);
  } else {
    return __half2float(x);
  }
}

template <class E>
__device__ __forceinline__ E from_float(float x) {
  if constexpr (std::is_same_v<E, __nv_bfloat16>) {
    return __float2bfloat16_rn(x);
  } else {
    return __float2half_rn(x);
  }
}

// ---- cp.async (sm_80+): 16 bytes global -> shared, zero-filled when src_bytes is 0 (commit and wait: CuTe's)
__device__ __forceinline__ void cp_async_16(void* smem, const void* gmem, int src_bytes) {
  const uint32_t s = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(gmem), "r"(src_bytes));
}

}  // namespace flare::cuda::decode

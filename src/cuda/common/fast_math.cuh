// fast_math.cuh — the approximate transcendental functions every CUDA kernel shares (the sm80 and sm90
// attention kernels through scores.cuh, the decode kernels directly): 2^x and tanh from the ex2 / rcp
// instructions, and the constants that move between natural and base-2 logarithms. No CuTe here.
#pragma once

namespace flare::cuda {

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// 2^x (ex2.approx: relative error ~2^-22, -inf -> 0).
__device__ __forceinline__ float exp2_approx(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// tanh from one ex2 and one reciprocal: tanh(u) = 1 - 2 / (e^{2u} + 1). Absolute error ~1e-7, saturating
// cleanly to ±1 (no call to the libdevice tanhf, whose register appetite spilled the kernels).
__device__ __forceinline__ float tanh_approx(float u) {
  float e, r;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(e) : "f"(u * (2.f * 1.4426950408889634f)));
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(e + 1.f));
  return 1.f - 2.f * r;
}

}  // namespace flare::cuda

// isa_amx.cpp — the CPU kernels for processors with AMX-BF16 (AVX-512 plus tile units); flags per file in
// src/CMakeLists.txt. bf16 forward runs on tiles; every other pass and dtype uses the AVX-512 FMA engine.
#define FLARE_ISA amx
#define FLARE_VEC_BYTES 64
#include "cpu/backward.hpp"
#include "cpu/forward_amx.hpp"
#include "cpu/isa_kernels.hpp"

namespace flare::cpu::amx {

size_t forward_scratch(const detail::Problem& p, int threads) {
  switch (p.dtype) {
    case FLARE_DTYPE_BF16: return forward_scratch_bytes<AmxForward>(p, threads);
    case FLARE_DTYPE_F64: return forward_scratch_bytes<FmaForward<double>>(p, threads);
    default: return forward_scratch_bytes<FmaForward<float>>(p, threads);
  }
}
void forward(const detail::Problem& p, void* scratch, int threads) {
  switch (p.dtype) {
    case FLARE_DTYPE_BF16: run_forward<AmxForward>(p, scratch, threads); break;
    case FLARE_DTYPE_F64: run_forward<FmaForward<double>>(p, scratch, threads); break;
    default: run_forward<FmaForward<float>>(p, scratch, threads); break;
  }
}
size_t backward_scratch(const detail::Problem& p, int threads) {
  return p.dtype == FLARE_DTYPE_F64 ? backward_scratch_bytes<double>(p, threads)
                                    : backward_scratch_bytes<float>(p, threads);
}
void backward(const detail::Problem& p, void* scratch, int threads) {
  if (p.dtype == FLARE_DTYPE_F64) {
    backward_impl<double>(p, scratch, threads);
  } else {
    backward_impl<float>(p, scratch, threads);
  }
}

}  // namespace flare::cpu::amx

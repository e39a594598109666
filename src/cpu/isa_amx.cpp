// isa_amx.cpp — the CPU kernels for processors with AMX-BF16 (AVX-512 plus tile units); flags per file in
// src/CMakeLists.txt. bf16 forward and backward run on tiles; other dtypes use the AVX-512 FMA engines.
#define FLARE_ISA amx
#define FLARE_VEC_BYTES 64
#include "cpu/backward_amx.hpp"
#include "cpu/forward_amx.hpp"
#include "cpu/decode.hpp"
#include "cpu/isa_kernels.hpp"

namespace flare::cpu::amx {

size_t forward_scratch(const detail::Problem& p, int threads) {
  switch (p.dtype) {
    case FLARE_DTYPE_BF16: return scratch_bytes<AmxForward>(p, threads);
    case FLARE_DTYPE_F64: return fma_forward_scratch<double>(p, threads);
    default: return fma_forward_scratch<float>(p, threads);
  }
}
void forward(const detail::Problem& p, void* scratch, int threads) {
  switch (p.dtype) {
    case FLARE_DTYPE_BF16: run_forward<AmxForward>(p, scratch, threads); break;
    case FLARE_DTYPE_F64: fma_forward<double>(p, scratch, threads); break;
    default: fma_forward<float>(p, scratch, threads); break;
  }
}
// Decoding is bound by reading the cache: the FMA decode path (decode.hpp) for every dtype.
size_t decode_scratch(const detail::Problem& p, int threads) { return decode_scratch_bytes(p, threads); }
void decode(const detail::Problem& p, void* scratch, int threads) { run_decode(p, scratch, threads); }
size_t backward_scratch(const detail::Problem& p, int threads) {
  switch (p.dtype) {
    case FLARE_DTYPE_BF16: return scratch_bytes<AmxBackward>(p, threads);
    case FLARE_DTYPE_F64: return fma_backward_scratch<double>(p, threads);
    default: return fma_backward_scratch<float>(p, threads);
  }
}
void backward(const detail::Problem& p, void* scratch, int threads) {
  switch (p.dtype) {
    case FLARE_DTYPE_BF16: run_backward<AmxBackward>(p, scratch, threads); break;
    case FLARE_DTYPE_F64: fma_backward<double>(p, scratch, threads); break;
    default: fma_backward<float>(p, scratch, threads); break;
  }
}

}  // namespace flare::cpu::amx

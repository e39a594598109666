// isa_avx512bf16.cpp — the CPU kernels for processors with AVX-512 and AVX512_BF16 but no AMX (AMD Zen 4/5,
// Intel Cooper Lake); flags per file in src/CMakeLists.txt. bf16 forward and backward run on bf16 dot
// products (vdpbf16ps: forward_dot.hpp, backward_dot.hpp); other dtypes use the AVX-512 FMA engines.
#define FLARE_ISA avx512bf16
#define FLARE_VEC_BYTES 64
#include "cpu/backward_dot.hpp"
#include "cpu/forward_dot.hpp"
#include "cpu/decode.hpp"
#include "cpu/isa_kernels.hpp"

namespace flare::cpu::avx512bf16 {

size_t forward_scratch(const detail::Problem& p, int threads) {
  switch (p.dtype) {
    case FLARE_DTYPE_BF16: return scratch_bytes<DotForward>(p, threads);
    case FLARE_DTYPE_F64: return fma_forward_scratch<double>(p, threads);
    default: return fma_forward_scratch<float>(p, threads);
  }
}
void forward(const detail::Problem& p, void* scratch, int threads) {
  switch (p.dtype) {
    case FLARE_DTYPE_BF16: run_forward<DotForward>(p, scratch, threads); break;
    case FLARE_DTYPE_F64: fma_forward<double>(p, scratch, threads); break;
    default: fma_forward<float>(p, scratch, threads); break;
  }
}
// Decoding is bound by reading the cache: the FMA decode path (decode.hpp) for every dtype.
size_t decode_scratch(const detail::Problem& p, int threads) { return decode_scratch_bytes(p, threads); }
void decode(const detail::Problem& p, void* scratch, int threads) { run_decode(p, scratch, threads); }
size_t backward_scratch(const detail::Problem& p, int threads) {
  switch (p.dtype) {
    case FLARE_DTYPE_BF16: return scratch_bytes<DotBackward>(p, threads);
    case FLARE_DTYPE_F64: return fma_backward_scratch<double>(p, threads);
    default: return fma_backward_scratch<float>(p, threads);
  }
}
void backward(const detail::Problem& p, void* scratch, int threads) {
  switch (p.dtype) {
    case FLARE_DTYPE_BF16: run_backward<DotBackward>(p, scratch, threads); break;
    case FLARE_DTYPE_F64: fma_backward<double>(p, scratch, threads); break;
    default: fma_backward<float>(p, scratch, threads); break;
  }
}

}  // namespace flare::cpu::avx512bf16

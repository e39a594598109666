// isa_avx512bf16.cpp — the CPU kernels for processors with AVX-512 and AVX512_BF16 but no AMX (AMD Zen 4/5,
// Intel Cooper Lake); flags per file in src/CMakeLists.txt. bf16 forward and backward run on bf16 dot
// products (vdpbf16ps: product_dot.hpp); other dtypes use the AVX-512 FMA engines.
#define FLARE_ISA avx512bf16
#define FLARE_VEC_BYTES 64
#define FLARE_BF16_PRODUCT DotProduct
#include "cpu/product_dot.hpp"
#include "cpu/isa_kernels.inc"

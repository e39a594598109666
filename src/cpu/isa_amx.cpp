// isa_amx.cpp — the CPU kernels for processors with AMX-BF16 (AVX-512 plus tile units); flags per file in
// src/CMakeLists.txt. bf16 forward and backward run on tiles (product_amx.hpp); other dtypes use the AVX-512
// FMA engines.
#define FLARE_ISA amx
#define FLARE_AMX_LEVEL 1  // the tile units: real, or emulated in a FLARE_AMX_EMULATE build (amx.hpp)
#define FLARE_VEC_BYTES 64
#define FLARE_BF16_PRODUCT AmxProduct
#include "cpu/product_amx.hpp"
#include "cpu/isa_kernels.inc"

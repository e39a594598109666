// isa_avx512.cpp — the CPU kernels compiled for avx512 (64-byte vectors); flags per file in src/CMakeLists.txt.
#define FLARE_ISA avx512
#define FLARE_VEC_BYTES 64
#include "cpu/isa_kernels.inc"

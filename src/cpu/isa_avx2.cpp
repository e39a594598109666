// isa_avx2.cpp — the CPU kernels compiled for avx2 (32-byte vectors); flags per file in src/CMakeLists.txt.
#define FLARE_ISA avx2
#define FLARE_VEC_BYTES 32
#include "cpu/isa_kernels.inc"

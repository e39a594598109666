// isa_generic.cpp — the CPU kernels compiled for generic (16-byte vectors); flags per file in src/CMakeLists.txt.
#define FLARE_ISA generic
#define FLARE_VEC_BYTES 16
#include "cpu/isa_kernels.inc"

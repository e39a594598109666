// isa_kernels.hpp — what each per-ISA translation unit exports to the dispatcher (dispatch.cpp).
#pragma once

#include <cstddef>

#include "common/problem.hpp"

#define FLARE_DECLARE_ISA_KERNELS(isa)                                           \
  namespace flare::cpu::isa {                                                    \
  size_t forward_scratch(const detail::Problem& p, int threads);                 \
  void forward(const detail::Problem& p, void* scratch, int threads);            \
  size_t decode_scratch(const detail::Problem& p, int threads);                  \
  void decode(const detail::Problem& p, void* scratch, int threads);             \
  size_t backward_scratch(const detail::Problem& p, int threads);                \
  void backward(const detail::Problem& p, void* scratch, int threads);           \
  }

FLARE_DECLARE_ISA_KERNELS(amx)
FLARE_DECLARE_ISA_KERNELS(avx512bf16)
FLARE_DECLARE_ISA_KERNELS(avx512)
FLARE_DECLARE_ISA_KERNELS(avx2)
FLARE_DECLARE_ISA_KERNELS(generic)
#undef FLARE_DECLARE_ISA_KERNELS

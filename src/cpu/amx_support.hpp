// amx_support.hpp — whether this x86 processor and its OS offer AMX-BF16 tiles, asked of CPUID directly:
// clang (16 at least) rejects "amx-tile" and "amx-bf16" in __builtin_cpu_supports, which GCC accepts.
// Used by the dispatcher (dispatch.cpp) and tools/fma_peak.cpp; header-only, x86-64 only.
#pragma once

#include <cpuid.h>

namespace flare::cpu {

// AMX-TILE and AMX-BF16 (CPUID leaf 7, EDX bits 24 and 22) with the tile state saved by the OS (XCR0 bits
// 17 and 18, XTILECFG and XTILEDATA). Linux still hands the tile data out only on request (arch_prctl).
inline bool amx_bf16_supported() {
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (!__get_cpuid(1, &eax, &ebx, &ecx, &edx) || !(ecx & (1u << 27))) return false;  // OSXSAVE: xgetbv works
  if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return false;
  constexpr unsigned kAmxBf16 = 1u << 22, kAmxTile = 1u << 24;
  if ((edx & (kAmxBf16 | kAmxTile)) != (kAmxBf16 | kAmxTile)) return false;
  unsigned xcr0_lo = 0, xcr0_hi = 0;
  __asm__("xgetbv" : "=a"(xcr0_lo), "=d"(xcr0_hi) : "c"(0));
  constexpr unsigned kTileCfg = 1u << 17, kTileData = 1u << 18;
  return (xcr0_lo & (kTileCfg | kTileData)) == (kTileCfg | kTileData);
}

}  // namespace flare::cpu

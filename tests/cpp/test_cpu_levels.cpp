// test_cpu_levels.cpp — the CPU backend picks the best SIMD level this processor has (dispatch.cpp), and
// FLARE_CPU_ISA only lowers it. scripts/test.sh runs the whole suite again at every level below the best;
// this test says, by name, which levels this machine cannot test.
#include <gtest/gtest.h>

#include <cstdlib>
#include <cstring>
#include <string>

#if defined(__x86_64__)
#  include <cpuid.h>
#endif

#include "flare/flare.h"

namespace {

// The levels in dispatch.cpp's order, lowest first.
constexpr const char* kLevels[] = {"generic", "avx2", "avx512", "avx512bf16", "amx"};
constexpr int kLevelCount = 5;

int level_index(const char* name) {
  for (int i = 0; i < kLevelCount; ++i)
    if (std::strcmp(name, kLevels[i]) == 0) return i;
  return -1;
}

#if defined(__x86_64__)
// AMX-TILE and AMX-BF16 (CPUID leaf 7: EDX bits 24 and 22) with the tile state enabled by the OS (XCR0 bits
// 17 and 18). Read from CPUID: clang rejects "amx-tile" in __builtin_cpu_supports.
bool has_amx_bf16() {
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (!__get_cpuid(1, &a, &b, &c, &d) || !(c & (1u << 27))) return false;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !(d & (1u << 24)) || !(d & (1u << 22))) return false;
  unsigned lo = 0, hi = 0;
  __asm__("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  return (lo >> 17 & 3u) == 3u;
}
#endif

// The best level by the processor's feature flags, as dispatch.cpp decides it (before the AMX permission).
int processor_level() {
  int level = 0;
#if defined(__x86_64__)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) level = 1;
  if (level == 1 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq"))
    level = 2;
  if (level == 2 && __builtin_cpu_supports("avx512bf16")) level = 3;
  if (level == 3 && has_amx_bf16()) level = 4;
#endif
  return level;
}

TEST(CpuLevels, BestLevelOrTheForcedOneBelowIt) {
  const int best = processor_level();
  int expected = best;
  const char* forced = std::getenv("FLARE_CPU_ISA");
  if (forced != nullptr && level_index(forced) >= 0 && level_index(forced) < best) expected = level_index(forced);
  const int got = level_index(flare_cpu_isa());
  ASSERT_GE(got, 0) << "unknown level " << flare_cpu_isa();
  if (expected == 4 && got == 3) return;  // the OS refused the AMX tile state: AVX-512 BF16 is the next best
  EXPECT_EQ(std::string(flare_cpu_isa()), kLevels[expected]);
}

TEST(CpuLevels, Bf16DotProductLevelIsTestedHere) {
  if (processor_level() < 3)
    GTEST_SKIP() << "this CPU lacks AVX512_BF16 (vdpbf16ps): the avx512bf16 level and its bf16 engines are not "
                    "tested on this machine";
  const char* forced = std::getenv("FLARE_CPU_ISA");
  if (forced != nullptr && level_index(forced) >= 0 && level_index(forced) < 3)
    GTEST_SKIP() << "FLARE_CPU_ISA=" << forced << " forces a level below avx512bf16 for this run";
  EXPECT_GE(level_index(flare_cpu_isa()), 3) << flare_cpu_isa();
}

}  // namespace

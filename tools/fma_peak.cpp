// fma_peak.cpp — measures this machine's arithmetic ceilings for the CPU benchmark (bench/cpu).
//
// Every OpenMP thread runs a loop of independent fused multiply-add chains that never touch memory, so
// the figure is the core's issue rate: fp32 FMA with 512-bit (AVX-512) and 256-bit (AVX2) vectors, and
// bf16 dot products (vdpbf16ps, AVX512_BF16) and AMX tile dot products (tdpbf16ps) when the processor
// has them. Each chain depends on itself
// only; with enough chains per thread the FMA latency (4 cycles) is hidden behind the two FMA ports.
//
//   fma_peak            a readable report
//   fma_peak --json     one JSON object: {"threads": 2, "fma_fp32_gflops": ..., ...} (absent = unsupported)
//
// FLOPs count a multiply and an add each: fp32 FMA = 2 per lane; vdpbf16ps = 2 products + 2 adds per
// fp32 lane (each lane accumulates a pair of bf16 products) = 4 per lane, 64 per 512-bit instruction;
// tdpbf16ps = 16 x 16 x 32 multiply-adds = 16384.
#include <omp.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>

#if defined(__x86_64__)
#include <immintrin.h>

#include "cpu/amx_support.hpp"
#if defined(__linux__)
#  include <sys/syscall.h>
#  include <unistd.h>
#endif
#endif

namespace {

// Independent accumulators per thread: enough to cover FMA latency x ports (4 x 2 = 8) while leaving room
// for the two operands in the register file (32 zmm registers with AVX-512, 16 ymm with AVX2 alone).
constexpr int kChains = 16;
constexpr int kChainsAvx2 = 12;
constexpr double kTargetSeconds = 0.3;  // length of one timed measurement
constexpr int kTrials = 5;              // best of (the machine may be shared)

#if defined(__x86_64__)

// The sum of every lane of n accumulators: what the kernels return.
__attribute__((target("avx512f"))) float sum_lanes(const __m512* acc, int n) {
  __m512 sum = acc[0];
  for (int c = 1; c < n; ++c) sum = _mm512_add_ps(sum, acc[c]);
  float lanes[16];
  _mm512_storeu_ps(lanes, sum);
  float total = 0.0f;
  for (float x : lanes) total += x;
  return total;
}

__attribute__((target("avx2"))) float sum_lanes(const __m256* acc, int n) {
  __m256 sum = acc[0];
  for (int c = 1; c < n; ++c) sum = _mm256_add_ps(sum, acc[c]);
  float lanes[8];
  _mm256_storeu_ps(lanes, sum);
  float total = 0.0f;
  for (float x : lanes) total += x;
  return total;
}

// Each kernel runs `iters` rounds of one operation per chain (each chain dependent on itself only) and
// returns a value that depends on every accumulator, so nothing is optimised away.
__attribute__((target("avx512f,fma"))) float fma_chains_avx512(long iters) {
  __m512 acc[kChains];
  for (int c = 0; c < kChains; ++c) acc[c] = _mm512_set1_ps(1.0f + 0.01f * c);
  const __m512 a = _mm512_set1_ps(0.999999f);  // acc -> acc * a + b stays bounded and normal
  const __m512 b = _mm512_set1_ps(1e-6f);
  for (long i = 0; i < iters; ++i) {
#pragma GCC unroll 16
    for (int c = 0; c < kChains; ++c) acc[c] = _mm512_fmadd_ps(acc[c], a, b);
  }
  return sum_lanes(acc, kChains);
}

__attribute__((target("avx2,fma"))) float fma_chains_avx2(long iters) {
  __m256 acc[kChainsAvx2];
  for (int c = 0; c < kChainsAvx2; ++c) acc[c] = _mm256_set1_ps(1.0f + 0.01f * c);
  const __m256 a = _mm256_set1_ps(0.999999f);
  const __m256 b = _mm256_set1_ps(1e-6f);
  for (long i = 0; i < iters; ++i) {
#pragma GCC unroll 12
    for (int c = 0; c < kChainsAvx2; ++c) acc[c] = _mm256_fmadd_ps(acc[c], a, b);
  }
  return sum_lanes(acc, kChainsAvx2);
}

__attribute__((target("avx512f,avx512bf16"))) float dpbf16_chains(long iters) {
  __m512 acc[kChains];
  for (int c = 0; c < kChains; ++c) acc[c] = _mm512_set1_ps(0.01f * c);
  // Small operands: each instruction adds 2 * 1e-6 per lane, far from overflow in any run length.
  const __m512bh a = _mm512_cvtne2ps_pbh(_mm512_set1_ps(1e-3f), _mm512_set1_ps(1e-3f));
  const __m512bh b = _mm512_cvtne2ps_pbh(_mm512_set1_ps(1e-3f), _mm512_set1_ps(1e-3f));
  for (long i = 0; i < iters; ++i) {
#pragma GCC unroll 16
    for (int c = 0; c < kChains; ++c) acc[c] = _mm512_dpbf16_ps(acc[c], a, b);
  }
  return sum_lanes(acc, kChains);
}

// AMX-BF16: four independent accumulator tiles, each fed the same A and B tiles (no loads in the loop);
// one tdpbf16ps is 16 x 16 x 32 multiply-adds. The tile state needs the Linux permission request first.
struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

bool request_amx() {
#if defined(__linux__) && defined(SYS_arch_prctl)
  constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
#else
  return false;
#endif
}

__attribute__((target("amx-tile,amx-bf16"))) float amx_chains(long iters) {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.colsb[t] = 64;
    cfg.rows[t] = 16;
  }
  _tile_loadconfig(&cfg);
  alignas(64) static thread_local uint16_t operand[16 * 32];
  for (auto& x : operand) x = 0x3c00;  // bf16 2^-7: sums stay finite for any iteration count
  _tile_loadd(4, operand, 64);
  _tile_loadd(5, operand, 64);
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (long i = 0; i < iters; ++i) {
    _tile_dpbf16ps(0, 4, 5);
    _tile_dpbf16ps(1, 4, 5);
    _tile_dpbf16ps(2, 4, 5);
    _tile_dpbf16ps(3, 4, 5);
  }
  alignas(64) static thread_local float out[16 * 16];
  _tile_stored(0, out, 64);
  _tile_release();
  return out[0];
}
#endif  // __x86_64__

using Kernel = float (*)(long);

// Runs `kernel` on every thread at once and returns GFLOP/s over all threads: the best of kTrials
// measurements of about kTargetSeconds each, after a calibration run that sizes the loop.
double measure_gflops(Kernel kernel, double flops_per_iter_per_thread, int threads) {
  volatile float sink = 0.0f;  // keeps the kernels' results alive
  auto run_all = [&](long iters) {
    float total = 0.0f;
    const auto start = std::chrono::steady_clock::now();
#pragma omp parallel num_threads(threads) reduction(+ : total)
    total += kernel(iters);
    const auto stop = std::chrono::steady_clock::now();
    sink = total;
    return std::chrono::duration<double>(stop - start).count();
  };
  long iters = 1 << 16;
  double seconds = run_all(iters);
  while (seconds < 0.05) {
    iters *= 4;
    seconds = run_all(iters);
  }
  iters = static_cast<long>(iters * (kTargetSeconds / seconds)) + 1;
  double best = 0.0;
  for (int t = 0; t < kTrials; ++t) {
    const double s = run_all(iters);
    const double gflops = flops_per_iter_per_thread * static_cast<double>(iters) * threads / s * 1e-9;
    if (gflops > best) best = gflops;
  }
  return best;
}

struct Ceilings {
  int threads = 0;
  double avx512_fp32 = -1.0;  // < 0: not supported by this processor
  double avx2_fp32 = -1.0;
  double dpbf16 = -1.0;
  double amx_bf16 = -1.0;
};

Ceilings measure_all() {
  Ceilings c;
  c.threads = omp_get_max_threads();
#if defined(__x86_64__)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f"))
    c.avx512_fp32 = measure_gflops(fma_chains_avx512, kChains * 16 * 2.0, c.threads);
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))
    c.avx2_fp32 = measure_gflops(fma_chains_avx2, kChainsAvx2 * 8 * 2.0, c.threads);
  if (__builtin_cpu_supports("avx512bf16"))
    c.dpbf16 = measure_gflops(dpbf16_chains, kChains * 16 * 4.0, c.threads);
  if (flare::cpu::amx_bf16_supported() && request_amx())
    c.amx_bf16 = measure_gflops(amx_chains, 4 * 16 * 16 * 32 * 2.0, c.threads);
#endif
  return c;
}

void print_json(const Ceilings& c) {
  std::string s = "{\"threads\": " + std::to_string(c.threads);
  auto add = [&](const char* key, double v) {
    if (v < 0.0) return;
    char buf[96];
    std::snprintf(buf, sizeof buf, ", \"%s\": %.1f", key, v);
    s += buf;
  };
  // fma_fp32_gflops is the widest fp32 FMA this processor has.
  add("fma_fp32_gflops", c.avx512_fp32 >= 0.0 ? c.avx512_fp32 : c.avx2_fp32);
  add("fma_fp32_avx512_gflops", c.avx512_fp32);
  add("fma_fp32_avx2_gflops", c.avx2_fp32);
  add("dpbf16_gflops", c.dpbf16);
  add("amx_bf16_gflops", c.amx_bf16);
  s += "}";
  std::puts(s.c_str());
}

void print_report(const Ceilings& c) {
  std::printf("Arithmetic ceilings, %d OpenMP threads (independent chains, no memory traffic):\n", c.threads);
  auto line = [](const char* what, double v) {
    if (v < 0.0)
      std::printf("  %-34s not supported by this processor\n", what);
    else
      std::printf("  %-34s %10.1f GFLOP/s\n", what, v);
  };
  line("fp32 FMA, AVX-512 (zmm)", c.avx512_fp32);
  line("fp32 FMA, AVX2 (ymm)", c.avx2_fp32);
  line("bf16 dot product, vdpbf16ps (zmm)", c.dpbf16);
  line("bf16 tile dot product, AMX tdpbf16ps", c.amx_bf16);
}

}  // namespace

int main(int argc, char** argv) {
  bool json = false;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--json") == 0) {
      json = true;
    } else {
      std::fprintf(stderr, "usage: %s [--json]\n", argv[0]);
      return 2;
    }
  }
  const Ceilings c = measure_all();
  if (json)
    print_json(c);
  else
    print_report(c);
  return 0;
}

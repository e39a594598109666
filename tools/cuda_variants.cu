// cuda_variants — times tile-shape variants of the sm80 kernels side by side, for tuning
// src/cuda/sm80/configs.cuh. It launches the kernels directly (no C ABI, no checks) on the benchmark
// protocol's shapes (16384 tokens, width 2048, bf16) and prints TFLOP/s per variant; correctness stays the
// GPU suite's job (tests/gpu). Not built by default:
//   cmake --build build/cuda --target flare_cuda_variants && build/cuda/tools/flare_cuda_variants [TEXT]
// (TEXT: only the variants whose name contains it, e.g. to profile one under ncu).
// Add a variant: one line in main() with the traits to try; ptxas' spill report for it comes with
// -DCMAKE_CUDA_FLAGS="-Xptxas -v".
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <type_traits>
#include <vector>

#include "cuda/sm80/backward.cuh"
#include "cuda/sm80/forward.cuh"

namespace flare::tools {  // named: nvcc's host stubs cannot name kernels in an anonymous namespace

using namespace flare::cuda;
using namespace flare::cuda::sm80;
using bf16 = cutlass::bfloat16_t;

constexpr int kTokens = 16384;
constexpr int kWidth = 2048;

__global__ void fill_random(bf16* p, size_t n, unsigned seed) {
  const size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x;
  if (i >= n) return;
  unsigned x = static_cast<unsigned>(i * 2654435761u) ^ seed;
  x ^= x >> 13;
  x *= 0x5bd1e995u;
  x ^= x >> 15;
  p[i] = bf16(((x & 0xffff) / 65536.f - 0.5f) * 3.f);
}

struct Buffers {
  bf16 *q, *k, *v, *out, *dout, *dq, *dk, *dv;
  float *lse, *workspace;
};

double flops(const AttnParams& p, double factor) {
  const bool causal = p.window_right == 0;
  return factor * 4.0 * p.batch * p.nheads * double(p.seqlen_q) * p.seqlen_k * p.headdim / (causal ? 2 : 1);
}

template <class Launch>
double median_ms(Launch&& launch, int reps) {
  cudaEvent_t a, b;
  cudaEventCreate(&a);
  cudaEventCreate(&b);
  std::vector<float> times;
  for (int it = 0; it < reps + 3; ++it) {
    cudaEventRecord(a);
    launch();
    cudaEventRecord(b);
    cudaEventSynchronize(b);
    float ms = 0;
    cudaEventElapsedTime(&ms, a, b);
    if (it >= 3) times.push_back(ms);
  }
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  std::sort(times.begin(), times.end());
  return times[times.size() / 2];
}

AttnParams dense(int headdim, int seqlen, bool causal, const Buffers& bufs) {
  AttnParams p;
  const int batch = kTokens / seqlen, heads = kWidth / headdim;
  auto operand = [&](void* ptr) {
    return Tensor3{ptr, int64_t{seqlen} * heads * headdim, int64_t{heads} * headdim, headdim};
  };
  p.q = operand(bufs.q);
  p.k = operand(bufs.k);
  p.v = operand(bufs.v);
  p.out = operand(bufs.out);
  p.lse = bufs.lse;
  p.lse_batch_stride = int64_t{heads} * seqlen;
  p.lse_head_stride = seqlen;
  p.batch = batch;
  p.nheads = p.nheads_k = heads;
  p.headdim = p.headdim_v = headdim;
  p.seqlen_q = p.seqlen_k = seqlen;
  p.scale = 1.f / std::sqrt(float(headdim));
  p.scale_log2 = p.scale * 1.4426950408889634f;
  p.window_right = causal ? 0 : -1;
  return p;
}

BwdParams dense_bwd(int headdim, int seqlen, bool causal, const Buffers& bufs) {
  BwdParams p;
  static_cast<AttnParams&>(p) = dense(headdim, seqlen, causal, bufs);
  auto operand = [&](void* ptr) {
    return Tensor3{ptr, int64_t{seqlen} * p.nheads * headdim, int64_t{p.nheads} * headdim, headdim};
  };
  p.dout = operand(bufs.dout);
  p.dq = operand(bufs.dq);
  p.dk = operand(bufs.dk);
  p.dv = operand(bufs.dv);
  p.seqlen_q_rounded = p.seqlen_k_rounded = (seqlen + kRowPad - 1) / kRowPad * kRowPad;
  p.q_rows = p.k_rows = int64_t{p.batch} * p.seqlen_q_rounded;
  p.headdim_rounded = headdim;
  p.dsum = bufs.workspace;
  p.dq_accum = bufs.workspace + int64_t{p.nheads} * p.q_rows;
  return p;
}

// The shipped forward of a head dim: the configuration launch_forward_for picks for the call's mask.
template <class Element, int kHeadDim>
struct Shipped {};

template <class T>
struct ShippedOf : std::false_type {};
template <class E, int D>
struct ShippedOf<Shipped<E, D>> : std::true_type {
  using Element = E;
  static constexpr int kHeadDim = D;
};

template <class Fwd>
void run_forward(const AttnParams& p) {
  if constexpr (ShippedOf<Fwd>::value) {
    launch_forward_for<typename ShippedOf<Fwd>::Element, ShippedOf<Fwd>::kHeadDim>(p, nullptr);
  } else {
    launch_forward<Fwd>(p, nullptr);
  }
}

// A backward configuration with its query-tile loops merged into one (kMaskLoopApart false), the rest as is.
template <class T>
struct OneLoopOf;
template <class E, int d, int m, int n, int w, int a, int b, int c, bool dbl, SmemClass k, int dq, bool apart>
struct OneLoopOf<BwdTraits<E, d, m, n, w, a, b, c, dbl, k, dq, apart>> {
  using type = BwdTraits<E, d, m, n, w, a, b, c, dbl, k, dq, false>;
};
template <class T>
using OneLoop = typename OneLoopOf<T>::type;

// A forward traits type with its kSkipSettledRescale and kEarlyCopies flags set as given, the rest as is.
template <class T, bool kSkip, bool kEarly>
struct FwdFlagsOf;
template <class E, int d, int m, int n, int w, bool apart, bool plain, bool skip, bool early, bool kSkip,
          bool kEarly>
struct FwdFlagsOf<FwdTraits<E, d, m, n, w, apart, plain, skip, early>, kSkip, kEarly> {
  using type = FwdTraits<E, d, m, n, w, apart, plain, kSkip, kEarly>;
};
// The prologue's copies issued after the set-up (FwdTraits::kEarlyCopies false).
template <class T>
using LateCopies = typename FwdFlagsOf<T, T::kSkipSettledRescale, false>::type;
// The output rescale never skipped (FwdTraits::kSkipSettledRescale false).
template <class T>
using NoSkip = typename FwdFlagsOf<T, false, T::kEarlyCopies>::type;

// A backward configuration compiled for kMin CTAs per SM (__launch_bounds__ min blocks: registers capped).
template <class T, int kMin>
struct MinBlocks : T {
  static constexpr int kMinBlocks = kMin;
};

// The variants to run: those whose name contains this text (argv[1]); all when null.
const char* g_only = nullptr;

// The forward runs first: the backward needs its out and lse.
template <class Fwd, class Bwd = void>
void time_variant(const char* name, int headdim, int seqlen, bool causal, const Buffers& bufs) {
  if (g_only != nullptr && std::strstr(name, g_only) == nullptr) return;
  const AttnParams p = dense(headdim, seqlen, causal, bufs);
  const double fwd = median_ms([&] { run_forward<Fwd>(p); }, 20);
  std::printf("%-34s hd %3d seqlen %5d %-9s fwd %6.0f TFLOP/s", name, headdim, seqlen,
              causal ? "causal" : "full", flops(p, 1) / fwd * 1e-9);
  if constexpr (!std::is_void_v<Bwd>) {
    const BwdParams b = dense_bwd(headdim, seqlen, causal, bufs);
    // launch_backward_with, not launch_backward: the latter would swap in BwdShortOf's twin at short lengths.
    const double bwd = median_ms([&] { launch_backward_with<Bwd, false>(b, nullptr); }, 10);
    std::printf("   bwd %6.0f TFLOP/s", flops(p, 2.5) / bwd * 1e-9);
  }
  const cudaError_t e = cudaDeviceSynchronize();
  std::printf("%s\n", e == cudaSuccess ? "" : cudaGetErrorString(e));
}

// ---- the backward's passes one by one: dsum_kernel (with the dQ buffer's zeroing), the main kernel (no mask
// transform), dq_kernel, and the whole backward (launch_backward_with), on the grids it launches them on; the
// whole backward with its kernels launched chained (where the GPU allows it) and unchained.
template <class T>
void time_stages(const char* name, int seqlen, bool causal, const Buffers& bufs) {
  if (g_only != nullptr && std::strstr(name, g_only) == nullptr) return;
  constexpr int d = T::kHeadDim;
  using E = typename T::Element;
  const AttnParams fp = dense(d, seqlen, causal, bufs);
  launch_forward_for<E, d>(fp, nullptr);
  const BwdParams b = dense_bwd(d, seqlen, causal, bufs);
  const BwdGrids<T> grids(b);
  const auto main_kernel = backward_kernel<T, false>;
  cudaFuncSetAttribute(main_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, T::kSmemBytes);
  const double dsum = median_ms([&] { dsum_kernel<E, d><<<grids.rows, kDsumThreads>>>(b); }, 10);
  const double main = median_ms([&] { main_kernel<<<grids.main, T::kThreads, T::kSmemBytes>>>(b); }, 10);
  const double dq = median_ms([&] { dq_kernel<T><<<grids.dq, T::kThreads>>>(b); }, 10);
  const double total = median_ms([&] { launch_backward_with<T, false>(b, nullptr); }, 10);
  const double unchained = median_ms([&] { launch_backward_with<T, false>(b, nullptr, false); }, 10);
  std::printf("%-34s hd %3d seqlen %5d %-9s us: dsum %6.1f main %7.1f dq %6.1f total %7.1f unchained %7.1f%s\n",
              name, d, seqlen, causal ? "causal" : "full", dsum * 1e3, main * 1e3, dq * 1e3, total * 1e3,
              unchained * 1e3, cudaDeviceSynchronize() == cudaSuccess ? "" : " CUDA ERROR");
}

// ---- a check that two backward configurations agree: dK and dV bitwise (each CTA sums its query tiles in
// one order either way), dQ to within fp32 rounding of its atomics (relative to its largest element), with
// the gradients poisoned (all-ones bits: NaN) before each run, so that any element left unwritten fails.
template <class A, class B>
bool same_backward(const char* name, int seqlen, bool causal, const Buffers& bufs) {
  if (g_only != nullptr && std::strstr(name, g_only) == nullptr) return true;
  using E = typename A::Element;
  constexpr int d = A::kHeadDim;
  const AttnParams fp = dense(d, seqlen, causal, bufs);
  launch_forward_for<E, d>(fp, nullptr);
  const BwdParams b = dense_bwd(d, seqlen, causal, bufs);
  const size_t n = size_t{kTokens} * kWidth;
  std::vector<uint16_t> out[2][3];
  for (int run = 0; run < 2; ++run) {
    for (bf16* g : {bufs.dq, bufs.dk, bufs.dv}) cudaMemset(g, 0xff, n * sizeof(bf16));
    const cudaError_t e =
        run == 0 ? launch_backward_with<A, false>(b, nullptr) : launch_backward_with<B, false>(b, nullptr);
    if (e != cudaSuccess || cudaDeviceSynchronize() != cudaSuccess) {
      std::printf("%-34s hd %3d seqlen %5d %-9s CUDA ERROR\n", name, d, seqlen, causal ? "causal" : "full");
      return false;
    }
    int i = 0;
    for (bf16* g : {bufs.dq, bufs.dk, bufs.dv}) {
      out[run][i].resize(n);
      cudaMemcpy(out[run][i++].data(), g, n * sizeof(bf16), cudaMemcpyDeviceToHost);
    }
  }
  const auto value = [](uint16_t bits) {
    const uint32_t w = uint32_t{bits} << 16;
    float f;
    std::memcpy(&f, &w, sizeof f);
    return f;
  };
  size_t unwritten = 0, dkv_differ = 0;
  double dq_diff = 0, dq_max = 0;
  const size_t used = static_cast<size_t>(b.batch) * seqlen * kWidth;  // 1000 does not divide the tokens
  for (int g = 0; g < 3; ++g) {
    for (size_t i = 0; i < used; ++i) {
      const float x = value(out[0][g][i]), y = value(out[1][g][i]);
      if (std::isnan(x) || std::isnan(y)) ++unwritten;
      if (g == 0) {
        dq_diff = std::max(dq_diff, double(std::fabs(x - y)));
        dq_max = std::max(dq_max, double(std::fabs(x)));
      } else if (out[0][g][i] != out[1][g][i]) {
        ++dkv_differ;
      }
    }
  }
  // bf16 keeps 8 bits: two roundings of differently ordered fp32 sums differ by at most a few units there.
  const bool ok = unwritten == 0 && dkv_differ == 0 && dq_diff <= dq_max * (1.0 / 64);
  std::printf("%-34s hd %3d seqlen %5d %-9s check: unwritten %zu, dK/dV differing %zu, dQ max diff %.3g of "
              "%.3g %s\n",
              name, d, seqlen, causal ? "causal" : "full", unwritten, dkv_differ, dq_diff, dq_max,
              ok ? "OK" : "FAILED");
  return ok;
}

}  // namespace flare::tools

int main(int argc, char** argv) {
  using namespace flare::tools;
  if (argc > 1) g_only = argv[1];
  Buffers bufs{};
  const size_t n = size_t{kTokens} * kWidth;
  for (bf16** p : {&bufs.q, &bufs.k, &bufs.v, &bufs.out, &bufs.dout, &bufs.dq, &bufs.dk, &bufs.dv}) {
    if (cudaMalloc(p, n * sizeof(bf16)) != cudaSuccess) {
      std::fprintf(stderr, "cudaMalloc failed\n");
      return 1;
    }
    fill_random<<<(n + 255) / 256, 256>>>(*p, n, static_cast<unsigned>(p - &bufs.q));
  }
  cudaMalloc(&bufs.lse, sizeof(float) * kTokens * 64);
  cudaMalloc(&bufs.workspace, sizeof(float) * (n + size_t{kTokens} * 64) + (1 << 20));

  // Variants first checked against the shipped configuration (same_backward), then timed.
  // Head dim 64's backward: the shipped configuration beyond backward_short (dQ in 32-column slices) and its
  // twin with the statistics in shared memory (whole-width dQ), each against the other dQ width
  // (bench/results/gpu-tuning-2026-12-04-fc316c5.json).
  using Long64 = BwdConfig<bf16, 64>;
  using Stats64 = BwdShortOf<Long64>::type;
  using LongDq32 = BwdTraits<bf16, 64, 128, 128, 8, 4, 4, 4, true, SmemClass::kLarge, 32, true, false>;
  using LongWhole = BwdTraits<bf16, 64, 128, 128, 8, 4, 4, 4, true, SmemClass::kLarge, 0, true, false>;
  using StatsDq32 = BwdTraits<bf16, 64, 128, 128, 8, 4, 4, 4, true, SmemClass::kLarge, 32, true, true>;
  static_assert(std::is_same_v<Long64, LongDq32>, "the shipped configuration is the one timed as such");
  bool same = true;
  for (bool causal : {false, true}) {
    for (int seqlen : {512, 1000}) {  // 1000: a partial last tile
      same &= same_backward<Long64, LongWhole>("hd64 bwd check whole dq", seqlen, causal, bufs);
      same &= same_backward<Long64, StatsDq32>("hd64 bwd check stats dq32", seqlen, causal, bufs);
    }
  }
  for (int round = 0; round < 2; ++round) {
    for (bool causal : {false, true}) {
      for (int seqlen : {512, 1024, 2048, 4096, 8192, 16384}) {
        time_variant<Shipped<bf16, 64>, LongWhole>("hd64 bwd long-seq config", 64, seqlen, causal, bufs);
        time_variant<Shipped<bf16, 64>, Long64>("hd64 bwd long-seq dq32", 64, seqlen, causal, bufs);
        time_variant<Shipped<bf16, 64>, Stats64>("hd64 bwd stats in smem", 64, seqlen, causal, bufs);
        time_variant<Shipped<bf16, 64>, StatsDq32>("hd64 bwd stats in smem dq32", 64, seqlen, causal, bufs);
      }
    }
  }
  return same ? 0 : 1;
}

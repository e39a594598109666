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
    const double bwd = median_ms([&] { launch_backward<Bwd>(b, nullptr); }, 10);
    std::printf("   bwd %6.0f TFLOP/s", flops(p, 2.5) / bwd * 1e-9);
  }
  const cudaError_t e = cudaDeviceSynchronize();
  std::printf("%s\n", e == cudaSuccess ? "" : cudaGetErrorString(e));
}


// ---- the backward's passes one by one, against the passes before dsum_kernel zeroed the dQ buffer and
// dq_kernel wrote through shared memory (a memset, a dsum with 2-byte loads, dq stores from the fragments).
template <class Element>
__global__ void __launch_bounds__(256) dsum_before(const __grid_constant__ BwdParams p) {
  const int h = blockIdx.y;
  const int b = blockIdx.z;
  const Sequence seq(p, b);
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const Element* out = static_cast<const Element*>(p.out.ptr) + seq.q_offset(p.out, b, h);
  const Element* dout = static_cast<const Element*>(p.dout.ptr) + seq.q_offset(p.dout, b, h);
  float* dsum = p.dsum + h * p.q_rows + seq.q_row0(p, b);
  for (int i = blockIdx.x * kRowsPerCta + warp; i < min(seq.len_q, (blockIdx.x + 1) * kRowsPerCta); i += 8) {
    float acc = 0.f;
    for (int c = lane; c < p.headdim_v; c += 32) {
      acc += static_cast<float>(out[i * p.out.row_stride + c]) * static_cast<float>(dout[i * p.dout.row_stride + c]);
    }
    for (int o = 16; o > 0; o /= 2) acc += __shfl_xor_sync(0xffffffff, acc, o);
    if (lane == 0) dsum[i] = acc;
  }
}

template <class T>
__global__ void __launch_bounds__(T::kThreads) dq_before(const __grid_constant__ BwdParams p) {
  using Element = typename T::Element;
  constexpr int kBlockM = T::kBlockM;
  constexpr int kHeadDim = T::kHeadDim;
  const int h = blockIdx.y;
  const int b = blockIdx.z;
  const int tid = threadIdx.x;
  const Sequence seq(p, b);
  const int m0 = blockIdx.x * kBlockM;
  if (m0 >= seq.len_q) return;
  typename T::MmadQ mma_dq;
  using DqCoords = AccCoords<typename T::MmadQ, Shape<Int<kBlockM>, Int<T::kDqCols>>>;
  const DqCoords coords(mma_dq, tid);
  Tensor offsets = DqCoords::offsets();
  Element* dq = static_cast<Element*>(p.dq.ptr) + seq.q_offset(p.dq, b, h);
  const float* src = p.dq_accum + (h * p.q_rows + seq.q_row0(p, b) + m0) * kHeadDim + tid;
  for (int slice = 0; slice < kHeadDim / T::kDqCols; ++slice) {
    for (int i = 0; i < size(offsets); ++i) {
      const int row = m0 + coords.row_base + get<0>(offsets(i));
      const int col = slice * T::kDqCols + coords.col_base + get<1>(offsets(i));
      if (row >= seq.len_q || col >= p.headdim) continue;
      const float acc = src[slice * (kBlockM * T::kDqCols) + i * T::kThreads];
      dq[static_cast<int64_t>(row) * p.dq.row_stride + col] = static_cast<Element>(acc * p.scale);
    }
  }
}

// Times each pass of the shipped backward of traits T (no mask transform) and of the passes before, and checks
// that both give the same dq (up to the order of dsum's additions).
template <class T>
void time_stages(const char* name, int seqlen, bool causal, const Buffers& bufs) {
  if (g_only != nullptr && std::strstr(name, g_only) == nullptr) return;
  constexpr int d = T::kHeadDim;
  const AttnParams fp = dense(d, seqlen, causal, bufs);
  launch_forward_for<typename T::Element, d>(fp, nullptr);
  const BwdParams b = dense_bwd(d, seqlen, causal, bufs);
  const size_t dq_bytes = sizeof(float) * size_t(b.nheads) * b.q_rows * b.headdim_rounded;
  const dim3 rows_grid((b.seqlen_q + kRowsPerCta - 1) / kRowsPerCta, b.nheads, b.batch);
  const dim3 grid((b.seqlen_k + T::kBlockN - 1) / T::kBlockN, b.nheads, b.batch);
  const dim3 dq_grid((b.seqlen_q + T::kBlockM - 1) / T::kBlockM, b.nheads, b.batch);
  const auto main_kernel = backward_kernel<T, false>;
  cudaFuncSetAttribute(main_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, T::kSmemBytes);
  using E = typename T::Element;
  const double memset = median_ms([&] { cudaMemsetAsync(b.dq_accum, 0, dq_bytes, nullptr); }, 10);
  const double dsum_old = median_ms([&] { dsum_before<E><<<rows_grid, 256>>>(b); }, 10);
  const double dsum_new = median_ms([&] { dsum_kernel<E, d><<<rows_grid, kDsumThreads>>>(b); }, 10);
  const double main = median_ms([&] { main_kernel<<<grid, T::kThreads, T::kSmemBytes>>>(b); }, 10);
  const double dq_old = median_ms([&] { dq_before<T><<<dq_grid, T::kThreads>>>(b); }, 10);
  const double dq_new = median_ms([&] { dq_kernel<T><<<dq_grid, T::kThreads>>>(b); }, 10);
  const auto before = [&] {
    cudaMemsetAsync(b.dq_accum, 0, dq_bytes, nullptr);
    dsum_before<E><<<rows_grid, 256>>>(b);
    main_kernel<<<grid, T::kThreads, T::kSmemBytes>>>(b);
    dq_before<T><<<dq_grid, T::kThreads>>>(b);
  };
  const double total_old = median_ms(before, 10);
  const double total_new = median_ms([&] { launch_backward_with<T, false>(b, nullptr); }, 10);
  // Same dq both ways?
  const size_t n = size_t{kTokens} * kWidth;
  std::vector<E> dq_a(n), dq_b(n);
  before();
  cudaMemcpy(dq_a.data(), bufs.dq, n * sizeof(E), cudaMemcpyDeviceToHost);
  cudaMemset(bufs.dq, 0xff, n * sizeof(E));
  launch_backward_with<T, false>(b, nullptr);
  cudaMemcpy(dq_b.data(), bufs.dq, n * sizeof(E), cudaMemcpyDeviceToHost);
  double diff = 0, most = 0;
  for (size_t i = 0; i < n; ++i) {
    diff = std::max(diff, std::abs(double(float(dq_a[i])) - double(float(dq_b[i]))));
    most = std::max(most, std::abs(double(float(dq_a[i]))));
  }
  std::printf("%-34s hd %3d seqlen %5d %-9s us: memset %6.1f dsum %6.1f -> %6.1f (with zeroing) main %7.1f "
              "dq %6.1f -> %6.1f total %7.1f -> %7.1f  max|dq diff| %.3g of max|dq| %.3g%s\n",
              name, d, seqlen, causal ? "causal" : "full", memset * 1e3, dsum_old * 1e3, dsum_new * 1e3,
              main * 1e3, dq_old * 1e3, dq_new * 1e3, total_old * 1e3, total_new * 1e3, diff, most,
              cudaDeviceSynchronize() == cudaSuccess ? "" : " CUDA ERROR");
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

  for (bool causal : {false, true}) {
    for (int seqlen : {512, 1024, 2048}) {
      time_stages<BwdConfig<bf16, 64>>("hd64 bwd stages", seqlen, causal, bufs);
      time_stages<BwdConfig<bf16, 128>>("hd128 bwd stages", seqlen, causal, bufs);
      time_stages<BwdConfig<bf16, 256>>("hd256 bwd stages", seqlen, causal, bufs);
    }
    for (int seqlen : {512, 1024, 2048, 4096, 8192, 16384}) {
      // The forward: the shipped choice (forward_shape), both shapes of each head dim with the score transform
      // and, where the long shape has one, its kernel with the mask alone (FwdConfigOf::Plain).
      time_variant<Shipped<bf16, 64>>("hd64 fwd shipped", 64, seqlen, causal, bufs);
      time_variant<FwdConfig<bf16, 64, FwdShape::kShort>>("hd64 fwd short", 64, seqlen, causal, bufs);
      time_variant<FwdConfig<bf16, 64, FwdShape::kLong>>("hd64 fwd long", 64, seqlen, causal, bufs);
      time_variant<FwdConfigOf<bf16, 64, FwdShape::kLong, SmemClass::kLarge>::Plain>("hd64 fwd long plain", 64,
                                                                                     seqlen, causal, bufs);
      time_variant<Shipped<bf16, 128>>("hd128 fwd shipped", 128, seqlen, causal, bufs);
      time_variant<FwdConfig<bf16, 128, FwdShape::kShort>>("hd128 fwd short", 128, seqlen, causal, bufs);
      time_variant<FwdConfig<bf16, 128, FwdShape::kLong>>("hd128 fwd long", 128, seqlen, causal, bufs);
      time_variant<FwdConfigOf<bf16, 128, FwdShape::kLong, SmemClass::kLarge>::Plain>("hd128 fwd long plain", 128,
                                                                                      seqlen, causal, bufs);
      time_variant<Shipped<bf16, 256>>("hd256 fwd shipped", 256, seqlen, causal, bufs);
      time_variant<FwdConfig<bf16, 256, FwdShape::kShort>>("hd256 fwd short", 256, seqlen, causal, bufs);
      time_variant<FwdConfig<bf16, 256, FwdShape::kLong>>("hd256 fwd long", 256, seqlen, causal, bufs);
      time_variant<FwdConfigOf<bf16, 256, FwdShape::kShort, SmemClass::kLarge>::Plain>("hd256 fwd short plain", 256,
                                                                                       seqlen, causal, bufs);
    }
    for (int seqlen : {1024, 4096, 16384}) {
      // The backward: the shipped configuration of each head dim, and the same with one query-tile loop
      // that tests the mask per tile (BwdTraits::kMaskLoopApart false).
      time_variant<Shipped<bf16, 64>, BwdConfig<bf16, 64>>("hd64 bwd shipped", 64, seqlen, causal, bufs);
      time_variant<Shipped<bf16, 64>, OneLoop<BwdConfig<bf16, 64>>>("hd64 bwd one loop", 64, seqlen, causal, bufs);
      time_variant<Shipped<bf16, 128>, BwdConfig<bf16, 128>>("hd128 bwd shipped", 128, seqlen, causal, bufs);
      time_variant<Shipped<bf16, 128>, OneLoop<BwdConfig<bf16, 128>>>("hd128 bwd one loop", 128, seqlen, causal,
                                                                      bufs);
      time_variant<Shipped<bf16, 256>, BwdConfig<bf16, 256>>("hd256 bwd shipped", 256, seqlen, causal, bufs);
      time_variant<Shipped<bf16, 256>, OneLoop<BwdConfig<bf16, 256>>>("hd256 bwd one loop", 256, seqlen, causal,
                                                                      bufs);
    }
  }
  return 0;
}

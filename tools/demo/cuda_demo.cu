// cuda_demo.cu — see cuda_demo.hpp. Input generation and the naive way as plain CUDA kernels (shared-memory
// tiles, fp32 arithmetic, no tensor cores: the point of the foil is the n x n matrix, not its speed), and
// flare through the C ABI on CUDA tensor views.
#include "cuda_demo.hpp"

#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <flare/flare.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <utility>
#include <string>
#include <vector>

namespace flare_demo {
namespace {

constexpr int kTile = 16;           // the naive kernels' square tile
constexpr int kSoftmaxThreads = 256;
constexpr double kMiB = 1024.0 * 1024.0;

std::string cuda_error(cudaError_t e, const char* what) {
  return std::string(what) + ": " + cudaGetErrorName(e) + " (" + cudaGetErrorString(e) + ")";
}

// ---- inputs: N(0, 1) from a counter-based hash (splitmix64) and Box-Muller, rounded to bf16
__device__ uint64_t splitmix64(uint64_t z) {
  z += 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

__global__ void fill_normal_bf16(__nv_bfloat16* x, int64_t n, uint64_t seed) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const float u1 = float((splitmix64(seed + 2 * i) >> 40) + 1) * 0x1.0p-24f;  // (0, 1]
    const float u2 = float(splitmix64(seed + 2 * i + 1) >> 40) * 0x1.0p-24f;    // [0, 1)
    x[i] = __float2bfloat16(sqrtf(-2.0f * logf(u1)) * cospif(2.0f * u2));
  }
}

// ---- the naive way. q (b, sq, h, d), k/v (b, sk, h, d) bf16; s (b*h, sq, sk) fp32; out (b, sq, h, d) fp32.
struct Dims {
  int64_t sq, sk, h, d;
};

// s[bh][i][j] = scale * q_i . k_j where key j is visible to query i, -inf elsewhere (causal: bottom-right).
__global__ void naive_scores(const __nv_bfloat16* q, const __nv_bfloat16* k, float* s, Dims dm, float scale,
                             bool causal) {
  __shared__ float q_tile[kTile][kTile + 1], k_tile[kTile][kTile + 1];  // (rows, features)
  const int64_t bh = blockIdx.z, b = bh / dm.h, h = bh % dm.h;
  const int64_t i = blockIdx.y * int64_t(kTile) + threadIdx.y;
  const int64_t j = blockIdx.x * int64_t(kTile) + threadIdx.x;
  const int64_t k_row = blockIdx.x * int64_t(kTile) + threadIdx.y;  // the key this thread loads
  float acc = 0.0f;
  for (int64_t c0 = 0; c0 < dm.d; c0 += kTile) {
    const int64_t c = c0 + threadIdx.x;
    q_tile[threadIdx.y][threadIdx.x] =
        (i < dm.sq && c < dm.d) ? __bfloat162float(q[((b * dm.sq + i) * dm.h + h) * dm.d + c]) : 0.0f;
    k_tile[threadIdx.y][threadIdx.x] =
        (k_row < dm.sk && c < dm.d) ? __bfloat162float(k[((b * dm.sk + k_row) * dm.h + h) * dm.d + c]) : 0.0f;
    __syncthreads();
    for (int t = 0; t < kTile; ++t) acc += q_tile[threadIdx.y][t] * k_tile[threadIdx.x][t];
    __syncthreads();
  }
  if (i < dm.sq && j < dm.sk) {
    const bool visible = !causal || j <= i + dm.sk - dm.sq;
    s[(bh * dm.sq + i) * dm.sk + j] = visible ? scale * acc : -INFINITY;
  }
}

__device__ float block_reduce(float x, bool is_max) {
  __shared__ float partial[kSoftmaxThreads];
  partial[threadIdx.x] = x;
  __syncthreads();
  for (int stride = kSoftmaxThreads / 2; stride > 0; stride /= 2) {
    if (threadIdx.x < stride) {
      const float other = partial[threadIdx.x + stride];
      partial[threadIdx.x] = is_max ? fmaxf(partial[threadIdx.x], other) : partial[threadIdx.x] + other;
    }
    __syncthreads();
  }
  const float result = partial[0];
  __syncthreads();  // partial is reused by the next call
  return result;
}

// In place, one block per row: s <- softmax(s); a row with no visible key becomes zeros.
__global__ void naive_softmax(float* s, int64_t sk) {
  float* row = s + blockIdx.x * sk;
  float m = -INFINITY;
  for (int64_t j = threadIdx.x; j < sk; j += kSoftmaxThreads) m = fmaxf(m, row[j]);
  m = block_reduce(m, true);
  if (m == -INFINITY) {  // the same for the whole block
    for (int64_t j = threadIdx.x; j < sk; j += kSoftmaxThreads) row[j] = 0.0f;
    return;
  }
  float sum = 0.0f;
  for (int64_t j = threadIdx.x; j < sk; j += kSoftmaxThreads) {
    const float e = expf(row[j] - m);
    row[j] = e;
    sum += e;
  }
  const float inv = 1.0f / block_reduce(sum, false);
  for (int64_t j = threadIdx.x; j < sk; j += kSoftmaxThreads) row[j] *= inv;
}

// out[b][i][h][c] = sum_j p[bh][i][j] v[b][j][h][c]
__global__ void naive_pv(const float* p, const __nv_bfloat16* v, float* out, Dims dm) {
  __shared__ float p_tile[kTile][kTile + 1], v_tile[kTile][kTile + 1];  // (query, key), (key, feature)
  const int64_t bh = blockIdx.z, b = bh / dm.h, h = bh % dm.h;
  const int64_t i = blockIdx.y * int64_t(kTile) + threadIdx.y;
  const int64_t c = blockIdx.x * int64_t(kTile) + threadIdx.x;
  float acc = 0.0f;
  for (int64_t j0 = 0; j0 < dm.sk; j0 += kTile) {
    const int64_t jp = j0 + threadIdx.x, jv = j0 + threadIdx.y;
    p_tile[threadIdx.y][threadIdx.x] = (i < dm.sq && jp < dm.sk) ? p[(bh * dm.sq + i) * dm.sk + jp] : 0.0f;
    v_tile[threadIdx.y][threadIdx.x] =
        (jv < dm.sk && c < dm.d) ? __bfloat162float(v[((b * dm.sk + jv) * dm.h + h) * dm.d + c]) : 0.0f;
    __syncthreads();
    for (int t = 0; t < kTile; ++t) acc += p_tile[threadIdx.y][t] * v_tile[t][threadIdx.x];
    __syncthreads();
  }
  if (i < dm.sq && c < dm.d) out[((b * dm.sq + i) * dm.h + h) * dm.d + c] = acc;
}

// ---- device buffers that free themselves
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  ~DeviceBuffer() {
    if (ptr_) cudaFree(ptr_);
  }
  cudaError_t allocate(size_t bytes) { return bytes ? cudaMalloc(&ptr_, bytes) : cudaSuccess; }
  template <class T = void>
  T* get() const {
    return static_cast<T*>(ptr_);
  }

 private:
  void* ptr_ = nullptr;
};

class EventPair {
 public:
  EventPair() {
    cudaEventCreate(&start_);
    cudaEventCreate(&stop_);
  }
  ~EventPair() {
    cudaEventDestroy(start_);
    cudaEventDestroy(stop_);
  }
  cudaEvent_t start_ = nullptr, stop_ = nullptr;
};

// Runs `launch` once untimed, then `reps` times (once if the warm-up took over long_run_s), each between
// two events on `stream`; fills median_ms / timed_runs / ok / error of m.
void time_on_stream(const std::function<std::string()>& launch, cudaStream_t stream, int reps, double long_run_s,
                    Measurement& m) {
  EventPair ev;
  std::vector<float> times;
  for (int run = 0; run <= reps; ++run) {
    cudaEventRecord(ev.start_, stream);
    const std::string error = launch();
    if (!error.empty()) {
      m.error = error;
      return;
    }
    cudaEventRecord(ev.stop_, stream);
    const cudaError_t e = cudaEventSynchronize(ev.stop_);
    if (e != cudaSuccess) {
      m.error = cuda_error(e, "running");
      return;
    }
    float ms = 0.0f;
    cudaEventElapsedTime(&ms, ev.start_, ev.stop_);
    if (run == 0) {
      if (ms * 1e-3 > long_run_s) reps = 1;
      continue;
    }
    times.push_back(ms);
  }
  std::sort(times.begin(), times.end());
  m.median_ms = times[times.size() / 2];
  m.timed_runs = static_cast<int>(times.size());
  m.ok = true;
}

float bf16_to_float(uint16_t h) {
  const uint32_t bits = static_cast<uint32_t>(h) << 16;
  float x;
  std::memcpy(&x, &bits, sizeof x);
  return x;
}

}  // namespace

CudaDeviceInfo cuda_device_info() {
  CudaDeviceInfo info;
  int count = 0;
  const cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess || count == 0) {
    info.error = e != cudaSuccess ? cuda_error(e, "cudaGetDeviceCount") : "no CUDA device";
    cudaGetLastError();  // clear it
    return info;
  }
  cudaDeviceProp prop{};
  cudaGetDeviceProperties(&prop, 0);
  info.count = count;
  info.name = prop.name;
  info.sm_count = prop.multiProcessorCount;
  info.major = prop.major;
  info.minor = prop.minor;
  info.memory_gib = static_cast<double>(prop.totalGlobalMem) / (kMiB * 1024.0);
  return info;
}

CudaRow run_cuda_row(const AttentionShape& s, int reps, double long_run_s, double budget_bytes, uint64_t seed) {
  CudaRow row;
  const int64_t q_count = s.batch * s.seqlen_q * s.nheads * s.headdim;
  const int64_t kv_count = s.batch * s.seqlen_k * s.nheads * s.headdim;
  auto fail_both = [&](const std::string& why) {
    row.flare.error = row.naive.error = why;
    return row;
  };
  cudaSetDevice(0);
  cudaStream_t stream = nullptr;
  cudaError_t e = cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
  if (e != cudaSuccess) return fail_both(cuda_error(e, "cudaStreamCreate"));
  struct StreamGuard {
    cudaStream_t s;
    ~StreamGuard() { cudaStreamDestroy(s); }
  } stream_guard{stream};

  DeviceBuffer q, k, v, flare_out, naive_out;
  const std::pair<DeviceBuffer*, int64_t> buffers[] = {  // bf16 q, k, v and flare's out; the naive out is fp32
      {&q, q_count * 2}, {&k, kv_count * 2}, {&v, kv_count * 2}, {&flare_out, q_count * 2}, {&naive_out, q_count * 4}};
  for (const auto& [buf, bytes] : buffers) {
    if ((e = buf->allocate(static_cast<size_t>(bytes))) != cudaSuccess)
      return fail_both(cuda_error(e, "allocating inputs and outputs"));
  }
  int grid = 0;
  cudaDeviceGetAttribute(&grid, cudaDevAttrMultiProcessorCount, 0);
  fill_normal_bf16<<<grid * 8, 256, 0, stream>>>(q.get<__nv_bfloat16>(), q_count, seed);
  fill_normal_bf16<<<grid * 8, 256, 0, stream>>>(k.get<__nv_bfloat16>(), kv_count, seed + (1ull << 40));
  fill_normal_bf16<<<grid * 8, 256, 0, stream>>>(v.get<__nv_bfloat16>(), kv_count, seed + (2ull << 40));
  if ((e = cudaStreamSynchronize(stream)) != cudaSuccess) return fail_both(cuda_error(e, "generating inputs"));

  // ---- flare
  const flare_device dev = {FLARE_DEVICE_CUDA, 0};
  const int64_t q_shape[4] = {s.batch, s.seqlen_q, s.nheads, s.headdim};
  const int64_t kv_shape[4] = {s.batch, s.seqlen_k, s.nheads, s.headdim};
  flare_fwd_params p;
  flare_fwd_params_init(&p);
  p.q = flare_tensor_contiguous(q.get(), FLARE_DTYPE_BF16, dev, 4, q_shape);
  p.k = flare_tensor_contiguous(k.get(), FLARE_DTYPE_BF16, dev, 4, kv_shape);
  p.v = flare_tensor_contiguous(v.get(), FLARE_DTYPE_BF16, dev, 4, kv_shape);
  p.out = flare_tensor_contiguous(flare_out.get(), FLARE_DTYPE_BF16, dev, 4, q_shape);
  p.attn.causal = s.causal ? 1 : 0;  // softmax_scale 0: 1/sqrt(headdim), as the naive way uses
  p.exec.stream = stream;
  size_t workspace_bytes = 0;
  DeviceBuffer workspace;
  flare_status st = flare_fwd_workspace_size(&p, 0, &workspace_bytes);
  if (st != FLARE_OK) {
    row.flare.error = std::string(flare_status_string(st)) + ": " + flare_last_error();
  } else if ((e = workspace.allocate(workspace_bytes)) != cudaSuccess) {
    row.flare.error = cuda_error(e, "allocating flare's workspace");
  } else {
    p.exec.workspace = workspace.get();
    p.exec.workspace_size = workspace_bytes;
    time_on_stream(
        [&]() -> std::string {
          const flare_status status = flare_fwd(&p);
          return status == FLARE_OK ? "" : std::string(flare_status_string(status)) + ": " + flare_last_error();
        },
        stream, reps, long_run_s, row.flare);
    row.flare.extra_mib = static_cast<double>(workspace_bytes) / kMiB;
  }

  // ---- the naive way
  row.naive_scores_bytes = static_cast<double>(naive_scores_bytes(s));
  if (row.naive_scores_bytes > budget_bytes) {
    row.naive_skipped = true;
    return row;
  }
  DeviceBuffer scores;
  if ((e = scores.allocate(naive_scores_bytes(s))) != cudaSuccess) {
    cudaGetLastError();
    row.naive.error = cuda_error(e, "allocating the score matrix");
    return row;
  }
  const Dims dm{s.seqlen_q, s.seqlen_k, s.nheads, s.headdim};
  const float scale = 1.0f / std::sqrt(static_cast<float>(s.headdim));
  const dim3 tile(kTile, kTile);
  const dim3 score_grid((s.seqlen_k + kTile - 1) / kTile, (s.seqlen_q + kTile - 1) / kTile, s.batch * s.nheads);
  const dim3 pv_grid((s.headdim + kTile - 1) / kTile, (s.seqlen_q + kTile - 1) / kTile, s.batch * s.nheads);
  const unsigned rows = static_cast<unsigned>(s.batch * s.nheads * s.seqlen_q);
  time_on_stream(
      [&]() -> std::string {
        naive_scores<<<score_grid, tile, 0, stream>>>(q.get<__nv_bfloat16>(), k.get<__nv_bfloat16>(),
                                                      scores.get<float>(), dm, scale, s.causal);
        naive_softmax<<<rows, kSoftmaxThreads, 0, stream>>>(scores.get<float>(), s.seqlen_k);
        naive_pv<<<pv_grid, tile, 0, stream>>>(scores.get<float>(), v.get<__nv_bfloat16>(), naive_out.get<float>(),
                                               dm);
        const cudaError_t launch = cudaGetLastError();
        return launch == cudaSuccess ? "" : cuda_error(launch, "launching the naive kernels");
      },
      stream, reps, long_run_s, row.naive);
  row.naive.extra_mib = row.naive_scores_bytes / kMiB;

  // ---- compare
  if (row.flare.ok && row.naive.ok) {
    std::vector<uint16_t> mine(static_cast<size_t>(q_count));
    std::vector<float> theirs(static_cast<size_t>(q_count));
    cudaMemcpy(mine.data(), flare_out.get(), mine.size() * 2, cudaMemcpyDeviceToHost);
    cudaMemcpy(theirs.data(), naive_out.get(), theirs.size() * 4, cudaMemcpyDeviceToHost);
    double max_diff = 0.0;
    for (size_t i = 0; i < mine.size(); ++i) {
      const double d = std::fabs(static_cast<double>(bf16_to_float(mine[i])) - theirs[i]);
      if (!(d <= max_diff)) max_diff = d;  // also catches NaN
    }
    row.max_abs_diff = max_diff;
  }
  return row;
}

}  // namespace flare_demo

// flare_demo.cpp — what flare buys you, shown through its public C ABI (include/flare/flare.h) only.
//
// For a few sequence lengths it runs causal attention with flare and the naive way (the full score matrix
// S = QK^T materialised in fp32, softmax, then P·V; naive_attention.cpp), and prints for each:
// time, peak extra memory (each variant in its own forked process, child_measure.hpp) and the
// largest difference between the two outputs. The naive way is skipped where its score matrix alone
// would exceed the memory budget; the table then says what it would have needed.
//
//   flare_demo                 1 x 8 heads x headdim 128, seqlen 1024 / 4096 / 16384, fp32 and bf16
//   flare_demo --quick         small sizes, a few seconds (the smoke test)
//   flare_demo --help          every option
//
// Devices: --device auto (the default) runs on the GPU when the demo was built with CUDA (FLARE_DEMO_CUDA,
// set by tools/CMakeLists.txt when FLARE_ENABLE_CUDA is on), libflare has its CUDA backend and a CUDA
// device is present; otherwise on the CPU, exactly as a CPU-only build does. On the GPU the rows are bf16
// at seqlen 1024 / 4096 / 16384 / 65536, the naive way is a set of plain CUDA kernels materialising S in
// fp32 (cuda_demo.cu), times come from CUDA events and memory is the device memory each
// variant allocates beyond the inputs and outputs.
#include <flare/flare.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "child_measure.hpp"
#include "naive_attention.hpp"
#ifdef FLARE_DEMO_CUDA
#include "cuda_demo.hpp"
#endif

namespace {

using flare_demo::AttentionShape;
using flare_demo::Measurement;
using flare_demo::Region;
using flare_demo::SharedBuffer;

constexpr double kMiB = 1024.0 * 1024.0;
constexpr double kGiB = 1024.0 * kMiB;
// Largest |flare - naive| accepted: fp32 differs by summation order only; bf16 output is rounded to
// 8 significant bits (|out| < ~1 here, so half an ulp is <= 2^-9) on top of bf16 probabilities.
constexpr double kToleranceF32 = 1e-4;
constexpr double kToleranceBF16 = 2e-2;
// After a warm-up longer than this, one timed run is enough (keeps the long rows to seconds).
constexpr double kLongRunSeconds = 1.0;

enum class Dtype { f32, bf16 };
enum class Device { automatic, cpu, cuda };

const char* dtype_name(Dtype d) { return d == Dtype::f32 ? "fp32" : "bf16"; }
size_t dtype_bytes(Dtype d) { return d == Dtype::f32 ? 4 : 2; }

// ---- bf16 <-> fp32 (round to nearest even; inputs here are finite)
uint16_t to_bf16(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  bits += 0x7FFFu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}
float from_bf16(uint16_t h) {
  const uint32_t bits = static_cast<uint32_t>(h) << 16;
  float x;
  std::memcpy(&x, &bits, sizeof x);
  return x;
}

// ---- options
struct Options {
  bool quick = false;
  std::vector<int64_t> seqlens = {1024, 4096, 16384};
  int64_t batch = 1, nheads = 8, headdim = 128;
  std::vector<Dtype> dtypes = {Dtype::f32, Dtype::bf16};
  bool causal = true;
  double budget_gib = 4.0;  // the naive way runs only if its score matrix fits in this
  int reps = 3;
  Device device = Device::automatic;  // resolve_device() makes it cpu or cuda
  bool seqlens_given = false, budget_given = false;
  std::string device_note;  // why auto chose the CPU, when a GPU build could not use the GPU
};

void print_usage(std::FILE* to, const char* argv0) {
  std::fprintf(to,
               "usage: %s [options]\n"
               "  --quick             small sizes (seqlen 256, 1024; 4 heads; headdim 64): a few seconds\n"
               "  --seqlens A,B,...   sequence lengths (default 1024,4096,16384)\n"
               "  --batch N           (default 1)\n"
               "  --heads N           (default 8)\n"
               "  --headdim N         (default 128)\n"
               "  --dtypes LIST       fp32, bf16 or fp32,bf16 (default)\n"
               "  --no-causal         full attention instead of causal\n"
               "  --budget-gib X      run the naive way only if its score matrix fits in X GiB (default 4;\n"
               "                      40 on the GPU)\n"
               "  --reps N            timed runs per variant after one warm-up (default 3; 1 for long runs)\n"
               "  --device auto|cpu|cuda\n"
               "                      auto (default): the GPU when this build, libflare and the machine have one\n"
               "                      (then bf16 only, seqlen 1024,4096,16384,65536 unless given), else the CPU\n"
               "  --isa               print the CPU SIMD level flare uses here (flare_cpu_isa()) and exit\n",
               argv0);
}

[[noreturn]] void usage_error(const char* argv0, const std::string& message) {
  std::fprintf(stderr, "flare_demo: %s\n", message.c_str());
  print_usage(stderr, argv0);
  std::exit(2);
}

int64_t parse_positive(const char* argv0, const std::string& name, const std::string& text) {
  char* end = nullptr;
  const long long v = std::strtoll(text.c_str(), &end, 10);
  if (end == text.c_str() || *end != '\0' || v <= 0)
    usage_error(argv0, name + " wants a positive integer, got '" + text + "'");
  return v;
}

std::vector<std::string> split_commas(const std::string& text) {
  std::vector<std::string> parts;
  size_t start = 0;
  while (start <= text.size()) {
    const size_t comma = std::min(text.find(',', start), text.size());
    parts.push_back(text.substr(start, comma - start));
    start = comma + 1;
  }
  return parts;
}

Options parse_options(int argc, char** argv) {
  Options o;
  bool quick_sizes = false;
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i], value;
    const size_t eq = arg.find('=');
    if (eq != std::string::npos) {
      value = arg.substr(eq + 1);
      arg = arg.substr(0, eq);
    }
    auto next_value = [&]() -> std::string {
      if (eq != std::string::npos) return value;
      if (i + 1 >= argc) usage_error(argv[0], arg + " needs a value");
      return argv[++i];
    };
    if (arg == "--help" || arg == "-h") {
      print_usage(stdout, argv[0]);
      std::exit(0);
    } else if (arg == "--isa") {  // for scripts: which SIMD level would run here
      std::printf("%s\n", flare_cpu_isa());
      std::exit(0);
    } else if (arg == "--quick") {
      o.quick = quick_sizes = true;
    } else if (arg == "--seqlens") {
      o.seqlens.clear();
      for (const std::string& s : split_commas(next_value()))
        o.seqlens.push_back(parse_positive(argv[0], arg, s));
      quick_sizes = false;
      o.seqlens_given = true;
    } else if (arg == "--batch") {
      o.batch = parse_positive(argv[0], arg, next_value());
    } else if (arg == "--heads") {
      o.nheads = parse_positive(argv[0], arg, next_value());
    } else if (arg == "--headdim") {
      o.headdim = parse_positive(argv[0], arg, next_value());
    } else if (arg == "--dtypes") {
      o.dtypes.clear();
      for (const std::string& s : split_commas(next_value())) {
        if (s == "fp32")
          o.dtypes.push_back(Dtype::f32);
        else if (s == "bf16")
          o.dtypes.push_back(Dtype::bf16);
        else
          usage_error(argv[0], "unknown dtype '" + s + "' (fp32 or bf16)");
      }
    } else if (arg == "--no-causal") {
      o.causal = false;
    } else if (arg == "--budget-gib") {
      const std::string v = next_value();
      o.budget_gib = std::atof(v.c_str());
      if (!(o.budget_gib > 0.0))
        usage_error(argv[0], "--budget-gib wants a positive number, got '" + v + "'");
      o.budget_given = true;
    } else if (arg == "--reps") {
      o.reps = static_cast<int>(parse_positive(argv[0], arg, next_value()));
    } else if (arg == "--device") {
      const std::string v = next_value();
      if (v == "auto")
        o.device = Device::automatic;
      else if (v == "cpu")
        o.device = Device::cpu;
      else if (v == "cuda")
        o.device = Device::cuda;
      else
        usage_error(argv[0], "unknown device '" + v + "' (auto, cpu or cuda)");
    } else {
      usage_error(argv[0], "unknown option '" + arg + "'");
    }
  }
  if (o.quick) {  // --quick sets small sizes; an explicit --seqlens after it still wins
    if (quick_sizes) o.seqlens = {256, 1024};
    o.nheads = std::min<int64_t>(o.nheads, 4);
    o.headdim = std::min<int64_t>(o.headdim, 64);
    o.reps = std::min(o.reps, 2);
  }
  return o;
}

// auto -> cuda or cpu (see the top of the file); an explicit --device cuda that cannot run is an error.
// On the GPU the defaults change: bf16 only, longer sequences, a larger budget for the naive way's S.
void resolve_device(Options& o, const char* argv0) {
  if (o.device == Device::cpu) return;
  std::string why_not;
#ifdef FLARE_DEMO_CUDA
  const flare_demo::CudaDeviceInfo gpu = flare_demo::cuda_device_info();
  if (!flare_has_cuda())
    why_not = "libflare was built without its CUDA backend (-DFLARE_ENABLE_CUDA=ON)";
  else if (gpu.count == 0)
    why_not = "no CUDA device (" + gpu.error + ")";
#else
  why_not = "flare_demo was built without CUDA (configure with -DFLARE_ENABLE_CUDA=ON)";
#endif
  if (!why_not.empty()) {
    if (o.device == Device::cuda) {
      std::fprintf(stderr, "flare_demo: --device cuda: %s\n", why_not.c_str());
      std::exit(2);
    }
#ifdef FLARE_DEMO_CUDA
    o.device_note = why_not;  // a CUDA build on a machine without a GPU: say why it runs on the CPU
#endif
    o.device = Device::cpu;
    return;
  }
  o.device = Device::cuda;
  if (!o.seqlens_given && !o.quick) o.seqlens = {1024, 4096, 16384, 65536};
  if (!o.budget_given && !o.quick) o.budget_gib = 40.0;
  const size_t before = o.dtypes.size();
  o.dtypes.erase(std::remove(o.dtypes.begin(), o.dtypes.end(), Dtype::f32), o.dtypes.end());
  if (o.dtypes.empty()) usage_error(argv0, "the CUDA path takes bf16 (fp16) only: --dtypes bf16");
  if (o.dtypes.size() < before) o.device_note = "fp32 rows left out: flare's CUDA path takes fp16/bf16";
}

// ---- inputs: fresh normal random values; for bf16 the fp32 copy holds exactly the rounded values, so
// both variants see identical numbers.
class Random {
 public:
  explicit Random(uint64_t seed) : state_(seed) {}
  double uniform() { return (next() >> 11) * 0x1.0p-53; }  // [0, 1)
  float normal() {
    if (has_spare_) {
      has_spare_ = false;
      return spare_;
    }
    const double u1 = std::max(uniform(), 0x1.0p-53), u2 = uniform();
    const double radius = std::sqrt(-2.0 * std::log(u1)), angle = 2.0 * M_PI * u2;
    spare_ = static_cast<float>(radius * std::sin(angle));
    has_spare_ = true;
    return static_cast<float>(radius * std::cos(angle));
  }

 private:
  uint64_t next() {  // splitmix64
    uint64_t z = (state_ += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  uint64_t state_;
  float spare_ = 0.0f;
  bool has_spare_ = false;
};

struct Tensor {  // one input in both forms
  std::vector<float> f32;
  std::vector<uint16_t> bf16;  // empty for fp32 problems
  const void* data(Dtype d) const {
    return d == Dtype::f32 ? static_cast<const void*>(f32.data()) : bf16.data();
  }
};

Tensor random_tensor(size_t count, Dtype dtype, Random& rng) {
  Tensor t;
  t.f32.resize(count);
  for (float& x : t.f32) x = rng.normal();
  if (dtype == Dtype::bf16) {
    t.bf16.resize(count);
    for (size_t i = 0; i < count; ++i) {
      t.bf16[i] = to_bf16(t.f32[i]);
      t.f32[i] = from_bf16(t.bf16[i]);
    }
  }
  return t;
}

// ---- flare through the C ABI
std::string run_flare_cpu(const AttentionShape& s, Dtype dtype, const void* q, const void* k, const void* v,
                          void* out) {
  const flare_dtype dt = dtype == Dtype::f32 ? FLARE_DTYPE_F32 : FLARE_DTYPE_BF16;
  const flare_device cpu = {FLARE_DEVICE_CPU, 0};
  const int64_t q_shape[4] = {s.batch, s.seqlen_q, s.nheads, s.headdim};
  const int64_t kv_shape[4] = {s.batch, s.seqlen_k, s.nheads, s.headdim};
  flare_fwd_params p;
  flare_fwd_params_init(&p);
  p.q = flare_tensor_contiguous(const_cast<void*>(q), dt, cpu, 4, q_shape);
  p.k = flare_tensor_contiguous(const_cast<void*>(k), dt, cpu, 4, kv_shape);
  p.v = flare_tensor_contiguous(const_cast<void*>(v), dt, cpu, 4, kv_shape);
  p.out = flare_tensor_contiguous(out, dt, cpu, 4, q_shape);
  p.attn.causal = s.causal ? 1 : 0;  // softmax_scale 0 = 1/sqrt(headdim), as the naive way uses
  const flare_status status = flare_fwd(&p);
  if (status != FLARE_OK) return std::string(flare_status_string(status)) + ": " + flare_last_error();
  return "";
}


// ---- reporting
std::string format_bytes(double bytes, const char* prefix = "") {
  char buf[48];
  if (bytes >= kGiB)
    std::snprintf(buf, sizeof buf, "%s%.2f GiB", prefix, bytes / kGiB);
  else
    std::snprintf(buf, sizeof buf, "%s%.1f MiB", prefix, bytes / kMiB);
  return buf;
}

std::string format_ms(double ms) {
  char buf[32];
  std::snprintf(buf, sizeof buf, ms >= 100.0 ? "%.0f" : "%.2f", ms);
  return buf;
}

// BENCH.md's forward FLOP count: 4 * batch * nheads * seqlen_q * seqlen_k * headdim, halved when causal.
double forward_flops(const AttentionShape& s) {
  const double f = 4.0 * s.batch * s.nheads * s.seqlen_q * s.seqlen_k * s.headdim;
  return s.causal ? f / 2.0 : f;
}

struct Row {
  AttentionShape shape;
  Dtype dtype;
  Measurement flare, naive;
  bool naive_skipped = false;
  double naive_scores_bytes = 0.0;
  double max_abs_diff = -1.0;  // < 0: not compared
  bool mismatch = false;
};

#ifdef FLARE_DEMO_CUDA
// A GPU row (bf16): flare and the naive way on the device, measured in this process (cuda_demo.cu).
Row run_row_cuda(const Options& o, int64_t seqlen, uint64_t seed) {
  Row row;
  row.shape = {o.batch, seqlen, seqlen, o.nheads, o.headdim, o.causal};
  row.dtype = Dtype::bf16;
  std::printf(" flare and the naive way on the GPU ... ");
  std::fflush(stdout);
  const flare_demo::CudaRow r = flare_demo::run_cuda_row(row.shape, o.reps, kLongRunSeconds, o.budget_gib * kGiB, seed);
  row.flare = r.flare;
  row.naive = r.naive;
  row.naive_skipped = r.naive_skipped;
  row.naive_scores_bytes = r.naive_scores_bytes;
  row.max_abs_diff = r.max_abs_diff;
  row.mismatch = row.max_abs_diff >= 0.0 && !(row.max_abs_diff <= kToleranceBF16);
  if (row.flare.ok)
    std::printf("flare %s ms", format_ms(row.flare.median_ms).c_str());
  else
    std::printf("flare FAILED (%s)", row.flare.error.c_str());
  if (row.naive_skipped)
    std::printf(" | naive skipped: its score matrix needs %s", format_bytes(row.naive_scores_bytes).c_str());
  else if (row.naive.ok)
    std::printf(" | naive %s ms", format_ms(row.naive.median_ms).c_str());
  else
    std::printf(" | naive FAILED (%s)", row.naive.error.c_str());
  if (row.max_abs_diff >= 0.0) std::printf(" | max|diff| %.2e%s", row.max_abs_diff, row.mismatch ? " MISMATCH" : "");
  std::printf("\n");
  return row;
}
#endif

Row run_row(const Options& o, int64_t seqlen, Dtype dtype, uint64_t seed) {
#ifdef FLARE_DEMO_CUDA
  if (o.device == Device::cuda) return run_row_cuda(o, seqlen, seed);
#endif
  Row row;
  row.shape = {o.batch, seqlen, seqlen, o.nheads, o.headdim, o.causal};
  row.dtype = dtype;
  const AttentionShape& s = row.shape;
  const size_t q_count = static_cast<size_t>(s.batch * s.seqlen_q * s.nheads * s.headdim);
  const size_t kv_count = static_cast<size_t>(s.batch * s.seqlen_k * s.nheads * s.headdim);

  Random rng(seed);
  const Tensor q = random_tensor(q_count, dtype, rng), k = random_tensor(kv_count, dtype, rng),
               v = random_tensor(kv_count, dtype, rng);
  SharedBuffer flare_out(q_count * dtype_bytes(dtype)), naive_out(q_count * sizeof(float));
  const std::vector<Region> resident = {
      {q.data(dtype), q_count * dtype_bytes(dtype)},  {k.data(dtype), kv_count * dtype_bytes(dtype)},
      {v.data(dtype), kv_count * dtype_bytes(dtype)}, {q.f32.data(), q_count * sizeof(float)},
      {k.f32.data(), kv_count * sizeof(float)},       {v.f32.data(), kv_count * sizeof(float)},
      {flare_out.data(), flare_out.bytes()},          {naive_out.data(), naive_out.bytes()}};

  std::printf(" flare ... ");
  std::fflush(stdout);
  row.flare = flare_demo::measure_in_child(
      [&] {
        return run_flare_cpu(s, dtype, q.data(dtype), k.data(dtype), v.data(dtype), flare_out.data());
      },
      resident, o.reps, kLongRunSeconds);
  if (row.flare.ok)
    std::printf("%s ms, +%s", format_ms(row.flare.median_ms).c_str(),
                format_bytes(row.flare.extra_mib * kMiB).c_str());
  else
    std::printf("FAILED (%s)", row.flare.error.c_str());

  row.naive_scores_bytes = static_cast<double>(flare_demo::naive_scores_bytes(s));
  if (row.naive_scores_bytes > o.budget_gib * kGiB) {
    row.naive_skipped = true;
    std::printf(" | naive skipped: its score matrix needs %s\n",
                format_bytes(row.naive_scores_bytes).c_str());
    return row;
  }
  std::printf(" | naive ... ");
  std::fflush(stdout);
  float* naive_result = static_cast<float*>(naive_out.data());
  row.naive = flare_demo::measure_in_child(
      [&]() -> std::string {
        if (!flare_demo::naive_attention(s, q.f32.data(), k.f32.data(), v.f32.data(), naive_result))
          return "could not allocate the " + format_bytes(row.naive_scores_bytes) + " score matrix";
        return "";
      },
      resident, o.reps, kLongRunSeconds);
  if (!row.naive.ok) {
    std::printf("FAILED (%s)\n", row.naive.error.c_str());
    return row;
  }
  std::printf("%s ms, +%s", format_ms(row.naive.median_ms).c_str(),
              format_bytes(row.naive.extra_mib * kMiB).c_str());

  if (row.flare.ok) {
    double max_diff = 0.0;
    for (size_t i = 0; i < q_count; ++i) {
      const float f = dtype == Dtype::f32 ? static_cast<const float*>(flare_out.data())[i]
                                          : from_bf16(static_cast<const uint16_t*>(flare_out.data())[i]);
      const double d = std::fabs(static_cast<double>(f) - naive_result[i]);
      if (!(d <= max_diff)) max_diff = d;  // also catches NaN
    }
    row.max_abs_diff = max_diff;
    row.mismatch = !(max_diff <= (dtype == Dtype::f32 ? kToleranceF32 : kToleranceBF16));
    std::printf(" | max|diff| %.2e%s", max_diff, row.mismatch ? " MISMATCH" : "");
  }
  std::printf("\n");
  return row;
}

void print_table(const std::vector<Row>& rows, bool gpu) {
  // The GPU reports TFLOP/s, the CPU GFLOP/s: each in the unit its figures are read in.
  const double unit = gpu ? 1e-12 : 1e-9;
  std::printf("\n%7s %5s | %10s %8s %10s %8s | %11s %15s | %10s\n", "seqlen", "dtype", "flare ms",
              gpu ? "TFLOP/s" : "GFLOP/s", "naive ms", "speedup", "flare mem", "naive mem", "max|diff|");
  std::printf("%s\n", std::string(102, '-').c_str());
  for (const Row& r : rows) {
    std::string flare_ms = "failed", gflops = "-", flare_mem = "-";
    if (r.flare.ok) {
      flare_ms = format_ms(r.flare.median_ms);
      char buf[32];
      std::snprintf(buf, sizeof buf, "%.1f", forward_flops(r.shape) / (r.flare.median_ms * 1e-3) * unit);
      gflops = buf;
      flare_mem = format_bytes(r.flare.extra_mib * kMiB, "+");
    }
    std::string naive_ms = "failed", speedup = "-", naive_mem = "-", diff = "-";
    if (r.naive_skipped) {
      naive_ms = "skipped";
      naive_mem = format_bytes(r.naive_scores_bytes, "needs ");
    } else if (r.naive.ok) {
      naive_ms = format_ms(r.naive.median_ms);
      naive_mem = format_bytes(r.naive.extra_mib * kMiB, "+");
      if (r.flare.ok) {
        char buf[32];
        std::snprintf(buf, sizeof buf, "%.1fx", r.naive.median_ms / r.flare.median_ms);
        speedup = buf;
      }
    }
    if (r.max_abs_diff >= 0.0) {
      char buf[32];
      std::snprintf(buf, sizeof buf, "%.1e%s", r.max_abs_diff, r.mismatch ? " BAD" : "");
      diff = buf;
    }
    std::printf("%7lld %5s | %10s %8s %10s %8s | %11s %15s | %10s\n",
                static_cast<long long>(r.shape.seqlen_q), dtype_name(r.dtype), flare_ms.c_str(),
                gflops.c_str(), naive_ms.c_str(), speedup.c_str(), flare_mem.c_str(), naive_mem.c_str(),
                diff.c_str());
  }
}

#ifdef FLARE_DEMO_CUDA
void print_header_cuda(const Options& o) {
  const flare_demo::CudaDeviceInfo gpu = flare_demo::cuda_device_info();
  std::printf("flare %s demo: exact attention without the n x n score matrix\n", flare_version());
  std::printf("device: cuda:0, %s (sm_%d%d, %d SMs, %.0f GiB); flare's CUDA backend\n", gpu.name.c_str(),
              gpu.major, gpu.minor, gpu.sm_count, gpu.memory_gib);
  if (!o.device_note.empty()) std::printf("note: %s\n", o.device_note.c_str());
  std::printf("problem: batch %lld, %lld heads, headdim %lld, %s, forward, bf16; inputs fresh N(0,1) made on the GPU\n",
              static_cast<long long>(o.batch), static_cast<long long>(o.nheads),
              static_cast<long long>(o.headdim), o.causal ? "causal" : "not causal");
  std::printf(
      "naive way: S = QK^T/sqrt(d) materialised in fp32 on the GPU (batch x heads x seqlen^2 floats), masked,\n"
      "  softmax, then P.V, by plain CUDA kernels (no tensor cores); it runs only if S fits in %.1f GiB.\n",
      o.budget_gib);
  std::printf(
      "time: CUDA events, median of up to %d runs after one warm-up run (one run when the warm-up took over\n"
      "  %.0f s). memory: device memory a variant allocates beyond its inputs and output: flare's workspace\n"
      "  (flare_fwd_workspace_size; given one, flare allocates nothing), the naive way's S.\n\n",
      o.reps, kLongRunSeconds);
}
#endif

void print_header(const Options& o) {
#ifdef FLARE_DEMO_CUDA
  if (o.device == Device::cuda) return print_header_cuda(o);
#endif
  std::printf("flare %s demo: exact attention without the n x n score matrix\n", flare_version());
  std::printf("device: %s; CPU SIMD level: %s; OpenMP threads: %d; CUDA backend in this build: %s\n",
              o.device == Device::cpu ? "cpu" : "cuda", flare_cpu_isa(), omp_get_max_threads(),
              flare_has_cuda() ? "yes" : "no");
  if (!o.device_note.empty()) std::printf("note: %s: running on the CPU\n", o.device_note.c_str());
  std::printf("problem: batch %lld, %lld heads, headdim %lld, %s, forward; inputs fresh N(0,1)\n",
              static_cast<long long>(o.batch), static_cast<long long>(o.nheads),
              static_cast<long long>(o.headdim), o.causal ? "causal" : "not causal");
  std::printf(
      "naive way: S = QK^T/sqrt(d) materialised in fp32 (batch x heads x seqlen^2 floats), masked, softmax,\n"
      "  then P.V; plain loops, OpenMP over rows; it reads the same (bf16-rounded) values in fp32, and runs\n"
      "  only if S fits in %.1f GiB.\n",
      o.budget_gib);
  std::printf(
      "time: median of up to %d runs after one warm-up run (one run when the warm-up took over %.0f s).\n"
      "memory: each variant runs in its own forked process with inputs and outputs already resident;\n"
      "  'mem' = peak resident set (VmHWM) after its runs minus resident set (VmRSS) before them: all the\n"
      "  memory it allocated and touched (flare's scratch, the naive way's S, thread stacks).\n\n",
      o.reps, kLongRunSeconds);
}

}  // namespace

int main(int argc, char** argv) {
  Options o = parse_options(argc, argv);
  resolve_device(o, argv[0]);
  // The parent stays serial (no OpenMP region) so that forked children can start their own threads.
  print_header(o);

  std::vector<Row> rows;
  const size_t total = o.seqlens.size() * o.dtypes.size();
  uint64_t seed = 20261201;
  for (int64_t seqlen : o.seqlens) {
    for (Dtype dtype : o.dtypes) {
      std::printf("[%zu/%zu] seqlen %lld, %s:", rows.size() + 1, total, static_cast<long long>(seqlen),
                  dtype_name(dtype));
      rows.push_back(run_row(o, seqlen, dtype, seed++));
    }
  }
  print_table(rows, o.device == Device::cuda);

  bool failed = false;
  for (const Row& r : rows) failed = failed || !r.flare.ok || r.mismatch || (!r.naive_skipped && !r.naive.ok);
  std::printf("\n%s\n", failed ? "FAILED: see the rows above" : "all rows ok");
  return failed ? 1 : 0;
}

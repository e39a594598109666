// dispatch.cpp — the CPU backend's entry points: picks the SIMD level once per process, secures scratch
// (the caller's workspace or one allocation) before anything is written, and runs the pass.
#include <omp.h>
#if defined(__linux__)
#  include <sys/syscall.h>
#  include <unistd.h>
#endif

#include <cstdlib>
#include <cstring>
#include <memory>
#include <new>
#include <string>

#include "api/error.hpp"
#include "cpu/cpu_backend.hpp"
#include "cpu/isa_kernels.hpp"

namespace flare::cpu {
namespace {

using detail::Problem;

struct Kernels {
  const char* name;
  size_t (*forward_scratch)(const Problem&, int);
  void (*forward)(const Problem&, void*, int);
  size_t (*backward_scratch)(const Problem&, int);
  void (*backward)(const Problem&, void*, int);
};

constexpr Kernels kAmx{"amx", amx::forward_scratch, amx::forward, amx::backward_scratch, amx::backward};
constexpr Kernels kAvx512{"avx512", avx512::forward_scratch, avx512::forward, avx512::backward_scratch,
                          avx512::backward};
constexpr Kernels kAvx2{"avx2", avx2::forward_scratch, avx2::forward, avx2::backward_scratch, avx2::backward};
constexpr Kernels kGeneric{"generic", generic::forward_scratch, generic::forward, generic::backward_scratch,
                           generic::backward};

// Linux hands out the AMX tile state only on request, once per process.
bool request_amx_permission() {
#if defined(__linux__) && defined(SYS_arch_prctl)
  constexpr long kArchReqXcompPerm = 0x1023;
  constexpr long kXfeatureXtiledata = 18;
  return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
#else
  return false;
#endif
}

// The best level the processor supports, lowered by FLARE_CPU_ISA if set (never raised).
const Kernels& select_kernels() {
  int level = 0;
#if defined(FLARE_X86)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) level = 1;
  if (level == 1 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
      __builtin_cpu_supports("avx512bf16"))
    level = 2;
  if (level == 2 && __builtin_cpu_supports("amx-tile") && __builtin_cpu_supports("amx-bf16")) level = 3;
#endif
  if (const char* forced = std::getenv("FLARE_CPU_ISA")) {
    int wanted = level;
    if (std::strcmp(forced, "generic") == 0) wanted = 0;
    if (std::strcmp(forced, "avx2") == 0) wanted = 1;
    if (std::strcmp(forced, "avx512") == 0) wanted = 2;
    level = wanted < level ? wanted : level;
  }
  if (level == 3 && !request_amx_permission()) level = 2;
  switch (level) {
    case 3: return kAmx;
    case 2: return kAvx512;
    case 1: return kAvx2;
    default: return kGeneric;
  }
}

const Kernels& kernels() {
  static const Kernels& chosen = select_kernels();
  return chosen;
}

// The caller's num_threads, or by default OpenMP's thread count cut for small problems: waking a thread
// and meeting it at barriers costs more than a few MFLOP of work (and much more when the cores are shared
// with other processes). The count depends only on the problem, so results stay reproducible.
int thread_count(const Problem& p) {
  if (p.num_threads > 0) return p.num_threads;
  constexpr double kFlopsPerThread = 16e6;
  const double pass_factor = p.pass == detail::Pass::kBackward ? 2.5 : 1.0;
  const double keys = static_cast<double>(p.pass == detail::Pass::kKvCache ? p.seqlen_cache : p.seqlen_k);
  const double flops = 2.0 * pass_factor * static_cast<double>(p.batch) * static_cast<double>(p.nheads) *
                       static_cast<double>(p.seqlen_q) * keys * static_cast<double>(p.headdim + p.headdim_v);
  const int by_work = static_cast<int>(flops / kFlopsPerThread);
  const int most = omp_get_max_threads();
  return by_work < 1 ? 1 : by_work < most ? by_work : most;
}

// Runs pass with scratch of `bytes`: the caller's workspace when given (validated to be large enough),
// else one allocation; fails with OUT_OF_MEMORY before anything is written.
template <class Run>
flare_status with_scratch(const Problem& p, size_t bytes, Run run) {
  if (p.workspace != nullptr) {
    run(p.workspace);
    return FLARE_OK;
  }
  std::unique_ptr<char[]> scratch(new (std::nothrow) char[bytes]);
  if (!scratch)
    return detail::fail(FLARE_OUT_OF_MEMORY, "could not allocate " + std::to_string(bytes) +
                                                 " bytes of CPU scratch; pass a workspace or use smaller inputs");
  run(scratch.get());
  return FLARE_OK;
}

}  // namespace

const char* isa_name() { return kernels().name; }

size_t workspace_size(const Problem& p) {
  const int nt = thread_count(p);
  switch (p.pass) {
    case detail::Pass::kBackward: return kernels().backward_scratch(p, nt);
    case detail::Pass::kKvCache: return kernels().forward_scratch(p, nt) + kvcache_extra_scratch(p);
    default: return kernels().forward_scratch(p, nt);
  }
}

flare_status forward(const Problem& p) {
  const int nt = thread_count(p);
  return with_scratch(p, kernels().forward_scratch(p, nt), [&](void* s) { kernels().forward(p, s, nt); });
}

flare_status backward(const Problem& p) {
  const int nt = thread_count(p);
  return with_scratch(p, kernels().backward_scratch(p, nt), [&](void* s) { kernels().backward(p, s, nt); });
}

flare_status kvcache(const Problem& p) {
  const int nt = thread_count(p);
  return with_scratch(p, workspace_size(p), [&](void* s) {
    char* base = static_cast<char*>(s);
    const Problem attend = kvcache_prepare(p, base + kernels().forward_scratch(p, nt), nt);
    kernels().forward(attend, base, nt);
  });
}

}  // namespace flare::cpu

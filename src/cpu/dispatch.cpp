// dispatch.cpp — the CPU backend's entry points: picks the SIMD level once per process, secures scratch
// (the caller's workspace or one allocation) before anything is written, and runs the pass.
#include <omp.h>

#include <algorithm>
#include <atomic>
#if defined(__linux__)
#  include <sys/mman.h>
#  include <sys/syscall.h>
#  include <unistd.h>
#endif

#include <cstdlib>
#include <cstring>
#include <memory>
#include <new>
#include <string>

#include "common/error.hpp"
#include "cpu/cpu_backend.hpp"
#if defined(FLARE_X86)
#  include "cpu/amx_support.hpp"
#endif
#include "cpu/isa_kernels.hpp"

namespace flare::cpu {
namespace {

using detail::Problem;

struct Kernels {
  const char* name;
  size_t (*forward_scratch)(const Problem&, int);
  void (*forward)(const Problem&, void*, int);
  size_t (*decode_scratch)(const Problem&, int);
  void (*decode)(const Problem&, void*, int);
  size_t (*backward_scratch)(const Problem&, int);
  void (*backward)(const Problem&, void*, int);
};

// The levels, lowest first; each needs the one below it. Their names are what FLARE_CPU_ISA takes and
// flare_cpu_isa() reports.
constexpr Kernels kLevels[] = {
#define FLARE_LEVEL(isa)                                                                                    \
  {#isa, isa::forward_scratch, isa::forward, isa::decode_scratch, isa::decode, isa::backward_scratch, isa::backward}
    FLARE_LEVEL(generic), FLARE_LEVEL(avx2), FLARE_LEVEL(avx512), FLARE_LEVEL(avx512bf16), FLARE_LEVEL(amx),
#undef FLARE_LEVEL
};
enum Level : int { kGeneric, kAvx2, kAvx512, kAvx512Bf16, kAmx };

// Linux hands out the AMX tile state only on request, once per process.
[[maybe_unused]] bool request_amx_permission() {
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
  int level = kGeneric;
#if defined(FLARE_X86)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) level = kAvx2;
  if (level == kAvx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq"))
    level = kAvx512;
  if (level == kAvx512 && __builtin_cpu_supports("avx512bf16")) level = kAvx512Bf16;
#if defined(FLARE_AMX_EMULATE)
  if (level == kAvx512Bf16) level = kAmx;  // tiles emulated in software (amx.hpp)
#else
  if (level == kAvx512Bf16 && amx_bf16_supported()) level = kAmx;
#endif
#endif
  if (const char* forced = std::getenv("FLARE_CPU_ISA")) {
    for (int wanted = kGeneric; wanted < level; ++wanted)
      if (std::strcmp(forced, kLevels[wanted].name) == 0) level = wanted;
  }
#if !defined(FLARE_AMX_EMULATE)
  if (level == kAmx && !request_amx_permission()) level = kAvx512Bf16;
#endif
  return kLevels[level];
}

const Kernels& kernels() {
  static const Kernels& chosen = select_kernels();
  return chosen;
}

// Bytes of one element of the call's dtype (q, k, v and the outputs).
int64_t element_bytes(flare_dtype dtype) { return dtype == FLARE_DTYPE_F64 ? 8 : dtype == FLARE_DTYPE_F32 ? 4 : 2; }

// The caller's num_threads, or by default OpenMP's thread count cut for small problems: waking a thread
// and meeting it at barriers costs more than a few MFLOP of work or a few hundred KiB of rows read and
// written (and much more when the cores are shared with other processes). The bytes matter where the keys
// are few: 60 sequences of 239 queries against one key each are 15 MFLOP but 29 MB of fp32 q and out, on
// one thread half as fast as on two. The count depends only on the problem, so results stay reproducible.
int thread_count(const Problem& p) {
  if (p.num_threads > 0) return p.num_threads;
  constexpr double kFlopsPerThread = 16e6;
  constexpr double kBytesPerThread = 512.0 * 1024;
  const double pass_factor = p.pass == detail::Pass::kBackward ? 2.5 : 1.0;
  const double keys = static_cast<double>(p.pass == detail::Pass::kKvCache ? p.seqlen_cache : p.seqlen_k);
  const double width = static_cast<double>(p.headdim + p.headdim_v);
  const double flops = 2.0 * pass_factor * static_cast<double>(p.batch) * static_cast<double>(p.nheads) *
                       static_cast<double>(p.seqlen_q) * keys * width;
  const double rows = static_cast<double>(p.seqlen_q) * static_cast<double>(p.nheads) +
                      keys * static_cast<double>(p.nheads_k);  // q and out, k and v rows of one sequence
  const double bytes = pass_factor * static_cast<double>(element_bytes(p.dtype)) * static_cast<double>(p.batch) *
                       rows * width;
  const int most = omp_get_max_threads();
  // Compared in double: past 2^31 threads' worth of work the count would not fit an int.
  const double by_work = std::max(flops / kFlopsPerThread, bytes / kBytesPerThread);
  if (!(by_work < most)) return most;
  return by_work < 1 ? 1 : static_cast<int>(by_work);
}

// The pass's scratch bytes on nt threads; SIZE_MAX when they do not fit in size_t.
size_t scratch_size(const Problem& p, int nt) {
  switch (p.pass) {
    case detail::Pass::kBackward: return kernels().backward_scratch(p, nt);
    case detail::Pass::kKvCache: {
      size_t total = 0;
      const size_t attend = use_decode_path(p) ? kernels().decode_scratch(p, nt) : kernels().forward_scratch(p, nt);
      if (__builtin_add_overflow(attend, kvcache_extra_scratch(p), &total)) return SIZE_MAX;
      return total;
    }
    default: return use_decode_path(p) ? kernels().decode_scratch(p, nt) : kernels().forward_scratch(p, nt);
  }
}

// The scratch size, or FLARE_OUT_OF_MEMORY (with the figures) when it does not fit in size_t: no machine
// could provide it, and the layout's pointers would wrap around.
flare_status checked_scratch_size(const Problem& p, int nt, size_t* bytes) {
  *bytes = scratch_size(p, nt);
  if (*bytes != SIZE_MAX) return FLARE_OK;
  return detail::fail(FLARE_OUT_OF_MEMORY,
                      detail::cat("the CPU scratch of this call exceeds 2^64 bytes (", nt, " threads, batch ", p.batch,
                                  ", seqlen_q ", p.seqlen_q, ", seqlen_k up to ", p.seqlen_k, ", ", p.nheads,
                                  " heads, head dims ", p.headdim, "/", p.headdim_v,
                                  "): use fewer threads or smaller inputs"));
}

// Scratch of small calls (a decode step of a few sequences, a few KiB to hundreds) is kept per calling thread and
// reused: malloc and free showed as about a tenth of the library's time in such a call (perf, a 16-key decode
// step). At most this much stays allocated per thread that has called flare.
constexpr size_t kKeptScratchBytes = size_t{1} << 20;

// Scratch of larger calls, up to kKeptLargeBytes, comes from one block kept for the process and lent to one call
// at a time (a call that finds it lent allocates its own). Allocated per call, a block above glibc's largest
// mmap threshold (32 MiB) comes back as fresh pages every time, and the pass takes a page fault per 4 KiB of it:
// the bf16 backward at head dim 512 (55 MiB of scratch on two threads) took 14,000 a call, which the same pass
// at head dim 256 (28 MiB, reused from the heap) did not (docs/tuning-cpu.md). The block grows to the largest
// scratch asked of it, page-aligned, and is freed at exit; a call with a caller's workspace never touches it. No
// pass reads scratch it has not written.
constexpr size_t kKeptLargeBytes = size_t{256} << 20;
constexpr size_t kPage = 4096;

// Taken and given back with one atomic flag, no mutex: a process that forks while a call holds the block leaves
// its child a block marked lent (the child's calls allocate their own) rather than a lock it can never take.
class KeptBlock {
 public:
  // The block, grown to at least `bytes`; nullptr when another call holds it or it cannot grow.
  char* lend(size_t bytes) {
    bool lent = false;
    if (!lent_.compare_exchange_strong(lent, true, std::memory_order_acquire)) return nullptr;
    if (bytes_ < bytes) {  // block_ and bytes_ belong to the holder of lent_
      block_.reset();
      bytes_ = 0;
      const size_t size = (bytes + kPage - 1) / kPage * kPage;
      block_.reset(static_cast<char*>(std::aligned_alloc(kPage, size)));
      if (!block_) {
        give_back();
        return nullptr;
      }
      bytes_ = size;
    }
    return block_.get();
  }
  void give_back() { lent_.store(false, std::memory_order_release); }

 private:
  struct Free {
    void operator()(char* p) const { std::free(p); }
  };
  std::atomic<bool> lent_{false};
  std::unique_ptr<char, Free> block_;
  size_t bytes_ = 0;
};

// Runs pass with scratch of `bytes`: the caller's workspace when given (validated to be large enough),
// else the calling thread's kept block (small calls), the process's kept block (larger ones) or one
// allocation; fails with OUT_OF_MEMORY before anything is written.
template <class Run>
flare_status with_scratch(const Problem& p, int nt, Run run) {
  size_t bytes = 0;
  if (flare_status s = checked_scratch_size(p, nt, &bytes); s != FLARE_OK) return s;
  if (p.workspace != nullptr) {
    run(p.workspace);
    return FLARE_OK;
  }
  if (bytes <= kKeptScratchBytes) {
    thread_local std::unique_ptr<char[]> kept;
    thread_local size_t kept_bytes = 0;
    if (kept_bytes < bytes) {
      kept.reset(new (std::nothrow) char[bytes]);
      kept_bytes = kept ? bytes : 0;
    }
    if (kept) {
      run(kept.get());
      return FLARE_OK;
    }
  } else if (bytes <= kKeptLargeBytes) {
    static KeptBlock large;
    if (char* block = large.lend(bytes)) {
      const struct Lease {
        KeptBlock& from;
        ~Lease() { from.give_back(); }
      } lease{large};
      run(block);
      return FLARE_OK;
    }
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

int max_threads() {
  const int procs = omp_get_num_procs();
  const int most = procs > kMaxThreadsFloor ? procs : kMaxThreadsFloor;
  const int limit = omp_get_thread_limit();
  return limit < most ? limit : most;
}

flare_status workspace_size(const Problem& p, size_t* bytes) { return checked_scratch_size(p, thread_count(p), bytes); }

// ---- fresh outputs --------------------------------------------------------------------------------------
//
// A large output just allocated by the caller (torch.empty above glibc's mmap threshold: every call at
// FlashAttention's race shapes) has no pages yet, and the pass's first write to each 4 KB page takes a page
// fault: on the 2-core Zen 4 VM about 1.3 us a page on two threads, a third to half of some calls.
// madvise(MADV_POPULATE_WRITE) (Linux 5.14) faults a range in with one system call per thread: 94 MiB
// populated and then written took 22-24 ms on two threads against 29-32 ms for the writes alone. On pages
// already there it would cost 0.1-0.2 us a page for nothing, so it runs only where the page in the middle of
// the output is not resident (malloc writes the first). Contents are untouched (fresh pages read as zero
// either way) and every page populated is one the pass writes: dense outputs only, each written in full.
#if defined(__linux__)
#  ifndef MADV_POPULATE_WRITE
#    define MADV_POPULATE_WRITE 23
#  endif
#endif
namespace {

constexpr size_t kPopulateMinBytes = size_t{8} << 20;

// Faults in [data, data + bytes) on nt threads where it is large and fresh (above). Errors are ignored:
// older kernels, and memory madvise cannot populate, take their page faults in the pass as before.
void populate_if_fresh(void* data, size_t bytes, int nt) {
#if defined(__linux__)
  if (data == nullptr || bytes < kPopulateMinBytes) return;
  const long page_size = sysconf(_SC_PAGESIZE);
  if (page_size <= 0) return;
  const uintptr_t page = static_cast<uintptr_t>(page_size);
  const uintptr_t lo = (reinterpret_cast<uintptr_t>(data) + page - 1) & ~(page - 1);
  const uintptr_t hi = (reinterpret_cast<uintptr_t>(data) + bytes) & ~(page - 1);
  if (hi <= lo) return;
  const uintptr_t pages = (hi - lo) / page;
  unsigned char resident = 1;
  if (mincore(reinterpret_cast<void*>(lo + pages / 2 * page), page, &resident) != 0 || (resident & 1)) return;
#  pragma omp parallel for schedule(static) num_threads(nt)
  for (int t = 0; t < nt; ++t) {
    const uintptr_t first = lo + pages * t / nt * page, last = lo + pages * (t + 1) / nt * page;
    if (last > first) madvise(reinterpret_cast<void*>(first), last - first, MADV_POPULATE_WRITE);
  }
#else
  (void)data, (void)bytes, (void)nt;
#endif
}

// An output of batch x seqlen rows of heads x dim elements, when it is one dense block (batch, seqlen, heads,
// dim) row-major: its pages, if fresh, are faulted in before the pass (populate_if_fresh).
void populate_output(const Problem& p, const detail::Operand& x, int64_t seqlen, int64_t heads, int64_t dim,
                     int nt) {
  if (p.varlen || x.data == nullptr) return;
  const int64_t row = heads * dim;
  if (x.head_stride != dim || x.row_stride != row || (p.batch > 1 && x.batch_stride != seqlen * row)) return;
  populate_if_fresh(x.data, static_cast<size_t>(p.batch * seqlen * row * element_bytes(p.dtype)), nt);
}

}  // namespace

flare_status forward(const Problem& p) {
  const int nt = thread_count(p);
  return with_scratch(p, nt, [&](void* s) {
    populate_output(p, p.out, p.seqlen_q, p.nheads, p.headdim_v, nt);
    if (use_decode_path(p)) {
      kernels().decode(p, s, nt);
    } else {
      kernels().forward(p, s, nt);
    }
  });
}

flare_status backward(const Problem& p) {
  const int nt = thread_count(p);
  return with_scratch(p, nt, [&](void* s) {
    populate_output(p, p.dq, p.seqlen_q, p.nheads, p.headdim, nt);
    populate_output(p, p.dk, p.seqlen_k, p.nheads_k, p.headdim, nt);
    populate_output(p, p.dv, p.seqlen_k, p.nheads_k, p.headdim_v, nt);
    kernels().backward(p, s, nt);
  });
}

flare_status kvcache(const Problem& p) {
  const int nt = thread_count(p);
  return with_scratch(p, nt, [&](void* s) {
    char* base = static_cast<char*>(s);
    if (use_decode_path(p)) {
      const Problem attend = kvcache_prepare(p, base + kernels().decode_scratch(p, nt), nt);
      kernels().decode(attend, base, nt);
      return;
    }
    const Problem attend = kvcache_prepare(p, base + kernels().forward_scratch(p, nt), nt);
    kernels().forward(attend, base, nt);
  });
}

}  // namespace flare::cpu

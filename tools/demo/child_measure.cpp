// child_measure.cpp — fork, measure, report back through shared memory (see child_measure.hpp).
#include "child_measure.hpp"

#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <new>
#include <string>

namespace flare_demo {
namespace {

constexpr size_t kPageBytes = 4096;

// What the child writes back; a plain struct in a shared mapping.
struct ChildReport {
  int ok;
  int timed_runs;
  double median_ms;
  long baseline_kib;
  long peak_kib;
  char error[512];
};

// A field of /proc/self/status in KiB ("VmRSS", "VmHWM"), or -1.
long proc_status_kib(const char* field) {
  FILE* f = std::fopen("/proc/self/status", "r");
  if (f == nullptr) return -1;
  char line[256];
  long value = -1;
  const size_t n = std::strlen(field);
  while (std::fgets(line, sizeof line, f) != nullptr) {
    if (std::strncmp(line, field, n) == 0 && line[n] == ':') {
      value = std::strtol(line + n + 1, nullptr, 10);
      break;
    }
  }
  std::fclose(f);
  return value;
}

void touch_pages(const Region& r) {
  const volatile unsigned char* p = static_cast<const volatile unsigned char*>(r.data);
  unsigned char sink = 0;
  for (size_t i = 0; i < r.bytes; i += kPageBytes) sink ^= p[i];
  if (r.bytes > 0) sink ^= p[r.bytes - 1];
  (void)sink;
}

double elapsed_ms(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
}

// The child's whole life: never returns.
[[noreturn]] void child_main(ChildReport* report, const RunOnce& run_once,
                             const std::vector<Region>& resident, int reps, double long_run_s) {
  for (const Region& r : resident) touch_pages(r);
  report->baseline_kib = proc_status_kib("VmRSS");

  auto fail = [&](const std::string& message) {
    std::snprintf(report->error, sizeof report->error, "%s", message.c_str());
    report->peak_kib = proc_status_kib("VmHWM");
    std::fflush(nullptr);
    _exit(1);
  };

  auto start = std::chrono::steady_clock::now();
  std::string err = run_once();  // warm-up: first-touch page faults, thread pool start
  if (!err.empty()) fail(err);
  const double warmup_ms = elapsed_ms(start);

  const int runs = warmup_ms > long_run_s * 1e3 ? 1 : std::max(1, reps);
  std::vector<double> times;
  for (int r = 0; r < runs; ++r) {
    start = std::chrono::steady_clock::now();
    err = run_once();
    times.push_back(elapsed_ms(start));
    if (!err.empty()) fail(err);
  }
  std::sort(times.begin(), times.end());
  const size_t mid = times.size() / 2;
  report->median_ms = times.size() % 2 == 1 ? times[mid] : 0.5 * (times[mid - 1] + times[mid]);
  report->timed_runs = runs;
  report->peak_kib = proc_status_kib("VmHWM");
  report->ok = 1;
  std::fflush(nullptr);
  _exit(0);
}

}  // namespace

SharedBuffer::SharedBuffer(size_t bytes) : bytes_(bytes) {
  void* p =
      mmap(nullptr, std::max<size_t>(bytes, 1), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) throw std::bad_alloc();
  data_ = p;
  std::memset(data_, 0, bytes_);  // allocate every page now, so children find them resident
}

SharedBuffer::~SharedBuffer() { munmap(data_, std::max<size_t>(bytes_, 1)); }

Measurement measure_in_child(const RunOnce& run_once, const std::vector<Region>& resident, int reps,
                             double long_run_s) {
  SharedBuffer shared(sizeof(ChildReport));
  auto* report = static_cast<ChildReport*>(shared.data());

  std::fflush(nullptr);  // or the child would flush the parent's buffered output a second time
  const pid_t pid = fork();
  Measurement m;
  if (pid < 0) {
    m.error = std::string("fork failed: ") + std::strerror(errno);
    return m;
  }
  if (pid == 0) child_main(report, run_once, resident, reps, long_run_s);

  int status = 0;
  if (waitpid(pid, &status, 0) < 0) {
    m.error = std::string("waitpid failed: ") + std::strerror(errno);
    return m;
  }
  if (WIFSIGNALED(status)) {
    const int sig = WTERMSIG(status);
    m.error = "child killed by signal " + std::to_string(sig) + " (" + strsignal(sig) + ")";
    if (sig == SIGKILL) m.error += "; the kernel's out-of-memory killer is the usual cause";
    return m;
  }
  if (report->peak_kib >= 0 && report->baseline_kib >= 0)
    m.extra_mib = std::max(0L, report->peak_kib - report->baseline_kib) / 1024.0;
  if (!report->ok) {
    m.error = report->error[0] != '\0' ? report->error
                                       : "child exited with status " + std::to_string(WEXITSTATUS(status));
    return m;
  }
  m.ok = true;
  m.median_ms = report->median_ms;
  m.timed_runs = report->timed_runs;
  return m;
}

}  // namespace flare_demo

// child_measure.hpp — runs one variant of the demo in a forked child process and measures it there.
//
// Why a child: peak resident memory (VmHWM) only ever grows within a process, so each variant gets a
// fresh process that starts from the parent's state (inputs and outputs already resident) and reports
//   extra_mib = VmHWM after the runs - VmRSS before them
// i.e. every byte the variant allocated and touched on top of its inputs and outputs: flare's scratch,
// the naive way's score matrix, OpenMP thread stacks. The parent must not have started OpenMP threads
// before forking (a forked child cannot use the parent's thread pool); the demo keeps the parent serial.
#pragma once

#include <cstddef>
#include <functional>
#include <string>
#include <vector>

namespace flare_demo {

struct Measurement {
  bool ok = false;
  std::string error;       // why not ok: the variant's own message, or how the child died
  double median_ms = 0.0;  // median over the timed runs (after one untimed warm-up run)
  int timed_runs = 0;
  double extra_mib = 0.0;  // peak resident memory beyond the baseline, see above
};

// A memory range the child reads once before taking its baseline, so shared pages (outputs the child
// writes back to the parent) are resident before the baseline and not counted as extra.
struct Region {
  const void* data;
  size_t bytes;
};

// One run of the variant: returns "" on success or an error message.
using RunOnce = std::function<std::string()>;

// Forks, pre-touches `resident`, runs `run_once` once untimed and then `reps` times timed (once if the
// warm-up took longer than `long_run_s`), and returns what the child measured.
Measurement measure_in_child(const RunOnce& run_once, const std::vector<Region>& resident, int reps,
                             double long_run_s);

// Memory that a forked child can write and the parent read afterwards (MAP_SHARED | MAP_ANONYMOUS),
// zero-filled and resident. Freed by the destructor.
class SharedBuffer {
 public:
  explicit SharedBuffer(size_t bytes);
  ~SharedBuffer();
  SharedBuffer(const SharedBuffer&) = delete;
  SharedBuffer& operator=(const SharedBuffer&) = delete;
  void* data() const { return data_; }
  size_t bytes() const { return bytes_; }

 private:
  void* data_ = nullptr;
  size_t bytes_ = 0;
};

}  // namespace flare_demo

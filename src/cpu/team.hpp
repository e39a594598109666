// team.hpp — running a kernel's parallel body on nt threads, or on the calling thread alone.
#pragma once

namespace flare::cpu {

// Runs body() on a team of nt threads (an OpenMP parallel region: the body's worksharing loops split over
// it), or, for nt <= 1, on the calling thread with no region at all: its worksharing loops are then orphaned
// and run whole there. A region of one thread still ends in libgomp's team barrier, two futex system calls
// per call (about 1 us of a 3 us decode step on the CPU: docs/tuning-cpu.md).
template <class Body>
inline void on_team(int nt, Body&& body) {
  if (nt > 1) {
#pragma omp parallel num_threads(nt)
    body();
  } else {
    body();
  }
}

}  // namespace flare::cpu

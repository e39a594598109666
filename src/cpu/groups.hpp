// groups.hpp — how a pass spreads over threads. Work is organised by (sequence, kv head) group: a group's
// keys are packed once and serve all its query heads. With many groups each thread takes whole groups with
// packs of its own (no barriers; results independent of the thread count); with few, the whole team enters
// every group and splits its work with worksharing loops (team_loop).
#pragma once

#include <omp.h>

#include <type_traits>

#include "cpu/arena.hpp"
#include "cpu/sequences.hpp"
#include "cpu/team.hpp"

namespace flare::cpu::FLARE_ISA {

// Private packs of all threads together take at most this much scratch: past it the team shares one pack.
// A pack holds a group's keys (the backward's also its queries), so private packs cost nt times the keys a
// call uses; shared, a long KV cache or sequence costs its keys once (a 1-query decode over 131072 keys at
// head dim 128 takes one 128 MiB fp32 pack, not one per thread).
inline constexpr int64_t kPrivatePacksBudget = int64_t{128} << 20;

// Whether each thread takes whole groups: when there are enough of them to keep every thread busy — many
// groups, or, where every sequence has the same lengths (dense batches), a multiple of the team — and the
// packs of all threads stay within kPrivatePacksBudget.
inline bool use_private_groups(const Problem& p, int nt) {
  if (nt == 1) return true;
  const int64_t groups = p.batch * p.nheads_k;
  const bool equal_groups = !p.varlen && p.pass != Pass::kKvCache;
  if (groups < 4 * nt && !(equal_groups && groups % nt == 0)) return false;
  const Lengths most = longest_sequence(p);
  const int64_t rows = most.keys + (p.pass == Pass::kBackward ? most.queries : 0);
  const int64_t element = p.dtype == FLARE_DTYPE_F64 ? 8 : 4;  // the compute type, at most
  // rows < 2^32, headdim + headdim_v <= 576 + 512, nt <= a few thousand: no overflow.
  return rows * (p.headdim + p.headdim_v) * element * nt <= kPrivatePacksBudget;
}

// Bytes of scratch an engine lays out for this problem (measured by laying it out on a null base).
template <class Engine>
inline size_t scratch_bytes(const Problem& p, int nt) {
  Arena a;
  typename Engine::Scratch ws;
  ws.layout(a, p, nt);
  return a.used();
}

// Units of work (key blocks, query tiles) a task takes when an engine would take up to `most` at a time:
// `most`, or fewer where a team sharing a group would otherwise leave some of its nt threads without a task.
template <bool Shared>
inline int64_t units_per_task(int64_t most, int64_t units, int nt) {
  if constexpr (Shared) return smax<int64_t>(1, smin<int64_t>(most, units / nt));
  return most;
}

enum class Schedule { kStatic, kRoundRobin, kDynamic };

// Runs f(i) for i in [0, n): split over the team when Shared (a worksharing loop, so every thread of the
// team must reach it), else all on the calling thread.
template <bool Shared, Schedule S = Schedule::kStatic, class F>
inline void team_loop(int64_t n, F f) {
  if constexpr (!Shared) {
    for (int64_t i = 0; i < n; ++i) f(i);
  } else if constexpr (S == Schedule::kRoundRobin) {
#pragma omp for schedule(static, 1)
    for (int64_t i = 0; i < n; ++i) f(i);
  } else if constexpr (S == Schedule::kDynamic) {
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < n; ++i) f(i);
  } else {
#pragma omp for schedule(static)
    for (int64_t i = 0; i < n; ++i) f(i);
  }
}

// Groups a thread takes at a time with private groups: all kv heads of a sequence where the sequences are
// of equal lengths and enough to go round (four per thread), else one (unequal sequences balance better group
// by group). The heads of a sequence share every row of the outputs (q, out, dq, dk, dv are (batch, seqlen,
// heads, dim)), so with whole sequences per thread each output page is written by one thread: the first touch
// of a fresh allocation (a page fault per 4 KB) never waits on another thread faulting the same page or page
// table. It matters where writing the outputs is most of a call: FlashAttention's race shapes, few keys or few
// queries per sequence (docs/tuning-cpu.md).
inline int64_t batch_chunk(const Problem& p, int nt) {
  const bool equal_groups = !p.varlen && p.pass != Pass::kKvCache;
  return equal_groups && p.batch >= 4 * int64_t{nt} ? p.nheads_k : 1;
}

// Lays out Engine's scratch and runs Engine::group(p, seq, hk, ws, this thread's scratch) for every
// (sequence, kv head) group, one task per group handed out dynamically (a sequence's heads together where
// batch_chunk says so): the backwards that stream one side of short sequences (few_keys.hpp, few_queries.hpp).
template <class Engine>
inline void run_group_tasks(const Problem& p, void* scratch, int nt) {
  Arena arena(scratch);
  typename Engine::Scratch ws;
  ws.layout(arena, p, nt);
  const int64_t chunk = batch_chunk(p, nt);
#pragma omp parallel for num_threads(nt) schedule(dynamic, chunk) collapse(2)
  for (int64_t b = 0; b < p.batch; ++b)
    for (int64_t hk = 0; hk < p.nheads_k; ++hk)
      Engine::group(p, sequence_of(p, b), hk, ws, ws.threads[omp_get_thread_num()]);
}

// Lays out the engine's scratch and runs group(ws, seq, hk, tid, shared) for every group on a team of nt
// threads; `shared` is std::true_type when the whole team runs the group together.
template <class Engine, class Group>
inline void run_groups(const Problem& p, void* scratch, int nt, Group group) {
  Arena arena(scratch);
  typename Engine::Scratch ws;
  ws.layout(arena, p, nt);
  const bool private_groups = use_private_groups(p, nt);

  on_team(nt, [&]() {
    const int tid = omp_get_thread_num();
    Engine::thread_begin();
    if (private_groups) {
      const int64_t chunk = batch_chunk(p, nt);
#pragma omp for schedule(dynamic, chunk) collapse(2)
      for (int64_t b = 0; b < p.batch; ++b)
        for (int64_t hk = 0; hk < p.nheads_k; ++hk) group(ws, sequence_of(p, b), hk, tid, std::false_type{});
    } else {
      for (int64_t b = 0; b < p.batch; ++b)
        for (int64_t hk = 0; hk < p.nheads_k; ++hk) group(ws, sequence_of(p, b), hk, tid, std::true_type{});
    }
    Engine::thread_end();
  });
}

}  // namespace flare::cpu::FLARE_ISA

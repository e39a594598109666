// pipeline.cuh — a ring of shared-memory stages that the producer fills with TMA copies and the consumer
// warpgroups drain with wgmma, synchronised by mbarriers: `full` completes when the producer has armed it and
// the copy's bytes have landed, `empty` when every consumer warpgroup has released the stage. One thread per
// consumer warpgroup releases (its wgmma reads are complete once the warpgroup has waited for them), so a
// release is one arrival per warpgroup rather than one per thread.
#pragma once

#include <cstdint>

#include <cutlass/arch/barrier.h>

namespace flare::cuda::sm90 {

// Where the producer or a consumer is in the ring: the stage and the parity of the ring's lap.
template <int kStages>
struct RingPos {
  int stage = 0;
  uint32_t phase = 0;

  __device__ __forceinline__ void advance() {
    if (++stage == kStages) {
      stage = 0;
      phase ^= 1;
    }
  }
};

template <int kStages>
struct TmaRing {
  uint64_t full[kStages];
  uint64_t empty[kStages];

  // One thread, before the block-wide sync that precedes any use.
  __device__ __forceinline__ void init(int consumer_warpgroups) {
    for (int s = 0; s < kStages; ++s) {
      cutlass::arch::ClusterTransactionBarrier::init(&full[s], 1);
      cutlass::arch::ClusterBarrier::init(&empty[s], consumer_warpgroups);
    }
  }

  // Producer: waits until the stage is free (a fresh ring starts free: the wait on the previous lap's parity
  // returns at once), arms its full barrier for `bytes` and returns it for the TMA copy to complete.
  __device__ __forceinline__ uint64_t& acquire(RingPos<kStages> pos, uint32_t bytes) {
    cutlass::arch::ClusterBarrier::wait(&empty[pos.stage], pos.phase ^ 1);
    cutlass::arch::ClusterTransactionBarrier::arrive_and_expect_tx(&full[pos.stage], bytes);
    return full[pos.stage];
  }

  // Consumer: waits until the stage's copy has landed.
  __device__ __forceinline__ void wait(RingPos<kStages> pos) {
    cutlass::arch::ClusterBarrier::wait(&full[pos.stage], pos.phase);
  }

  // Consumer: hands the stage back; `leader` is true for one thread of each consumer warpgroup.
  __device__ __forceinline__ void release(RingPos<kStages> pos, bool leader) {
    if (leader) cutlass::arch::ClusterBarrier::arrive(&empty[pos.stage]);
  }
};

}  // namespace flare::cuda::sm90

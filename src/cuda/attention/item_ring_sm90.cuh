// The work items of a CTA, passed from the one thread that draws them to the CTA's other roles.
//
// Every role of the forward kernel (the q/K producer thread, the V producer thread, the consumer
// warpgroups) must walk the same items in the same order, and a dynamic scheduler's draw is an
// atomic that only one thread may make. The q/K producer, which runs ahead of the others, draws
// and puts the k-th item into slot k % kSlots; the readers take it from there. Each slot has a
// pair of mbarriers: `full` (one arrival: the writer's) and `empty` (one arrival per reader), so
// the writer can run up to kSlots items ahead of the slowest reader and no further.
//
// The writer puts item k + 1 before it issues item k's loads (tile_scheduler.h's draw-ahead), so
// a reader never waits for an item whose put depends on loads the reader itself must consume
// first: the ring cannot deadlock the pipeline (the consumers read one item ahead of the one they
// compute).
#pragma once

#include <cstdint>

#include <cutlass/arch/barrier.h>

namespace sparsetrain::cuda::attn {

template <int kSlots>
struct ItemRing {
  int32_t index[kSlots];
  uint64_t full[kSlots];
  uint64_t empty[kSlots];

  // By one thread, before the CTA's barrier-init fence and __syncthreads.
  __device__ void init(uint32_t readers) {
    for (int s = 0; s < kSlots; ++s) {
      cutlass::arch::ClusterBarrier::init(&full[s], 1);
      cutlass::arch::ClusterBarrier::init(&empty[s], readers);
    }
  }

  // The writer: item number k (0, 1, ...). Waits until every reader has taken item k - kSlots.
  __device__ void put(uint32_t k, int32_t item) {
    const uint32_t s = k % kSlots, use = k / kSlots;
    if (use > 0) cutlass::arch::ClusterBarrier::wait(&empty[s], (use - 1) & 1);
    // The barrier helpers' asm has no memory clobber: volatile keeps the slot's store between
    // the wait and the arrival (mbarrier.arrive releases it to the readers).
    *reinterpret_cast<volatile int32_t*>(&index[s]) = item;
    cutlass::arch::ClusterBarrier::arrive(&full[s]);
  }

  // A reader: item number k, each reader taking k = 0, 1, ... in turn.
  __device__ int32_t get(uint32_t k) {
    const uint32_t s = k % kSlots, use = k / kSlots;
    cutlass::arch::ClusterBarrier::wait(&full[s], use & 1);
    const int32_t item = *reinterpret_cast<volatile int32_t*>(&index[s]);
    cutlass::arch::ClusterBarrier::arrive(&empty[s]);
    return item;
  }
};

}  // namespace sparsetrain::cuda::attn

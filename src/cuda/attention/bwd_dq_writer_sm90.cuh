// The backward's dQ writers (two producer threads, taking the partials in turn): each q tile x D
// fp32 partial from shared memory into the accumulator with a bulk TMA reduce-add; in the deterministic
// mode after waiting for the q tile's turn on its semaphore (the first turn stores), and releasing
// the next writer once the write has landed; and the primitives they synchronise with other CTAs
// through.
#pragma once

#include <cstdint>

#include "cuda/attention/bwd_traits_sm90.cuh"

namespace sparsetrain::cuda::attn {

using namespace cute;

// ---- synchronisation with other CTAs (deterministic dQ) ------------------------------------------

__device__ __forceinline__ int32_t load_acquire(const int32_t* p) {
  int32_t v;
  asm volatile("ld.acquire.gpu.global.s32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void add_release(int32_t* p, int32_t v) {
  asm volatile("red.release.gpu.global.add.s32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

__device__ __forceinline__ uint64_t global_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// Waits until *sem == turn and says whether it came. A turn that never comes can only mean a
// corrupt write order (the scheduler guarantees progress otherwise): after spin_limit_ns the wait
// records what it waited for in abandoned[0..3] (the dQ conversion kernel reports it), marks the
// run abandoned (later waits return at once) and gives up the order, so the kernel cannot hang.
// (No printf here: the writers run in the producer warpgroup with 40 or 24 registers.)
__device__ inline bool wait_turn(const int32_t* sem, int32_t turn, const BwdArgs& a) {
  if (load_acquire(sem) == turn) return true;
  const uint64_t start = global_ns();
  while (load_acquire(sem) != turn) {
    if (*reinterpret_cast<volatile int32_t*>(a.abandoned) != 0) return false;
    if (global_ns() - start > uint64_t(a.spin_limit_ns)) {
      if (atomicExch(a.abandoned, 1) == 0) {
        a.abandoned[1] = int32_t(sem - a.semaphores);
        a.abandoned[2] = turn;
        a.abandoned[3] = load_acquire(sem);
      }
      return false;
    }
  }
  return true;
}

__device__ __forceinline__ void bulk_store(float* gmem, const float* smem, uint32_t bytes) {
  const uint32_t s = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(gmem), "r"(s), "r"(bytes)
               : "memory");
}

__device__ __forceinline__ void bulk_reduce_add(float* gmem, const float* smem, uint32_t bytes) {
  const uint32_t s = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;" ::"l"(gmem), "r"(s),
               "r"(bytes)
               : "memory");
}

// Waits until at most N bulk groups of this thread are pending (their global writes included).
template <int N>
__device__ __forceinline__ void bulk_wait() {
  asm volatile("cp.async.bulk.wait_group %0;" ::"n"(N) : "memory");
}

// Writer kWriter of T::kDqWriters takes every kDqWriters-th partial (the CTA's visits counted in
// walk order). Each has one add in flight: it hands the buffer back once the add has read it, and
// releases the q tile's next writer as soon as the add has landed, not when a later partial
// arrives (on a long column that hand-off is on the deterministic mode's critical path once per
// (q tile, column)); meanwhile the other writers take the next partials. A writer never waits for
// a turn while holding a release back (its own add is retired first): what deadlock freedom
// needs (the argument, for any number of writers: attention_bwd_walk.h).
template <class T, int kWriter>
__device__ void bwd_write_dq(const typename T::Params& p, typename T::SharedStorage& ss) {
  const BwdArgs& a = p.args;
  const BwdTicketScheduler& sched = a.sched;
  int n_dq = 0;
  for (int n_item = 0;; ++n_item) {
    const int32_t ticket = read_ticket<T>(ss, n_item);
    if (!sched.valid(ticket)) break;
    const DqWorkItem w = sched.item(ticket);
    const int b = int(w.batch), column = int(w.column), sub_tile = int(w.sub_tile);
    // The same visits in the same order as the loader and the consumers (the walk is the one rule
    // of bwd_item_next); each waits for its own turn, whatever the order (attention_bwd_walk.h).
    BwdItemCursor cur = bwd_item_begin(a.lists, b, int(w.kv_head), a.group, column);
    BwdVisit visit;
    for (; bwd_item_next<kVisitTurn>(a.lists, b, column, cur, &visit); ++n_dq) {
      if (n_dq % T::kDqWriters != kWriter) continue;
      const int buf = n_dq % T::kDqBuffers;
      cutlass::arch::ClusterBarrier::wait(&ss.dq_full[buf], (n_dq / T::kDqBuffers) & 1);
      // int32: B * Hq * q tiles < 2^31 (the backend checks it).
      const int32_t tile = int32_t(bwd_q_tile_index(b, visit.q_head, a.heads_q, a.lists.num_q_tiles, visit.q_tile));
      // The deterministic mode's first writer of a q tile stores (the accumulator is never zeroed
      // there; the conversion kernel writes zeros for a tile nobody wrote). A writer whose wait
      // gave up stores too: the first write to land on a tile is then always a store, so even a
      // corrupt order leaves finite (if wrong) numbers, never the scratch's old bytes.
      bool store = false;
      if (a.deterministic) {
        const int32_t turn = dq_visit_turn(visit.turn, int32_t(a.sched.handout.sub_tiles), sub_tile);
        store = !wait_turn(a.semaphores + tile, turn, a) || turn == 0;
      }
      float* dst = a.dq_accum + int64_t(tile) * (T::kBlockM * T::kHeadDim);
      const float* src = ss.dq.data() + buf * (T::kBlockM * T::kHeadDim);
      if (store) bulk_store(dst, src, T::kDqBytes);
      else bulk_reduce_add(dst, src, T::kDqBytes);
      tma_store_arrive();
      tma_store_wait<0>();  // shared memory read: the buffer goes back to the consumers at once
      cutlass::arch::ClusterBarrier::arrive(&ss.dq_empty[buf]);
      if (a.deterministic) {
        // Landed in global memory: now the next writer may add to the tile. The release orders the
        // landed add before the semaphore (cumulative: the add is visible to this thread once the
        // wait returns); a __threadfence before it cost 3-5 % on short documents, 1-2 % at 128k (A / B, PERF).
        bulk_wait<0>();
        add_release(a.semaphores + tile, 1);
      }
    }
  }
}

// Writer `writer` (< T::kDqWriters), its index a compile-time constant: one register fewer in
// the producer warpgroup's 24 at 128-row q tiles.
template <class T, int kFirst = 0>
__device__ void bwd_write_dq_as(const typename T::Params& p, typename T::SharedStorage& ss, int writer) {
  if constexpr (kFirst < T::kDqWriters) {
    if (writer == kFirst) bwd_write_dq<T, kFirst>(p, ss);
    else bwd_write_dq_as<T, kFirst + 1>(p, ss, writer);
  }
}

}  // namespace sparsetrain::cuda::attn

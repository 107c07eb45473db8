// The forward's mainloop collective for sm_90a: TMA loads by a producer warpgroup, wgmma by two
// consumer warpgroups (64 query rows each), as in FlashAttention-3.
//
//   FwdTraits      fwd_traits_sm90.cuh: tiles, pipelines, shared memory, the two GEMMs, the TMA
//                  loads and o's TMA store
//   fwd_produce    one producer thread loads q (two buffers: the next item's q and first kv tiles
//                  load while the consumers finish the current item) and K, another V, walking the
//                  same valid tiles as the consumers (common/attention/attention_fwd_walk.h)
//   consumers      their loop over tiles and items is the kernel's (attention_fwd_sm90.cuh), from
//                  the pieces here and in mask_tile_sm90.cuh (shared with the backward) and
//                  softmax_sm90.cuh
#pragma once

#include <cuda_runtime.h>

#include "cuda/attention/attention_fwd_params.h"
#include "cuda/attention/attention_common_sm90.cuh"
#include "cuda/attention/fwd_traits_sm90.cuh"
#include "cuda/attention/item_ring_sm90.cuh"
#include "cuda/attention/mask_tile_sm90.cuh"
#include "cuda/attention/softmax_sm90.cuh"
#include "cuda/attention/tile_scheduler.h"

namespace sparsetrain::cuda::attn {

using namespace cute;

// One thread of the producer warpgroup per role: kLoadsV false loads q and K, true loads V (one
// instantiation per role: each keeps only its own state in the producer's few registers). Items
// come from the same scheduler as the consumers'; items without a valid tile load nothing.
template <class T, bool kLoadsV>
__device__ __forceinline__ void fwd_produce(const typename T::Params& p, typename T::SharedStorage& ss,
                                            typename T::PipelineK& pipe_k, typename T::PipelineV& pipe_v) {
  const FwdArgs& a = p.args;
  using QTile = Shape<Int<T::kBlockM>, Int<T::kHeadDim>>;
  using KVTile = Shape<Int<T::kBlockN>, Int<T::kHeadDim>>;
  // Tile n of the CTA's walk goes to stage n % stages (one counter, as the consumers count). A
  // producer's phase starts at 1: its first pass over the stages finds them empty without waiting.
  constexpr int kStages = kLoadsV ? T::kStagesV : T::kStagesK;
  using Pipeline = std::conditional_t<kLoadsV, typename T::PipelineV, typename T::PipelineK>;
  Pipeline& pipe = [&]() -> Pipeline& {
    if constexpr (kLoadsV) return pipe_v; else return pipe_k;
  }();
  auto& tma = kLoadsV ? p.tma_v : p.tma_k;
  Tensor sKV = make_tensor(make_smem_ptr(kLoadsV ? ss.v.data() : ss.k.data()),
                           std::conditional_t<kLoadsV, typename T::SmemLayoutV, typename T::SmemLayoutK>{});
  Tensor mKV = tma.get_tma_tensor(make_shape(a.seq_kv, int32_t(T::kHeadDim), a.heads_kv, a.batch));
  uint32_t n = 0;
  int q_loads = 0;
  const int group = a.heads_q / a.heads_kv;
  // Items: the q/K thread draws them and passes them on (item k + 1 is put before item k's loads
  // are issued: item_ring_sm90.cuh); the V thread takes them from the ring.
  const FwdTicketScheduler sched{a.records, a.num_items, a.ticket};
  uint32_t k = 0;  // items taken so far
  int it = sched.initial_work(blockIdx.x);
  if constexpr (kLoadsV) {
    it = ss.items.get(k);
  } else {
    ss.items.put(k, it);
  }
  for (int next; sched.valid(it); it = next, ++k) {
    if constexpr (kLoadsV) {
      next = ss.items.get(k + 1);
    } else {
      next = sched.next_work(it, gridDim.x);
      ss.items.put(k + 1, next);
    }
    const FwdWorkRecord rec = a.records[it];
    const FwdWorkItem w = fwd_work_item(rec.item, a.heads_q, a.q_tiles);
    const int row = fwd_mask_row(w.q_tile, T::kBlockM, a.lists.block_q);
    const WalkCounts counts{rec.partial, rec.full};
    const int length = walk_length(a.lists, counts);
    WalkTile tile{};
    int t = walk_next_valid(a.lists, counts, w.b, w.h, row, 0, &tile);
    if (t == length) continue;  // nothing to load: the consumers write o = 0, lse = -inf
    if constexpr (!kLoadsV) {
      const int buf = q_loads % T::kQBuffers, use = q_loads / T::kQBuffers;  // use: of this buffer
      if (use > 0) cutlass::arch::ClusterBarrier::wait(&ss.q_empty[buf], (use - 1) & 1);
      ++q_loads;
      Tensor sQ = make_tensor(make_smem_ptr(ss.q.data()), typename T::SmemLayoutQs{});
      Tensor mQ = p.tma_q.get_tma_tensor(make_shape(a.seq_q, int32_t(T::kHeadDim), a.heads_q, a.batch));
      Tensor gQ = local_tile(mQ(_, _, w.h, w.b), QTile{}, make_coord(w.q_tile, 0));
      auto [tQgQ, tQsQ] =
          tma_partition(p.tma_q, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sQ(_, _, buf)), group_modes<0, 2>(gQ));
      cutlass::arch::ClusterTransactionBarrier::arrive_and_expect_tx(&ss.q_full[buf], T::kQBytes);
      copy(p.tma_q.with(ss.q_full[buf]), tQgQ, tQsQ);
    }
    Tensor gKV = local_tile(mKV(_, _, w.h / group, w.b), KVTile{}, make_coord(_, 0));  // (N, D, tiles)
    auto [tg, ts] = tma_partition(tma, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sKV), group_modes<0, 2>(gKV));
    for (; t < length; t = walk_next_valid(a.lists, counts, w.b, w.h, row, t + 1, &tile), ++n) {
      const cutlass::PipelineState<kStages> state(n % kStages, ((n / kStages) & 1) ^ 1, n);
      pipe.producer_acquire(state);
      copy(tma.with(*pipe.producer_get_barrier(state), 0), tg(_, tile.tile), ts(_, state.index()));
    }
  }
}

}  // namespace sparsetrain::cuda::attn

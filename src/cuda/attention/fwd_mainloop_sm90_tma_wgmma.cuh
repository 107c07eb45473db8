// The forward's mainloop collective for sm_90a: TMA loads by a producer warpgroup, wgmma by two
// consumer warpgroups (64 query rows each), as in FlashAttention-3.
//
//   FwdTraits      tiles, pipelines (K: 2 stages, V: 3: V is held until the PV GEMM of the next
//                  iteration), shared memory, the two GEMMs (S = Q K^T from shared memory, O += P V
//                  with P straight from registers), the TMA loads and o's TMA store
//   fwd_produce    one producer thread loads q (two buffers: the next item's q and first kv tiles
//                  load while the consumers finish the current item) and K, another V, walking the
//                  same valid tiles as the consumers (common/attention_fwd_walk.h)
//   consumers      their loop over tiles and items is the kernel's (attention_fwd_sm90.cuh), from
//                  the pieces here and in mask_tile_sm90.cuh (shared with the backward) and
//                  softmax_sm90.cuh
#pragma once

#include <cuda_runtime.h>

#include "cuda/attention/attention_fwd_params.h"
#include "cuda/attention/attention_sm90_common.cuh"
#include "cuda/attention/item_ring_sm90.cuh"
#include "cuda/attention/mask_tile_sm90.cuh"
#include "cuda/attention/softmax_sm90.cuh"
#include "cuda/attention/tile_scheduler.h"

namespace sparsetrain::cuda::attn {

using namespace cute;

template <class Element_, int kHeadDim_>
struct FwdTraits {
  using Element = Element_;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockM = kTileQ, kBlockN = kTileKv;
  // Pipeline depth: V is held longer than K (until the PV GEMM of the next iteration), so it gets
  // one more stage; each has its own producer thread, so K never waits for a V slot.
  static constexpr int kStagesK = 2, kStagesV = 3;
  static constexpr int kConsumerWarpgroups = 2;
  static constexpr int kMmaThreads = 128 * kConsumerWarpgroups;
  static constexpr int kThreads = kMmaThreads + 128;  // + the producer warpgroup
  // setmaxnreg budgets (per thread; 2 x 128 x 232 + 128 x 40 <= the 168 x 384 the CTA starts
  // with): the consumers hold S, P and O (160 registers at D = 128) beside the walk and softmax
  // state; the producer threads walk the mask's lists (they spilled at 24). No instance spills:
  // the build checks it (CMakeLists.txt).
  static constexpr int kConsumerRegs = 232;
  static constexpr int kProducerRegs = 40;
  static_assert(register_split_fits(kThreads, kProducerRegs, kMmaThreads, kConsumerRegs), "setmaxnreg budgets");
  // The consumer warpgroups taking turns to issue GEMMs (see fwd_consume): off, it cost registers
  // and lost 8 %.
  static constexpr bool kPingPong = false;

  using TileQK = Shape<Int<kBlockM>, Int<kBlockN>, Int<kHeadDim>>;  // S = Q K^T: M x N x K
  using TilePV = Shape<Int<kBlockM>, Int<kHeadDim>, Int<kBlockN>>;  // O += P V: M x D x N
  using WarpgroupsAlongM = Layout<Shape<Int<kConsumerWarpgroups>, _1, _1>>;
  using MmaQK = decltype(make_tiled_mma(GMMA::ss_op_selector<Element, Element, float, TileQK>(), WarpgroupsAlongM{}));
  // V stays [kv, D] in shared memory (D contiguous): as PV's B operand (D x kv) it is MN-major.
  using MmaPV = decltype(make_tiled_mma(
      GMMA::rs_op_selector<Element, Element, float, TilePV, GMMA::Major::K, GMMA::Major::MN>(), WarpgroupsAlongM{}));

  using SmemAtom = decltype(smem_atom_k_major<Element, kHeadDim>());
  using SmemLayoutQ = decltype(tile_to_shape(SmemAtom{}, Shape<Int<kBlockM>, Int<kHeadDim>>{}));
  // Two q tiles: the producer loads the next item's q (and its first kv tiles) while the
  // consumers finish the current one.
  static constexpr int kQBuffers = 2;
  using SmemLayoutQs = decltype(tile_to_shape(SmemAtom{}, Shape<Int<kBlockM>, Int<kHeadDim>, Int<kQBuffers>>{}));
  using SmemLayoutK = decltype(tile_to_shape(SmemAtom{}, Shape<Int<kBlockN>, Int<kHeadDim>, Int<kStagesK>>{}));
  using SmemLayoutV = decltype(tile_to_shape(SmemAtom{}, Shape<Int<kBlockN>, Int<kHeadDim>, Int<kStagesV>>{}));
  using SmemLayoutVt = decltype(composition(
      SmemLayoutV{}, make_ordered_layout(Shape<Int<kHeadDim>, Int<kBlockN>, Int<kStagesV>>{}, Step<_2, _1, _3>{})));

  // Global q / k / v as TMA sees them: (S, D, H, B), D contiguous, any other strides.
  using GmemShape = Shape<int32_t, int32_t, int32_t, int32_t>;
  using GmemStride = Stride<int64_t, _1, int64_t, int64_t>;
  using GmemTensor =
      decltype(make_tensor(make_gmem_ptr(static_cast<Element const*>(nullptr)), GmemShape{}, GmemStride{}));
  using TmaQ = decltype(make_tma_copy(SM90_TMA_LOAD{}, GmemTensor{}, SmemLayoutQ{},
                                      Shape<Int<kBlockM>, Int<kHeadDim>>{}, _1{}));
  using TmaKV = decltype(make_tma_copy(SM90_TMA_LOAD{}, GmemTensor{}, take<0, 2>(SmemLayoutK{}),
                                       Shape<Int<kBlockN>, Int<kHeadDim>>{}, _1{}));
  // o [B, Sq, Hq, D] as the TMA store sees it, from one V stage ([kBlockN = kBlockM, D], the same
  // K-major swizzle as q's tile): an item's o is staged in the V stage its last PV GEMM read
  // (fwd_consume's store_o).
  static_assert(kBlockN == kBlockM, "o is staged in a V stage: the tiles must have as many rows");
  using SmemLayoutO = decltype(take<0, 2>(SmemLayoutV{}));
  using GmemTensorO = decltype(make_tensor(make_gmem_ptr(static_cast<Element*>(nullptr)), GmemShape{}, GmemStride{}));
  using TmaO = decltype(make_tma_copy(SM90_TMA_STORE{}, GmemTensorO{}, SmemLayoutO{},
                                     Shape<Int<kBlockM>, Int<kHeadDim>>{}, _1{}));
  static constexpr uint32_t kQBytes = kBlockM * kHeadDim * sizeof(Element);
  static constexpr uint32_t kKVBytes = kBlockN * kHeadDim * sizeof(Element);

  using PipelineK = cutlass::PipelineTmaAsync<kStagesK>;
  using PipelineV = cutlass::PipelineTmaAsync<kStagesV>;

  struct SharedStorage {
    array_aligned<Element, cosize_v<SmemLayoutQs>, 1024> q;
    array_aligned<Element, cosize_v<SmemLayoutK>, 1024> k;
    array_aligned<Element, cosize_v<SmemLayoutV>, 1024> v;
    typename PipelineK::SharedStorage pipe_k;
    typename PipelineV::SharedStorage pipe_v;
    uint64_t q_full[kQBuffers];   // the q tile landed (TMA transaction barrier)
    uint64_t q_empty[kQBuffers];  // the consumers are done with it (every consumer thread arrives)
    int32_t doc_kv[kConsumerWarpgroups][kBlockN];  // a partial tile's key document ids, per warpgroup
    // The CTA's work items, from the q/K producer (which draws them) to the V producer and the
    // consumers. The writer draws one item ahead and the consumers read one ahead, so a few slots
    // suffice; more only let the writer run further ahead over items without tiles.
    ItemRing<8> items;
  };
  static constexpr uint32_t kItemReaders = kMmaThreads + 1;  // every consumer thread and the V producer

  static_assert(sizeof(SharedStorage) <= 227 * 1024, "sm90 allows 227 KiB of shared memory per CTA");

  struct Params {
    FwdArgs args;
    TmaQ tma_q;
    TmaKV tma_k, tma_v;
    TmaO tma_o;
    float scale_log2;  // scale * log2(e): the softmax runs in base 2
  };
};

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

// The forward kernel's traits for sm_90a: tiles, pipelines (K: 2 stages, V: 3: V is held until the
// PV GEMM of the next iteration), setmaxnreg budgets, shared memory, the two GEMMs (S = Q K^T from
// shared memory, O += P V with P straight from registers), the TMA loads and o's TMA store
// (fwd_mainloop_sm90.cuh and attention_fwd_sm90.cuh compose them).
#pragma once

#include <cuda_runtime.h>

#include "cuda/attention/attention_common_sm90.cuh"
#include "cuda/attention/attention_fwd_params.h"
#include "cuda/attention/item_ring_sm90.cuh"

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
  // The consumer warpgroups taking turns to issue GEMMs (see fwd_consume): off, 1-4 % slower.
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

}  // namespace sparsetrain::cuda::attn

// The backward kernel's traits (tile sizes, GMMA atoms, shared-memory layouts and storage, TMA
// types, setmaxnreg budgets), the fragment order of a dQ partial, and the ticket ring through
// which the loader passes each work item to the other roles (attention_bwd_sm90.cuh composes them).
#pragma once

#include <algorithm>

#include "cuda/attention/attention_bwd_params.h"
#include "cuda/attention/attention_common_sm90.cuh"

namespace sparsetrain::cuda::attn {

using namespace cute;

template <class Element_, int kHeadDim_>
struct BwdTraits {
  using Element = Element_;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockM = bwd_tile_q(kHeadDim_), kBlockN = kBwdTileKv;
  static constexpr int kStages = 2;  // of Q, dO, lse, delta
  static constexpr int kMmaThreads = 256;
  static constexpr int kThreads = kMmaThreads + 128;
  // setmaxnreg budgets inside the CTA's pool (register_split_fits): 40 / 232, or FlashAttention-3's
  // 24 / 240 at 128-row q tiles. The consumers hold dK, dV, S, dP and dQ; the loader and the dQ
  // writers walk the mask's lists, which at 24 registers spills their walk cursors to local
  // memory (the one instance family allowed to spill, CMakeLists.txt: the walks' cursors kept in
  // shared memory instead gave the writers wrong visits).
  static constexpr int kProducerRegs = kBlockM == 128 ? 24 : 40, kConsumerRegs = kBlockM == 128 ? 240 : 232;
  static_assert(register_split_fits(kThreads, kProducerRegs, kMmaThreads, kConsumerRegs), "setmaxnreg budgets");
  // dS buffers: two, so a warpgroup may write the next visit's dS while the other still reads this
  // one's; one at 128-row q tiles (shared memory), the consumers then meet before writing it.
  static constexpr int kDsBuffers = kBlockM == 128 ? 1 : 2;

  // S^T = K Q^T and dP^T = V dO^T: M = keys (two warpgroups x 64), N = q rows, K = D.
  using AlongM = Layout<Shape<_2, _1, _1>>;
  using MmaSdP = decltype(make_tiled_mma(
      GMMA::ss_op_selector<Element, Element, float, Shape<Int<kBlockN>, Int<kBlockM>, Int<kHeadDim>>>(), AlongM{}));
  // dV += P^T dO and dK += dS^T Q: M = keys, N = D, K = q rows; A from registers, B = dO / Q
  // stored [q, D] (D contiguous: MN-major).
  using MmaDkv = decltype(make_tiled_mma(
      GMMA::rs_op_selector<Element, Element, float, Shape<Int<kBlockN>, Int<kHeadDim>, Int<kBlockM>>, GMMA::Major::K,
                           GMMA::Major::MN>(),
      AlongM{}));
  // dQ = dS K: M = q rows, N = D, K = keys; dS stored q-contiguous, K stored [keys, D]: both
  // MN-major. 64-row q tiles: each warpgroup one half of D; 128-row ones: each warpgroup 64 rows
  // with all of D (wider instructions, and each reads only its own rows of dS).
  static constexpr bool kDqAlongM = kBlockM == 128;
  using MmaDq = decltype(make_tiled_mma(
      GMMA::ss_op_selector<Element, Element, float,
                           Shape<Int<kBlockM / (kDqAlongM ? 2 : 1)>, Int<kHeadDim / (kDqAlongM ? 1 : 2)>, Int<kBlockN>>,
                           GMMA::Major::MN, GMMA::Major::MN>(),
      std::conditional_t<kDqAlongM, AlongM, Layout<Shape<_1, _2, _1>>>{}));

  using AtomQ = decltype(smem_atom_k_major<Element, kHeadDim>());
  using SmemLayoutQ = decltype(tile_to_shape(AtomQ{}, Shape<Int<kBlockM>, Int<kHeadDim>, Int<kStages>>{}));  // Q, dO
  using SmemLayoutQt = decltype(composition(
      SmemLayoutQ{}, make_ordered_layout(Shape<Int<kHeadDim>, Int<kBlockM>, Int<kStages>>{}, Step<_2, _1, _3>{})));
  // K is dQ's B operand, at 64-row q tiles split along D between the warpgroups: its swizzle atom
  // must not straddle the halves, so it is the widest one that fits D / 2.
  using AtomK = decltype(smem_atom_k_major<Element, kHeadDim / 2>());
  using SmemLayoutK = decltype(tile_to_shape(AtomK{}, Shape<Int<kBlockN>, Int<kHeadDim>>{}));
  using SmemLayoutKt =
      decltype(composition(SmemLayoutK{}, make_ordered_layout(Shape<Int<kHeadDim>, Int<kBlockN>>{}, Step<_2, _1>{})));
  using SmemLayoutV = decltype(tile_to_shape(AtomQ{}, Shape<Int<kBlockN>, Int<kHeadDim>>{}));
  // dS [q, keys], q contiguous, kDsBuffers buffers.
  using SmemLayoutDs =
      decltype(tile_to_shape(GMMA::Layout_MN_SW128_Atom<Element>{}, Shape<Int<kBlockM>, Int<kBlockN>, Int<kDsBuffers>>{}));
  // The same buffers as (keys, q, buffer), the accumulator's orientation: rows of 8 q values are
  // 16 contiguous bytes, so dS^T goes in with matrix stores (stmatrix) instead of one 32-bit store
  // (and its swizzled address) per pair.
  using SmemLayoutDsT = decltype(composition(
      SmemLayoutDs{}, make_ordered_layout(Shape<Int<kBlockN>, Int<kBlockM>, Int<kDsBuffers>>{}, Step<_2, _1, _3>{})));
  using SmemCopyDs = decltype(make_tiled_copy_C(Copy_Atom<SM90_U32x4_STSM_N, Element>{}, MmaSdP{}));

  using GmemShape = Shape<int32_t, int32_t, int32_t, int32_t>;  // (S, D, H, B)
  using GmemStride = Stride<int64_t, _1, int64_t, int64_t>;
  using GmemTensor =
      decltype(make_tensor(make_gmem_ptr(static_cast<Element const*>(nullptr)), GmemShape{}, GmemStride{}));
  using TmaQ = decltype(make_tma_copy(SM90_TMA_LOAD{}, GmemTensor{}, take<0, 2>(SmemLayoutQ{}),
                                      Shape<Int<kBlockM>, Int<kHeadDim>>{}, _1{}));
  using TmaK = decltype(make_tma_copy(SM90_TMA_LOAD{}, GmemTensor{}, SmemLayoutK{},
                                      Shape<Int<kBlockN>, Int<kHeadDim>>{}, _1{}));
  using TmaV = decltype(make_tma_copy(SM90_TMA_LOAD{}, GmemTensor{}, SmemLayoutV{},
                                      Shape<Int<kBlockN>, Int<kHeadDim>>{}, _1{}));
  // dK and dV leave through the K and V tiles' shared memory (bwd_epilogue_sm90.cuh).
  using GmemTensorOut =
      decltype(make_tensor(make_gmem_ptr(static_cast<Element*>(nullptr)), GmemShape{}, GmemStride{}));
  using TmaDk = decltype(make_tma_copy(SM90_TMA_STORE{}, GmemTensorOut{}, SmemLayoutK{},
                                       Shape<Int<kBlockN>, Int<kHeadDim>>{}, _1{}));
  using TmaDv = decltype(make_tma_copy(SM90_TMA_STORE{}, GmemTensorOut{}, SmemLayoutV{},
                                       Shape<Int<kBlockN>, Int<kHeadDim>>{}, _1{}));
  static constexpr uint32_t kQBytes = kBlockM * kHeadDim * sizeof(Element);
  static constexpr uint32_t kKVBytes = kBlockN * kHeadDim * sizeof(Element);
  static constexpr uint32_t kRowBytes = kBlockM * sizeof(float);  // lse or delta of a q tile
  static constexpr uint32_t kDqBytes = kBlockM * kHeadDim * sizeof(float);
  // dQ staging buffers: as many as shared memory holds, up to 4 (2 at D = 128, 4 below). The
  // more there are, the further the writers may fall behind (waiting for deterministic turns)
  // before the consumers stall.
  static constexpr int kSmemBesidesDq = int(2 * kStages * kQBytes + 2 * kKVBytes) +
                                        kDsBuffers * kBlockM * kBlockN * int(sizeof(Element)) + 2048;
  // dQ writer threads (bwd_dq_writer_sm90.cuh: lane 0 of the producer warpgroup's warps 1, 2),
  // each with its own buffers: a writer waits for its buffers' phases in order, so another writer
  // could not share one without mistaking an earlier phase for its own.
  static constexpr int kDqWriters = 2;
  static constexpr int kDqBuffers =
      std::max(1, std::min(4, (227 * 1024 - kSmemBesidesDq) / int(kDqBytes))) / kDqWriters * kDqWriters;
  static_assert(kDqBuffers % kDqWriters == 0, "each dQ writer owns every kDqWriters-th buffer");
  static_assert(kDqWriters <= 3, "the writers are lane 0 of the producer warpgroup's warps 1..3");

  using Pipeline = cutlass::PipelineTmaAsync<kStages>;

  struct SharedStorage {
    array_aligned<Element, cosize_v<SmemLayoutQ>, 1024> q;
    array_aligned<Element, cosize_v<SmemLayoutQ>, 1024> dout;
    array_aligned<Element, cosize_v<SmemLayoutK>, 1024> k;
    array_aligned<Element, cosize_v<SmemLayoutV>, 1024> v;
    array_aligned<Element, cosize_v<SmemLayoutDs>, 1024> ds;
    // dQ partials in fragment order (dq_fragment_offset), the layout of a tile in the accumulator:
    // the consumers go on while the writers wait for deterministic turns.
    array_aligned<float, kDqBuffers * kBlockM * kHeadDim, 128> dq;
    alignas(16) float lse[kStages][kBlockM];
    alignas(16) float delta[kStages][kBlockM];
    alignas(16) int32_t doc_q[kStages][kBlockM];  // document masks' query ids (BwdArgs::doc_q_rows)
    typename Pipeline::SharedStorage pipe;
    uint64_t kv_full, kv_empty;  // the item's K and V landed / its dK and dV stores have read them
    uint64_t dq_full[kDqBuffers], dq_empty[kDqBuffers];  // a dQ partial written / read by its writer
    uint64_t ticket_full[2], ticket_empty[2];
    int32_t ticket[2];
  };
  static_assert(sizeof(SharedStorage) <= 227 * 1024, "sm90 allows 227 KiB of shared memory per CTA");

  struct Params {
    BwdArgs args;
    TmaQ tma_q, tma_do;
    TmaK tma_k;
    TmaV tma_v;
    TmaDk tma_dk;
    TmaDv tma_dv;
    float scale_log2;
  };
};

// A dQ tile's fp32 values are kept in the dQ GEMM's fragment order, not [q, D]: value i of
// consumer thread t sits at ((i / 4) * kMmaThreads + t) * 4 + i % 4, so that each warp writes
// whole 512-byte runs of shared memory (row-major would cost 8-way bank conflicts), and the
// bulk reduce-add copies the tile as it is. The conversion kernel (bwd_convert_dq_kernel) maps
// it back with the same fragment coordinates.
template <class T>
__host__ __device__ constexpr int dq_fragment_offset(int thread, int i) {
  return ((i / 4) * T::kMmaThreads + thread) * 4 + i % 4;
}

// Every role takes the same tickets in the same order: the loader draws them (BwdTicketScheduler) and
// passes each on through a two-slot ring in shared memory.
template <class T>
__device__ __forceinline__ int32_t read_ticket(typename T::SharedStorage& ss, int n_item) {
  const int slot = n_item & 1;
  cutlass::arch::ClusterBarrier::wait(&ss.ticket_full[slot], (n_item >> 1) & 1);
  const int32_t t = ss.ticket[slot];
  cutlass::arch::ClusterBarrier::arrive(&ss.ticket_empty[slot]);
  return t;
}

}  // namespace sparsetrain::cuda::attn

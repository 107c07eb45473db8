// Block-sparse attention backward for sm_90a, written on CuTe: a persistent, warp-specialised
// kernel over kv tiles, with dK and dV accumulated on chip and dQ partials reduced into an fp32
// buffer, either by atomic adds in any order or in the mask's dQ write order (deterministic).
//
//   scheduler  work items (batch, kv head, 128-key sub-column), handed out by an atomic ticket
//              counter (zeroed on the stream before every launch, so graphs replay it) in the
//              mask's column schedule (DqColumnHandout, common/attention/dq_schedule_model.h): never by
//              blockIdx, so the earliest unfinished column is always running and never waits
//   mainloop   a producer thread loads the item's K and V once, then the item's visits (q tile,
//              query head of the kv head's group: GQA, dK / dV stay on chip, no cross-CTA
//              reduction) in the schedule's walk order (bwd_item_next, common/attention/attention_bwd_walk.h:
//              by default q tiles bottom-up with the group's heads innermost): Q, dO, lse and delta
//              through a 2-stage TMA pipeline (q tiles of 64 rows, 128 at D <= 64:
//              bwd_tile_q). Two consumer warpgroups (64 keys each) compute
//              S^T = K Q^T and dP^T = V dO^T, P^T and dS^T = P^T (dP^T - delta) in registers;
//              dS^T to shared memory with matrix stores, then (FlashAttention-3's order) dV +=
//              P^T dO (A from registers) runs while the warpgroups meet at a barrier, dQ = dS K
//              (each warpgroup half of D, or at 128-row tiles half of the rows) and dK +=
//              dS^T Q, and the dQ partial goes to shared
//              memory while dK's GEMM runs
//   dQ writer  two threads (one warp each) take the q tile x D fp32 partials from shared memory in
//              turn and add each to the accumulator with a bulk TMA reduce-add; in the
//              deterministic mode a writer first waits until the q tile's semaphore equals the
//              visit's turn (turn 0 stores: that accumulator is never zeroed), and increments it
//              as soon as its write has landed. The consumers meanwhile go on
//   epilogue   dK * scale and dV in the input dtype, staged in the item's K and V tiles in
//              shared memory and written with one TMA store each; a second kernel
//              converts the fp32 dQ accumulator (times scale) to the input dtype
//
// The parts, one header each: bwd_traits_sm90.cuh (tiles, layouts, shared storage, the ticket
// ring), bwd_mainloop_sm90.cuh (loader and consumers), bwd_dq_writer_sm90.cuh,
// bwd_epilogue_sm90.cuh (dK / dV), bwd_preprocess.cuh (delta, lse; before the kernel) and
// bwd_postprocess_sm90.cuh (the dQ conversion kernel); this header composes them and launches.
//
// The mask kind and the deterministic flag are runtime switches. Keys past Skv are masked (their
// K / V rows are TMA zero fill), rows past Sq and rows without any allowed key have lse = +inf in
// the preprocessed lse (P = 0).
#pragma once

#include <algorithm>
#include <cmath>

#include "cuda/attention/attention_bwd_params.h"
#include "cuda/attention/bwd_dq_writer_sm90.cuh"
#include "cuda/attention/bwd_mainloop_sm90.cuh"
#include "cuda/attention/bwd_postprocess_sm90.cuh"
#include "cuda/attention/bwd_traits_sm90.cuh"
#include "cuda/pdl.cuh"

namespace sparsetrain::cuda::attn {

using namespace cute;

template <class T>
__global__ void __launch_bounds__(T::kThreads, 1) bwd_kernel(CUTE_GRID_CONSTANT const typename T::Params p) {
  extern __shared__ __align__(1024) char smem[];
  auto& ss = *reinterpret_cast<typename T::SharedStorage*>(smem);
  const int warp = cutlass::canonical_warp_idx_sync();
  const int warpgroup = warp / 4;
  if (warp == 0 && cute::elect_one_sync()) {
    cute::prefetch_tma_descriptor(p.tma_q.get_tma_descriptor());
    cute::prefetch_tma_descriptor(p.tma_do.get_tma_descriptor());
    cute::prefetch_tma_descriptor(p.tma_k.get_tma_descriptor());
    cute::prefetch_tma_descriptor(p.tma_v.get_tma_descriptor());
    cute::prefetch_tma_descriptor(p.tma_dk.get_tma_descriptor());
    cute::prefetch_tma_descriptor(p.tma_dv.get_tma_descriptor());
    cutlass::arch::ClusterTransactionBarrier::init(&ss.kv_full, 1);
    cutlass::arch::ClusterBarrier::init(&ss.kv_empty, 1);  // the consumer that stores dK and dV
    for (int i = 0; i < T::kDqBuffers; ++i) {
      cutlass::arch::ClusterBarrier::init(&ss.dq_full[i], T::kMmaThreads);
      cutlass::arch::ClusterBarrier::init(&ss.dq_empty[i], 1);
    }
    for (int i = 0; i < 2; ++i) {
      cutlass::arch::ClusterBarrier::init(&ss.ticket_full[i], 1);
      cutlass::arch::ClusterBarrier::init(&ss.ticket_empty[i], T::kMmaThreads + T::kDqWriters);
    }
  }
  typename T::Pipeline::Params pp;
  pp.transaction_bytes = 2 * T::kQBytes + (p.args.doc_q_rows != nullptr ? 3 : 2) * T::kRowBytes;
  pp.role = warpgroup == 0 ? T::Pipeline::ThreadCategory::Producer : T::Pipeline::ThreadCategory::Consumer;
  pp.is_leader = threadIdx.x == 0;
  pp.num_consumers = T::kMmaThreads;
  typename T::Pipeline pipe(ss.pipe, pp, Shape<_1, _1, _1>{});
  cutlass::arch::fence_barrier_init();
  __syncthreads();
  // Launched as a dependent of the preprocessing (cuda/pdl.cuh): set up so far, now its lse,
  // delta and zeroed semaphores and ticket counter.
  pdl_wait();

  if (warpgroup == 0) {
    cutlass::arch::warpgroup_reg_dealloc<T::kProducerRegs>();
    if (threadIdx.x == 0) bwd_load<T>(p, ss, pipe);
    else if (threadIdx.x % 32 == 0 && threadIdx.x / 32 <= T::kDqWriters) bwd_write_dq_as<T>(p, ss, threadIdx.x / 32 - 1);
  } else {
    cutlass::arch::warpgroup_reg_alloc<T::kConsumerRegs>();
    bwd_compute<T>(p, ss, pipe, int(threadIdx.x) - 128);
  }
}

template <FwdElement E, int HeadDim>
void run_bwd_sm90(const BwdArgs& a, void* dq, void* stream) {
  using Element = std::conditional_t<E == FwdElement::kBF16, cutlass::bfloat16_t, cutlass::half_t>;
  using T = BwdTraits<Element, HeadDim>;
  auto tma = [&](const void* ptr, int32_t seq, int32_t heads, int64_t sb, int64_t ss, int64_t sh, auto smem_layout,
                 auto tile) {
    Tensor g = make_tensor(make_gmem_ptr(static_cast<Element const*>(ptr)),
                           make_shape(seq, int32_t(HeadDim), heads, a.batch), make_stride(ss, _1{}, sh, sb));
    return make_tma_copy(SM90_TMA_LOAD{}, g, smem_layout, tile, _1{});
  };
  using QTile = Shape<Int<T::kBlockM>, Int<HeadDim>>;
  using KVTile = Shape<Int<T::kBlockN>, Int<HeadDim>>;
  using QStage = decltype(take<0, 2>(typename T::SmemLayoutQ{}));
  // dk, dv: [B, Skv, Hkv, D] contiguous (the library allocates them).
  auto out = [&](void* ptr, auto smem_layout) {
    const int64_t row = int64_t(a.heads_kv) * HeadDim;
    Tensor g = make_tensor(make_gmem_ptr(static_cast<Element*>(ptr)),
                           make_shape(a.seq_kv, int32_t(HeadDim), a.heads_kv, a.batch),
                           make_stride(row, _1{}, int64_t(HeadDim), a.seq_kv * row));
    return make_tma_copy(SM90_TMA_STORE{}, g, smem_layout, KVTile{}, _1{});
  };
  typename T::Params p{
      a,
      tma(a.q, a.seq_q, a.heads_q, a.q_stride_b, a.q_stride_s, a.q_stride_h, QStage{}, QTile{}),
      tma(a.dout, a.seq_q, a.heads_q, a.do_stride_b, a.do_stride_s, a.do_stride_h, QStage{}, QTile{}),
      tma(a.k, a.seq_kv, a.heads_kv, a.k_stride_b, a.k_stride_s, a.k_stride_h, typename T::SmemLayoutK{}, KVTile{}),
      tma(a.v, a.seq_kv, a.heads_kv, a.v_stride_b, a.v_stride_s, a.v_stride_h, typename T::SmemLayoutV{}, KVTile{}),
      out(a.dk, typename T::SmemLayoutK{}),
      out(a.dv, typename T::SmemLayoutV{}),
      float(a.scale * M_LOG2E)};
  constexpr int smem_bytes = int(sizeof(typename T::SharedStorage));
  opt_in_smem(bwd_kernel<T>, smem_bytes);
  const auto s = static_cast<cudaStream_t>(stream);
  check_cuda(launch_dependent(bwd_kernel<T>, a.grid, T::kThreads, smem_bytes, s, p), "attention backward launch");
  const int64_t tiles = int64_t(a.batch) * a.heads_q * a.lists.num_q_tiles;
  check_cuda(launch_dependent(bwd_convert_dq_kernel<T>, int(std::min<int64_t>(tiles, 65535)), T::kMmaThreads, 0, s, a, dq),
             "dQ conversion launch");
}

}  // namespace sparsetrain::cuda::attn

// One instantiation per translation unit (attention_bwd_sm90_instance.cu.in).
#define SPARSETRAIN_ATTN_BWD_INSTANTIATE(E, D) \
  template void run_bwd_sm90<E, D>(const BwdArgs& a, void* dq, void* stream);

// The FP8 grouped GEMMs' mainloop: CUTLASS's sm90 ptr-array blockwise-scaled mainloop (its
// loads, pipeline, shared storage and parameters, inherited) with each k step's promotion
// overlapped with the next k step's MMAs.
//
// Each 128-deep partial sum t is promoted into the accumulator on the CUDA cores, 64 elements a
// thread: accum += t * (sfa * sfb) with one B scale a tile column (fprop and dgrad: A's per row,
// the weight's per 128 x 128 block), accum += t * sfa * sfb with scales along M and N (wgrad: per
// channel and 128-token tile on both operands, a multiply more an element). CUTLASS's mma() waits
// for a k step's MMAs, then promotes, then issues the next step's, so the tensor cores idle
// through every promotion (the wgrad ran at 851-910 TFLOP/s, fprop at 1081-1148, torch's rowwise
// GEMM, which scales once in its epilogue, at 1260). Here two partial-sum fragments alternate: k
// step i's MMAs are issued into one while step i - 1's are promoted from the other, so the
// promotion runs under the MMAs (the cost: a third 64-float fragment a thread; no spill; the gain,
// measured on an H200: 2.5-3 % of a MoE step's FP8 GEMM time). Each promotion reads its scales
// from its stage in shared memory, not from a second set of registers, so a stage goes back to the
// producer after its promotion (and a warpgroup barrier: one thread signals it for all four warps)
// rather than after its MMAs. The arithmetic is CUTLASS's, element for element and in its order,
// from a zero accumulator: the same bits.
#pragma once

#include "cute/tensor.hpp"
#include "cutlass/arch/barrier.h"
#include "cutlass/cutlass.h"
#include "cutlass/gemm/collective/collective_builder.hpp"

namespace sparsetrain::cuda::sm90 {

template <class Base>
struct Fp8OverlappedMainloop : Base {
  static_assert(Base::ScaleMsPerTile > 1, "A's scales per row (1 x 128 tiles)");
  static_assert(Base::ScalePromotionInterval == cute::size<2>(typename Base::TileShape{}) /
                                                   cute::size<2>(typename Base::TiledMma::AtomShape_MNK{}),
                "a promotion every k step");

  template <class FrgTensorC>
  CUTLASS_DEVICE void mma(typename Base::MainloopPipeline pipeline, typename Base::PipelineState smem_pipe_read,
                          FrgTensorC& accum, int k_tile_count, int thread_idx,
                          typename Base::TensorStorage& shared_tensors, typename Base::Params const&) {
    using namespace cute;
    using TileShape = typename Base::TileShape;
    using SmemLayoutSFA = typename Base::SmemLayoutSFA;
    using SmemLayoutSFB = typename Base::SmemLayoutSFB;
    using TiledMma = typename Base::TiledMma;
    // Operands and scales in shared memory, partitioned as CUTLASS's mma() does: the scales as
    // accumulator-shaped views (stride 0 along the other operand's mode).
    Tensor sA = make_tensor(make_smem_ptr(shared_tensors.smem_A.data()), typename Base::SmemLayoutA{});
    Tensor sB = make_tensor(make_smem_ptr(shared_tensors.smem_B.data()), typename Base::SmemLayoutB{});
    Tensor sSFA = make_tensor(
        make_smem_ptr(shared_tensors.smem_SFA.data()),
        make_layout(make_shape(shape<0>(SmemLayoutSFA{}), get<1>(TileShape{}),
                               make_shape(shape<1>(SmemLayoutSFA{}), shape<2>(SmemLayoutSFA{}))),
                    make_stride(stride<0>(SmemLayoutSFA{}), _0{},
                                make_stride(stride<1>(SmemLayoutSFA{}), stride<2>(SmemLayoutSFA{})))));
    Tensor sSFB = make_tensor(
        make_smem_ptr(shared_tensors.smem_SFB.data()),
        make_layout(make_shape(get<0>(TileShape{}), shape<0>(SmemLayoutSFB{}),
                               make_shape(shape<1>(SmemLayoutSFB{}), shape<2>(SmemLayoutSFB{}))),
                    make_stride(_0{}, stride<0>(SmemLayoutSFB{}),
                                make_stride(stride<1>(SmemLayoutSFB{}), stride<2>(SmemLayoutSFB{})))));
    constexpr int kThreads = cutlass::NumThreadsPerWarpGroup;
    constexpr int kWarpGroups = size(TiledMma{}) / kThreads;
    const Layout warp_group_thread_layout = make_layout(Int<kWarpGroups>{}, Int<kThreads>{});
    const int warp_group_idx = __shfl_sync(0xFFFFFFFF, thread_idx / kThreads, 0);
    TiledMma tiled_mma;
    auto thread_mma = tiled_mma.get_slice(warp_group_thread_layout(warp_group_idx));
    Tensor tCsSFA = tiled_mma.get_slice(thread_idx).partition_C(sSFA);  // (MMA, MMA_M, MMA_N, (MMA_K, PIPE))
    Tensor tCsSFB = tiled_mma.get_slice(thread_idx).partition_C(sSFB);
    Tensor tCrA = thread_mma.make_fragment_A(thread_mma.partition_A(sA));  // (MMA, MMA_M, MMA_K, PIPE)
    Tensor tCrB = thread_mma.make_fragment_B(thread_mma.partition_B(sB));

    Tensor t0 = make_fragment_like(accum), t1 = make_fragment_like(accum);
    typename Base::PipelineState smem_pipe_release = smem_pipe_read;
    // k step `smem_pipe_read`'s MMAs into t (zeroed by the first), left in flight.
    auto issue = [&](auto& t) {
      pipeline.consumer_wait(smem_pipe_read, pipeline.consumer_try_wait(smem_pipe_read));
      const int stage = smem_pipe_read.index();
      tiled_mma.accumulate_ = GMMA::ScaleOut::Zero;
      warpgroup_fence_operand(t);
      warpgroup_arrive();
      CUTLASS_PRAGMA_UNROLL
      for (int k_block = 0; k_block < size<2>(tCrA); ++k_block) {
        cute::gemm(tiled_mma, tCrA(_, _, k_block, stage), tCrB(_, _, k_block, stage), t);
        tiled_mma.accumulate_ = GMMA::ScaleOut::One;
      }
      warpgroup_commit_batch();
      warpgroup_fence_operand(t);
      ++smem_pipe_read;
    };
    // The oldest issued step (stage `smem_pipe_release`), whose MMAs the caller waited for, into
    // accum with its scales; its stage then goes back to the producer, except the last step's
    // (mma_tail releases it, as after CUTLASS's mma()).
    auto promote = [&](auto& t, bool release) {
      warpgroup_fence_operand(t);
      const int stage = smem_pipe_release.index();
      Tensor sfa = tCsSFA(_, _, _, make_coord(_0{}, stage));
      Tensor sfb = tCsSFB(_, _, _, make_coord(_0{}, stage));
      if constexpr (Base::ScaleNsPerTile == 1) {
        const float b = sfb(0);
        CUTLASS_PRAGMA_UNROLL
        for (int i = 0; i < size(accum); ++i) accum(i) += t(i) * (sfa(i) * b);
      } else {
        CUTLASS_PRAGMA_UNROLL
        for (int i = 0; i < size(accum); ++i) accum(i) += t(i) * sfa(i) * sfb(i);
      }
      // One thread of the warpgroup signals a release (here, or mma_tail's for the last step), so
      // every warp must have read the stage's scales first. CUTLASS's mma() needs no barrier: its
      // warps read a step's scales before issuing its MMAs, which complete only once all four
      // warps issued them; here a warp reads them after issuing the next step's.
      cutlass::arch::NamedBarrier::sync(kThreads, warp_group_idx);
      if (release) {
        pipeline.consumer_release(smem_pipe_release);
        ++smem_pipe_release;
      }
    };

    clear(accum);
    warpgroup_fence_operand(accum);
    if (k_tile_count <= 0) return;
    // Steps 0, 1, 2, ... into t0, t1, t0, ...: each promoted while the next one's MMAs run.
    issue(t0);
    for (int k = 1; k < k_tile_count; k += 2) {
      issue(t1);
      warpgroup_wait<1>();
      promote(t0, true);
      if (k + 1 == k_tile_count) {
        warpgroup_wait<0>();
        promote(t1, false);
        warpgroup_fence_operand(accum);
        return;
      }
      issue(t0);
      warpgroup_wait<1>();
      promote(t1, true);
    }
    warpgroup_wait<0>();
    promote(t0, false);
    warpgroup_fence_operand(accum);
  }
};

}  // namespace sparsetrain::cuda::sm90

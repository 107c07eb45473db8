// What the sm90 attention kernels (forward and backward) share: shared-memory atoms, the
// register-level views of wgmma accumulators, one-batch warpgroup GEMMs, and launch helpers.
#pragma once

#include <cuda_runtime.h>

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>
#include <cutlass/numeric_types.h>
#include <cutlass/pipeline/pipeline.hpp>

#include "cuda/cuda_check.h"
#include "cuda/device_cache.h"

namespace sparsetrain::cuda::attn {

using namespace cute;
using cute::Tensor;  // not sparsetrain::Tensor (sparsetrain/tensor.h), when both are visible

// The widest K-major swizzle a row of kHeadDim elements allows (128-byte rows and up: SW128).
template <class Element, int kHeadDim>
constexpr auto smem_atom_k_major() {
  constexpr int row_bytes = kHeadDim * int(sizeof(Element));
  if constexpr (row_bytes % 128 == 0) {
    return GMMA::Layout_K_SW128_Atom<Element>{};
  } else if constexpr (row_bytes % 64 == 0) {
    return GMMA::Layout_K_SW64_Atom<Element>{};
  } else {
    return GMMA::Layout_K_SW32_Atom<Element>{};
  }
}

// Whether a warp-specialised CTA's setmaxnreg budgets fit: setmaxnreg only moves registers inside
// the pool the CTA starts with, the registers a thread of __launch_bounds__(threads, 1) gets (the
// register file over the threads, in steps of 8: 168 for 384 threads) times its threads (64512,
// not 65536). A split that asks for more leaves the growing warpgroups waiting forever (a prepared
// 32 / 240 backward hung so).
constexpr bool register_split_fits(int threads, int producer_regs, int consumer_threads, int consumer_regs) {
  return (threads - consumer_threads) * producer_regs + consumer_threads * consumer_regs <=
         65536 / threads / 8 * 8 * threads;
}

// ---- small register-level helpers --------------------------------------------------------------

__device__ __forceinline__ float fast_exp2(float x) {  // ex2.approx(-inf) = +0
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// A wgmma accumulator's layout ((2 cols, 2 row halves, N/8), M tiles, N tiles) viewed as
// (rows, cols) = ((2, M), (2, N/8, N)): the row a thread holds, and the columns along it.
template <class Layout>
CUTE_HOST_DEVICE auto acc_rowcol(Layout l) {  // host too: tests/cpp/test_bwd_mask_layout.cu
  return make_layout(make_layout(get<0, 1>(l), get<1>(l)), make_layout(get<0, 0>(l), get<0, 2>(l), get<2>(l)));
}

// The same accumulator as a 16-bit A operand of the next wgmma: each k-block of 16 columns is two
// adjacent 8-column groups, so (2, 2, N/8) splits into (2, 2, 2) x N/16 k-blocks.
template <class Layout>
__device__ __forceinline__ auto acc_as_a_operand(Layout l) {
  auto groups = logical_divide(get<0, 2>(l), Tile<_2>{});  // (2, N/16)
  return make_layout(make_layout(get<0, 0>(l), get<0, 1>(l), get<0, 0>(groups)), get<1>(l),
                     coalesce(make_layout(get<0, 1>(groups), get<2>(l))));
}

// Issues one warpgroup GEMM C (+)= A B over all k-blocks and commits it as one wgmma batch; the
// caller waits (warpgroup_wait<N>: at most N batches still in flight) and then fences C.
// zero_init (a runtime flag: wgmma's scale-d predicate) overwrites C instead of adding to it.
template <class Mma, class TA, class TB, class TC>
__device__ __forceinline__ void warpgroup_gemm_issue(Mma& mma, TA const& a, TB const& b, TC& c, bool zero_init) {
  constexpr bool kRegisterA = !is_base_of<GMMA::DescriptorIterator, typename Mma::FrgTypeA>::value;
  if constexpr (kRegisterA) warpgroup_fence_operand(const_cast<TA&>(a));
  warpgroup_fence_operand(c);
  warpgroup_arrive();
  mma.accumulate_ = zero_init ? GMMA::ScaleOut::Zero : GMMA::ScaleOut::One;
  CUTLASS_PRAGMA_UNROLL
  for (int kb = 0; kb < size<2>(a); ++kb) {
    cute::gemm(mma, a(_, _, kb), b(_, _, kb), c);
    mma.accumulate_ = GMMA::ScaleOut::One;
  }
  warpgroup_commit_batch();
}

template <bool kZeroInit, class Mma, class TA, class TB, class TC>
__device__ __forceinline__ void warpgroup_gemm_issue(Mma& mma, TA const& a, TB const& b, TC& c) {
  warpgroup_gemm_issue(mma, a, b, c, kZeroInit);
}

// An fp32 accumulator in the input type (P, dS): the A operand of the next GEMM.
template <class TS, class TP>
__device__ __forceinline__ void convert_p(TS const& s, TP& p) {
  CUTLASS_PRAGMA_UNROLL
  for (int i = 0; i < size(p); ++i) p(i) = typename TP::value_type(s(i));
}

// The kernels' spellings of the library's CUDA check and shared-memory opt-in (cuda/cuda_check.h,
// cuda/device_cache.h).
inline void check_cuda(cudaError_t e, const char* what) { ST_CUDA_CHECK(e, "sm90 attention: ", what); }

// Raises a kernel's dynamic shared memory limit to `bytes` on the current device (once per device).
template <class Kernel>
void opt_in_smem(Kernel* kernel, int bytes) {
  ::sparsetrain::cuda::opt_in_smem(reinterpret_cast<const void*>(kernel), bytes);
}

}  // namespace sparsetrain::cuda::attn

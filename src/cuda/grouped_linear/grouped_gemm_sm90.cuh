// The fast Hopper grouped GEMM: CUTLASS's sm90 ptr-array kernel (TMA loads, wgmma, warp-
// specialised cooperative schedule) over the groups, with problem sizes, pointers and strides
// written on the device by a set-up kernel from the group offsets, so a launch never reads
// split values on the host and a captured graph replays with new splits. Groups with no rows
// get M = 0 (no tiles). The per-launch arrays and CUTLASS's own workspace live in the caller's
// workspace (sizes from shapes only).
//
// fprop: D_g [M_g, out] = A_g [M_g, in] * B_g, with A the x rows of group g (row-major) and B_g
// = W_g^T (W_g [out, in] row-major is B column-major), fp32 accumulation, no C operand.
#pragma once

#include <cuda_runtime.h>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/group_array_problem_shape.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/util/packed_stride.hpp"
#include "cuda/grouped_linear/grouped_gemm_params.h"
#include "sparsetrain/error.h"

namespace sparsetrain::cuda::sm90 {

using namespace cute;

template <typename Element>
struct FpropGemm {
  using ProblemShape = cutlass::gemm::GroupProblemShape<Shape<int, int, int>>;
  using LayoutA = cutlass::layout::RowMajor;
  using LayoutB = cutlass::layout::ColumnMajor;
  using LayoutD = cutlass::layout::RowMajor;
  static constexpr int kAlign = 128 / cutlass::sizeof_bits<Element>::value;  // 16-byte TMA alignment
  // 128x256x64 tiles, cooperative (two consumer warpgroups), cluster 2x1: large MoE GEMMs.
  using TileShape = Shape<_128, _256, _64>;
  using ClusterShape = Shape<_2, _1, _1>;
  using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, void, LayoutD*, kAlign, Element, LayoutD*,
      kAlign, cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative,
      cutlass::epilogue::fusion::LinearCombination<Element, float, void>>::CollectiveOp;
  using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Element, LayoutA*, kAlign, Element, LayoutB*, kAlign,
      float, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename CollectiveEpilogue::SharedStorage))>,
      cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative>::CollectiveOp;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<ProblemShape, CollectiveMainloop, CollectiveEpilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
  using StrideA = typename Kernel::InternalStrideA;
  using StrideB = typename Kernel::InternalStrideB;
  using StrideD = typename Kernel::InternalStrideD;
  using Shape3 = typename ProblemShape::UnderlyingProblemShape;

  // Device arrays of one launch, carved from the workspace.
  struct Arrays {
    Shape3* problems;
    const Element** a;
    const Element** b;
    Element** d;
    StrideA* stride_a;
    StrideB* stride_b;
    StrideD* stride_d;
  };
};

// Bytes of the per-launch arrays plus CUTLASS's workspace, for G groups (shapes only).
template <typename Element>
size_t fprop_workspace_bytes(int64_t num_groups);

// Runs fprop on the fast path; the caller checked fprop_supported().
template <typename Element>
void run_fprop(const GroupedGemmParams& p, void* workspace, size_t workspace_bytes, void* stream);

}  // namespace sparsetrain::cuda::sm90

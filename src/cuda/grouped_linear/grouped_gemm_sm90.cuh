// The fast Hopper grouped GEMMs: CUTLASS's sm90 ptr-array kernel (TMA loads, wgmma, warp-
// specialised cooperative schedule) over the groups. Problem sizes, pointers and strides are
// written on the device by a set-up kernel from the group offsets, so a launch never reads split
// values on the host and a captured graph replays with new splits. The per-launch arrays and
// CUTLASS's workspace live in the caller's workspace (sizes from G only).
//
//   fprop  D_g [rows_g, out] = x_g [rows_g, in] . W_g^T    A row-major, B = W_g column-major
//   dgrad  D_g [rows_g, in]  = dy_g [rows_g, out] . W_g    A row-major, B = W_g row-major
//   wgrad  D_g [out, in]     = dy_g^T . x_g  (+ C_g)       A = dy_g column-major, B = x_g row-major,
//          K = rows_g (ragged); fp32 main_grad: C = D = main_grad, beta 1 (accumulate) or 0
// Groups with no rows get M = 0 (no tiles): a K = 0 problem is never launched (CUTLASS would
// leave its accumulators unwritten); wgrad handles those groups in its set-up kernel instead.
#pragma once

#include <cuda_runtime.h>

#include <type_traits>

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

template <Variant V>
struct Config;
template <> struct Config<Variant::kFpropBf16> {
  using A = cutlass::layout::RowMajor; using B = cutlass::layout::ColumnMajor; using C = void; using D = cutlass::bfloat16_t;
};
template <> struct Config<Variant::kDgradBf16> {
  using A = cutlass::layout::RowMajor; using B = cutlass::layout::RowMajor; using C = void; using D = cutlass::bfloat16_t;
};
template <> struct Config<Variant::kWgradBf16> {
  using A = cutlass::layout::ColumnMajor; using B = cutlass::layout::RowMajor; using C = void; using D = cutlass::bfloat16_t;
};
template <> struct Config<Variant::kWgradF32> {
  using A = cutlass::layout::ColumnMajor; using B = cutlass::layout::RowMajor; using C = float; using D = float;
};

template <Variant V>
struct Sm90GroupedGemm {
  using Element = cutlass::bfloat16_t;
  using ElementC = typename Config<V>::C;
  using ElementD = typename Config<V>::D;
  using LayoutD = cutlass::layout::RowMajor;
  using ProblemShape = cutlass::gemm::GroupProblemShape<Shape<int, int, int>>;
  static constexpr int kAlignAB = 128 / cutlass::sizeof_bits<Element>::value;  // 16-byte TMA alignment
  static constexpr int kAlignD = 128 / cutlass::sizeof_bits<ElementD>::value;
  static constexpr int kAlignC = std::is_void_v<ElementC> ? kAlignD : 128 / cutlass::sizeof_bits<ElementC>::value;
  // 128x256x64 tiles, cooperative (two consumer warpgroups), cluster 2x1: the large MoE GEMMs.
  using TileShape = Shape<_128, _256, _64>;
  using ClusterShape = Shape<_2, _1, _1>;
  using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, ElementC, LayoutD*, kAlignC, ElementD, LayoutD*,
      kAlignD, cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative,
      cutlass::epilogue::fusion::LinearCombination<ElementD, float, ElementC>>::CollectiveOp;
  using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Element, typename Config<V>::A*, kAlignAB, Element,
      typename Config<V>::B*, kAlignAB, float, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename CollectiveEpilogue::SharedStorage))>,
      cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative>::CollectiveOp;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<ProblemShape, CollectiveMainloop, CollectiveEpilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
  using StrideA = typename Kernel::InternalStrideA;
  using StrideB = typename Kernel::InternalStrideB;
  using StrideC = typename Kernel::InternalStrideC;
  using StrideD = typename Kernel::InternalStrideD;
  using Shape3 = typename ProblemShape::UnderlyingProblemShape;
  using PtrC = std::conditional_t<std::is_void_v<ElementC>, const void*, const float*>;

  struct Arrays {  // device arrays of one launch, carved from the workspace
    Shape3* problems;
    const Element** a;
    const Element** b;
    PtrC* c;
    ElementD** d;
    StrideA* stride_a;
    StrideB* stride_b;
    StrideC* stride_c;
    StrideD* stride_d;
  };

  static size_t align_up(size_t n) { return (n + 255) / 256 * 256; }
  static size_t arrays_bytes(int64_t g) {
    const size_t n = size_t(g);
    return align_up(sizeof(Shape3) * n) + 4 * align_up(sizeof(void*) * n) + align_up(sizeof(StrideA) * n) +
           align_up(sizeof(StrideB) * n) + align_up(sizeof(StrideC) * n) + align_up(sizeof(StrideD) * n);
  }
  static Arrays carve(void* ws, int64_t g) {
    char* p = static_cast<char*>(ws);
    Arrays a;
    auto take = [&](auto*& ptr, size_t each) {
      ptr = reinterpret_cast<std::remove_reference_t<decltype(ptr)>>(p);
      p += align_up(each * size_t(g));
    };
    take(a.problems, sizeof(Shape3));
    take(a.a, sizeof(void*));
    take(a.b, sizeof(void*));
    take(a.c, sizeof(void*));
    take(a.d, sizeof(void*));
    take(a.stride_a, sizeof(StrideA));
    take(a.stride_b, sizeof(StrideB));
    take(a.stride_c, sizeof(StrideC));
    take(a.stride_d, sizeof(StrideD));
    return a;
  }

  static typename Gemm::Arguments arguments(const GroupedGemmParams& p, const Arrays& a, int device, float beta) {
    typename Gemm::Arguments args;
    decltype(args.epilogue.thread) fusion;
    fusion.alpha = 1.f;
    fusion.beta = beta;
    const auto hw = cutlass::KernelHardwareInfo::make_kernel_hardware_info<Kernel>(device);
    args = typename Gemm::Arguments{cutlass::gemm::GemmUniversalMode::kGrouped,
                                    {int(p.num_groups), a.problems, nullptr},
                                    {a.a, a.stride_a, a.b, a.stride_b},
                                    {fusion, a.c, a.stride_c, a.d, a.stride_d},
                                    hw};
    return args;
  }

  static size_t workspace_bytes(int64_t g) {
    GroupedGemmParams p{};
    p.num_groups = g;
    int device = 0;
    cudaGetDevice(&device);
    return arrays_bytes(g) + align_up(Gemm::get_workspace_size(arguments(p, Arrays{}, device, 0.f)));
  }

  static void run(const GroupedGemmParams& p, void* workspace, size_t bytes, void* stream);
};

// One thread per group: that group's problem, pointers and strides. A wgrad group with no rows
// gets M = 0; zero_empty_groups_kernel writes its zeros.
template <Variant V>
__global__ void sm90_setup_kernel(const GroupedGemmParams p, typename Sm90GroupedGemm<V>::Arrays a) {
  using S = Sm90GroupedGemm<V>;
  using E = typename S::Element;
  const int64_t g = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (g >= p.num_groups) return;
  const int64_t row = p.offsets[g], rows = p.offsets[g + 1] - row;
  int m, n, k;
  if constexpr (V == Variant::kFpropBf16 || V == Variant::kDgradBf16) {
    const bool fprop = V == Variant::kFpropBf16;
    m = int(rows);
    n = int(fprop ? p.out : p.in);
    k = int(fprop ? p.in : p.out);
    a.a[g] = static_cast<const E*>(p.act) + row * p.act_ld;
    a.b[g] = static_cast<const E*>(p.weight[g]);
    a.d[g] = static_cast<E*>(p.c) + row * p.c_ld;
    a.c[g] = nullptr;
  } else {
    m = rows > 0 ? int(p.out) : 0;
    n = int(p.in);
    k = int(rows);
    a.a[g] = static_cast<const E*>(p.act) + row * p.act_ld;    // dy rows of g, column-major [out, rows]
    a.b[g] = static_cast<const E*>(p.act2) + row * p.act2_ld;  // x rows of g, row-major [rows, in]
    a.d[g] = static_cast<typename S::ElementD*>(p.dw[g]);
    a.c[g] = static_cast<typename S::PtrC>(p.dw[g]);
  }
  a.problems[g] = typename S::Shape3(m, n, k);
  a.stride_a[g] = cutlass::make_cute_packed_stride(typename S::StrideA{}, cute::make_shape(m, k, 1));
  a.stride_b[g] = cutlass::make_cute_packed_stride(typename S::StrideB{}, cute::make_shape(n, k, 1));
  a.stride_c[g] = cutlass::make_cute_packed_stride(typename S::StrideC{}, cute::make_shape(m, n, 1));
  a.stride_d[g] = cutlass::make_cute_packed_stride(typename S::StrideD{}, cute::make_shape(m, n, 1));
}

// dW_g = 0 for the groups with no rows (a weight grad, or main_grad being overwritten); a main_grad
// being accumulated is left untouched. Grid (blocks, G); groups with rows return at once.
template <typename T>
__global__ void zero_empty_groups_kernel(const int64_t* offsets, GroupedGemmParams::DwTable dw, int64_t numel) {
  const int64_t g = blockIdx.y;
  if (offsets[g + 1] != offsets[g]) return;
  T* out = static_cast<T*>(dw.ptr[g]);
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < numel; i += int64_t(gridDim.x) * blockDim.x)
    out[i] = T(0.f);
}

template <Variant V>
void Sm90GroupedGemm<V>::run(const GroupedGemmParams& p, void* workspace, size_t bytes, void* stream) {
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  const Arrays a = carve(workspace, p.num_groups);
  sm90_setup_kernel<V><<<unsigned((p.num_groups + 127) / 128), 128, 0, s>>>(p, a);
  if constexpr (V == Variant::kWgradBf16 || V == Variant::kWgradF32) {
    if (p.wgrad_store != WgradStore::kMainGradAccumulate) {
      GroupedGemmParams::DwTable t;
      for (int64_t g = 0; g < p.num_groups; ++g) t.ptr[g] = p.dw[g];
      const dim3 grid(64, unsigned(p.num_groups));
      zero_empty_groups_kernel<ElementD><<<grid, 256, 0, s>>>(p.offsets, t, p.out * p.in);
    }
  }
  int device = 0;
  cudaGetDevice(&device);
  const float beta = p.wgrad_store == WgradStore::kMainGradAccumulate && V == Variant::kWgradF32 ? 1.f : 0.f;
  const auto args = arguments(p, a, device, beta);
  Gemm gemm;
  if (arrays_bytes(p.num_groups) + Gemm::get_workspace_size(args) > bytes) ST_FAIL("sm90 grouped GEMM: workspace too small");
  if (gemm.can_implement(args) != cutlass::Status::kSuccess) ST_FAIL("sm90 grouped GEMM: cannot implement");
  void* cutlass_ws = static_cast<char*>(workspace) + arrays_bytes(p.num_groups);
  if (gemm.initialize(args, cutlass_ws, s) != cutlass::Status::kSuccess) ST_FAIL("sm90 grouped GEMM: initialize failed");
  if (gemm.run(s) != cutlass::Status::kSuccess) ST_FAIL("sm90 grouped GEMM: run failed");
}

#define SPARSETRAIN_SM90_INSTANTIATE(V)                                                             \
  template <>                                                                                      \
  size_t workspace_bytes<V>(int64_t num_groups) {                                                  \
    return Sm90GroupedGemm<V>::workspace_bytes(num_groups);                                        \
  }                                                                                                \
  template <>                                                                                      \
  void run<V>(const GroupedGemmParams& p, void* workspace, size_t bytes, void* stream) {          \
    Sm90GroupedGemm<V>::run(p, workspace, bytes, stream);                                          \
  }

}  // namespace sparsetrain::cuda::sm90

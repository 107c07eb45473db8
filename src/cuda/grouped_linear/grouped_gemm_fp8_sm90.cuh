// The FP8 grouped GEMMs of GroupedLinear's blockwise-scaled recipe (docs/DESIGN.md, FP8):
// CUTLASS's sm90 ptr-array kernel with blockwise-scaled accumulation (each 128-deep partial sum
// is scaled by its operands' scales in fp32 registers and added to the accumulator), e4m3
// operands, fp32 scales. FP8 wgmma reads both operands K-major, so each variant takes the copies
// the quantizing passes write in that layout:
//
//   act x weight  D_g [rows_g, n] = A_g [rows_g, k] . B_g^T    (n, k multiples of 16)
//                 fprop: A = x, B_g = W_g [out, in]; dgrad: A = dy, B_g = W_g^T [in, out], the
//                 weight's transposed copy. A's scales: 1 x 128 tiles, grouped M-major (group g's
//                 [k/128][rows_g] block at offset o_g * ceil(k/128)); B's: 128 x 128 blocks,
//                 [n/128][k/128] per group (K-major), one pointer each in the parameters.
//   wgrad         D_g [out, in] = dy_g^T . x_g   A = dy^T [out, cols], B = x^T [in, cols], the
//                 columnwise copies: group g's tokens from column 128 tb_g (fp8_blockwise.h), scales
//                 1 x 128 along tokens, [tiles][out] and [tiles][in] (M- and N-major). D: the
//                 weight grad (bf16 / fp16) or the fp32 main_grad (C = D, beta 1 or 0).
//
// The mainloop promotes each k step's partial sums under the next step's MMAs
// (fp8_mainloop_sm90.cuh).
//
// As for the bf16 GEMMs (grouped_gemm_sm90.cuh), a set-up kernel writes each group's problem,
// pointers, strides and scale layouts on the device from the group offsets, so no split value is
// read on the host and a captured graph replays with new splits; the per-launch arrays and
// CUTLASS's workspace come from the caller's workspace, sized from G only.
#pragma once

#include <cuda_runtime.h>

#include <type_traits>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/detail/blockwise_scale_layout.hpp"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/group_array_problem_shape.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/util/packed_stride.hpp"
#include "common/fp8_blockwise.h"
#include "cuda/grouped_linear/fp8_mainloop_sm90.cuh"
#include "cuda/grouped_linear/grouped_gemm_launch_sm90.cuh"
#include "cuda/grouped_linear/grouped_gemm_fp8_params.h"
#include "sparsetrain/dtype.h"
#include "sparsetrain/error.h"

namespace sparsetrain::cuda::sm90 {

using namespace cute;

template <Fp8Variant V>
struct Sm90Fp8GroupedGemm {
  static constexpr bool kWgrad = V != Fp8Variant::kActWeight;
  using Element = cutlass::float_e4m3_t;
  using ElementOut = cutlass::bfloat16_t;
  using ElementD = std::conditional_t<V == Fp8Variant::kWgradF32, float, ElementOut>;
  using ElementC = std::conditional_t<V == Fp8Variant::kWgradF32, float, void>;
  using LayoutA = cutlass::layout::RowMajor;     // [M, K], K contiguous
  using LayoutB = cutlass::layout::ColumnMajor;  // [N, K], K contiguous
  using LayoutD = cutlass::layout::RowMajor;
  using ProblemShape = cutlass::gemm::GroupProblemShape<Shape<int, int, int>>;
  static constexpr int kAlignAB = 16;
  static constexpr int kAlignD = 128 / cutlass::sizeof_bits<ElementD>::value;
  static constexpr int kAlignC = std::is_void_v<ElementC> ? kAlignD : 128 / cutlass::sizeof_bits<ElementC>::value;
  // A 128-deep k step per scale; per-row scales on both sides for wgrad, 128 x 128 weight blocks
  // (one scale per tile column) otherwise. MN-major per-row scales are what the quantizing
  // passes write (one row's tiles apart, a tile's rows adjacent).
  using TileShape = Shape<_128, _128, _128>;
  using ClusterShape = Shape<_1, _2, _1>;
  using ScaleConfig =
      cutlass::detail::Sm90BlockwiseScaleConfig<1, kWgrad ? 1 : 128, 128, cute::GMMA::Major::MN,
                                                kWgrad ? cute::GMMA::Major::MN : cute::GMMA::Major::K>;
  using LayoutSFA = decltype(ScaleConfig::deduce_layoutSFA());
  using LayoutSFB = decltype(ScaleConfig::deduce_layoutSFB());
  using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, ElementC, LayoutD*, kAlignC, ElementD, LayoutD*,
      kAlignD, cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative,
      cutlass::epilogue::fusion::LinearCombination<ElementD, float, ElementC>>::CollectiveOp;
  using BuiltMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Element, cute::tuple<LayoutA*, LayoutSFA*>, kAlignAB,
      Element, cute::tuple<LayoutB*, LayoutSFB*>, kAlignAB, float, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename CollectiveEpilogue::SharedStorage))>,
      cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperativeFP8BlockScaledAccum>::CollectiveOp;
  // Each k step's promotion under the next one's MMAs (fp8_mainloop_sm90.cuh).
  using CollectiveMainloop = Fp8OverlappedMainloop<BuiltMainloop>;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<ProblemShape, CollectiveMainloop, CollectiveEpilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
  using StrideA = typename Kernel::InternalStrideA;
  using StrideB = typename Kernel::InternalStrideB;
  using StrideC = typename Kernel::InternalStrideC;
  using StrideD = typename Kernel::InternalStrideD;
  using Shape3 = typename ProblemShape::UnderlyingProblemShape;
  using PtrC = std::conditional_t<std::is_void_v<ElementC>, const void*, const ElementC*>;

  struct Arrays {  // device arrays of one launch, carved from the workspace
    Shape3* problems;
    const Element** a;
    const Element** b;
    const float** sfa;
    const float** sfb;
    PtrC* c;
    ElementD** d;
    StrideA* stride_a;
    StrideB* stride_b;
    StrideC* stride_c;
    StrideD* stride_d;
    LayoutSFA* layout_sfa;
    LayoutSFB* layout_sfb;
  };

  static size_t align_up(size_t n) { return (n + 255) / 256 * 256; }
  // The arrays in the workspace (GroupArrays; over a null one, only their size in *bytes).
  static Arrays carve(void* ws, int64_t g, size_t* bytes = nullptr) {
    GroupArrays c(ws, g);
    Arrays a;
    c.take(a.problems), c.take(a.a), c.take(a.b), c.take(a.sfa), c.take(a.sfb), c.take(a.c), c.take(a.d);
    c.take(a.stride_a), c.take(a.stride_b), c.take(a.stride_c), c.take(a.stride_d);
    c.take(a.layout_sfa), c.take(a.layout_sfb);
    if (bytes != nullptr) *bytes = c.bytes();
    return a;
  }
  static size_t arrays_bytes(int64_t g) {
    size_t bytes = 0;
    carve(nullptr, g, &bytes);
    return bytes;
  }

  static typename Gemm::Arguments arguments(int64_t num_groups, const Arrays& a, int device, float beta) {
    typename Gemm::Arguments args;
    decltype(args.epilogue.thread) fusion;
    fusion.alpha = 1.f;
    fusion.beta = beta;
    args = typename Gemm::Arguments{cutlass::gemm::GemmUniversalMode::kGrouped,
                                    {int(num_groups), a.problems, nullptr},
                                    {a.a, a.stride_a, a.b, a.stride_b, a.sfa, a.layout_sfa, a.sfb, a.layout_sfb},
                                    {fusion, a.c, a.stride_c, a.d, a.stride_d},
                                    hardware_info<Kernel>(device)};
    return args;
  }

  static size_t workspace_bytes(int64_t g) {
    const int device = ::sparsetrain::cuda::current_device();
    return arrays_bytes(g) + align_up(Gemm::get_workspace_size(arguments(g, Arrays{}, device, 0.f)));
  }

  static void run(const Fp8GemmArgs& p, void* workspace, size_t bytes, cudaStream_t s);
};

// One thread per group: that group's problem, pointers, strides and scale layouts. A group with
// no rows gets M = 0 (wgrad: its weight grad is written by zero_empty_groups).
template <typename S, int Cap>
__global__ void sm90_fp8_setup_kernel(const __grid_constant__ Fp8GemmParams<Cap> p, typename S::Arrays a) {
  using E = typename S::Element;
  const int64_t g = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (g >= p.num_groups) return;
  const int64_t* offsets = p.offsets;
  const int64_t row = offsets[g], rows = offsets[g + 1] - row;
  const E* a_base = static_cast<const E*>(p.a);
  const E* b_base = static_cast<const E*>(p.b);
  int m, n, k;
  int64_t a_ld, b_ld;
  if constexpr (S::kWgrad) {
    const int64_t tile = fp8_columnwise_tile_base(offsets, g), col = kFp8Tile * tile;
    m = rows > 0 ? int(p.m) : 0;
    n = int(p.n);
    k = int(rows);
    a.a[g] = a_base + col;
    a.b[g] = b_base + col;
    a.sfa[g] = p.sfa + tile * p.m;
    a.sfb[g] = p.sfb + tile * p.n;
    a.d[g] = static_cast<typename S::ElementD*>(p.dw[g]);
    a.c[g] = static_cast<typename S::PtrC>(p.dw[g]);
    a_ld = p.a_ld, b_ld = p.b_ld;
  } else {
    m = int(rows);
    n = int(p.n);
    k = int(p.k);
    a.a[g] = a_base + row * p.a_ld;
    a.b[g] = static_cast<const E*>(p.weight[g]);
    a.sfa[g] = p.sfa + row * fp8_tiles(p.k);
    a.sfb[g] = p.weight_scale[g];
    a.d[g] = static_cast<typename S::ElementD*>(p.d) + row * p.d_ld;
    a.c[g] = nullptr;
    a_ld = p.a_ld, b_ld = p.k;
  }
  a.problems[g] = typename S::Shape3(m, n, k);
  a.stride_a[g] = cutlass::make_cute_packed_stride(typename S::StrideA{}, cute::make_shape(m, k, 1));
  cute::get<0>(a.stride_a[g]) = a_ld;
  a.stride_b[g] = cutlass::make_cute_packed_stride(typename S::StrideB{}, cute::make_shape(n, k, 1));
  cute::get<0>(a.stride_b[g]) = b_ld;
  a.stride_c[g] = cutlass::make_cute_packed_stride(typename S::StrideC{}, cute::make_shape(m, n, 1));
  a.stride_d[g] = cutlass::make_cute_packed_stride(typename S::StrideD{}, cute::make_shape(m, n, 1));
  if constexpr (!S::kWgrad) cute::get<0>(a.stride_d[g]) = p.d_ld;
  a.layout_sfa[g] = S::ScaleConfig::tile_atom_to_shape_SFA(cute::make_shape(m, n, k, 1));
  a.layout_sfb[g] = S::ScaleConfig::tile_atom_to_shape_SFB(cute::make_shape(m, n, k, 1));
}

template <Fp8Variant V>
void Sm90Fp8GroupedGemm<V>::run(const Fp8GemmArgs& p, void* workspace, size_t bytes, cudaStream_t s) {
  const Arrays a = carve(workspace, p.num_groups);
  const int device = ::sparsetrain::cuda::current_device();
  const float beta = V == Fp8Variant::kWgradF32 && p.wgrad_store == WgradStore::kMainGradAccumulate ? 1.f : 0.f;
  const auto args = arguments(p.num_groups, a, device, beta);
  // Every check before the first launch (can_implement reads only host-side arguments).
  if (arrays_bytes(p.num_groups) + Gemm::get_workspace_size(args) > bytes)
    ST_FAIL("sm90 FP8 grouped GEMM: workspace too small");
  check_status(Gemm::can_implement(args), "can_implement");
  with_group_cap(p.num_groups, [&](auto cap) {
    constexpr int kCap = decltype(cap)::value;
    sm90_fp8_setup_kernel<Sm90Fp8GroupedGemm, kCap>
        <<<unsigned((p.num_groups + 127) / 128), 128, 0, s>>>(capped_params<kCap>(p), a);
  });
  ST_CUDA_CHECK(cudaGetLastError(), "sm90 FP8 grouped GEMM: sm90_fp8_setup_kernel launch");
  if constexpr (kWgrad) {
    if (V == Fp8Variant::kWgrad || p.wgrad_store != WgradStore::kMainGradAccumulate)
      zero_empty_groups<ElementD>(p.offsets, p.num_groups, p.dw, p.m * p.n, s);
  }
  void* cutlass_ws = static_cast<char*>(workspace) + arrays_bytes(p.num_groups);
  check_status(Kernel::initialize_workspace(args, cutlass_ws, s, nullptr), "initialize_workspace");
  launch_gemm<Gemm>(Kernel::to_underlying_arguments(args, cutlass_ws), s);
}

// The explicit specialisation of one variant; CMake generates one .cu each.
#define SPARSETRAIN_SM90_FP8_INSTANTIATE(V)                                          \
  template <>                                                                        \
  size_t fp8_workspace_bytes<V>(int64_t num_groups) {                                \
    return Sm90Fp8GroupedGemm<V>::workspace_bytes(num_groups);                       \
  }                                                                                  \
  template <>                                                                        \
  void run_fp8<V>(const Fp8GemmArgs& p, void* workspace, size_t bytes, void* stream) { \
    Sm90Fp8GroupedGemm<V>::run(p, workspace, bytes, static_cast<cudaStream_t>(stream)); \
  }

}  // namespace sparsetrain::cuda::sm90

// The fast Hopper grouped GEMMs: CUTLASS's sm90 ptr-array kernel (TMA loads, wgmma, warp-
// specialised cooperative schedule) over the groups. Problem sizes, pointers and strides are
// written on the device by a set-up kernel from the group offsets, so a launch never reads split
// values on the host and a captured graph replays with new splits. The per-launch arrays and
// CUTLASS's workspace live in the caller's workspace (sizes from G only).
//
//   fprop  D_g [rows_g, out] = x_g [rows_g, in] . W_g^T    A row-major, B = W_g column-major
//          (+ b_g broadcast over the rows, read by the epilogue through a per-group pointer table)
//   dgrad  D_g [rows_g, in]  = dy_g [rows_g, out] . W_g    A row-major, B = W_g row-major
//   wgrad  D_g [out, in]     = dy_g^T . x_g  (+ C_g)       A = dy_g column-major, B = x_g row-major,
//          K = rows_g (ragged); fp32 main_grad: C = D = main_grad, beta 1 (accumulate) or 0, or
//          (kWgradF32Add) D = main_grad accumulated by the TMA store itself (a reduce-add, no C)
// Each variant has a direct-store twin (grouped_gemm_tuning_sm90.h) for caller outputs off a 16-byte boundary:
// the same mainloop, its epilogue writing each element from the accumulator registers.
// Groups with no rows get M = 0 (no tiles): a K = 0 problem is never launched (CUTLASS would
// leave its accumulators unwritten); wgrad handles those groups in its set-up kernel instead.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <type_traits>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/epilogue/fusion/sm90_callbacks_tma_warpspecialized.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/group_array_problem_shape.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/util/packed_stride.hpp"
#include "cuda/cuda_check.h"
#include "cuda/device_cache.h"
#include "cuda/grouped_linear/grouped_gemm_launch_sm90.cuh"
#include "cuda/grouped_linear/grouped_gemm_params.h"
#include "cuda/grouped_linear/tma_reduce_add_sm90.cuh"
#include "sparsetrain/dtype.h"
#include "sparsetrain/error.h"

namespace sparsetrain::cuda::sm90 {

using namespace cute;

template <typename E> struct CutlassType;
template <> struct CutlassType<bf16_t> { using type = cutlass::bfloat16_t; };
template <> struct CutlassType<fp16_t> { using type = cutlass::half_t; };

// Operand layouts and output types of each variant (Element: the operands' type).
template <Variant V, typename Element>
struct Config;
template <typename E> struct Config<Variant::kFprop, E> {
  using A = cutlass::layout::RowMajor; using B = cutlass::layout::ColumnMajor; using C = void; using D = E;
};
template <typename E> struct Config<Variant::kFpropBias, E> : Config<Variant::kFprop, E> {};
template <typename E> struct Config<Variant::kDgrad, E> {
  using A = cutlass::layout::RowMajor; using B = cutlass::layout::RowMajor; using C = void; using D = E;
};
template <typename E> struct Config<Variant::kWgrad, E> {
  using A = cutlass::layout::ColumnMajor; using B = cutlass::layout::RowMajor; using C = void; using D = E;
};
template <typename E> struct Config<Variant::kWgradF32, E> : Config<Variant::kWgrad, E> { using C = float; using D = float; };
template <typename E> struct Config<Variant::kWgradF32Add, E> : Config<Variant::kWgrad, E> { using D = float; };
template <typename E> struct Config<Variant::kFpropDirect, E> : Config<Variant::kFprop, E> {};
template <typename E> struct Config<Variant::kFpropNoCluster, E> : Config<Variant::kFprop, E> {};
template <typename E> struct Config<Variant::kFpropBiasNoCluster, E> : Config<Variant::kFprop, E> {};
template <typename E> struct Config<Variant::kDgradNoCluster, E> : Config<Variant::kDgrad, E> {};
// Direct store, biased: the bias is the epilogue's source C, read with a zero row stride.
template <typename E> struct Config<Variant::kFpropBiasDirect, E> : Config<Variant::kFprop, E> { using C = E; };
template <typename E> struct Config<Variant::kDgradDirect, E> : Config<Variant::kDgrad, E> {};
template <typename E> struct Config<Variant::kWgradF32Direct, E> : Config<Variant::kWgradF32, E> {};

// The epilogue's fusion: D = acc (+ beta C), or D = acc + bias_g broadcast over the rows, the bias
// read through a per-group pointer table. The direct-store epilogue takes only LinearCombination:
// there D = acc + 1 * bias is the same single fp32 rounding as the TMA epilogue's acc + bias.
template <Variant V, typename Element, typename ElementD, typename ElementC, typename TileShape>
struct Fusion {
  using type = cutlass::epilogue::fusion::LinearCombination<ElementD, float, ElementC>;
};
template <typename Element, typename ElementD, typename ElementC, typename TileShape>
struct Fusion<Variant::kFpropBias, Element, ElementD, ElementC, TileShape> {
  using Bias = cutlass::epilogue::fusion::Sm90RowBroadcast<0, TileShape, Element*, float, Stride<_0, _1, _0>>;
  using type = cutlass::epilogue::fusion::Sm90EVT<
      cutlass::epilogue::fusion::Sm90Compute<cutlass::plus, ElementD, float, cutlass::FloatRoundStyle::round_to_nearest>,
      cutlass::epilogue::fusion::Sm90AccFetch, Bias>;
};

// The epilogue the builder made, storing D with another TMA operation (kWgradF32Add: a reduce-add
// instead of a store; everything else, tiles and pipeline included, the builder's).
template <class Epilogue, class CopyOpS2G>
struct WithStoreOp {
  using type = Epilogue;
};
template <class Policy, class Tile, class EpiTile, class EC, class SC, class ED, class SD, class Fusion_, class G2S,
          class AtomC, class S2R, class S2G, class AtomD, class R2S, class CopyAtomC, class R2R, class CopyOpS2G>
struct WithStoreOp<cutlass::epilogue::collective::CollectiveEpilogue<Policy, Tile, EpiTile, EC, SC, ED, SD, Fusion_,
                                                                     G2S, AtomC, S2R, S2G, AtomD, R2S, CopyAtomC, R2R>,
                   CopyOpS2G> {
  using type = cutlass::epilogue::collective::CollectiveEpilogue<Policy, Tile, EpiTile, EC, SC, ED, SD, Fusion_, G2S,
                                                                 AtomC, S2R, CopyOpS2G, AtomD, R2S, CopyAtomC, R2R>;
};

template <Variant V, typename E>
struct Sm90GroupedGemm {
  static constexpr Variant kVariant = V;
  static constexpr Variant kComputes = computed_by(V);
  static constexpr bool kDirect = is_direct_store(V);
  // Whose epilogue fusion it runs: a no-cluster twin its variant's; a direct-store twin its own
  // (the biased one adds the bias as C).
  static constexpr Variant kFused = kDirect ? V : kComputes;
  using Element = typename CutlassType<E>::type;
  using Cfg = Config<V, Element>;
  using ElementC = typename Cfg::C;
  using ElementD = typename Cfg::D;
  using LayoutD = cutlass::layout::RowMajor;
  using ProblemShape = cutlass::gemm::GroupProblemShape<Shape<int, int, int>>;
  static constexpr int kAlignAB = 128 / cutlass::sizeof_bits<Element>::value;  // 16-byte TMA alignment
  static constexpr int kAlignD = kDirect ? 1 : 128 / cutlass::sizeof_bits<ElementD>::value;
  static constexpr int kAlignC =
      kDirect || std::is_void_v<ElementC> ? kAlignD : 128 / cutlass::sizeof_bits<ElementC>::value;
  using EpilogueSchedule = std::conditional_t<kDirect, cutlass::epilogue::PtrArrayNoSmemWarpSpecialized,
                                              cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative>;
  // 128x256x64 tiles, cooperative (both consumer warpgroups on one tile), on clusters of 2x1 or
  // (the no-cluster twins) of one CTA: grouped_gemm_tuning_sm90.h says what else was measured.
  using TileShape = Shape<Int<kTileM>, Int<kTileN>, _64>;
  using ClusterShape = Shape<Int<is_no_cluster(V) ? 1 : 2>, _1, _1>;
  using BuiltEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, ElementC, LayoutD*, kAlignC, ElementD, LayoutD*,
      kAlignD, EpilogueSchedule, typename Fusion<kFused, Element, ElementD, ElementC, TileShape>::type>::CollectiveOp;
  using CollectiveEpilogue = std::conditional_t<V == Variant::kWgradF32Add,
                                                typename WithStoreOp<BuiltEpilogue, TmaReduceAdd>::type,
                                                BuiltEpilogue>;
  using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Element, typename Cfg::A*, kAlignAB, Element,
      typename Cfg::B*, kAlignAB, float, TileShape, ClusterShape,
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
  using PtrC = std::conditional_t<std::is_void_v<ElementC>, const void*, const ElementC*>;

  struct Arrays {  // device arrays of one launch, carved from the workspace
    Shape3* problems;
    const Element** a;
    const Element** b;
    PtrC* c;
    ElementD** d;
    const Element** bias;
    StrideA* stride_a;
    StrideB* stride_b;
    StrideC* stride_c;
    StrideD* stride_d;
  };

  static size_t align_up(size_t n) { return (n + 255) / 256 * 256; }
  // The arrays in the workspace (GroupArrays; over a null one, only their size in *bytes).
  static Arrays carve(void* ws, int64_t g, size_t* bytes = nullptr) {
    GroupArrays c(ws, g);
    Arrays a;
    c.take(a.problems), c.take(a.a), c.take(a.b), c.take(a.c), c.take(a.d), c.take(a.bias);
    c.take(a.stride_a), c.take(a.stride_b), c.take(a.stride_c), c.take(a.stride_d);
    if (bytes != nullptr) *bytes = c.bytes();
    return a;
  }
  static size_t arrays_bytes(int64_t g) {
    size_t bytes = 0;
    carve(nullptr, g, &bytes);
    return bytes;
  }

  static typename Gemm::Arguments arguments(const GroupedGemmParams& p, const Tuning& t, const Arrays& a, int device,
                                            float beta) {
    typename Gemm::Arguments args;
    decltype(args.epilogue.thread) fusion;
    if constexpr (kFused == Variant::kFpropBias) {  // (its direct twin: C = bias, beta 1)
      fusion = {{}, {a.bias}, {}};  // EVT arguments: {AccFetch, RowBroadcast, plus}
    } else {
      fusion.alpha = 1.f;
      fusion.beta = beta;
    }
    const cutlass::KernelHardwareInfo hw = hardware_info<Kernel>(device);
    args = typename Gemm::Arguments{cutlass::gemm::GemmUniversalMode::kGrouped,
                                    {int(p.num_groups), a.problems, nullptr},
                                    {a.a, a.stride_a, a.b, a.stride_b},
                                    {fusion, a.c, a.stride_c, a.d, a.stride_d},
                                    hw};
    using RasterOrder = cutlass::gemm::kernel::detail::RasterOrderOptions;
    args.scheduler.raster_order = t.raster == Raster::kAlongN ? RasterOrder::AlongN : RasterOrder::AlongM;
    args.scheduler.max_swizzle_size = t.swizzle;
    return args;
  }

  static size_t workspace_bytes(int64_t g) {
    GroupedGemmParams p{};
    p.num_groups = g;
    const int device = ::sparsetrain::cuda::current_device();
    return arrays_bytes(g) + align_up(Gemm::get_workspace_size(arguments(p, Tuning{}, Arrays{}, device, 0.f)));
  }

  static void run(const GroupedGemmParams& p, const Tuning& t, void* workspace, size_t bytes, void* stream);
};

// One thread per group: that group's problem, pointers and strides. A wgrad group with no rows
// gets M = 0; zero_empty_groups writes its zeros.
template <typename S, int Cap>
__global__ void sm90_setup_kernel(const __grid_constant__ CappedGemmParams<Cap> p, typename S::Arrays a) {
  using E = typename S::Element;
  constexpr Variant V = S::kComputes;
  const int64_t g = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (g >= p.num_groups) return;
  int64_t row, end;
  if (p.write_offsets != nullptr) {  // host splits: this launch also puts their offsets where later kernels read them
    row = p.host_offsets[g], end = p.host_offsets[g + 1];
    p.write_offsets[g] = row;
    if (g == p.num_groups - 1) p.write_offsets[g + 1] = end;
  } else {
    row = p.offsets[g], end = p.offsets[g + 1];
  }
  const int64_t rows = end - row;
  int m, n, k;
  if constexpr (is_wgrad(V)) {
    m = rows > 0 ? int(p.out) : 0;
    n = int(p.in);
    k = int(rows);
    a.a[g] = static_cast<const E*>(p.act) + row * p.act_ld;    // dy rows of g, column-major [out, rows]
    a.b[g] = static_cast<const E*>(p.act2) + row * p.act2_ld;  // x rows of g, row-major [rows, in]
    a.d[g] = static_cast<typename S::ElementD*>(p.dw[g]);
    a.c[g] = static_cast<typename S::PtrC>(p.dw[g]);
  } else {
    const bool dgrad = V == Variant::kDgrad;
    m = int(rows);
    n = int(dgrad ? p.in : p.out);
    k = int(dgrad ? p.out : p.in);
    a.a[g] = static_cast<const E*>(p.act) + row * p.act_ld;
    a.b[g] = static_cast<const E*>(p.weight[g]);
    a.d[g] = static_cast<E*>(p.c) + row * p.c_ld;
    a.bias[g] = static_cast<const E*>(p.bias[g]);
    a.c[g] = S::kVariant == Variant::kFpropBiasDirect ? a.bias[g] : nullptr;
  }
  a.problems[g] = typename S::Shape3(m, n, k);
  a.stride_a[g] = cutlass::make_cute_packed_stride(typename S::StrideA{}, cute::make_shape(m, k, 1));
  a.stride_b[g] = cutlass::make_cute_packed_stride(typename S::StrideB{}, cute::make_shape(n, k, 1));
  a.stride_c[g] = cutlass::make_cute_packed_stride(typename S::StrideC{}, cute::make_shape(m, n, 1));
  if constexpr (S::kVariant == Variant::kFpropBiasDirect) cute::get<0>(a.stride_c[g]) = 0;  // one bias row
  a.stride_d[g] = cutlass::make_cute_packed_stride(typename S::StrideD{}, cute::make_shape(m, n, 1));
}

template <Variant V, typename E>
void Sm90GroupedGemm<V, E>::run(const GroupedGemmParams& p, const Tuning& t, void* workspace, size_t bytes,
                                   void* stream) {
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  const Arrays a = carve(workspace, p.num_groups);
  const int device = ::sparsetrain::cuda::current_device();
  // beta 1 where the epilogue adds its source: main_grad being accumulated, the direct biased
  // fprop's bias.
  const bool adds_source = V == Variant::kFpropBiasDirect ||
                           (kComputes == Variant::kWgradF32 && p.wgrad_store == WgradStore::kMainGradAccumulate);
  const float beta = adds_source ? 1.f : 0.f;
  if (V == Variant::kWgradF32Add && p.wgrad_store != WgradStore::kMainGradAccumulate)
    ST_FAIL("sm90 grouped GEMM: the reduce-add wgrad only accumulates into main_grad");
  const auto args = arguments(p, t, a, device, beta);
  // Every check before the first launch: a refusal must leave dW (zero-filled below for empty
  // groups) and the set-up arrays as they were. can_implement reads only host-side arguments
  // (the problem shapes stay on the device), so it can run before the set-up kernel writes them.
  if (arrays_bytes(p.num_groups) + Gemm::get_workspace_size(args) > bytes) ST_FAIL("sm90 grouped GEMM: workspace too small");
  check_status(Gemm::can_implement(args), "can_implement");
  with_group_cap(p.num_groups, [&](auto cap) {
    constexpr int kCap = decltype(cap)::value;
    sm90_setup_kernel<Sm90GroupedGemm, kCap><<<unsigned((p.num_groups + 127) / 128), 128, 0, s>>>(
        capped_params<kCap>(p), a);
  });
  ST_CUDA_CHECK(cudaGetLastError(), "sm90 grouped GEMM: sm90_setup_kernel launch");
  if constexpr (is_wgrad(kComputes)) {
    if (p.wgrad_store != WgradStore::kMainGradAccumulate)
      zero_empty_groups<ElementD>(p.offsets, p.num_groups, p.dw, p.out * p.in, s);
  }
  void* cutlass_ws = static_cast<char*>(workspace) + arrays_bytes(p.num_groups);
  check_status(Kernel::initialize_workspace(args, cutlass_ws, s, nullptr), "initialize_workspace");
  launch_gemm<Gemm>(Kernel::to_underlying_arguments(args, cutlass_ws), s);
}

// The explicit specialisation of one (variant, element); CMake generates one .cu each.
#define SPARSETRAIN_SM90_INSTANTIATE(V, E)                                                     \
  template <>                                                                                      \
  size_t workspace_bytes<V, E>(int64_t num_groups) {                                            \
    return Sm90GroupedGemm<V, E>::workspace_bytes(num_groups);                                  \
  }                                                                                                \
  template <>                                                                                      \
  void run<V, E>(const GroupedGemmParams& p, const Tuning& t, void* workspace, size_t bytes,    \
                    void* stream) {                                                                \
    Sm90GroupedGemm<V, E>::run(p, t, workspace, bytes, stream);                                 \
  }

}  // namespace sparsetrain::cuda::sm90

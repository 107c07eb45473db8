// Experiment: the FP8 blockwise fprop GEMM (kActWeight) on other clusters and tile-scheduler
// swizzles, one shared object per cluster (-DST_CM=.. -DST_CN=..), called through ctypes from
// 2026-12-02_fp8_fprop_clusters.py beside torch._scaled_grouped_mm. Build as the wgrad shape
// experiment (nvcc ... -shared THIS.cu build/libsparsetrain.a -o c<CM>x<CN>.so).
#include <cstdint>

#include "cuda/grouped_linear/grouped_gemm_fp8_sm90.cuh"

namespace sm90 = sparsetrain::cuda::sm90;
using S = sm90::Sm90Fp8GroupedGemm<sparsetrain::cuda::Fp8Variant::kActWeight,
                                   cute::Shape<cute::Int<ST_CM>, cute::Int<ST_CN>, cute::_1>>;

extern "C" size_t st_ws_bytes(int64_t groups) { return S::workspace_bytes(groups); }

// y [T, n] bf16 = dequant(a [T, k] e4m3, sfa) . dequant(w_g [n, k], wscale_g)^T per group; raster
// 0 / 1 (along M / N; -1: as the library leaves it), swizzle 1, 2, 4, 8 (0: the library's); S::run's steps with the scheduler's arguments set.
extern "C" int st_fprop(int64_t groups, int64_t k, int64_t n, const int64_t* offsets, const void* a, const float* sfa,
                        const void* w, const float* wscale, void* y, int raster, int swizzle, void* ws, size_t bytes,
                        void* stream) {
  try {
    static sparsetrain::cuda::Fp8GemmArgs p{};
    p.num_groups = groups, p.n = n, p.k = k, p.offsets = offsets;
    p.a = a, p.sfa = sfa, p.a_ld = k, p.d = y, p.d_ld = n;
    for (int64_t g = 0; g < groups; ++g) {
      p.weight[g] = static_cast<const char*>(w) + g * n * k;
      p.weight_scale[g] = wscale + g * (n / 128) * (k / 128);
    }
    const cudaStream_t s = static_cast<cudaStream_t>(stream);
    const auto arr = S::carve(ws, groups);
    auto args = S::arguments(groups, arr, sparsetrain::cuda::current_device(), 0.f);
    using RO = cutlass::gemm::kernel::detail::RasterOrderOptions;
    if (raster >= 0) args.scheduler.raster_order = raster ? RO::AlongN : RO::AlongM;  // -1: the library's
    if (swizzle > 0) args.scheduler.max_swizzle_size = swizzle;
    if (S::arrays_bytes(groups) + S::Gemm::get_workspace_size(args) > bytes) return 3;
    sm90::check_status(S::Gemm::can_implement(args), "can_implement");
    sparsetrain::cuda::with_group_cap(groups, [&](auto cap) {
      constexpr int kCap = decltype(cap)::value;
      sm90::sm90_fp8_setup_kernel<S, kCap><<<unsigned((groups + 127) / 128), 128, 0, s>>>(
          sparsetrain::cuda::capped_params<kCap>(p), arr);
    });
    void* cutlass_ws = static_cast<char*>(ws) + S::arrays_bytes(groups);
    sm90::check_status(S::Kernel::initialize_workspace(args, cutlass_ws, s, nullptr), "initialize_workspace");
    sm90::launch_gemm<S::Gemm>(S::Kernel::to_underlying_arguments(args, cutlass_ws), s);
    return cudaGetLastError() == cudaSuccess ? 0 : 2;
  } catch (...) {
    return 1;
  }
}

// Experiment: the bf16 grouped wgrad into an fp32 main_grad (accumulate) under other kernel
// shapes (tile, cluster, cooperative / ping-pong) and both epilogues (the register epilogue
// reading main_grad, kWgradF32; the TMA reduce-add, kWgradF32Add), one shared object per shape
// (-DST_M .. -DST_N .. -DST_K .. -DST_CM .. -DST_CN .. -DST_PP=0/1 -DST_ADD=0/1), called through
// ctypes from 2026-12-02_wgrad_main_grad_kernel_shapes.py.
//   nvcc -std=c++17 -O3 -DNDEBUG --expt-relaxed-constexpr -gencode=arch=compute_90a,code=sm_90a
//        -Xcompiler -fPIC -Iinclude -Isrc -isystem CUTLASS/include -DSPARSETRAIN_WITH_CUDA=1
//        -DSPARSETRAIN_WITH_CUTLASS=1 -shared -DST_M=128 ... THIS.cu build/libsparsetrain.a -o shape.so
#include <cstdint>

#include "cuda/grouped_linear/grouped_gemm_sm90.cuh"

namespace sm90 = sparsetrain::cuda::sm90;
using Gemm = sm90::Sm90GroupedGemm<ST_ADD ? sm90::Variant::kWgradF32Add : sm90::Variant::kWgradF32, sparsetrain::bf16_t,
                                   sm90::KernelShape<ST_M, ST_N, ST_K, ST_CM, ST_CN, bool(ST_PP)>>;

extern "C" size_t st_ws_bytes(int64_t groups) { return Gemm::workspace_bytes(groups); }

// main_grad [G, out, in] fp32 += dy_g^T x_g per group (offsets [G + 1] int64 on the device,
// dy [T, out], x [T, in] bf16). raster_n: walk the tiles along N (the library's rule for out >> in).
extern "C" int st_wgrad(int64_t groups, int64_t rows, int64_t in, int64_t out, const int64_t* offsets,
                        const void* dy, const void* x, void* main_grad, int raster_n, void* ws, size_t ws_bytes,
                        void* stream) {
  try {
    static sparsetrain::cuda::GroupedGemmParams p{};
    p.kind = sparsetrain::cuda::GemmKind::kWgrad;
    p.wgrad_store = sparsetrain::cuda::WgradStore::kMainGradAccumulate;
    p.num_groups = groups, p.num_rows = rows, p.in = in, p.out = out;
    p.offsets = offsets, p.host_offsets = nullptr;
    p.act = dy, p.act_ld = out, p.act2 = x, p.act2_ld = in;
    for (int64_t g = 0; g < groups; ++g) p.dw[g] = static_cast<char*>(main_grad) + g * out * in * 4;
    sm90::Tuning t;
    t.raster = raster_n ? sm90::Raster::kAlongN : sm90::Raster::kAlongM;
    Gemm::run(p, t, ws, ws_bytes, stream);
    return 0;
  } catch (...) {
    return 1;
  }
}

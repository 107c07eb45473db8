// Experiment: the bf16 grouped fprop under other kernel shapes (tile, cluster, schedule), one
// shared object per shape (-DST_M=.. -DST_N=.. -DST_K=.. -DST_CM=.. -DST_CN=.. -DST_PP=0/1), called
// through ctypes from 2026-12-02_gemm_kernel_shapes.py beside torch._grouped_mm.
//   nvcc -std=c++17 -O3 --expt-relaxed-constexpr -gencode=arch=compute_90a,code=sm_90a -Xcompiler -fPIC
//        -Iinclude -Isrc -isystem CUTLASS/include -isystem CUTLASS/tools/util/include -shared
//        -DST_M=128 ... docs/experiments/2026-12-02_gemm_kernel_shapes.cu build/libsparsetrain.a -o shape.so
#include <cstdint>

#include "cuda/grouped_linear/grouped_gemm_sm90.cuh"

namespace sm90 = sparsetrain::cuda::sm90;
using Gemm = sm90::Sm90GroupedGemm<sm90::Variant::kFprop, sparsetrain::bf16_t,
                                   sm90::KernelShape<ST_M, ST_N, ST_K, ST_CM, ST_CN, bool(ST_PP)>>;

extern "C" size_t st_ws_bytes(int64_t groups) { return Gemm::workspace_bytes(groups); }

// y [T, out] = x [T, in] . W_g^T per group (offsets [G + 1] int64 on the device, w [G, out, in]).
extern "C" int st_fprop(int64_t groups, int64_t rows, int64_t in, int64_t out, const int64_t* offsets,
                        const void* x, const void* w, void* y, void* ws, size_t ws_bytes, void* stream) {
  try {
    static sparsetrain::cuda::GroupedGemmParams p{};
    p.kind = sparsetrain::cuda::GemmKind::kFprop;
    p.num_groups = groups, p.num_rows = rows, p.in = in, p.out = out;
    p.offsets = offsets, p.host_offsets = nullptr;
    p.act = x, p.act_ld = in, p.c = y, p.c_ld = out;
    for (int64_t g = 0; g < groups; ++g) {
      p.weight[g] = static_cast<const char*>(w) + g * out * in * 2;
      p.bias[g] = nullptr;
    }
    Gemm::run(p, sm90::Tuning{}, ws, ws_bytes, stream);
    return 0;
  } catch (...) {
    return 1;
  }
}

// The SIMT grouped GEMM, bias grad and tail kernels for fp16 (one element type per .cu).
#include "cuda/grouped_linear/grouped_gemm_simt.cuh"

namespace sparsetrain::cuda {

template bool launch_grouped_gemm<fp16_t>(const GroupedGemmParams&, void*);
template void launch_bias_grad<fp16_t>(const int64_t*, int64_t, int64_t, const void*, int64_t, void*, void*);
template void launch_zero_tail<fp16_t>(const int64_t*, int64_t, void*, int64_t, int64_t, void*);

}  // namespace sparsetrain::cuda

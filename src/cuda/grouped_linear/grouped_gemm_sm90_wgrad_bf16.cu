// The sm90 CUTLASS grouped GEMM, variant wgrad_bf16 (one instantiation per .cu: CUTLASS TUs are slow).
#include "cuda/grouped_linear/grouped_gemm_sm90.cuh"

namespace sparsetrain::cuda::sm90 {
SPARSETRAIN_SM90_INSTANTIATE(Variant::kWgradBf16)
}  // namespace sparsetrain::cuda::sm90

// The sm90 CUTLASS grouped GEMM, variant wgrad_f32 (one instantiation per .cu: CUTLASS TUs are slow).
#include "cuda/grouped_linear/grouped_gemm_sm90.cuh"

namespace sparsetrain::cuda::sm90 {
SPARSETRAIN_SM90_INSTANTIATE(Variant::kWgradF32)
}  // namespace sparsetrain::cuda::sm90

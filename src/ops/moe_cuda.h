// The MoE router's and layer's device paths (src/cuda/moe/moe_cuda.cu), called by moe_router.cpp
// and moe_layer.cpp after every check: raw device pointers, the caller's stream, no host read.
#pragma once

#include <cstdint>

#include "common/moe_routing.h"
#include "sparsetrain/allocator.h"
#include "sparsetrain/dtype.h"

namespace sparsetrain {

// The layout kernel counts a chunk's tokens per expert in shared memory (4 bytes an expert).
constexpr int64_t kMaxExpertsCuda = 8192;

#if SPARSETRAIN_WITH_CUDA
struct RouteOutputs {
  int32_t* experts;       // [N, K]
  float* probs;           // [N, K]
  int64_t* counts;        // [E]
  int32_t* row_of;        // [N, K]
  int32_t* token_of_row;  // [N * K]
  float* score_sum;       // [E]
};
// Device scratch route_cuda needs (bytes).
int64_t route_cuda_scratch_bytes(int64_t N, int32_t E);
void route_cuda(const RouterRule& r, const float* logits, int64_t stride, const float* bias, int64_t N,
                const RouteOutputs& out, void* scratch, int device, Stream stream);
// An invalid expert id (out of range, repeated in a token) makes that token's gradient NaN.
void route_backward_cuda(const RouterRule& r, const float* logits, int64_t stride, const int32_t* experts,
                         int64_t experts_stride, const float* dprobs, int64_t dprobs_stride, const float* dscore_sum,
                         int64_t N, float* dlogits, int device, Stream stream);
// rows[r] = x[index[r]] (rows contiguous [R, H]).
void gather_rows_cuda(DType dtype, const void* x, int64_t x_stride, const int32_t* index, int64_t R, int64_t H,
                      void* rows, int device, Stream stream);
// out[n] = sum over i < K of rows[row_of[n * K + i]], in slot order, in fp32, rounded once.
void combine_rows_cuda(DType dtype, const void* rows, int64_t rows_stride, const int32_t* row_of, int64_t N, int32_t K,
                       int64_t H, void* out, int device, Stream stream);
// dst[index[i]] = src[i] (scatter: index a permutation) or dst[i] = src[index[i]].
void permute_f32_cuda(const float* src, const int32_t* index, int64_t n, float* dst, bool scatter, int device,
                      Stream stream);
#endif

}  // namespace sparsetrain

// The internal interface every MoE backend implements (the CPU reference, CUDA): the router's
// choice, layout and score sums, its backward, and the rows' moves between the token order and the
// expert-major layout. ops/moe_router.cpp and ops/moe_layer.cpp own every rule (validation,
// allocation, the composition with GroupedMLP); a backend runs on validated arguments: raw
// pointers, the caller's stream, no host read of device data.
#pragma once

#include <cstddef>
#include <cstdint>

#include "common/moe_routing.h"
#include "sparsetrain/allocator.h"
#include "sparsetrain/dtype.h"
#include "sparsetrain/tensor.h"

namespace sparsetrain::backend {

// The CUDA layout kernel counts a chunk's tokens per expert in shared memory (4 bytes an expert).
constexpr int64_t kMaxExpertsCuda = 8192;

struct RouteOutputs {
  int32_t* experts;       // [N, K]
  float* probs;           // [N, K]
  int64_t* counts;        // [E]
  int32_t* row_of;        // [N, K]
  int32_t* token_of_row;  // [N * K]
  float* score_sum;       // [E]
};

class MoEBackend {
 public:
  virtual ~MoEBackend() = default;
  // Scratch route() needs (bytes; 0: none).
  virtual size_t route_scratch_bytes(int64_t N, int32_t E) const = 0;
  // Each token's experts and probs, the counts, the layout (row_of, token_of_row) and the score sums.
  virtual void route(const RouterRule& r, const float* logits, int64_t stride, const float* bias, int64_t N,
                     const RouteOutputs& out, void* scratch, Device device, Stream stream) = 0;
  // An invalid expert id (out of range, repeated in a token) makes that token's gradient NaN.
  virtual void route_backward(const RouterRule& r, const float* logits, int64_t stride, const int32_t* experts,
                              int64_t experts_stride, const float* dprobs, int64_t dprobs_stride,
                              const float* dscore_sum, int64_t N, float* dlogits, Device device, Stream stream) = 0;
  // rows[r] = x[index[r]] (rows contiguous [R, H]).
  virtual void gather_rows(DType dtype, const void* x, int64_t x_stride, const int32_t* index, int64_t R, int64_t H,
                           void* rows, Device device, Stream stream) = 0;
  // out[n] = sum over i < K of rows[row_of[n * K + i]], in slot order, in fp32, rounded once.
  virtual void combine_rows(DType dtype, const void* rows, int64_t rows_stride, const int32_t* row_of, int64_t N,
                            int32_t K, int64_t H, void* out, Device device, Stream stream) = 0;
  // dst[index[i]] = src[i] (scatter: index a permutation) or dst[i] = src[index[i]].
  virtual void permute_f32(const float* src, const int32_t* index, int64_t n, float* dst, bool scatter,
                           Device device, Stream stream) = 0;
};

MoEBackend& moe_reference_backend();
#if SPARSETRAIN_WITH_CUDA
// The router's and the rows' kernels (src/cuda/moe/moe_cuda.cu).
MoEBackend& moe_cuda_backend();
#endif
// The backend that runs on `device`; an Error naming `arg` where this build has none.
MoEBackend& moe_backend_for(Device device, const char* arg);

}  // namespace sparsetrain::backend

// document_ids_from_cu_seqlens on a CUDA device: one thread per position runs document_of_position
// (src/common/attention/cu_seqlens.h, the host conversion's own function), so the device ids equal the host
// ones. One launch on the caller's stream; the offsets are never read by the host.
#include <cuda_runtime.h>

#include "common/attention/cu_seqlens.h"
#include "cuda/block_mask/block_mask_cuda.h"
#include "cuda/cuda_check.h"
#include "cuda/runtime_cuda.h"
#include "sparsetrain/error.h"

namespace sparsetrain {
namespace {

constexpr int kThreads = 256;

// Grid-stride, so any seq fits a grid of at most 65535 CTAs. The offsets (n + 1 int32: a few KiB at
// most) are read through the cache by every thread's binary search.
__global__ void cu_seqlens_to_ids_kernel(const int32_t* __restrict__ cu, int64_t num_docs, int32_t padding_id,
                                         int32_t* __restrict__ ids, int64_t seq) {
  for (int64_t p = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; p < seq; p += int64_t(gridDim.x) * blockDim.x)
    ids[p] = document_of_position(cu, num_docs, p, padding_id);
}

}  // namespace

void document_ids_from_cu_seqlens_cuda(const int32_t* cu, int64_t num_docs, int32_t padding_id, int32_t* ids,
                                       int64_t seq, int device, Stream stream) {
  if (seq <= 0) return;
  cuda::DeviceGuard guard(device);
  const int64_t blocks = (seq + kThreads - 1) / kThreads;
  const unsigned grid = unsigned(blocks < 65535 ? blocks : 65535);
  cu_seqlens_to_ids_kernel<<<grid, kThreads, 0, static_cast<cudaStream_t>(stream.handle)>>>(cu, num_docs,
                                                                                           padding_id, ids, seq);
  ST_CUDA_CHECK(cudaGetLastError(), "cu_seqlens_to_ids_kernel launch");
}

}  // namespace sparsetrain

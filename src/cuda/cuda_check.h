// The one CUDA error check of the library: ST_CUDA_CHECK(call, "what", ...) throws sparsetrain::Error
// (kRuntime) naming what failed and the CUDA error, e.g. "CUDA attention: cudaMemsetAsync (dQ
// semaphores) failed: invalid argument (cudaErrorInvalidValue)". Launches are checked with
// ST_CUDA_CHECK(cudaGetLastError(), "... launch"). Host code of .cu / .cuh files only: it needs the
// CUDA runtime header, which .cpp files never include (cuda/runtime_cuda.h).
#pragma once

#include <cuda_runtime.h>

#include "sparsetrain/error.h"

namespace sparsetrain::cuda {

template <class... What>
[[noreturn]] void fail_cuda(cudaError_t e, const What&... what) {
  ST_FAIL(what..., " failed: ", cudaGetErrorString(e), " (", cudaGetErrorName(e), ")");
}

}  // namespace sparsetrain::cuda

// `call` is evaluated exactly once; the pieces of `what...` (streamed like ST_FAIL's) only on
// failure.
#define ST_CUDA_CHECK(call, ...)                                           \
  do {                                                                     \
    const cudaError_t st_cuda_check_error_ = (call);                       \
    if (st_cuda_check_error_ != cudaSuccess)                               \
      ::sparsetrain::cuda::fail_cuda(st_cuda_check_error_, __VA_ARGS__);   \
  } while (0)

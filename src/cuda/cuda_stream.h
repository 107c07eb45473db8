// The library's Stream (an opaque handle, sparsetrain/allocator.h) as the cudaStream_t it holds.
#pragma once

#include <cuda_runtime.h>

#include "sparsetrain/allocator.h"  // Stream

namespace sparsetrain::cuda {

inline cudaStream_t as_cuda(Stream s) { return static_cast<cudaStream_t>(s.handle); }

}  // namespace sparsetrain::cuda

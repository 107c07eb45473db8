// ST_HOST_DEVICE: marks the index math that the CPU code and the CUDA kernels both run (the group
// offsets, the schedulers, the mask predicate and walks, the router's rules). __host__ __device__
// under nvcc, nothing for the host compiler, so the same functions build into CPU-only code.
#pragma once

#if defined(__CUDACC__)
#define ST_HOST_DEVICE __host__ __device__
#else
#define ST_HOST_DEVICE
#endif

// Programmatic dependent launch (sm_90+): a kernel launched with launch_dependent() may be
// scheduled before the kernel ahead of it on the stream has finished, once every CTA of that
// kernel has called pdl_launch_dependents() (or exited), so that its launch and prologue (barrier
// set-up, descriptor prefetch) overlap that kernel's last wave. It must call pdl_wait() before it
// touches memory the kernel ahead writes: the wait returns once that kernel has completed and its
// writes are visible. Used only between the kernels of one operation, where the kernel ahead is
// always the operation's own (launched in the ordinary way after everything before it).
#pragma once

#include <cuda_runtime.h>

#include <utility>

namespace sparsetrain::cuda {

__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ void pdl_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// kernel<<<grid, block, smem, stream>>>(args...) as a programmatic dependent of the kernel ahead.
template <class... Params, class... Args>
cudaError_t launch_dependent(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                             Args&&... args) {
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  config.attrs = attr;
  config.numAttrs = 1;
  return cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...);
}

}  // namespace sparsetrain::cuda

// CUDA runtime services for the host code (see runtime_cuda.h). Every call is checked.
#include <cuda_runtime.h>

#include "cuda/cuda_check.h"
#include "cuda/runtime_cuda.h"

namespace sparsetrain::cuda {

DeviceGuard::DeviceGuard(int device) {
  ST_CUDA_CHECK(cudaGetDevice(&previous_), "cudaGetDevice");
  if (previous_ != device) ST_CUDA_CHECK(cudaSetDevice(device), "cudaSetDevice(", device, ")");
  changed_ = previous_ != device;
}

DeviceGuard::~DeviceGuard() {
  if (changed_) cudaSetDevice(previous_);
}

int device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky "no driver" error so later calls are not confused
    return 0;
  }
  return n;
}

std::string device_name(int device) {
  cudaDeviceProp prop{};
  ST_CUDA_CHECK(cudaGetDeviceProperties(&prop, device), "cudaGetDeviceProperties(", device, ")");
  return std::string(prop.name) + " (sm_" + std::to_string(prop.major * 10 + prop.minor) + ")";
}

void* malloc_async(size_t bytes, int device, void* stream) {
  DeviceGuard guard(device);
  void* p = nullptr;
  ST_CUDA_CHECK(cudaMallocAsync(&p, bytes, static_cast<cudaStream_t>(stream)), "cudaMallocAsync");
  return p;
}

void free_async(void* ptr, int device, void* stream) {
  DeviceGuard guard(device);
  ST_CUDA_CHECK(cudaFreeAsync(ptr, static_cast<cudaStream_t>(stream)), "cudaFreeAsync");
}

}  // namespace sparsetrain::cuda

// CUDA runtime services for the host code (see runtime_cuda.h). Every call is checked.
#include <cuda_runtime.h>

#include "sparsetrain/error.h"
#include "cuda/runtime_cuda.h"

namespace sparsetrain::cuda {
namespace {

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) ST_FAIL(what, " failed: ", cudaGetErrorString(e));
}

}  // namespace

DeviceGuard::DeviceGuard(int device) {
  check(cudaGetDevice(&previous_), "cudaGetDevice");
  if (previous_ != device) check(cudaSetDevice(device), "cudaSetDevice");
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
  check(cudaGetDeviceProperties(&prop, device), "cudaGetDeviceProperties");
  return std::string(prop.name) + " (sm_" + std::to_string(prop.major * 10 + prop.minor) + ")";
}

void* malloc_async(size_t bytes, int device, void* stream) {
  DeviceGuard guard(device);
  void* p = nullptr;
  check(cudaMallocAsync(&p, bytes, static_cast<cudaStream_t>(stream)), "cudaMallocAsync");
  return p;
}

void free_async(void* ptr, int device, void* stream) {
  DeviceGuard guard(device);
  check(cudaFreeAsync(ptr, static_cast<cudaStream_t>(stream)), "cudaFreeAsync");
}

}  // namespace sparsetrain::cuda

// The per-device cache of cuda/device_cache.h: one mutex over two maps, filled on first use. Entries
// never change once written (a device's attributes are fixed for the process), so a caller gets a
// copy and the lock is held only for the lookup (and the first query).
#include <cuda_runtime.h>

#include <map>
#include <mutex>
#include <string>
#include <utility>

#include "cuda/cuda_check.h"
#include "cuda/device_cache.h"
#include "cuda/runtime_cuda.h"
#include "sparsetrain/error.h"

namespace sparsetrain::cuda {
namespace {

struct Cache {
  std::mutex mutex;
  std::map<int, DeviceInfo> devices;
  std::map<std::pair<const void*, int>, int> smem;  // (kernel, device) -> bytes opted in to
};

Cache& cache() {
  static Cache c;
  return c;
}

int attribute(cudaDeviceAttr attr, int device, const char* name) {
  int v = 0;
  ST_CUDA_CHECK(cudaDeviceGetAttribute(&v, attr, device), "cudaDeviceGetAttribute(", name, ") on device ", device);
  return v;
}

}  // namespace

DeviceInfo device_info(int device) {
  Cache& c = cache();
  const std::lock_guard<std::mutex> lock(c.mutex);
  const auto it = c.devices.find(device);
  if (it != c.devices.end()) return it->second;
  const int n = device_count();
  ST_CHECK_ARG(device >= 0 && device < n, "device",
               "a CUDA device index in [0, " + std::to_string(n) + ")" +
                   (n == 0 ? " (this process sees no CUDA device)" : ""),
               device);
  DeviceInfo d;
  d.sm_count = attribute(cudaDevAttrMultiProcessorCount, device, "multiProcessorCount");
  d.cc_major = attribute(cudaDevAttrComputeCapabilityMajor, device, "computeCapabilityMajor");
  d.cc_minor = attribute(cudaDevAttrComputeCapabilityMinor, device, "computeCapabilityMinor");
  d.max_smem_optin = attribute(cudaDevAttrMaxSharedMemoryPerBlockOptin, device, "maxSharedMemoryPerBlockOptin");
  d.l2_bytes = attribute(cudaDevAttrL2CacheSize, device, "l2CacheSize");
  c.devices.emplace(device, d);
  return d;
}

int current_device() {
  int device = 0;
  ST_CUDA_CHECK(cudaGetDevice(&device), "cudaGetDevice");
  return device;
}

void opt_in_smem(const void* kernel, int bytes) {
  const int device = current_device();
  const DeviceInfo d = device_info(device);
  Cache& c = cache();
  const std::lock_guard<std::mutex> lock(c.mutex);
  int& done = c.smem[{kernel, device}];  // 0 when new
  if (bytes <= done) return;
  if (bytes > d.max_smem_optin)
    ST_FAIL("a kernel needs ", bytes, " bytes of shared memory per block; device ", device, " allows ",
            d.max_smem_optin);
  ST_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes),
                "cudaFuncSetAttribute(maxDynamicSharedMemorySize = ", bytes, ") on device ", device);
  done = bytes;
}

}  // namespace sparsetrain::cuda

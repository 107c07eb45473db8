// The few CUDA runtime services the host code needs (device count, stream-ordered allocation,
// copies), behind a plain C++ interface so that .cpp files never include CUDA headers. Only the
// runtime API is used (static cudart): the driver is loaded at run time, so a CUDA build links
// and its CPU tests run on machines without a driver.
#pragma once

#include <cstddef>
#include <string>

namespace sparsetrain::cuda {

int device_count();                     // 0 on any error (no driver, no device)
std::string device_name(int device);    // "NVIDIA H100 ... (sm_90)"
void* malloc_async(size_t bytes, int device, void* stream);
void free_async(void* ptr, int device, void* stream);

// Makes `device` current for the guard's lifetime.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device);
  ~DeviceGuard();
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = 0;
  bool changed_ = false;
};

}  // namespace sparsetrain::cuda

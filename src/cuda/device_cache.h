// What the CUDA host code asks of a device, queried once per device and cached (thread-safe): SM
// count, compute capability, the shared memory a block may opt in to, the L2 size, and each
// kernel's raised dynamic shared-memory limit. Plain C++ (no CUDA headers), so the CPU tests call it too: a device
// id outside [0, device_count()) is refused with an Error naming it (tests/cpp/test_device_cache.cpp).
#pragma once


namespace sparsetrain::cuda {

struct DeviceInfo {
  int sm_count = 0;
  int cc_major = 0, cc_minor = 0;  // compute capability
  int max_smem_optin = 0;          // bytes of shared memory one block may opt in to
  int l2_bytes = 0;                // L2 cache size
};

// An Error ("device: expected a CUDA device index in [0, n), got d") for any other id.
DeviceInfo device_info(int device);
inline int sm_count(int device) { return device_info(device).sm_count; }

// The current device (cudaGetDevice, checked).
int current_device();

// Raises `kernel`'s dynamic shared-memory limit on the current device to `bytes`: one
// cudaFuncSetAttribute per (kernel, device) and size, an Error when the device allows less.
// `kernel`: the __global__ function's address.
void opt_in_smem(const void* kernel, int bytes);

}  // namespace sparsetrain::cuda

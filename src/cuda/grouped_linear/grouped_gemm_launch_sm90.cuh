// What every CUTLASS sm90 grouped GEMM of the library does around its kernel (the bf16 / fp16
// GEMMs of grouped_gemm_sm90.cuh and the FP8 ones of grouped_gemm_fp8_sm90.cuh): the hardware
// info it is built for, its launch, CUTLASS's status, and the zeros of a weight grad whose group
// has no rows (such a group gets M = 0, no tiles: a K = 0 problem is never launched).
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <map>
#include <mutex>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/kernel_hardware_info.h"
#include "cuda/cuda_check.h"
#include "cuda/device_cache.h"
#include "cuda/grouped_linear/grouped_gemm_params.h"
#include "sparsetrain/error.h"

namespace sparsetrain::cuda::sm90 {

// A launch's per-group device arrays (one entry a group) laid out one after another in the
// workspace, each on a 256-byte boundary; over a null workspace it only measures them.
class GroupArrays {
 public:
  GroupArrays(void* workspace, int64_t num_groups) : base_(static_cast<char*>(workspace)), n_(size_t(num_groups)) {}
  template <class T>
  void take(T*& array) {
    array = base_ == nullptr ? nullptr : reinterpret_cast<T*>(base_ + bytes_);
    bytes_ += (sizeof(T) * n_ + 255) / 256 * 256;
  }
  size_t bytes() const { return bytes_; }

 private:
  char* base_;
  size_t n_;
  size_t bytes_ = 0;
};

// SM count (the library's device cache) and the kernel's occupancy in clusters: queried once per
// device and kernel (the occupancy query takes tens of microseconds, which a small MoE GEMM would
// pay on every call otherwise).
template <class Kernel>
cutlass::KernelHardwareInfo hardware_info(int device) {
  static std::mutex mutex;
  static std::map<int, cutlass::KernelHardwareInfo> cache;
  const std::lock_guard<std::mutex> lock(mutex);
  auto it = cache.find(device);
  if (it == cache.end()) {
    const int sms = ::sparsetrain::cuda::sm_count(device);
    it = cache.emplace(device, cutlass::KernelHardwareInfo::make_kernel_hardware_info<Kernel>(device, sms)).first;
  }
  return it->second;
}

// GemmUniversalAdapter's initialize + run less the two cudaFuncSetAttribute calls they make on
// every call (~1.2 us of host time each, against ~17 us for a whole small MoE GEMM): the
// shared-memory opt-in goes through the library's per-device cache, and the non-portable
// cluster-size permission is not needed by clusters of 2.
template <class Gemm>
void launch_gemm(const typename Gemm::GemmKernel::Params& params, cudaStream_t s) {
  using Kernel = typename Gemm::GemmKernel;
  using ClusterShape = typename Kernel::ClusterShape;
  const void* kernel = reinterpret_cast<const void*>(&cutlass::device_kernel<Kernel>);
  constexpr int kSmem = int(Kernel::SharedStorageSize);
  ::sparsetrain::cuda::opt_in_smem(kernel, kSmem);
  cudaLaunchConfig_t config{};
  config.gridDim = Gemm::get_grid_shape(params);
  config.blockDim = Kernel::get_block_shape();
  config.dynamicSmemBytes = kSmem;
  config.stream = s;
  cudaLaunchAttribute cluster{};
  cluster.id = cudaLaunchAttributeClusterDimension;
  cluster.val.clusterDim.x = cute::size<0>(ClusterShape{});
  cluster.val.clusterDim.y = cute::size<1>(ClusterShape{});
  cluster.val.clusterDim.z = cute::size<2>(ClusterShape{});
  config.attrs = &cluster;
  config.numAttrs = 1;
  void* args[] = {const_cast<typename Kernel::Params*>(&params)};
  ST_CUDA_CHECK(cudaLaunchKernelExC(&config, kernel, args), "sm90 grouped GEMM launch");
}

inline void check_status(cutlass::Status status, const char* step) {
  if (status != cutlass::Status::kSuccess)
    ST_FAIL("sm90 grouped GEMM: ", step, " failed: ", cutlassGetStatusString(status));
}

// dW_g = 0 for the groups with no rows (a weight grad, or main_grad being overwritten); a main_grad
// being accumulated is left untouched. Grid (blocks, G); groups with rows return at once.
template <int Cap>
struct DwTable {
  void* ptr[Cap];
};
template <typename T, int Cap>
__global__ void zero_empty_groups_kernel(const int64_t* offsets, const __grid_constant__ DwTable<Cap> dw, int64_t numel) {
  const int64_t g = blockIdx.y;
  if (offsets[g + 1] != offsets[g]) return;
  T* out = static_cast<T*>(dw.ptr[g]);
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < numel; i += int64_t(gridDim.x) * blockDim.x)
    out[i] = T(0.f);
}
template <typename T>
void zero_empty_groups(const int64_t* offsets, int64_t num_groups, void* const* dw, int64_t numel, cudaStream_t s) {
  with_group_cap(num_groups, [&](auto cap) {
    constexpr int kCap = decltype(cap)::value;
    DwTable<kCap> t;
    std::copy(dw, dw + num_groups, t.ptr);
    const dim3 grid(64, unsigned(num_groups));
    zero_empty_groups_kernel<T, kCap><<<grid, 256, 0, s>>>(offsets, t, numel);
  });
  ST_CUDA_CHECK(cudaGetLastError(), "sm90 grouped GEMM: zero_empty_groups_kernel launch");
}

}  // namespace sparsetrain::cuda::sm90

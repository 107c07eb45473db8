// GPU test helpers: device copies of host tensors (or NaN-poisoned device buffers), copies back
// to the host (strided views included), and the visible skip when there is no GPU.
#pragma once

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <vector>

#include "host_tensor.h"
#include "sparsetrain/allocator.h"
#include "sparsetrain/runtime.h"

namespace sparsetrain::testing {

#define CUDA_OK(x) ASSERT_EQ((x), cudaSuccess) << #x

// A device copy of a host tensor, poisoned (0xFF: NaN) when made without data.
struct DeviceTensor {
  Tensor t;
  DeviceTensor() = default;
  explicit DeviceTensor(const HostTensor& h, bool copy = true) {
    const TensorView v = h.view();
    t = Tensor::empty(v.dtype(), v.shape(), v.dim(), Device::cuda(0), default_allocator(), {});
    const size_t bytes = size_t(v.numel()) * v.element_size();
    if (copy) {
      EXPECT_EQ(cudaMemcpy(t.view().data(), h.data(), bytes, cudaMemcpyHostToDevice), cudaSuccess);
    } else {
      EXPECT_EQ(cudaMemset(t.view().data(), 0xff, bytes), cudaSuccess);
    }
    // Landed before any stream uses it: a pageable copy may return before its DMA does, and a
    // memset or copy on the legacy stream does not order a test's non-blocking streams.
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  }
  const TensorView& view() const { return t.view(); }
};

// A NaN-poisoned [rows, cols] device buffer whose view starts one element past an aligned
// allocation (2 bytes off for bf16 / fp16): a caller buffer off a 16-byte boundary.
struct MisalignedBuffer {
  DeviceTensor memory;
  TensorView view;
  MisalignedBuffer(DType dtype, int64_t rows, int64_t cols) {
    HostTensor h(dtype, {rows * cols + 8});
    h.poison();
    memory = DeviceTensor(h);
    view = TensorView(static_cast<char*>(memory.view().data()) + dtype_size(dtype), dtype, {rows, cols},
                      Device::cuda(0));
  }
};

inline HostTensor to_host(const TensorView& v) {
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  // Strided device views (per-group wgrads): copy the whole extent, then gather on the host.
  int64_t extent = 1;
  for (int i = 0; i < v.dim(); ++i) extent += (v.size(i) - 1) * v.stride(i);
  HostTensor stage(v.dtype(), {v.numel() == 0 ? 0 : extent});
  if (v.numel() > 0) {
    EXPECT_EQ(cudaMemcpy(stage.data(), v.data(), size_t(extent) * v.element_size(), cudaMemcpyDeviceToHost), cudaSuccess);
  }
  const TensorView sv(stage.data(), v.dtype(), v.shape(), v.strides(), v.dim());
  return HostTensor::copy_of(sv);
}

// Hands out pieces of one device buffer allocated before a capture, never reusing any (like
// torch's graph memory pool): a graph captured with it owns fixed addresses and replays freely.
class PoolAllocator final : public Allocator {
 public:
  explicit PoolAllocator(size_t bytes) : pool_(HostTensor(DType::kInt32, {int64_t(bytes / 4)}), false) {}
  void* allocate(size_t bytes, Device, Stream) override {
    const size_t at = used_;
    used_ += (bytes + 255) / 256 * 256;
    EXPECT_LE(used_, size_t(pool_.view().numel()) * pool_.view().element_size()) << "pool exhausted (bytes used vs held)";
    return static_cast<char*>(pool_.view().data()) + at;
  }
  void deallocate(void*, size_t, Device, Stream) override {}

 private:
  DeviceTensor pool_;
  size_t used_ = 0;
};

inline bool have_gpu() { return cuda_device_count() > 0; }
// Device 0 runs the sm_90a kernels (attention): compute capability 9.0.
inline bool have_hopper() {
  int major = 0, minor = 0;
  return have_gpu() && cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, 0) == cudaSuccess &&
         cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, 0) == cudaSuccess && major == 9 &&
         minor == 0;
}

}  // namespace sparsetrain::testing

#define REQUIRE_GPU()                    \
  if (sparsetrain::testing::have_gpu()) { \
  } else                                  \
    GTEST_SKIP() << "no CUDA device on this machine: GPU test skipped"
#define REQUIRE_HOPPER()                                                                          \
  if (sparsetrain::testing::have_hopper()) {                                                     \
  } else                                                                                         \
    GTEST_SKIP() << (sparsetrain::testing::have_gpu()                                            \
                         ? "GPU 0 is not a Hopper (compute capability 9.0): sm_90a test skipped" \
                         : "no CUDA device on this machine: GPU test skipped")

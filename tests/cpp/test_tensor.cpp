// TensorView geometry, Tensor ownership through a caller allocator, and Error messages.
#include <gtest/gtest.h>

#include "host_tensor.h"
#include "sparsetrain/allocator.h"
#include "sparsetrain/error.h"
#include "sparsetrain/runtime.h"
#include "sparsetrain/tensor.h"

namespace st = sparsetrain;

TEST(TensorView, ContiguousStridesSelectAndRows) {
  float buf[24];
  st::TensorView v(buf, st::DType::kFP32, {2, 3, 4});
  EXPECT_EQ(v.dim(), 3);
  EXPECT_EQ(v.numel(), 24);
  EXPECT_EQ(v.stride(0), 12);
  EXPECT_EQ(v.stride(-1), 1);
  EXPECT_TRUE(v.is_contiguous());
  st::TensorView s = v.select(1);
  EXPECT_EQ(s.dim(), 2);
  EXPECT_EQ(s.data(), buf + 12);
  EXPECT_EQ(s.shape_str(), "[3, 4]");
  st::TensorView r = s.rows(1, 3);
  EXPECT_EQ(r.data(), buf + 16);
  EXPECT_EQ(r.size(0), 2);
  EXPECT_EQ(v.str(), "fp32[2, 3, 4] on cpu");
  EXPECT_THROW(v.select(2), st::Error);
  EXPECT_THROW(s.rows(2, 4), st::Error);
}

TEST(TensorView, StridedViewIsNotContiguous) {
  float buf[32];
  const int64_t shape[2] = {4, 3}, strides[2] = {8, 1};
  st::TensorView v(buf, st::DType::kFP32, shape, strides, 2);
  EXPECT_FALSE(v.is_contiguous());
  EXPECT_EQ(v.numel(), 12);
  EXPECT_EQ(st::Device::cuda(1).str(), "cuda:1");
  EXPECT_NE(st::Device::cuda(0), st::Device::cuda(1));
}

TEST(Tensor, AllocatesAlignedThroughTheCallerAllocatorAndFreesOnce) {
  st::testing::PoisonAllocator alloc;
  {
    st::Tensor t = st::Tensor::empty(st::DType::kBF16, {3, 5}, st::Device::cpu(), alloc, {});
    EXPECT_EQ(reinterpret_cast<uintptr_t>(t.view().data()) % 256, 0u);
    EXPECT_EQ(alloc.allocations, 1);
    st::Tensor view = t.with_view(t.view().select(1));
    t = st::Tensor();
    EXPECT_EQ(alloc.live, 1) << "a view keeps the storage alive";
  }
  EXPECT_EQ(alloc.live, 0);
}

TEST(Tensor, RejectsAnAllocatorThatIgnoresAlignment) {
  struct Misaligned final : st::Allocator {
    void* allocate(size_t bytes, st::Device d, st::Stream s) override {
      return static_cast<char*>(st::default_allocator().allocate(bytes + 256, d, s)) + 8;
    }
    void deallocate(void* p, size_t bytes, st::Device d, st::Stream s) override {
      st::default_allocator().deallocate(static_cast<char*>(p) - 8, bytes + 256, d, s);
    }
  } alloc;
  try {
    st::Tensor::empty(st::DType::kFP32, {4}, st::Device::cpu(), alloc, {});
    FAIL() << "expected an Error";
  } catch (const st::Error& e) {
    EXPECT_NE(std::string(e.what()).find("256-byte aligned"), std::string::npos) << e.what();
  }
}

TEST(Error, NamesArgumentExpectationAndValue) {
  try {
    ST_CHECK_ARG(false, "x", "dtype bf16", "fp32");
    FAIL();
  } catch (const st::Error& e) {
    EXPECT_STREQ(e.what(), "x: expected dtype bf16, got fp32");
    EXPECT_EQ(e.kind(), st::Error::Kind::kInvalidArgument);
  }
}

TEST(Runtime, ReportsTheBuildAndRunsWithoutADriver) {
  // On CI (no driver) a CUDA build must answer 0 devices rather than fail.
  const int n = st::cuda_device_count();
  EXPECT_GE(n, 0);
  if (!st::built_with_cuda()) {
    EXPECT_EQ(n, 0);
  }
  EXPECT_FALSE(st::best_backend_description().empty());
}

// GPU test: the default allocator's CUDA path (stream-ordered cudaMallocAsync). Skipped, and
// reported as skipped, on machines without a GPU.
TEST(RuntimeGpu, DefaultAllocatorAllocatesAlignedDeviceMemory) {
  if (st::cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device on this machine: GPU test skipped";
  for (int64_t n : {int64_t(1), int64_t(1000), int64_t(1) << 24}) {
    st::Tensor t = st::Tensor::empty(st::DType::kBF16, {n}, st::Device::cuda(0), st::default_allocator(), {});
    EXPECT_NE(t.view().data(), nullptr);
    EXPECT_EQ(reinterpret_cast<uintptr_t>(t.view().data()) % 256, 0u);
    EXPECT_TRUE(t.view().device().is_cuda());
  }
  EXPECT_NE(st::best_backend_description().find("cuda:0"), std::string::npos);
}

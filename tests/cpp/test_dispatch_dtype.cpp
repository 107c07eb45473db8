// The one dtype dispatch (common/dispatch_dtype.h): each element dtype reaches f once with its
// storage type, a restricted list instantiates and accepts only its types, and anything else is
// refused with an Error naming the caller, the dtype and the accepted ones.
#include <gtest/gtest.h>

#include <functional>
#include <string>
#include <type_traits>

#include "common/dispatch_dtype.h"

namespace st = sparsetrain;
using st::DType;

namespace {

class DispatchDtype : public ::testing::TestWithParam<DType> {};

TEST_P(DispatchDtype, CallsOnceWithTheStorageType) {
  const DType dtype = GetParam();
  int calls = 0;
  size_t size = 0;
  DType seen = DType::kUInt8;
  st::dispatch_dtype(dtype, "test", [&](auto e) {
    using E = decltype(e);
    ++calls;
    size = sizeof(E);
    seen = st::dtype_of<E>();
  });
  EXPECT_EQ(calls, 1);
  EXPECT_EQ(seen, dtype);
  EXPECT_EQ(size, st::dtype_size(dtype));
}

INSTANTIATE_TEST_SUITE_P(Elements, DispatchDtype, ::testing::Values(DType::kBF16, DType::kFP16, DType::kFP32),
                         [](const ::testing::TestParamInfo<DType>& i) { return std::string(st::dtype_name(i.param)); });

void expect_refused(DType dtype, const std::function<void()>& call, const std::string& message) {
  try {
    call();
    FAIL() << "no Error for " << st::dtype_name(dtype);
  } catch (const st::Error& e) {
    EXPECT_EQ(std::string(e.what()), message);
  }
}

TEST(DispatchDtypeRefusal, NonElementDtypes) {
  for (DType dtype : {DType::kInt32, DType::kInt64, DType::kUInt8})
    expect_refused(
        dtype, [&] { st::dispatch_dtype(dtype, "CUDA op", [](auto) { FAIL() << "f called"; }); },
        std::string("CUDA op: unsupported dtype ") + st::dtype_name(dtype) + " (expected one of bf16, fp16, fp32)");
}

TEST(DispatchDtypeRefusal, RestrictedList) {
  int calls = 0;
  auto f = [&](auto e) {
    static_assert(!std::is_same_v<decltype(e), float>, "a restricted list must not instantiate f for fp32");
    ++calls;
  };
  st::dispatch_dtype<st::bf16_t, st::fp16_t>(DType::kFP16, "attention", f);
  EXPECT_EQ(calls, 1);
  expect_refused(
      DType::kFP32, [&] { st::dispatch_dtype<st::bf16_t, st::fp16_t>(DType::kFP32, "attention", f); },
      "attention: unsupported dtype fp32 (expected one of bf16, fp16)");
  EXPECT_EQ(calls, 1);
}

TEST(DtypeOf, StorageTypes) {
  static_assert(st::dtype_of<st::bf16_t>() == DType::kBF16);
  static_assert(st::dtype_of<st::fp16_t>() == DType::kFP16);
  static_assert(st::dtype_of<float>() == DType::kFP32);
}

}  // namespace

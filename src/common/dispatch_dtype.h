// The one dtype dispatch: dispatch_dtype(dtype, "who", f) calls f(E{}) with E the storage type of
// `dtype` (bf16_t, fp16_t, float: sparsetrain/dtype.h); dispatch_dtype<bf16_t, fp16_t>(...) allows
// only the listed types, so a caller instantiates f for exactly the types it supports. Any other
// dtype throws an Error "who: unsupported dtype X (expected one of ...)". Plain C++ (host and the
// host side of .cu files), tested on the CPU (tests/cpp/test_dispatch_dtype.cpp).
#pragma once

#include <string>
#include <type_traits>

#include "sparsetrain/dtype.h"
#include "sparsetrain/error.h"

namespace sparsetrain {

// The DType whose storage type is E.
template <class E>
constexpr DType dtype_of() {
  static_assert(std::is_same_v<E, bf16_t> || std::is_same_v<E, fp16_t> || std::is_same_v<E, float>,
                "dtype_of: E must be one of the element storage types bf16_t, fp16_t or float");
  return std::is_same_v<E, bf16_t> ? DType::kBF16 : std::is_same_v<E, fp16_t> ? DType::kFP16 : DType::kFP32;
}

template <class... Es, class F>
void dispatch_dtype(DType dtype, const char* who, F&& f) {
  if constexpr (sizeof...(Es) == 0) {
    dispatch_dtype<bf16_t, fp16_t, float>(dtype, who, f);
  } else {
    const bool called = ((dtype == dtype_of<Es>() ? (f(Es{}), true) : false) || ...);
    if (!called) {
      std::string allowed;
      ((allowed += (allowed.empty() ? "" : ", ") + std::string(dtype_name(dtype_of<Es>()))), ...);
      ST_FAIL(who, ": unsupported dtype ", dtype_name(dtype), " (expected one of ", allowed, ")");
    }
  }
}

}  // namespace sparsetrain

// Argument checks shared by every op. Each raises sparsetrain::Error naming the argument, what was
// expected and what came; ops run all of them before writing anything.
#pragma once

#include <string>

#include "sparsetrain/error.h"
#include "sparsetrain/tensor.h"
#if SPARSETRAIN_WITH_CUDA
#include "cuda/device_support.h"
#endif

namespace sparsetrain::checks {

// The device runs the kernels an op launches (common/gpu_arch.h's rules on its compute
// capability). Checked after every argument and before anything is allocated, so argument errors
// come first (the CPU tests reach them with cuda-tagged views and no GPU). CPU devices pass.
enum class Kernels { kGeneric, kSm90a };
inline void device_runs([[maybe_unused]] Device device, [[maybe_unused]] Kernels kernels,
                        [[maybe_unused]] const char* arg) {
#if SPARSETRAIN_WITH_CUDA
  if (!device.is_cuda()) return;
  if (kernels == Kernels::kSm90a) cuda::require_sm90a_kernels(device.index, arg);
  cuda::require_generic_kernels(device.index, arg);
#endif
}

inline void defined(const TensorView& t, const std::string& name, const std::string& what) {
  ST_CHECK_ARG(t.defined(), name.c_str(), what, "no tensor");
}

inline void dtype(const TensorView& t, const std::string& name, DType expected, const char* why = "") {
  ST_CHECK_ARG(t.dtype() == expected, name.c_str(),
               std::string("dtype ") + dtype_name(expected) + why, dtype_name(t.dtype()));
}

inline void device(const TensorView& t, const std::string& name, Device expected) {
  ST_CHECK_ARG(t.device() == expected, name.c_str(),
               "a tensor on " + expected.str() + " (the layer's device)", t.device().str());
}

inline void non_null(const TensorView& t, const std::string& name) {
  ST_CHECK_ARG(t.data() != nullptr || t.numel() == 0, name.c_str(), "non-null data",
               "a null pointer for " + t.str());
}

// Exact shape; -1 in `expected` matches any size. `desc` describes the shape for the message.
inline void shape(const TensorView& t, const std::string& name, std::initializer_list<int64_t> expected,
                  const std::string& desc) {
  bool ok = t.dim() == int(expected.size());
  int d = 0;
  for (int64_t e : expected) {
    if (!ok) break;
    ok = e < 0 || t.size(d) == e;
    ++d;
  }
  ST_CHECK_ARG(ok, name.c_str(), "shape " + desc, t.shape_str());
}

inline void contiguous(const TensorView& t, const std::string& name) {
  std::string strides = "strides [";
  for (int i = 0; i < t.dim(); ++i) strides += (i ? ", " : "") + std::to_string(t.stride(i));
  ST_CHECK_ARG(t.is_contiguous(), name.c_str(), "a contiguous tensor", strides, "] for shape ",
               t.shape_str());
}

// The rule of every strided input (any strides but the last dimension's, which must be 1) and its
// one message: which layouts are taken, and the fix for the usual way to break it, a transpose.
// `dim_label` names the last dimension where it has a name (" (D)").
inline void unit_last_stride(const TensorView& t, const std::string& name, const char* dim_label = "") {
  ST_CHECK_ARG(t.stride(-1) == 1 || t.size(-1) <= 1, name.c_str(),
               std::string("a unit stride in the last dimension") + dim_label +
                   " (taken: any strides with the last dimension contiguous, as in a contiguous tensor or a slice "
                   "of one; a transposed tensor is not, pass " + name + ".contiguous())",
               t.stride(-1));
}

// A 2-D input whose rows are contiguous and do not overlap (any row stride >= the row length).
inline void rows_contiguous(const TensorView& t, const std::string& name) {
  if (t.numel() == 0) return;  // nothing is read; producers give empty arrays arbitrary strides
  unit_last_stride(t, name);
  ST_CHECK_ARG(t.size(0) <= 1 || t.stride(0) >= t.size(1), name.c_str(),
               "a row stride >= the row length " + std::to_string(t.size(1)), t.stride(0));
}

}  // namespace sparsetrain::checks

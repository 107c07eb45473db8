// The one rule that picks an op's backend for a device, for the ops whose backends come in a CPU
// reference and a CUDA implementation: the reference on the CPU, the CUDA backend on a CUDA device
// where this build has one, else an Error naming the argument.
#pragma once

#include "sparsetrain/error.h"
#include "sparsetrain/tensor.h"

// A CUDA backend's getter where this build has CUDA, else null (pick_backend's `cuda`).
#if SPARSETRAIN_WITH_CUDA
#define ST_CUDA_BACKEND(getter) (getter)
#else
#define ST_CUDA_BACKEND(getter) nullptr
#endif

namespace sparsetrain::ops {

template <class Backend>
Backend& pick_backend(Device device, const char* arg, Backend& (*reference)(), Backend& (*cuda)()) {
  if (device.is_cpu()) return reference();
  if (device.is_cuda() && cuda != nullptr) return cuda();
  detail::throw_arg_error(arg, "a tensor on cpu (this build has no CUDA backend)", device.str());
}

}  // namespace sparsetrain::ops

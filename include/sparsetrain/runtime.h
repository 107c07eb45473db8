// What this build of sparsetrain can run on. Safe to call on a machine without a GPU driver.
#pragma once

#include <string>

namespace sparsetrain {

const char* version();
// Whether the CUDA backend was compiled in (the toolkit was found at build time).
bool built_with_cuda();
// The Hopper (sm_90a) kernels compiled in: "an ALL build", "a MINIMAL build" or "none: <why>"
// (CMake SPARSETRAIN_SM90_KERNELS).
const char* sm90_kernel_set();
// The architectures the generic CUDA kernels were built for, e.g. "80,89,90a,100,120" (SASS for
// each, PTX for the last; CMake SPARSETRAIN_CUDA_ARCHS); "" without CUDA.
const char* cuda_archs();
// Number of usable CUDA devices: 0 when built without CUDA, without a driver or without a GPU.
int cuda_device_count();
// One line for reports: "cpu reference" or "cuda:0 NVIDIA H100 80GB HBM3 (sm_90)".
std::string best_backend_description();

}  // namespace sparsetrain

// What this build of sparsetrain can run on. Safe to call on a machine without a GPU driver.
#pragma once

#include <string>

namespace sparsetrain {

const char* version();
// Whether the CUDA backend was compiled in (the toolkit was found at build time).
bool built_with_cuda();
// Number of usable CUDA devices: 0 when built without CUDA, without a driver or without a GPU.
int cuda_device_count();
// One line for reports: "cpu reference" or "cuda:0 NVIDIA H100 80GB HBM3 (sm_90)".
std::string best_backend_description();

}  // namespace sparsetrain

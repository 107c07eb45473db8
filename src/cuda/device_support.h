// Whether the device a call's tensors live on runs the kernels it needs (common/gpu_arch.h's rules
// on the device's compute capability): an Error naming the argument, the rule and the GPU before
// anything is allocated or launched, instead of CUDA's "no kernel image" at the first launch.
#pragma once

namespace sparsetrain::cuda {

// GroupedLinear, GroupedMLP, device block-mask builds, cu_seqlens: the generic kernels.
void require_generic_kernels(int device, const char* arg);
// Attention: the sm_90a kernels.
void require_sm90a_kernels(int device, const char* arg);

}  // namespace sparsetrain::cuda

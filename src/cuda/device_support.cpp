// cuda/device_support.h: the rules of common/gpu_arch.h on the device's cached capability.
#include "cuda/device_support.h"

#include <string>
#include <vector>

#include "common/gpu_arch.h"
#include "cuda/device_cache.h"
#include "cuda/runtime_cuda.h"
#include "sm90/sm90_instances.h"
#include "sparsetrain/error.h"

namespace sparsetrain::cuda {
namespace {

arch::Capability capability(int device) {
  const DeviceInfo d = device_info(device);
  return {d.cc_major, d.cc_minor};
}

void require(const std::string& refusal, int device, const char* arg) {
  if (refusal.empty()) return;
  detail::throw_arg_error(arg, refusal, "cuda:" + std::to_string(device) + ", " + device_name(device));
}

}  // namespace

void require_generic_kernels(int device, const char* arg) {
  static const std::vector<arch::CudaArch> built = arch::parse_archs(SPARSETRAIN_CUDA_ARCHS);
  const arch::Capability cc = capability(device);
  if (!arch::runs_build(cc, built)) require(arch::generic_kernels_refusal(cc, SPARSETRAIN_CUDA_ARCHS), device, arg);
}

void require_sm90a_kernels(int device, const char* arg) {
  require(arch::sm90a_refusal(capability(device)), device, arg);
}

}  // namespace sparsetrain::cuda

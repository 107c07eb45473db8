// Which NVIDIA GPUs run which of the library's kernels. Plain host code, so the rules are tested
// on the CPU with made-up compute capabilities (tests/cpp/test_gpu_arch.cpp); the CUDA backend
// applies them to the real device (cuda/device_support.h) before anything is launched.
//
// Two kinds of kernel:
//   generic  the SIMT grouped GEMMs, the elementwise, set-up and bias kernels, the block-mask
//            builders: built for every entry of the build's architecture list (CMake
//            SPARSETRAIN_CUDA_ARCHS, default 80,89,90a,100,120), as SASS for each and as PTX for
//            the last, so they run on any GPU from the first entry on;
//   sm_90a   the CUTLASS/CuTe kernels (wgmma, TMA, register reallocation): arch-specific code
//            that runs on compute capability 9.0 only (not forward on 10.x or 12.x); the grouped
//            GEMMs fall back to their SIMT kernels elsewhere (grouped_gemm_kernels), attention
//            refuses (sm90a_refusal).
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "sparsetrain/error.h"

namespace sparsetrain::arch {

struct Capability {
  int major = 0, minor = 0;
};

inline std::string str(Capability c) { return std::to_string(c.major) + "." + std::to_string(c.minor); }

// One entry of an architecture list: "89" is SASS for 8.9, "90a" arch-specific SASS for 9.0.
struct CudaArch {
  Capability cc;
  bool specific = false;
};

// "80,89,90a" (commas or semicolons) -> its entries; an Error for anything else.
inline std::vector<CudaArch> parse_archs(std::string_view list) {
  std::vector<CudaArch> out;
  size_t i = 0;
  while (i < list.size()) {
    const size_t end = std::min(list.find_first_of(",;", i), list.size());
    std::string_view e = list.substr(i, end - i);
    i = end + 1;
    CudaArch a;
    if (!e.empty() && e.back() == 'a') {
      a.specific = true;
      e.remove_suffix(1);
    }
    const bool digits = e.size() >= 2 && e.find_first_not_of("0123456789") == std::string_view::npos;
    if (!digits) ST_FAIL("CUDA architecture list \"", std::string(list), "\": expected entries like 80 or 90a");
    const int v = std::stoi(std::string(e));
    a.cc = {v / 10, v % 10};
    out.push_back(a);
  }
  if (out.empty()) ST_FAIL("CUDA architecture list is empty");
  return out;
}

// SASS for X.Y runs on X.Y' with Y' >= Y (arch-specific SASS: on X.Y only); the last entry's PTX
// (none when it is arch-specific) is compiled by the driver for any later GPU.
inline bool runs_build(Capability dev, const std::vector<CudaArch>& archs) {
  for (const CudaArch& a : archs) {
    const bool same = dev.major == a.cc.major && dev.minor == a.cc.minor;
    if (same || (!a.specific && dev.major == a.cc.major && dev.minor > a.cc.minor)) return true;
  }
  const CudaArch& ptx = archs.back();
  return !ptx.specific && (dev.major > ptx.cc.major || (dev.major == ptx.cc.major && dev.minor >= ptx.cc.minor));
}

inline bool runs_sm90a(Capability dev) { return dev.major == 9 && dev.minor == 0; }

// The grouped GEMMs' kernels on a device: the sm_90a CUTLASS kernel where the device runs sm_90a
// and this build compiled that kernel in (SPARSETRAIN_SM90_KERNELS; OFF, or MINIMAL without the
// variant or dtype: not), else the SIMT kernels. The CUDA backend takes sm90 only when this says
// so and the call also suits TMA (in and out multiples of 8, aligned inputs with packed rows).
enum class GemmKernels { kSimt, kSm90 };
inline GemmKernels grouped_gemm_kernels(Capability dev, bool sm90_compiled) {
  return sm90_compiled && runs_sm90a(dev) ? GemmKernels::kSm90 : GemmKernels::kSimt;
}

// Tiny problems take the SIMT kernel on Hopper too: with host splits it is one launch against the
// sm90 path's set-up kernel and GEMM, and at this size an eager call's time is its launches
// (bench/bench_gemm_paths.py: at 16 x 64 x 64 an eager forward takes a quarter less time; from
// 16 x 256 x 256 up the SIMT kernel's own time loses).
// rows x in x out multiply-adds at most max_macs; 0 turns the rule off.
inline constexpr int64_t kSimtMaxMacs = int64_t(1) << 16;
inline bool simt_by_size(int64_t rows, int64_t in, int64_t out, int64_t max_macs = kSimtMaxMacs) {
  return max_macs > 0 && double(rows) * double(in) * double(out) <= double(max_macs);
}

// What a refusal says the device should be ("" when the device runs the kernels): the expected
// part of the Error that names the argument and the device.
inline std::string generic_kernels_refusal(Capability dev, std::string_view archs) {
  if (runs_build(dev, parse_archs(archs))) return "";
  return "a GPU this build has kernels for (SASS for " + std::string(archs) +
         ", PTX for the last; CMake SPARSETRAIN_CUDA_ARCHS), not compute capability " + str(dev);
}
inline std::string sm90a_refusal(Capability dev) {
  if (runs_sm90a(dev)) return "";
  return "a tensor on a Hopper GPU (compute capability 9.0: the CUDA attention kernels are sm_90a, wgmma "
         "and TMA), not compute capability " + str(dev);
}

}  // namespace sparsetrain::arch

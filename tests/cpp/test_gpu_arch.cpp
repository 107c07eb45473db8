// Which GPUs run which kernels (common/gpu_arch.h), with made-up compute capabilities: the rules
// the CUDA backend applies to the real device before anything is launched.
#include <gtest/gtest.h>

#include <cstdint>
#include <ostream>
#include <string>

#include "common/gpu_arch.h"
#include "sm90/sm90_instances.h"
#include "sparsetrain/error.h"

namespace arch = sparsetrain::arch;
using arch::Capability;

namespace {
constexpr const char* kDefault = "80,89,90a,100,120";  // CMake's default SPARSETRAIN_CUDA_ARCHS
}

namespace sparsetrain::arch {
void PrintTo(GemmKernels k, std::ostream* os) { *os << (k == GemmKernels::kSm90 ? "sm90" : "SIMT"); }
}  // namespace sparsetrain::arch

TEST(GpuArch, ParsesTheListCMakeWrites) {
  const auto a = arch::parse_archs("80;89,90a");
  ASSERT_EQ(a.size(), 3u);
  EXPECT_EQ(a[0].cc.major, 8);
  EXPECT_EQ(a[0].cc.minor, 0);
  EXPECT_FALSE(a[0].specific);
  EXPECT_EQ(a[1].cc.minor, 9);
  EXPECT_EQ(a[2].cc.major, 9);
  EXPECT_TRUE(a[2].specific);
  EXPECT_EQ(arch::parse_archs("100")[0].cc.major, 10);
  for (const char* bad : {"", "8", "sm_80", "80,,90", "90b", "a"})
    EXPECT_THROW(arch::parse_archs(bad), sparsetrain::Error) << bad;
  // This build's own list parses (the CUDA backend reads it at its first call).
  EXPECT_NO_THROW(arch::parse_archs(SPARSETRAIN_CUDA_ARCHS));
}

TEST(GpuArch, TheDefaultListRunsEveryGpuFromAmpereOn) {
  const auto built = arch::parse_archs(kDefault);
  // A100 8.0, A10 / RTX 30 8.6 (8.0 SASS), Orin 8.7, L40 8.9, H100 9.0, B200 10.0, GB300 10.3,
  // RTX 50 12.0, and a later GPU through the 12.0 PTX.
  for (Capability c : {Capability{8, 0}, Capability{8, 6}, Capability{8, 7}, Capability{8, 9}, Capability{9, 0},
                       Capability{10, 0}, Capability{10, 3}, Capability{12, 0}, Capability{12, 1}, Capability{13, 0}})
    EXPECT_TRUE(arch::runs_build(c, built)) << arch::str(c);
  for (Capability c : {Capability{7, 0}, Capability{7, 5}, Capability{6, 1}})
    EXPECT_FALSE(arch::runs_build(c, built)) << arch::str(c);
  EXPECT_EQ(arch::generic_kernels_refusal({8, 0}, kDefault), "");
  const std::string r = arch::generic_kernels_refusal({7, 5}, kDefault);
  EXPECT_NE(r.find("80,89,90a,100,120"), std::string::npos) << r;
  EXPECT_NE(r.find("compute capability 7.5"), std::string::npos) << r;
}

TEST(GpuArch, ArchSpecificCodeRunsOnItsOwnCapabilityOnly) {
  // CI's build: the generic kernels for sm_90a only, no PTX.
  const auto hopper_only = arch::parse_archs("90a");
  EXPECT_TRUE(arch::runs_build({9, 0}, hopper_only));
  for (Capability c : {Capability{8, 0}, Capability{9, 1}, Capability{10, 0}, Capability{12, 0}})
    EXPECT_FALSE(arch::runs_build(c, hopper_only)) << arch::str(c);
  // Plain SASS runs on later minors of its major, not on the next major; PTX runs forward.
  const auto ampere = arch::parse_archs("80");
  EXPECT_TRUE(arch::runs_build({8, 9}, ampere));
  EXPECT_TRUE(arch::runs_build({10, 0}, ampere));  // through the 8.0 PTX
  EXPECT_FALSE(arch::runs_build({7, 5}, ampere));
  const auto two = arch::parse_archs("80,90a");  // last entry arch-specific: no PTX at all
  EXPECT_TRUE(arch::runs_build({8, 6}, two));
  EXPECT_FALSE(arch::runs_build({10, 0}, two));
}

TEST(GpuArch, AttentionNeedsHopperAndSaysWhichGpuItGot) {
  EXPECT_TRUE(arch::runs_sm90a({9, 0}));
  EXPECT_EQ(arch::sm90a_refusal({9, 0}), "");
  for (Capability c : {Capability{8, 0}, Capability{8, 9}, Capability{10, 0}, Capability{12, 0}}) {
    EXPECT_FALSE(arch::runs_sm90a(c)) << arch::str(c);
    const std::string r = arch::sm90a_refusal(c);
    EXPECT_NE(r.find("compute capability 9.0"), std::string::npos) << r;
    EXPECT_NE(r.find("not compute capability " + arch::str(c)), std::string::npos) << r;
  }
}

TEST(GpuArch, GroupedGemmsTakeSm90OnHopperWhenBuiltAndSimtElsewhere) {
  using arch::GemmKernels;
  // A100 8.0, A10 8.6, Orin 8.7, L40 8.9, B200 10.0, GB300 10.3, RTX 50 12.0, 12.1, a later GPU,
  // and a made-up 9.1: the SIMT kernels, whether or not the sm90 kernels were compiled in.
  for (Capability c : {Capability{8, 0}, Capability{8, 6}, Capability{8, 7}, Capability{8, 9}, Capability{9, 1},
                       Capability{10, 0}, Capability{10, 3}, Capability{12, 0}, Capability{12, 1}, Capability{13, 0}})
    for (bool built : {false, true})
      EXPECT_EQ(arch::grouped_gemm_kernels(c, built), GemmKernels::kSimt) << arch::str(c) << " built " << built;
  // H100 / H200 9.0: sm90 where the build has the kernel, else SIMT (an OFF build, or MINIMAL
  // without the call's variant or dtype).
  EXPECT_EQ(arch::grouped_gemm_kernels({9, 0}, true), GemmKernels::kSm90);
  EXPECT_EQ(arch::grouped_gemm_kernels({9, 0}, false), GemmKernels::kSimt);
}

TEST(GpuArch, TinyGemmsTakeSimtUpToTheThresholdAndZeroTurnsTheRuleOff) {
  EXPECT_TRUE(arch::simt_by_size(16, 64, 64));  // the threshold's own case: 65536 multiply-adds
  EXPECT_FALSE(arch::simt_by_size(17, 64, 64));
  EXPECT_FALSE(arch::simt_by_size(16, 256, 256));
  EXPECT_TRUE(arch::simt_by_size(0, 4096, 4096));  // no rows: nothing to run either way
  EXPECT_TRUE(arch::simt_by_size(99, 10, 10, 9900));
  EXPECT_FALSE(arch::simt_by_size(99, 10, 10, 9899));
  EXPECT_FALSE(arch::simt_by_size(16, 64, 64, 0));
  EXPECT_FALSE(arch::simt_by_size(0, 64, 64, 0));
  // No overflow where rows x in x out passes 2^63.
  EXPECT_FALSE(arch::simt_by_size(int64_t(1) << 40, int64_t(1) << 20, int64_t(1) << 20, INT64_MAX));
}

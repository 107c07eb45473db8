// The CUDA backend's host plumbing, without a GPU: the per-device cache refuses device ids this
// process cannot see with an Error naming the id and the valid range (and answers consistently for
// the ones it can, from any thread); the generated list of built sm90 instances
// (sm90/sm90_instances.h) matches SPARSETRAIN_SM90_KERNELS, and the attention backend's "is this
// kernel built" check and its refusal message agree with it entry for entry; every GEMM variant
// with a direct-store twin has the twin built.
#include <gtest/gtest.h>

#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "host_tensor.h"
#include "cuda/grouped_linear/grouped_gemm_tuning_sm90.h"
#include "sm90/sm90_instances.h"
#include "sparsetrain/block_mask.h"
#include "sparsetrain/error.h"
#if SPARSETRAIN_WITH_CUDA
#include "cuda/device_cache.h"
#include "cuda/runtime_cuda.h"
#include "ops/attention_backend.h"
#endif

namespace st = sparsetrain;
using st::DType;

namespace {

// (element, head dim) of every attention instance in the generated list.
std::set<std::pair<DType, int64_t>> attention_list() {
  std::set<std::pair<DType, int64_t>> s;
#define ST_TEST_ATTN(E, D) s.insert({DType::E, D});
  SPARSETRAIN_ATTN_INSTANCES(ST_TEST_ATTN)
#undef ST_TEST_ATTN
  return s;
}

// "variant:element" of every grouped GEMM instance in the generated list.
std::set<std::string> gemm_list() {
  std::set<std::string> s;
#define ST_TEST_GEMM(V, E) s.insert(std::string(#V) + ":" + #E);
  SPARSETRAIN_SM90_GEMM_INSTANCES(ST_TEST_GEMM)
#undef ST_TEST_GEMM
  return s;
}

const std::string kSet = SPARSETRAIN_SM90_KERNEL_SET;
// A developer build that chose its attention instances (CMake's SPARSETRAIN_ATTN_INSTANCES).
const std::string kChosen = ", attention instances from SPARSETRAIN_ATTN_INSTANCES";
bool attention_chosen() { return kSet.size() > kChosen.size() && kSet.compare(kSet.size() - kChosen.size(), kChosen.size(), kChosen) == 0; }

TEST(Sm90Instances, ListMatchesKernelSet) {
  const auto attn = attention_list();
  const auto gemm = gemm_list();
  if (attention_chosen()) {
    EXPECT_FALSE(attn.empty());
    EXPECT_FALSE(gemm.empty());
  } else if (kSet == "a MINIMAL build") {
    EXPECT_EQ(attn, (std::set<std::pair<DType, int64_t>>{{DType::kBF16, 128}}));
    EXPECT_EQ(gemm, (std::set<std::string>{"kFprop:bf16_t", "kDgrad:bf16_t", "kWgrad:bf16_t", "kWgradF32:bf16_t",
                                           "kFpropDirect:bf16_t", "kDgradDirect:bf16_t", "kWgradF32Direct:bf16_t"}));
  } else if (kSet == "an ALL build") {
    std::set<std::pair<DType, int64_t>> all;
    for (DType t : {DType::kBF16, DType::kFP16})
      for (int64_t d : {64, 96, 128}) all.insert({t, d});
    EXPECT_EQ(attn, all);
    EXPECT_EQ(gemm.size(), 26u);
    for (const char* v : {"kFprop", "kFpropBias", "kDgrad", "kWgrad", "kWgradF32", "kWgradF32Add", "kFpropDirect",
                          "kFpropBiasDirect", "kDgradDirect", "kWgradF32Direct", "kFpropNoCluster",
                          "kFpropBiasNoCluster", "kDgradNoCluster"})
      for (const char* e : {"bf16_t", "fp16_t"}) EXPECT_EQ(gemm.count(std::string(v) + ":" + e), 1u) << v << e;
  } else {
    EXPECT_EQ(kSet.rfind("none: ", 0), 0u) << kSet;
    EXPECT_TRUE(attn.empty());
    EXPECT_TRUE(gemm.empty());
  }
}

// Misaligned caller outputs are bit-identical only through a direct-store twin (docs/DESIGN.md
// section 4): every built variant that has one has it built, for the same element.
TEST(Sm90Instances, EveryGemmVariantHasItsDirectStoreTwin) {
  namespace sm90 = st::cuda::sm90;
  std::set<std::pair<sm90::Variant, std::string>> built;
#define ST_TEST_GEMM(V, E) built.insert({sm90::Variant::V, #E});
  SPARSETRAIN_SM90_GEMM_INSTANCES(ST_TEST_GEMM)
#undef ST_TEST_GEMM
  for (const auto& [v, e] : built) EXPECT_EQ(built.count({sm90::direct_store(v), e}), 1u) << int(v) << " " << e;
}

#if SPARSETRAIN_WITH_CUDA

TEST(Sm90Instances, HasKernelAgreesWithList) {
  const auto list = attention_list();
  for (DType t : {DType::kBF16, DType::kFP16, DType::kFP32})
    for (int64_t d = 0; d <= 512; ++d)
      EXPECT_EQ(st::backend::attention_cuda_has_kernel(t, d), list.count({t, d}) == 1) << st::dtype_name(t) << " D " << d;
}

TEST(Sm90Instances, KernelsInWords) {
  const std::string text = st::backend::attention_cuda_kernels();
  if (attention_chosen()) EXPECT_EQ(text.substr(text.size() - kSet.size() - 2), ": " + kSet) << text;
  else if (kSet == "a MINIMAL build") EXPECT_EQ(text, "bf16 with D = 128: a MINIMAL build");
  else if (kSet == "an ALL build") EXPECT_EQ(text, "bf16 with D = 64, 96 or 128, fp16 with D = 64, 96 or 128: an ALL build");
  else EXPECT_EQ(text, kSet);
}

// check_supported runs no CUDA call: on host buffers it refuses a head dim without a kernel with
// the list of the built ones, and accepts every listed (dtype, D).
TEST(Sm90Instances, CheckSupportedReadsList) {
  const int64_t S = 256;
  st::MaskSpec causal;
  causal.kind = st::MaskKind::kCausal;
  const st::BlockMaskTensors m = st::build_block_mask(causal, S, S);
  st::backend::AttentionBackend& be = st::backend::attention_cuda_backend();
  auto check = [&](DType t, int64_t d) {
    st::testing::HostTensor q(t, {1, S, 1, d});
    const st::backend::AttentionProblem p{t, 1, S, S, 1, 1, d, 1.f};
    be.check_supported(p, q.view(), q.view(), q.view(), m.mask, nullptr);
  };
  for (const auto& [t, d] : attention_list()) EXPECT_NO_THROW(check(t, d)) << st::dtype_name(t) << " D " << d;
  for (DType t : {DType::kBF16, DType::kFP16})
    for (int64_t d : {64, 80, 96, 128, 256}) {
      if (attention_list().count({t, d})) continue;
      try {
        check(t, d);
        ADD_FAILURE() << "no Error for " << st::dtype_name(t) << " D " << d;
      } catch (const st::Error& e) {
        EXPECT_EQ(std::string(e.what()), "q: expected a head dim with a CUDA kernel in this build (" +
                                             st::backend::attention_cuda_kernels() + "), got D = " +
                                             std::to_string(d) + " (" + st::dtype_name(t) + ")");
      }
    }
}

void expect_refused(int device) {
  const int n = st::cuda::device_count();
  try {
    st::cuda::device_info(device);
    ADD_FAILURE() << "no Error for device " << device;
  } catch (const st::Error& e) {
    const std::string msg = e.what();
    EXPECT_EQ(msg.rfind("device: expected a CUDA device index in [0, " + std::to_string(n) + ")", 0), 0u) << msg;
    EXPECT_NE(msg.find("got " + std::to_string(device)), std::string::npos) << msg;
    EXPECT_EQ(e.kind(), st::Error::Kind::kInvalidArgument);
  }
}

TEST(DeviceCache, RefusesNegativeId) { expect_refused(-1); }
TEST(DeviceCache, RefusesIdPastTheDevices) {
  expect_refused(st::cuda::device_count());
  expect_refused(1 << 20);
}

// The devices there are (none on CI): plausible attributes, the same answer every time, from
// many threads at once; and the ids past them refused from those threads too.
TEST(DeviceCache, ConsistentAcrossThreads) {
  const int n = st::cuda::device_count();
  std::vector<st::cuda::DeviceInfo> first;
  for (int d = 0; d < n; ++d) {
    first.push_back(st::cuda::device_info(d));
    EXPECT_GT(first.back().sm_count, 0);
    EXPECT_GT(first.back().cc_major, 0);
    EXPECT_GT(first.back().max_smem_optin, 0);
  }
  std::vector<std::thread> threads;
  std::vector<int> bad(8, 0);
  for (int i = 0; i < 8; ++i)
    threads.emplace_back([&, i] {
      for (int d = -1; d <= n; ++d) {
        try {
          const st::cuda::DeviceInfo info = st::cuda::device_info(d);
          if (d < 0 || d >= n || info.sm_count != first[size_t(d)].sm_count ||
              info.cc_major != first[size_t(d)].cc_major || info.cc_minor != first[size_t(d)].cc_minor)
            ++bad[size_t(i)];
        } catch (const st::Error&) {
          if (d >= 0 && d < n) ++bad[size_t(i)];
        }
      }
    });
  for (auto& t : threads) t.join();
  for (int i = 0; i < 8; ++i) EXPECT_EQ(bad[size_t(i)], 0) << "thread " << i;
}

#endif  // SPARSETRAIN_WITH_CUDA

}  // namespace

// The sm90 launch heuristic (cuda/grouped_linear/grouped_gemm_tuning_sm90.h): plain host code, so tested on
// the CPU. It sees shapes only (a graph captured once stays valid for any split values).
#include <gtest/gtest.h>

#include <cstdlib>

#include "cuda/grouped_linear/grouped_gemm_tuning_sm90.h"
#include "cuda/tuning.h"

namespace sm90 = sparsetrain::cuda::sm90;

// A two-way environment switch (tuning::forced_or): unset, the rule's answer; `on` / `off` force
// it; `bad` is refused.
template <class F>
void expect_two_way_switch(const char* name, F f, const char* on, const char* off, const char* bad) {
  unsetenv(name);
  EXPECT_TRUE(f(true));
  EXPECT_FALSE(f(false));
  setenv(name, off, 1);
  EXPECT_FALSE(f(true));
  setenv(name, on, 1);
  EXPECT_TRUE(f(false));
  setenv(name, bad, 1);
  EXPECT_THROW(f(true), sparsetrain::Error);
  unsetenv(name);
}

TEST(Sm90Tuning, WgradWalksAlongNWhenMHasManyMoreTiles) {
  // mixtral fc1's wgrad: M = out = 28672 (224 tiles of 128), N = in = 4096 (16 tiles of 256).
  EXPECT_EQ(sm90::pick_tuning(sm90::Variant::kWgrad, 4096, 28672).raster, sm90::Raster::kAlongN);
  EXPECT_EQ(sm90::pick_tuning(sm90::Variant::kWgradF32, 4096, 28672).raster, sm90::Raster::kAlongN);
  // mixtral fc2 (M 32 tiles, N 56) and deepseek fc1 (M 32, N 28): along M.
  EXPECT_EQ(sm90::pick_tuning(sm90::Variant::kWgrad, 14336, 4096).raster, sm90::Raster::kAlongM);
  EXPECT_EQ(sm90::pick_tuning(sm90::Variant::kWgradF32, 7168, 4096).raster, sm90::Raster::kAlongM);
  // The boundary: M tiles = 2 x N tiles walks along N, one fewer along M.
  EXPECT_EQ(sm90::pick_tuning(sm90::Variant::kWgrad, 256, 256).raster, sm90::Raster::kAlongN);
  EXPECT_EQ(sm90::pick_tuning(sm90::Variant::kWgrad, 256, 128).raster, sm90::Raster::kAlongM);
}

TEST(Sm90Tuning, FpropAndDgradWalkAlongM) {
  for (auto v : {sm90::Variant::kFprop, sm90::Variant::kFpropBias, sm90::Variant::kDgrad}) {
    EXPECT_EQ(sm90::pick_tuning(v, 4096, 28672).raster, sm90::Raster::kAlongM);
    EXPECT_EQ(sm90::pick_tuning(v, 28672, 4096).raster, sm90::Raster::kAlongM);
    EXPECT_EQ(sm90::pick_tuning(v, 4096, 28672).swizzle, 1);
  }
}

// A direct-store twin (misaligned caller outputs) computes its variant and is launched exactly
// like it; kWgrad (dW always the library's, aligned) has none.
TEST(Sm90Tuning, DirectStoreTwinsComputeTheirVariantWithItsTuning) {
  for (auto v : {sm90::Variant::kFprop, sm90::Variant::kFpropBias, sm90::Variant::kDgrad, sm90::Variant::kWgradF32}) {
    const sm90::Variant d = sm90::direct_store(v);
    EXPECT_NE(d, v);
    EXPECT_TRUE(sm90::is_direct_store(d));
    EXPECT_FALSE(sm90::is_direct_store(v));
    EXPECT_EQ(sm90::computed_by(d), v);
    EXPECT_EQ(sm90::direct_store(d), d);
    for (int64_t in : {256, 4096})
      for (int64_t out : {128, 28672}) {
        EXPECT_EQ(sm90::pick_tuning(d, in, out).raster, sm90::pick_tuning(v, in, out).raster);
        EXPECT_EQ(sm90::pick_tuning(d, in, out).swizzle, sm90::pick_tuning(v, in, out).swizzle);
      }
  }
  EXPECT_EQ(sm90::direct_store(sm90::Variant::kWgrad), sm90::Variant::kWgrad);
}

// The fprops' and dgrad's one-CTA-cluster twins compute their variant, walked like it; nothing
// else has one (a direct-store twin neither), and none is a direct-store twin.
TEST(Sm90Tuning, NoClusterTwinsComputeTheirVariantWithItsTuning) {
  for (auto v : {sm90::Variant::kFprop, sm90::Variant::kFpropBias, sm90::Variant::kDgrad}) {
    const sm90::Variant s = sm90::no_cluster(v);
    EXPECT_NE(s, v);
    EXPECT_TRUE(sm90::is_no_cluster(s));
    EXPECT_FALSE(sm90::is_no_cluster(v));
    EXPECT_FALSE(sm90::is_direct_store(s));
    EXPECT_FALSE(sm90::is_wgrad(s));
    EXPECT_EQ(sm90::computed_by(s), v);
    EXPECT_EQ(sm90::no_cluster(s), s);
    EXPECT_EQ(sm90::direct_store(s), s);
    for (int64_t in : {256, 4096})
      for (int64_t out : {128, 28672}) {
        EXPECT_EQ(sm90::pick_tuning(s, in, out).raster, sm90::pick_tuning(v, in, out).raster);
        EXPECT_EQ(sm90::pick_tuning(s, in, out).swizzle, sm90::pick_tuning(v, in, out).swizzle);
      }
  }
  for (auto v : {sm90::Variant::kWgrad, sm90::Variant::kWgradF32, sm90::Variant::kWgradF32Add,
                 sm90::Variant::kFpropDirect, sm90::Variant::kFpropBiasDirect, sm90::Variant::kDgradDirect,
                 sm90::Variant::kWgradF32Direct}) {
    EXPECT_EQ(sm90::no_cluster(v), v);
    EXPECT_FALSE(sm90::is_no_cluster(v));
    EXPECT_FALSE(sm90::no_cluster_pays(v, 768, 2048));
  }
  for (auto v : {sm90::Variant::kFpropDirect, sm90::Variant::kFpropBiasDirect, sm90::Variant::kDgradDirect,
                 sm90::Variant::kWgradF32Direct})
    EXPECT_TRUE(sm90::is_direct_store(v));
}

// The one-CTA clusters where an expert's weight is small; SPARSETRAIN_SM90_CLUSTER forces either
// way, other values refused.
TEST(Sm90Tuning, NoClusterByTheExpertsWeightAndItsOverride) {
  const int64_t w = sm90::kNoClusterMaxWeight;
  for (auto v : {sm90::Variant::kFprop, sm90::Variant::kFpropBias, sm90::Variant::kDgrad,
                 sm90::Variant::kFpropNoCluster, sm90::Variant::kDgradNoCluster}) {
    EXPECT_TRUE(sm90::no_cluster_pays(v, 768, 2048));   // qwen fc2
    EXPECT_TRUE(sm90::no_cluster_pays(v, 2048, 1536));  // qwen fc1
    EXPECT_TRUE(sm90::no_cluster_pays(v, 1024, 4096));
    EXPECT_TRUE(sm90::no_cluster_pays(v, w / 8, 8));
    EXPECT_FALSE(sm90::no_cluster_pays(v, w / 8 + 8, 8));
    EXPECT_FALSE(sm90::no_cluster_pays(v, 2048, 7168));   // deepseek fc2
    EXPECT_FALSE(sm90::no_cluster_pays(v, 7168, 4096));   // deepseek fc1
    EXPECT_FALSE(sm90::no_cluster_pays(v, 14336, 4096));  // mixtral fc2
  }
  expect_two_way_switch("SPARSETRAIN_SM90_CLUSTER", sparsetrain::cuda::tuning::sm90_no_cluster, "1", "2", "4");
}

// The reduce-add main_grad wgrad is a wgrad (walked as one) and has no twin: a misaligned
// main_grad runs kWgradF32's direct-store twin instead (GroupedLinear's CUDA backend picks).
TEST(Sm90Tuning, ReduceAddWgradIsAWgradWithoutATwin) {
  EXPECT_EQ(sm90::direct_store(sm90::Variant::kWgradF32Add), sm90::Variant::kWgradF32Add);
  EXPECT_FALSE(sm90::is_direct_store(sm90::Variant::kWgradF32Add));
  for (auto v : {sm90::Variant::kWgrad, sm90::Variant::kWgradF32, sm90::Variant::kWgradF32Add,
                 sm90::Variant::kWgradF32Direct})
    EXPECT_TRUE(sm90::is_wgrad(v));
  for (auto v : {sm90::Variant::kFprop, sm90::Variant::kFpropBias, sm90::Variant::kDgrad, sm90::Variant::kFpropDirect,
                 sm90::Variant::kFpropBiasDirect, sm90::Variant::kDgradDirect})
    EXPECT_FALSE(sm90::is_wgrad(v));
  EXPECT_EQ(sm90::pick_tuning(sm90::Variant::kWgradF32Add, 4096, 28672).raster, sm90::Raster::kAlongN);
  EXPECT_EQ(sm90::pick_tuning(sm90::Variant::kWgradF32Add, 7168, 4096).raster, sm90::Raster::kAlongM);
}

// The reduce-add accumulation where an expert's mean rows (the wgrad's K) reach the threshold;
// SPARSETRAIN_MAIN_GRAD_ADD forces either way, other values refused.
TEST(Sm90Tuning, MainGradAddByMeanRowsPerExpertAndItsOverride) {
  const int64_t r = sm90::kReduceAddMinRowsPerGroup;
  EXPECT_TRUE(sm90::reduce_add_pays(8 * r, 8));
  EXPECT_FALSE(sm90::reduce_add_pays(8 * r - 1, 8));
  EXPECT_FALSE(sm90::reduce_add_pays(128 * 512, 128));
  EXPECT_TRUE(sm90::reduce_add_pays(8 * 16384, 8));
  EXPECT_FALSE(sm90::reduce_add_pays(0, 0));
  expect_two_way_switch("SPARSETRAIN_MAIN_GRAD_ADD", sparsetrain::cuda::tuning::main_grad_reduce_add, "reduce",
                        "epilogue", "atomics");
}

TEST(Sm90Tuning, EnvironmentOverridesOnlyValidValues) {
  const sm90::Tuning base = sm90::pick_tuning(sm90::Variant::kFprop, 64, 64);
  setenv("SPARSETRAIN_SM90_RASTER", "n", 1);
  setenv("SPARSETRAIN_SM90_SWIZZLE", "4", 1);
  sm90::Tuning t = sparsetrain::cuda::tuning::sm90_override(base);
  EXPECT_EQ(t.raster, sm90::Raster::kAlongN);
  EXPECT_EQ(t.swizzle, 4);
  setenv("SPARSETRAIN_SM90_RASTER", "diagonal", 1);
  setenv("SPARSETRAIN_SM90_SWIZZLE", "3", 1);
  t = sparsetrain::cuda::tuning::sm90_override(base);
  EXPECT_EQ(t.raster, base.raster);
  EXPECT_EQ(t.swizzle, base.swizzle);
  unsetenv("SPARSETRAIN_SM90_RASTER");
  unsetenv("SPARSETRAIN_SM90_SWIZZLE");
}

// The layers with the FP8 recipe on the CPU backend. GroupedLinear: forward, dgrad and wgrad
// (weight grad, fused main_grad, delayed) against the double-precision oracle on the operands
// quantized as each GEMM reads them (a tight bound: fp32 accumulation and one rounding), against
// the bf16 layer (a loose bound: the quantization), the recipe's refusals, empty and tiny experts
// and padded tails. GroupedMLP: both layers in FP8, against the bf16 MLP.
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "expect_error.h"
#include "fp8_testing.h"
#include "grouped_linear_case.h"
#include "grouped_mlp_case.h"
#include "ops/grouped_mlp_backend.h"

namespace st = sparsetrain;
using st::testing::GroupedLinearCase;
using st::testing::HostTensor;

namespace {

GroupedLinearCase fp8_case(std::vector<int64_t> splits, int64_t T, int64_t in, int64_t out, uint64_t seed = 1) {
  GroupedLinearCase c;
  c.dtype = st::DType::kBF16;
  c.G = int64_t(splits.size());
  c.T = T, c.in = in, c.out = out;
  c.splits = std::move(splits);
  c.packed_weight = true;
  c.seed = seed;
  c.make();
  return c;
}

st::GroupedLinearOptions fp8_options(const GroupedLinearCase& c) {
  st::GroupedLinearOptions o = c.options();
  o.fp8 = st::Fp8Recipe::kBlockwise;
  return o;
}

std::vector<double> finite_or_zero(const HostTensor& t) {
  std::vector<double> v = t.to_double();
  for (double& e : v)
    if (std::isnan(e)) e = 0;  // rows of no expert: never read by the oracle
  return v;
}

// The oracle on the operands as the FP8 GEMMs read them: x and dy rowwise (fprop, dgrad) or
// columnwise (wgrad), W (fprop, wgrad unused) or W^T read back in [out, in] order (dgrad).
st::testing::GroupedLinearOracle quantized_oracle(const GroupedLinearCase& c, bool columnwise, bool transposed) {
  const std::vector<int64_t> off = st::testing::offsets_of(c.splits, c.T);
  st::testing::GroupedLinearOracle o{c.G, c.T, c.in, c.out, c.splits, {}, {}, {}, {}};
  auto deq = [&](const HostTensor& t, int64_t K) {
    return finite_or_zero(columnwise ? st::testing::dequantize_columnwise(st::testing::quantize_columnwise(t, off),
                                                                          off, c.T, K)
                                     : st::testing::dequantize_rowwise(st::testing::quantize_rowwise(t, off), off,
                                                                       c.T, K));
  };
  o.x = deq(c.x, c.in);
  o.dy = deq(c.dy, c.out);
  for (int64_t g = 0; g < c.G; ++g) {
    const st::testing::Fp8WeightPair p = st::testing::quantize_weight(c.w.view().select(g));
    if (!transposed) {
      o.w.push_back(finite_or_zero(st::testing::dequantize_blocks(p.w, c.out, c.in)));
      continue;
    }
    const std::vector<double> wt = finite_or_zero(st::testing::dequantize_blocks(p.wt, c.in, c.out));
    std::vector<double> back(size_t(c.out * c.in));
    for (int64_t i = 0; i < c.in; ++i)
      for (int64_t j = 0; j < c.out; ++j) back[size_t(j * c.in + i)] = wt[size_t(i * c.out + j)];
    o.w.push_back(back);
  }
  return o;
}

void expect_ok(const st::testing::CompareResult& r) { EXPECT_TRUE(r.ok) << r.first_failure; }

// ||a - b|| / ||b|| over rows [0, rows).
double relative_error(const HostTensor& a, const HostTensor& b, int64_t elements) {
  double num = 0, den = 0;
  for (int64_t i = 0; i < elements; ++i) {
    num += (a.get(i) - b.get(i)) * (a.get(i) - b.get(i));
    den += b.get(i) * b.get(i);
  }
  return std::sqrt(num / std::max(den, 1e-300));
}

struct Shape {
  std::vector<int64_t> splits;
  int64_t T, in, out;
};
const Shape kShapes[] = {
    {{129, 0, 1, 150}, 300, 256, 144},  // empty and 1-row experts, a 129-row one, a padded tail
    {{0, 64, 0}, 64, 16, 1024},
    {{3, 5}, 8, 32, 48},
    {{0, 0}, 10, 16, 16},  // only a padded tail
};

TEST(GroupedLinearFp8, ForwardAndBackwardMatchTheOracleOfTheQuantizedOperands) {
  for (const Shape& s : kShapes) {
    const GroupedLinearCase c = fp8_case(s.splits, s.T, s.in, s.out);
    SCOPED_TRACE(c.name());
    const st::Splits sp = st::Splits::host(c.splits);
    st::GroupedLinear layer(fp8_options(c), c.params());
    const st::Tensor y = layer.forward(c.x.view(), sp);
    expect_ok(st::testing::compare_with_oracle(HostTensor::copy_of(y.view()), quantized_oracle(c, false, false).forward(),
                                               c.dtype, 1, "y"));
    const st::GroupedLinearGrads g = layer.backward(c.x.view(), c.dy.view(), sp);
    expect_ok(st::testing::compare_with_oracle(HostTensor::copy_of(g.grad_input.view()),
                                               quantized_oracle(c, false, true).dgrad(), c.dtype, 1, "dx"));
    ASSERT_EQ(g.weight.kind, st::WeightGradKind::kWgrad);
    const st::testing::GroupedLinearOracle ow = quantized_oracle(c, true, false);
    for (int64_t e = 0; e < c.G; ++e)
      expect_ok(st::testing::compare_with_oracle(HostTensor::copy_of(g.weight.per_group[size_t(e)].view()),
                                                 ow.wgrad(e, nullptr), c.dtype, 1, "dw[" + std::to_string(e) + "]"));
  }
}

// The quantization's cost against the bf16 layer: a few percent (e4m3's 3 mantissa bits), the
// bound this test states.
TEST(GroupedLinearFp8, StaysCloseToTheBf16Layer) {
  const GroupedLinearCase c = fp8_case({100, 0, 37, 120}, 260, 256, 128, 7);
  const st::Splits sp = st::Splits::host(c.splits);
  st::GroupedLinear fp8(fp8_options(c), c.params()), bf16(c.options(), c.params());
  const int64_t S = 257;
  const HostTensor y8 = HostTensor::copy_of(fp8.forward(c.x.view(), sp).view());
  const HostTensor y16 = HostTensor::copy_of(bf16.forward(c.x.view(), sp).view());
  const double ey = relative_error(y8, y16, S * c.out);
  EXPECT_LT(ey, 0.06);
  EXPECT_GT(ey, 1e-3) << "the FP8 GEMMs ran (e4m3 cannot give the bf16 layer's results)";
  const auto g8 = fp8.backward(c.x.view(), c.dy.view(), sp), g16 = bf16.backward(c.x.view(), c.dy.view(), sp);
  EXPECT_LT(relative_error(HostTensor::copy_of(g8.grad_input.view()), HostTensor::copy_of(g16.grad_input.view()),
                           S * c.in),
            0.06);
  EXPECT_LT(relative_error(HostTensor::copy_of(g8.weight.packed.view()), HostTensor::copy_of(g16.weight.packed.view()),
                           c.G * c.out * c.in),
            0.06);
}

// Fused main_grad (accumulated; an empty expert's untouched) and delayed wgrad (bitwise the
// non-delayed one).
TEST(GroupedLinearFp8, MainGradFusionAndDelayedWgrad) {
  GroupedLinearCase c = fp8_case({40, 0, 88}, 130, 128, 64, 3);
  c.fuse = true;
  c.packed_main_grad = true;
  const HostTensor before = c.main_grad;
  const st::Splits sp = st::Splits::host(c.splits);
  {
    st::GroupedLinear layer(fp8_options(c), c.params());
    const auto g = layer.backward(c.x.view(), c.dy.view(), sp);
    EXPECT_EQ(g.weight.kind, st::WeightGradKind::kNone);
  }
  const st::testing::GroupedLinearOracle ow = quantized_oracle(c, true, false);
  for (int64_t e = 0; e < c.G; ++e) {
    const HostTensor got = HostTensor::copy_of(c.main_grad.view().select(e));
    const HostTensor base = HostTensor::copy_of(before.view().select(e));
    if (c.splits[size_t(e)] == 0) {
      EXPECT_TRUE(got.bytes_equal(base)) << "an empty expert's main_grad is left bit for bit";
      continue;
    }
    const std::vector<double> b = base.to_double();
    expect_ok(st::testing::compare_with_oracle(got, ow.wgrad(e, &b), st::DType::kFP32, 1, "main_grad"));
  }
  const HostTensor eager = c.main_grad;
  c.main_grad = before;
  c.delay = true;
  st::GroupedLinear delayed(fp8_options(c), c.params());
  delayed.backward(c.x.view(), c.dy.view(), sp);
  delayed.backward_dw();
  EXPECT_TRUE(c.main_grad.bytes_equal(eager)) << "delayed FP8 wgrad equals the eager one bitwise";
}

// Weights are quantized once a version (CallArgs::weight_version): a call at the version of the
// last quantization reuses it (so a change behind the counter is not seen: what the counter is
// for), another version quantizes anew, and 0 quantizes anew and drops what the layer kept.
TEST(GroupedLinearFp8, WeightsAreQuantizedOnceAVersion) {
  GroupedLinearCase c = fp8_case({20, 12}, 32, 32, 48, 9);
  const st::Splits sp = st::Splits::host(c.splits);
  st::GroupedLinear layer(fp8_options(c), c.params());
  auto run = [&](uint64_t version) {
    st::CallArgs a;
    a.weight_version = version;
    return HostTensor::copy_of(layer.forward(c.x.view(), sp, {}, a).view());
  };
  const HostTensor y1 = run(7);
  for (int64_t i = 0; i < c.w.numel(); ++i) c.w.set(i, 2 * c.w.get(i));  // in place, behind the counter
  EXPECT_TRUE(run(7).bytes_equal(y1)) << "version 7 again: the cached weights";
  const HostTensor y2 = run(8);
  EXPECT_FALSE(y2.bytes_equal(y1)) << "a new version: quantized anew";
  EXPECT_TRUE(run(0).bytes_equal(y2)) << "version 0: quantized anew (the same weights)";
  for (int64_t i = 0; i < c.w.numel(); ++i) c.w.set(i, 0.5 * c.w.get(i));
  EXPECT_TRUE(run(0).bytes_equal(y1)) << "version 0 keeps nothing: the weights as they are now";
  EXPECT_TRUE(run(8).bytes_equal(y1)) << "version 0 dropped the cache: version 8 quantizes the weights as they are";
}

TEST(GroupedLinearFp8, RefusesWhatTheRecipeCannotRun) {
  using st::testing::expect_error;
  GroupedLinearCase c = fp8_case({4, 4}, 8, 32, 32);
  c.bias = true;
  expect_error([&] { st::GroupedLinear(fp8_options(c), c.params()); }, {"bias", "none with fp8", "a bias"});
  const GroupedLinearCase odd = fp8_case({4, 4}, 8, 24, 32);
  expect_error([&] { st::GroupedLinear(fp8_options(odd), odd.params()); },
               {"in_features", "a multiple of 16 with fp8", "24"});
  GroupedLinearCase half = fp8_case({4, 4}, 8, 32, 32);
  half.dtype = st::DType::kFP16;
  half.make();
  expect_error([&] { st::GroupedLinear(fp8_options(half), half.params()); }, {"dtype", "bf16 with fp8", "fp16"});
}

// Both of GroupedMLP's layers in FP8 (fc2's bias is the MLP's own, so it stays): outputs and every
// gradient through a GEMM within the quantization's few percent of the bf16 MLP, and not equal
// to it.
TEST(GroupedMLPFp8, BothLayersRunTheRecipe) {
  const st::testing::GroupedMLPCase c =
      st::testing::random_mlp_case(st::DType::kBF16, 3, 70, 64, 64, 32, 48, 0, {1}, true, false, true, 5);
  st::GroupedMLPOptions o8 = c.options();
  o8.fp8 = st::Fp8Recipe::kBlockwise;
  st::GroupedMLP fp8(o8, c.params()), bf16(c.options(), c.params());
  const st::Splits sp = st::Splits::host(c.splits);
  const auto f8 = fp8.forward(c.x.view(), sp, c.probs.view()), f16 = bf16.forward(c.x.view(), sp, c.probs.view());
  const auto g8 = fp8.backward(c.x.view(), f8.fc1_out.view(), c.probs.view(), c.dy.view(), sp);
  const auto g16 = bf16.backward(c.x.view(), f16.fc1_out.view(), c.probs.view(), c.dy.view(), sp);
  const int64_t S = 64;
  auto close = [&](const st::TensorView& a, const st::TensorView& b, int64_t n, const char* what) {
    const double e = relative_error(HostTensor::copy_of(a), HostTensor::copy_of(b), n);
    EXPECT_LT(e, 0.08) << what;
    EXPECT_GT(e, 1e-4) << what << ": the FP8 GEMMs ran";
  };
  close(f8.out.view(), f16.out.view(), S * c.out, "out");
  close(g8.grad_input.view(), g16.grad_input.view(), S * c.in, "dx");
  close(g8.dprobs.view(), g16.dprobs.view(), S, "dprobs");
  close(g8.fc1.weight.packed.view(), g16.fc1.weight.packed.view(), c.G * 2 * c.F * c.in, "fc1 dw");
  close(g8.fc2.weight.packed.view(), g16.fc2.weight.packed.view(), c.G * c.out * c.F, "fc2 dw");
  EXPECT_TRUE(HostTensor::copy_of(g8.fc2.bias_grad.view()).bytes_equal(HostTensor::copy_of(g16.fc2.bias_grad.view())))
      << "fc2's bias grad (a probs-scaled sum of dy) passes through no GEMM: the bf16 MLP's bits";

  const st::testing::GroupedMLPCase b =
      st::testing::random_mlp_case(st::DType::kBF16, 2, 8, 8, 32, 16, 16, 0, {}, true, true, false, 6);
  st::GroupedMLPOptions ob = b.options();
  ob.fp8 = st::Fp8Recipe::kBlockwise;
  st::testing::expect_error([&] { st::GroupedMLP(ob, b.params()); }, {"fc1.bias", "none with fp8"});
}

// fc2 reads h' quantized straight from the SwiGLU (h' never in memory in the dtype): the same
// bits as an FP8 GroupedLinear run on the h' the bf16 SwiGLU writes, interleaved gate / up
// columns, an empty expert and a padded tail included.
TEST(GroupedMLPFp8, Fc2ReadsTheSwigluOutputAsAnFp8LayerWould) {
  const st::testing::GroupedMLPCase c =
      st::testing::random_mlp_case(st::DType::kBF16, 4, 300, 290, 64, 160, 48, 32, {2}, true, false, false, 7);
  st::GroupedMLPOptions o8 = c.options();
  o8.fp8 = st::Fp8Recipe::kBlockwise;
  st::GroupedMLP mlp(o8, c.params());
  const st::Splits sp = st::Splits::host(c.splits);
  const auto f = mlp.forward(c.x.view(), sp, c.probs.view());

  const std::vector<int64_t> off = st::testing::offsets_of(c.splits, c.T);
  HostTensor h(st::DType::kBF16, {c.T, c.F});
  st::backend::grouped_mlp_backend_for(st::Device::cpu(), "x")
      .swiglu_forward({{st::DType::kBF16, c.G, c.T, off.data()}, c.F, c.k, f.fc1_out.view(), c.probs.view(), h.view(),
                       {}},
                      nullptr, st::Stream{});
  st::GroupedLinearOptions o2;
  o2.num_groups = c.G, o2.in_features = c.F, o2.out_features = c.out, o2.dtype = st::DType::kBF16;
  o2.fp8 = st::Fp8Recipe::kBlockwise;
  st::GroupedLinear fc2(o2, c.params().fc2);
  const st::Tensor y = fc2.forward(h.view(), sp);
  EXPECT_TRUE(HostTensor::copy_of(f.out.view()).bytes_equal(HostTensor::copy_of(y.view())));
}


// GroupedMLP's FP8 backward with a's and b's in 128-column tile pairs: the SwiGLU backward writes
// fc1's two layouts of d fc1_out codes and fc2's wgrad codes of h' itself (neither in memory in
// the dtype); every gradient the
// same bits as the layers run step by step (fc2's FP8 backward on the h' the bf16 SwiGLU writes,
// the bf16 SwiGLU backward, fc1's FP8 backward on its d fc1_out), halves and interleaved columns,
// an empty expert and a padded tail. F = 32 (no tile pairs) and an fc2 bias took the step-by-step
// path (BothLayersRunTheRecipe).
TEST(GroupedMLPFp8, Fc1ReadsTheSwigluGradientAsAnFp8LayerWould) {
  for (const int64_t k : {int64_t(0), int64_t(128)}) {
    SCOPED_TRACE("interleave " + std::to_string(k));
    const st::testing::GroupedMLPCase c =
        st::testing::random_mlp_case(st::DType::kBF16, 4, 300, 290, 64, 256, 48, k, {2}, true, false, false, 8);
    st::GroupedMLPOptions o8 = c.options();
    o8.fp8 = st::Fp8Recipe::kBlockwise;
    st::GroupedMLP mlp(o8, c.params());
    const st::Splits sp = st::Splits::host(c.splits);
    const auto f = mlp.forward(c.x.view(), sp, c.probs.view());
    const auto g = mlp.backward(c.x.view(), f.fc1_out.view(), c.probs.view(), c.dy.view(), sp);

    const std::vector<int64_t> off = st::testing::offsets_of(c.splits, c.T);
    const st::backend::MLPRows rows{st::DType::kBF16, c.G, c.T, off.data()};
    st::backend::GroupedMLPBackend& ref = st::backend::grouped_mlp_backend_for(st::Device::cpu(), "x");
    HostTensor h(st::DType::kBF16, {c.T, c.F});
    ref.swiglu_forward({rows, c.F, c.k, f.fc1_out.view(), c.probs.view(), h.view(), {}}, nullptr, st::Stream{});
    auto fp8_layer = [&](int64_t in, int64_t out, const st::GroupedLinearParams& params) {
      st::GroupedLinearOptions o;
      o.num_groups = c.G, o.in_features = in, o.out_features = out, o.dtype = st::DType::kBF16;
      o.fp8 = st::Fp8Recipe::kBlockwise;
      return st::GroupedLinear(o, params);
    };
    st::GroupedLinear fc2 = fp8_layer(c.F, c.out, c.params().fc2), fc1 = fp8_layer(c.in, 2 * c.F, c.params().fc1);
    const auto g2 = fc2.backward(h.view(), c.dy.view(), sp);
    HostTensor dz(st::DType::kBF16, {c.T, 2 * c.F}), dprobs(st::DType::kFP32, {c.T});
    ref.swiglu_backward({rows, c.F, c.k, c.out, f.fc1_out.view(), c.probs.view(), g2.grad_input.view(), c.dy.view(),
                         {}, dz.view(), dprobs.view()},
                        nullptr, st::Stream{});
    const auto g1 = fc1.backward(c.x.view(), dz.view(), sp);
    auto same = [](const st::TensorView& a, const st::TensorView& b) {
      return HostTensor::copy_of(a).bytes_equal(HostTensor::copy_of(b));
    };
    EXPECT_TRUE(same(g.grad_input.view(), g1.grad_input.view())) << "dx";
    EXPECT_TRUE(same(g.fc1.weight.packed.view(), g1.weight.packed.view())) << "fc1 dw";
    EXPECT_TRUE(same(g.fc2.weight.packed.view(), g2.weight.packed.view())) << "fc2 dw";
    EXPECT_TRUE(same(g.dprobs.view(), dprobs.view())) << "dprobs";
  }
}

}  // namespace

// The CPU reference of GroupedLinear's three FP8 GEMMs (fprop, dgrad, wgrad into the layer's
// dtype or an fp32 main_grad) on quantized operands, against the double-precision GroupedLinear
// oracle run on the dequantized operands: the bound is fp32 accumulation plus the output's
// rounding, nothing for the quantization. Empty and tiny experts, padded tails, poisoned outputs.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "fp8_testing.h"
#include "grouped_linear_oracle.h"

namespace st = sparsetrain;
namespace be = sparsetrain::backend;
using st::testing::Fp8Operand;
using st::testing::HostTensor;

namespace {

struct GemmCase {
  st::DType dtype;
  std::vector<int64_t> splits;
  int64_t T, in, out;
};

std::string case_name(const ::testing::TestParamInfo<GemmCase>& info) {
  const GemmCase& c = info.param;
  int64_t S = 0;
  for (int64_t s : c.splits) S += s;
  return std::string(st::dtype_name(c.dtype)) + "_G" + std::to_string(c.splits.size()) + "_T" + std::to_string(c.T) +
         "_S" + std::to_string(S) + "_in" + std::to_string(c.in) + "_out" + std::to_string(c.out);
}

std::vector<double> as_double(const HostTensor& t) {
  std::vector<double> v = t.to_double();
  for (double& e : v)
    if (std::isnan(e)) e = 0;  // rows of no expert: never read by the oracle's sums
  return v;
}

HostTensor random_tensor(st::DType dtype, std::vector<int64_t> shape, std::mt19937_64& rng, double scale) {
  HostTensor t(dtype, std::move(shape));
  t.fill_random(rng, scale);
  return t;
}

// The operands of one layer step, quantized as each GEMM reads them.
struct Fp8Step {
  const GemmCase& c;
  std::vector<int64_t> off;
  std::mt19937_64 rng;
  HostTensor x, dy, w, main_grad;  // x [T, in], dy [T, out], w [G, out, in], main_grad fp32 [G, out, in]
  Fp8Operand xq, dyq, xc, dyc;     // rowwise x, dy; columnwise x, dy
  std::vector<st::testing::Fp8WeightPair> wq;
  HostTensor scratch;

  int64_t G() const { return int64_t(c.splits.size()); }
  int64_t S() const { return off.back(); }
  be::GroupedProblem problem() const { return {c.dtype, G(), c.T, c.in, c.out, off.data(), nullptr}; }

  explicit Fp8Step(const GemmCase& gc)
      : c(gc),
        off(st::testing::offsets_of(gc.splits, gc.T)),
        rng(uint64_t(gc.T * 31 + gc.in * 7 + gc.out)),
        x(random_tensor(gc.dtype, {gc.T, gc.in}, rng, 1.0)),
        dy(random_tensor(gc.dtype, {gc.T, gc.out}, rng, 1e-3)),
        w(random_tensor(gc.dtype, {G(), gc.out, gc.in}, rng, 1.0 / std::sqrt(double(gc.in)))),
        main_grad(random_tensor(st::DType::kFP32, {G(), gc.out, gc.in}, rng, 4.0)),
        xq(st::testing::quantize_rowwise(x, off)),
        dyq(st::testing::quantize_rowwise(dy, off)),
        xc(st::testing::quantize_columnwise(x, off)),
        dyc(st::testing::quantize_columnwise(dy, off)),
        scratch(st::DType::kUInt8,
                {int64_t(st::testing::fp8_ref().gemm_scratch_bytes(gc.dtype, G(), gc.T, gc.in, gc.out))}) {
    for (int64_t g = 0; g < G(); ++g) wq.push_back(st::testing::quantize_weight(w.view().select(g)));
    scratch.poison();
  }

  // The oracle on dequantized operands: rowwise x and W for fprop, rowwise dy and W^T's copy for
  // dgrad, the columnwise copies for wgrad.
  st::testing::GroupedLinearOracle oracle(bool columnwise, bool transposed_weight) const {
    st::testing::GroupedLinearOracle o{G(), c.T, c.in, c.out, c.splits, {}, {}, {}, {}};
    o.x = as_double(columnwise ? st::testing::dequantize_columnwise(xc, off, c.T, c.in)
                               : st::testing::dequantize_rowwise(xq, off, c.T, c.in));
    o.dy = as_double(columnwise ? st::testing::dequantize_columnwise(dyc, off, c.T, c.out)
                                : st::testing::dequantize_rowwise(dyq, off, c.T, c.out));
    for (int64_t g = 0; g < G(); ++g) {
      if (!transposed_weight) {
        o.w.push_back(as_double(st::testing::dequantize_blocks(wq[size_t(g)].w, c.out, c.in)));
        continue;
      }
      const std::vector<double> wt = as_double(st::testing::dequantize_blocks(wq[size_t(g)].wt, c.in, c.out));
      std::vector<double> back(size_t(c.out * c.in));
      for (int64_t i = 0; i < c.in; ++i)
        for (int64_t o2 = 0; o2 < c.out; ++o2) back[size_t(o2 * c.in + i)] = wt[size_t(i * c.out + o2)];
      o.w.push_back(back);
    }
    return o;
  }

  std::vector<be::Fp8Tensor> weights(bool transposed) const {
    std::vector<be::Fp8Tensor> v;
    for (const auto& p : wq) v.push_back(transposed ? p.wt.view() : p.w.view());
    return v;
  }
};

void expect_ok(const st::testing::CompareResult& r) { EXPECT_TRUE(r.ok) << r.first_failure; }

// Rows [from, rows) of t: all zero (zero_tail) or all still poisoned (NaN).
void expect_tail(const HostTensor& t, int64_t cols, int64_t from, bool zero) {
  for (int64_t i = from * cols; i < t.numel(); ++i) {
    if (zero) {
      ASSERT_EQ(t.get(i), 0.0) << "tail element " << i;
    } else {
      ASSERT_TRUE(std::isnan(t.get(i))) << "tail element " << i << " written";
    }
  }
}

// fprop or dgrad: call(out, zero_tail) into a poisoned [T, cols] output, with and without a zeroed
// tail, against the oracle's rows below S.
template <class Call>
void expect_rowwise_gemm(const Fp8Step& s, int64_t cols, const st::testing::OracleValues& want, const char* name,
                         Call call) {
  for (const bool zero_tail : {true, false}) {
    HostTensor out(s.c.dtype, {s.c.T, cols});
    out.poison();
    call(out.view(), zero_tail);
    expect_ok(st::testing::compare_with_oracle(out, want, s.c.dtype, 1, name));
    expect_tail(out, cols, s.S(), zero_tail);
  }
}

class Fp8Gemm : public ::testing::TestWithParam<GemmCase> {};

TEST_P(Fp8Gemm, FpropMatchesTheOracleOfTheDequantizedOperands) {
  const Fp8Step s(GetParam());
  expect_rowwise_gemm(s, s.c.out, s.oracle(false, false).forward(), "y", [&](st::TensorView y, bool zero_tail) {
    st::testing::fp8_ref().fprop({s.problem(), s.xq.view(), s.weights(false), y, zero_tail}, s.scratch.data(),
                                 st::Stream{});
  });
}

TEST_P(Fp8Gemm, DgradReadsTheTransposedWeightsAndMatchesTheOracle) {
  const Fp8Step s(GetParam());
  expect_rowwise_gemm(s, s.c.in, s.oracle(false, true).dgrad(), "dx", [&](st::TensorView dx, bool zero_tail) {
    st::testing::fp8_ref().dgrad({s.problem(), s.dyq.view(), s.weights(true), dx, zero_tail}, s.scratch.data(),
                                 st::Stream{});
  });
}

TEST_P(Fp8Gemm, WgradIntoEachTargetMatchesTheOracle) {
  const Fp8Step s(GetParam());
  const GemmCase& c = s.c;
  const st::testing::GroupedLinearOracle o = s.oracle(true, false);
  for (const be::WgradTarget target :
       {be::WgradTarget::kWeightGrad, be::WgradTarget::kMainGradAccumulate, be::WgradTarget::kMainGradOverwrite}) {
    const bool main = target != be::WgradTarget::kWeightGrad;
    const st::DType out_type = main ? st::DType::kFP32 : c.dtype;
    HostTensor dw(out_type, {s.G(), c.out, c.in});
    if (target == be::WgradTarget::kMainGradAccumulate) dw = s.main_grad;
    else dw.poison();
    std::vector<st::TensorView> dws;
    for (int64_t g = 0; g < s.G(); ++g) dws.push_back(dw.view().select(g));
    st::testing::fp8_ref().wgrad({s.problem(), s.xc.view(), s.dyc.view(), target, dws}, s.scratch.data(),
                                 st::Stream{});
    for (int64_t g = 0; g < s.G(); ++g) {
      const HostTensor got = HostTensor::copy_of(dws[size_t(g)]);
      const HostTensor before = HostTensor::copy_of(s.main_grad.view().select(g));
      if (target == be::WgradTarget::kMainGradAccumulate && c.splits[size_t(g)] == 0) {
        EXPECT_TRUE(got.bytes_equal(before)) << "an empty expert's main_grad is left bit for bit";
        continue;
      }
      const std::vector<double> base = before.to_double();
      expect_ok(st::testing::compare_with_oracle(
          got, o.wgrad(g, target == be::WgradTarget::kMainGradAccumulate ? &base : nullptr), out_type, 1,
          "dw[" + std::to_string(g) + "]"));
    }
  }
}

const GemmCase kCases[] = {
    {st::DType::kBF16, {129, 0, 1, 150}, 300, 200, 136},
    {st::DType::kFP16, {0, 64, 0}, 64, 8, 1000},
    {st::DType::kFP32, {1, 2, 3, 0, 30}, 40, 129, 7},
    {st::DType::kBF16, {257}, 257, 128, 128},
    {st::DType::kFP16, {3, 0}, 5, 1, 3},
    {st::DType::kBF16, {0, 0}, 10, 16, 16},  // only a padded tail
};
INSTANTIATE_TEST_SUITE_P(Reference, Fp8Gemm, ::testing::ValuesIn(kCases), case_name);

// A non-finite input reaches the output: its tile's NaN spreads to the outputs it feeds, and the
// other rows stay finite.
TEST(Fp8GemmNonFinite, AnInfInXMakesItsRowOfYNaN) {
  const GemmCase c{st::DType::kBF16, {4, 3}, 7, 200, 5};
  Fp8Step s(c);
  s.x.set(5 * c.in + 150, INFINITY);
  s.xq = st::testing::quantize_rowwise(s.x, s.off);
  HostTensor y(c.dtype, {c.T, c.out});
  y.poison();
  st::testing::fp8_ref().fprop({s.problem(), s.xq.view(), s.weights(false), y.view(), true}, s.scratch.data(),
                               st::Stream{});
  for (int64_t t = 0; t < c.T; ++t)
    for (int64_t o = 0; o < c.out; ++o) EXPECT_EQ(std::isnan(y.get(t * c.out + o)), t == 5) << t << " " << o;
}

}  // namespace

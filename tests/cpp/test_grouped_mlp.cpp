// GroupedMLP on the CPU reference vs the double-precision oracle, on fresh random data and odd
// shapes (prime sizes, G = 1 and 128, empty experts, T > S, no rows at all, glu interleave 0, 1
// and 4, biases on and off), with host and device splits; plus bitwise determinism, caller
// buffers (written in place, tails untouched, bit-identical to the library-allocated path) and a
// finite-difference check of the oracle's own backward.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>

#include "grouped_mlp_case.h"

namespace st = sparsetrain;
using st::testing::GroupedMLPCase;
using st::testing::HostTensor;

using st::testing::SplitsHolder;

namespace {

struct Shape {
  st::DType dtype;
  int64_t G, T, S, in, F, out, k;
  std::vector<int64_t> empty;
  bool packed, bias1, bias2;
};

const Shape kShapes[] = {
    {st::DType::kBF16, 8, 257, 250, 64, 48, 96, 0, {2, 5}, false, true, true},
    {st::DType::kFP16, 1, 131, 131, 37, 53, 29, 1, {}, true, true, false},
    {st::DType::kFP32, 5, 97, 89, 13, 20, 11, 4, {0, 3}, false, false, true},
    {st::DType::kBF16, 7, 61, 59, 3, 8, 5, 4, {6}, true, false, false},
    {st::DType::kFP16, 3, 43, 40, 16, 12, 17, 4, {1}, false, true, true},
    {st::DType::kFP32, 128, 263, 251, 8, 6, 7, 1, {5}, true, true, true},
    {st::DType::kBF16, 3, 0, 0, 8, 4, 8, 0, {0, 1, 2}, false, true, true},  // no rows at all
    {st::DType::kFP32, 2, 40, 0, 9, 4, 7, 4, {0, 1}, true, true, true},     // only a padded tail
};

struct Param {
  Shape shape;
  bool device_splits;
};

std::string param_name(const Param& p) {
  const Shape& s = p.shape;
  return std::string(st::dtype_name(s.dtype)) + "_G" + std::to_string(s.G) + "_T" + std::to_string(s.T) + "_S" +
         std::to_string(s.S) + "_in" + std::to_string(s.in) + "_F" + std::to_string(s.F) + "_out" +
         std::to_string(s.out) + "_k" + std::to_string(s.k) + "_empty" + std::to_string(s.empty.size()) +
         (s.packed ? "_packed" : "") + (s.bias1 ? "_bias1" : "") + (s.bias2 ? "_bias2" : "") +
         (p.device_splits ? "_devicesplits" : "_hostsplits");
}
std::string param_name_info(const ::testing::TestParamInfo<Param>& info) { return param_name(info.param); }
void PrintTo(const Param& p, std::ostream* os) { *os << param_name(p); }


void expect_ok(const st::testing::CompareResult& r) { EXPECT_TRUE(r.ok) << r.first_failure; }

// Rows >= from_row of a 1-D or 2-D tensor are exactly +0.
void expect_tail_zero(const st::TensorView& t, int64_t from_row, const char* what) {
  const HostTensor h = HostTensor::copy_of(t);
  const int64_t row = t.dim() > 1 ? t.size(1) : 1;
  for (int64_t i = from_row * row; i < t.numel(); ++i)
    ASSERT_TRUE(h.get(i) == 0.0 && !std::signbit(h.get(i))) << what << ": padded tail element " << i << " not zero";
}

// The first `rows` rows of a tensor, as a contiguous host copy.
HostTensor head(const st::TensorView& t, int64_t rows) { return HostTensor::copy_of(t.rows(0, rows)); }

class GroupedMLPVsOracle : public ::testing::TestWithParam<Param> {
 protected:
  GroupedMLPCase make_case(uint64_t seed = 5) const {
    const Shape& s = GetParam().shape;
    return st::testing::random_mlp_case(s.dtype, s.G, s.T, s.S, s.in, s.F, s.out, s.k, s.empty, s.packed, s.bias1,
                                        s.bias2, seed);
  }
};

}  // namespace

TEST_P(GroupedMLPVsOracle, ForwardBackwardMatchTheOracle) {
  const GroupedMLPCase c = make_case();
  const int64_t S = c.rows_used();
  st::testing::PoisonAllocator alloc;  // every library allocation starts as NaN
  st::GroupedMLP mlp(c.options(), c.params(), &alloc);
  SplitsHolder sp(c.splits, GetParam().device_splits);
  const auto oracle = c.oracle();

  const st::GroupedMLPForward fwd = mlp.forward(c.x.view(), sp.splits, c.probs.view());
  ASSERT_EQ(fwd.out.view().size(0), c.T);
  ASSERT_EQ(fwd.out.view().size(1), c.out);
  ASSERT_EQ(fwd.fc1_out.view().size(1), 2 * c.F);
  const auto f = oracle.forward();
  expect_ok(st::testing::compare_bounded(head(fwd.fc1_out.view(), S), f.fc1_out, c.dtype, "fc1_out"));
  expect_ok(st::testing::compare_bounded(head(fwd.out.view(), S), f.out, c.dtype, "out"));
  expect_tail_zero(fwd.out.view(), S, "out");
  expect_tail_zero(fwd.fc1_out.view(), S, "fc1_out");

  const st::GroupedMLPGrads g =
      mlp.backward(c.x.view(), fwd.fc1_out.view(), c.probs.view(), c.dy.view(), sp.splits);
  const auto b = oracle.backward(HostTensor::copy_of(fwd.fc1_out.view()).to_double());
  expect_ok(st::testing::compare_bounded(head(g.grad_input.view(), S), b.dx, c.dtype, "dx"));
  expect_tail_zero(g.grad_input.view(), S, "dx");
  ASSERT_EQ(g.dprobs.view().dtype(), st::DType::kFP32);
  ASSERT_EQ(g.dprobs.view().dim(), 1);
  ASSERT_EQ(g.dprobs.view().size(0), c.T);
  expect_ok(st::testing::compare_bounded(head(g.dprobs.view(), S), b.dprobs, st::DType::kFP32, "dprobs"));
  expect_tail_zero(g.dprobs.view(), S, "dprobs");

  ASSERT_EQ(g.fc1.weight.kind, st::WeightGradKind::kWgrad);
  ASSERT_EQ(g.fc2.weight.kind, st::WeightGradKind::kWgrad);
  ASSERT_EQ(int64_t(g.fc1.weight.per_group.size()), c.G);
  ASSERT_EQ(int64_t(g.fc2.weight.per_group.size()), c.G);
  EXPECT_EQ(g.fc1.bias_grad.defined(), c.bias1);
  EXPECT_EQ(g.fc2.bias_grad.defined(), c.bias2);
  for (int64_t grp = 0; grp < c.G; ++grp) {
    const std::string n = "[" + std::to_string(grp) + "]";
    expect_ok(st::testing::compare_bounded(HostTensor::copy_of(g.fc1.weight.per_group[size_t(grp)].view()),
                                           b.dw1[size_t(grp)], c.dtype, "dW1" + n));
    expect_ok(st::testing::compare_bounded(HostTensor::copy_of(g.fc2.weight.per_group[size_t(grp)].view()),
                                           b.dw2[size_t(grp)], c.dtype, "dW2" + n));
    if (c.bias1)
      expect_ok(st::testing::compare_bounded(HostTensor::copy_of(g.fc1.bias_grad.view().select(grp)),
                                             b.db1[size_t(grp)], c.dtype, "db1" + n));
    if (c.bias2)
      expect_ok(st::testing::compare_bounded(HostTensor::copy_of(g.fc2.bias_grad.view().select(grp)),
                                             b.db2[size_t(grp)], c.dtype, "db2" + n));
  }
  if (GetParam().device_splits) {
    EXPECT_EQ(sp.status.get(0), 0.0) << "valid splits leave the status clear";
  }
}

TEST_P(GroupedMLPVsOracle, RepeatedRunsAreBitwiseIdentical) {
  const GroupedMLPCase c = make_case(6);
  st::GroupedMLP mlp(c.options(), c.params());
  SplitsHolder sp(c.splits, GetParam().device_splits);
  const auto f1 = mlp.forward(c.x.view(), sp.splits, c.probs.view());
  const auto f2 = mlp.forward(c.x.view(), sp.splits, c.probs.view());
  EXPECT_TRUE(st::testing::bytes_equal(f1.out.view(), f2.out.view()));
  EXPECT_TRUE(st::testing::bytes_equal(f1.fc1_out.view(), f2.fc1_out.view()));
  const auto g1 = mlp.backward(c.x.view(), f1.fc1_out.view(), c.probs.view(), c.dy.view(), sp.splits);
  const auto g2 = mlp.backward(c.x.view(), f1.fc1_out.view(), c.probs.view(), c.dy.view(), sp.splits);
  EXPECT_TRUE(st::testing::bytes_equal(g1.grad_input.view(), g2.grad_input.view()));
  EXPECT_TRUE(st::testing::bytes_equal(g1.dprobs.view(), g2.dprobs.view()));
  EXPECT_TRUE(HostTensor::copy_of(g1.fc1.weight.packed.view()).bytes_equal(HostTensor::copy_of(g2.fc1.weight.packed.view())));
  EXPECT_TRUE(HostTensor::copy_of(g1.fc2.weight.packed.view()).bytes_equal(HostTensor::copy_of(g2.fc2.weight.packed.view())));
  if (c.bias1) {
    EXPECT_TRUE(st::testing::bytes_equal(g1.fc1.bias_grad.view(), g2.fc1.bias_grad.view()));
  }
  if (c.bias2) {
    EXPECT_TRUE(st::testing::bytes_equal(g1.fc2.bias_grad.view(), g2.fc2.bias_grad.view()));
  }
}

TEST_P(GroupedMLPVsOracle, CallerBuffersAreWrittenInPlaceWithTailsUntouched) {
  const GroupedMLPCase c = make_case(7);
  const int64_t S = c.rows_used();
  st::GroupedMLP mlp(c.options(), c.params());
  SplitsHolder sp(c.splits, GetParam().device_splits);
  // Host splits need S rows; device splits need T. A few rows more show they stay untouched.
  const int64_t rows = (GetParam().device_splits ? c.T : S) + 3;
  HostTensor out(c.dtype, {rows, c.out}), gin(c.dtype, {rows, c.in});
  out.poison();
  gin.poison();
  const size_t es = st::dtype_size(c.dtype);

  const auto lib = mlp.forward(c.x.view(), sp.splits, c.probs.view());
  const auto mine = mlp.forward(c.x.view(), sp.splits, c.probs.view(), out.view());
  EXPECT_EQ(mine.out.view().data(), out.data()) << "the result is the caller's buffer";
  const HostTensor yh = HostTensor::copy_of(lib.out.view());
  for (int64_t i = 0; i < rows * c.out; ++i) {
    if (i < S * c.out)
      ASSERT_EQ(std::memcmp(static_cast<char*>(out.data()) + i * es, static_cast<char*>(yh.data()) + i * es, es), 0)
          << "out element " << i << " differs from the library-allocated result";
    else
      ASSERT_TRUE(std::isnan(out.get(i))) << "out element " << i << " (row >= S) was written";
  }

  const auto g_lib = mlp.backward(c.x.view(), lib.fc1_out.view(), c.probs.view(), c.dy.view(), sp.splits);
  const auto g = mlp.backward(c.x.view(), lib.fc1_out.view(), c.probs.view(), c.dy.view(), sp.splits, gin.view());
  EXPECT_EQ(g.grad_input.view().data(), gin.data());
  const HostTensor dxh = HostTensor::copy_of(g_lib.grad_input.view());
  for (int64_t i = 0; i < rows * c.in; ++i) {
    if (i < S * c.in)
      ASSERT_EQ(std::memcmp(static_cast<char*>(gin.data()) + i * es, static_cast<char*>(dxh.data()) + i * es, es), 0)
          << "grad_input element " << i;
    else
      ASSERT_TRUE(std::isnan(gin.get(i))) << "grad_input element " << i << " (row >= S) was written";
  }
  EXPECT_TRUE(st::testing::bytes_equal(g.dprobs.view(), g_lib.dprobs.view()));
}

std::vector<Param> all_params() {
  std::vector<Param> p;
  for (const Shape& s : kShapes)
    for (bool dev : {false, true}) p.push_back({s, dev});
  return p;
}

INSTANTIATE_TEST_SUITE_P(Reference, GroupedMLPVsOracle, ::testing::ValuesIn(all_params()), param_name_info);

// The oracle's backward is the gradient of its forward: central differences in double of the
// loss sum(dy . y) against dprobs, dx, dW1, db1, dW2 and db2, for halves and interleaved layouts.
TEST(GroupedMLPOracle, BackwardIsTheGradientOfForward) {
  for (int64_t k : {0, 1, 2}) {
    SCOPED_TRACE(::testing::Message() << "k=" << k);
    GroupedMLPCase c = st::testing::random_mlp_case(st::DType::kFP32, 3, 9, 8, 5, 4, 3, k, {1}, false, true, true, 3);
    st::testing::GroupedMLPOracle o = c.oracle();
    const auto b = o.backward(o.forward().fc1_out.value);  // the exact pre-activation
    const double h = 1e-6;
    auto fd = [&](double& v) {
      const double keep = v;
      v = keep + h;
      const double lp = o.loss();
      v = keep - h;
      const double lm = o.loss();
      v = keep;
      return (lp - lm) / (2 * h);
    };
    auto expect_close = [](double numeric, double analytic, const std::string& what) {
      EXPECT_NEAR(numeric, analytic, 1e-6 * (1 + std::fabs(analytic))) << what;
    };
    const int64_t S = o.rows_used();
    for (int64_t t = 0; t < S; ++t) expect_close(fd(o.probs[size_t(t)]), b.dprobs.value[size_t(t)], "dprobs");
    for (int64_t i = 0; i < S * o.in; i += 3) expect_close(fd(o.x[size_t(i)]), b.dx.value[size_t(i)], "dx");
    for (int64_t g : {0, 2}) {
      for (int64_t i = 0; i < 2 * o.F * o.in; i += 2)
        expect_close(fd(o.w1[size_t(g)][size_t(i)]), b.dw1[size_t(g)].value[size_t(i)], "dW1");
      for (int64_t i = 0; i < 2 * o.F; ++i)
        expect_close(fd(o.b1[size_t(g)][size_t(i)]), b.db1[size_t(g)].value[size_t(i)], "db1");
      for (int64_t i = 0; i < o.out * o.F; ++i)
        expect_close(fd(o.w2[size_t(g)][size_t(i)]), b.dw2[size_t(g)].value[size_t(i)], "dW2");
      for (int64_t i = 0; i < o.out; ++i)
        expect_close(fd(o.b2[size_t(g)][size_t(i)]), b.db2[size_t(g)].value[size_t(i)], "db2");
    }
  }
}

// The interleaved layout, spelled out for F = 4, k = 2: columns 0-1 are a_0, a_1, 2-3 are b_0,
// b_1, 4-5 a_2, a_3, 6-7 b_2, b_3. With b = 1 everywhere but one column, only the matching h
// column changes.
TEST(GroupedMLPOracle, InterleavedColumnsFollowTheDefinition) {
  GroupedMLPCase c = st::testing::random_mlp_case(st::DType::kFP32, 1, 1, 1, 1, 4, 1, 2, {}, false, false, false, 1);
  const st::testing::GroupedMLPOracle o = c.oracle();
  const int64_t expect_a[4] = {0, 1, 4, 5}, expect_b[4] = {2, 3, 6, 7};
  for (int64_t j = 0; j < 4; ++j) {
    EXPECT_EQ(o.column_of(true, j), expect_a[j]);
    EXPECT_EQ(o.column_of(false, j), expect_b[j]);
  }
}

// GroupedLinear on the CPU reference vs the double-precision oracle, on fresh random data and odd
// shapes (prime sizes, G = 1 and 128, empty experts, T > S), with host and device splits; plus
// bitwise determinism and caller buffers (written in place, tails untouched, bit-identical to the
// library-allocated path, whose tails are zero).
#include <gtest/gtest.h>

#include "grouped_linear_case.h"

namespace st = sparsetrain;
using st::testing::GroupedLinearCase;
using st::testing::HostTensor;

using st::testing::SplitsHolder;

namespace {

struct Shape {
  st::DType dtype;
  int64_t G, T, S, in, out;
  std::vector<int64_t> empty;
  bool packed, bias;
};

const Shape kShapes[] = {
    {st::DType::kBF16, 8, 257, 250, 64, 96, {2, 5}, false, false},
    {st::DType::kFP16, 1, 131, 131, 37, 53, {}, true, true},
    {st::DType::kFP32, 128, 509, 500, 16, 24, {5}, false, true},
    {st::DType::kBF16, 5, 97, 89, 128, 130, {0, 1, 3, 4}, true, false},  // all rows in one expert
    {st::DType::kFP16, 7, 61, 61, 3, 5, {6}, false, true},
    {st::DType::kBF16, 3, 0, 0, 8, 8, {0, 1, 2}, false, true},            // no rows at all
    {st::DType::kFP32, 2, 40, 0, 9, 7, {0, 1}, true, true},                // only a padded tail
};

struct Param {
  Shape shape;
  bool device_splits;
};

std::string param_name(const Param& p) {
  const Shape& s = p.shape;
  std::string n = std::string(st::dtype_name(s.dtype)) + "_G" + std::to_string(s.G) + "_T" + std::to_string(s.T) +
                  "_S" + std::to_string(s.S) + "_in" + std::to_string(s.in) + "_out" + std::to_string(s.out) +
                  "_empty" + std::to_string(s.empty.size()) + (s.packed ? "_packed" : "") + (s.bias ? "_bias" : "");
  return n + (p.device_splits ? "_devicesplits" : "_hostsplits");
}

std::string param_name_info(const ::testing::TestParamInfo<Param>& info) { return param_name(info.param); }
void PrintTo(const Param& p, std::ostream* os) { *os << param_name(p); }

class GroupedLinearVsOracle : public ::testing::TestWithParam<Param> {
 protected:
  GroupedLinearCase make_case() const {
    const Shape& s = GetParam().shape;
    return st::testing::random_case(s.dtype, s.G, s.T, s.S, s.in, s.out, s.empty, s.packed, s.bias, 11);
  }
};


void expect_rows_zero(const st::TensorView& t, int64_t from_row, const char* what) {
  const HostTensor h = HostTensor::copy_of(t);
  for (int64_t i = from_row * t.size(1); i < t.numel(); ++i)
    ASSERT_EQ(h.get(i), 0.0) << what << ": padded tail element " << i << " not zero";
}

void expect_ok(const st::testing::CompareResult& r) { EXPECT_TRUE(r.ok) << r.first_failure; }

}  // namespace

TEST_P(GroupedLinearVsOracle, ForwardBackwardMatchTheOracle) {
  GroupedLinearCase c = make_case();
  const int64_t S = c.oracle().rows_used();
  st::testing::PoisonAllocator alloc;  // every library allocation starts as NaN
  st::GroupedLinear layer(c.options(), c.params(), &alloc);
  SplitsHolder sp(c.splits, GetParam().device_splits);
  const auto oracle = c.oracle();

  st::Tensor y = layer.forward(c.x.view(), sp.splits);
  ASSERT_EQ(y.view().size(0), c.T);
  ASSERT_EQ(y.view().size(1), c.out);
  expect_ok(st::testing::compare_with_oracle(HostTensor::copy_of(y.view()), oracle.forward(), c.dtype, 1, "y"));
  expect_rows_zero(y.view(), S, "y");

  st::GroupedLinearGrads grads = layer.backward(c.x.view(), c.dy.view(), sp.splits);
  expect_ok(st::testing::compare_with_oracle(HostTensor::copy_of(grads.grad_input.view()), oracle.dgrad(),
                                             c.dtype, 1, "dx"));
  expect_rows_zero(grads.grad_input.view(), S, "dx");
  ASSERT_EQ(grads.weight.kind, st::WeightGradKind::kWgrad);
  ASSERT_EQ(int64_t(grads.weight.per_group.size()), c.G);
  for (int64_t g = 0; g < c.G; ++g) {
    const st::TensorView dw = grads.weight.per_group[size_t(g)].view();
    EXPECT_EQ(reinterpret_cast<uintptr_t>(dw.data()) % 256, 0u) << "group " << g;
    expect_ok(st::testing::compare_with_oracle(HostTensor::copy_of(dw), oracle.wgrad(g), c.dtype, 1,
                                               "dW[" + std::to_string(g) + "]"));
    if (c.bias)
      expect_ok(st::testing::compare_with_oracle(HostTensor::copy_of(grads.bias_grad.view().select(g)),
                                                 oracle.bias_grad(g), c.dtype, 1, "db[" + std::to_string(g) + "]"));
  }
  EXPECT_EQ(grads.bias_grad.defined(), c.bias);
  if (GetParam().device_splits) {
    EXPECT_EQ(sp.status.get(0), 0.0) << "valid splits leave the status clear";
  }
}

TEST_P(GroupedLinearVsOracle, RepeatedRunsAreBitwiseIdentical) {
  GroupedLinearCase c = make_case();
  st::GroupedLinear layer(c.options(), c.params());
  SplitsHolder sp(c.splits, GetParam().device_splits);
  const st::Tensor y1 = layer.forward(c.x.view(), sp.splits), y2 = layer.forward(c.x.view(), sp.splits);
  EXPECT_TRUE(st::testing::bytes_equal(y1.view(), y2.view()));
  const auto g1 = layer.backward(c.x.view(), c.dy.view(), sp.splits);
  const auto g2 = layer.backward(c.x.view(), c.dy.view(), sp.splits);
  EXPECT_TRUE(st::testing::bytes_equal(g1.grad_input.view(), g2.grad_input.view()));
  for (int64_t g = 0; g < c.G; ++g)
    EXPECT_TRUE(HostTensor::copy_of(g1.weight.per_group[size_t(g)].view())
                    .bytes_equal(HostTensor::copy_of(g2.weight.per_group[size_t(g)].view())));
  if (c.bias) {
    EXPECT_TRUE(st::testing::bytes_equal(g1.bias_grad.view(), g2.bias_grad.view()));
  }
}

TEST_P(GroupedLinearVsOracle, CallerBuffersAreWrittenInPlaceWithTailsUntouched) {
  GroupedLinearCase c = make_case();
  const int64_t S = c.oracle().rows_used();
  st::GroupedLinear layer(c.options(), c.params());
  SplitsHolder sp(c.splits, GetParam().device_splits);
  // Host splits need S rows; device splits need T. Give a few rows more to see they stay untouched.
  const int64_t rows = (GetParam().device_splits ? c.T : S) + 3;
  HostTensor out(c.dtype, {rows, c.out}), gin(c.dtype, {rows, c.in});
  out.poison();
  gin.poison();
  const st::Tensor y_lib = layer.forward(c.x.view(), sp.splits);
  const st::Tensor y = layer.forward(c.x.view(), sp.splits, out.view());
  EXPECT_EQ(y.view().data(), out.data()) << "the result is the caller's buffer";
  const HostTensor yh = HostTensor::copy_of(y_lib.view());
  for (int64_t i = 0; i < rows * c.out; ++i) {
    if (i < S * c.out) {
      ASSERT_EQ(std::memcmp(static_cast<char*>(out.data()) + i * st::dtype_size(c.dtype),
                            static_cast<char*>(yh.data()) + i * st::dtype_size(c.dtype), st::dtype_size(c.dtype)), 0)
          << "out element " << i << " differs from the library-allocated result";
    } else {
      ASSERT_TRUE(std::isnan(out.get(i))) << "out element " << i << " (row >= S) was written";
    }
  }
  const auto g_lib = layer.backward(c.x.view(), c.dy.view(), sp.splits);
  const auto g = layer.backward(c.x.view(), c.dy.view(), sp.splits, gin.view());
  EXPECT_EQ(g.grad_input.view().data(), gin.data());
  const HostTensor dxh = HostTensor::copy_of(g_lib.grad_input.view());
  for (int64_t i = 0; i < rows * c.in; ++i) {
    if (i < S * c.in)
      ASSERT_EQ(std::memcmp(static_cast<char*>(gin.data()) + i * st::dtype_size(c.dtype),
                            static_cast<char*>(dxh.data()) + i * st::dtype_size(c.dtype), st::dtype_size(c.dtype)), 0)
          << "grad_input element " << i;
    else
      ASSERT_TRUE(std::isnan(gin.get(i))) << "grad_input element " << i << " (row >= S) was written";
  }
}

std::vector<Param> all_params() {
  std::vector<Param> p;
  for (const Shape& s : kShapes)
    for (bool dev : {false, true}) p.push_back({s, dev});
  return p;
}

INSTANTIATE_TEST_SUITE_P(Reference, GroupedLinearVsOracle, ::testing::ValuesIn(all_params()), param_name_info);

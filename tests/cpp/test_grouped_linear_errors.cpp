// Bad input to GroupedLinear: each case raises sparsetrain::Error whose message names the argument,
// the expectation and what came, and leaves every output as it was (caller buffers, main_grad,
// the delayed-wgrad queue) without allocating anything.
#include <gtest/gtest.h>

#include <functional>

#include "grouped_linear_case.h"
#include "sparsetrain/error.h"

namespace st = sparsetrain;
using st::testing::GroupedLinearCase;
using st::testing::HostTensor;

namespace {

// A fused, biased layer with caller buffers, all poisoned/randomised so any write shows. With
// `delay` the layer delays its wgrad (the queue a refused call must leave as it was).
struct Env {
  GroupedLinearCase c;
  st::testing::PoisonAllocator alloc;
  std::unique_ptr<st::GroupedLinear> layer;
  HostTensor out, gin, dsplits, bad_dtype_x;

  explicit Env(bool delay = false) {
    c.dtype = st::DType::kBF16;
    c.G = 4;
    c.T = 23;
    c.in = 6;
    c.out = 5;
    c.splits = {7, 0, 11, 2};  // S = 20
    c.bias = true;
    c.fuse = true;
    c.delay = delay;
    c.make();
    layer = std::make_unique<st::GroupedLinear>(c.options(), c.params(), &alloc);
    out = HostTensor(c.dtype, {c.T, c.out});
    gin = HostTensor(c.dtype, {c.T, c.in});
    out.poison();
    gin.poison();
    dsplits = HostTensor(st::DType::kInt64, {c.G});
    for (int64_t g = 0; g < c.G; ++g) dsplits.set(g, double(c.splits[size_t(g)]));
  }
  st::Splits host() const { return st::Splits::host(c.splits); }
  // A view of `t` with its shape/strides replaced.
  static st::TensorView reshape(const HostTensor& t, std::initializer_list<int64_t> shape,
                                std::initializer_list<int64_t> strides, st::DType dtype) {
    return st::TensorView(t.data(), dtype, shape.begin(), strides.begin(), int(shape.size()));
  }
};

struct CallCase {
  const char* name;
  std::function<void(Env&)> call;
  const char* expected_message;
};

const CallCase kCallCases[] = {
    {"SplitsWrongLength", [](Env& e) { e.layer->forward(e.c.x.view(), st::Splits::host({7, 0, 11}), e.out.view()); },
     "splits: expected shape [4] (num_groups), got [3]"},
    {"SplitsNegative", [](Env& e) { e.layer->forward(e.c.x.view(), st::Splits::host({7, -1, 11, 2}), e.out.view()); },
     "splits: expected entries >= 0, got -1 at index 1"},
    {"SplitsSumAboveT", [](Env& e) { e.layer->backward(e.c.x.view(), e.c.dy.view(), st::Splits::host({7, 0, 11, 6}), e.gin.view()); },
     "splits: expected a sum <= 23 (the rows of x), got a sum of at least 24 at index 3"},
    {"SplitsMissing", [](Env& e) { e.layer->forward(e.c.x.view(), st::Splits(), e.out.view()); },
     "splits: expected host or device splits of shape [4], got none"},
    {"DeviceSplitsWrongShape",
     [](Env& e) { e.layer->forward(e.c.x.view(), st::Splits::device(Env::reshape(e.dsplits, {3}, {1}, st::DType::kInt64)), e.out.view()); },
     "splits: expected shape [4] (num_groups), got [3]"},
    {"DeviceSplitsInt32",
     [](Env& e) { e.layer->forward(e.c.x.view(), st::Splits::device(Env::reshape(e.dsplits, {4}, {1}, st::DType::kInt32)), e.out.view()); },
     "splits: expected dtype int64 (device splits), got int32"},
    {"DeviceSplitsBadStatus",
     [](Env& e) {
       e.layer->forward(e.c.x.view(), st::Splits::device(e.dsplits.view(), Env::reshape(e.dsplits, {1}, {1}, st::DType::kInt64)),
                        e.out.view());
     },
     "splits status: expected dtype int32, got int64"},
    {"XWrongWidth", [](Env& e) { e.layer->forward(Env::reshape(e.c.x, {23, 5}, {5, 1}, st::DType::kBF16), e.host(), e.out.view()); },
     "x: expected shape [T, 6 (in_features)], got [23, 5]"},
    {"XWrongDtype", [](Env& e) { e.layer->forward(Env::reshape(e.c.x, {23, 6}, {6, 1}, st::DType::kFP16), e.host(), e.out.view()); },
     "x: expected dtype bf16 (the layer's dtype), got fp16"},
    {"XNull",
     [](Env& e) { e.layer->forward(st::TensorView(nullptr, st::DType::kBF16, {23, 6}), e.host(), e.out.view()); },
     "x: expected non-null data, got a null pointer for bf16[23, 6] on cpu"},
    {"XOnCuda",
     [](Env& e) { e.layer->forward(st::TensorView(e.c.x.data(), st::DType::kBF16, {23, 6}, st::Device::cuda(0)), e.host(), e.out.view()); },
     "x: expected a tensor on cpu (the layer's device), got cuda:0"},
    {"XColumnStrided", [](Env& e) { e.layer->forward(Env::reshape(e.c.x, {11, 6}, {12, 2}, st::DType::kBF16), st::Splits::host({1, 1, 1, 1}), e.out.view()); },
     "x: expected a unit stride in the last dimension "
     "(taken: any strides with the last dimension contiguous, as in a contiguous tensor or a slice of one; a transposed tensor is not, pass x.contiguous()), got 2"},
    {"DyWrongRows", [](Env& e) { e.layer->backward(e.c.x.view(), Env::reshape(e.c.dy, {22, 5}, {5, 1}, st::DType::kBF16), e.host(), e.gin.view()); },
     "dy: expected shape [23 (the rows of x), 5 (out_features)], got [22, 5]"},
    {"OutFewerRowsThanS", [](Env& e) { e.layer->forward(e.c.x.view(), e.host(), Env::reshape(e.out, {19, 5}, {5, 1}, st::DType::kBF16)); },
     "out: expected shape [>= 20 (S: host splits), 5], got [19, 5]"},
    {"OutFewerRowsThanTWithDeviceSplits",
     [](Env& e) { e.layer->forward(e.c.x.view(), st::Splits::device(e.dsplits.view()), Env::reshape(e.out, {22, 5}, {5, 1}, st::DType::kBF16)); },
     "out: expected shape [>= 23 (T: device splits), 5], got [22, 5]"},
    {"OutNotContiguousEnoughRows",
     [](Env& e) { e.layer->forward(e.c.x.view(), st::Splits::host({1, 1, 1, 1}), Env::reshape(e.out, {11, 5}, {10, 1}, st::DType::kBF16)); },
     "out: expected a contiguous tensor, got strides [10, 1] for shape [11, 5]"},
    {"OutWrongDtype", [](Env& e) { e.layer->forward(e.c.x.view(), e.host(), Env::reshape(e.out, {23, 5}, {5, 1}, st::DType::kFP16)); },
     "out: expected dtype bf16 (the layer's dtype), got fp16"},
    {"OutOnCuda",
     [](Env& e) { e.layer->forward(e.c.x.view(), e.host(), st::TensorView(e.out.data(), st::DType::kBF16, {23, 5}, st::Device::cuda(0))); },
     "out: expected a tensor on cpu (the layer's device), got cuda:0"},
    {"GradInputWrongDtype",
     [](Env& e) { e.layer->backward(e.c.x.view(), e.c.dy.view(), e.host(), Env::reshape(e.gin, {23, 6}, {6, 1}, st::DType::kFP16)); },
     "grad_input: expected dtype bf16 (the layer's dtype), got fp16"},
    {"GradInputOnCuda",
     [](Env& e) {
       e.layer->backward(e.c.x.view(), e.c.dy.view(), e.host(), st::TensorView(e.gin.data(), st::DType::kBF16, {23, 6}, st::Device::cuda(0)));
     },
     "grad_input: expected a tensor on cpu (the layer's device), got cuda:0"},
    {"DyWrongDtype",
     [](Env& e) { e.layer->backward(e.c.x.view(), Env::reshape(e.c.dy, {23, 5}, {5, 1}, st::DType::kFP16), e.host(), e.gin.view()); },
     "dy: expected dtype bf16 (the layer's dtype), got fp16"},
    {"DyOnCuda",
     [](Env& e) { e.layer->backward(e.c.x.view(), st::TensorView(e.c.dy.data(), st::DType::kBF16, {23, 5}, st::Device::cuda(0)), e.host(), e.gin.view()); },
     "dy: expected a tensor on cpu (the layer's device), got cuda:0"},
    {"OutWrongWidth", [](Env& e) { e.layer->forward(e.c.x.view(), e.host(), Env::reshape(e.out, {23, 4}, {4, 1}, st::DType::kBF16)); },
     "out: expected shape [>= 20 (S: host splits), 5], got [23, 4]"},
    {"GradInputTooSmall",
     [](Env& e) { e.layer->backward(e.c.x.view(), e.c.dy.view(), st::Splits::device(e.dsplits.view()), Env::reshape(e.gin, {20, 6}, {6, 1}, st::DType::kBF16)); },
     "grad_input: expected shape [>= 23 (T: device splits), 6], got [20, 6]"},
    {"GradInputNotContiguous",
     [](Env& e) { e.layer->backward(e.c.x.view(), e.c.dy.view(), st::Splits::host({1, 1, 1, 1}), Env::reshape(e.gin, {5, 6}, {12, 1}, st::DType::kBF16)); },
     "grad_input: expected a contiguous tensor, got strides [12, 1] for shape [5, 6]"},
    {"WorkspaceTooSmall",
     [](Env& e) {
       st::CallArgs a;
       a.workspace = {e.out.data(), 16};  // out is checked for writes after the call
       e.layer->backward(e.c.x.view(), e.c.dy.view(), e.host(), st::TensorView(), a);
     },
     "workspace: expected >= "},
};

void PrintTo(const CallCase& c, std::ostream* os) { *os << c.name; }

class GroupedLinearBadCall : public ::testing::TestWithParam<CallCase> {};

TEST_P(GroupedLinearBadCall, RaisesAClearErrorAndWritesNothing) {
  Env e;
  const HostTensor out0 = HostTensor::copy_of(e.out.view()), gin0 = HostTensor::copy_of(e.gin.view());
  const HostTensor mg0 = HostTensor::copy_of(e.c.main_grad.view());
  try {
    GetParam().call(e);
    FAIL() << "expected sparsetrain::Error containing: " << GetParam().expected_message;
  } catch (const st::Error& err) {
    EXPECT_NE(std::string(err.what()).find(GetParam().expected_message), std::string::npos)
        << "message: " << err.what() << "\nexpected to contain: " << GetParam().expected_message;
    EXPECT_EQ(err.kind(), st::Error::Kind::kInvalidArgument);
  }
  EXPECT_TRUE(e.out.bytes_equal(out0)) << "out was written";
  EXPECT_TRUE(e.gin.bytes_equal(gin0)) << "grad_input was written";
  EXPECT_TRUE(e.c.main_grad.bytes_equal(mg0)) << "main_grad was written";
  EXPECT_EQ(e.alloc.allocations, 0) << "memory was allocated before validation passed";
  EXPECT_EQ(e.layer->pending_wgrads(), 0u);
}

// The same refusals by a layer with delayed wgrad and one backward already pending: the queue
// must be exactly as it was. Checked by what it produces, not by its length alone: a later good
// backward and two backward_dw calls give main_grad and bias grads bit-identical to a fresh layer
// that saw only the two good backwards (a refused call that queued, or popped, shows).
TEST_P(GroupedLinearBadCall, LeavesTheDelayedWgradQueueAsItWas) {
  const st::Splits second = st::Splits::host({3, 9, 0, 8});
  auto good_steps = [&](Env& e, const std::function<void()>& between) {
    e.layer->backward(e.c.x.view(), e.c.dy.view(), e.host());
    between();
    EXPECT_EQ(e.layer->pending_wgrads(), 1u);
    e.layer->backward(e.c.x.view(), e.c.dy.view(), second);
    std::vector<HostTensor> bias_grads;
    for (int i = 0; i < 2; ++i) bias_grads.push_back(HostTensor::copy_of(e.layer->backward_dw().bias_grad.view()));
    EXPECT_EQ(e.layer->pending_wgrads(), 0u);
    return bias_grads;
  };
  Env refused(/*delay=*/true), fresh(/*delay=*/true);
  const auto got = good_steps(refused, [&] { EXPECT_THROW(GetParam().call(refused), st::Error); });
  const auto want = good_steps(fresh, [] {});
  EXPECT_TRUE(refused.c.main_grad.bytes_equal(fresh.c.main_grad)) << "main_grad differs from a fresh layer's";
  for (size_t i = 0; i < want.size(); ++i)
    EXPECT_TRUE(got[i].bytes_equal(want[i])) << "bias grad of backward_dw " << i << " differs from a fresh layer's";
}

INSTANTIATE_TEST_SUITE_P(Calls, GroupedLinearBadCall, ::testing::ValuesIn(kCallCases),
                         [](const ::testing::TestParamInfo<CallCase>& i) { return std::string(i.param.name); });

// Bad layer configuration or parameters are rejected when the layer is built.
struct ConfigCase {
  const char* name;
  std::function<void(GroupedLinearCase&, st::GroupedLinearOptions&, st::GroupedLinearParams&)> mutate;
  const char* expected_message;
};

const ConfigCase kConfigCases[] = {
    {"NumGroupsZero", [](auto&, auto& o, auto&) { o.num_groups = 0; }, "num_groups: expected >= 1, got 0"},
    {"DtypeInt32", [](auto&, auto& o, auto&) { o.dtype = st::DType::kInt32; }, "dtype: expected bf16, fp16 or fp32, got int32"},
    {"OverwriteWithoutFusion", [](auto&, auto& o, auto&) { o.fuse_wgrad_accumulation = false, o.overwrite_main_grad = true; },
     "overwrite_main_grad: expected false unless fuse_wgrad_accumulation is true"},
    {"WeightMissing", [](auto&, auto&, auto& p) { p.weight = st::GroupedParam(); }, "weight: expected per-group or packed tensors, got none"},
    {"WeightCountMismatch",
     [](auto& c, auto&, auto& p) { p.weight = st::GroupedParam::per_group({c.w.view().select(0), c.w.view().select(1), c.w.view().select(2)}); },
     "weight: expected 4 per-group tensors (num_groups), got 3"},
    {"PackedWeightWrongGroups",
     [](auto& c, auto&, auto& p) { p.weight = st::GroupedParam::packed(st::TensorView(c.w.data(), st::DType::kBF16, {3, 5, 6})); },
     "weight: expected packed shape [4 (num_groups), 5, 6], got [3, 5, 6]"},
    {"WeightWrongDtype",
     [](auto& c, auto&, auto& p) { p.weight = st::GroupedParam::packed(st::TensorView(c.w.data(), st::DType::kFP16, {4, 5, 6})); },
     "weight: expected dtype bf16, got fp16"},
    {"WeightTransposed",
     [](auto& c, auto&, auto& p) {
       auto v = p.weight.views();
       v[2] = st::TensorView(c.w.data(), st::DType::kBF16, {6, 5});
       p.weight = st::GroupedParam::per_group(v);
     },
     "weight[2]: expected shape [5, 6], got [6, 5]"},
    {"WeightNull",
     [](auto&, auto&, auto& p) {
       auto v = p.weight.views();
       v[1] = st::TensorView(nullptr, st::DType::kBF16, {5, 6});
       p.weight = st::GroupedParam::per_group(v);
     },
     "weight[1]: expected non-null data"},
    {"BiasWrongShape",
     [](auto& c, auto&, auto& p) { p.bias = st::GroupedParam::packed(st::TensorView(c.b.data(), st::DType::kBF16, {4, 4})); },
     "bias: expected packed shape [4 (num_groups), 5], got [4, 4]"},
    {"BiasWrongDtype",
     [](auto& c, auto&, auto& p) { p.bias = st::GroupedParam::packed(st::TensorView(c.b.data(), st::DType::kFP16, {4, 5})); },
     "bias: expected dtype bf16, got fp16"},
    {"BiasOnCuda",
     [](auto& c, auto&, auto& p) { p.bias = st::GroupedParam::packed(st::TensorView(c.b.data(), st::DType::kBF16, {4, 5}, st::Device::cuda(0))); },
     "bias: expected a tensor on cpu"},
    {"MainGradOnCuda",
     [](auto& c, auto&, auto& p) {
       p.main_grad = st::GroupedParam::packed(st::TensorView(c.main_grad.data(), st::DType::kFP32, {4, 5, 6}, st::Device::cuda(0)));
     },
     "main_grad: expected a tensor on cpu"},
    {"MainGradMissing", [](auto&, auto&, auto& p) { p.main_grad = st::GroupedParam(); },
     "main_grad: expected fp32 per-group or packed tensors (fuse_wgrad_accumulation is true), got none"},
    {"MainGradBf16",
     [](auto& c, auto&, auto& p) { p.main_grad = st::GroupedParam::packed(st::TensorView(c.main_grad.data(), st::DType::kBF16, {4, 5, 6})); },
     "main_grad: expected dtype fp32, got bf16"},
    {"MainGradWrongShape",
     [](auto& c, auto&, auto& p) {
       auto v = p.main_grad.views();
       v[3] = st::TensorView(c.main_grad.data(), st::DType::kFP32, {6, 5});
       p.main_grad = st::GroupedParam::per_group(v);
     },
     "main_grad[3]: expected shape [5, 6], got [6, 5]"},
    {"MainGradOverlappingGroups",
     [](auto& c, auto&, auto& p) {
       const int64_t shape[3] = {4, 5, 6}, strides[3] = {6, 6, 1};
       p.main_grad = st::GroupedParam::packed(st::TensorView(c.main_grad.data(), st::DType::kFP32, shape, strides, 3));
     },
     "main_grad: expected non-overlapping groups (stride of dim 0 >= 30), got 6"},
};

void PrintTo(const ConfigCase& c, std::ostream* os) { *os << c.name; }

class GroupedLinearBadConfig : public ::testing::TestWithParam<ConfigCase> {};

TEST_P(GroupedLinearBadConfig, IsRejectedWithAClearError) {
  GroupedLinearCase c;
  c.G = 4;
  c.T = 8;
  c.in = 6;
  c.out = 5;
  c.splits = {2, 2, 2, 2};
  c.bias = true;
  c.fuse = true;
  c.make();
  st::GroupedLinearOptions o = c.options();
  st::GroupedLinearParams p = c.params();
  GetParam().mutate(c, o, p);
  try {
    st::GroupedLinear layer(o, p);
    FAIL() << "expected sparsetrain::Error containing: " << GetParam().expected_message;
  } catch (const st::Error& err) {
    EXPECT_NE(std::string(err.what()).find(GetParam().expected_message), std::string::npos)
        << "message: " << err.what() << "\nexpected to contain: " << GetParam().expected_message;
  }
}

INSTANTIATE_TEST_SUITE_P(Config, GroupedLinearBadConfig, ::testing::ValuesIn(kConfigCases),
                         [](const ::testing::TestParamInfo<ConfigCase>& i) { return std::string(i.param.name); });

}  // namespace

// GroupedLinear's contract beyond the arithmetic (docs/DESIGN.md section 4): wgrad views on 256-byte
// boundaries, fused main_grad accumulation / overwrite with empty experts, the six rows of the
// weight-grad table through a real layer, delayed wgrad first-in-first-out, invalid device splits
// (empty problems + sticky status, or an Error in checked mode), caller workspace, host splits
// from a tensor.
#include <gtest/gtest.h>

#include <cmath>

#include "grouped_linear_case.h"
#include "sparsetrain/error.h"

namespace st = sparsetrain;
using st::testing::GroupedLinearCase;
using st::testing::HostTensor;
using K = st::WeightGradKind;

namespace {

GroupedLinearCase small_case(st::DType dtype, int64_t in = 6, int64_t out = 5) {
  GroupedLinearCase c;
  c.dtype = dtype;
  c.G = 4;
  c.T = 23;
  c.in = in;
  c.out = out;
  c.splits = {7, 0, 11, 2};  // S = 20 < T, group 1 empty
  c.bias = true;
  c.make();
  return c;
}

void expect_ok(const st::testing::CompareResult& r) { EXPECT_TRUE(r.ok) << r.first_failure; }

bool all_zero(const st::TensorView& v) {
  const HostTensor h = HostTensor::copy_of(v);
  for (int64_t i = 0; i < h.numel(); ++i)
    if (h.get(i) != 0.0 || std::signbit(h.get(i))) return false;
  return true;
}

std::string expect_error(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const st::Error& e) {
    return e.what();
  }
  ADD_FAILURE() << "expected sparsetrain::Error";
  return "";
}

}  // namespace

// out*in*sizeof(dtype) = 3*5*4 = 60 (fp32) and 30 (bf16) bytes: the per-group stride must be padded.
TEST(GroupedLinearContract, WgradViewsStartOn256ByteBoundariesWithPaddedStride) {
  for (st::DType dt : {st::DType::kFP32, st::DType::kBF16}) {
    GroupedLinearCase c = small_case(dt, /*in=*/5, /*out=*/3);
    st::GroupedLinear layer(c.options(), c.params());
    const auto grads = layer.backward(c.x.view(), c.dy.view(), st::Splits::host(c.splits));
    ASSERT_EQ(grads.weight.kind, K::kWgrad);
    const st::TensorView packed = grads.weight.packed.view();
    EXPECT_EQ(packed.dim(), 3);
    EXPECT_EQ(packed.stride(0) * int64_t(st::dtype_size(dt)), 256) << st::dtype_name(dt);
    const auto oracle = c.oracle();
    for (int64_t g = 0; g < c.G; ++g) {
      const st::TensorView v = grads.weight.per_group[size_t(g)].view();
      EXPECT_EQ(reinterpret_cast<uintptr_t>(v.data()) % 256, 0u) << st::dtype_name(dt) << " group " << g;
      EXPECT_EQ(v.data(), packed.select(g).data());
      EXPECT_TRUE(v.is_contiguous());
      expect_ok(st::testing::compare_with_oracle(HostTensor::copy_of(v), oracle.wgrad(g), dt, 1, "dW"));
    }
    EXPECT_TRUE(all_zero(grads.weight.per_group[1].view())) << "an expert with no rows has dW = 0";
    EXPECT_TRUE(all_zero(grads.bias_grad.view().select(1))) << "and db = 0";
  }
}

class MainGradFusion : public ::testing::TestWithParam<std::tuple<bool, bool>> {};  // overwrite, packed

TEST_P(MainGradFusion, WritesMainGradInOnePassAndHandlesTheEmptyExpert) {
  const auto [overwrite, packed] = GetParam();
  GroupedLinearCase c = small_case(st::DType::kBF16);
  c.fuse = true;
  c.overwrite = overwrite;
  c.packed_main_grad = packed;
  // The empty expert's main_grad holds a -0.0: "untouched" means bit for bit.
  c.main_grad.set(1 * c.out * c.in + 3, -0.0);
  const HostTensor before = HostTensor::copy_of(c.main_grad.view());
  st::testing::PoisonAllocator alloc;
  st::GroupedLinear layer(c.options(), c.params(), &alloc);
  const auto grads = layer.backward(c.x.view(), c.dy.view(), st::Splits::host(c.splits));
  EXPECT_EQ(grads.weight.kind, K::kNone);
  EXPECT_TRUE(grads.bias_grad.defined()) << "bias grads are never fused into main_grad";
  const auto oracle = c.oracle();
  for (int64_t g = 0; g < c.G; ++g) {
    const st::TensorView mg = c.main_grad.view().select(g);
    const std::vector<double> base = HostTensor::copy_of(before.view().select(g)).to_double();
    if (c.splits[size_t(g)] == 0) {
      if (overwrite) {
        EXPECT_TRUE(all_zero(mg)) << "overwrite zeroes an empty expert's main_grad";
      } else {
        EXPECT_TRUE(HostTensor::copy_of(mg).bytes_equal(HostTensor::copy_of(before.view().select(g))))
            << "accumulation leaves an empty expert's main_grad untouched";
      }
      continue;
    }
    expect_ok(st::testing::compare_with_oracle(HostTensor::copy_of(mg), oracle.wgrad(g, overwrite ? nullptr : &base),
                                               st::DType::kFP32, 2, "main_grad"));
  }
}

INSTANTIATE_TEST_SUITE_P(Modes, MainGradFusion,
                         ::testing::Combine(::testing::Bool(), ::testing::Bool()),
                         [](const auto& param_info) {
                           return std::string(std::get<0>(param_info.param) ? "overwrite" : "accumulate") +
                                  (std::get<1>(param_info.param) ? "_packed" : "_per_expert");
                         });

// docs/DESIGN.md section 4's table, through real backward / backward_dw calls with a bias.
TEST(GroupedLinearContract, TheSixRowsOfTheWeightGradTable) {
  struct Row { bool delay, fuse, attr; K weight; bool bias_now; };
  const Row rows[] = {
      {false, false, false, K::kWgrad, true},  {true, false, false, K::kNone, false},
      {false, true, false, K::kNone, true},    {false, true, true, K::kDummy, true},
      {true, true, false, K::kNone, false},    {true, true, true, K::kDummy, false},
  };
  for (bool packed_weight : {false, true}) {
    for (const Row& r : rows) {
      SCOPED_TRACE(::testing::Message() << "delay=" << r.delay << " fuse=" << r.fuse << " attr=" << r.attr
                                        << " packed_weight=" << packed_weight);
      GroupedLinearCase c = small_case(st::DType::kBF16);
      c.delay = r.delay;
      c.fuse = r.fuse;
      c.has_attr = r.attr;
      c.packed_weight = packed_weight;
      const HostTensor mg_before = HostTensor::copy_of(c.main_grad.view());
      st::GroupedLinear layer(c.options(), c.params());
      const st::Splits sp = st::Splits::host(c.splits);
      const auto g1 = layer.backward(c.x.view(), c.dy.view(), sp);
      EXPECT_EQ(g1.weight.kind, r.weight);
      EXPECT_EQ(g1.bias_grad.defined(), r.bias_now);
      EXPECT_EQ(g1.weight.grad_added_to_main_grad, r.weight == K::kDummy);
      EXPECT_EQ(layer.pending_wgrads(), r.delay ? 1u : 0u);
      // Fused without delay: main_grad already holds the accumulation after backward.
      const bool mg_changed = !HostTensor::copy_of(c.main_grad.view()).bytes_equal(mg_before);
      EXPECT_EQ(mg_changed, r.fuse && !r.delay);
      if (r.weight == K::kDummy) {
        ASSERT_EQ(int64_t(g1.weight.per_group.size()), c.G);
        for (const st::Tensor& d : g1.weight.per_group) {
          EXPECT_EQ(d.view().size(0), c.out);
          EXPECT_EQ(d.view().size(1), c.in);
          EXPECT_EQ(d.view().dtype(), c.dtype);
          EXPECT_TRUE(all_zero(d.view()));
          const char* mg_lo = static_cast<const char*>(c.main_grad.data());
          const char* p = static_cast<const char*>(d.view().data());
          EXPECT_TRUE(p < mg_lo || p >= mg_lo + c.main_grad.numel() * 4) << "the dummy never aliases main_grad";
        }
        if (packed_weight) {
          EXPECT_EQ(g1.weight.packed.view().size(0), c.G);
        }
        // Cached and reused across steps.
        const auto again = layer.backward(c.x.view(), c.dy.view(), sp);
        EXPECT_EQ(again.weight.per_group[0].view().data(), g1.weight.per_group[0].view().data());
        if (r.delay) layer.backward_dw();
        // A new zero tensor where the caller asks for one; the cached one stays as it was.
        st::CallArgs fresh;
        fresh.cache_dummy_wgrad = false;
        const auto renewed = layer.backward(c.x.view(), c.dy.view(), sp, {}, fresh);
        ASSERT_EQ(renewed.weight.kind, K::kDummy);
        ASSERT_EQ(int64_t(renewed.weight.per_group.size()), c.G);
        EXPECT_NE(renewed.weight.per_group[0].view().data(), g1.weight.per_group[0].view().data());
        EXPECT_TRUE(renewed.weight.per_group[0].owns_storage());
        EXPECT_TRUE(all_zero(renewed.weight.per_group[c.G - 1].view()));
        EXPECT_EQ(renewed.weight.packed.defined(), packed_weight);
        EXPECT_TRUE(all_zero(g1.weight.per_group[0].view()));
        if (r.delay) layer.backward_dw();
      }
      if (r.delay) {
        const auto dw = layer.backward_dw();
        EXPECT_EQ(dw.weight.kind, r.fuse ? K::kNone : K::kWgrad);
        EXPECT_TRUE(dw.bias_grad.defined()) << "a delayed bias grad comes from backward_dw";
        EXPECT_EQ(layer.pending_wgrads(), 0u);
        if (r.fuse) {
          // By value: bit-identical to a layer without delay running the same backwards on a
          // copy of the initial main_grad (MainGradFusion checks that one against the oracle).
          GroupedLinearCase e = c;
          e.delay = false;
          e.main_grad = HostTensor::copy_of(mg_before.view());
          st::GroupedLinear eager(e.options(), e.params());
          for (int i = 0; i < (r.weight == K::kDummy ? 3 : 1); ++i) eager.backward(e.x.view(), e.dy.view(), sp);
          EXPECT_FALSE(c.main_grad.bytes_equal(mg_before)) << "backward_dw wrote main_grad";
          EXPECT_TRUE(c.main_grad.bytes_equal(e.main_grad)) << "delayed main_grad differs from the eager layer's";
        }
      }
    }
  }
}

// Two micro-batches with different data and routing, wgrad delayed: backward_dw hands them back
// first in, first out, bit-identical to the non-delayed layer.
TEST(GroupedLinearContract, DelayedWgradIsFirstInFirstOut) {
  GroupedLinearCase a = small_case(st::DType::kFP16), b = small_case(st::DType::kFP16);
  b.seed = 99;
  b.make();
  b.splits = {1, 9, 0, 13};
  b.w = a.w;  // same layer weights
  b.b = a.b;
  GroupedLinearCase delayed_cfg = a;
  delayed_cfg.delay = true;
  st::GroupedLinear eager(a.options(), a.params()), delayed(delayed_cfg.options(), a.params());
  const st::Splits sa = st::Splits::host(a.splits), sb = st::Splits::host(b.splits);
  const auto ea = eager.backward(a.x.view(), a.dy.view(), sa);
  const auto eb = eager.backward(b.x.view(), b.dy.view(), sb);
  const auto da = delayed.backward(a.x.view(), a.dy.view(), sa);
  const auto db = delayed.backward(b.x.view(), b.dy.view(), sb);
  EXPECT_TRUE(st::testing::bytes_equal(ea.grad_input.view(), da.grad_input.view()));
  EXPECT_TRUE(st::testing::bytes_equal(eb.grad_input.view(), db.grad_input.view()));
  EXPECT_EQ(delayed.pending_wgrads(), 2u);
  for (const auto* eager_grads : {&ea, &eb}) {
    const auto w = delayed.backward_dw();
    ASSERT_EQ(w.weight.kind, K::kWgrad);
    EXPECT_TRUE(HostTensor::copy_of(w.weight.packed.view()).bytes_equal(HostTensor::copy_of(eager_grads->weight.packed.view())));
    EXPECT_TRUE(st::testing::bytes_equal(w.bias_grad.view(), eager_grads->bias_grad.view()));
  }
  const std::string msg = expect_error([&] { delayed.backward_dw(); });
  EXPECT_NE(msg.find("backward_dw: expected a pending delayed wgrad"), std::string::npos) << msg;
  EXPECT_NE(msg.find("none pending"), std::string::npos) << msg;
}

// TransformerEngine's backward_dw returns at once when wgrad is not delayed: backward already
// computed the wgrad, so there is nothing to do and nothing may change.
TEST(GroupedLinearContract, BackwardDwWithoutDelayIsANoOp) {
  GroupedLinearCase c = small_case(st::DType::kBF16);
  c.fuse = true;
  c.make();
  st::testing::PoisonAllocator alloc;
  st::GroupedLinear layer(c.options(), c.params(), &alloc);
  const HostTensor mg0 = HostTensor::copy_of(c.main_grad.view());
  const auto g = layer.backward_dw();
  EXPECT_EQ(g.weight.kind, K::kNone);
  EXPECT_FALSE(g.weight.packed.defined());
  EXPECT_TRUE(g.weight.per_group.empty());
  EXPECT_FALSE(g.bias_grad.defined());
  EXPECT_FALSE(g.grad_input.defined());
  EXPECT_TRUE(c.main_grad.bytes_equal(mg0)) << "main_grad was written";
  EXPECT_EQ(alloc.allocations, 0);
}

// Invalid device splits are never read by the host: every problem becomes empty and the status
// word records why.
TEST(GroupedLinearContract, InvalidDeviceSplitsEmptyEveryProblemAndSetTheStatus) {
  struct Bad { std::vector<int64_t> splits; int32_t bit; };
  for (const Bad& bad : {Bad{{5, -1, 3, 2}, st::kSplitsNegative}, Bad{{20, 0, 3, 1}, st::kSplitsSumExceedsRows}}) {
    for (bool overwrite : {false, true}) {
      GroupedLinearCase c = small_case(st::DType::kBF16);
      c.fuse = true;
      c.overwrite = overwrite;
      const HostTensor mg_before = HostTensor::copy_of(c.main_grad.view());
      HostTensor values(st::DType::kInt64, {c.G}), status(st::DType::kInt32, {1});
      for (int64_t g = 0; g < c.G; ++g) values.set(g, double(bad.splits[size_t(g)]));
      status.set(0, 0);
      const st::Splits sp = st::Splits::device(values.view(), status.view());
      st::GroupedLinear layer(c.options(), c.params());
      HostTensor out(c.dtype, {c.T, c.out});
      out.poison();
      const HostTensor out_before = HostTensor::copy_of(out.view());
      const st::Tensor y = layer.forward(c.x.view(), sp);
      EXPECT_TRUE(all_zero(y.view())) << "library output: every row is tail";
      layer.forward(c.x.view(), sp, out.view());
      EXPECT_TRUE(out.bytes_equal(out_before)) << "caller output: no row < S = 0 to write";
      const auto grads = layer.backward(c.x.view(), c.dy.view(), sp);
      EXPECT_TRUE(all_zero(grads.grad_input.view()));
      EXPECT_TRUE(all_zero(grads.bias_grad.view()));
      if (overwrite) {
        EXPECT_TRUE(all_zero(c.main_grad.view()));
      } else {
        EXPECT_TRUE(HostTensor::copy_of(c.main_grad.view()).bytes_equal(mg_before));
      }
      EXPECT_EQ(int32_t(status.get(0)), bad.bit);
    }
  }
}

TEST(GroupedLinearContract, CheckedModeRaisesOnInvalidDeviceSplitsAndWritesNothing) {
  GroupedLinearCase c = small_case(st::DType::kBF16);
  st::GroupedLinearOptions o = c.options();
  o.check_device_splits = true;
  HostTensor values(st::DType::kInt64, {c.G});
  const std::vector<int64_t> bad = {5, 4, 30, 0};
  for (int64_t g = 0; g < c.G; ++g) values.set(g, double(bad[size_t(g)]));
  st::testing::PoisonAllocator alloc;
  st::GroupedLinear layer(o, c.params(), &alloc);
  HostTensor out(c.dtype, {c.T, c.out});
  out.poison();
  const HostTensor out_before = HostTensor::copy_of(out.view());
  const std::string msg = expect_error([&] { layer.forward(c.x.view(), st::Splits::device(values.view()), out.view()); });
  EXPECT_NE(msg.find("splits (device, checked mode): expected a sum <= 23"), std::string::npos) << msg;
  EXPECT_TRUE(out.bytes_equal(out_before));
  EXPECT_EQ(alloc.allocations, 0) << "nothing allocated before validation passed";
  // Valid device splits pass checked mode and match host splits bit for bit.
  for (int64_t g = 0; g < c.G; ++g) values.set(g, double(c.splits[size_t(g)]));
  const st::Tensor yd = layer.forward(c.x.view(), st::Splits::device(values.view()));
  const st::Tensor yh = layer.forward(c.x.view(), st::Splits::host(c.splits));
  EXPECT_TRUE(st::testing::bytes_equal(yd.view(), yh.view()));
}

TEST(GroupedLinearContract, CallerWorkspaceIsUsedAndItsSizeDependsOnShapesOnly) {
  GroupedLinearCase c = small_case(st::DType::kBF16);
  st::testing::PoisonAllocator alloc;
  st::GroupedLinear layer(c.options(), c.params(), &alloc);
  const size_t bytes = layer.workspace_size(c.T);
  EXPECT_GT(bytes, 0u);
  // Shapes only: another layer of the same shapes over other data (other parameters, fused
  // main_grad, delayed wgrad) asks for the same bytes.
  GroupedLinearCase other = c;
  other.seed = 41;
  other.fuse = true;
  other.delay = true;
  other.make();
  EXPECT_EQ(bytes, st::GroupedLinear(other.options(), other.params()).workspace_size(c.T));
  HostTensor ws(st::DType::kInt32, {int64_t(bytes / 4)});
  st::CallArgs args;
  args.workspace = {ws.data(), bytes};
  HostTensor out(c.dtype, {c.T, c.out}), gin(c.dtype, {c.T, c.in});
  // Never on split values: exactly `bytes` serves every split vector, host or device, with
  // nothing allocated but the backward's weight / bias grads.
  HostTensor dsplits(st::DType::kInt64, {c.G});
  for (const std::vector<int64_t>& sv : {std::vector<int64_t>{23, 0, 0, 0}, std::vector<int64_t>{0, 0, 0, 0},
                                         std::vector<int64_t>{1, 2, 3, 17}, c.splits}) {
    for (int64_t g = 0; g < c.G; ++g) dsplits.set(g, double(sv[size_t(g)]));
    for (const st::Splits& sp : {st::Splits::host(sv), st::Splits::device(dsplits.view())}) {
      alloc.allocations = 0;
      layer.forward(c.x.view(), sp, out.view(), args);
      EXPECT_EQ(alloc.allocations, 0) << "caller output + caller workspace: the layer allocates nothing";
      layer.backward(c.x.view(), c.dy.view(), sp, gin.view(), args);
      EXPECT_EQ(alloc.allocations, 2) << "backward allocates its weight and bias grads only";
    }
  }
  alloc.allocations = 0;
  layer.forward(c.x.view(), st::Splits::host(c.splits), out.view(), args);
  const st::Tensor y = layer.forward(c.x.view(), st::Splits::host(c.splits));  // own workspace
  EXPECT_TRUE(st::testing::bytes_equal(HostTensor::copy_of(y.view().rows(0, 20)).view(),
                                       HostTensor::copy_of(out.view().rows(0, 20)).view()));
  args.workspace.bytes = bytes - 1;
  const std::string msg = expect_error([&] { layer.forward(c.x.view(), st::Splits::host(c.splits), out.view(), args); });
  EXPECT_NE(msg.find("workspace: expected >= " + std::to_string(bytes) + " bytes"), std::string::npos) << msg;
  args.workspace = {static_cast<char*>(ws.data()) + 8, bytes};
  expect_error([&] { layer.forward(c.x.view(), st::Splits::host(c.splits), out.view(), args); });
}

TEST(GroupedLinearContract, HostSplitsFromAnInt32Or64Tensor) {
  GroupedLinearCase c = small_case(st::DType::kBF16);
  st::GroupedLinear layer(c.options(), c.params());
  HostTensor s32(st::DType::kInt32, {c.G}), s64(st::DType::kInt64, {c.G});
  for (int64_t g = 0; g < c.G; ++g) s32.set(g, double(c.splits[size_t(g)])), s64.set(g, double(c.splits[size_t(g)]));
  const st::Tensor a = layer.forward(c.x.view(), st::Splits::host(s32.view()));
  const st::Tensor b = layer.forward(c.x.view(), st::Splits::host(s64.view()));
  const st::Tensor r = layer.forward(c.x.view(), st::Splits::host(c.splits));
  EXPECT_TRUE(st::testing::bytes_equal(a.view(), r.view()));
  EXPECT_TRUE(st::testing::bytes_equal(b.view(), r.view()));
  HostTensor f(st::DType::kFP32, {c.G});
  const std::string msg = expect_error([&] { st::Splits::host(f.view()); });
  EXPECT_NE(msg.find("splits: expected dtype int64 or int32, got fp32"), std::string::npos) << msg;
}

// x with a row stride larger than its width (a slice of a wider tensor) gives the same result.
TEST(GroupedLinearContract, StridedInputRowsAreAccepted) {
  GroupedLinearCase c = small_case(st::DType::kBF16);
  st::GroupedLinear layer(c.options(), c.params());
  HostTensor wide(c.dtype, {c.T, c.in + 5});
  wide.poison();
  for (int64_t t = 0; t < c.T; ++t)
    for (int64_t k = 0; k < c.in; ++k) wide.set(t * (c.in + 5) + k, c.x.get(t * c.in + k));
  const int64_t shape[2] = {c.T, c.in}, strides[2] = {c.in + 5, 1};
  const st::TensorView xs(wide.data(), c.dtype, shape, strides, 2);
  const st::Tensor a = layer.forward(xs, st::Splits::host(c.splits));
  const st::Tensor b = layer.forward(c.x.view(), st::Splits::host(c.splits));
  EXPECT_TRUE(st::testing::bytes_equal(a.view(), b.view()));
}

// Producers (numpy) give empty arrays zero strides: with no row to read they are accepted.
TEST(GroupedLinearContract, EmptyInputsWithZeroStridesAreAccepted) {
  GroupedLinearCase c = small_case(st::DType::kFP32);
  st::GroupedLinear layer(c.options(), c.params());
  const int64_t xs[2] = {0, c.in}, ys[2] = {0, c.out}, zero[2] = {0, 0};
  const st::TensorView x(c.x.data(), c.dtype, xs, zero, 2), dy(c.dy.data(), c.dtype, ys, zero, 2);
  const st::Splits none = st::Splits::host({0, 0, 0, 0});
  EXPECT_EQ(layer.forward(x, none).view().size(0), 0);
  const auto g = layer.backward(x, dy, none);
  EXPECT_EQ(g.grad_input.view().size(0), 0);
  EXPECT_TRUE(all_zero(g.bias_grad.view()));
}

// main_grad moved to other tensors (set_main_grad): a delayed wgrad pending from before the move
// goes to the new main_grad, bit-identical to a layer made over it, and the old one is left as it
// was; a main_grad of another shape or dtype, or one for a layer without fusion, is refused with
// the layer unchanged.
TEST(GroupedLinearContract, MovedMainGradTakesThePendingWgrad) {
  GroupedLinearCase c = small_case(st::DType::kBF16);
  c.fuse = c.delay = true;
  c.make();
  st::GroupedLinear layer(c.options(), c.params());
  const st::Splits s = st::Splits::host(c.splits);
  layer.backward(c.x.view(), c.dy.view(), s);
  GroupedLinearCase moved = c;
  moved.main_grad = HostTensor::copy_of(c.main_grad.view());
  const HostTensor old = HostTensor::copy_of(c.main_grad.view());
  layer.set_main_grad(moved.params().main_grad);
  layer.backward_dw();
  EXPECT_TRUE(c.main_grad.bytes_equal(old)) << "the old main_grad was written";
  st::GroupedLinear fresh(c.options(), c.params());  // over c.main_grad, which still holds the start
  fresh.backward(c.x.view(), c.dy.view(), s);
  fresh.backward_dw();
  EXPECT_TRUE(moved.main_grad.bytes_equal(c.main_grad)) << "the moved main_grad differs from a fresh layer's";
  HostTensor wrong(st::DType::kFP32, {c.G, c.out + 1, c.in});
  GroupedLinearCase bad = c;
  bad.main_grad = wrong;
  const std::string msg = expect_error([&] { layer.set_main_grad(bad.params().main_grad); });
  EXPECT_NE(msg.find("main_grad"), std::string::npos) << msg;
  GroupedLinearCase plain = small_case(st::DType::kBF16);
  st::GroupedLinear unfused(plain.options(), plain.params());
  const std::string none = expect_error([&] { unfused.set_main_grad(moved.params().main_grad); });
  EXPECT_NE(none.find("fuse_wgrad_accumulation is false"), std::string::npos) << none;
}

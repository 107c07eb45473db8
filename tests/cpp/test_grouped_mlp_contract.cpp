// GroupedMLP's contract beyond the arithmetic (docs/DESIGN.md sections 4 and 5) for both of its layers:
// fused main_grad accumulation / overwrite with an empty expert, the six rows of the weight-grad
// table, delayed wgrad first-in-first-out with the intermediates kept alive by the layer, caller
// workspace, invalid device splits; and bad input, each raising an Error that names the argument
// while writing and allocating nothing.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <memory>

#include "grouped_mlp_case.h"
#include "sparsetrain/error.h"

namespace st = sparsetrain;
using st::testing::GroupedMLPCase;
using st::testing::HostTensor;
using K = st::WeightGradKind;

namespace {

// G = 4, T = 23, S = 20 (expert 1 empty), in 6, F 5, out 7; both biases.
GroupedMLPCase small_case(st::DType dtype, int64_t k = 0, uint64_t seed = 0) {
  GroupedMLPCase c;
  c.dtype = dtype;
  c.G = 4;
  c.T = 23;
  c.in = 6;
  c.F = k == 0 ? 5 : 2 * k;
  c.out = 7;
  c.k = k;
  c.splits = {7, 0, 11, 2};
  c.bias1 = c.bias2 = true;
  c.seed = seed;
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

bool same_bytes(const st::TensorView& a, const st::TensorView& b) {
  return HostTensor::copy_of(a).bytes_equal(HostTensor::copy_of(b));
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

// Host allocator that poisons memory when it is handed out and again when it comes back, and
// keeps freed blocks until it dies: reading memory after the library let go of it shows as NaN
// instead of undefined behaviour.
class QuarantineAllocator final : public st::Allocator {
 public:
  ~QuarantineAllocator() override {
    for (auto& [p, bytes] : freed_) st::default_allocator().deallocate(p, bytes, st::Device::cpu(), {});
  }
  void* allocate(size_t bytes, st::Device device, st::Stream stream) override {
    void* p = st::default_allocator().allocate(bytes, device, stream);
    std::memset(p, 0xff, bytes);
    return p;
  }
  void deallocate(void* p, size_t bytes, st::Device, st::Stream) override {
    std::memset(p, 0xff, bytes);
    freed_.emplace_back(p, bytes);
  }

 private:
  std::vector<std::pair<void*, size_t>> freed_;
};

}  // namespace

class MLPMainGradFusion : public ::testing::TestWithParam<std::tuple<bool, bool>> {};  // overwrite, packed

TEST_P(MLPMainGradFusion, BothLayersWriteMainGradAndHandleTheEmptyExpert) {
  const auto [overwrite, packed] = GetParam();
  GroupedMLPCase c = small_case(st::DType::kBF16);
  c.fuse = true;
  c.overwrite = overwrite;
  c.packed_main_grad = packed;
  // The empty expert's main_grads hold a -0.0: "untouched" means bit for bit.
  c.mg1.set(1 * 2 * c.F * c.in + 3, -0.0);
  c.mg2.set(1 * c.out * c.F + 2, -0.0);
  const HostTensor mg1_before = HostTensor::copy_of(c.mg1.view()), mg2_before = HostTensor::copy_of(c.mg2.view());
  st::testing::PoisonAllocator alloc;
  st::GroupedMLP mlp(c.options(), c.params(), &alloc);
  const st::Splits sp = st::Splits::host(c.splits);
  const auto fwd = mlp.forward(c.x.view(), sp, c.probs.view());
  const auto g = mlp.backward(c.x.view(), fwd.fc1_out.view(), c.probs.view(), c.dy.view(), sp);
  EXPECT_EQ(g.fc1.weight.kind, K::kNone);
  EXPECT_EQ(g.fc2.weight.kind, K::kNone);
  EXPECT_TRUE(g.fc1.bias_grad.defined() && g.fc2.bias_grad.defined()) << "bias grads are never fused";
  const auto oracle = c.oracle().backward(HostTensor::copy_of(fwd.fc1_out.view()).to_double());
  struct Layer { const char* name; HostTensor* mg; const HostTensor* before; const std::vector<st::testing::Bounded>* dw; };
  for (const Layer& l : {Layer{"fc1.main_grad", &c.mg1, &mg1_before, &oracle.dw1},
                         Layer{"fc2.main_grad", &c.mg2, &mg2_before, &oracle.dw2}}) {
    for (int64_t grp = 0; grp < c.G; ++grp) {
      const st::TensorView mg = l.mg->view().select(grp), before = l.before->view().select(grp);
      if (c.splits[size_t(grp)] == 0) {
        if (overwrite) {
          EXPECT_TRUE(all_zero(mg)) << l.name << ": overwrite zeroes an empty expert's main_grad";
        } else {
          EXPECT_TRUE(same_bytes(mg, before)) << l.name << ": accumulation leaves an empty expert untouched";
        }
        continue;
      }
      const std::vector<double> base = HostTensor::copy_of(before).to_double();
      expect_ok(st::testing::compare_bounded(HostTensor::copy_of(mg), (*l.dw)[size_t(grp)], st::DType::kFP32,
                                             l.name, overwrite ? nullptr : &base));
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Modes, MLPMainGradFusion, ::testing::Combine(::testing::Bool(), ::testing::Bool()),
                         [](const auto& param_info) {
                           return std::string(std::get<0>(param_info.param) ? "overwrite" : "accumulate") +
                                  (std::get<1>(param_info.param) ? "_packed" : "_per_expert");
                         });

// docs/DESIGN.md section 4's table, for fc1 and fc2 (fc2's bias being the MLP's probs-scaled one).
TEST(GroupedMLPContract, TheSixRowsOfTheWeightGradTableForBothLayers) {
  struct Row { bool delay, fuse, attr; K weight; bool bias_now; };
  const Row rows[] = {
      {false, false, false, K::kWgrad, true},  {true, false, false, K::kNone, false},
      {false, true, false, K::kNone, true},    {false, true, true, K::kDummy, true},
      {true, true, false, K::kNone, false},    {true, true, true, K::kDummy, false},
  };
  for (bool packed : {false, true}) {
    for (const Row& r : rows) {
      SCOPED_TRACE(::testing::Message() << "delay=" << r.delay << " fuse=" << r.fuse << " attr=" << r.attr
                                        << " packed=" << packed);
      GroupedMLPCase c = small_case(st::DType::kBF16);
      c.delay = r.delay;
      c.fuse = r.fuse;
      c.attr1 = c.attr2 = r.attr;
      c.packed = packed;
      const HostTensor mg1_before = HostTensor::copy_of(c.mg1.view()), mg2_before = HostTensor::copy_of(c.mg2.view());
      st::GroupedMLP mlp(c.options(), c.params());
      const st::Splits sp = st::Splits::host(c.splits);
      const auto fwd = mlp.forward(c.x.view(), sp, c.probs.view());
      const auto g = mlp.backward(c.x.view(), fwd.fc1_out.view(), c.probs.view(), c.dy.view(), sp);
      EXPECT_TRUE(g.grad_input.defined() && g.dprobs.defined());
      for (const auto* lg : {&g.fc1, &g.fc2}) {
        EXPECT_EQ(lg->weight.kind, r.weight);
        EXPECT_EQ(lg->bias_grad.defined(), r.bias_now);
        EXPECT_EQ(lg->weight.grad_added_to_main_grad, r.weight == K::kDummy);
      }
      EXPECT_EQ(mlp.pending_wgrads(), r.delay ? 1u : 0u);
      EXPECT_EQ(mlp.fc1().pending_wgrads(), r.delay ? 1u : 0u);
      EXPECT_EQ(mlp.fc2().pending_wgrads(), r.delay ? 1u : 0u);
      EXPECT_EQ(!HostTensor::copy_of(c.mg1.view()).bytes_equal(mg1_before), r.fuse && !r.delay);
      EXPECT_EQ(!HostTensor::copy_of(c.mg2.view()).bytes_equal(mg2_before), r.fuse && !r.delay);
      if (r.weight == K::kDummy) {
        ASSERT_EQ(int64_t(g.fc1.weight.per_group.size()), c.G);
        ASSERT_EQ(int64_t(g.fc2.weight.per_group.size()), c.G);
        EXPECT_EQ(g.fc1.weight.per_group[0].view().size(0), 2 * c.F);
        EXPECT_EQ(g.fc2.weight.per_group[0].view().size(1), c.F);
        EXPECT_TRUE(all_zero(g.fc1.weight.per_group[0].view()) && all_zero(g.fc2.weight.per_group[0].view()));
      }
      if (r.delay) {
        const auto dw = mlp.backward_dw();
        EXPECT_FALSE(dw.grad_input.defined() || dw.dprobs.defined());
        for (const auto* lg : {&dw.fc1, &dw.fc2}) {
          EXPECT_EQ(lg->weight.kind, r.fuse ? K::kNone : K::kWgrad);
          EXPECT_TRUE(lg->bias_grad.defined()) << "a delayed bias grad comes from backward_dw";
        }
        EXPECT_EQ(mlp.pending_wgrads(), 0u);
        EXPECT_EQ(mlp.fc1().pending_wgrads(), 0u);
        EXPECT_EQ(mlp.fc2().pending_wgrads(), 0u);
        EXPECT_EQ(!HostTensor::copy_of(c.mg1.view()).bytes_equal(mg1_before), r.fuse);
        EXPECT_EQ(!HostTensor::copy_of(c.mg2.view()).bytes_equal(mg2_before), r.fuse);
      }
    }
  }
}

// Each layer reads its own parameter's grad_added_to_main_grad attribute.
TEST(GroupedMLPContract, EachLayerFollowsItsOwnWeightAttribute) {
  GroupedMLPCase c = small_case(st::DType::kFP16);
  c.fuse = true;
  c.attr1 = true;
  c.attr2 = false;
  st::GroupedMLP mlp(c.options(), c.params());
  const st::Splits sp = st::Splits::host(c.splits);
  const auto fwd = mlp.forward(c.x.view(), sp, c.probs.view());
  const auto g = mlp.backward(c.x.view(), fwd.fc1_out.view(), c.probs.view(), c.dy.view(), sp);
  EXPECT_EQ(g.fc1.weight.kind, K::kDummy);
  EXPECT_EQ(g.fc2.weight.kind, K::kNone);
  // The call's choice of a cached or a new dummy reaches the layer.
  st::CallArgs fresh;
  fresh.cache_dummy_wgrad = false;
  const auto g2 = mlp.backward(c.x.view(), fwd.fc1_out.view(), c.probs.view(), c.dy.view(), sp, {}, fresh);
  ASSERT_EQ(g2.fc1.weight.kind, K::kDummy);
  EXPECT_NE(g2.fc1.weight.per_group[0].view().data(), g.fc1.weight.per_group[0].view().data());
  EXPECT_TRUE(all_zero(g2.fc1.weight.per_group[0].view()));
  const auto g3 = mlp.backward(c.x.view(), fwd.fc1_out.view(), c.probs.view(), c.dy.view(), sp);
  EXPECT_EQ(g3.fc1.weight.per_group[0].view().data(), g.fc1.weight.per_group[0].view().data());
}

// Two micro-batches with different data and routing, wgrad delayed: backward_dw hands both layers'
// grads back first in, first out, bit-identical to the eager layer, after everything the caller
// does not own (fc1_out, the backward's results) is gone and poisoned: the layer keeps its own
// intermediates (the recomputed fc2 input and fc1's output grad) alive.
TEST(GroupedMLPContract, DelayedWgradIsFirstInFirstOutAndKeepsItsIntermediates) {
  for (int64_t k : {0, 4}) {
    SCOPED_TRACE(::testing::Message() << "k=" << k);
    QuarantineAllocator alloc;
    GroupedMLPCase a = small_case(st::DType::kBF16, k, 1), b = small_case(st::DType::kBF16, k, 2);
    b.splits = {1, 9, 0, 13};
    b.w1 = a.w1, b.b1 = a.b1, b.w2 = a.w2, b.b2 = a.b2;  // the same layer
    GroupedMLPCase delayed_cfg = a;
    delayed_cfg.delay = true;
    st::GroupedMLP eager(a.options(), a.params(), &alloc), delayed(delayed_cfg.options(), a.params(), &alloc);
    const st::Splits sa = st::Splits::host(a.splits), sb = st::Splits::host(b.splits);
    std::vector<st::GroupedMLPGrads> want;
    for (const GroupedMLPCase* c : {&a, &b}) {
      const st::Splits& s = c == &a ? sa : sb;
      auto f = eager.forward(c->x.view(), s, c->probs.view());
      want.push_back(eager.backward(c->x.view(), f.fc1_out.view(), c->probs.view(), c->dy.view(), s));
      auto fd = delayed.forward(c->x.view(), s, c->probs.view());
      {
        const auto got = delayed.backward(c->x.view(), fd.fc1_out.view(), c->probs.view(), c->dy.view(), s);
        EXPECT_TRUE(st::testing::bytes_equal(got.grad_input.view(), want.back().grad_input.view()));
        EXPECT_TRUE(st::testing::bytes_equal(got.dprobs.view(), want.back().dprobs.view()));
      }
      fd = {};  // fc1_out and out released (and poisoned)
    }
    EXPECT_EQ(delayed.pending_wgrads(), 2u);
    for (const auto& w : want) {
      const auto got = delayed.backward_dw();
      ASSERT_EQ(got.fc1.weight.kind, K::kWgrad);
      ASSERT_EQ(got.fc2.weight.kind, K::kWgrad);
      EXPECT_TRUE(same_bytes(got.fc1.weight.packed.view(), w.fc1.weight.packed.view()));
      EXPECT_TRUE(same_bytes(got.fc2.weight.packed.view(), w.fc2.weight.packed.view()));
      EXPECT_TRUE(st::testing::bytes_equal(got.fc1.bias_grad.view(), w.fc1.bias_grad.view()));
      EXPECT_TRUE(st::testing::bytes_equal(got.fc2.bias_grad.view(), w.fc2.bias_grad.view()));
    }
    const std::string msg = expect_error([&] { delayed.backward_dw(); });
    EXPECT_NE(msg.find("backward_dw: expected a pending delayed wgrad"), std::string::npos) << msg;
  }
}

// As GroupedLinear's (and TransformerEngine's): nothing to do, nothing written or allocated.
TEST(GroupedMLPContract, BackwardDwWithoutDelayIsANoOp) {
  const GroupedMLPCase c = small_case(st::DType::kBF16);
  st::testing::PoisonAllocator alloc;
  st::GroupedMLP mlp(c.options(), c.params(), &alloc);
  const auto g = mlp.backward_dw();
  for (const auto* lg : {&g.fc1, &g.fc2}) {
    EXPECT_EQ(lg->weight.kind, K::kNone);
    EXPECT_FALSE(lg->weight.packed.defined());
    EXPECT_FALSE(lg->bias_grad.defined());
  }
  EXPECT_FALSE(g.grad_input.defined());
  EXPECT_FALSE(g.dprobs.defined());
  EXPECT_EQ(alloc.allocations, 0);
}

TEST(GroupedMLPContract, CallerWorkspaceIsUsedAndItsSizeDependsOnShapesOnly) {
  const GroupedMLPCase c = small_case(st::DType::kBF16);
  st::testing::PoisonAllocator alloc;
  st::GroupedMLP mlp(c.options(), c.params(), &alloc);
  const size_t bytes = mlp.workspace_size(c.T);
  EXPECT_GE(bytes, std::max(mlp.fc1().workspace_size(c.T), mlp.fc2().workspace_size(c.T)));
  // Shapes only: other data and modes (fused main_grad, delayed wgrad) ask for the same bytes.
  GroupedMLPCase other = small_case(st::DType::kBF16, 0, 41);
  other.splits = {23, 0, 0, 0};
  other.fuse = true;
  other.delay = true;
  other.make();
  EXPECT_EQ(bytes, st::GroupedMLP(other.options(), other.params()).workspace_size(c.T));
  HostTensor ws(st::DType::kInt32, {int64_t(bytes / 4)});
  st::CallArgs args;
  args.workspace = {ws.data(), bytes};
  const st::Splits sp = st::Splits::host(c.splits);

  alloc.allocations = 0;
  const auto own = mlp.forward(c.x.view(), sp, c.probs.view());
  const int own_allocs = alloc.allocations;
  alloc.allocations = 0;
  const auto given = mlp.forward(c.x.view(), sp, c.probs.view(), {}, args);
  EXPECT_EQ(alloc.allocations, own_allocs - 1) << "with a caller workspace, no workspace is allocated";
  EXPECT_TRUE(st::testing::bytes_equal(own.out.view(), given.out.view()));
  alloc.allocations = 0;
  const auto g_own = mlp.backward(c.x.view(), own.fc1_out.view(), c.probs.view(), c.dy.view(), sp);
  const int own_bwd_allocs = alloc.allocations;
  alloc.allocations = 0;
  const auto g_given = mlp.backward(c.x.view(), own.fc1_out.view(), c.probs.view(), c.dy.view(), sp, {}, args);
  EXPECT_EQ(alloc.allocations, own_bwd_allocs - 1);
  EXPECT_TRUE(st::testing::bytes_equal(g_own.grad_input.view(), g_given.grad_input.view()));
  EXPECT_TRUE(st::testing::bytes_equal(g_own.dprobs.view(), g_given.dprobs.view()));
  EXPECT_TRUE(st::testing::bytes_equal(g_own.fc2.bias_grad.view(), g_given.fc2.bias_grad.view()));

  HostTensor out(c.dtype, {c.T, c.out});
  out.poison();
  const HostTensor out_before = HostTensor::copy_of(out.view());
  args.workspace.bytes = bytes - 1;
  std::string msg = expect_error([&] { mlp.forward(c.x.view(), sp, c.probs.view(), out.view(), args); });
  EXPECT_NE(msg.find("workspace: expected >= " + std::to_string(bytes) + " bytes"), std::string::npos) << msg;
  args.workspace = {static_cast<char*>(ws.data()) + 8, bytes};
  msg = expect_error([&] { mlp.forward(c.x.view(), sp, c.probs.view(), out.view(), args); });
  EXPECT_NE(msg.find("workspace: expected a 256-byte aligned address"), std::string::npos) << msg;
  EXPECT_TRUE(out.bytes_equal(out_before));
}

// Invalid device splits are never read by the host: every row is tail, the status records why.
TEST(GroupedMLPContract, InvalidDeviceSplitsEmptyEveryProblemAndSetTheStatus) {
  const GroupedMLPCase c = small_case(st::DType::kBF16);
  HostTensor values(st::DType::kInt64, {c.G}), status(st::DType::kInt32, {1});
  const std::vector<int64_t> bad = {5, -1, 3, 2};
  for (int64_t g = 0; g < c.G; ++g) values.set(g, double(bad[size_t(g)]));
  status.set(0, 0);
  const st::Splits sp = st::Splits::device(values.view(), status.view());
  st::GroupedMLP mlp(c.options(), c.params());
  const auto fwd = mlp.forward(c.x.view(), sp, c.probs.view());
  EXPECT_TRUE(all_zero(fwd.out.view()));
  const auto g = mlp.backward(c.x.view(), fwd.fc1_out.view(), c.probs.view(), c.dy.view(), sp);
  EXPECT_TRUE(all_zero(g.grad_input.view()));
  EXPECT_TRUE(all_zero(g.dprobs.view()));
  EXPECT_TRUE(all_zero(g.fc1.weight.packed.view()) && all_zero(g.fc2.weight.packed.view()));
  EXPECT_TRUE(all_zero(g.fc1.bias_grad.view()) && all_zero(g.fc2.bias_grad.view()));
  EXPECT_EQ(int32_t(status.get(0)), st::kSplitsNegative);
}

TEST(GroupedMLPContract, CheckedModeRaisesOnInvalidDeviceSplitsAndWritesNothing) {
  const GroupedMLPCase c = small_case(st::DType::kBF16);
  st::GroupedMLPOptions o = c.options();
  o.check_device_splits = true;
  HostTensor values(st::DType::kInt64, {c.G});
  const std::vector<int64_t> bad = {5, 4, 30, 0};
  for (int64_t g = 0; g < c.G; ++g) values.set(g, double(bad[size_t(g)]));
  st::testing::PoisonAllocator alloc;
  st::GroupedMLP mlp(o, c.params(), &alloc);
  HostTensor out(c.dtype, {c.T, c.out});
  out.poison();
  const HostTensor out_before = HostTensor::copy_of(out.view());
  const std::string msg =
      expect_error([&] { mlp.forward(c.x.view(), st::Splits::device(values.view()), c.probs.view(), out.view()); });
  EXPECT_NE(msg.find("splits (device, checked mode): expected a sum <= 23"), std::string::npos) << msg;
  EXPECT_TRUE(out.bytes_equal(out_before));
  EXPECT_EQ(alloc.allocations, 0);
}

// ---------------------------------------------------------------------------------------------
// Bad input

namespace {

// A fused, biased MLP with caller buffers and main_grads, poisoned/randomised so any write shows.
// With `delay` its wgrads are delayed (the queues a refused call must leave as they were).
struct Env {
  GroupedMLPCase c;
  st::testing::PoisonAllocator alloc;
  std::unique_ptr<st::GroupedMLP> mlp;
  HostTensor out, gin, fc1_out, big;

  explicit Env(bool delay = false) {
    c = small_case(st::DType::kBF16);
    c.fuse = true;
    c.delay = delay;
    mlp = std::make_unique<st::GroupedMLP>(c.options(), c.params(), &alloc);
    out = HostTensor(c.dtype, {c.T, c.out});
    gin = HostTensor(c.dtype, {c.T, c.in});
    fc1_out = HostTensor(c.dtype, {c.T, 2 * c.F});
    std::mt19937_64 rng(3);
    fc1_out.fill_random(rng);
    big = HostTensor(st::DType::kFP32, {4096});  // room for any mis-shaped view below
    out.poison();
    gin.poison();
  }
  st::Splits host() const { return st::Splits::host(c.splits); }
  st::TensorView view(std::initializer_list<int64_t> shape, st::DType dtype, st::Device dev = st::Device::cpu()) const {
    return st::TensorView::contiguous(big.data(), dtype, shape.begin(), int(shape.size()), dev);
  }
  void forward(const st::TensorView& probs) { mlp->forward(c.x.view(), host(), probs, out.view()); }
  void backward(const st::TensorView& fc1, const st::TensorView& probs, const st::TensorView& dy,
                const st::Splits& s) {
    mlp->backward(c.x.view(), fc1, probs, dy, s, gin.view());
  }
};

struct CallCase {
  const char* name;
  std::function<void(Env&)> call;
  const char* expected_message;
};

const CallCase kCallCases[] = {
    {"ProbsMissing", [](Env& e) { e.forward({}); },
     "probs: expected an fp32 tensor of shape [T] (one router probability per row of x), got no tensor"},
    {"ProbsTooShort", [](Env& e) { e.forward(e.view({22}, st::DType::kFP32)); },
     "probs: expected shape [23] (one router probability per row of x), got [22]"},
    {"ProbsTwoDimensional", [](Env& e) { e.forward(e.view({23, 1}, st::DType::kFP32)); },
     "probs: expected shape [23] (one router probability per row of x), got [23, 1]"},
    {"ProbsBf16", [](Env& e) { e.forward(e.view({23}, st::DType::kBF16)); },
     "probs: expected dtype fp32 (router probabilities), got bf16"},
    {"ProbsOnAnotherDevice", [](Env& e) { e.forward(e.view({23}, st::DType::kFP32, st::Device::cuda(0))); },
     "probs: expected a tensor on cpu (the layer's device), got cuda:0"},
    {"XWrongWidth", [](Env& e) { e.mlp->forward(e.view({23, 5}, st::DType::kBF16), e.host(), e.c.probs.view(), e.out.view()); },
     "x: expected shape [T, 6 (in_features)], got [23, 5]"},
    {"OutTooFewRows",
     [](Env& e) { e.mlp->forward(e.c.x.view(), e.host(), e.c.probs.view(), e.out.view().rows(0, 19)); },
     "out: expected shape [>= 20 (S: host splits), 7], got [19, 7]"},
    {"OutWrongWidth", [](Env& e) { e.mlp->forward(e.c.x.view(), e.host(), e.c.probs.view(), e.view({23, 6}, st::DType::kBF16)); },
     "out: expected shape [>= 20 (S: host splits), 7], got [23, 6]"},
    {"SplitsSumAboveT", [](Env& e) { e.mlp->forward(e.c.x.view(), st::Splits::host({7, 0, 11, 6}), e.c.probs.view(), e.out.view()); },
     "splits: expected a sum <= 23 (the rows of x), got a sum of at least 24 at index 3"},
    {"BackwardFc1OutOddWidth", [](Env& e) { e.backward(e.view({23, 9}, st::DType::kBF16), e.c.probs.view(), e.c.dy.view(), e.host()); },
     "fc1_out: expected shape [23 (the rows of x), 10 (2 * ffn_features)], got [23, 9]"},
    {"BackwardFc1OutWrongRows", [](Env& e) { e.backward(e.view({22, 10}, st::DType::kBF16), e.c.probs.view(), e.c.dy.view(), e.host()); },
     "fc1_out: expected shape [23 (the rows of x), 10 (2 * ffn_features)], got [22, 10]"},
    {"BackwardFc1OutWrongDtype", [](Env& e) { e.backward(e.view({23, 10}, st::DType::kFP16), e.c.probs.view(), e.c.dy.view(), e.host()); },
     "fc1_out: expected dtype bf16 (the layer's dtype), got fp16"},
    {"BackwardProbsFp16", [](Env& e) { e.backward(e.fc1_out.view(), e.view({23}, st::DType::kFP16), e.c.dy.view(), e.host()); },
     "probs: expected dtype fp32 (router probabilities), got fp16"},
    {"BackwardDyWrongWidth", [](Env& e) { e.backward(e.fc1_out.view(), e.c.probs.view(), e.view({23, 8}, st::DType::kBF16), e.host()); },
     "dy: expected shape [23 (the rows of x), 7 (out_features)], got [23, 8]"},
    {"BackwardSplitsNegative", [](Env& e) { e.backward(e.fc1_out.view(), e.c.probs.view(), e.c.dy.view(), st::Splits::host({7, -1, 11, 2})); },
     "splits: expected entries >= 0, got -1 at index 1"},
    {"BackwardGradInputWrongDtype",
     [](Env& e) { e.mlp->backward(e.c.x.view(), e.fc1_out.view(), e.c.probs.view(), e.c.dy.view(), e.host(), e.view({23, 6}, st::DType::kFP32)); },
     "grad_input: expected dtype bf16 (the layer's dtype), got fp32"},
};

class GroupedMLPBadCall : public ::testing::TestWithParam<CallCase> {};

}  // namespace

TEST_P(GroupedMLPBadCall, RaisesAClearErrorAndWritesNothing) {
  Env e;
  const HostTensor out0 = HostTensor::copy_of(e.out.view()), gin0 = HostTensor::copy_of(e.gin.view());
  const HostTensor mg1 = HostTensor::copy_of(e.c.mg1.view()), mg2 = HostTensor::copy_of(e.c.mg2.view());
  const std::string msg = expect_error([&] { GetParam().call(e); });
  EXPECT_NE(msg.find(GetParam().expected_message), std::string::npos) << "message: " << msg;
  EXPECT_TRUE(e.out.bytes_equal(out0));
  EXPECT_TRUE(e.gin.bytes_equal(gin0));
  EXPECT_TRUE(e.c.mg1.bytes_equal(mg1));
  EXPECT_TRUE(e.c.mg2.bytes_equal(mg2));
  EXPECT_EQ(e.alloc.allocations, 0) << "nothing allocated before validation passed";
  EXPECT_EQ(e.mlp->pending_wgrads(), 0u);
}

// The same refusals with delayed wgrad and one backward pending: the MLP's queue and both
// layers' must be exactly as they were, checked by value (a later good backward and two
// backward_dw calls give main_grads and bias grads bit-identical to a fresh MLP's).
TEST_P(GroupedMLPBadCall, LeavesTheDelayedWgradQueuesAsTheyWere) {
  const st::Splits second = st::Splits::host({3, 9, 0, 8});
  auto good_steps = [&](Env& e, const std::function<void()>& between) {
    const auto f = e.mlp->forward(e.c.x.view(), e.host(), e.c.probs.view());
    e.mlp->backward(e.c.x.view(), f.fc1_out.view(), e.c.probs.view(), e.c.dy.view(), e.host());
    between();
    EXPECT_EQ(e.mlp->pending_wgrads(), 1u);
    EXPECT_EQ(e.mlp->fc1().pending_wgrads(), 1u);
    EXPECT_EQ(e.mlp->fc2().pending_wgrads(), 1u);
    const auto f2 = e.mlp->forward(e.c.x.view(), second, e.c.probs.view());
    e.mlp->backward(e.c.x.view(), f2.fc1_out.view(), e.c.probs.view(), e.c.dy.view(), second);
    std::vector<HostTensor> bias_grads;
    for (int i = 0; i < 2; ++i) {
      const auto g = e.mlp->backward_dw();
      bias_grads.push_back(HostTensor::copy_of(g.fc1.bias_grad.view()));
      bias_grads.push_back(HostTensor::copy_of(g.fc2.bias_grad.view()));
    }
    EXPECT_EQ(e.mlp->pending_wgrads(), 0u);
    return bias_grads;
  };
  Env refused(/*delay=*/true), fresh(/*delay=*/true);
  const auto got = good_steps(refused, [&] { EXPECT_THROW(GetParam().call(refused), st::Error); });
  const auto want = good_steps(fresh, [] {});
  EXPECT_TRUE(refused.c.mg1.bytes_equal(fresh.c.mg1)) << "fc1 main_grad differs from a fresh MLP's";
  EXPECT_TRUE(refused.c.mg2.bytes_equal(fresh.c.mg2)) << "fc2 main_grad differs from a fresh MLP's";
  for (size_t i = 0; i < want.size(); ++i) EXPECT_TRUE(got[i].bytes_equal(want[i])) << "bias grad " << i;
}

INSTANTIATE_TEST_SUITE_P(Cases, GroupedMLPBadCall, ::testing::ValuesIn(kCallCases),
                         [](const auto& param_info) { return std::string(param_info.param.name); });

namespace {

struct CtorCase {
  const char* name;
  std::function<void(GroupedMLPCase&, st::GroupedMLPOptions&, st::GroupedMLPParams&, const HostTensor& big)> edit;
  const char* expected_message;
};

st::GroupedParam packed_view(const HostTensor& big, std::initializer_list<int64_t> shape, st::DType dtype) {
  return st::GroupedParam::packed(st::TensorView::contiguous(big.data(), dtype, shape.begin(), int(shape.size())));
}

// small_case: G 4, in 6, F 5, out 7, bf16, both biases, fused main_grad.
const CtorCase kCtorCases[] = {
    {"Fc1OddWidth", [](auto&, auto&, auto& p, const auto& big) { p.fc1.weight = packed_view(big, {4, 11, 6}, st::DType::kBF16); },
     "fc1.weight: expected packed shape [4 (num_groups), 10 (2 * ffn_features), 6 (in_features)], got [4, 11, 6]"},
    {"Fc1InFeaturesMismatch", [](auto&, auto&, auto& p, const auto& big) { p.fc1.weight = packed_view(big, {4, 10, 5}, st::DType::kBF16); },
     "fc1.weight: expected packed shape [4 (num_groups), 10 (2 * ffn_features), 6 (in_features)], got [4, 10, 5]"},
    {"Fc2InFeaturesNotF", [](auto&, auto&, auto& p, const auto& big) { p.fc2.weight = packed_view(big, {4, 7, 10}, st::DType::kBF16); },
     "fc2.weight: expected packed shape [4 (num_groups), 7 (out_features), 5 (ffn_features)], got [4, 7, 10]"},
    {"Fc2FewerGroups", [](auto&, auto&, auto& p, const auto& big) { p.fc2.weight = packed_view(big, {3, 7, 5}, st::DType::kBF16); },
     "fc2.weight: expected packed shape [4 (num_groups), 7 (out_features), 5 (ffn_features)], got [3, 7, 5]"},
    {"Fc2Fp16", [](auto&, auto&, auto& p, const auto& big) { p.fc2.weight = packed_view(big, {4, 7, 5}, st::DType::kFP16); },
     "fc2.weight: expected dtype bf16, got fp16"},
    {"Fc2WeightMissing", [](auto&, auto&, auto& p, const auto&) { p.fc2.weight = {}; },
     "fc2.weight: expected per-group or packed tensors, got none"},
    {"Fc2BiasWrongWidth", [](auto&, auto&, auto& p, const auto& big) { p.fc2.bias = packed_view(big, {4, 8}, st::DType::kBF16); },
     "fc2.bias: expected packed shape [4 (num_groups), 7 (out_features)], got [4, 8]"},
    {"Fc1BiasWrongWidth", [](auto&, auto&, auto& p, const auto& big) { p.fc1.bias = packed_view(big, {4, 5}, st::DType::kBF16); },
     "fc1.bias: expected packed shape [4 (num_groups), 10], got [4, 5]"},
    {"Fc1MainGradMissing", [](auto&, auto&, auto& p, const auto&) { p.fc1.main_grad = {}; },
     "fc1.main_grad: expected fp32 per-group or packed tensors (fuse_wgrad_accumulation is true), got none"},
    {"Fc2MainGradBf16", [](auto&, auto&, auto& p, const auto& big) { p.fc2.main_grad = packed_view(big, {4, 7, 5}, st::DType::kBF16); },
     "fc2.main_grad: expected dtype fp32, got bf16"},
    {"FNotAMultipleOfTheInterleave", [](auto&, auto& o, auto&, const auto&) { o.glu_interleave_size = 2; },
     "glu_interleave_size: expected a divisor of ffn_features = 5, got 2"},
    {"NegativeInterleave", [](auto&, auto& o, auto&, const auto&) { o.glu_interleave_size = -1; },
     "glu_interleave_size: expected >= 0"},
    {"OverwriteWithoutFusion", [](auto&, auto& o, auto&, const auto&) { o.fuse_wgrad_accumulation = false; o.overwrite_main_grad = true; },
     "overwrite_main_grad: expected false unless fuse_wgrad_accumulation is true, got true"},
    {"NoFfnFeatures", [](auto&, auto& o, auto&, const auto&) { o.ffn_features = 0; },
     "ffn_features: expected >= 1, got 0"},
};

class GroupedMLPBadConstruction : public ::testing::TestWithParam<CtorCase> {};

}  // namespace

TEST_P(GroupedMLPBadConstruction, RaisesAClearError) {
  GroupedMLPCase c = small_case(st::DType::kBF16);
  c.fuse = true;
  st::GroupedMLPOptions o = c.options();
  st::GroupedMLPParams p = c.params();
  const HostTensor big(st::DType::kFP32, {4096});
  GetParam().edit(c, o, p, big);
  st::testing::PoisonAllocator alloc;
  const std::string msg = expect_error([&] { st::GroupedMLP mlp(o, p, &alloc); });
  EXPECT_NE(msg.find(GetParam().expected_message), std::string::npos) << "message: " << msg;
  EXPECT_EQ(alloc.allocations, 0);
}

INSTANTIATE_TEST_SUITE_P(Cases, GroupedMLPBadConstruction, ::testing::ValuesIn(kCtorCases),
                         [](const auto& param_info) { return std::string(param_info.param.name); });

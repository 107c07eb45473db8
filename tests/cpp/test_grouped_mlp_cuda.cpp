// GPU tests of the CUDA GroupedMLP (skipped, visibly, without a GPU): forward and backward
// against the double-precision oracle on fresh random data — vectorised and scalar activation
// paths (halves, interleaved blocks of 8, blocks of 3), bf16 / fp16 / fp32, biases, empty experts,
// a padded tail, G = 128 — outputs poisoned first, bitwise repeatability, fused main_grad, and a
// CUDA graph of forward + backward replayed with new split values.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "device_tensor.h"
#include "grouped_mlp_case.h"
#include "sparsetrain/grouped_mlp.h"

namespace st = sparsetrain;
using st::testing::Bounded;
using st::testing::DeviceTensor;
using st::testing::GroupedMLPCase;
using st::testing::HostTensor;
using st::testing::MisalignedBuffer;
using st::testing::PoolAllocator;
using st::testing::to_host;

namespace {

struct Shape {
  st::DType dtype;
  int64_t G, T, S, in, F, out, k;
  std::vector<int64_t> empty;
  bool packed, bias1, bias2, device_splits;
};

const Shape kShapes[] = {
    {st::DType::kBF16, 8, 301, 290, 64, 96, 72, 0, {3}, true, false, true, true},     // TMA GEMMs, vector
    {st::DType::kBF16, 4, 131, 131, 40, 64, 48, 8, {}, false, true, true, false},     // interleaved by 8
    {st::DType::kFP16, 5, 97, 89, 24, 30, 40, 3, {0, 2}, true, false, true, true},    // scalar activation
    {st::DType::kFP32, 3, 67, 60, 16, 20, 12, 0, {}, true, true, false, true},        // fp32, vector of 4
    {st::DType::kBF16, 128, 1031, 1000, 32, 48, 40, 0, {5, 77}, true, true, true, true},  // G = 128
};

std::string shape_name(const Shape& s) {
  return std::string(st::dtype_name(s.dtype)) + "_G" + std::to_string(s.G) + "_T" + std::to_string(s.T) + "_S" +
         std::to_string(s.S) + "_F" + std::to_string(s.F) + "_k" + std::to_string(s.k) + (s.bias1 ? "_b1" : "") +
         (s.bias2 ? "_b2" : "") + (s.device_splits ? "_devicesplits" : "_hostsplits");
}
void PrintTo(const Shape& s, std::ostream* os) { *os << shape_name(s); }

GroupedMLPCase make_case(const Shape& s, uint64_t seed = 3) {
  return st::testing::random_mlp_case(s.dtype, s.G, s.T, s.S, s.in, s.F, s.out, s.k, s.empty, s.packed, s.bias1,
                                      s.bias2, seed);
}

// The case's parameters and inputs on the GPU, and the layer over them.
struct CudaMLP {
  DeviceTensor x, probs, dy, w1, b1, w2, b2, mg1, mg2, splits, status;
  std::unique_ptr<st::GroupedMLP> mlp;
  CudaMLP(const GroupedMLPCase& c, st::GroupedMLPOptions o, st::Allocator* alloc = nullptr)
      : x(c.x), probs(c.probs), dy(c.dy), w1(c.w1), b1(c.b1), w2(c.w2), b2(c.b2), mg1(c.mg1), mg2(c.mg2) {
    HostTensor s(st::DType::kInt64, {c.G}), z(st::DType::kInt32, {1});
    for (int64_t g = 0; g < c.G; ++g) s.set(g, double(c.splits[size_t(g)]));
    z.set(0, 0);
    splits = DeviceTensor(s);
    status = DeviceTensor(z);
    auto grouped = [&](const st::TensorView& v) {
      if (c.packed) return st::GroupedParam::packed(v);
      std::vector<st::TensorView> views;
      for (int64_t g = 0; g < c.G; ++g) views.push_back(v.select(g));
      return st::GroupedParam::per_group(views);
    };
    st::GroupedMLPParams p;
    p.fc1.weight = grouped(w1.view());
    p.fc2.weight = grouped(w2.view());
    if (c.bias1) p.fc1.bias = grouped(b1.view());
    if (c.bias2) p.fc2.bias = grouped(b2.view());
    if (o.fuse_wgrad_accumulation) {
      p.fc1.main_grad = grouped(mg1.view());
      p.fc2.main_grad = grouped(mg2.view());
    }
    mlp = std::make_unique<st::GroupedMLP>(o, p, alloc);
  }
  st::Splits device_splits() const { return st::Splits::device(splits.view(), status.view()); }
};

void expect_ok(const st::testing::CompareResult& r) { EXPECT_TRUE(r.ok) << r.first_failure; }

HostTensor head(const st::TensorView& t, int64_t rows) { return to_host(t.rows(0, rows)); }

void expect_tail_zero(const st::TensorView& t, int64_t from_row, const char* what) {
  const HostTensor h = to_host(t);
  const int64_t row = t.dim() > 1 ? t.size(1) : 1;
  for (int64_t i = from_row * row; i < h.numel(); ++i) ASSERT_EQ(h.get(i), 0.0) << what << ": tail element " << i;
}

class GroupedMLPCuda : public ::testing::TestWithParam<Shape> {};

}  // namespace

TEST_P(GroupedMLPCuda, MatchesTheOracleAndIsBitwiseRepeatable) {
  REQUIRE_GPU();
  const Shape& s = GetParam();
  const GroupedMLPCase c = make_case(s);
  const int64_t S = c.rows_used();
  CudaMLP L(c, c.options());
  const st::Splits sp = s.device_splits ? L.device_splits() : st::Splits::host(c.splits);
  const auto oracle = c.oracle();

  // Caller out buffer poisoned with NaN: rows < S written, the rest untouched.
  HostTensor poison(c.dtype, {c.T, c.out});
  poison.poison();
  const DeviceTensor out(poison);
  const st::GroupedMLPForward fwd = L.mlp->forward(L.x.view(), sp, L.probs.view(), out.view());
  const auto f = oracle.forward();
  expect_ok(st::testing::compare_bounded(head(fwd.fc1_out.view(), S), f.fc1_out, c.dtype, "fc1_out"));
  expect_ok(st::testing::compare_bounded(head(out.view(), S), f.out, c.dtype, "out"));
  const HostTensor outh = to_host(out.view());
  for (int64_t i = S * c.out; i < outh.numel(); ++i) ASSERT_TRUE(std::isnan(outh.get(i))) << "out tail written";

  const st::GroupedMLPGrads g =
      L.mlp->backward(L.x.view(), fwd.fc1_out.view(), L.probs.view(), L.dy.view(), sp);
  const auto b = oracle.backward(to_host(fwd.fc1_out.view()).to_double());
  expect_ok(st::testing::compare_bounded(head(g.grad_input.view(), S), b.dx, c.dtype, "dx"));
  expect_tail_zero(g.grad_input.view(), S, "dx");
  expect_ok(st::testing::compare_bounded(head(g.dprobs.view(), S), b.dprobs, st::DType::kFP32, "dprobs"));
  expect_tail_zero(g.dprobs.view(), S, "dprobs");
  for (int64_t grp = 0; grp < c.G; ++grp) {
    const std::string n = "[" + std::to_string(grp) + "]";
    expect_ok(st::testing::compare_bounded(to_host(g.fc1.weight.per_group[size_t(grp)].view()), b.dw1[size_t(grp)],
                                           c.dtype, "dW1" + n));
    expect_ok(st::testing::compare_bounded(to_host(g.fc2.weight.per_group[size_t(grp)].view()), b.dw2[size_t(grp)],
                                           c.dtype, "dW2" + n));
    if (c.bias1)
      expect_ok(st::testing::compare_bounded(to_host(g.fc1.bias_grad.view().select(grp)), b.db1[size_t(grp)],
                                             c.dtype, "db1" + n));
    if (c.bias2)
      expect_ok(st::testing::compare_bounded(to_host(g.fc2.bias_grad.view().select(grp)), b.db2[size_t(grp)],
                                             c.dtype, "db2" + n));
  }

  // Bitwise repeatability of every output.
  const st::GroupedMLPForward fwd2 = L.mlp->forward(L.x.view(), sp, L.probs.view());
  EXPECT_TRUE(head(fwd2.out.view(), S).bytes_equal(head(out.view(), S)));
  const st::GroupedMLPGrads g2 =
      L.mlp->backward(L.x.view(), fwd.fc1_out.view(), L.probs.view(), L.dy.view(), sp);
  EXPECT_TRUE(to_host(g2.grad_input.view()).bytes_equal(to_host(g.grad_input.view())));
  EXPECT_TRUE(to_host(g2.dprobs.view()).bytes_equal(to_host(g.dprobs.view())));
  EXPECT_TRUE(to_host(g2.fc1.weight.packed.view()).bytes_equal(to_host(g.fc1.weight.packed.view())));
  EXPECT_TRUE(to_host(g2.fc2.weight.packed.view()).bytes_equal(to_host(g.fc2.weight.packed.view())));
}

INSTANTIATE_TEST_SUITE_P(Cuda, GroupedMLPCuda, ::testing::ValuesIn(kShapes),
                         [](const ::testing::TestParamInfo<Shape>& i) { return shape_name(i.param); });

// Both layers' wgrads accumulated into fp32 main_grad, one expert empty (its main_grad untouched).
TEST(GroupedMLPCudaContract, MainGradAccumulatesForBothLayers) {
  REQUIRE_GPU();
  const GroupedMLPCase c = make_case({st::DType::kBF16, 4, 150, 140, 32, 40, 24, 0, {1}, true, false, true, true});
  GroupedMLPCase fused = c;
  fused.fuse = true;
  CudaMLP L(fused, fused.options());
  const st::Splits sp = L.device_splits();
  const st::GroupedMLPForward fwd = L.mlp->forward(L.x.view(), sp, L.probs.view());
  const st::GroupedMLPGrads g = L.mlp->backward(L.x.view(), fwd.fc1_out.view(), L.probs.view(), L.dy.view(), sp);
  EXPECT_EQ(g.fc1.weight.kind, st::WeightGradKind::kNone);
  EXPECT_EQ(g.fc2.weight.kind, st::WeightGradKind::kNone);
  const auto b = c.oracle().backward(to_host(fwd.fc1_out.view()).to_double());
  const HostTensor mg1 = to_host(L.mg1.view()), mg2 = to_host(L.mg2.view());
  for (int64_t grp = 0; grp < c.G; ++grp) {
    const HostTensor before1 = HostTensor::copy_of(c.mg1.view().select(grp));
    const HostTensor before2 = HostTensor::copy_of(c.mg2.view().select(grp));
    const HostTensor after1 = HostTensor::copy_of(mg1.view().select(grp));
    const HostTensor after2 = HostTensor::copy_of(mg2.view().select(grp));
    if (grp == 1) {
      EXPECT_TRUE(after1.bytes_equal(before1) && after2.bytes_equal(before2)) << "empty expert's main_grad touched";
      continue;
    }
    const std::vector<double> base1 = before1.to_double(), base2 = before2.to_double();
    expect_ok(st::testing::compare_bounded(after1, b.dw1[size_t(grp)], st::DType::kFP32, "main_grad1", &base1));
    expect_ok(st::testing::compare_bounded(after2, b.dw2[size_t(grp)], st::DType::kFP32, "main_grad2", &base2));
  }
}

// Caller out and grad_input whose base is one element off a 16-byte boundary, on shapes the TMA
// path takes (in, F, out multiples of 8): fc2 stores into out through the direct-store twins of
// the sm90 kernels and the MLP adds the probs-scaled fc2 bias there, fc1's dgrad writes
// grad_input. GroupedMLP follows GroupedLinear's caller-buffer contract (docs/DESIGN.md section
// 4): rows < S bit-identical to the library-allocated path, rows >= S untouched (poisoned), and
// nothing else changed (fc1_out, dprobs, both wgrads). Host and device splits, with and without
// biases.
TEST(GroupedMLPCudaContract, MisalignedCallerBuffersAreBitIdenticalToTheAlignedPath) {
  REQUIRE_GPU();
  for (st::DType dtype : {st::DType::kBF16, st::DType::kFP16})
    for (bool bias : {true, false})
      for (bool device_splits : {false, true}) {
        SCOPED_TRACE(std::string(st::dtype_name(dtype)) + (bias ? " biases" : " no biases") +
                     (device_splits ? " device splits" : " host splits"));
        const GroupedMLPCase c =
            make_case({dtype, 4, 515, 500, 256, 192, 128, 0, {2}, true, bias, bias, device_splits});
        const int64_t S = c.rows_used();
        const size_t es = st::dtype_size(dtype);
        CudaMLP L(c, c.options());
        const st::Splits sp = device_splits ? L.device_splits() : st::Splits::host(c.splits);
        const st::GroupedMLPForward fwd = L.mlp->forward(L.x.view(), sp, L.probs.view());
        const st::GroupedMLPGrads g = L.mlp->backward(L.x.view(), fwd.fc1_out.view(), L.probs.view(), L.dy.view(), sp);
        const HostTensor y = to_host(fwd.out.view()), fc1_out = to_host(fwd.fc1_out.view());
        const HostTensor dx = to_host(g.grad_input.view()), dprobs = to_host(g.dprobs.view());
        const MisalignedBuffer out_buf(dtype, c.T, c.out), gin_buf(dtype, c.T, c.in);
        const st::TensorView &out = out_buf.view, &gin = gin_buf.view;
        ASSERT_NE(reinterpret_cast<uintptr_t>(out.data()) % 16, 0u);
        ASSERT_NE(reinterpret_cast<uintptr_t>(gin.data()) % 16, 0u);
        const st::GroupedMLPForward fwd_off = L.mlp->forward(L.x.view(), sp, L.probs.view(), out);
        const st::GroupedMLPGrads g_off =
            L.mlp->backward(L.x.view(), fwd.fc1_out.view(), L.probs.view(), L.dy.view(), sp, gin);
        const HostTensor outh = to_host(out), ginh = to_host(gin);
        EXPECT_EQ(std::memcmp(outh.data(), y.data(), size_t(S * c.out) * es), 0) << "misaligned out vs aligned path";
        EXPECT_EQ(std::memcmp(ginh.data(), dx.data(), size_t(S * c.in) * es), 0) << "misaligned grad_input vs aligned";
        for (int64_t i = S * c.out; i < outh.numel(); ++i) ASSERT_TRUE(std::isnan(outh.get(i))) << "out tail written";
        for (int64_t i = S * c.in; i < ginh.numel(); ++i)
          ASSERT_TRUE(std::isnan(ginh.get(i))) << "grad_input tail written";
        EXPECT_TRUE(to_host(fwd_off.fc1_out.view()).bytes_equal(fc1_out)) << "fc1_out with a misaligned out";
        EXPECT_TRUE(to_host(g_off.dprobs.view()).bytes_equal(dprobs)) << "dprobs with a misaligned grad_input";
        EXPECT_TRUE(to_host(g_off.fc1.weight.packed.view()).bytes_equal(to_host(g.fc1.weight.packed.view()))) << "dW1";
        EXPECT_TRUE(to_host(g_off.fc2.weight.packed.view()).bytes_equal(to_host(g.fc2.weight.packed.view()))) << "dW2";
      }
}

// Forward + backward captured once (caller buffers and workspace, device splits), replayed after
// new split values with the same T: every replay matches the oracle of its splits.
TEST(GroupedMLPCudaGraph, ReplaysWithNewSplitValues) {
  REQUIRE_GPU();
  GroupedMLPCase c = make_case({st::DType::kBF16, 4, 200, 200, 32, 48, 40, 8, {}, true, true, true, true});
  PoolAllocator pool(size_t(8) << 20);
  CudaMLP L(c, c.options(), &pool);
  HostTensor poison_out(c.dtype, {c.T, c.out}), poison_in(c.dtype, {c.T, c.in});
  const DeviceTensor out(poison_out, false), gin(poison_in, false);
  const size_t ws_bytes = L.mlp->workspace_size(c.T);
  HostTensor ws_host(st::DType::kInt32, {int64_t(ws_bytes / 4) + 64});
  const DeviceTensor ws(ws_host, false);
  cudaStream_t stream;
  CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  st::CallArgs args;
  args.stream.handle = stream;
  args.workspace = {ws.view().data(), ws_bytes};
  // Library allocations inside the capture (fc1_out, intermediates, dprobs, weight grads) come
  // from the pool: fixed addresses that every replay rewrites.
  cudaGraph_t graph;
  st::GroupedMLPForward fwd;
  st::GroupedMLPGrads g;
  CUDA_OK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  fwd = L.mlp->forward(L.x.view(), L.device_splits(), L.probs.view(), out.view(), args);
  g = L.mlp->backward(L.x.view(), fwd.fc1_out.view(), L.probs.view(), L.dy.view(), L.device_splits(), gin.view(),
                      args);
  CUDA_OK(cudaStreamEndCapture(stream, &graph));
  cudaGraphExec_t exec;
  CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
  for (const std::vector<int64_t>& splits :
       {std::vector<int64_t>{50, 50, 50, 50}, std::vector<int64_t>{0, 199, 1, 0}, std::vector<int64_t>{120, 0, 7, 73}}) {
    HostTensor s(st::DType::kInt64, {c.G});
    for (int64_t grp = 0; grp < c.G; ++grp) s.set(grp, double(splits[size_t(grp)]));
    // On the replay's stream: a cudaMemcpy from pageable memory may return before its copy lands,
    // and a non-blocking stream does not wait for it (seen once: a replay with the old splits).
    CUDA_OK(cudaMemcpyAsync(L.splits.view().data(), s.data(), size_t(c.G) * 8, cudaMemcpyHostToDevice, stream));
    CUDA_OK(cudaGraphLaunch(exec, stream));
    CUDA_OK(cudaStreamSynchronize(stream));
    c.splits = splits;
    const auto oracle = c.oracle();
    expect_ok(st::testing::compare_bounded(to_host(out.view()), oracle.forward().out, c.dtype, "replayed out"));
    const auto b = oracle.backward(to_host(fwd.fc1_out.view()).to_double());
    expect_ok(st::testing::compare_bounded(to_host(gin.view()), b.dx, c.dtype, "replayed dx"));
    expect_ok(st::testing::compare_bounded(to_host(g.dprobs.view()), b.dprobs, st::DType::kFP32, "replayed dprobs"));
    for (int64_t grp = 0; grp < c.G; ++grp)
      expect_ok(st::testing::compare_bounded(to_host(g.fc2.weight.per_group[size_t(grp)].view()), b.dw2[size_t(grp)],
                                             c.dtype, "replayed dW2"));
  }
  CUDA_OK(cudaGraphExecDestroy(exec));
  CUDA_OK(cudaGraphDestroy(graph));
  CUDA_OK(cudaStreamDestroy(stream));
}


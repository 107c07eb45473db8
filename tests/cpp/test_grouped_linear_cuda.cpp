// GPU tests of the CUDA GroupedLinear (skipped, visibly, without a GPU): CUDA vs the double
// oracle on fresh random data for odd shapes and every mode, outputs poisoned first, padded
// tails, bitwise repeatability, main_grad fusion with empty experts, invalid device splits, and
// CUDA-graph capture of forward + backward replayed with different split values.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstdlib>
#include <utility>

#include "device_tensor.h"
#include "grouped_linear_case.h"
#include "sparsetrain/error.h"
#include "sparsetrain/runtime.h"

namespace st = sparsetrain;
using st::testing::GroupedLinearCase;
using st::testing::DeviceTensor;
using st::testing::HostTensor;
using st::testing::MisalignedBuffer;
using st::testing::to_host;

namespace {

struct Shape {
  st::DType dtype;
  int64_t G, T, S, in, out;
  std::vector<int64_t> empty;
  bool packed, bias, device_splits;
};

const Shape kShapes[] = {
    {st::DType::kBF16, 8, 1031, 1000, 256, 384, {5}, true, false, true},
    {st::DType::kFP16, 8, 1031, 1031, 200, 136, {2}, false, true, false},   // not multiples of 128
    {st::DType::kBF16, 1, 257, 257, 96, 64, {}, true, true, true},
    {st::DType::kBF16, 128, 4099, 4000, 64, 48, {5, 77}, true, false, true}, // G = 128
    {st::DType::kFP16, 5, 97, 89, 13, 37, {0, 3}, false, true, true},        // not multiples of 8
    {st::DType::kBF16, 3, 61, 0, 16, 24, {0, 1, 2}, true, true, false},      // only a padded tail
    // G > 128 with host splits covering every row: the set-up kernel's largest parameter tables,
    // no tail launch.
    {st::DType::kBF16, 300, 1500, 1500, 64, 48, {7, 150}, true, false, false},
    // fp32 runs the SIMT kernel on every GPU, host splits folded into its parameters at each table
    // capacity (16, 128, 512 groups), two with padded tails (their zeros read the offsets it wrote).
    {st::DType::kFP32, 4, 70, 70, 24, 40, {1}, false, true, false},
    {st::DType::kFP32, 40, 333, 300, 16, 24, {3, 39}, true, true, false},
    {st::DType::kFP32, 200, 900, 800, 16, 8, {0, 199}, true, false, false},
};

std::string shape_name(const Shape& s) {
  return std::string(st::dtype_name(s.dtype)) + "_G" + std::to_string(s.G) + "_T" + std::to_string(s.T) + "_S" +
         std::to_string(s.S) + "_in" + std::to_string(s.in) + "_out" + std::to_string(s.out) +
         (s.packed ? "_packed" : "") + (s.bias ? "_bias" : "") + (s.device_splits ? "_devicesplits" : "_hostsplits");
}
void PrintTo(const Shape& s, std::ostream* os) { *os << shape_name(s); }

GroupedLinearCase make_case(const Shape& s) {
  return st::testing::random_case(s.dtype, s.G, s.T, s.S, s.in, s.out, s.empty, s.packed, s.bias, 3);
}

// The case's parameters copied to the GPU, and the layer over them.
struct CudaLayer {
  DeviceTensor w, b, mg, splits, status;
  std::unique_ptr<st::GroupedLinear> layer;
  CudaLayer(const GroupedLinearCase& c, st::GroupedLinearOptions o) : w(c.w), b(c.b), mg(c.main_grad) {
    HostTensor s(st::DType::kInt64, {c.G}), z(st::DType::kInt32, {1});
    for (int64_t g = 0; g < c.G; ++g) s.set(g, double(c.splits[size_t(g)]));
    z.set(0, 0);
    splits = DeviceTensor(s);
    status = DeviceTensor(z);
    st::GroupedLinearParams p;
    auto grouped = [&](const st::TensorView& v) {
      if (c.packed_weight) return st::GroupedParam::packed(v);
      std::vector<st::TensorView> views;
      for (int64_t g = 0; g < c.G; ++g) views.push_back(v.select(g));
      return st::GroupedParam::per_group(views);
    };
    p.weight = grouped(w.view());
    if (c.bias) p.bias = grouped(b.view());
    if (o.fuse_wgrad_accumulation) p.main_grad = grouped(mg.view());
    p.has_grad_added_to_main_grad = c.has_attr;
    layer = std::make_unique<st::GroupedLinear>(o, p);
  }
  st::Splits device_splits() const { return st::Splits::device(splits.view(), status.view()); }
};

void expect_ok(const st::testing::CompareResult& r) { EXPECT_TRUE(r.ok) << r.first_failure; }

void expect_tail_zero(const HostTensor& h, int64_t S, int64_t cols) {
  for (int64_t i = S * cols; i < h.numel(); ++i) ASSERT_EQ(h.get(i), 0.0) << "tail element " << i;
}

// Forward, backward (wgrad into dW) against the oracle, tails, caller buffers, repeatability.
void check_against_oracle(const Shape& s) {
  GroupedLinearCase c = make_case(s);
  const auto oracle = c.oracle();
  const int64_t S = oracle.rows_used();
  CudaLayer L(c, c.options());
  const DeviceTensor x(c.x), dy(c.dy);
  const st::Splits sp = s.device_splits ? L.device_splits() : st::Splits::host(c.splits);
  // Library outputs come from cudaMallocAsync: poison-free, so check every element is written
  // through the caller-buffer path below too (poisoned with NaN).
  const st::Tensor y = L.layer->forward(x.view(), sp);
  const HostTensor yh = to_host(y.view());
  expect_ok(st::testing::compare_with_oracle(yh, oracle.forward(), c.dtype, 1, "y"));
  expect_tail_zero(yh, S, c.out);
  const auto g = L.layer->backward(x.view(), dy.view(), sp);
  const HostTensor dxh = to_host(g.grad_input.view());
  expect_ok(st::testing::compare_with_oracle(dxh, oracle.dgrad(), c.dtype, 1, "dx"));
  expect_tail_zero(dxh, S, c.in);
  for (int64_t gi = 0; gi < c.G; ++gi) {
    EXPECT_EQ(reinterpret_cast<uintptr_t>(g.weight.per_group[size_t(gi)].view().data()) % 256, 0u);
    expect_ok(st::testing::compare_with_oracle(to_host(g.weight.per_group[size_t(gi)].view()), oracle.wgrad(gi),
                                               c.dtype, 1, "dW[" + std::to_string(gi) + "]"));
    if (c.bias)
      expect_ok(st::testing::compare_with_oracle(to_host(g.bias_grad.view().select(gi)), oracle.bias_grad(gi), c.dtype,
                                                 1, "db"));
  }
  // Caller buffers poisoned with NaN: rows < S written bit-identically, the rest untouched.
  HostTensor poison_out(c.dtype, {c.T, c.out}), poison_in(c.dtype, {c.T, c.in});
  poison_out.poison();
  poison_in.poison();
  const DeviceTensor out(poison_out), gin(poison_in);
  L.layer->forward(x.view(), sp, out.view());
  L.layer->backward(x.view(), dy.view(), sp, gin.view());
  const HostTensor outh = to_host(out.view()), ginh = to_host(gin.view());
  const size_t es = st::dtype_size(c.dtype);
  EXPECT_EQ(std::memcmp(outh.data(), yh.data(), size_t(S * c.out) * es), 0) << "out vs library path";
  EXPECT_EQ(std::memcmp(ginh.data(), dxh.data(), size_t(S * c.in) * es), 0) << "grad_input vs library path";
  for (int64_t i = S * c.out; i < outh.numel(); ++i) ASSERT_TRUE(std::isnan(outh.get(i))) << "out tail written";
  for (int64_t i = S * c.in; i < ginh.numel(); ++i) ASSERT_TRUE(std::isnan(ginh.get(i))) << "grad_input tail written";
  // Bitwise repeatability.
  const auto g2 = L.layer->backward(x.view(), dy.view(), sp);
  EXPECT_TRUE(to_host(g2.grad_input.view()).bytes_equal(dxh));
  EXPECT_TRUE(to_host(g2.weight.packed.view()).bytes_equal(to_host(g.weight.packed.view())));
  EXPECT_TRUE(to_host(L.layer->forward(x.view(), sp).view()).bytes_equal(yh));
}

// main_grad fused into wgrad (accumulate, then overwrite) with expert 1 empty: accumulated
// main_grad of an empty expert untouched bitwise, overwritten one zeroed.
void check_main_grad(st::DType dtype, int64_t T = 77, int64_t in = 40, int64_t out = 24) {
  for (bool overwrite : {false, true}) {
    SCOPED_TRACE(std::string("T ") + std::to_string(T) + " in " + std::to_string(in) + " out " + std::to_string(out) +
                 (overwrite ? " overwrite" : " accumulate"));
    GroupedLinearCase c = make_case({dtype, 4, T, T - 7, in, out, {1}, true, true, true});
    c.fuse = true;
    c.overwrite = overwrite;
    c.main_grad.set(1 * c.out * c.in + 2, -0.0);
    CudaLayer L(c, c.options());
    const DeviceTensor x(c.x), dy(c.dy);
    const auto g = L.layer->backward(x.view(), dy.view(), L.device_splits());
    EXPECT_EQ(g.weight.kind, st::WeightGradKind::kNone);
    const HostTensor mg = to_host(L.mg.view());
    const auto oracle = c.oracle();
    for (int64_t gi = 0; gi < c.G; ++gi) {
      const HostTensor before = HostTensor::copy_of(c.main_grad.view().select(gi));
      const HostTensor after = HostTensor::copy_of(mg.view().select(gi));
      if (gi == 1) {
        if (overwrite) {
          for (int64_t i = 0; i < after.numel(); ++i) ASSERT_EQ(after.get(i), 0.0);
        } else {
          EXPECT_TRUE(after.bytes_equal(before)) << "an empty expert's main_grad is untouched";
        }
        continue;
      }
      const std::vector<double> base = before.to_double();
      expect_ok(st::testing::compare_with_oracle(after, oracle.wgrad(gi, overwrite ? nullptr : &base), st::DType::kFP32,
                                                 2, "main_grad"));
    }
  }
}

// An environment variable set for the scope (the backend reads these switches at every call).
struct ScopedEnv {
  ScopedEnv(const char* name, const char* value) : name_(name) { setenv(name, value, 1); }
  ~ScopedEnv() { unsetenv(name_); }
  const char* name_;
};

// Forces the sm90 tile walk for the scope (the heuristic otherwise picks it from the shapes).
struct TuningOverride {
  TuningOverride(const char* raster, const char* swizzle)
      : raster_("SPARSETRAIN_SM90_RASTER", raster), swizzle_("SPARSETRAIN_SM90_SWIZZLE", swizzle) {}
  ScopedEnv raster_, swizzle_;
};

class GroupedLinearCuda : public ::testing::TestWithParam<Shape> {};

}  // namespace

TEST_P(GroupedLinearCuda, MatchesTheOracleWithTailsAndIsBitwiseRepeatable) {
  REQUIRE_GPU();
  check_against_oracle(GetParam());
}

// The sm90 kernels (fprop with and without bias, dgrad, wgrad, main_grad; bf16 and fp16) under
// every tile walk, on shapes with a prime T, an empty expert, a padded tail and several tiles
// per group in M and in N for every pass (about 370 rows per expert, out = 264, in = 520).
TEST(GroupedLinearCudaTuning, EveryTileWalkMatchesTheOracle) {
  REQUIRE_GPU();
  for (const auto& [raster, swizzle] : {std::pair{"m", "1"}, std::pair{"n", "1"}, std::pair{"m", "4"}}) {
    SCOPED_TRACE(std::string("raster ") + raster + ", swizzle " + swizzle);
    TuningOverride force(raster, swizzle);
    for (st::DType dtype : {st::DType::kBF16, st::DType::kFP16}) {
      for (bool bias : {false, true}) {
        SCOPED_TRACE(std::string(st::dtype_name(dtype)) + (bias ? " bias" : ""));
        check_against_oracle({dtype, 5, 1499, 1480, 520, 264, {2}, true, bias, true});
      }
      check_main_grad(dtype, 613, 520, 264);
    }
  }
}

// Tiny problems take the SIMT kernel by default (fewer launches); the same shapes pinned to each
// path, every pass against the oracle: a padded tail, an empty expert, bias, device splits.
TEST(GroupedLinearCudaSizeRule, TinyProblemsMatchTheOracleOnBothPaths) {
  REQUIRE_GPU();
  for (const char* max_macs : {"0", "1000000000000"}) {
    SCOPED_TRACE(std::string("SPARSETRAIN_GEMM_SIMT_MAX_MACS=") + max_macs);
    // The tiny-problem size rule's threshold (arch::simt_by_size): "0" lets every size take the
    // sm90 kernels, a huge value sends every size to the SIMT ones.
    ScopedEnv pin("SPARSETRAIN_GEMM_SIMT_MAX_MACS", max_macs);
    check_against_oracle({st::DType::kBF16, 3, 61, 0, 16, 24, {0, 1, 2}, true, true, false});
    check_against_oracle({st::DType::kBF16, 4, 16, 16, 64, 64, {}, true, true, false});
    check_against_oracle({st::DType::kFP16, 4, 50, 41, 16, 8, {1}, false, false, true});
  }
}

// The fprop's and dgrad's one-CTA-cluster twins (ALL builds; the default for this 520 x 776
// weight; forced both ways here, so MINIMAL builds run the 2x1 kernels twice): the twins against
// the oracle (poisoned caller buffers, tails), and the two forwards and the two input gradients
// bitwise equal (so the 2x1 kernels pass it too). Several row tiles per expert, an odd count in
// some (a 2x1 cluster's idle partner), empty experts and a prime T.
TEST(GroupedLinearCudaTuning, NoClusterTwinsAreBitIdenticalToTheClusterKernels) {
  REQUIRE_GPU();
  for (st::DType dtype : {st::DType::kBF16, st::DType::kFP16}) {
    for (bool bias : {false, true}) {
      SCOPED_TRACE(std::string(st::dtype_name(dtype)) + (bias ? " bias" : ""));
      const Shape s{dtype, 7, 1613, 1560, 776, 520, {0, 4}, true, bias, true};
      std::vector<HostTensor> y, dx;
      for (const char* cluster : {"1", "2"}) {
        SCOPED_TRACE(std::string("SPARSETRAIN_SM90_CLUSTER=") + cluster);
        ScopedEnv pin("SPARSETRAIN_SM90_CLUSTER", cluster);
        if (y.empty()) check_against_oracle(s);
        GroupedLinearCase c = make_case(s);
        CudaLayer L(c, c.options());
        const DeviceTensor x(c.x), dy(c.dy);
        y.push_back(to_host(L.layer->forward(x.view(), L.device_splits()).view()));
        dx.push_back(to_host(L.layer->backward(x.view(), dy.view(), L.device_splits()).grad_input.view()));
      }
      EXPECT_TRUE(y[0].bytes_equal(y[1])) << "forward: one-CTA clusters against 2x1";
      EXPECT_TRUE(dx[0].bytes_equal(dx[1])) << "grad_input: one-CTA clusters against 2x1";
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Cuda, GroupedLinearCuda, ::testing::ValuesIn(kShapes),
                         [](const ::testing::TestParamInfo<Shape>& i) { return shape_name(i.param); });

TEST(GroupedLinearCudaContract, MainGradAccumulateAndOverwriteWithAnEmptyExpert) {
  REQUIRE_GPU();
  check_main_grad(st::DType::kBF16);
}

// docs/DESIGN.md section 4: main_grad accumulated by the sm90 wgrad's reduce-add (ALL builds,
// Hopper, an aligned main_grad; forced here) and by the register epilogue (as the direct-store twin
// and the CPU reference) gives the same bits: random data, and subnormal main_grad values under
// added zeros (x = 0) kept by both.
TEST(GroupedLinearCudaContract, MainGradAccumulationsAgreeBitwiseSubnormalsKept) {
  REQUIRE_GPU();
  for (bool zero_x : {false, true}) {
    GroupedLinearCase c = make_case({st::DType::kBF16, 3, 700, 650, 192, 320, {0}, true, false, false});
    c.fuse = true;
    const float subnormal = 1e-40f;
    ASSERT_LT(subnormal, 1.17549435e-38f);
    if (zero_x) {
      for (int64_t i = 0; i < c.x.numel(); ++i) c.x.set(i, 0.0);
      for (int64_t i = 0; i < c.main_grad.numel(); ++i) c.main_grad.set(i, i % 2 ? subnormal : -subnormal);
    }
    std::vector<HostTensor> results;
    for (const char* how : {"reduce", "epilogue"}) {
      SCOPED_TRACE(std::string(zero_x ? "x = 0, " : "") + "SPARSETRAIN_MAIN_GRAD_ADD=" + how);
      ScopedEnv pin("SPARSETRAIN_MAIN_GRAD_ADD", how);
      CudaLayer L(c, c.options());
      const DeviceTensor x(c.x), dy(c.dy);
      L.layer->backward(x.view(), dy.view(), st::Splits::host(c.splits));
      results.push_back(to_host(L.mg.view()));
      for (int64_t i = 0; zero_x && i < results.back().numel(); ++i)
        ASSERT_EQ(results.back().get(i), double(c.main_grad.get(i))) << i;
    }
    ASSERT_EQ(results[0].numel(), results[1].numel());
    EXPECT_EQ(std::memcmp(results[0].data(), results[1].data(), size_t(results[0].numel()) * 4), 0)
        << "reduce-add vs register epilogue";
  }
}

TEST(GroupedLinearCudaContract, InvalidDeviceSplitsEmptyEveryProblemAndSetTheStatus) {
  REQUIRE_GPU();
  GroupedLinearCase c = make_case({st::DType::kFP16, 4, 50, 40, 16, 8, {}, true, false, true});
  c.splits = {10, -3, 20, 10};
  CudaLayer L(c, c.options());
  const DeviceTensor x(c.x);
  const st::Tensor y = L.layer->forward(x.view(), L.device_splits());
  const HostTensor yh = to_host(y.view());
  for (int64_t i = 0; i < yh.numel(); ++i) ASSERT_EQ(yh.get(i), 0.0);
  EXPECT_EQ(int32_t(to_host(L.status.view()).get(0)), st::kSplitsNegative);
  st::GroupedLinearOptions o = c.options();
  o.check_device_splits = true;
  CudaLayer checked(c, o);
  EXPECT_THROW(checked.layer->forward(x.view(), checked.device_splits()), st::Error);
}

// Caller buffers whose base is one element off a 16-byte boundary, on shapes the TMA path takes
// (in, out multiples of 8): they take the direct-store twins of the sm90 kernels, and docs/DESIGN.md
// section 4 says caller buffers give results bit-identical to the library-allocated path, with
// rows >= S untouched. Checked for out (with and without bias), grad_input and (fused) main_grad,
// overwritten (poisoned first) and accumulated (from the same random values).
TEST(GroupedLinearCudaContract, MisalignedCallerBuffersAreBitIdenticalToTheAlignedPath) {
  REQUIRE_GPU();
  for (st::DType dtype : {st::DType::kBF16, st::DType::kFP16})
    for (bool bias : {true, false}) {
      SCOPED_TRACE(std::string(st::dtype_name(dtype)) + (bias ? " bias" : " no bias"));
      GroupedLinearCase c = make_case({dtype, 4, 515, 500, 256, 192, {2}, true, bias, false});
      const int64_t S = c.oracle().rows_used();
      const size_t es = st::dtype_size(dtype);
      CudaLayer L(c, c.options());
      const DeviceTensor x(c.x), dy(c.dy);
      const st::Splits sp = st::Splits::host(c.splits);
      const HostTensor y = to_host(L.layer->forward(x.view(), sp).view());
      const auto g = L.layer->backward(x.view(), dy.view(), sp);
      const HostTensor dx = to_host(g.grad_input.view());
      const MisalignedBuffer out_buf(dtype, c.T, c.out), gin_buf(dtype, c.T, c.in);
      const st::TensorView &out = out_buf.view, &gin = gin_buf.view;
      ASSERT_NE(reinterpret_cast<uintptr_t>(out.data()) % 16, 0u);
      L.layer->forward(x.view(), sp, out);
      L.layer->backward(x.view(), dy.view(), sp, gin);
      const HostTensor outh = to_host(out), ginh = to_host(gin);
      EXPECT_EQ(std::memcmp(outh.data(), y.data(), size_t(S * c.out) * es), 0) << "misaligned out vs aligned path";
      EXPECT_EQ(std::memcmp(ginh.data(), dx.data(), size_t(S * c.in) * es), 0) << "misaligned grad_input vs aligned";
      for (int64_t i = S * c.out; i < outh.numel(); ++i) ASSERT_TRUE(std::isnan(outh.get(i))) << "out tail written";
      for (int64_t i = S * c.in; i < ginh.numel(); ++i) ASSERT_TRUE(std::isnan(ginh.get(i))) << "grad_input tail written";

      // main_grad (fp32) one element off, against an aligned one: overwritten (each call's wgrad;
      // the misaligned one poisoned first), and accumulated onto the same random values.
      c.fuse = true;
      for (bool overwrite : {true, false}) {
        SCOPED_TRACE(overwrite ? "main_grad overwritten" : "main_grad accumulated");
        c.overwrite = overwrite;
        CudaLayer aligned(c, c.options());
        const int64_t n = c.G * c.out * c.in;
        HostTensor mg_host(st::DType::kFP32, {n + 4});
        mg_host.poison();
        if (!overwrite)
          for (int64_t i = 0; i < n; ++i) mg_host.set(i + 1, c.main_grad.get(i));
        const DeviceTensor mg_mem(mg_host);
        const int64_t mg_shape[3] = {c.G, c.out, c.in}, mg_strides[3] = {c.out * c.in, c.in, 1};
        st::GroupedLinearParams p;
        p.weight = st::GroupedParam::packed(aligned.w.view());
        if (bias) p.bias = st::GroupedParam::packed(aligned.b.view());
        p.main_grad = st::GroupedParam::packed(st::TensorView(static_cast<char*>(mg_mem.view().data()) + 4,
                                                              st::DType::kFP32, mg_shape, mg_strides, 3,
                                                              st::Device::cuda(0)));
        st::GroupedLinear off(c.options(), p);
        aligned.layer->backward(x.view(), dy.view(), sp);
        off.backward(x.view(), dy.view(), sp);
        const HostTensor mg_aligned = to_host(aligned.mg.view()), mg_off = to_host(p.main_grad.views()[0]);
        EXPECT_TRUE(mg_off.bytes_equal(mg_aligned)) << "misaligned main_grad vs aligned";
      }
    }
}

// Forward + backward captured once with device splits and caller buffers/workspace, replayed
// after new split values (same T) are written into the splits tensor.
class GraphCapture : public ::testing::TestWithParam<bool> {};  // bias (no bias: the sm90 fprop path)

TEST_P(GraphCapture, ReplaysWithNewSplitValues) {
  REQUIRE_GPU();
  GroupedLinearCase c = make_case({st::DType::kBF16, 6, 300, 300, 64, 40, {}, true, GetParam(), true});
  c.fuse = true;
  c.overwrite = true;  // each replay's main_grad is that replay's wgrad
  CudaLayer L(c, c.options());
  const DeviceTensor x(c.x), dy(c.dy);
  HostTensor poison_out(c.dtype, {c.T, c.out}), poison_in(c.dtype, {c.T, c.in});
  const DeviceTensor out(poison_out, false), gin(poison_in, false);
  HostTensor ws_host(st::DType::kInt32, {int64_t(L.layer->workspace_size(c.T) / 4) + 64});
  const DeviceTensor ws(ws_host, false);
  st::CallArgs args;
  cudaStream_t stream;
  CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  args.stream.handle = stream;
  args.workspace = {ws.view().data(), L.layer->workspace_size(c.T)};
  cudaGraph_t graph;
  CUDA_OK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  L.layer->forward(x.view(), L.device_splits(), out.view(), args);
  L.layer->backward(x.view(), dy.view(), L.device_splits(), gin.view(), args);
  CUDA_OK(cudaStreamEndCapture(stream, &graph));
  cudaGraphExec_t exec;
  CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
  for (const std::vector<int64_t>& splits : {std::vector<int64_t>{50, 50, 50, 50, 50, 50},
                                             std::vector<int64_t>{0, 299, 0, 0, 1, 0},
                                             std::vector<int64_t>{120, 0, 7, 73, 0, 100}}) {
    HostTensor s(st::DType::kInt64, {c.G});
    for (int64_t g = 0; g < c.G; ++g) s.set(g, double(splits[size_t(g)]));
    // On the replay's stream: a cudaMemcpy from pageable memory may return before its copy lands,
    // and a non-blocking stream does not wait for it.
    CUDA_OK(cudaMemcpyAsync(L.splits.view().data(), s.data(), size_t(c.G) * 8, cudaMemcpyHostToDevice, stream));
    CUDA_OK(cudaGraphLaunch(exec, stream));
    CUDA_OK(cudaStreamSynchronize(stream));
    c.splits = splits;
    const auto oracle = c.oracle();
    expect_ok(st::testing::compare_with_oracle(to_host(out.view()), oracle.forward(), c.dtype, 1, "replayed y"));
    expect_ok(st::testing::compare_with_oracle(to_host(gin.view()), oracle.dgrad(), c.dtype, 1, "replayed dx"));
    const HostTensor mg = to_host(L.mg.view());
    for (int64_t g = 0; g < c.G; ++g)
      expect_ok(st::testing::compare_with_oracle(HostTensor::copy_of(mg.view().select(g)), oracle.wgrad(g),
                                                 st::DType::kFP32, 2, "replayed main_grad"));
  }
  CUDA_OK(cudaGraphExecDestroy(exec));
  CUDA_OK(cudaGraphDestroy(graph));
  CUDA_OK(cudaStreamDestroy(stream));
}

INSTANTIATE_TEST_SUITE_P(Cuda, GraphCapture, ::testing::Bool(),
                         [](const ::testing::TestParamInfo<bool>& i) { return i.param ? "bias" : "nobias"; });

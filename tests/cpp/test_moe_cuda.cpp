// The MoE router and layer on a CUDA device against the CPU reference on the same data (the CPU
// path is itself tested against oracles written apart: test_moe_router, test_moe_layer): the same
// choice and layout (exactly), probs and gradients to fp32 / the dtype's rounding, bitwise
// repeatable runs, a CUDA graph replayed with new logits (new routing) equal to eager calls,
// invalid device expert ids turned into NaN gradients, never an out-of-bounds read. Skipped,
// visibly, without a GPU.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "device_tensor.h"
#include "fp8_testing.h"
#include "grouped_mlp_case.h"
#include "host_tensor.h"
#include "ops/fp8_blockwise_backend.h"
#include "sparsetrain/moe_layer.h"
#include "sparsetrain/moe_router.h"

namespace st = sparsetrain;
using st::DType;
using st::RouterScore;
using st::testing::DeviceTensor;
using st::testing::HostTensor;
using st::testing::to_host;

namespace {

HostTensor random_logits(int64_t N, int E, uint64_t seed, float scale = 2.f) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> d(0.f, scale);
  HostTensor t(DType::kFP32, {N, E});
  for (int64_t i = 0; i < N * E; ++i) t.set(i, d(rng));
  return t;
}

void expect_equal(const HostTensor& a, const HostTensor& b, const char* what) {
  ASSERT_EQ(a.numel(), b.numel()) << what;
  for (int64_t i = 0; i < a.numel(); ++i) ASSERT_EQ(a.get(i), b.get(i)) << what << " at " << i;
}

void expect_near(const HostTensor& got, const HostTensor& want, double rel, double abs, const char* what) {
  ASSERT_EQ(got.numel(), want.numel()) << what;
  for (int64_t i = 0; i < got.numel(); ++i) {
    ASSERT_FALSE(std::isnan(got.get(i))) << what << " at " << i;
    ASSERT_NEAR(got.get(i), want.get(i), abs + rel * std::fabs(want.get(i))) << what << " at " << i;
  }
}

struct RouteCase {
  int64_t N;
  int E, K;
  RouterScore score;
  bool normalize, bias;
};

class MoERouterCuda : public ::testing::TestWithParam<RouteCase> {};

TEST_P(MoERouterCuda, EqualsTheHostRouter) {
  REQUIRE_GPU();
  const RouteCase c = GetParam();
  const HostTensor logits = random_logits(c.N, c.E, uint64_t(c.N * 7 + c.E));
  const HostTensor bias = c.bias ? random_logits(1, c.E, 99, 0.3f) : HostTensor();
  const HostTensor bias1 = c.bias ? HostTensor::copy_of(bias.view().select(0)) : HostTensor();
  const st::RouterOptions o{c.E, c.K, c.score, c.normalize};
  const st::RouterOutput h = st::route(o, logits.view(), c.bias ? bias1.view() : st::TensorView{});
  const DeviceTensor dl(logits), db = c.bias ? DeviceTensor(bias1) : DeviceTensor();
  const st::RouterOutput d = st::route(o, dl.view(), c.bias ? db.view() : st::TensorView{});
  expect_equal(to_host(d.experts.view()), HostTensor::copy_of(h.experts.view()), "experts");
  expect_equal(to_host(d.counts.view()), HostTensor::copy_of(h.counts.view()), "counts");
  expect_equal(to_host(d.row_of.view()), HostTensor::copy_of(h.row_of.view()), "row_of");
  expect_equal(to_host(d.token_of_row.view()), HostTensor::copy_of(h.token_of_row.view()), "token_of_row");
  expect_near(to_host(d.probs.view()), HostTensor::copy_of(h.probs.view()), 2e-6, 1e-7, "probs");
  expect_near(to_host(d.score_sum.view()), HostTensor::copy_of(h.score_sum.view()), 1e-5, 1e-6 * double(c.N),
              "score_sum");
  // Repeatable bit for bit.
  const st::RouterOutput d2 = st::route(o, dl.view(), c.bias ? db.view() : st::TensorView{});
  EXPECT_TRUE(to_host(d2.score_sum.view()).bytes_equal(to_host(d.score_sum.view())));

  HostTensor dprobs(DType::kFP32, {c.N, c.K});
  std::mt19937_64 rng(5);
  dprobs.fill_random(rng);
  const HostTensor dsum = random_logits(1, c.E, 6, 1.f);
  const HostTensor dsum1 = HostTensor::copy_of(dsum.view().select(0));
  const st::Tensor gh = st::route_backward(o, logits.view(), h.experts.view(), dprobs.view(), dsum1.view());
  const DeviceTensor ddp(dprobs), dds(dsum1);
  const st::Tensor gd = st::route_backward(o, dl.view(), d.experts.view(), ddp.view(), dds.view());
  expect_near(to_host(gd.view()), HostTensor::copy_of(gh.view()), 1e-5, 1e-6, "dlogits");
}

INSTANTIATE_TEST_SUITE_P(Cases, MoERouterCuda,
                         ::testing::Values(RouteCase{1000, 8, 2, RouterScore::kSoftmax, true, false},
                                           RouteCase{777, 64, 8, RouterScore::kSigmoid, true, true},
                                           RouteCase{3001, 256, 8, RouterScore::kSigmoid, false, true},
                                           RouteCase{5, 1, 1, RouterScore::kSoftmax, false, false},
                                           RouteCase{0, 4, 2, RouterScore::kSoftmax, false, false}));

TEST(MoERouterCudaErrors, InvalidDeviceExpertIdsGiveNanNeverAnOutOfBoundsRead) {
  REQUIRE_GPU();
  const HostTensor logits = random_logits(4, 6, 1);
  HostTensor ids(DType::kInt32, {4, 2});
  const int32_t bad[8] = {0, 1, 7, 2, 3, 3, -1, 5};  // token 1: out of range, 2: repeated, 3: negative
  for (int i = 0; i < 8; ++i) ids.set(i, bad[i]);
  HostTensor dp(DType::kFP32, {4, 2});
  for (int i = 0; i < 8; ++i) dp.set(i, 1.0);
  const DeviceTensor dl(logits), di(ids), ddp(dp);
  const HostTensor g = to_host(st::route_backward({6, 2, RouterScore::kSoftmax, false}, dl.view(), di.view(),
                                                  ddp.view()).view());
  for (int e = 0; e < 6; ++e) EXPECT_FALSE(std::isnan(g.get(e))) << "token 0 is valid";
  for (int n = 1; n < 4; ++n)
    for (int e = 0; e < 6; ++e) EXPECT_TRUE(std::isnan(g.get(n * 6 + e))) << "token " << n;
}

// combine_rows on the device equals the host's bit for bit (the same fp32 sums in slot order), on
// both of its kernel paths: 16-byte vectors (row lengths and strides multiples of 16 bytes) and
// element by element (odd row lengths, or a row stride off 16 bytes); the output poisoned first.
TEST(MoECombineRowsCuda, EqualsTheHost) {
  REQUIRE_GPU();
  for (const DType dt : {DType::kBF16, DType::kFP16, DType::kFP32})
    for (const int64_t H : {64, 40, 13})
      for (const int64_t pad : {0, 1})
        for (const int64_t K : {1, 3, 8}) {
          SCOPED_TRACE(std::string(st::dtype_name(dt)) + " H " + std::to_string(H) + " pad " + std::to_string(pad) +
                       " K " + std::to_string(K));
          const int64_t N = 1031, R = 2 * N + 5, stride = H + pad;
          std::mt19937_64 rng(uint64_t(H * 131 + pad * 17 + K));
          HostTensor rows(dt, {R, stride});
          rows.fill_random(rng, 2.0);
          HostTensor row_of(DType::kInt32, {N, K});
          for (int64_t i = 0; i < N * K; ++i) row_of.set(i, double(rng() % uint64_t(R)));
          const int64_t shape[2] = {R, H}, strides[2] = {stride, 1};
          const st::TensorView hv(rows.data(), dt, shape, strides, 2, st::Device::cpu());
          const HostTensor want = HostTensor::copy_of(st::combine_rows(hv, row_of.view()).view());
          const DeviceTensor drows(rows), drow_of(row_of);
          const st::TensorView dv(drows.view().data(), dt, shape, strides, 2, st::Device::cuda(0));
          st::testing::PoolAllocator poisoned(size_t(N * H) * 4 + 4096);  // its memory NaN-filled (0xFF)
          const st::Tensor got = st::combine_rows(dv, drow_of.view(), &poisoned);
          EXPECT_TRUE(to_host(got.view()).bytes_equal(want));
        }
}

// The experts of a layer of E experts, top-K over N tokens, hidden H, ffn F: packed bf16 weights
// (the splits are the routing's, on the device).
st::testing::GroupedMLPCase experts_case(int64_t N, int64_t H, int64_t F, int E, int K) {
  st::testing::GroupedMLPCase c;
  c.dtype = DType::kBF16;
  c.G = E;
  c.T = N * K;
  c.in = c.out = H;
  c.F = F;
  c.packed = true;
  c.splits = std::vector<int64_t>(size_t(E), 0);
  c.make();
  return c;
}

TEST(MoELayerCuda, EqualsTheHostLayerRepeatablyAndUnderGraphReplay) {
  REQUIRE_GPU();
  const int64_t N = 301, H = 64, F = 32;
  const int E = 8, K = 2;
  const st::testing::GroupedMLPCase c = experts_case(N, H, F, E, K);
  st::MoELayerOptions o;
  o.router = {E, K, RouterScore::kSoftmax, true};
  o.mlp = c.options();
  o.recompute_expert_input = false;  // the rows kept; the recompute case below is compared with it
  HostTensor x(DType::kBF16, {N, H}), dout(DType::kBF16, {N, H});
  std::mt19937_64 rng(11);
  x.fill_random(rng);
  dout.fill_random(rng);
  const HostTensor logits = random_logits(N, E, 12);
  st::MoELayer host(o, c.params());
  const st::MoEForward hf = host.forward(x.view(), logits.view());
  const st::MoEGrads hg = host.backward(x.view(), logits.view(), hf, dout.view());

  const DeviceTensor w1(c.w1), w2(c.w2), dx(x), ddout(dout), dlog(logits);
  st::GroupedMLPParams dp;
  dp.fc1.weight = st::GroupedParam::packed(w1.view());
  dp.fc2.weight = st::GroupedParam::packed(w2.view());
  st::MoELayer dev(o, dp);
  const st::MoEForward df = dev.forward(dx.view(), dlog.view());
  const st::MoEGrads dg = dev.backward(dx.view(), dlog.view(), df, ddout.view());
  expect_equal(to_host(df.route.row_of.view()), HostTensor::copy_of(hf.route.row_of.view()), "row_of");
  // The experts' GEMMs differ between the backends in their summation order: bf16 rounding apart.
  expect_near(to_host(df.out.view()), HostTensor::copy_of(hf.out.view()), 2e-2, 2e-2, "out");
  expect_near(to_host(dg.grad_input.view()), HostTensor::copy_of(hg.grad_input.view()), 2e-2, 2e-2, "dx");
  expect_near(to_host(dg.dlogits.view()), HostTensor::copy_of(hg.dlogits.view()), 2e-2, 2e-3, "dlogits");
  expect_near(to_host(dg.fc1.weight.packed.view()), HostTensor::copy_of(hg.fc1.weight.packed.view()), 2e-2, 5e-2,
              "dW1");

  // Bitwise repeatable.
  const st::MoEForward df2 = dev.forward(dx.view(), dlog.view());
  const st::MoEGrads dg2 = dev.backward(dx.view(), dlog.view(), df2, ddout.view());
  EXPECT_TRUE(to_host(df2.out.view()).bytes_equal(to_host(df.out.view())));
  EXPECT_TRUE(to_host(dg2.grad_input.view()).bytes_equal(to_host(dg.grad_input.view())));
  EXPECT_TRUE(to_host(dg2.dlogits.view()).bytes_equal(to_host(dg.dlogits.view())));
  // recompute_expert_input: no rows kept, gathered again in backward by the kernel: the same bits.
  st::MoELayerOptions ro = o;
  ro.recompute_expert_input = true;
  st::MoELayer rdev(ro, dp);
  const st::MoEForward rf = rdev.forward(dx.view(), dlog.view());
  EXPECT_FALSE(rf.rows.defined());
  const st::MoEGrads rg = rdev.backward(dx.view(), dlog.view(), rf, ddout.view());
  EXPECT_TRUE(to_host(rg.grad_input.view()).bytes_equal(to_host(dg.grad_input.view())));
  EXPECT_TRUE(to_host(rg.dlogits.view()).bytes_equal(to_host(dg.dlogits.view())));
  EXPECT_TRUE(to_host(rg.fc1.weight.packed.view()).bytes_equal(to_host(dg.fc1.weight.packed.view())));
  // x with a row stride of H + 1 elements (its rows off 16-byte boundaries: the gather's
  // element-wise path, the contiguous x took the 16-byte one): the same bits.
  {
    HostTensor wide(DType::kBF16, {N, H + 1});
    for (int64_t n = 0; n < N; ++n)
      for (int64_t h = 0; h <= H; ++h) wide.set(n * (H + 1) + h, h < H ? x.get(n * H + h) : 1e30);
    const DeviceTensor dwide(wide);
    const int64_t shape[2] = {N, H}, strides[2] = {H + 1, 1};
    const st::TensorView xs(dwide.view().data(), DType::kBF16, shape, strides, 2, st::Device::cuda(0));
    const st::MoEForward sf = dev.forward(xs, dlog.view());
    EXPECT_TRUE(to_host(sf.out.view()).bytes_equal(to_host(df.out.view()))) << "strided x";
  }

  // A CUDA graph of the forward, replayed with new logits (new routing), equals an eager call.
  // The graph's memory comes from a pool allocated before the capture (fixed addresses).
  st::testing::PoolAllocator pool(size_t(32) << 20);
  st::MoELayer graphed(o, dp, &pool);
  cudaStream_t s;
  CUDA_OK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  st::CallArgs args;
  args.stream.handle = s;
  const size_t ws_bytes = graphed.experts().workspace_size(N * K);
  HostTensor ws_host(DType::kInt32, {int64_t(ws_bytes / 4) + 64});
  const DeviceTensor ws(ws_host, false);
  args.workspace = {ws.view().data(), ws_bytes};
  st::MoEForward captured;
  cudaGraph_t graph;
  CUDA_OK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
  captured = graphed.forward(dx.view(), dlog.view(), {}, args);
  CUDA_OK(cudaStreamEndCapture(s, &graph));
  cudaGraphExec_t exec;
  CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
  const HostTensor logits2 = random_logits(N, E, 13);
  // On the replay's stream (a pageable cudaMemcpy may return before it lands; s does not wait).
  CUDA_OK(cudaMemcpyAsync(dlog.view().data(), logits2.data(), size_t(N * E) * 4, cudaMemcpyHostToDevice, s));
  CUDA_OK(cudaGraphLaunch(exec, s));
  CUDA_OK(cudaStreamSynchronize(s));
  const st::MoEForward eager = dev.forward(dx.view(), dlog.view());
  EXPECT_TRUE(to_host(captured.out.view()).bytes_equal(to_host(eager.out.view())));
  EXPECT_TRUE(to_host(captured.route.row_of.view()).bytes_equal(to_host(eager.route.row_of.view())));
  EXPECT_FALSE(to_host(captured.route.row_of.view()).bytes_equal(HostTensor::copy_of(hf.route.row_of.view())))
      << "the replay did not see the new logits";
  CUDA_OK(cudaGraphExecDestroy(exec));
  CUDA_OK(cudaGraphDestroy(graph));
  CUDA_OK(cudaStreamDestroy(s));
}

// fp8_saved_activations on the device: fc1's codes and scales are the reference quantizer's of the
// plain FP8 layer's fc1 output (same device, same bits up to fc1), 2F = 160 (a partial second
// tile) and 256 (F = 128: with the wgrad now the SwiGLU backward reads the codes themselves); the
// backward gives the bits of the plain layer's fed those codes decoded on the host (the restore is
// exact), the wgrad now and delayed (the pending wgrad keeps the restored buffer).
TEST(MoELayerCuda, Fp8SavedActivationsGiveTheReferenceCodesAndThePlainLayersBitsOnThem) {
  REQUIRE_HOPPER();
  if (st::backend::fp8_blockwise_cuda_backend().gemm_scratch_bytes(DType::kBF16, 1, 1, 16, 16) == 0)
    GTEST_SKIP() << "this build has no CUDA FP8 GEMMs (SPARSETRAIN_SM90_KERNELS=ALL builds them)";
  for (const int64_t F : {int64_t(80), int64_t(128)}) {
    SCOPED_TRACE("F " + std::to_string(F));
    const int64_t N = 301, H = 64;
    const int E = 8, K = 2;
    const st::testing::GroupedMLPCase c = experts_case(N, H, F, E, K);
    HostTensor x(DType::kBF16, {N, H}), dout(DType::kBF16, {N, H});
    std::mt19937_64 rng(21);
    x.fill_random(rng);
    dout.fill_random(rng);
    const HostTensor logits = random_logits(N, E, 22);
    const DeviceTensor w1(c.w1), w2(c.w2), dx(x), ddout(dout), dlog(logits);
    st::GroupedMLPParams dp;
    dp.fc1.weight = st::GroupedParam::packed(w1.view());
    dp.fc2.weight = st::GroupedParam::packed(w2.view());
    for (const bool delay : {false, true}) {
      SCOPED_TRACE(delay ? "delayed wgrad" : "immediate wgrad");
      st::MoELayerOptions o;
      o.router = {E, K, RouterScore::kSoftmax, true};
      o.mlp = c.options();
      o.mlp.fp8 = st::Fp8Recipe::kBlockwise;
      o.mlp.delay_wgrad_compute = delay;
      st::MoELayer plain(o, dp);
      o.fp8_saved_activations = true;
      st::MoELayer saving(o, dp);
      const st::MoEForward fa = plain.forward(dx.view(), dlog.view());
      const st::MoEForward fb = saving.forward(dx.view(), dlog.view());
      EXPECT_TRUE(to_host(fa.out.view()).bytes_equal(to_host(fb.out.view())));
      const HostTensor counts = to_host(fb.route.counts.view());
      std::vector<int64_t> off{0};
      for (int e = 0; e < E; ++e) off.push_back(off.back() + int64_t(counts.get(e)));
      const st::testing::Fp8Operand want = st::testing::quantize_rowwise(to_host(fa.fc1_out.view()), off);
      EXPECT_TRUE(to_host(fb.fc1_out.view()).bytes_equal(want.data)) << "codes";
      EXPECT_TRUE(to_host(fb.fc1_out_scales.view()).bytes_equal(want.scale)) << "scales";
      const HostTensor decoded32 = st::testing::dequantize_rowwise(want, off, N * K, 2 * F);
      HostTensor decoded(DType::kBF16, {N * K, 2 * F});
      for (int64_t i = 0; i < decoded.numel(); ++i) decoded.set(i, decoded32.get(i));
      const DeviceTensor ddecoded(decoded);
      st::MoEForward fed = fa;
      fed.fc1_out = st::Tensor::borrowed(ddecoded.view());
      const st::MoEGrads ga = plain.backward(dx.view(), dlog.view(), fed, ddout.view());
      const st::MoEGrads gb = saving.backward(dx.view(), dlog.view(), fb, ddout.view());
      EXPECT_TRUE(to_host(ga.grad_input.view()).bytes_equal(to_host(gb.grad_input.view())));
      EXPECT_TRUE(to_host(ga.dlogits.view()).bytes_equal(to_host(gb.dlogits.view())));
      st::GroupedMLPLayerGrads a1 = ga.fc1, a2 = ga.fc2, b1 = gb.fc1, b2 = gb.fc2;
      if (delay) {
        const st::GroupedMLPGrads da = plain.backward_dw(), db = saving.backward_dw();
        a1 = da.fc1, a2 = da.fc2, b1 = db.fc1, b2 = db.fc2;
      }
      EXPECT_TRUE(to_host(a1.weight.packed.view()).bytes_equal(to_host(b1.weight.packed.view())));
      EXPECT_TRUE(to_host(a2.weight.packed.view()).bytes_equal(to_host(b2.weight.packed.view())));
    }
  }
}

}  // namespace

// MoELayer (moe_layer.h) on the CPU against oracles written apart from the library: the routing
// from the router oracle (choice and layout exact), the experts from GroupedMLP's double-precision
// oracle run on the rows the routing oracle lays out, the combine (each token's rows summed) and
// the logits' gradient (central differences of the router oracle, fed the expert oracle's dprobs)
// in double, each with its error bound. Also: bitwise repeatable, delayed wgrad equal to the
// immediate one, every library allocation poisoned, and bad arguments refused (naming them)
// before anything is written: a refused backward leaves the delayed-wgrad queue as it was.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <ostream>
#include <cstring>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "common/fp8_blockwise.h"
#include "grouped_mlp_case.h"
#include "expect_error.h"
#include "host_tensor.h"
#include "moe_router_oracle.h"
#include "sparsetrain/error.h"
#include "sparsetrain/moe_layer.h"

namespace st = sparsetrain;
using st::DType;
using st::RouterScore;
using st::testing::Bounded;
using st::testing::GroupedMLPCase;
using st::testing::HostTensor;
using st::testing::expect_error;

namespace {

struct Case {
  int64_t N;
  int E, K;
  int64_t H, F;
  RouterScore score;
  bool normalize, bias, mlp_bias;
  DType dtype;
};

std::string name(const Case& c) {
  return "N" + std::to_string(c.N) + "_E" + std::to_string(c.E) + "_K" + std::to_string(c.K) + "_H" +
         std::to_string(c.H) + "_F" + std::to_string(c.F) + (c.score == RouterScore::kSoftmax ? "_softmax" : "_sigmoid") +
         (c.normalize ? "_norm" : "") + (c.bias ? "_ebias" : "") + (c.mlp_bias ? "_mlpbias" : "") + "_" +
         st::dtype_name(c.dtype);
}
void PrintTo(const Case& c, std::ostream* os) { *os << name(c); }

// A routed problem: tokens, logits, the routing oracle, and an expert case whose rows are the
// tokens' rows in the oracle's layout.
struct Problem {
  Case c;
  HostTensor x, logits, bias, dout, dsum;
  std::vector<float> logit_values, bias_values;
  st::testing::RouterOracle route;
  GroupedMLPCase mlp;

  explicit Problem(const Case& cs, uint64_t seed) : c(cs) {
    std::mt19937_64 rng(seed * 1000003 + uint64_t(c.N * 31 + c.E * 7 + c.K));
    x = HostTensor(c.dtype, {c.N, c.H});
    dout = HostTensor(c.dtype, {c.N, c.H});
    x.fill_random(rng);
    dout.fill_random(rng);
    std::normal_distribution<float> d(0.f, 2.f);
    logits = HostTensor(DType::kFP32, {c.N, c.E});
    for (int64_t i = 0; i < c.N * c.E; ++i) logit_values.push_back(d(rng)), logits.set(i, logit_values.back());
    if (c.bias) {
      bias = HostTensor(DType::kFP32, {c.E});
      for (int e = 0; e < c.E; ++e) bias_values.push_back(0.25f * d(rng)), bias.set(e, bias_values.back());
    }
    dsum = HostTensor(DType::kFP32, {c.E});
    for (int e = 0; e < c.E; ++e) dsum.set(e, d(rng));
    route = st::testing::router_oracle(logit_values, bias_values, c.N, c.E, c.K, c.score, c.normalize);

    mlp.dtype = c.dtype;
    mlp.G = c.E;
    mlp.T = c.N * c.K;
    mlp.in = mlp.out = c.H;
    mlp.F = c.F;
    mlp.bias1 = mlp.bias2 = c.mlp_bias;
    mlp.splits = route.counts;
    mlp.seed = seed;
    mlp.make();
    // The expert case's rows are the tokens' rows in the layout.
    for (int64_t r = 0; r < mlp.T; ++r)
      for (int64_t h = 0; h < c.H; ++h) {
        const int64_t n = route.token_of_row[size_t(r)];
        mlp.x.set(r * c.H + h, x.get(n * c.H + h));
        mlp.dy.set(r * c.H + h, dout.get(n * c.H + h));
      }
  }

  st::MoELayerOptions options() const {
    st::MoELayerOptions o;
    o.router = {c.E, c.K, c.score, c.normalize};
    o.mlp = mlp.options();
    o.recompute_expert_input = false;  // the rows kept: what the recompute cases are compared with
    return o;
  }
  st::TensorView bias_view() const { return c.bias ? bias.view() : st::TensorView{}; }
};

void expect_ok(const st::testing::CompareResult& r) { EXPECT_TRUE(r.ok) << r.first_failure; }

// Token n's value: the sum over its slots of the oracle's rows, the bound the rows' errors plus
// the fp32 sum's roundings (the final rounding to the dtype is compare_bounded's).
Bounded combine(const Bounded& rows, const std::vector<int>& row_of, int64_t N, int K, int64_t H) {
  Bounded out(size_t(N * H));
  const double u32 = std::ldexp(1.0, -24);
  for (int64_t n = 0; n < N; ++n)
    for (int64_t h = 0; h < H; ++h) {
      double v = 0, e = 0, a = 0;
      for (int i = 0; i < K; ++i) {
        const size_t j = size_t(row_of[size_t(n * K + i)] * H + h);
        v += rows.value[j], e += rows.err[j], a += std::fabs(rows.value[j]);
      }
      out.value[size_t(n * H + h)] = v;
      out.err[size_t(n * H + h)] = e + double(K + 1) * u32 * a;
    }
  return out;
}

class MoELayerVsOracle : public ::testing::TestWithParam<Case> {};

TEST_P(MoELayerVsOracle, ForwardBackwardMatchTheOracles) {
  const Case c = GetParam();
  Problem p(c, 1);
  st::testing::PoisonAllocator alloc;
  st::MoELayer layer(p.options(), p.mlp.params(), &alloc);
  const st::MoEForward f = layer.forward(p.x.view(), p.logits.view(), p.bias_view());

  // The routing: choice and layout exact, probs to fp32.
  const HostTensor experts = HostTensor::copy_of(f.route.experts.view());
  const HostTensor row_of = HostTensor::copy_of(f.route.row_of.view());
  const HostTensor probs = HostTensor::copy_of(f.route.probs.view());
  for (int64_t i = 0; i < c.N * c.K; ++i) {
    ASSERT_EQ(experts.get(i), p.route.experts[size_t(i)]) << i;
    ASSERT_EQ(row_of.get(i), p.route.row_of[size_t(i)]) << i;
    ASSERT_NEAR(probs.get(i), p.route.probs[size_t(i)], 2e-6) << i;
  }
  // The experts' oracle takes the library's fp32 probs (checked just above) on the rows.
  GroupedMLPCase& m = p.mlp;
  for (int64_t i = 0; i < c.N * c.K; ++i) m.probs.set(p.route.row_of[size_t(i)], probs.get(i));
  const auto oracle = m.oracle();
  const auto fo = oracle.forward();
  expect_ok(st::testing::compare_bounded(HostTensor::copy_of(f.out.view()),
                                         combine(fo.out, p.route.row_of, c.N, c.K, c.H), c.dtype, "out"));

  const st::MoEGrads g = layer.backward(p.x.view(), p.logits.view(), f, p.dout.view(), p.dsum.view());
  const auto bo = oracle.backward(HostTensor::copy_of(f.fc1_out.view()).to_double());
  expect_ok(st::testing::compare_bounded(HostTensor::copy_of(g.grad_input.view()),
                                         combine(bo.dx, p.route.row_of, c.N, c.K, c.H), c.dtype, "dx"));
  // dlogits: the router oracle's gradient fed the experts' oracle dprobs; their error bounds
  // carried through a Jacobian whose entries are at most 1 in size (twice that, with normalise).
  const HostTensor dl = HostTensor::copy_of(g.dlogits.view());
  const std::vector<double> ds = p.dsum.to_double();
  for (int64_t n = 0; n < c.N; ++n) {
    const std::vector<double> l(p.logit_values.begin() + n * c.E, p.logit_values.begin() + (n + 1) * c.E);
    const std::vector<int> chosen(p.route.experts.begin() + n * c.K, p.route.experts.begin() + (n + 1) * c.K);
    std::vector<double> dp;
    double err = 0;
    for (int i = 0; i < c.K; ++i) {
      const size_t r = size_t(p.route.row_of[size_t(n * c.K + i)]);
      dp.push_back(bo.dprobs.value[r]);
      err += bo.dprobs.err[r] + std::ldexp(1.0, -24) * std::fabs(bo.dprobs.value[r]);
    }
    const std::vector<double> want = st::testing::dlogits_by_differences(l, chosen, c.score, c.normalize, dp, &ds);
    for (int e = 0; e < c.E; ++e) {
      const double got = dl.get(n * c.E + e);
      ASSERT_FALSE(std::isnan(got)) << n << "," << e;
      EXPECT_NEAR(got, want[size_t(e)], 2 * err + 1e-5 * (1 + std::fabs(want[size_t(e)])) * (1 + 0.1 * c.K))
          << "token " << n << " expert " << e;
    }
  }
  for (int e = 0; e < c.E; ++e) {
    const std::string n = "[" + std::to_string(e) + "]";
    expect_ok(st::testing::compare_bounded(HostTensor::copy_of(g.fc1.weight.per_group[size_t(e)].view()),
                                           bo.dw1[size_t(e)], c.dtype, "dW1" + n));
    expect_ok(st::testing::compare_bounded(HostTensor::copy_of(g.fc2.weight.per_group[size_t(e)].view()),
                                           bo.dw2[size_t(e)], c.dtype, "dW2" + n));
    if (c.mlp_bias)
      expect_ok(st::testing::compare_bounded(HostTensor::copy_of(g.fc2.bias_grad.view().select(e)),
                                             bo.db2[size_t(e)], c.dtype, "db2" + n));
  }
}

INSTANTIATE_TEST_SUITE_P(
    Cases, MoELayerVsOracle,
    ::testing::Values(Case{37, 8, 2, 16, 8, RouterScore::kSoftmax, true, false, false, DType::kBF16},
                      Case{29, 16, 4, 8, 16, RouterScore::kSigmoid, true, true, true, DType::kBF16},
                      Case{13, 4, 1, 24, 8, RouterScore::kSoftmax, false, false, true, DType::kFP16},
                      Case{9, 1, 1, 8, 8, RouterScore::kSigmoid, false, true, false, DType::kBF16},
                      Case{7, 64, 8, 8, 8, RouterScore::kSigmoid, true, true, false, DType::kBF16}),
    [](const ::testing::TestParamInfo<Case>& i) { return name(i.param); });

HostTensor copy(const st::Tensor& t) { return HostTensor::copy_of(t.view()); }

// Host memory overwritten when freed: a read after the free sees garbage, not the old values.
class PoisonOnFree final : public st::Allocator {
 public:
  void* allocate(size_t bytes, st::Device device, st::Stream stream) override {
    return st::default_allocator().allocate(bytes, device, stream);
  }
  void deallocate(void* p, size_t bytes, st::Device device, st::Stream stream) override {
    std::memset(p, 0xff, bytes);
    st::default_allocator().deallocate(p, bytes, device, stream);
  }
};

TEST(MoELayer, BitwiseRepeatableAndDelayedWgradEqualsImmediate) {
  const Case c{41, 8, 2, 16, 8, RouterScore::kSoftmax, true, true, true, DType::kBF16};
  Problem p(c, 2);
  st::MoELayer a(p.options(), p.mlp.params());
  const st::MoEForward fa = a.forward(p.x.view(), p.logits.view(), p.bias_view());
  const st::MoEGrads ga = a.backward(p.x.view(), p.logits.view(), fa, p.dout.view(), p.dsum.view());
  st::MoELayer b(p.options(), p.mlp.params());
  const st::MoEForward fb = b.forward(p.x.view(), p.logits.view(), p.bias_view());
  const st::MoEGrads gb = b.backward(p.x.view(), p.logits.view(), fb, p.dout.view(), p.dsum.view());
  EXPECT_TRUE(copy(fa.out).bytes_equal(copy(fb.out)));
  EXPECT_TRUE(copy(ga.grad_input).bytes_equal(copy(gb.grad_input)));
  EXPECT_TRUE(copy(ga.dlogits).bytes_equal(copy(gb.dlogits)));
  EXPECT_TRUE(copy(ga.fc1.weight.packed).bytes_equal(copy(gb.fc1.weight.packed)));

  st::MoELayerOptions delayed = p.options();
  delayed.mlp.delay_wgrad_compute = true;
  st::MoELayer d(delayed, p.mlp.params());
  st::MoEGrads gd;
  {
    const st::MoEForward fd = d.forward(p.x.view(), p.logits.view(), p.bias_view());
    gd = d.backward(p.x.view(), p.logits.view(), fd, p.dout.view(), p.dsum.view());
  }  // the forward's result is gone: the pending wgrad keeps what it needs alive
  EXPECT_EQ(gd.fc1.weight.kind, st::WeightGradKind::kNone);
  EXPECT_TRUE(copy(gd.grad_input).bytes_equal(copy(ga.grad_input)));
  EXPECT_TRUE(copy(gd.dlogits).bytes_equal(copy(ga.dlogits)));
  ASSERT_EQ(d.pending_wgrads(), 1u);
  const st::GroupedMLPGrads w = d.backward_dw();
  EXPECT_TRUE(copy(w.fc1.weight.packed).bytes_equal(copy(ga.fc1.weight.packed)));
  EXPECT_TRUE(copy(w.fc2.weight.packed).bytes_equal(copy(ga.fc2.weight.packed)));
  EXPECT_TRUE(copy(w.fc2.bias_grad).bytes_equal(copy(ga.fc2.bias_grad)));

  // recompute_expert_input: forward keeps no rows, backward gathers them again from x: the same
  // bits, immediate and delayed (the pending wgrad keeps the gathered rows alive), and x changed
  // after the backward (the rows were not read from it later).
  EXPECT_TRUE(st::MoELayerOptions{}.recompute_expert_input) << "the default";
  for (const bool delay : {false, true}) {
    SCOPED_TRACE(delay ? "delayed wgrad" : "immediate wgrad");
    st::MoELayerOptions o = p.options();
    o.recompute_expert_input = true;
    o.mlp.delay_wgrad_compute = delay;
    PoisonOnFree freed;
    st::MoELayer r(o, p.mlp.params(), &freed);
    HostTensor x = HostTensor::copy_of(p.x.view());
    st::MoEGrads gr;
    {
      const st::MoEForward fr = r.forward(x.view(), p.logits.view(), p.bias_view());
      EXPECT_FALSE(fr.rows.defined());
      EXPECT_TRUE(copy(fr.out).bytes_equal(copy(fa.out)));
      gr = r.backward(x.view(), p.logits.view(), fr, p.dout.view(), p.dsum.view());
    }
    std::mt19937_64 rng(99);
    x.fill_random(rng);
    EXPECT_TRUE(copy(gr.grad_input).bytes_equal(copy(ga.grad_input)));
    EXPECT_TRUE(copy(gr.dlogits).bytes_equal(copy(ga.dlogits)));
    st::GroupedMLPLayerGrads fc1 = gr.fc1, fc2 = gr.fc2;
    if (delay) {
      const st::GroupedMLPGrads dw = r.backward_dw();
      fc1 = dw.fc1, fc2 = dw.fc2;
    }
    EXPECT_TRUE(copy(fc1.weight.packed).bytes_equal(copy(ga.fc1.weight.packed)));
    EXPECT_TRUE(copy(fc2.weight.packed).bytes_equal(copy(ga.fc2.weight.packed)));
  }
}

// Two layers' gradients of one backward each, ga of a and gb of b, are the same bits: dx, dlogits
// and both weight grads (with a delayed wgrad, from each layer's backward_dw()). Returns b's
// weight grads (fc1, fc2).
std::pair<st::GroupedMLPLayerGrads, st::GroupedMLPLayerGrads> expect_same_grads(st::MoELayer& a, const st::MoEGrads& ga,
                                                                              st::MoELayer& b, const st::MoEGrads& gb,
                                                                              bool delay) {
  EXPECT_TRUE(copy(ga.grad_input).bytes_equal(copy(gb.grad_input)));
  EXPECT_TRUE(copy(ga.dlogits).bytes_equal(copy(gb.dlogits)));
  st::GroupedMLPLayerGrads a1 = ga.fc1, a2 = ga.fc2, b1 = gb.fc1, b2 = gb.fc2;
  if (delay) {
    const st::GroupedMLPGrads da = a.backward_dw(), db = b.backward_dw();
    a1 = da.fc1, a2 = da.fc2, b1 = db.fc1, b2 = db.fc2;
  }
  EXPECT_TRUE(copy(a1.weight.packed).bytes_equal(copy(b1.weight.packed)));
  EXPECT_TRUE(copy(a2.weight.packed).bytes_equal(copy(b2.weight.packed)));
  return {b1, b2};
}

// FP8 (blockwise recipe): with the rows recomputed (the default), fc1's quantizers read x's tokens
// in the layout's order (rowwise in forward; columnwise in backward when the wgrad runs there) and
// the rows are never written in the dtype; with them kept, they are gathered in bf16 and quantized
// after; with the wgrad in backward fc2's quantizers read dout's tokens likewise. All give the
// bits of an FP8 GroupedMLP on rows gathered beforehand, forward and backward, immediate and
// delayed wgrad (which gathers the rows in backward), hidden sizes over one and several
// 128-channel tiles, an uneven top-4 routing over 16 experts; F = 128 with the wgrad now takes the
// SwiGLU backward that writes fc1's d fc1_out codes itself.
TEST(MoELayer, Fp8RowsQuantizedAsGatheredGiveTheKeptRowsBits) {
  for (const int64_t F : {int64_t(32), int64_t(128)})
    for (const int64_t H : {int64_t(48), int64_t(272)})
      for (const bool delay : {false, true}) {
        SCOPED_TRACE("F " + std::to_string(F) + " H " + std::to_string(H) +
                     (delay ? ", delayed wgrad" : ", immediate wgrad"));
        const Case c{97, 16, 4, H, F, RouterScore::kSoftmax, true, true, false, DType::kBF16};
        Problem p(c, 3);
        st::MoELayerOptions kept = p.options(), recomputed = p.options();
        kept.mlp.fp8 = recomputed.mlp.fp8 = st::Fp8Recipe::kBlockwise;
        kept.mlp.delay_wgrad_compute = recomputed.mlp.delay_wgrad_compute = delay;
        recomputed.recompute_expert_input = true;
        st::MoELayer a(kept, p.mlp.params()), b(recomputed, p.mlp.params());
        const st::MoEForward fa = a.forward(p.x.view(), p.logits.view(), p.bias_view());
        const st::MoEForward fb = b.forward(p.x.view(), p.logits.view(), p.bias_view());
        EXPECT_TRUE(fa.rows.defined());
        EXPECT_FALSE(fb.rows.defined());
        EXPECT_TRUE(copy(fa.out).bytes_equal(copy(fb.out)));
        EXPECT_TRUE(copy(fa.fc1_out).bytes_equal(copy(fb.fc1_out)));
        const st::MoEGrads ga = a.backward(p.x.view(), p.logits.view(), fa, p.dout.view(), p.dsum.view());
        const st::MoEGrads gb = b.backward(p.x.view(), p.logits.view(), fb, p.dout.view(), p.dsum.view());
        const auto [b1, b2] = expect_same_grads(a, ga, b, gb, delay);
        // Both against an FP8 GroupedMLP on the rows gathered beforehand (x's and dout's, which the
        // layer's quantizers read from the tokens with the wgrad now): the same bits.
        st::GroupedMLP mlp(kept.mlp, p.mlp.params());
        const st::Splits sp = st::Splits::host(p.mlp.splits);
        const st::GroupedMLPForward fm = mlp.forward(p.mlp.x.view(), sp, fb.row_probs.view());
        EXPECT_TRUE(copy(fm.fc1_out).bytes_equal(copy(fb.fc1_out)));
        const st::GroupedMLPGrads gm = mlp.backward(p.mlp.x.view(), fm.fc1_out.view(), fb.row_probs.view(),
                                                    p.mlp.dy.view(), sp);
        const st::GroupedMLPGrads dm = delay ? mlp.backward_dw() : st::GroupedMLPGrads{};
        const st::Tensor dx = st::combine_rows(gm.grad_input.view(), fb.route.row_of.view());
        EXPECT_TRUE(copy(dx).bytes_equal(copy(gb.grad_input)));
        EXPECT_TRUE(copy((delay ? dm : gm).fc1.weight.packed).bytes_equal(copy(b1.weight.packed)));
        EXPECT_TRUE(copy((delay ? dm : gm).fc2.weight.packed).bytes_equal(copy(b2.weight.packed)));
        // And the recipe ran: the output is not the bf16 layer's.
        st::MoELayer bf16(p.options(), p.mlp.params());
        const st::MoEForward f16 = bf16.forward(p.x.view(), p.logits.view(), p.bias_view());
        EXPECT_FALSE(copy(f16.out).bytes_equal(copy(fb.out)));
      }
}

// FP8 with fp8_saved_activations: forward keeps fc1's output as e4m3 codes and fp32 scales, those
// of the recipe's rowwise quantization in each expert's rows (checked against the tiles quantized
// here from the plain FP8 layer's fc1_out, with the scale rule and encoder of fp8_blockwise.h), at
// 0.53x the dtype's bytes; the output is the plain layer's. Backward gives the bits of the plain
// FP8 layer's backward fed those codes decoded here (e4m3 times the tile's power of two: exact in
// bf16), immediate and delayed wgrad (which keeps the restored buffer alive), rows kept or
// recomputed, 2F over one partial and several 128-column tiles (F = 128 with the wgrad now: the
// SwiGLU backward reads the codes themselves, nothing restored), an uneven top-4 routing over 16
// experts. The decoded values lie within e4m3's rounding of fc1's output.
TEST(MoELayer, Fp8SavedActivationsKeepFc1sCodesAndGiveTheirDecodedBits) {
  for (const int64_t F : {int64_t(32), int64_t(80), int64_t(128)})
    for (const bool delay : {false, true})
      for (const bool recompute : {true, false}) {
        SCOPED_TRACE("F " + std::to_string(F) + (delay ? ", delayed wgrad" : ", immediate wgrad") +
                     (recompute ? ", rows recomputed" : ", rows kept"));
        const Case c{97, 16, 4, 48, F, RouterScore::kSoftmax, true, true, false, DType::kBF16};
        Problem p(c, 5);
        st::MoELayerOptions plain = p.options();
        plain.mlp.fp8 = st::Fp8Recipe::kBlockwise;
        plain.mlp.delay_wgrad_compute = delay;
        plain.recompute_expert_input = recompute;
        st::MoELayerOptions saving = plain;
        saving.fp8_saved_activations = true;
        EXPECT_FALSE(st::MoELayerOptions{}.fp8_saved_activations) << "the default";
        st::MoELayer a(plain, p.mlp.params()), b(saving, p.mlp.params());
        const st::MoEForward fa = a.forward(p.x.view(), p.logits.view(), p.bias_view());
        const st::MoEForward fb = b.forward(p.x.view(), p.logits.view(), p.bias_view());
        EXPECT_TRUE(copy(fa.out).bytes_equal(copy(fb.out)));
        const int64_t R = c.N * c.K, K2 = 2 * F, KB = st::fp8_tiles(K2);
        ASSERT_EQ(fb.fc1_out.view().dtype(), DType::kUInt8);
        ASSERT_EQ(fb.fc1_out.view().size(0), R);
        ASSERT_EQ(fb.fc1_out.view().size(1), K2);
        const HostTensor x1 = copy(fa.fc1_out), codes = copy(fb.fc1_out), scales = copy(fb.fc1_out_scales);
        const double held = double(codes.view().numel() + 4 * st::fp8_rowwise_scale_count(R, K2));
        EXPECT_LE(held, 0.54 * double(2 * x1.view().numel()));

        // Each 1 x 128 tile of each expert's rows quantized here; the codes decoded into `decoded`.
        std::vector<int64_t> offsets{0};
        for (const int n : p.route.counts) offsets.push_back(offsets.back() + n);
        HostTensor decoded(DType::kBF16, {R, K2});
        decoded.poison();
        int64_t wrong = 0;
        for (size_t g = 0; g + 1 < offsets.size(); ++g)
          for (int64_t r = offsets[g]; r < offsets[g + 1]; ++r)
            for (int64_t kb = 0; kb < KB; ++kb) {
              const int64_t k0 = kb * st::kFp8Tile, k1 = std::min(K2, k0 + st::kFp8Tile);
              float amax = 0.f;
              for (int64_t k = k0; k < k1; ++k) amax = st::fp8_amax(amax, float(x1.get(r * K2 + k)));
              const float scale = st::fp8_scale(amax);
              const float stored =
                  float(scales.get(st::fp8_rowwise_scale_index(offsets[g], offsets[g + 1] - offsets[g], KB, r, kb)));
              wrong += std::memcmp(&stored, &scale, 4) != 0;
              for (int64_t k = k0; k < k1; ++k) {
                const double x = x1.get(r * K2 + k);
                const uint8_t q = uint8_t(codes.get(r * K2 + k));
                wrong += q != st::fp8_quantize(float(x), scale);
                const double d = double(st::e4m3_decode(q)) * double(scale);
                decoded.set(r * K2 + k, d);
                wrong += decoded.get(r * K2 + k) != d;                     // exact in bf16
                wrong += std::abs(d - x) > std::abs(x) / 16 + double(scale) / 512;  // e4m3's rounding
              }
            }
        EXPECT_EQ(wrong, 0);

        // The plain layer fed the decoded codes: the same bits, immediate and delayed.
        st::MoEForward fed = fa;
        fed.fc1_out = st::Tensor::borrowed(decoded.view());
        const st::MoEGrads ga = a.backward(p.x.view(), p.logits.view(), fed, p.dout.view(), p.dsum.view());
        st::MoEGrads gb;
        {
          const st::MoEForward kept = fb;  // the saved struct gone after backward: the delayed wgrad
          gb = b.backward(p.x.view(), p.logits.view(), kept, p.dout.view(), p.dsum.view());
        }  // keeps what it needs alive
        expect_same_grads(a, ga, b, gb, delay);
      }
}

TEST(MoELayer, NoTokens) {
  const Case c{0, 4, 2, 8, 8, RouterScore::kSoftmax, false, false, false, DType::kBF16};
  Problem p(c, 4);
  st::MoELayer l(p.options(), p.mlp.params());
  const st::MoEForward f = l.forward(p.x.view(), p.logits.view());
  EXPECT_EQ(f.out.view().shape_str(), "[0, 8]");
  const st::MoEGrads g = l.backward(p.x.view(), p.logits.view(), f, p.dout.view());
  EXPECT_EQ(g.grad_input.view().shape_str(), "[0, 8]");
  EXPECT_EQ(g.dlogits.view().shape_str(), "[0, 4]");
  for (int e = 0; e < 4; ++e) {  // no rows: zero weight grads
    const HostTensor w = HostTensor::copy_of(g.fc1.weight.per_group[size_t(e)].view());
    for (int64_t i = 0; i < w.numel(); ++i) ASSERT_EQ(w.get(i), 0.0);
  }
}

// combine_rows against a sum written here: each token's rows read as doubles from their bits,
// added in slot order in float from 0, rounded once to the dtype (the contract's order), for
// every dtype, slots 1..5, rows used by several tokens or none; the output poisoned first.
TEST(MoECombineRows, SumsEachTokensRowsInSlotOrder) {
  for (const DType dt : {DType::kBF16, DType::kFP16, DType::kFP32})
    for (const int64_t K : {1, 2, 5}) {
      SCOPED_TRACE(std::string(st::dtype_name(dt)) + " K " + std::to_string(K));
      const int64_t N = 23, R = 31, H = 13;
      std::mt19937_64 rng(uint64_t(K) * 7 + uint64_t(dt));
      HostTensor rows(dt, {R, H});
      rows.fill_random(rng, 3.0);
      HostTensor row_of(DType::kInt32, {N, K});
      for (int64_t i = 0; i < N * K; ++i) row_of.set(i, double(rng() % uint64_t(R)));
      st::testing::PoisonAllocator poison;
      const st::Tensor out = st::combine_rows(rows.view(), row_of.view(), &poison);
      ASSERT_EQ(out.view().dtype(), dt);
      ASSERT_EQ(out.view().size(0), N);
      ASSERT_EQ(out.view().size(1), H);
      const HostTensor got = HostTensor::copy_of(out.view());
      HostTensor want(dt, {N, H});
      for (int64_t n = 0; n < N; ++n)
        for (int64_t h = 0; h < H; ++h) {
          float acc = 0.f;
          for (int64_t i = 0; i < K; ++i) acc += float(rows.get(int64_t(row_of.get(n * K + i)) * H + h));
          want.set(n * H + h, double(acc));  // set() rounds to the dtype (nearest even)
        }
      EXPECT_TRUE(got.bytes_equal(want));
    }
}

TEST(MoECombineRows, BadArgumentsAreNamed) {
  HostTensor rows(DType::kBF16, {4, 8}), row_of(DType::kInt32, {3, 2});
  for (int64_t i = 0; i < 6; ++i) row_of.set(i, double(i % 4));
  const HostTensor rows_i32(DType::kInt32, {4, 8}), row_of_i64(DType::kInt64, {3, 2}), row_of_1d(DType::kInt32, {6});
  expect_error([&] { st::combine_rows(rows_i32.view(), row_of.view()); }, {"rows", "bf16, fp16 or fp32", "int32"});
  expect_error([&] { st::combine_rows(rows.view(), row_of_i64.view()); }, {"row_of", "int32"});
  expect_error([&] { st::combine_rows(rows.view(), row_of_1d.view()); }, {"row_of", "[N, K]"});
  expect_error([&] { st::combine_rows(rows.view(), st::TensorView{}); }, {"row_of", "int32 [N, K]"});
  const int64_t shape[2] = {3, 1}, strides[2] = {2, 1};
  const st::TensorView strided(row_of.data(), DType::kInt32, shape, strides, 2, st::Device::cpu());
  expect_error([&] { st::combine_rows(rows.view(), strided); }, {"row_of", "contiguous"});
  row_of.set(5, 4.0);
  expect_error([&] { st::combine_rows(rows.view(), row_of.view()); }, {"row_of", "[0, R = 4)", "4", "flat index 5"});
  row_of.set(5, -1.0);
  expect_error([&] { st::combine_rows(rows.view(), row_of.view()); }, {"row_of", "[0, R = 4)", "-1"});
}

TEST(MoELayerErrors, BadArgumentsAreNamedBeforeAnythingIsWritten) {
  const Case c{11, 4, 2, 8, 8, RouterScore::kSoftmax, false, false, false, DType::kBF16};
  Problem p(c, 3);
  st::MoELayerOptions bad = p.options();
  bad.router.num_experts = 5;
  expect_error([&] { st::MoELayer l(bad, p.mlp.params()); }, {"mlp.num_groups", "router.num_experts = 5"});
  bad = p.options();
  bad.router.top_k = 5;
  st::MoELayer top5(bad, p.mlp.params());
  expect_error([&] { top5.forward(p.x.view(), p.logits.view()); }, {"top_k", "num_experts = 4"});

  st::MoELayerOptions delayed = p.options();
  delayed.mlp.delay_wgrad_compute = true;
  st::MoELayer l(delayed, p.mlp.params());
  const HostTensor x_fp16(DType::kFP16, {c.N, c.H});
  const HostTensor x_short(DType::kBF16, {c.N, c.H - 1});
  expect_error([&] { l.forward(x_fp16.view(), p.logits.view()); }, {"x", "bf16"});
  expect_error([&] { l.forward(x_short.view(), p.logits.view()); }, {"x", "hidden = 8"});
  const HostTensor logits_rows(DType::kFP32, {c.N + 1, c.E});
  expect_error([&] { l.forward(p.x.view(), logits_rows.view()); }, {"logits", "N = 11"});
  const HostTensor logits_bf16(DType::kBF16, {c.N, c.E});
  expect_error([&] { l.forward(p.x.view(), logits_bf16.view()); }, {"logits", "fp32"});

  const st::MoEForward f = l.forward(p.x.view(), p.logits.view());
  const HostTensor dout_short(DType::kBF16, {c.N - 1, c.H});
  const HostTensor dsum_wrong(DType::kFP32, {c.E + 1});
  expect_error([&] { l.backward(p.x.view(), p.logits.view(), f, dout_short.view()); }, {"dout", "[11, hidden = 8]"});
  expect_error([&] { l.backward(p.x.view(), p.logits.view(), f, p.dout.view(), dsum_wrong.view()); }, {"dscore_sum", "[4]"});
  expect_error([&] { l.backward(p.x.view(), logits_bf16.view(), f, p.dout.view()); }, {"logits", "fp32"});
  expect_error([&] { l.backward(p.x.view(), p.logits.view(), st::MoEForward{}, p.dout.view()); }, {"saved", "forward()'s result"});
  EXPECT_EQ(l.pending_wgrads(), 0u) << "a refused backward queued a delayed wgrad";
  l.backward(p.x.view(), p.logits.view(), f, p.dout.view());
  EXPECT_EQ(l.pending_wgrads(), 1u);

  // fp8_saved_activations: only with the recipe; backward takes only fc1's codes and scales.
  bad = p.options();
  bad.fp8_saved_activations = true;
  expect_error([&] { st::MoELayer s(bad, p.mlp.params()); }, {"fp8_saved_activations", "FP8 recipe"});
  Problem q(Case{11, 4, 2, 16, 16, RouterScore::kSoftmax, false, false, false, DType::kBF16}, 3);
  st::MoELayerOptions fp8 = q.options();
  fp8.mlp.fp8 = st::Fp8Recipe::kBlockwise;
  fp8.mlp.delay_wgrad_compute = true;
  st::MoELayer plain(fp8, q.mlp.params());
  fp8.fp8_saved_activations = true;
  st::MoELayer saving(fp8, q.mlp.params());
  const st::MoEForward fs = saving.forward(q.x.view(), q.logits.view());
  st::MoEForward dtype_copy = fs, no_scales = fs, few_scales = fs;
  dtype_copy.fc1_out = plain.forward(q.x.view(), q.logits.view()).fc1_out;  // bf16
  no_scales.fc1_out_scales = st::Tensor();
  const HostTensor scales_short(DType::kFP32, {fs.fc1_out_scales.view().numel() - 1});
  few_scales.fc1_out_scales = st::Tensor::borrowed(scales_short.view());
  expect_error([&] { saving.backward(q.x.view(), q.logits.view(), dtype_copy, q.dout.view()); },
               {"saved.fc1_out", "uint8 [22, 32]", "bf16"});
  expect_error([&] { saving.backward(q.x.view(), q.logits.view(), no_scales, q.dout.view()); },
               {"saved.fc1_out_scales"});
  expect_error([&] { saving.backward(q.x.view(), q.logits.view(), few_scales, q.dout.view()); },
               {"saved.fc1_out_scales", ">= 22 scales"});
  EXPECT_EQ(saving.pending_wgrads(), 0u) << "a refused backward queued a delayed wgrad";
  saving.backward(q.x.view(), q.logits.view(), fs, q.dout.view());
  EXPECT_EQ(saving.pending_wgrads(), 1u);
}

}  // namespace

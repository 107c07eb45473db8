// The MoE router (moe_router.h) on the CPU against an oracle written apart from the library's
// rules: scores in double, the choice by sorting every expert (score + bias descending, the lower
// id first on ties), the layout by a stable sort of (expert, token), and the logits' gradient by
// central differences of the oracle's forward in double with the choice held. Softmax and
// sigmoid, with and without normalisation and expert bias, top_k 1, 2, 8, E = 1 and 256, token
// counts that are no multiple of anything, ties, experts with no token, NaN logits; each bad
// argument gets its error naming it.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <numeric>
#include <ostream>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "expect_error.h"
#include "host_tensor.h"
#include "moe_router_oracle.h"
#include "sparsetrain/error.h"
#include "sparsetrain/moe_router.h"

namespace st = sparsetrain;
using st::DType;
using st::RouterScore;
using st::testing::HostTensor;
using st::testing::expect_error;
using st::testing::RouterOracle;
using st::testing::chosen_probs;
using st::testing::router_oracle;
using st::testing::router_scores;

namespace {

HostTensor from(const std::vector<float>& v, std::vector<int64_t> shape) {
  HostTensor t(DType::kFP32, std::move(shape));
  for (size_t i = 0; i < v.size(); ++i) t.set(int64_t(i), v[i]);
  return t;
}

std::vector<float> random_floats(size_t n, uint32_t seed, float scale) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> d(0.f, scale);
  std::vector<float> v(n);
  for (float& x : v) x = d(gen);
  return v;
}

double value(const st::Tensor& t, int64_t i) {
  switch (t.view().dtype()) {
    case DType::kInt32: return t.view().data_as<const int32_t>()[i];
    case DType::kInt64: return double(t.view().data_as<const int64_t>()[i]);
    default: return t.view().data_as<const float>()[i];
  }
}

struct Case {
  int64_t N;
  int E, K;
  RouterScore score;
  bool normalize, bias;
};

std::string name(const Case& c) {
  return "N" + std::to_string(c.N) + "_E" + std::to_string(c.E) + "_K" + std::to_string(c.K) +
         (c.score == RouterScore::kSoftmax ? "_softmax" : "_sigmoid") + (c.normalize ? "_norm" : "") +
         (c.bias ? "_bias" : "");
}

void PrintTo(const Case& c, std::ostream* os) { *os << name(c); }

class Router : public ::testing::TestWithParam<Case> {};

TEST_P(Router, MatchesTheOracleForwardAndBackward) {
  const Case c = GetParam();
  const uint32_t seed = uint32_t(c.N * 131 + c.E * 7 + c.K);
  const std::vector<float> logits = random_floats(size_t(c.N * c.E), seed, 2.f);
  const std::vector<float> bias = c.bias ? random_floats(size_t(c.E), seed + 1, 0.5f) : std::vector<float>{};
  const HostTensor hl = from(logits, {c.N, c.E});
  const HostTensor hb = c.bias ? from(bias, {c.E}) : HostTensor();
  const st::RouterOptions opt{c.E, c.K, c.score, c.normalize};
  const st::RouterOutput out = st::route(opt, hl.view(), c.bias ? hb.view() : st::TensorView{});
  const RouterOracle o = router_oracle(logits, bias, c.N, c.E, c.K, c.score, c.normalize);

  ASSERT_EQ(out.experts.view().shape_str(), "[" + std::to_string(c.N) + ", " + std::to_string(c.K) + "]");
  for (int64_t i = 0; i < c.N * c.K; ++i) {
    ASSERT_EQ(value(out.experts, i), o.experts[size_t(i)]) << "token " << i / c.K << " slot " << i % c.K;
    const double p = value(out.probs, i);
    ASSERT_FALSE(std::isnan(p)) << i;
    EXPECT_NEAR(p, o.probs[size_t(i)], 2e-6 * std::max(1.0, o.probs[size_t(i)])) << i;
    ASSERT_EQ(value(out.row_of, i), o.row_of[size_t(i)]) << i;
    ASSERT_EQ(value(out.token_of_row, i), o.token_of_row[size_t(i)]) << i;
  }
  for (int e = 0; e < c.E; ++e) {
    ASSERT_EQ(value(out.counts, e), double(o.counts[size_t(e)])) << e;
    // fp32 sums over N tokens in order: N rounding steps of at most 2^-24 relative each.
    EXPECT_NEAR(value(out.score_sum, e), o.score_sum[size_t(e)], 1e-6 * double(c.N) + 1e-6) << e;
  }

  // Backward: L = sum dprobs * probs + sum dscore_sum * score_sum; dL / dlogits by central
  // differences of the oracle in double, the choice held.
  const std::vector<float> dprobs = random_floats(size_t(c.N * c.K), seed + 2, 1.f);
  const std::vector<float> dsum = random_floats(size_t(c.E), seed + 3, 1.f);
  for (bool with_sum : {false, true}) {
    const HostTensor hdp = from(dprobs, {c.N, c.K});
    const HostTensor hds = from(dsum, {c.E});
    HostTensor hex(DType::kInt32, {c.N, c.K});
    for (int64_t i = 0; i < c.N * c.K; ++i) hex.set(i, o.experts[size_t(i)]);
    const st::Tensor dl =
        st::route_backward(opt, hl.view(), hex.view(), hdp.view(), with_sum ? hds.view() : st::TensorView{});
    for (int64_t n = 0; n < c.N; ++n) {
      const std::vector<double> l(logits.begin() + n * c.E, logits.begin() + (n + 1) * c.E);
      const std::vector<int> chosen(o.experts.begin() + n * c.K, o.experts.begin() + (n + 1) * c.K);
      const std::vector<double> dp(dprobs.begin() + n * c.K, dprobs.begin() + (n + 1) * c.K);
      const std::vector<double> ds(dsum.begin(), dsum.end());
      const std::vector<double> want =
          st::testing::dlogits_by_differences(l, chosen, c.score, c.normalize, dp, with_sum ? &ds : nullptr);
      for (int e = 0; e < c.E; ++e) {
        const double got = value(dl, n * c.E + e);
        ASSERT_FALSE(std::isnan(got));
        EXPECT_NEAR(got, want[size_t(e)], 1e-5 * (1.0 + std::fabs(want[size_t(e)])) * (1.0 + 0.05 * c.K))
            << "token " << n << " expert " << e << (with_sum ? " (with score sums)" : "");
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Cases, Router,
                         ::testing::Values(Case{37, 8, 2, RouterScore::kSoftmax, false, false},
                                           Case{37, 8, 2, RouterScore::kSoftmax, true, false},
                                           Case{53, 16, 1, RouterScore::kSoftmax, false, true},
                                           Case{29, 64, 8, RouterScore::kSigmoid, true, true},
                                           Case{29, 64, 8, RouterScore::kSigmoid, false, false},
                                           Case{11, 256, 8, RouterScore::kSigmoid, true, true},
                                           Case{9, 256, 8, RouterScore::kSoftmax, true, false},
                                           Case{5, 1, 1, RouterScore::kSoftmax, false, false},
                                           Case{5, 1, 1, RouterScore::kSigmoid, true, true},
                                           Case{1, 8, 8, RouterScore::kSoftmax, true, false}),
                         [](const ::testing::TestParamInfo<Case>& p) { return name(p.param); });

TEST(RouterRules, TiesGoToTheLowerExpertAndEmptyExpertsCountZero) {
  // Every logit equal: each token takes experts 0 and 1 (ties to the lower id); 2..5 get nothing.
  const int64_t N = 7;
  const int E = 6;
  const HostTensor l = from(std::vector<float>(size_t(N * E), 0.25f), {N, E});
  for (RouterScore s : {RouterScore::kSoftmax, RouterScore::kSigmoid}) {
    const st::RouterOutput out = st::route({E, 2, s, false}, l.view());
    for (int64_t n = 0; n < N; ++n) {
      EXPECT_EQ(value(out.experts, 2 * n), 0);
      EXPECT_EQ(value(out.experts, 2 * n + 1), 1);
      EXPECT_EQ(value(out.row_of, 2 * n), n);      // expert 0's rows first, tokens in order
      EXPECT_EQ(value(out.row_of, 2 * n + 1), N + n);
    }
    const std::vector<double> want{double(N), double(N), 0, 0, 0, 0};
    for (int e = 0; e < E; ++e) EXPECT_EQ(value(out.counts, e), want[size_t(e)]);
  }
  // A bias changes the choice, not the probs.
  HostTensor bias = from({0.f, 0.f, 0.f, 1.f, 0.f, 2.f}, {E});
  const st::RouterOutput b = st::route({E, 2, RouterScore::kSoftmax, false}, l.view(), bias.view());
  EXPECT_EQ(value(b.experts, 0), 5);
  EXPECT_EQ(value(b.experts, 1), 3);
  EXPECT_NEAR(value(b.probs, 0), 1.0 / 6, 1e-7);
}

TEST(RouterRules, NanLogitsGiveNanProbsNeverASilentChoice) {
  HostTensor l = from({0.5f, NAN, 1.f, -1.f, /* token 1 */ 0.f, 1.f, 2.f, 3.f}, {2, 4});
  const st::RouterOutput sm = st::route({4, 2, RouterScore::kSoftmax, false}, l.view());
  EXPECT_TRUE(std::isnan(value(sm.probs, 0)) && std::isnan(value(sm.probs, 1)));  // the whole row
  EXPECT_FALSE(std::isnan(value(sm.probs, 2)) || std::isnan(value(sm.probs, 3)));  // the other token
  const st::RouterOutput sg = st::route({4, 4, RouterScore::kSigmoid, false}, l.view());
  EXPECT_EQ(value(sg.experts, 3), 1);  // NaN chosen last, its prob NaN
  EXPECT_TRUE(std::isnan(value(sg.probs, 3)));
  for (int e = 0; e < 4; ++e) EXPECT_GE(value(sg.counts, e), 1);  // still k distinct experts
}

TEST(RouterErrors, BadArgumentsAreNamed) {
  const HostTensor l = from(random_floats(24, 1, 1.f), {6, 4});
  const HostTensor l16(DType::kBF16, {6, 4});
  const HostTensor wrong_e = from(random_floats(30, 1, 1.f), {6, 5});
  expect_error([&] { st::route({4, 5, RouterScore::kSoftmax, false}, l.view()); }, {"top_k", "num_experts = 4"});
  expect_error([&] { st::route({4, 0, RouterScore::kSoftmax, false}, l.view()); }, {"top_k", "1 <= top_k"});
  expect_error([&] { st::route({0, 1, RouterScore::kSoftmax, false}, l.view()); }, {"num_experts", "1 <="});
  expect_error([&] { st::route({4, 2, RouterScore(7), false}, l.view()); }, {"score", "kSoftmax"});
  expect_error([&] { st::route({4, 2, RouterScore::kSoftmax, false}, l16.view()); }, {"logits", "fp32"});
  expect_error([&] { st::route({4, 2, RouterScore::kSoftmax, false}, wrong_e.view()); }, {"logits", "[N, E = 4]"});
  expect_error([&] { st::route({4, 2, RouterScore::kSoftmax, false}, {}); }, {"logits", "no tensor"});
  const HostTensor bias3 = from({0.f, 0.f, 0.f}, {3});
  expect_error([&] { st::route({4, 2, RouterScore::kSoftmax, false}, l.view(), bias3.view()); }, {"expert_bias", "[4]"});
  float dummy[4] = {};
  const st::TensorView on_gpu(dummy, DType::kFP32, {1, 4}, st::Device::cuda(0));
  const HostTensor bias4 = from({0.f, 0.f, 0.f, 0.f}, {4});
  expect_error([&] { st::route({4, 2, RouterScore::kSoftmax, false}, on_gpu, bias4.view()); },
               {"expert_bias", "cuda:0 (logits' device)"});

  const st::RouterOptions opt{4, 2, RouterScore::kSoftmax, false};
  const st::RouterOutput out = st::route(opt, l.view());
  const HostTensor dp = from(std::vector<float>(12, 1.f), {6, 2});
  const HostTensor dp_wrong = from(std::vector<float>(18, 1.f), {6, 3});
  expect_error([&] { st::route_backward(opt, l.view(), out.experts.view(), dp_wrong.view()); }, {"dprobs", "[N = 6, top_k = 2]"});
  HostTensor bad_ids(DType::kInt32, {6, 2});
  for (int64_t i = 0; i < 12; ++i) bad_ids.set(i, i % 2);
  bad_ids.set(5, 4);
  expect_error([&] { st::route_backward(opt, l.view(), bad_ids.view(), dp.view()); }, {"experts", "[0, 4)"});
  bad_ids.set(5, 0);  // token 2: experts 0, 0
  expect_error([&] { st::route_backward(opt, l.view(), bad_ids.view(), dp.view()); }, {"experts", "distinct"});
  const HostTensor ds_wrong = from(std::vector<float>(3, 1.f), {3});
  expect_error([&] { st::route_backward(opt, l.view(), out.experts.view(), dp.view(), ds_wrong.view()); },
               {"dscore_sum", "[4]"});
}

}  // namespace

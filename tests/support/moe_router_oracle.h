// An oracle for the MoE router (moe_router.h) written apart from the library's rules: scores in
// double, the choice by sorting every expert (float score + bias descending, the lower id first on
// ties, as the rule states it), the layout by a stable sort of (expert, token).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <tuple>
#include <vector>

#include "sparsetrain/moe_router.h"

namespace sparsetrain::testing {

struct RouterOracle {
  std::vector<int> experts;     // [N, K]
  std::vector<double> probs;    // [N, K]
  std::vector<int64_t> counts;  // [E]
  std::vector<int> row_of, token_of_row;
  std::vector<double> score_sum;
};

inline std::vector<double> router_scores(const std::vector<double>& l, sparsetrain::RouterScore score) {
  std::vector<double> s(l.size());
  if (score == sparsetrain::RouterScore::kSigmoid) {
    for (size_t e = 0; e < l.size(); ++e) s[e] = 1.0 / (1.0 + std::exp(-l[e]));
    return s;
  }
  const double mx = *std::max_element(l.begin(), l.end());
  double sum = 0;
  for (size_t e = 0; e < l.size(); ++e) sum += s[e] = std::exp(l[e] - mx);
  for (double& v : s) v /= sum;
  return s;
}

// The probs of a token for a given choice (what the gradient check differentiates).
inline std::vector<double> chosen_probs(const std::vector<double>& l, const std::vector<int>& chosen, sparsetrain::RouterScore score,
                                 bool normalize) {
  const std::vector<double> s = router_scores(l, score);
  std::vector<double> p;
  double sum = 0;
  for (int e : chosen) p.push_back(s[size_t(e)]), sum += s[size_t(e)];
  if (normalize)
    for (double& v : p) v /= sum;
  return p;
}

inline RouterOracle router_oracle(const std::vector<float>& logits, const std::vector<float>& bias, int64_t N, int E, int K,
              sparsetrain::RouterScore score, bool normalize) {
  RouterOracle o;
  o.counts.assign(size_t(E), 0);
  o.score_sum.assign(size_t(E), 0.0);
  for (int64_t n = 0; n < N; ++n) {
    std::vector<double> l(logits.begin() + n * E, logits.begin() + (n + 1) * E);
    const std::vector<double> s = router_scores(l, score);
    // The choice compares float scores plus bias, as the library states its rule (ties exact).
    std::vector<int> ids(static_cast<size_t>(E));
    std::iota(ids.begin(), ids.end(), 0);
    auto value = [&](int e) { return float(s[size_t(e)]) + (bias.empty() ? 0.f : bias[size_t(e)]); };
    std::stable_sort(ids.begin(), ids.end(), [&](int a, int b) { return value(a) > value(b); });
    ids.resize(size_t(K));
    const std::vector<double> p = chosen_probs(l, ids, score, normalize);
    for (int i = 0; i < K; ++i) {
      o.experts.push_back(ids[size_t(i)]);
      o.probs.push_back(p[size_t(i)]);
      ++o.counts[size_t(ids[size_t(i)])];
    }
    for (int e = 0; e < E; ++e) o.score_sum[size_t(e)] += s[size_t(e)];
  }
  // Layout: (expert, token) pairs stably sorted by expert.
  std::vector<std::tuple<int, int64_t, int>> pairs;  // (expert, token, slot)
  for (int64_t n = 0; n < N; ++n)
    for (int i = 0; i < K; ++i) pairs.emplace_back(o.experts[size_t(n * K + i)], n, i);
  std::stable_sort(pairs.begin(), pairs.end(),
                   [](const auto& a, const auto& b) { return std::get<0>(a) < std::get<0>(b); });
  o.row_of.assign(size_t(N * K), -1);
  for (size_t r = 0; r < pairs.size(); ++r) {
    o.row_of[size_t(std::get<1>(pairs[r]) * K + std::get<2>(pairs[r]))] = int(r);
    o.token_of_row.push_back(int(std::get<1>(pairs[r])));
  }
  return o;
}

// One token's d/dlogits of sum_i dprobs[i] * probs_i (+ sum_e dsum[e] * s_e when dsum is given),
// the choice held, by central differences in double.
inline std::vector<double> dlogits_by_differences(const std::vector<double>& l, const std::vector<int>& chosen,
                                                  sparsetrain::RouterScore score, bool normalize,
                                                  const std::vector<double>& dprobs, const std::vector<double>* dsum) {
  auto loss = [&](const std::vector<double>& x) {
    const std::vector<double> p = chosen_probs(x, chosen, score, normalize);
    double L = 0;
    for (size_t i = 0; i < p.size(); ++i) L += dprobs[i] * p[i];
    if (dsum != nullptr) {
      const std::vector<double> s = router_scores(x, score);
      for (size_t e = 0; e < s.size(); ++e) L += (*dsum)[e] * s[e];
    }
    return L;
  };
  std::vector<double> g(l.size());
  const double h = 1e-5;
  for (size_t e = 0; e < l.size(); ++e) {
    std::vector<double> up = l, down = l;
    up[e] += h, down[e] -= h;
    g[e] = (loss(up) - loss(down)) / (2 * h);
  }
  return g;
}

}  // namespace sparsetrain::testing

// The MoE router's rules (docs/DESIGN.md section 10), per token and per expert, as plain
// host/device code: the CPU reference runs them in loops, a CUDA kernel will run them one token
// per thread group, so both choose the same experts by the same order.
//
//   score     s_e = softmax(logits)_e over all E experts, or sigmoid(logit_e)
//   choice    the top_k experts by s_e + bias_e (bias: optional, for the choice only: DeepSeek-V3's
//             aux-loss-free balancing), larger first; equal values: the lower expert id first;
//             NaN below every number (a NaN row still chooses k distinct experts)
//   probs     s_e of the chosen experts, in choice order; with `normalize` divided by their sum
//             (softmax: the softmax over the chosen logits, Mixtral's; sigmoid: DeepSeek-V3's)
//   layout    expert-major rows: expert e's rows start at the sum of the counts of experts < e
//             and hold its tokens in token order (each token chooses an expert at most once), so
//             the layout is a function of the choice alone (deterministic)
//
// A NaN logit makes that token's probs NaN (softmax: the whole row's; sigmoid: the NaN expert's):
// visible in the output, never silently dropped.
#pragma once

#include <cmath>
#include <cstdint>

#include "common/host_device.h"
#include "sparsetrain/moe_router.h"  // RouterScore

namespace sparsetrain {

struct RouterRule {
  int32_t num_experts = 0;
  int32_t top_k = 0;
  RouterScore score = RouterScore::kSoftmax;
  bool normalize = false;
};

// The choice order: a before b (larger first, NaN last, ties to the lower expert id).
ST_HOST_DEVICE inline bool router_choice_before(float a, int32_t expert_a, float b, int32_t expert_b) {
  const bool nan_a = a != a, nan_b = b != b;
  if (nan_a || nan_b) return nan_a == nan_b ? expert_a < expert_b : nan_b;
  return a > b || (a == b && expert_a < expert_b);
}

// What the softmax of one token's logits needs besides the logit: its max and 1 / sum exp(l - max).
struct SoftmaxRow {
  float max = 0.f, inv_sum = 1.f;
};

ST_HOST_DEVICE inline SoftmaxRow router_softmax_row(const float* logits, int32_t num_experts) {
  float mx = -INFINITY;
  bool nan = false;
  for (int32_t e = 0; e < num_experts; ++e) {
    nan = nan || logits[e] != logits[e];
    mx = logits[e] > mx ? logits[e] : mx;
  }
  if (nan) return {NAN, NAN};
  float sum = 0.f;
  for (int32_t e = 0; e < num_experts; ++e) sum += expf(logits[e] - mx);
  return {mx, 1.f / sum};
}

ST_HOST_DEVICE inline float router_score(const RouterRule& r, float logit, const SoftmaxRow& row) {
  return r.score == RouterScore::kSoftmax ? expf(logit - row.max) * row.inv_sum : 1.f / (1.f + expf(-logit));
}

// One token: experts[0..top_k) in choice order and their probs. logits: the token's E logits
// (contiguous), bias: E floats or null. top_k <= num_experts (the op checks it). One pass over the
// experts keeps the best top_k so far in choice order (ids in experts, values in probs), each
// expert's value computed once and inserted where the order puts it; the order is strict and
// total, so the i-th kept is the i-th best (what top_k passes of an argmax choose), in E * top_k
// compares at worst and E value computations, not top_k * E of each.
ST_HOST_DEVICE inline void route_token(const RouterRule& r, const float* logits, const float* bias,
                                       int32_t* experts, float* probs) {
  SoftmaxRow row;
  if (r.score == RouterScore::kSoftmax) row = router_softmax_row(logits, r.num_experts);
  int32_t kept = 0;
  for (int32_t e = 0; e < r.num_experts; ++e) {
    const float value = router_score(r, logits[e], row) + (bias != nullptr ? bias[e] : 0.f);
    if (kept == r.top_k && !router_choice_before(value, e, probs[kept - 1], experts[kept - 1])) continue;
    int32_t i = kept < r.top_k ? kept++ : kept - 1;  // full: the last kept drops out
    for (; i > 0 && router_choice_before(value, e, probs[i - 1], experts[i - 1]); --i) {
      experts[i] = experts[i - 1];
      probs[i] = probs[i - 1];
    }
    experts[i] = e;
    probs[i] = value;
  }
  float sum = 0.f;
  for (int32_t i = 0; i < r.top_k; ++i) {
    probs[i] = router_score(r, logits[experts[i]], row);
    sum += probs[i];
  }
  if (r.normalize)
    for (int32_t i = 0; i < r.top_k; ++i) probs[i] /= sum;
}

// One token's gradient with respect to its logits, from dprobs (top_k, the gradient of the probs
// route_token returned, in its order) and dscore_sum (E or null: the gradient of the per-expert
// sums of the scores over the tokens, the statistic an auxiliary load-balancing loss uses).
// dlogits: E floats, written (not accumulated). experts: distinct, in range (the callers check).
ST_HOST_DEVICE inline void route_token_backward(const RouterRule& r, const float* logits, const int32_t* experts,
                                                const float* dprobs, const float* dscore_sum, float* dlogits) {
  SoftmaxRow row;
  if (r.score == RouterScore::kSoftmax) row = router_softmax_row(logits, r.num_experts);
  // The chosen probs' sum and, with `normalize`, sum_c dq_c q_c (q: the normalised probs).
  float chosen_sum = 0.f;
  for (int32_t i = 0; i < r.top_k; ++i) chosen_sum += router_score(r, logits[experts[i]], row);
  float dq_dot_q = 0.f;
  if (r.normalize)
    for (int32_t i = 0; i < r.top_k; ++i) dq_dot_q += dprobs[i] * router_score(r, logits[experts[i]], row) / chosen_sum;
  // ds_e: the gradient with respect to the score s_e; dlogits first holds it. A chosen expert's
  // term is added to its dscore_sum once (the experts are distinct), the others' is none.
  for (int32_t e = 0; e < r.num_experts; ++e) dlogits[e] = dscore_sum != nullptr ? dscore_sum[e] : 0.f;
  for (int32_t i = 0; i < r.top_k; ++i)
    dlogits[experts[i]] += r.normalize ? (dprobs[i] - dq_dot_q) / chosen_sum : dprobs[i];
  float ds_dot_s = 0.f;  // sum_e ds_e s_e (softmax's Jacobian)
  for (int32_t e = 0; e < r.num_experts; ++e) ds_dot_s += dlogits[e] * router_score(r, logits[e], row);
  for (int32_t e = 0; e < r.num_experts; ++e) {
    const float s = router_score(r, logits[e], row);
    dlogits[e] = r.score == RouterScore::kSoftmax ? s * (dlogits[e] - ds_dot_s) : dlogits[e] * s * (1.f - s);
  }
}

}  // namespace sparsetrain

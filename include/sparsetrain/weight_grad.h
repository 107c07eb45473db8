// What a layer's backward hands back for a weight: the one rule every layer (GroupedLinear, both
// layers of GroupedMLP) follows, so that the implementations cannot drift apart (seed 002).
//
//   delay_wgrad | fuse into main_grad | has grad_added_to_main_grad | weight grad | bias grad
//   no          | no                  | -                           | the wgrad   | now
//   yes         | no                  | -                           | none        | backward_dw
//   no          | yes                 | no                          | none        | now
//   no          | yes                 | yes                         | dummy       | now
//   yes         | yes                 | no                          | none        | backward_dw
//   yes         | yes                 | yes                         | dummy       | backward_dw
#pragma once

namespace sparsetrain {

enum class WeightGradKind {
  kWgrad,  // the computed weight gradient
  kNone,   // nothing (delayed, or already added to main_grad)
  kDummy,  // a cached zero tensor of the weight's shape; the caller sets grad_added_to_main_grad
};

struct WeightGradDisposition {
  WeightGradKind weight;
  bool bias_grad_now;  // bias grads are never fused into main_grad; delayed ones come from backward_dw
};

constexpr WeightGradDisposition weight_grad_disposition(bool delay_wgrad, bool fuse_into_main_grad,
                                                        bool has_grad_added_to_main_grad) {
  return {fuse_into_main_grad && has_grad_added_to_main_grad ? WeightGradKind::kDummy
          : (delay_wgrad || fuse_into_main_grad)             ? WeightGradKind::kNone
                                                             : WeightGradKind::kWgrad,
          !delay_wgrad};
}

constexpr const char* weight_grad_kind_name(WeightGradKind k) {
  return k == WeightGradKind::kWgrad ? "wgrad" : k == WeightGradKind::kNone ? "none" : "dummy";
}

}  // namespace sparsetrain

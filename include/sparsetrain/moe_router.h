// The MoE router (docs/DESIGN.md section 10): router logits in, for each token its top_k experts,
// their probabilities, and the expert-major layout the grouped layers take (per-expert counts =
// their splits, the row of each (token, slot) and the token of each row), plus the per-expert
// score sums an auxiliary load-balancing loss uses (returned, not applied). The rules (scores,
// choice order and ties, normalisation, layout, NaN) are written once in src/common/moe_routing.h.
//
// The router's own linear layer (hidden -> E logits) stays the caller's. Runs where the logits are:
// on the CPU (the reference) or a CUDA device (kernels on `stream`, nothing read by the host:
// graph-capturable; device expert ids given to route_backward are not checked by the host, and a
// token with invalid ones gets NaN gradients instead).
#pragma once

#include <cstdint>

#include "sparsetrain/allocator.h"
#include "sparsetrain/tensor.h"

namespace sparsetrain {

// softmax over all experts, or sigmoid per expert (DeepSeek-V3).
enum class RouterScore : int32_t { kSoftmax = 0, kSigmoid = 1 };

struct RouterOptions {
  int64_t num_experts = 0;  // E >= 1
  int64_t top_k = 0;        // 1 <= top_k <= E
  RouterScore score = RouterScore::kSoftmax;
  // The chosen probs divided by their sum: with softmax, the softmax over the chosen logits
  // (Mixtral); with sigmoid, DeepSeek-V3's normalisation.
  bool normalize = false;
};

struct RouterOutput {
  Tensor experts;       // int32 [N, top_k]: each token's experts, in choice order
  Tensor probs;         // fp32 [N, top_k]: their probabilities, in the same order
  Tensor counts;        // int64 [E]: tokens per expert (the grouped layers' device splits)
  Tensor row_of;        // int32 [N, top_k]: the row of (token, slot) in the expert-major layout
  Tensor token_of_row;  // int32 [N * top_k]: the token each row of the layout holds
  Tensor score_sum;     // fp32 [E]: each expert's score summed over the tokens (in token order)
};

// logits: fp32 [N, E] (rows contiguous, any row stride). expert_bias: optional fp32 [E], added to
// the scores for the choice only (DeepSeek-V3's aux-loss-free balancing; probs do not see it).
// Outputs from `allocator` (default_allocator() if null) on `stream`.
RouterOutput route(const RouterOptions& options, const TensorView& logits, const TensorView& expert_bias = {},
                   Allocator* allocator = nullptr, Stream stream = {});

// The gradient of the logits (fp32 [N, E]) given route()'s experts for the same logits, the
// gradient of its probs (fp32 [N, top_k]) and, optionally, of its score sums (fp32 [E]). The
// choice is a constant (no gradient flows through it); the bias gets none.
Tensor route_backward(const RouterOptions& options, const TensorView& logits, const TensorView& experts,
                      const TensorView& dprobs, const TensorView& dscore_sum = {}, Allocator* allocator = nullptr,
                      Stream stream = {});

}  // namespace sparsetrain

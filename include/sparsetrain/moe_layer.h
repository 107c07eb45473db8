// MoELayer: a dropless MoE block after the router's own linear (docs/DESIGN.md section 10):
//
//   route (moe_router.h)  -> each token's top_k experts and probs, the expert-major layout
//   rows                  -> x's rows in that layout (row r holds token token_of_row[r])
//   GroupedMLP            -> one group per expert, each row scaled by its prob (grouped_mlp.h)
//   combine               -> out[n] = sum over slots i = 0..top_k-1 of the MLP's row row_of[n, i],
//                            in slot order, in fp32, rounded once: no atomics, so the output and
//                            every gradient are bitwise deterministic
//
// Backward: dout's rows go back through the same layout, the MLP's backward gives each row's
// dx and dprob, dx[n] sums token n's rows in slot order, and the router's backward turns the
// dprobs (and, optionally, the gradient of the per-expert score sums an aux loss used) into the
// logits' gradient. The experts' parameters follow GroupedMLP's contract (main_grad fusion,
// delayed wgrad through backward_dw()).
//
// Runs where the experts' parameters are: the CPU (the reference) or a CUDA device (the router,
// gather and combine kernels of ops/moe_backend.h and the GroupedMLP's, the counts as device
// splits: no host synchronisation, graph-capturable). The rows are gathered into a copy for fc1
// (kept for backward, or gathered again there: recompute_expert_input); folding the gather into
// fc1's loads is the next step.
#pragma once

#include <cstdint>

#include "sparsetrain/allocator.h"
#include "sparsetrain/grouped_mlp.h"
#include "sparsetrain/moe_router.h"
#include "sparsetrain/tensor.h"

namespace sparsetrain {

struct MoELayerOptions {
  RouterOptions router;
  // The experts: num_groups == router.num_experts, in_features == out_features (the hidden size).
  GroupedMLPOptions mlp;
  // true (the default): forward drops x's rows gathered for fc1 after fc1 and backward gathers
  // them again from x (N x top_k x hidden elements less held between forward and backward, for
  // one more gather pass in backward, about 1 % of a layer's fwd + bwd; the results are bitwise
  // the same); false: they are kept in MoEForward::rows until backward.
  bool recompute_expert_input = true;
  // With the FP8 recipe (mlp.fp8; an Error without it): true keeps fc1's output for backward in
  // e4m3 with one fp32 scale per row and 128 columns (the recipe's activation tiles, DESIGN.md
  // section 12) instead of the dtype, the largest thing held between forward and backward at 0.53x
  // its bytes: MoEForward::fc1_out holds the codes and fc1_out_scales their scales. Backward
  // restores them (exactly: the scales are powers of two) into the buffer that then takes their
  // gradient. Costs a quantizing pass over fc1's output in forward and a restoring one in backward.
  bool fp8_saved_activations = false;
};

struct MoEForward {
  Tensor out;          // [N, hidden] in mlp.dtype
  RouterOutput route;  // the routing (its score_sum is the aux-loss statistic)
  // Saved for backward (keep this whole struct until backward, and with delayed wgrad until
  // the matching backward_dw): x's rows in the expert-major layout (undefined with
  // recompute_expert_input), their probs, fc1's output ([R, 2F] in the dtype; with
  // fp8_saved_activations its e4m3 codes, uint8 [R, 2F], and their fp32 scales in fc1_out_scales).
  Tensor rows, row_probs, fc1_out, fc1_out_scales;
};

struct MoEGrads {
  Tensor grad_input;  // [N, hidden]
  Tensor dlogits;     // fp32 [N, E]
  GroupedMLPLayerGrads fc1, fc2;
};

// The layer's combine on its own: out [N, H] with out[n] = the sum over slots i = 0..K-1 of
// rows[row_of[n, i]], in fp32 from 0 in slot order, rounded once to rows' dtype. It is also the
// gradient of gathering rows by the layout's token_of_row (each token's rows' gradients summed)
// and, unlike a scatter-add, the same bits on every call. rows: [R, H] bf16, fp16 or fp32, rows
// contiguous; row_of: int32 [N, K] contiguous on rows' device with entries in [0, R) (route()'s
// row_of; checked on the host, trusted on a device, where reading them would synchronise). out
// from `allocator` (default_allocator() if null) on `stream`.
Tensor combine_rows(const TensorView& rows, const TensorView& row_of, Allocator* allocator = nullptr,
                    Stream stream = {});

class MoELayer {
 public:
  // `allocator`: where every output and intermediate comes from (default_allocator() if null);
  // it must outlive the layer.
  MoELayer(const MoELayerOptions& options, const GroupedMLPParams& params, Allocator* allocator = nullptr);

  const MoELayerOptions& options() const { return options_; }
  const GroupedMLP& experts() const { return mlp_; }

  // x [N, hidden] (mlp.dtype, rows contiguous), logits fp32 [N, E], expert_bias optional fp32 [E]
  // (for the choice only).
  MoEForward forward(const TensorView& x, const TensorView& logits, const TensorView& expert_bias = {},
                     const CallArgs& args = {});

  // x and logits as given to forward, `saved` its result, dout [N, hidden]; dscore_sum: optional
  // fp32 [E], the gradient of saved.route.score_sum.
  MoEGrads backward(const TensorView& x, const TensorView& logits, const MoEForward& saved, const TensorView& dout,
                    const TensorView& dscore_sum = {}, const CallArgs& args = {});

  // GroupedMLP::backward_dw of the experts (delayed wgrad).
  GroupedMLPGrads backward_dw(const CallArgs& args = {}) { return mlp_.backward_dw(args); }
  size_t pending_wgrads() const { return mlp_.pending_wgrads(); }
  // GroupedMLP::set_main_grads of the experts.
  void set_main_grads(const GroupedParam& fc1, const GroupedParam& fc2) { mlp_.set_main_grads(fc1, fc2); }

 private:
  MoELayerOptions options_;
  Allocator* allocator_;
  GroupedMLP mlp_;
};

}  // namespace sparsetrain

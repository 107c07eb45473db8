// GroupedMLP: an MoE expert MLP, fc1 (GroupedLinear in -> 2F) -> SwiGLU -> scaled by the per-row
// router probability probs[T] (fp32) -> fc2 (GroupedLinear F -> out):
//   y = probs * (silu(a) * b) W2^T + probs * b2
// a, b: the two halves of fc1's output, or with glu_interleave_size = k > 0 alternating blocks of
// k columns (columns [2jk, 2jk + k) are a's block j, [2jk + k, 2jk + 2k) b's block j).
// probs scales the whole expert output, fc2's bias included: fc2 runs without its bias and the
// MLP adds (and differentiates) probs * b2 itself. Both layers follow GroupedLinear's contract
// (docs/DESIGN.md section 4: splits, padded tail, caller buffers, main_grad fusion, delayed wgrad and
// the one weight-grad disposition rule of weight_grad.h); all results are bitwise deterministic.
#pragma once

#include <cstdint>
#include <deque>

#include "sparsetrain/allocator.h"
#include "sparsetrain/grouped_linear.h"
#include "sparsetrain/splits.h"
#include "sparsetrain/tensor.h"

namespace sparsetrain {

struct GroupedMLPOptions {
  int64_t num_groups = 0;
  int64_t in_features = 0;
  int64_t ffn_features = 0;         // F: fc1 has 2F outputs, fc2 F inputs
  int64_t out_features = 0;
  DType dtype = DType::kBF16;       // x, weights, biases, dy and every output but dprobs/main_grad
  int64_t glu_interleave_size = 0;  // 0: a, b are fc1's halves; k > 0: blocks of k (F % k == 0)
  // GroupedLinear's options, applied to both layers.
  bool fuse_wgrad_accumulation = false;
  bool overwrite_main_grad = false;
  bool delay_wgrad_compute = false;
  bool check_device_splits = false;
  Fp8Recipe fp8 = Fp8Recipe::kOff;  // both layers' GEMMs (grouped_linear.h; fc1 then takes no bias)
};

// Non-owning references to the caller's parameters of both layers: fc1.weight G x [2F, in],
// fc2.weight G x [out, F], optional biases G x [2F] and G x [out], main_grads with fusion.
struct GroupedMLPParams {
  GroupedLinearParams fc1, fc2;
};

struct GroupedMLPForward {
  Tensor out;      // [T, out]: the caller's buffer or a new tensor with rows >= S zero
  Tensor fc1_out;  // [T, 2F] pre-activation (rows >= S zero): save it for backward
};

// One layer's parameter grads, as weight_grad.h's disposition says.
struct GroupedMLPLayerGrads {
  WeightGrad weight;
  Tensor bias_grad;  // [G, out of the layer] when the layer has a bias and the grad is due now
};

// What backward may do with fc1_out, the saved pre-activation. kReuse, when this backward is its
// last use (no second backward through the same forward: the graph is not retained): d fc1_out is
// written over it (the activation's backward reads each element before writing its gradient), one
// [T, 2F] tensor less at the step's peak; fc1_out must then be contiguous (else it is kept), and
// with delayed wgrad stay alive until the matching backward_dw.
enum class Fc1OutUse { kKeep, kReuse };

struct GroupedMLPGrads {
  Tensor grad_input;  // backward only: the caller's grad_input buffer or a new [T, in] tensor
  Tensor dprobs;      // backward only: fp32 [T], rows >= S zero
  GroupedMLPLayerGrads fc1, fc2;
};

class GroupedMLP {
 public:
  // `allocator`: where outputs, intermediates (fc1_out, the fc2 input, the gradients between the
  // layers) and a missing workspace come from (default_allocator() if null); it must outlive the
  // layer. Parameters on the CPU run the reference backend, on a CUDA device the CUDA one.
  GroupedMLP(const GroupedMLPOptions& options, const GroupedMLPParams& params, Allocator* allocator = nullptr);

  const GroupedMLPOptions& options() const { return options_; }
  Device device() const { return fc1_.device(); }
  const GroupedLinear& fc1() const { return fc1_; }
  const GroupedLinear& fc2() const { return fc2_; }

  // Bytes of workspace forward, backward and backward_dw need for T input rows: the group
  // offsets, the elementwise stages' scratch and the larger of the two layers' workspaces (the
  // layers run one after the other and share it). Intermediate activations are not in it: they
  // come from the allocator. Depends on (G, T, in, F, out, dtype) only.
  size_t workspace_size(int64_t T) const;

  // x [T, in], probs fp32 [T]. out: optional caller buffer as GroupedLinear::forward's (rows < S
  // written in place, the rest untouched).
  GroupedMLPForward forward(const TensorView& x, const Splits& splits, const TensorView& probs,
                            const TensorView& out = {}, const CallArgs& args = {});

  // x, probs and splits as given to forward, fc1_out its saved pre-activation, dy [T, out].
  // The activation is recomputed from fc1_out. grad_input: optional caller buffer for dx as
  // GroupedLinear::backward's. With delayed wgrad, x, dy and probs must stay alive and unchanged
  // until the matching backward_dw(); the intermediates it needs are kept by the layer.
  GroupedMLPGrads backward(const TensorView& x, const TensorView& fc1_out, const TensorView& probs,
                           const TensorView& dy, const Splits& splits, const TensorView& grad_input = {},
                           const CallArgs& args = {}, Fc1OutUse fc1_out_use = Fc1OutUse::kKeep);

  // GroupedLinear::check_grad_input's checks for this MLP's grad_input (fc1's dgrad).
  void check_grad_input(const TensorView& x, const Splits& splits, const TensorView& grad_input) const {
    fc1_.check_grad_input(x, splits, grad_input);
  }

  // The oldest pending delayed wgrad of both layers (first in, first out), and the bias grads.
  // Error if none is pending. Without delay_wgrad_compute a no-op returning empty grads.
  GroupedMLPGrads backward_dw(const CallArgs& args = {});
  size_t pending_wgrads() const { return pending_.size(); }

  // GroupedLinear::set_main_grad of both layers.
  void set_main_grads(const GroupedParam& fc1, const GroupedParam& fc2) {
    fc1_.set_main_grad(fc1);
    fc2_.set_main_grad(fc2);
  }

 private:
  friend class MoELayer;  // its FP8 steps hand fc1's quantizers the tokens and rows (forward_rows, backward_rows)

  // forward / backward on x's rows x_rows (int32 [T]) when given, backward on dy's rows dy_rows
  // (int32 [T], no fc2 bias) when given: FP8 only, backward with the wgrad now (the quantizers
  // gather them, the rows are never written in the dtype); forward / backward: without either.
  GroupedMLPForward forward_rows(const TensorView& x, const TensorView& x_rows, const Splits& splits,
                                 const TensorView& probs, const TensorView& out, const CallArgs& args);
  // fc1_out_codes (backward_rows): fc1's output as its rowwise codes (the MoE layer's
  // fp8_saved_activations), read by the SwiGLU backward instead of fc1_out (then undefined); only
  // where backward_reads_codes().
  GroupedMLPGrads backward_rows(const TensorView& x, const TensorView& x_rows, const TensorView& fc1_out,
                                const TensorView& probs, const TensorView& dy, const TensorView& dy_rows,
                                const Splits& splits, const TensorView& grad_input, const CallArgs& args,
                                Fc1OutUse fc1_out_use, const ops::Fp8Operand* fc1_out_codes = nullptr);
  // Whether backward runs FP8 on codes from the SwiGLU backward (the recipe with the wgrad now, no
  // fc2 bias, a's and b's in 128-column tile pairs): fc1's output is then read only by it.
  bool backward_reads_codes() const;

  // What backward_dw needs beyond the layers' own queues: it owns the recomputed fc2 input and
  // fc1's output gradient (the layers keep only references) and refers to dy and probs for the
  // scaled fc2 bias grad.
  struct Pending {
    Tensor fc2_input, fc1_out_grad;
    TensorView dy, probs;
    Splits splits;
    std::shared_ptr<const void> keep_alive;  // CallArgs::keep_alive of the backward
  };
  Tensor scaled_bias_grad(const TensorView& dy, const TensorView& probs, const int64_t* offsets,
                          void* scratch, Stream stream);

  GroupedMLPOptions options_;
  GroupedParam fc2_bias_;  // applied (scaled by probs) by the MLP, not by fc2
  Allocator* allocator_;
  GroupedLinear fc1_, fc2_;
  std::deque<Pending> pending_;
};

}  // namespace sparsetrain

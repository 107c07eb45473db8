// GroupedLinear: G independent linear layers (experts) over one input whose rows are grouped
// contiguously by group. With x [T, in], splits[G] rows per group and S = sum(splits) <= T:
//   forward  y_g  = x_g W_g^T + b_g          (rows >= S are a padded tail)
//   dgrad    dx_g = dy_g W_g
//   wgrad    dW_g = dy_g^T x_g,  db_g = sum over the rows of dy_g   (0 for a group with no rows)
// Accumulation is fp32 and every reduction runs in a fixed order: results are bitwise
// deterministic. See docs/DESIGN.md section 4 for the whole contract; weight_grad.h for what backward
// hands back for the weight.
#pragma once

#include <cstdint>
#include <deque>
#include <memory>
#include <vector>

#include "sparsetrain/allocator.h"
#include "sparsetrain/splits.h"
#include "sparsetrain/tensor.h"
#include "sparsetrain/weight_grad.h"

namespace sparsetrain {

class GroupedMLP;

namespace ops {
struct Fp8Layer;
struct Fp8WeightCache;
struct Fp8Operand;
}  // namespace ops

// One parameter of G groups: G views of the per-group shape, or one packed view [G, ...].
class GroupedParam {
 public:
  GroupedParam() = default;
  static GroupedParam per_group(std::vector<TensorView> views);
  static GroupedParam packed(const TensorView& view);

  bool present() const { return !views_.empty(); }
  bool is_packed() const { return packed_; }
  int64_t num_groups() const;
  TensorView group(int64_t g) const;  // the view of group g (a slice of the packed view)
  const std::vector<TensorView>& views() const { return views_; }

 private:
  std::vector<TensorView> views_;
  bool packed_ = false;
};

// The GEMMs' precision: the layer's dtype, or FP8 with blockwise scales (docs/DESIGN.md section
// 12): e4m3 operands quantized as each GEMM reads them, fp32 accumulation, outputs in the layer's
// dtype (bf16), fp32 main_grad as without it.
enum class Fp8Recipe { kOff, kBlockwise };

struct GroupedLinearOptions {
  int64_t num_groups = 0;
  int64_t in_features = 0;
  int64_t out_features = 0;
  DType dtype = DType::kBF16;            // x, weight, bias, dy and every output but main_grad
  bool fuse_wgrad_accumulation = false;  // wgrad goes into params.main_grad (fp32), in one pass
  bool overwrite_main_grad = false;      // with fusion: main_grad = wgrad (a group with no rows: 0)
  bool delay_wgrad_compute = false;      // backward computes dgrad only; wgrad in backward_dw()
  bool check_device_splits = false;      // debug: sync, read device splits and raise if invalid
  Fp8Recipe fp8 = Fp8Recipe::kOff;       // kBlockwise: bf16 layers, in / out multiples of 16, no bias
};

// Non-owning references to the caller's parameters.
struct GroupedLinearParams {
  GroupedParam weight;     // required: G x [out, in] or [G, out, in], rows contiguous
  GroupedParam bias;       // optional: G x [out] or [G, out]
  GroupedParam main_grad;  // fp32, G x [out, in] or [G, out, in]; required with fusion
  // Whether the weight parameter carries Megatron's `grad_added_to_main_grad` attribute.
  bool has_grad_added_to_main_grad = false;
};

struct CallArgs {
  Stream stream;
  Workspace workspace;  // optional; workspace_size() bytes on the compute device
  // Optional: whatever keeps the caller's x and dy alive. backward() with delayed wgrad stores
  // it with the pending wgrad and releases it when backward_dw() pops that entry, so a binding
  // needs no queue of its own (the layer's queue is the only one).
  std::shared_ptr<const void> keep_alive;
  // A dummy weight grad (weight_grad.h) is the layer's cached zero tensor, allocated once; false:
  // a new zero tensor from the allocator on each call. A binding whose outputs are owned by a
  // memory pool the layer must not keep memory of (torch's CUDA graph trees) asks for new ones.
  bool cache_dummy_wgrad = true;
  // FP8 (options.fp8): the parameters' version as the caller counts it (torch: their version
  // counters). A call whose non-zero version equals the one the layer's quantized weights were
  // made at reuses them (fprop and dgrad of a step, micro-batches between optimizer steps); 0
  // quantizes anew and drops what the layer kept (what a captured graph must do: its replays
  // follow weights updated behind any counter, and the memory of a capture belongs to its pool).
  uint64_t weight_version = 0;
};

// Per-group stride (elements) of the packed weight-grad buffer: out*in rounded up so that each
// group's view starts on a 256-byte boundary. Fake / meta implementations take it from here.
int64_t packed_wgrad_group_stride(int64_t out_features, int64_t in_features, DType dtype);

// A weight gradient as backward hands it back (see weight_grad.h).
struct WeightGrad {
  WeightGradKind kind = WeightGradKind::kNone;
  // kWgrad: G views [out, in] into one packed buffer, each starting on a 256-byte boundary
  // (the per-group stride is padded when out*in*sizeof(dtype) is not a multiple of 256).
  // kDummy: G views of the cached zero tensor. Empty for kNone.
  std::vector<Tensor> per_group;
  // kWgrad: the packed buffer as one strided [G, out, in] view. kDummy with a packed weight: the
  // [G, out, in] dummy. Otherwise undefined.
  Tensor packed;
  bool grad_added_to_main_grad = false;  // kDummy: set the parameter's flag to True
};

struct GroupedLinearGrads {
  Tensor grad_input;  // backward only: the caller's grad_input buffer or a new [T, in] tensor
  WeightGrad weight;
  Tensor bias_grad;   // [G, out] when the layer has a bias and the disposition says "now"
};

class GroupedLinear {
 public:
  // `allocator`: where outputs and missing workspace come from (default_allocator() if null);
  // it must outlive the layer.
  GroupedLinear(const GroupedLinearOptions& options, const GroupedLinearParams& params,
                Allocator* allocator = nullptr);

  const GroupedLinearOptions& options() const { return options_; }
  const GroupedLinearParams& params() const { return params_; }
  Device device() const;

  // Bytes of workspace forward, backward and backward_dw need for T input rows. Depends on
  // (G, T, in, out, dtype) only, never on split values.
  size_t workspace_size(int64_t T) const;

  // y = x W^T + b per group. x: [T, in]. out: optional caller buffer, contiguous, of the layer's
  // dtype and device, with >= T rows (>= S with host splits); rows < S are written in place, the
  // rest untouched. Without it a new [T, out] tensor is returned with rows >= S zero.
  Tensor forward(const TensorView& x, const Splits& splits, const TensorView& out = {},
                 const CallArgs& args = {});

  // dgrad, and unless delayed, wgrad and bias grad. x and splits as given to forward; dy [T, out].
  // grad_input: optional caller buffer as `out` above, [>= T (>= S), in]. With delayed wgrad the
  // layer keeps references to x, dy (and device splits): they must stay alive and unchanged until
  // the matching backward_dw().
  GroupedLinearGrads backward(const TensorView& x, const TensorView& dy, const Splits& splits,
                              const TensorView& grad_input = {}, const CallArgs& args = {});

  // The checks backward() makes of a grad_input buffer (and of x and splits, which its rule
  // needs), for fronts that take the buffer at forward and must refuse it before anything runs
  // (torch). Reads no device memory; throws the error backward() would.
  void check_grad_input(const TensorView& x, const Splits& splits, const TensorView& grad_input) const;

  // Computes the oldest pending delayed wgrad (first in, first out): into main_grad when fused
  // (weight.kind = kNone), otherwise returned (kWgrad); and the bias grad. Error if none pending.
  // Without delay_wgrad_compute it is a no-op returning empty grads (weight.kind = kNone), as
  // TransformerEngine's: backward already computed the wgrad.
  GroupedLinearGrads backward_dw(const CallArgs& args = {});
  size_t pending_wgrads() const { return pending_.size(); }

  // Fusion's main_grad moved to other tensors of the same shapes (Megatron reallocating its grad
  // buffers; torch.compile handing a functional copy to a graph): later wgrads, pending delayed
  // ones included, go there. The views are checked as the constructor checks them.
  void set_main_grad(const GroupedParam& main_grad);

 private:
  friend class GroupedMLP;  // its FP8 forward hands fc2 h' already quantized (forward_quantized), its
                            // FP8 backward fc1 d fc1_out (backward_quantized), fc1 the MoE layer's
                            // tokens and rows (forward_gathered, backward_rows)

  struct Pending {
    TensorView x, dy;
    Splits splits;
    std::shared_ptr<const void> keep_alive;  // CallArgs::keep_alive of the backward
  };
  // wgrad and bias grad of T rows with the group offsets already in the workspace. dy_columnwise /
  // x_columnwise: FP8, that operand's wgrad layout when already written (else quantized here from
  // dy, of T rows, or x). x_rows as backward_rows'.
  GroupedLinearGrads compute_wgrad(const TensorView& x, const TensorView& x_rows, const TensorView& dy, int64_t T,
                                   const int64_t* offsets, void* scratch, Stream stream,
                                   const ops::Fp8Operand* dy_columnwise = nullptr,
                                   const ops::Fp8Operand* x_columnwise = nullptr);
  // The weight-grad part of a backward's result, by the layer's disposition, from the wgrad w
  // computed now (null: a delayed one; the dummy and bias rules as backward's).
  void settle_weight_grads(GroupedLinearGrads& grads, GroupedLinearGrads* w, const CallArgs& args);
  // backward on x's rows x_rows and dy's rows dy_rows (int32 [T]) where given: FP8 with the wgrad
  // now only (its quantizers gather them); backward: without either. backward_quantized (FP8, the
  // wgrad now): with dy already quantized, rowwise codes dyq [T, out_features] for the dgrad and
  // the columnwise ones dyq_columnwise for the wgrad (backward_rows with both: dy then unused).
  // FP8 with the wgrad now, split around a producer of x's wgrad layout (GroupedMLP's SwiGLU
  // backward writes fc2's input h' as columnwise codes from fc2's dgrad output): backward_rows with
  // dy_columnwise_out (x undefined, T = dy's rows) runs the dgrad only and leaves dy's columnwise
  // codes there; wgrad_columnwise then gives the weight grads backward would have.
  GroupedLinearGrads backward_rows(const TensorView& x, const TensorView& x_rows, const TensorView& dy,
                                   const TensorView& dy_rows, const Splits& splits, const TensorView& grad_input,
                                   const CallArgs& args, const ops::Fp8Operand* dyq = nullptr,
                                   const ops::Fp8Operand* dyq_columnwise = nullptr,
                                   ops::Fp8Operand* dy_columnwise_out = nullptr);
  GroupedLinearGrads wgrad_columnwise(const ops::Fp8Operand& x_columnwise, const ops::Fp8Operand& dy_columnwise,
                                      int64_t T, const Splits& splits, const CallArgs& args);
  GroupedLinearGrads backward_quantized(const TensorView& x, const TensorView& x_rows, const ops::Fp8Operand& dyq,
                                        const ops::Fp8Operand& dyq_columnwise, const Splits& splits,
                                        const TensorView& grad_input, const CallArgs& args);
  // forward with x already quantized rowwise (FP8, T = its rows); forward_gathered (FP8): on x's
  // rows x_rows (int32 [T], valid indices: the caller's), gathered by the quantizer; forward_rows:
  // all three, after the input's own check (x, or xq when given).
  Tensor forward_quantized(const ops::Fp8Operand& xq, const Splits& splits, const TensorView& out,
                           const CallArgs& args);
  Tensor forward_gathered(const TensorView& x, const TensorView& x_rows, const Splits& splits, const TensorView& out,
                          const CallArgs& args);
  Tensor forward_rows(const TensorView& x, const TensorView& x_rows, const ops::Fp8Operand* xq, int64_t T,
                      const Splits& splits, const TensorView& out, const CallArgs& args);
  // What the FP8 GEMMs read of the layer (ops/grouped_linear_fp8.h), at a call's weight version.
  ops::Fp8Layer fp8_layer(uint64_t weight_version);
  // A zero tensor of the weight's shape: the cached one, or a new one (CallArgs::cache_dummy_wgrad).
  Tensor dummy_wgrad(bool cached, Stream stream);

  GroupedLinearOptions options_;
  GroupedLinearParams params_;
  Allocator* allocator_;
  std::deque<Pending> pending_;
  Tensor dummy_;  // cached zero tensor of the weight's shape and dtype; never aliases main_grad
  std::shared_ptr<ops::Fp8WeightCache> fp8_weights_;  // FP8: the quantized weights of the last version
};

}  // namespace sparsetrain

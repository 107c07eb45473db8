// GroupedMLP's rules, held once for every backend: validation of everything before any write or
// allocation, the workspace plan, and the composition of two GroupedLinears (which keep their own
// contract: caller buffers, main_grad, delayed wgrad, the weight-grad disposition) with the
// elementwise stages of ops/grouped_mlp_backend.h. fc2 runs without its bias because the bias is
// scaled by probs; the MLP adds it and computes its grad, under the same disposition rule.
#include "sparsetrain/grouped_mlp.h"

#include <algorithm>
#include <string>

#include "ops/checks.h"
#include "ops/grouped_args.h"
#include "ops/grouped_linear_fp8.h"
#include "ops/grouped_mlp_backend.h"
#include "ops/pick_backend.h"

namespace sparsetrain {

backend::GroupedMLPBackend& backend::grouped_mlp_backend_for(Device device, const char* arg) {
  return ops::pick_backend<GroupedMLPBackend>(device, arg, grouped_mlp_reference_backend,
                                              ST_CUDA_BACKEND(grouped_mlp_cuda_backend));
}

namespace {

using backend::GroupedMLPBackend;
using ops::round_up;

std::string features(int64_t n, const char* what) { return std::to_string(n) + " (" + what + ")"; }

// Checks the options and what GroupedMLP adds to its layers' rules: the layers' sizes follow
// from (in, F, out), and fc2's bias belongs to the MLP. Returns the options.
const GroupedMLPOptions& validated(const GroupedMLPOptions& o, const GroupedMLPParams& params) {
  ST_CHECK_ARG(o.num_groups >= 1, "num_groups", ">= 1", o.num_groups);
  ST_CHECK_ARG(o.in_features >= 1, "in_features", ">= 1", o.in_features);
  ST_CHECK_ARG(o.ffn_features >= 1, "ffn_features", ">= 1", o.ffn_features);
  ST_CHECK_ARG(o.out_features >= 1, "out_features", ">= 1", o.out_features);
  ST_CHECK_ARG(is_floating(o.dtype), "dtype", "bf16, fp16 or fp32", dtype_name(o.dtype));
  ST_CHECK_ARG(o.glu_interleave_size >= 0, "glu_interleave_size", ">= 0 (0: a and b are fc1's halves)",
               o.glu_interleave_size);
  ST_CHECK_ARG(o.glu_interleave_size == 0 || o.ffn_features % o.glu_interleave_size == 0, "glu_interleave_size",
               "a divisor of ffn_features = " + std::to_string(o.ffn_features), o.glu_interleave_size);
  ST_CHECK_ARG(!o.overwrite_main_grad || o.fuse_wgrad_accumulation, "overwrite_main_grad",
               "false unless fuse_wgrad_accumulation is true", "true");
  ST_CHECK_ARG(params.fc1.weight.present(), "fc1.weight", "per-group or packed tensors", "none");
  ST_CHECK_ARG(params.fc2.weight.present(), "fc2.weight", "per-group or packed tensors", "none");
  const Device dev = params.fc1.weight.views()[0].device();
  backend::grouped_mlp_backend_for(dev, "fc1.weight");
  const int64_t G = o.num_groups, F = o.ffn_features;
  ops::check_grouped_param(params.fc1.weight, "fc1.weight", G, {2 * F, o.in_features},
                           features(2 * F, "2 * ffn_features") + ", " + features(o.in_features, "in_features"),
                           o.dtype, dev);
  ops::check_grouped_param(params.fc2.weight, "fc2.weight", G, {o.out_features, F},
                           features(o.out_features, "out_features") + ", " + features(F, "ffn_features"),
                           o.dtype, dev);
  if (params.fc2.bias.present())
    ops::check_grouped_param(params.fc2.bias, "fc2.bias", G, {o.out_features},
                             features(o.out_features, "out_features"), o.dtype, dev);
  return o;
}

GroupedLinearOptions layer_options(const GroupedMLPOptions& o, int64_t in, int64_t out) {
  GroupedLinearOptions l;
  l.num_groups = o.num_groups;
  l.in_features = in;
  l.out_features = out;
  l.dtype = o.dtype;
  l.fuse_wgrad_accumulation = o.fuse_wgrad_accumulation;
  l.overwrite_main_grad = o.overwrite_main_grad;
  l.delay_wgrad_compute = o.delay_wgrad_compute;
  l.check_device_splits = o.check_device_splits;
  l.fp8 = o.fp8;
  return l;
}

// A GroupedLinear whose argument errors name the layer ("fc1.main_grad: expected ...").
GroupedLinear make_layer(const char* name, const GroupedLinearOptions& o, const GroupedLinearParams& p,
                         Allocator* alloc) {
  try {
    return GroupedLinear(o, p, alloc);
  } catch (const Error& e) {
    throw Error(e.kind(), std::string(name) + "." + e.what());
  }
}

GroupedLinearParams without_bias(GroupedLinearParams p) {
  p.bias = GroupedParam();
  return p;
}

void check_probs(const TensorView& probs, int64_t T, Device dev) {
  checks::defined(probs, "probs", "an fp32 tensor of shape [T] (one router probability per row of x)");
  ST_CHECK_ARG(probs.dim() == 1 && probs.size(0) == T, "probs",
               "shape [" + std::to_string(T) + "] (one router probability per row of x)", probs.shape_str());
  checks::dtype(probs, "probs", DType::kFP32, " (router probabilities)");
  checks::device(probs, "probs", dev);
  checks::contiguous(probs, "probs");
  checks::non_null(probs, "probs");
}

// Workspace layout: group offsets for the elementwise stages, a status sink for device splits
// without a caller status word, the stages' scratch, then one region the two layers take in turn
// (they run one after the other on the stream). Every part starts on a 256-byte boundary.
struct WorkspacePlan {
  size_t offsets = 0, status = 0, scratch = 0, layers = 0, layer_bytes = 0, total = 0;
};

struct CallWorkspace {
  // layer_args: the call's own but its workspace (the layers' region) and keep_alive (the MLP
  // keeps its delayed wgrads' tensors itself).
  CallWorkspace(const WorkspacePlan& plan, const CallArgs& args, Device device, Allocator& alloc)
      : memory(plan.total, args.workspace, device, alloc, args.stream),
        offsets(reinterpret_cast<int64_t*>(memory.at(plan.offsets))),
        status(reinterpret_cast<int32_t*>(memory.at(plan.status))),
        scratch(memory.at(plan.scratch)),
        layer_args(args) {
    layer_args.workspace = {memory.at(plan.layers), plan.layer_bytes};
    layer_args.keep_alive = nullptr;
  }
  ops::WorkspaceMemory memory;
  int64_t* offsets;
  int32_t* status;
  void* scratch;
  CallArgs layer_args;  // what fc1 and fc2 are called with
};

}  // namespace

GroupedMLP::GroupedMLP(const GroupedMLPOptions& options, const GroupedMLPParams& params, Allocator* allocator)
    : options_(validated(options, params)),
      fc2_bias_(params.fc2.bias),
      allocator_(allocator ? allocator : &default_allocator()),
      fc1_(make_layer("fc1", layer_options(options, options.in_features, 2 * options.ffn_features), params.fc1,
                      allocator_)),
      fc2_(make_layer("fc2", layer_options(options, options.ffn_features, options.out_features),
                      without_bias(params.fc2), allocator_)) {}

namespace {

WorkspacePlan plan_workspace(const GroupedMLPOptions& o, int64_t T, const GroupedMLPBackend& be,
                             const GroupedLinear& fc1, const GroupedLinear& fc2) {
  WorkspacePlan p;
  p.status = round_up(size_t(o.num_groups + 1) * sizeof(int64_t), kAllocAlignment);
  p.scratch = p.status + kAllocAlignment;
  p.layers = p.scratch + round_up(be.scratch_bytes(o.dtype, o.num_groups, T, o.ffn_features, o.out_features),
                                  kAllocAlignment);
  p.layer_bytes = std::max(fc1.workspace_size(T), fc2.workspace_size(T));
  p.total = p.layers + round_up(p.layer_bytes, kAllocAlignment);
  return p;
}

}  // namespace

size_t GroupedMLP::workspace_size(int64_t T) const {
  return plan_workspace(options_, T, backend::grouped_mlp_backend_for(device(), "fc1.weight"), fc1_, fc2_).total;
}

GroupedMLPForward GroupedMLP::forward(const TensorView& x, const Splits& splits, const TensorView& probs,
                                      const TensorView& out, const CallArgs& args) {
  return forward_rows(x, {}, splits, probs, out, args);
}

GroupedMLPForward GroupedMLP::forward_rows(const TensorView& x, const TensorView& x_rows, const Splits& splits,
                                           const TensorView& probs, const TensorView& out, const CallArgs& args) {
  const GroupedMLPOptions& o = options_;
  const Device dev = device();
  backend::GroupedLinearBackend& gemm = backend::backend_for(dev, "x");
  GroupedMLPBackend& be = backend::grouped_mlp_backend_for(dev, "x");
  ops::check_activation(x, "x", o.dtype, dev, -1, o.in_features, "in_features");
  if (x_rows.defined() && o.fp8 == Fp8Recipe::kOff)
    ST_FAIL("GroupedMLP::forward_rows: x_rows needs the FP8 recipe (its quantizer gathers)");
  const int64_t T = backend::fp8_operand_rows(x, x_rows);
  check_probs(probs, T, dev);
  const int64_t S = ops::check_splits(splits, o.num_groups, T, dev, o.check_device_splits, gemm, args.stream);
  if (out.defined())
    ops::check_out_buffer(out, "out", o.dtype, dev, o.out_features, ops::min_out_rows(S, T),
                          ops::min_out_rows_rule(S));
  const WorkspacePlan plan = plan_workspace(o, T, be, fc1_, fc2_);
  ops::check_workspace(plan.total, args.workspace);

  // Everything is valid: from here on outputs may be written.
  CallWorkspace ws(plan, args, dev, *allocator_);
  ops::prepare_offsets(splits, T, ws.offsets, ws.status, gemm, dev, args.stream);
  const backend::MLPRows rows{o.dtype, o.num_groups, T, ws.offsets};
  GroupedMLPForward result;
  result.fc1_out = x_rows.defined() ? fc1_.forward_gathered(x, x_rows, splits, {}, ws.layer_args)
                                    : fc1_.forward(x, splits, {}, ws.layer_args);
  if (o.fp8 != Fp8Recipe::kOff) {  // h' straight to fc2's rowwise codes: never in memory in the dtype
    const ops::Fp8Operand hq = ops::fp8_rowwise_buffers(*allocator_, dev, T, o.ffn_features, args.stream);
    be.swiglu_forward({rows, o.ffn_features, o.glu_interleave_size, result.fc1_out.view(), probs, {}, hq.view()},
                      ws.scratch, args.stream);
    result.out = fc2_.forward_quantized(hq, splits, out, ws.layer_args);
  } else {
    Tensor h = Tensor::empty(o.dtype, {T, o.ffn_features}, dev, *allocator_, args.stream);
    be.swiglu_forward({rows, o.ffn_features, o.glu_interleave_size, result.fc1_out.view(), probs, h.view(), {}},
                      ws.scratch, args.stream);
    result.out = fc2_.forward(h.view(), splits, out, ws.layer_args);
  }
  if (fc2_bias_.present())
    be.scaled_bias_add({rows, o.out_features, result.out.view(), probs, ops::group_views(fc2_bias_, o.num_groups)},
                       ws.scratch, args.stream);
  return result;
}

Tensor GroupedMLP::scaled_bias_grad(const TensorView& dy, const TensorView& probs, const int64_t* offsets,
                                    void* scratch, Stream stream) {
  const GroupedMLPOptions& o = options_;
  Tensor db = Tensor::empty(o.dtype, {o.num_groups, o.out_features}, device(), *allocator_, stream);
  std::vector<TensorView> per_group;
  for (int64_t g = 0; g < o.num_groups; ++g) per_group.push_back(db.view().select(g));
  backend::grouped_mlp_backend_for(device(), "dy")
      .scaled_bias_grad({{o.dtype, o.num_groups, dy.size(0), offsets}, o.out_features, dy, probs, per_group},
                        scratch, stream);
  return db;
}

GroupedMLPGrads GroupedMLP::backward(const TensorView& x, const TensorView& fc1_out, const TensorView& probs,
                                     const TensorView& dy, const Splits& splits, const TensorView& grad_input,
                                     const CallArgs& args, Fc1OutUse fc1_out_use) {
  return backward_rows(x, {}, fc1_out, probs, dy, {}, splits, grad_input, args, fc1_out_use);
}

bool GroupedMLP::backward_reads_codes() const {
  const GroupedMLPOptions& o = options_;
  return o.fp8 != Fp8Recipe::kOff && !o.delay_wgrad_compute && !fc2_bias_.present() &&
         backend::glu_tiles_pair(o.ffn_features, o.glu_interleave_size);
}

GroupedMLPGrads GroupedMLP::backward_rows(const TensorView& x, const TensorView& x_rows, const TensorView& fc1_out,
                                          const TensorView& probs, const TensorView& dy, const TensorView& dy_rows,
                                          const Splits& splits, const TensorView& grad_input, const CallArgs& args,
                                          Fc1OutUse fc1_out_use, const ops::Fp8Operand* fc1_out_codes) {
  const GroupedMLPOptions& o = options_;
  const Device dev = device();
  const int64_t F = o.ffn_features;
  backend::GroupedLinearBackend& gemm = backend::backend_for(dev, "x");
  GroupedMLPBackend& be = backend::grouped_mlp_backend_for(dev, "x");
  ops::check_activation(x, "x", o.dtype, dev, -1, o.in_features, "in_features");
  // With dy_rows fc2's quantizers must be dy's only readers: no fc2 bias (its gradient terms read
  // dy's rows).
  if ((x_rows.defined() || dy_rows.defined()) && (o.fp8 == Fp8Recipe::kOff || o.delay_wgrad_compute))
    ST_FAIL("GroupedMLP::backward_rows: x_rows / dy_rows need the FP8 recipe and the wgrad now (the quantizers "
            "gather)");
  if (dy_rows.defined() && fc2_bias_.present())
    ST_FAIL("GroupedMLP::backward_rows: dy_rows with an fc2 bias (its gradient terms read dy's rows)");
  const int64_t T = backend::fp8_operand_rows(x, x_rows);
  if (fc1_out_codes) {
    const TensorView& q = fc1_out_codes->data.view();
    if (!backward_reads_codes() || q.dim() != 2 || q.size(0) != T || q.size(1) != 2 * F)
      ST_FAIL("GroupedMLP::backward_rows: fc1_out's codes need an FP8 backward on codes and shape [" +
              std::to_string(T) + ", " + std::to_string(2 * F) + "]");
  } else {
    ops::check_activation(fc1_out, "fc1_out", o.dtype, dev, T, 2 * F, "2 * ffn_features");
  }
  check_probs(probs, T, dev);
  ops::check_activation(dy, "dy", o.dtype, dev, dy_rows.defined() ? -1 : T, o.out_features, "out_features");
  const int64_t S = ops::check_splits(splits, o.num_groups, T, dev, o.check_device_splits, gemm, args.stream);
  if (grad_input.defined())
    ops::check_out_buffer(grad_input, "grad_input", o.dtype, dev, o.in_features, ops::min_out_rows(S, T),
                          ops::min_out_rows_rule(S));
  const WorkspacePlan plan = plan_workspace(o, T, be, fc1_, fc2_);
  ops::check_workspace(plan.total, args.workspace);
  // fc2's bias follows the weight-grad rule like every other bias (its weight's attribute does
  // not matter for a bias grad, only whether wgrad is delayed).
  const bool fc2_bias_grad_now =
      weight_grad_disposition(o.delay_wgrad_compute, o.fuse_wgrad_accumulation,
                              fc2_.params().has_grad_added_to_main_grad)
          .bias_grad_now;

  // Everything is valid: from here on outputs may be written.
  CallWorkspace ws(plan, args, dev, *allocator_);
  ops::prepare_offsets(splits, T, ws.offsets, ws.status, gemm, dev, args.stream);
  const backend::MLPRows rows{o.dtype, o.num_groups, T, ws.offsets};
  GroupedMLPGrads grads;

  // FP8 with the wgrad now, a's and b's in tile pairs and no fc2 bias (its terms read dy): fc2's
  // dgrad, then the SwiGLU backward writes fc1's two layouts of d fc1_out codes and fc2's input h'
  // as its wgrad's codes from one read of fc1_out and dh' (neither in memory in the dtype), then
  // fc2's wgrad and fc1's backward on those codes.
  const bool codes = backward_reads_codes();
  grads.dprobs = Tensor::empty(DType::kFP32, {T}, dev, *allocator_, args.stream);
  Tensor h, dz;
  GroupedLinearGrads g1;
  if (codes) {
    ops::Fp8Operand dy_columnwise;
    GroupedLinearGrads g2 = fc2_.backward_rows({}, {}, dy, dy_rows, splits, {}, ws.layer_args, nullptr, nullptr,
                                               &dy_columnwise);
    const ops::Fp8Operand dzq = ops::fp8_rowwise_buffers(*allocator_, dev, T, 2 * F, args.stream);
    const ops::Fp8Operand dzc = ops::fp8_columnwise_buffers(*allocator_, dev, T, 2 * F, o.num_groups, args.stream);
    const ops::Fp8Operand hc = ops::fp8_columnwise_buffers(*allocator_, dev, T, F, o.num_groups, args.stream);
    be.swiglu_backward({rows, F, o.glu_interleave_size, o.out_features, fc1_out, probs, g2.grad_input.view(), {}, {},
                        {}, grads.dprobs.view(), dzq.view(), dzc.view(), hc.view(),
                        fc1_out_codes ? fc1_out_codes->view() : backend::Fp8Tensor{}},
                       ws.scratch, args.stream);
    g2.grad_input = Tensor();  // dh' is no longer needed
    grads.fc2.weight = fc2_.wgrad_columnwise(hc, dy_columnwise, T, splits, ws.layer_args).weight;
    g1 = fc1_.backward_quantized(x, x_rows, dzq, dzc, splits, grad_input, ws.layer_args);
  } else {
    // fc2: its input h' = probs * silu(a) * b is recomputed rather than saved.
    h = Tensor::empty(o.dtype, {T, F}, dev, *allocator_, args.stream);
    be.swiglu_forward({rows, F, o.glu_interleave_size, fc1_out, probs, h.view(), {}}, ws.scratch, args.stream);
    GroupedLinearGrads g2 = fc2_.backward_rows(h.view(), {}, dy, dy_rows, splits, {}, ws.layer_args);
    // Its only reader was fc2's wgrad: freed now (stream-ordered), not at the end, it is one [T, F]
    // less at the step's peak (fc1's backward). A delayed wgrad keeps it for backward_dw.
    if (!o.delay_wgrad_compute) h = Tensor();
    grads.fc2.weight = std::move(g2.weight);
    if (fc2_bias_.present() && fc2_bias_grad_now)
      grads.fc2.bias_grad = scaled_bias_grad(dy, probs, ws.offsets, ws.scratch, args.stream);

    // The activation's backward: d fc1_out and dprobs from dh' (fc2's dgrad), over fc1_out where
    // the caller lets it (Fc1OutUse::kReuse) and it has dz's layout.
    const bool reuse = fc1_out_use == Fc1OutUse::kReuse && fc1_out.stride(1) == 1 && fc1_out.stride(0) == 2 * F;
    dz = reuse ? Tensor::borrowed(fc1_out) : Tensor::empty(o.dtype, {T, 2 * F}, dev, *allocator_, args.stream);
    be.swiglu_backward({rows, F, o.glu_interleave_size, o.out_features, fc1_out, probs, g2.grad_input.view(),
                        dy_rows.defined() ? TensorView() : dy, ops::group_views(fc2_bias_, o.num_groups), dz.view(),
                        grads.dprobs.view()},
                       ws.scratch, args.stream);
    g2.grad_input = Tensor();  // dh' is no longer needed
    g1 = fc1_.backward_rows(x, x_rows, dz.view(), {}, splits, grad_input, ws.layer_args);
  }
  grads.grad_input = std::move(g1.grad_input);
  grads.fc1 = {std::move(g1.weight), std::move(g1.bias_grad)};
  // The layers queued references to h' and dz: keep them alive until backward_dw.
  if (o.delay_wgrad_compute) pending_.push_back({std::move(h), std::move(dz), dy, probs, splits, args.keep_alive});
  return grads;
}

GroupedMLPGrads GroupedMLP::backward_dw(const CallArgs& args) {
  const GroupedMLPOptions& o = options_;
  if (!o.delay_wgrad_compute) return {};  // backward computed it (TransformerEngine's no-op)
  ST_CHECK_ARG(!pending_.empty(), "backward_dw", "a pending delayed wgrad (from backward() with delay_wgrad_compute=true)",
               "none pending (delay_wgrad_compute=", o.delay_wgrad_compute ? "true" : "false", ")");
  const Pending& pd = pending_.front();
  const Device dev = device();
  const int64_t T = pd.dy.size(0);
  GroupedMLPBackend& be = backend::grouped_mlp_backend_for(dev, "dy");
  const WorkspacePlan plan = plan_workspace(o, T, be, fc1_, fc2_);
  ops::check_workspace(plan.total, args.workspace);

  CallWorkspace ws(plan, args, dev, *allocator_);
  GroupedMLPGrads grads;
  GroupedLinearGrads g2 = fc2_.backward_dw(ws.layer_args);
  grads.fc2.weight = std::move(g2.weight);
  if (fc2_bias_.present()) {
    ops::prepare_offsets(pd.splits, T, ws.offsets, ws.status, backend::backend_for(dev, "dy"), dev, args.stream);
    grads.fc2.bias_grad = scaled_bias_grad(pd.dy, pd.probs, ws.offsets, ws.scratch, args.stream);
  }
  GroupedLinearGrads g1 = fc1_.backward_dw(ws.layer_args);
  grads.fc1 = {std::move(g1.weight), std::move(g1.bias_grad)};
  pending_.pop_front();
  return grads;
}

}  // namespace sparsetrain

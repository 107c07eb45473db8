// GroupedLinear's rules, held once for every backend: argument validation (all of it before any
// output is written), workspace planning from shapes only, output allocation through the caller's
// allocator, host vs device splits, the weight-grad disposition and the delayed-wgrad queue.
#include "sparsetrain/grouped_linear.h"

#include <string>

#include "ops/grouped_args.h"
#include "ops/grouped_linear_backend.h"
#include "ops/grouped_linear_fp8.h"
#include "sparsetrain/error.h"

namespace sparsetrain {

backend::GroupedLinearBackend& backend::backend_for(Device device, const char* arg) {
  if (device.is_cpu()) return reference_backend();
#if SPARSETRAIN_WITH_CUDA
  (void)arg;
  return cuda_backend();
#else
  detail::throw_arg_error(arg, "a tensor on cpu (this build of sparsetrain has no CUDA backend)", device.str());
#endif
}

// ---------------------------------------------------------------------------------------------
// GroupedParam

GroupedParam GroupedParam::per_group(std::vector<TensorView> views) {
  GroupedParam p;
  p.views_ = std::move(views);
  return p;
}

GroupedParam GroupedParam::packed(const TensorView& view) {
  GroupedParam p;
  p.views_ = {view};
  p.packed_ = true;
  return p;
}

int64_t GroupedParam::num_groups() const {
  if (!present()) return 0;
  return packed_ ? (views_[0].dim() > 0 ? views_[0].size(0) : 0) : int64_t(views_.size());
}

TensorView GroupedParam::group(int64_t g) const {
  return packed_ ? views_[0].select(g) : views_[size_t(g)];
}

namespace {

using backend::backend_for;
using backend::GroupedLinearBackend;
using ops::check_activation;
using ops::check_grouped_param;
using ops::check_out_buffer;
using ops::check_splits;
using ops::group_views;
using ops::round_up;

// Workspace layout: group offsets, a status sink for device splits without a caller status
// word, then the backend's scratch. Every part starts on a 256-byte boundary.
struct WorkspacePlan {
  size_t offsets = 0, status = 0, scratch = 0, total = 0;
};

WorkspacePlan plan_workspace(const GroupedLinearOptions& o, int64_t T, const GroupedLinearBackend& be, Device dev) {
  WorkspacePlan p;
  p.status = round_up(size_t(o.num_groups + 1) * sizeof(int64_t), kAllocAlignment);
  p.scratch = p.status + kAllocAlignment;
  const size_t scratch = std::max(be.scratch_bytes(o.dtype, o.num_groups, T, o.in_features, o.out_features),
                                  ops::fp8_scratch_bytes(o, T, dev));
  p.total = p.scratch + round_up(scratch, kAllocAlignment);
  return p;
}

// The workspace of one call (checked by ops::check_workspace) carved into the plan's parts.
struct CallWorkspace {
  CallWorkspace(const WorkspacePlan& plan, const Workspace& given, Device device, Allocator& alloc, Stream stream)
      : memory(plan.total, given, device, alloc, stream),
        offsets(reinterpret_cast<int64_t*>(memory.at(plan.offsets))),
        status(reinterpret_cast<int32_t*>(memory.at(plan.status))),
        scratch(memory.at(plan.scratch)) {}
  ops::WorkspaceMemory memory;
  int64_t* offsets;
  int32_t* status;
  void* scratch;
};

}  // namespace

// ---------------------------------------------------------------------------------------------
// GroupedLinear

int64_t packed_wgrad_group_stride(int64_t out_features, int64_t in_features, DType dtype) {
  const size_t esize = dtype_size(dtype);
  return int64_t(round_up(size_t(out_features * in_features) * esize, kAllocAlignment) / esize);
}

GroupedLinear::GroupedLinear(const GroupedLinearOptions& o, const GroupedLinearParams& params,
                             Allocator* allocator)
    : options_(o), params_(params), allocator_(allocator ? allocator : &default_allocator()) {
  ST_CHECK_ARG(o.num_groups >= 1, "num_groups", ">= 1", o.num_groups);
  ST_CHECK_ARG(o.in_features >= 1, "in_features", ">= 1", o.in_features);
  ST_CHECK_ARG(o.out_features >= 1, "out_features", ">= 1", o.out_features);
  ST_CHECK_ARG(is_floating(o.dtype), "dtype", "bf16, fp16 or fp32", dtype_name(o.dtype));
  ST_CHECK_ARG(!o.overwrite_main_grad || o.fuse_wgrad_accumulation, "overwrite_main_grad",
               "false unless fuse_wgrad_accumulation is true", "true");
  const int64_t G = o.num_groups;
  const std::string out_in = std::to_string(o.out_features) + ", " + std::to_string(o.in_features);
  ST_CHECK_ARG(params.weight.present(), "weight", "per-group or packed tensors", "none");
  const Device dev = params.weight.views()[0].device();
  const int64_t max_groups = backend_for(dev, "weight").max_groups();
  ST_CHECK_ARG(G <= max_groups, "num_groups", "<= " + std::to_string(max_groups) + " on " + dev.str(), G);
  check_grouped_param(params.weight, "weight", G, {o.out_features, o.in_features}, out_in, o.dtype, dev);
  if (params.bias.present())
    check_grouped_param(params.bias, "bias", G, {o.out_features}, std::to_string(o.out_features), o.dtype, dev);
  if (o.fuse_wgrad_accumulation) set_main_grad(params.main_grad);
  ops::check_fp8_layer(o, params.bias.present());
}

void GroupedLinear::set_main_grad(const GroupedParam& main_grad) {
  const GroupedLinearOptions& o = options_;
  ST_CHECK_ARG(o.fuse_wgrad_accumulation, "main_grad", "none (fuse_wgrad_accumulation is false)", "tensors");
  ST_CHECK_ARG(main_grad.present(), "main_grad", "fp32 per-group or packed tensors (fuse_wgrad_accumulation is true)",
               "none");
  check_grouped_param(main_grad, "main_grad", o.num_groups, {o.out_features, o.in_features},
                      std::to_string(o.out_features) + ", " + std::to_string(o.in_features), DType::kFP32, device());
  params_.main_grad = main_grad;
}

Device GroupedLinear::device() const { return params_.weight.views()[0].device(); }

ops::Fp8Layer GroupedLinear::fp8_layer(uint64_t weight_version) {
  if (!fp8_weights_) fp8_weights_ = std::make_shared<ops::Fp8WeightCache>();
  return {options_, params_.weight, *allocator_, device(), *fp8_weights_, weight_version};
}

size_t GroupedLinear::workspace_size(int64_t T) const {
  return plan_workspace(options_, T, backend_for(device(), "weight"), device()).total;
}

Tensor GroupedLinear::forward(const TensorView& x, const Splits& splits, const TensorView& out,
                              const CallArgs& args) {
  check_activation(x, "x", options_.dtype, device(), -1, options_.in_features, "in_features");
  return forward_rows(x, {}, nullptr, x.size(0), splits, out, args);
}

Tensor GroupedLinear::forward_quantized(const ops::Fp8Operand& xq, const Splits& splits, const TensorView& out,
                                        const CallArgs& args) {
  if (options_.fp8 == Fp8Recipe::kOff || xq.data.view().dim() != 2 || xq.data.view().size(1) != options_.in_features)
    ST_FAIL("GroupedLinear::forward_quantized: expected an FP8 layer and rowwise codes [T, in_features]");
  return forward_rows({}, {}, &xq, xq.data.view().size(0), splits, out, args);
}

Tensor GroupedLinear::forward_gathered(const TensorView& x, const TensorView& x_rows, const Splits& splits,
                                       const TensorView& out, const CallArgs& args) {
  if (options_.fp8 == Fp8Recipe::kOff)
    ST_FAIL("GroupedLinear::forward_gathered: expected an FP8 layer (the quantizer gathers)");
  check_activation(x, "x", options_.dtype, device(), -1, options_.in_features, "in_features");
  return forward_rows(x, x_rows, nullptr, backend::fp8_operand_rows(x, x_rows), splits, out, args);
}

Tensor GroupedLinear::forward_rows(const TensorView& x, const TensorView& x_rows, const ops::Fp8Operand* xq,
                                   int64_t T, const Splits& splits, const TensorView& out, const CallArgs& args) {
  const GroupedLinearOptions& o = options_;
  const Device dev = device();
  GroupedLinearBackend& be = backend_for(dev, "x");
  const int64_t S = check_splits(splits, o.num_groups, T, dev, o.check_device_splits, be, args.stream);
  if (out.defined())
    check_out_buffer(out, "out", o.dtype, dev, o.out_features, ops::min_out_rows(S, T),
                     ops::min_out_rows_rule(S));
  const WorkspacePlan plan = plan_workspace(o, T, be, dev);
  ops::check_workspace(plan.total, args.workspace);

  // Everything is valid: from here on outputs may be written.
  Tensor y = out.defined() ? Tensor::borrowed(out)
                           : Tensor::empty(o.dtype, {T, o.out_features}, dev, *allocator_, args.stream);
  CallWorkspace ws(plan, args.workspace, dev, *allocator_, args.stream);
  const bool zero_tail = !out.defined() && ops::has_tail_rows(S, T);
  if (o.fp8 != Fp8Recipe::kOff) {  // its kernels read the offsets from the device: none folded
    ops::prepare_offsets(splits, T, ws.offsets, ws.status, be, dev, args.stream);
    if (xq)
      ops::fp8_fprop_quantized(fp8_layer(args.weight_version), *xq, ws.offsets, y.view(), zero_tail, ws.scratch,
                               args.stream);
    else
      ops::fp8_fprop(fp8_layer(args.weight_version), x, x_rows, ws.offsets, y.view(), zero_tail, ws.scratch,
                     args.stream);
    return y;
  }
  std::vector<int64_t> host_offsets;
  const int64_t* fold = ops::prepare_offsets(splits, T, ws.offsets, ws.status, be, dev, args.stream, &host_offsets);
  backend::FpropParams p{{o.dtype, o.num_groups, T, o.in_features, o.out_features, ws.offsets, fold},
                         x,
                         group_views(params_.weight, o.num_groups),
                         group_views(params_.bias, o.num_groups),
                         y.view(),
                         zero_tail};
  be.fprop(p, ws.scratch, args.stream);
  return y;
}

Tensor GroupedLinear::dummy_wgrad(bool cached, Stream stream) {
  if (cached && dummy_.defined()) return dummy_;
  const GroupedLinearOptions& o = options_;
  Tensor d = params_.weight.is_packed()
                 ? Tensor::empty(o.dtype, {o.num_groups, o.out_features, o.in_features}, device(), *allocator_, stream)
                 : Tensor::empty(o.dtype, {o.out_features, o.in_features}, device(), *allocator_, stream);
  backend_for(device(), "weight").fill_zero(d.view(), stream);
  if (cached) dummy_ = d;
  return d;
}

GroupedLinearGrads GroupedLinear::compute_wgrad(const TensorView& x, const TensorView& x_rows, const TensorView& dy,
                                                int64_t T, const int64_t* offsets, void* scratch, Stream stream,
                                                const ops::Fp8Operand* dy_columnwise,
                                                const ops::Fp8Operand* x_columnwise) {
  const GroupedLinearOptions& o = options_;
  const int64_t G = o.num_groups;
  GroupedLinearBackend& be = backend_for(device(), "x");
  GroupedLinearGrads grads;
  backend::WgradParams p{{o.dtype, G, T, o.in_features, o.out_features, offsets},
                         x, dy, backend::WgradTarget::kWeightGrad, {}, {}};
  if (o.fuse_wgrad_accumulation) {
    p.target = o.overwrite_main_grad ? backend::WgradTarget::kMainGradOverwrite
                                     : backend::WgradTarget::kMainGradAccumulate;
    p.dw = group_views(params_.main_grad, G);
    grads.weight.kind = WeightGradKind::kNone;  // it went into main_grad
  } else {
    // One packed buffer; each group's view starts on a 256-byte boundary, padding the per-group
    // stride where out*in*sizeof(dtype) is not a multiple of 256.
    const int64_t group_stride = packed_wgrad_group_stride(o.out_features, o.in_features, o.dtype);
    Tensor buf = Tensor::empty(o.dtype, {G * group_stride}, device(), *allocator_, stream);
    const int64_t shape[3] = {G, o.out_features, o.in_features};
    const int64_t strides[3] = {group_stride, o.in_features, 1};
    const TensorView packed(buf.view().data(), o.dtype, shape, strides, 3, device());
    grads.weight.kind = WeightGradKind::kWgrad;
    grads.weight.packed = buf.with_view(packed);
    for (int64_t g = 0; g < G; ++g) {
      p.dw.push_back(packed.select(g));
      grads.weight.per_group.push_back(buf.with_view(p.dw.back()));
    }
  }
  if (params_.bias.present()) {
    grads.bias_grad = Tensor::empty(o.dtype, {G, o.out_features}, device(), *allocator_, stream);
    for (int64_t g = 0; g < G; ++g) p.db.push_back(grads.bias_grad.view().select(g));
  }
  if (o.fp8 != Fp8Recipe::kOff)
    ops::fp8_wgrad(fp8_layer(0), x, x_rows, dy, T, offsets, p.target, p.dw, scratch, stream, dy_columnwise,
                   x_columnwise);
  else be.wgrad(p, scratch, stream);
  return grads;
}

GroupedLinearGrads GroupedLinear::backward(const TensorView& x, const TensorView& dy, const Splits& splits,
                                           const TensorView& grad_input, const CallArgs& args) {
  return backward_rows(x, {}, dy, {}, splits, grad_input, args);
}

void GroupedLinear::settle_weight_grads(GroupedLinearGrads& grads, GroupedLinearGrads* w, const CallArgs& args) {
  const GroupedLinearOptions& o = options_;
  const WeightGradDisposition disp =
      weight_grad_disposition(o.delay_wgrad_compute, o.fuse_wgrad_accumulation, params_.has_grad_added_to_main_grad);
  if (w) {
    if (disp.weight == WeightGradKind::kWgrad) grads.weight = std::move(w->weight);
    if (disp.bias_grad_now) grads.bias_grad = std::move(w->bias_grad);
  }
  if (disp.weight == WeightGradKind::kDummy) {
    const Tensor d = dummy_wgrad(args.cache_dummy_wgrad, args.stream);
    grads.weight.kind = WeightGradKind::kDummy;
    grads.weight.grad_added_to_main_grad = true;
    if (params_.weight.is_packed()) grads.weight.packed = d;
    for (int64_t g = 0; g < o.num_groups; ++g)
      grads.weight.per_group.push_back(params_.weight.is_packed() ? d.with_view(d.view().select(g)) : d);
  }
}

GroupedLinearGrads GroupedLinear::wgrad_columnwise(const ops::Fp8Operand& x_columnwise,
                                                   const ops::Fp8Operand& dy_columnwise, int64_t T,
                                                   const Splits& splits, const CallArgs& args) {
  GroupedLinearBackend& be = backend_for(device(), "x");
  const WorkspacePlan plan = plan_workspace(options_, T, be, device());
  ops::check_workspace(plan.total, args.workspace);
  CallWorkspace ws(plan, args.workspace, device(), *allocator_, args.stream);
  ops::prepare_offsets(splits, T, ws.offsets, ws.status, be, device(), args.stream);
  GroupedLinearGrads grads;
  GroupedLinearGrads w =
      compute_wgrad({}, {}, {}, T, ws.offsets, ws.scratch, args.stream, &dy_columnwise, &x_columnwise);
  settle_weight_grads(grads, &w, args);
  return grads;
}

GroupedLinearGrads GroupedLinear::backward_quantized(const TensorView& x, const TensorView& x_rows,
                                                     const ops::Fp8Operand& dyq,
                                                     const ops::Fp8Operand& dyq_columnwise, const Splits& splits,
                                                     const TensorView& grad_input, const CallArgs& args) {
  return backward_rows(x, x_rows, {}, {}, splits, grad_input, args, &dyq, &dyq_columnwise);
}

GroupedLinearGrads GroupedLinear::backward_rows(const TensorView& x, const TensorView& x_rows, const TensorView& dy,
                                                const TensorView& dy_rows, const Splits& splits,
                                                const TensorView& grad_input, const CallArgs& args,
                                                const ops::Fp8Operand* dyq, const ops::Fp8Operand* dyq_columnwise,
                                                ops::Fp8Operand* dy_columnwise_out) {
  const GroupedLinearOptions& o = options_;
  const Device dev = device();
  GroupedLinearBackend& be = backend_for(dev, "x");
  if ((x_rows.defined() || dy_rows.defined() || dyq || dy_columnwise_out) &&
      (o.fp8 == Fp8Recipe::kOff || o.delay_wgrad_compute))
    ST_FAIL("GroupedLinear::backward_rows: x_rows / dy_rows / a quantized dy / a split wgrad need the FP8 recipe and "
            "the wgrad now (its quantizers gather them; a delayed wgrad keeps dy)");
  if (dy_columnwise_out ? dyq != nullptr || x.defined() : !x.defined())
    ST_FAIL("GroupedLinear::backward_rows: x, except for the dgrad alone, which takes dy in the dtype and no x");
  if (x.defined()) check_activation(x, "x", o.dtype, dev, -1, o.in_features, "in_features");
  const int64_t T = x.defined() ? backend::fp8_operand_rows(x, x_rows) : backend::fp8_operand_rows(dy, dy_rows);
  if (dyq) {
    if (!dyq_columnwise || dyq->data.view().dim() != 2 || dyq->data.view().size(0) != T ||
        dyq->data.view().size(1) != o.out_features)
      ST_FAIL("GroupedLinear::backward_quantized: expected rowwise codes [" + std::to_string(T) + ", " +
              std::to_string(o.out_features) + "] and the columnwise ones");
  } else {
    check_activation(dy, "dy", o.dtype, dev, dy_rows.defined() ? -1 : T, o.out_features, "out_features");
  }
  if (dy_rows.defined() && dy_rows.size(0) != T)
    ST_FAIL("GroupedLinear::backward_rows: dy_rows for " + std::to_string(dy_rows.size(0)) + " rows, x's are " +
            std::to_string(T));
  const int64_t S = check_splits(splits, o.num_groups, T, dev, o.check_device_splits, be, args.stream);
  if (grad_input.defined())
    check_out_buffer(grad_input, "grad_input", o.dtype, dev, o.in_features, ops::min_out_rows(S, T),
                     ops::min_out_rows_rule(S));
  const WorkspacePlan plan = plan_workspace(o, T, be, dev);
  ops::check_workspace(plan.total, args.workspace);

  // Everything is valid: from here on outputs may be written.
  GroupedLinearGrads grads;
  grads.grad_input = grad_input.defined()
                         ? Tensor::borrowed(grad_input)
                         : Tensor::empty(o.dtype, {T, o.in_features}, dev, *allocator_, args.stream);
  CallWorkspace ws(plan, args.workspace, dev, *allocator_, args.stream);
  const bool zero_tail = !grad_input.defined() && ops::has_tail_rows(S, T);
  // FP8 with the wgrad now: dy's two layouts from one read, by the dgrad's quantization.
  ops::Fp8Operand dy_columnwise;
  const bool fp8 = o.fp8 != Fp8Recipe::kOff, fp8_wgrad_now = fp8 && !o.delay_wgrad_compute;
  if (fp8) {  // its kernels read the offsets from the device: none folded
    ops::prepare_offsets(splits, T, ws.offsets, ws.status, be, dev, args.stream);
    if (dyq)
      ops::fp8_dgrad_quantized(fp8_layer(args.weight_version), *dyq, ws.offsets, grads.grad_input.view(), zero_tail,
                               ws.scratch, args.stream);
    else
      ops::fp8_dgrad(fp8_layer(args.weight_version), dy, dy_rows, ws.offsets, grads.grad_input.view(), zero_tail,
                     ws.scratch, args.stream, fp8_wgrad_now ? &dy_columnwise : nullptr);
    if (dy_columnwise_out) {  // the wgrad later (wgrad_columnwise), with x's codes
      *dy_columnwise_out = std::move(dy_columnwise);
      return grads;
    }
  } else {
    std::vector<int64_t> host_offsets;  // dgrad's first kernel writes them; wgrad's then read them
    const int64_t* fold =
        ops::prepare_offsets(splits, T, ws.offsets, ws.status, be, dev, args.stream, &host_offsets);
    backend::DgradParams p{{o.dtype, o.num_groups, T, o.in_features, o.out_features, ws.offsets, fold},
                           dy,
                           group_views(params_.weight, o.num_groups),
                           grads.grad_input.view(),
                           zero_tail};
    be.dgrad(p, ws.scratch, args.stream);
  }

  if (o.delay_wgrad_compute) {
    pending_.push_back({x, dy, splits, args.keep_alive});  // references: the caller keeps x and dy alive
    settle_weight_grads(grads, nullptr, args);
  } else {
    GroupedLinearGrads w = compute_wgrad(x, x_rows, dy, T, ws.offsets, ws.scratch, args.stream,
                                         dyq ? dyq_columnwise : fp8_wgrad_now ? &dy_columnwise : nullptr);
    settle_weight_grads(grads, &w, args);
  }
  return grads;
}

void GroupedLinear::check_grad_input(const TensorView& x, const Splits& splits, const TensorView& grad_input) const {
  const GroupedLinearOptions& o = options_;
  const Device dev = device();
  GroupedLinearBackend& be = backend_for(dev, "x");
  check_activation(x, "x", o.dtype, dev, -1, o.in_features, "in_features");
  const int64_t T = x.size(0);
  const int64_t S = check_splits(splits, o.num_groups, T, dev, /*checked_mode=*/false, be, Stream{});
  check_out_buffer(grad_input, "grad_input", o.dtype, dev, o.in_features, ops::min_out_rows(S, T),
                   ops::min_out_rows_rule(S));
}

GroupedLinearGrads GroupedLinear::backward_dw(const CallArgs& args) {
  if (!options_.delay_wgrad_compute) return {};  // backward computed it (TransformerEngine's no-op)
  ST_CHECK_ARG(!pending_.empty(), "backward_dw",
               "a pending delayed wgrad (from backward() with delay_wgrad_compute=true)",
               "none pending (delay_wgrad_compute=", options_.delay_wgrad_compute ? "true" : "false", ")");
  const Pending& pd = pending_.front();
  GroupedLinearBackend& be = backend_for(device(), "x");
  const int64_t T = pd.x.size(0);
  const WorkspacePlan plan = plan_workspace(options_, T, be, device());
  ops::check_workspace(plan.total, args.workspace);
  CallWorkspace ws(plan, args.workspace, device(), *allocator_, args.stream);
  ops::prepare_offsets(pd.splits, T, ws.offsets, ws.status, be, device(), args.stream);
  GroupedLinearGrads grads = compute_wgrad(pd.x, {}, pd.dy, T, ws.offsets, ws.scratch, args.stream);
  pending_.pop_front();
  return grads;
}

}  // namespace sparsetrain

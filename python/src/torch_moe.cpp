// The MoE layer, its router and its combine as C++ torch operators of the library
// sparsetrain._torch_ops: sparsetrain::moe_layer_forward and _backward (moe_layer.h MoELayer: the
// one route of sparsetrain.torch.MoELayer, whose composition is the core's), moe_route and
// moe_route_backward (moe_router.h), the route of sparsetrain.torch.moe_route, and
// sparsetrain::moe_combine_rows (moe_layer.h combine_rows), each token's expert rows summed by
// token_rows.take (the expert-parallel layer composes these in Python around its exchanges). As
// attention's (torch_ops.cpp): compute kernels that call the core on the current stream with
// outputs from torch's caching allocator (CompositeExplicitAutograd), moe_route's Autograd kernel a
// torch::autograd::Function that calls the op again below autograd and the backward op through the
// dispatcher (so fake tensors, make_fx and torch.compile reach the Python fakes and see both ops),
// and fake implementations in Python (register_fake in the modules named below). The combine's
// autograd is token_rows.Rows (a gather both ways), so the op itself has none.
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/DeviceGuard.h>
#include <torch/autograd.h>
#include <torch/csrc/autograd/autograd_not_implemented_fallback.h>
#include <torch/library.h>

#include <optional>
#include <string>
#include <string_view>
#include <tuple>

#include "sparsetrain/error.h"
#include "sparsetrain/moe_layer.h"
#include "sparsetrain/moe_router.h"
#include "router_options.h"
#include "torch_common.h"
#include "torch_layers.h"

namespace st = sparsetrain;

namespace {

using st::torch_ops::call_args;
using st::torch_ops::OptTensor;
using st::torch_ops::stream_of;
using st::torch_ops::TorchAllocator;
using st::torch_ops::translated;
using st::torch_ops::view_of;
using MoEForwardTensors = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor,
                                     at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>;
using MoEGradTensors = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

// (experts, probs, counts, row_of, token_of_row, score_sum): st::RouterOutput's fields.
using Routed = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>;
using RouteSignature = Routed(const at::Tensor&, const std::optional<at::Tensor>&, int64_t, std::string_view, bool);
using RouteBackwardSignature = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                          const std::optional<at::Tensor>&, int64_t, std::string_view, bool);

// The router's options for logits [N, E]: E experts (checked before any view is made, so that a
// logits of another rank is named as such).
st::RouterOptions options_of(const at::Tensor& logits, int64_t top_k, std::string_view score, bool normalize) {
  ST_CHECK_ARG(logits.dim() == 2, "logits", "a 2-d tensor [N, E] (router logits)", logits.sizes());
  return st::wire::router_options(logits.size(1), top_k, score, normalize);
}

// With logits' device current, as the core launches on the current device.
Routed route(const at::Tensor& logits, const std::optional<at::Tensor>& expert_bias, int64_t top_k,
             std::string_view score, bool normalize) {
  return translated([&] {
    const c10::DeviceGuard guard(logits.device());
    const st::RouterOptions options = options_of(logits, top_k, score, normalize);
    TorchAllocator alloc;
    const st::RouterOutput r = st::route(options, view_of(logits, "logits"), view_of(expert_bias, "expert_bias"),
                                         &alloc, stream_of(logits));
    return std::make_tuple(alloc.take(r.experts), alloc.take(r.probs), alloc.take(r.counts), alloc.take(r.row_of),
                           alloc.take(r.token_of_row), alloc.take(r.score_sum));
  });
}

// The gradient of the logits, fp32 [N, E].
at::Tensor route_backward(const at::Tensor& logits, const at::Tensor& experts, const at::Tensor& dprobs,
                          const std::optional<at::Tensor>& dscore_sum, int64_t top_k, std::string_view score,
                          bool normalize) {
  return translated([&] {
    const c10::DeviceGuard guard(logits.device());
    const st::RouterOptions options = options_of(logits, top_k, score, normalize);
    TorchAllocator alloc;
    return alloc.take(st::route_backward(options, view_of(logits, "logits"), view_of(experts, "experts"),
                                         view_of(dprobs, "dprobs"), view_of(dscore_sum, "dscore_sum"), &alloc,
                                         stream_of(logits)));
  });
}

// out [N, H] in rows' dtype.
at::Tensor combine_rows(const at::Tensor& rows, const at::Tensor& row_of) {
  return translated([&] {
    const c10::DeviceGuard guard(rows.device());
    TorchAllocator alloc;
    return alloc.take(st::combine_rows(view_of(rows, "rows"), view_of(row_of, "row_of"), &alloc, stream_of(rows)));
  });
}

const c10::TypedOperatorHandle<RouteSignature>& route_op() {
  static const auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("sparsetrain::moe_route", "").typed<RouteSignature>();
  return op;
}

const c10::TypedOperatorHandle<RouteBackwardSignature>& route_backward_op() {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("sparsetrain::moe_route_backward", "")
                             .typed<RouteBackwardSignature>();
  return op;
}

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// The router's autograd: the gradients of probs and score_sum flow to the logits (the choice is a
// constant); expert_bias, which only steers the choice, gets none; the integer outputs have none.
struct RouteFunction : public torch::autograd::Function<RouteFunction> {
  static constexpr size_t kInputs = 5;  // forward's arguments after ctx; a gradient for logits only

  static variable_list forward(AutogradContext* ctx, const at::Tensor& logits,
                               const std::optional<at::Tensor>& expert_bias, int64_t top_k, std::string_view score,
                               bool normalize) {
    Routed r;
    {
      const at::AutoDispatchBelowADInplaceOrView below_autograd;
      r = route_op().call(logits, expert_bias, top_k, score, normalize);
    }
    const auto& [experts, probs, counts, row_of, token_of_row, score_sum] = r;
    ctx->mark_non_differentiable({experts, counts, row_of, token_of_row});
    // An unused probs or score_sum gets no zero tensor (a fill kernel a backward); both unused,
    // the logits get no gradient.
    ctx->set_materialize_grads(false);
    ctx->save_for_backward({logits, experts});
    ctx->saved_data["top_k"] = top_k;
    ctx->saved_data["score"] = std::string(score);
    ctx->saved_data["normalize"] = normalize;
    return {experts, probs, counts, row_of, token_of_row, score_sum};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const at::Tensor &dprobs = grads[1], &dscore_sum = grads[5];
    variable_list out(kInputs);
    if (!dprobs.defined() && !dscore_sum.defined()) return out;
    const variable_list s = ctx->get_saved_variables();
    const at::Tensor &logits = s[0], &experts = s[1];
    // The core reads rows with unit strides; a gradient may come expanded (that of a sum).
    out[0] = route_backward_op().call(
        logits, experts, dprobs.defined() ? dprobs.contiguous() : at::zeros(experts.sizes(), logits.options()),
        dscore_sum.defined() ? std::optional<at::Tensor>(dscore_sum.contiguous()) : std::nullopt,
        ctx->saved_data["top_k"].toInt(), ctx->saved_data["score"].toStringRef(),
        ctx->saved_data["normalize"].toBool());
    return out;
  }
};

Routed route_autograd(const at::Tensor& logits, const std::optional<at::Tensor>& expert_bias, int64_t top_k,
                      std::string_view score, bool normalize) {
  const variable_list r = RouteFunction::apply(logits, expert_bias, top_k, score, normalize);
  return std::make_tuple(r[0], r[1], r[2], r[3], r[4], r[5]);
}


// --- the MoE layer -----------------------------------------------------------------------------

// The C++ layer of a sparsetrain.torch.MoELayer: st::MoELayer over its experts' parameters (the
// module's `experts`, a GroupedMLP, passes them as GroupedMLP's operators take them).
class TorchMoELayer final : public st::torch_ops::ModuleLayer<st::MoELayer> {
 public:
  TorchMoELayer(int64_t num_experts, int64_t hidden, int64_t ffn, int64_t top_k, const std::string& score,
                bool normalize, int64_t glu_interleave_size, bool packed, bool bias, bool fuse_wgrad_accumulation,
                bool delay_wgrad_compute, bool recompute_expert_input, bool fp8_saved_activations)
      : ModuleLayer("MoELayer", {{num_experts, packed, bias, fuse_wgrad_accumulation, delay_wgrad_compute},
                                 {num_experts, packed, bias, fuse_wgrad_accumulation, delay_wgrad_compute}}) {
    o_.router = st::wire::router_options(num_experts, top_k, score, normalize);
    o_.mlp = st::torch_ops::module_options<st::GroupedMLPOptions>(num_experts, fuse_wgrad_accumulation,
                                                                  delay_wgrad_compute, false);
    o_.mlp.in_features = o_.mlp.out_features = hidden;
    o_.mlp.ffn_features = ffn;
    o_.mlp.glu_interleave_size = glu_interleave_size;
    o_.recompute_expert_input = recompute_expert_input;
    o_.fp8_saved_activations = fp8_saved_activations;  // in effect in the calls that run FP8 (make)
  }

  int64_t hidden() const { return o_.mlp.out_features; }

  // (out, experts, probs, counts, row_of, token_of_row, score_sum, rows, row_probs, fc1_out,
  // fc1_out_scales): the output, the routing, and what backward reads (rows empty with
  // recompute_expert_input; fc1_out e4m3 codes and their scales with FP8 saved activations, else
  // the dtype's and no scales).
  MoEForwardTensors forward(const at::Tensor& x, const at::Tensor& logits, const OptTensor& expert_bias,
                            at::TensorList params, at::TensorList main_grads, int64_t flags) {
    return translated([&] {
      const c10::DeviceGuard guard(x.device());
      const std::lock_guard<std::mutex> lock(mutex_);
      st::MoELayer& l = bound(params, main_grads, flags);
      const st::MoEForward f = l.forward(view_of(x, "x"), view_of(logits, "logits"),
                                         view_of(expert_bias, "expert_bias"),
                                         call_args(x, {}, true, weight_version(params, flags)));
      const st::RouterOutput& r = f.route;
      return std::make_tuple(alloc_.take(f.out), alloc_.take(r.experts), alloc_.take(r.probs), alloc_.take(r.counts),
                             alloc_.take(r.row_of), alloc_.take(r.token_of_row), alloc_.take(r.score_sum),
                             f.rows.defined() ? alloc_.take(f.rows) : at::empty({0}, x.options()),
                             alloc_.take(f.row_probs), alloc_.take(f.fc1_out),
                             f.fc1_out_scales.defined() ? alloc_.take(f.fc1_out_scales)
                                                        : at::empty({0}, x.options().dtype(at::kFloat)));
    });
  }

  // (dx, dlogits, fc1's dw, db, fc2's dw, db), the weight grads as GroupedMLP's.
  MoEGradTensors backward(const at::Tensor& x, const at::Tensor& logits, const at::Tensor& experts,
                          const at::Tensor& counts, const at::Tensor& row_of, const at::Tensor& token_of_row,
                          const at::Tensor& rows, const at::Tensor& row_probs, const at::Tensor& fc1_out,
                          const at::Tensor& fc1_out_scales, const at::Tensor& dout, const OptTensor& dscore_sum,
                          at::TensorList params, at::TensorList main_grads, int64_t flags) {
    return translated([&] {
      const c10::DeviceGuard guard(x.device());
      const std::lock_guard<std::mutex> lock(mutex_);
      st::MoELayer& l = bound(params, main_grads, flags);
      // The saved forward as the core keeps it, over the tensors torch holds (a delayed wgrad
      // keeps them alive through the call's keep_alive).
      st::MoEForward saved;
      saved.route.experts = st::Tensor::borrowed(view_of(experts, "experts"));
      saved.route.counts = st::Tensor::borrowed(view_of(counts, "counts"));
      saved.route.row_of = st::Tensor::borrowed(view_of(row_of, "row_of"));
      saved.route.token_of_row = st::Tensor::borrowed(view_of(token_of_row, "token_of_row"));
      if (!o_.recompute_expert_input) saved.rows = st::Tensor::borrowed(view_of(rows, "rows"));
      saved.row_probs = st::Tensor::borrowed(view_of(row_probs, "row_probs"));
      saved.fc1_out = st::Tensor::borrowed(view_of(fc1_out, "fc1_out"));
      if (l.options().fp8_saved_activations)
        saved.fc1_out_scales = st::Tensor::borrowed(view_of(fc1_out_scales, "fc1_out_scales"));
      const st::MoEGrads g =
          l.backward(view_of(x, "x"), view_of(logits, "logits"), saved, view_of(dout, "dout"),
                     view_of(dscore_sum, "dscore_sum"),
                     call_args(x, {x, logits, experts, counts, row_of, token_of_row, rows, row_probs, fc1_out,
                                   fc1_out_scales, dout},
                               st::torch_ops::eager_call(), weight_version(params, flags)));
      return std::tuple_cat(std::make_tuple(alloc_.take(g.grad_input), alloc_.take(g.dlogits)),
                            mlp_grads(g.fc1, g.fc2, x));
    });
  }

  // The experts' oldest pending delayed wgrads: (fc1's dw, db, fc2's dw, db).
  std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> backward_dw(at::TensorList params,
                                                                         at::TensorList main_grads, int64_t flags) {
    return mlp_backward_dw(params, main_grads, flags);
  }

 private:
  std::unique_ptr<st::MoELayer> make(at::TensorList params, at::TensorList main_grads, int64_t flags) override {
    const st::GroupedMLPParams p = mlp_params(params, main_grads, flags, "experts.");
    st::MoELayerOptions o = o_;
    o.mlp.dtype = p.fc1.weight.views()[0].dtype();
    o.mlp.overwrite_main_grad = st::torch_ops::overwrite_main_grad(flags);
    o.mlp.fp8 = st::torch_ops::fp8_recipe(flags);
    o.fp8_saved_activations = o_.fp8_saved_activations && o.mlp.fp8 != st::Fp8Recipe::kOff;
    return std::make_unique<st::MoELayer>(o, p, &alloc_);
  }
  void set_main_grads(st::MoELayer& l, const std::vector<st::GroupedParam>& mg) override {
    l.set_main_grads(mg.at(0), mg.at(1));
  }

  st::MoELayerOptions o_;  // all but the dtype and overwrite_main_grad, which come with the parameters
};

MoEForwardTensors moe_layer_forward(int64_t layer, const at::Tensor& x, const at::Tensor& logits,
                                    const OptTensor& expert_bias, at::TensorList params, at::TensorList main_grads,
                                    int64_t flags) {
  return st::torch_ops::Registry::get().find<TorchMoELayer>(layer)->forward(x, logits, expert_bias, params,
                                                                            main_grads, flags);
}

MoEGradTensors moe_layer_backward(int64_t layer, const at::Tensor& x, const at::Tensor& logits,
                                  const at::Tensor& experts, const at::Tensor& counts, const at::Tensor& row_of,
                                  const at::Tensor& token_of_row, const at::Tensor& rows, const at::Tensor& row_probs,
                                  const at::Tensor& fc1_out, const at::Tensor& fc1_out_scales, const at::Tensor& dout,
                                  const OptTensor& dscore_sum, at::TensorList params, at::TensorList main_grads,
                                  int64_t flags) {
  return st::torch_ops::Registry::get().find<TorchMoELayer>(layer)->backward(
      x, logits, experts, counts, row_of, token_of_row, rows, row_probs, fc1_out, fc1_out_scales, dout, dscore_sum,
      params, main_grads, flags);
}

const c10::TypedOperatorHandle<decltype(moe_layer_forward)>& moe_layer_forward_op() {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("sparsetrain::moe_layer_forward", "")
                             .typed<decltype(moe_layer_forward)>();
  return op;
}

const c10::TypedOperatorHandle<decltype(moe_layer_backward)>& moe_layer_backward_op() {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("sparsetrain::moe_layer_backward", "")
                             .typed<decltype(moe_layer_backward)>();
  return op;
}

// The MoE layer's node: saved [x, logits, experts, counts, row_of, token_of_row, rows, row_probs,
// fc1_out, fc1_out_scales]; the gradients of out and score_sum flow to x, the logits and the
// experts' parameters.
class MoELayerBackward final : public st::torch_ops::GroupedBackward {
 public:
  using GroupedBackward::GroupedBackward;
  std::string name() const override { return "sparsetrain::MoELayerBackward"; }

  variable_list apply(variable_list&& grads) override {
    const std::shared_ptr<Node> self = shared_from_this();
    const std::vector<at::Tensor> s = unpack(saved_, self), params = unpack(params_, self),
                                  main_grads = unpack(main_grads_, self);
    const at::Tensor &x = s[0], &logits = s[1];
    if (!grads[0].defined() && !grads[1].defined()) return variable_list(num_outputs());
    const at::Tensor dout =
        dy_of(grads[0], x, st::torch_ops::Registry::get().find<TorchMoELayer>(layer_)->hidden());
    const OptTensor dscore_sum = grads[1].defined() ? OptTensor(grads[1].contiguous()) : std::nullopt;
    const st::torch_ops::EagerCall scope(eager(s));
    const auto [dx, dlogits, dw1, db1, dw2, db2] = moe_layer_backward_op().call(
        layer_, x, logits, s[2], s[3], s[4], s[5], s[6], s[7], s[8], s[9], dout, dscore_sum, params, main_grads,
        flags_);
    variable_list out{dx, dlogits};
    size_t at = 0;
    append_param_grads(out, 0, dw1, db1, params, at);
    append_param_grads(out, 1, dw2, db2, params, at);
    return out;
  }
};

MoEForwardTensors moe_layer_forward_autograd(int64_t layer, const at::Tensor& x, const at::Tensor& logits,
                                             const OptTensor& expert_bias, at::TensorList params,
                                             at::TensorList main_grads, int64_t flags) {
  const bool record = st::torch_ops::recorded({&x, &logits}, params, "MoELayer");
  MoEForwardTensors r;
  {
    const at::AutoDispatchBelowADInplaceOrView below;
    r = moe_layer_forward_op().call(layer, x, logits, expert_bias, params, main_grads, flags);
  }
  if (record) {
    const auto& [out, experts, probs, counts, row_of, token_of_row, score_sum, rows, row_probs, fc1_out, fc1_out_scales] =
        r;
    auto node = st::torch_ops::make_node<MoELayerBackward, TorchMoELayer>(
        layer, flags, std::nullopt, std::nullopt,
        {x, logits, experts, counts, row_of, token_of_row, rows, row_probs, fc1_out, fc1_out_scales}, params,
        main_grads, {x, logits});
    torch::autograd::set_history(std::vector<at::Tensor>{out, score_sum}, node);
  }
  return r;
}

}  // namespace

void st::torch_ops::register_moe_layer(pybind11::module_& m) {
  register_layer<TorchMoELayer, int64_t, int64_t, int64_t, int64_t, std::string, bool, int64_t, bool, bool, bool,
                 bool, bool, bool>(m, "MoELayer");
  m.def("moe_layer_forward", [](int64_t layer, const at::Tensor& x, const at::Tensor& logits,
                                const OptTensor& expert_bias, const std::vector<at::Tensor>& params,
                                const std::vector<at::Tensor>& main_grads, int64_t flags) {
    const st::torch_ops::EagerCall eager;
    return moe_layer_forward_op().call(layer, x, logits, expert_bias, params, main_grads, flags);
  });
}

// torch_ops.cpp's TORCH_LIBRARY defines the namespace; the fakes are Python, in the modules named
// here (imported by torch when a fake tensor meets an op without one).
TORCH_LIBRARY_FRAGMENT(sparsetrain, m) {
  m.set_python_module("sparsetrain.torch.moe");
  m.def("moe_layer_forward(int layer_id, Tensor x, Tensor logits, Tensor? expert_bias, Tensor[] params, "
        "Tensor[] main_grads, int flags) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, "
        "Tensor, Tensor)");
  m.def("moe_layer_backward(int layer_id, Tensor x, Tensor logits, Tensor experts, Tensor counts, Tensor row_of, "
        "Tensor token_of_row, Tensor rows, Tensor row_probs, Tensor fc1_out, Tensor fc1_out_scales, Tensor dout, "
        "Tensor? dscore_sum, Tensor[] params, Tensor(a!)[] main_grads, int flags) "
        "-> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)");
  m.def("moe_route(Tensor logits, Tensor? expert_bias, int top_k, str score, bool normalize) "
        "-> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)");
  m.def("moe_route_backward(Tensor logits, Tensor experts, Tensor dprobs, Tensor? dscore_sum, int top_k, str score, "
        "bool normalize) -> Tensor");
  m.set_python_module("sparsetrain.torch.token_rows");
  m.def("moe_combine_rows(Tensor rows, Tensor row_of) -> Tensor");
}

TORCH_LIBRARY_IMPL(sparsetrain, CompositeExplicitAutograd, m) {
  m.impl("moe_layer_forward", &moe_layer_forward);
  m.impl("moe_layer_backward", &moe_layer_backward);
  m.impl("moe_route", &route);
  m.impl("moe_route_backward", &route_backward);
  m.impl("moe_combine_rows", &combine_rows);
}

// The backward op has no derivative (create_graph=True gets autograd's "not implemented" error
// when that is used, not silently wrong second derivatives); the combine's is token_rows.Rows.
TORCH_LIBRARY_IMPL(sparsetrain, Autograd, m) {
  m.impl("moe_layer_forward", &moe_layer_forward_autograd);
  m.impl("moe_layer_backward", torch::autograd::autogradNotImplementedFallback());
  m.impl("moe_route", &route_autograd);
  m.impl("moe_route_backward", torch::autograd::autogradNotImplementedFallback());
  m.impl("moe_combine_rows", torch::autograd::autogradNotImplementedFallback());
}

// GroupedLinear and GroupedMLP as C++ torch operators (sparsetrain::grouped_linear_* and
// grouped_mlp_*): the one route of sparsetrain.torch's GroupedLinear and GroupedMLP, eager, under
// autograd, torch.compile, fake tensors, dispatch modes and CUDA graphs alike, with their autograd
// in C++ (no Python in a backward but the Megatron attribute a dummy weight grad sets).
//
// A module's state lives in its C++ layer (the class sparsetrain._torch_ops.GroupedLinear /
// GroupedMLP, made with the module): the st::GroupedLinear / st::GroupedMLP over the module's
// parameters, its delayed-wgrad queue, its cached dummy wgrad. The operators find it by the
// module's id; the module passes its parameters, main_grads and flags with every call
// (torch_layers.h, which the MoE layer's operators of torch_moe.cpp share).
//
// Two operators per direction: a functional one, and one that writes a caller buffer (`out`,
// `grad_input`), so that neither has an optional mutated argument (Inductor lowers those poorly).
// The forward operators' Autograd kernels record a node (GroupedLinearBackward /
// GroupedMLPBackward) whose backward calls the backward operator through the dispatcher, so that
// make_fx and torch.compile see both; `_into` records it as an in-place op does (the caller's
// buffer takes the node as its history: CopySlices where it is a view). The compute kernels are
// CompositeExplicitAutograd; the fakes are Python (sparsetrain/torch/grouped_linear.py,
// grouped_mlp.py). Eager calls on plain tensors enter the same operators through this module's
// entries (no torch.ops argument conversion), as attention's do (torch_ops.cpp).
#include <ATen/DeviceAccelerator.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/autograd.h>
#include <torch/csrc/autograd/VariableTypeUtils.h>  // rebase_history, increment_version
#include <torch/csrc/autograd/autograd_not_implemented_fallback.h>
#include <torch/library.h>
#include <torch/python.h>

#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "sparsetrain/error.h"
#include "sparsetrain/grouped_linear.h"
#include "sparsetrain/grouped_mlp.h"
#include "torch_layers.h"

namespace st = sparsetrain;

namespace {

using namespace st::torch_ops;  // NOLINT(google-build-using-namespace): this file's toolbox

class TorchGroupedLinear final : public ModuleLayer<st::GroupedLinear> {
 public:
  TorchGroupedLinear(int64_t num_groups, int64_t in_features, int64_t out_features, bool packed, bool bias,
                     bool fuse_wgrad_accumulation, bool delay_wgrad_compute, bool check_device_splits)
      : ModuleLayer("GroupedLinear", {{num_groups, packed, bias, fuse_wgrad_accumulation, delay_wgrad_compute}}),
        o_(module_options<st::GroupedLinearOptions>(num_groups, fuse_wgrad_accumulation, delay_wgrad_compute,
                                                    check_device_splits)) {
    o_.in_features = in_features;
    o_.out_features = out_features;
  }

  int64_t out_features() const { return o_.out_features; }

  // y (the caller's `out` when given). grad_input: the buffer backward will write, checked now
  // (before anything runs: an error at backward time would come too late).
  at::Tensor forward(const at::Tensor& x, const at::Tensor& splits, const OptTensor& status, const OptTensor& out,
                     const OptTensor& grad_input, at::TensorList params, at::TensorList main_grads, int64_t flags) {
    return translated([&] {
      const std::lock_guard<std::mutex> lock(mutex_);
      st::GroupedLinear& l = bound(params, main_grads, flags);
      const st::TensorView xv = view_of(x, "x");
      const st::Splits s = splits_of(splits, status);
      if (grad_input.has_value()) l.check_grad_input(xv, s, view_of(grad_input, "grad_input"));
      const st::CallArgs a = call_args(x, {}, true, weight_version(params, flags));
      return alloc_.take(l.forward(xv, s, view_of(out, "out"), a), out);
    });
  }

  // (dx, dw, db): dx is the caller's grad_input when given; dw the packed wgrad or the dummy, db
  // [G, out], each an empty tensor where the weight-grad rule gives none.
  std::tuple<at::Tensor, at::Tensor, at::Tensor> backward(const at::Tensor& x, const at::Tensor& dy,
                                                          const at::Tensor& splits, const OptTensor& status,
                                                          const OptTensor& grad_input, at::TensorList params,
                                                          at::TensorList main_grads, int64_t flags) {
    return translated([&] {
      const std::lock_guard<std::mutex> lock(mutex_);
      st::GroupedLinear& l = bound(params, main_grads, flags);
      const st::GroupedLinearGrads g =
          l.backward(view_of(x, "x"), view_of(dy, "dy"), splits_of(splits, status), view_of(grad_input, "grad_input"),
                     call_args(x, {x, dy, splits, status.value_or(at::Tensor())}, eager_call(),
                               weight_version(params, flags)));
      auto [dw, db] = layer_grads(g.weight, g.bias_grad, x);
      return std::make_tuple(alloc_.take(g.grad_input, grad_input), dw, db);
    });
  }

  // The oldest pending delayed wgrad: (dw, db) as backward's.
  std::tuple<at::Tensor, at::Tensor> backward_dw(at::TensorList params, at::TensorList main_grads, int64_t flags) {
    return translated([&] {
      const std::lock_guard<std::mutex> lock(mutex_);
      st::GroupedLinear& l = bound(params, main_grads, flags);
      const st::GroupedLinearGrads g = l.backward_dw(call_args(first_param()));
      return layer_grads(g.weight, g.bias_grad, first_param());
    });
  }

 private:
  std::unique_ptr<st::GroupedLinear> make(at::TensorList params, at::TensorList main_grads, int64_t flags) override {
    size_t at = 0, mg_at = 0;
    const st::GroupedLinearParams p = layer_params(params, at, main_grads, mg_at, 0, flags, "");
    st::GroupedLinearOptions o = o_;
    o.dtype = p.weight.views()[0].dtype();
    o.overwrite_main_grad = overwrite_main_grad(flags);
    o.fp8 = fp8_recipe(flags);
    return std::make_unique<st::GroupedLinear>(o, p, &alloc_);
  }
  void set_main_grads(st::GroupedLinear& l, const std::vector<st::GroupedParam>& mg) override {
    l.set_main_grad(mg.at(0));
  }

  st::GroupedLinearOptions o_;  // all but dtype and overwrite_main_grad, which come with the parameters
};

class TorchGroupedMLP final : public ModuleLayer<st::GroupedMLP> {
 public:
  TorchGroupedMLP(int64_t num_groups, int64_t in_features, int64_t ffn_features, int64_t out_features,
                  int64_t glu_interleave_size, bool packed, bool bias, bool fuse_wgrad_accumulation,
                  bool delay_wgrad_compute, bool check_device_splits)
      : ModuleLayer("GroupedMLP", {{num_groups, packed, bias, fuse_wgrad_accumulation, delay_wgrad_compute},
                                   {num_groups, packed, bias, fuse_wgrad_accumulation, delay_wgrad_compute}}),
        o_(module_options<st::GroupedMLPOptions>(num_groups, fuse_wgrad_accumulation, delay_wgrad_compute,
                                                 check_device_splits)) {
    o_.in_features = in_features;
    o_.ffn_features = ffn_features;
    o_.out_features = out_features;
    o_.glu_interleave_size = glu_interleave_size;
  }

  int64_t out_features() const { return o_.out_features; }

  // (y, fc1_out): y is the caller's `out` when given.
  std::tuple<at::Tensor, at::Tensor> forward(const at::Tensor& x, const at::Tensor& splits, const OptTensor& status,
                                             const at::Tensor& probs, const OptTensor& out,
                                             const OptTensor& grad_input, at::TensorList params,
                                             at::TensorList main_grads, int64_t flags) {
    return translated([&] {
      const std::lock_guard<std::mutex> lock(mutex_);
      st::GroupedMLP& m = bound(params, main_grads, flags);
      const st::TensorView xv = view_of(x, "x");
      const st::Splits s = splits_of(splits, status);
      if (grad_input.has_value()) m.check_grad_input(xv, s, view_of(grad_input, "grad_input"));
      const st::GroupedMLPForward r =
          m.forward(xv, s, view_of(probs, "probs"), view_of(out, "out"),
                    call_args(x, {}, true, weight_version(params, flags)));
      return std::make_tuple(alloc_.take(r.out, out), alloc_.take(r.fc1_out));
    });
  }

  // (dx, dprobs, fc1's dw, db, fc2's dw, db), as GroupedLinear's backward. last_use: no backward
  // will read fc1_out again (st::Fc1OutUse::kReuse: its gradient is written over it).
  std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> backward(
      const at::Tensor& x, const at::Tensor& fc1_out, const at::Tensor& probs, const at::Tensor& dy,
      const at::Tensor& splits, const OptTensor& status, const OptTensor& grad_input, bool last_use,
      at::TensorList params, at::TensorList main_grads, int64_t flags) {
    return translated([&] {
      const std::lock_guard<std::mutex> lock(mutex_);
      st::GroupedMLP& m = bound(params, main_grads, flags);
      std::vector<at::Tensor> keep{x, dy, probs, splits, status.value_or(at::Tensor())};
      if (last_use) keep.push_back(fc1_out);  // a delayed wgrad reads the gradient written over it
      const st::GroupedMLPGrads g = m.backward(
          view_of(x, "x"), view_of(fc1_out, "fc1_out"), view_of(probs, "probs"), view_of(dy, "dy"),
          splits_of(splits, status), view_of(grad_input, "grad_input"),
          call_args(x, std::move(keep), eager_call(), weight_version(params, flags)),
          last_use ? st::Fc1OutUse::kReuse : st::Fc1OutUse::kKeep);
      return std::tuple_cat(std::make_tuple(alloc_.take(g.grad_input, grad_input), alloc_.take(g.dprobs)),
                            mlp_grads(g.fc1, g.fc2, x));
    });
  }

  // Both layers' oldest pending delayed wgrads: (fc1's dw, db, fc2's dw, db).
  std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> backward_dw(at::TensorList params,
                                                                         at::TensorList main_grads, int64_t flags) {
    return mlp_backward_dw(params, main_grads, flags);
  }

 private:
  std::unique_ptr<st::GroupedMLP> make(at::TensorList params, at::TensorList main_grads, int64_t flags) override {
    const st::GroupedMLPParams p = mlp_params(params, main_grads, flags, "");
    st::GroupedMLPOptions o = o_;
    o.dtype = p.fc1.weight.views()[0].dtype();
    o.overwrite_main_grad = overwrite_main_grad(flags);
    o.fp8 = fp8_recipe(flags);
    return std::make_unique<st::GroupedMLP>(o, p, &alloc_);
  }
  void set_main_grads(st::GroupedMLP& m, const std::vector<st::GroupedParam>& mg) override {
    m.set_main_grads(mg.at(0), mg.at(1));
  }

  st::GroupedMLPOptions o_;  // all but dtype and overwrite_main_grad, which come with the parameters
};

// --- the operators' compute kernels --------------------------------------------------------------

at::Tensor linear_forward(int64_t layer, const at::Tensor& x, const at::Tensor& splits, at::TensorList params,
                          at::TensorList main_grads, int64_t flags, const OptTensor& status,
                          const OptTensor& grad_input) {
  return Registry::get().find<TorchGroupedLinear>(layer)->forward(x, splits, status, std::nullopt, grad_input, params,
                                                                  main_grads, flags);
}

void linear_forward_into(int64_t layer, const at::Tensor& x, const at::Tensor& splits, at::TensorList params,
                         at::TensorList main_grads, int64_t flags, const at::Tensor& out, const OptTensor& status,
                         const OptTensor& grad_input) {
  Registry::get().find<TorchGroupedLinear>(layer)->forward(x, splits, status, out, grad_input, params, main_grads,
                                                           flags);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> linear_backward(int64_t layer, const at::Tensor& x,
                                                               const at::Tensor& dy, const at::Tensor& splits,
                                                               at::TensorList params, at::TensorList main_grads,
                                                               int64_t flags, const OptTensor& status) {
  return Registry::get().find<TorchGroupedLinear>(layer)->backward(x, dy, splits, status, std::nullopt, params,
                                                                   main_grads, flags);
}

std::tuple<at::Tensor, at::Tensor> linear_backward_into(int64_t layer, const at::Tensor& x, const at::Tensor& dy,
                                                        const at::Tensor& splits, at::TensorList params,
                                                        at::TensorList main_grads, int64_t flags,
                                                        const at::Tensor& grad_input, const OptTensor& status) {
  auto [dx, dw, db] = Registry::get().find<TorchGroupedLinear>(layer)->backward(
      x, dy, splits, status, grad_input, params, main_grads, flags);
  return {dw, db};
}

std::tuple<at::Tensor, at::Tensor> mlp_forward(int64_t layer, const at::Tensor& x, const at::Tensor& splits,
                                               const at::Tensor& probs, at::TensorList params,
                                               at::TensorList main_grads, int64_t flags, const OptTensor& status,
                                               const OptTensor& grad_input) {
  return Registry::get().find<TorchGroupedMLP>(layer)->forward(x, splits, status, probs, std::nullopt, grad_input,
                                                               params, main_grads, flags);
}

at::Tensor mlp_forward_into(int64_t layer, const at::Tensor& x, const at::Tensor& splits, const at::Tensor& probs,
                            at::TensorList params, at::TensorList main_grads, int64_t flags, const at::Tensor& out,
                            const OptTensor& status, const OptTensor& grad_input) {
  return std::get<1>(Registry::get().find<TorchGroupedMLP>(layer)->forward(x, splits, status, probs, out, grad_input,
                                                                          params, main_grads, flags));
}

using MLPGrads = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

MLPGrads mlp_backward(int64_t layer, const at::Tensor& x, const at::Tensor& fc1_out, const at::Tensor& probs,
                      const at::Tensor& dy, const at::Tensor& splits, at::TensorList params,
                      at::TensorList main_grads, int64_t flags, const OptTensor& status, bool last_use) {
  return Registry::get().find<TorchGroupedMLP>(layer)->backward(x, fc1_out, probs, dy, splits, status, std::nullopt,
                                                                last_use, params, main_grads, flags);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> mlp_backward_into(
    int64_t layer, const at::Tensor& x, const at::Tensor& fc1_out, const at::Tensor& probs, const at::Tensor& dy,
    const at::Tensor& splits, at::TensorList params, at::TensorList main_grads, int64_t flags,
    const at::Tensor& grad_input, const OptTensor& status, bool last_use) {
  auto [dx, dprobs, dw1, db1, dw2, db2] = Registry::get().find<TorchGroupedMLP>(layer)->backward(
      x, fc1_out, probs, dy, splits, status, grad_input, last_use, params, main_grads, flags);
  return {dprobs, dw1, db1, dw2, db2};
}

// --- typed handles ------------------------------------------------------------------------------

// Each operator's handle, looked up once; its signature is its compute kernel's.
#define ST_HANDLE(fn, name)                                                               \
  const c10::TypedOperatorHandle<decltype(fn)>& fn##_op() {                               \
    static const auto h =                                                                 \
        c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<decltype(fn)>();   \
    return h;                                                                             \
  }
ST_HANDLE(linear_forward, "sparsetrain::grouped_linear_forward")
ST_HANDLE(linear_forward_into, "sparsetrain::grouped_linear_forward_into")
ST_HANDLE(linear_backward, "sparsetrain::grouped_linear_backward")
ST_HANDLE(linear_backward_into, "sparsetrain::grouped_linear_backward_into")
ST_HANDLE(mlp_forward, "sparsetrain::grouped_mlp_forward")
ST_HANDLE(mlp_forward_into, "sparsetrain::grouped_mlp_forward_into")
ST_HANDLE(mlp_backward, "sparsetrain::grouped_mlp_backward")
ST_HANDLE(mlp_backward_into, "sparsetrain::grouped_mlp_backward_into")
#undef ST_HANDLE

// GroupedLinear's node: saved [x, splits, status].
class GroupedLinearBackward final : public GroupedBackward {
 public:
  using GroupedBackward::GroupedBackward;
  std::string name() const override { return "sparsetrain::GroupedLinearBackward"; }

  variable_list apply(variable_list&& grads) override {
    const std::shared_ptr<Node> self = shared_from_this();
    const std::vector<at::Tensor> s = unpack(saved_, self), params = unpack(params_, self),
                                  main_grads = unpack(main_grads_, self);
    const at::Tensor &x = s[0], &splits = s[1];
    const OptTensor status = s[2].defined() ? OptTensor(s[2]) : std::nullopt;
    const at::Tensor dy = dy_of(grads[0], x, Registry::get().find<TorchGroupedLinear>(layer_)->out_features());
    at::Tensor dx, dw, db;
    const EagerCall scope(eager(s));
    if (grad_input_.has_value()) {
      std::tie(dw, db) =
          linear_backward_into_op().call(layer_, x, dy, splits, params, main_grads, flags_, *grad_input_, status);
    } else {
      std::tie(dx, dw, db) =
          linear_backward_op().call(layer_, x, dy, splits, params, main_grads, flags_, status);
    }
    variable_list out;
    if (out_edge_) out.emplace_back();
    out.push_back(dx_of(dx, x));
    size_t at = 0;
    append_param_grads(out, 0, dw, db, params, at);
    return out;
  }
};

// GroupedMLP's node: saved [x, fc1_out, probs, splits, status].
class GroupedMLPBackward final : public GroupedBackward {
 public:
  using GroupedBackward::GroupedBackward;
  std::string name() const override { return "sparsetrain::GroupedMLPBackward"; }

  variable_list apply(variable_list&& grads) override {
    const std::shared_ptr<Node> self = shared_from_this();
    const std::vector<at::Tensor> s = unpack(saved_, self), params = unpack(params_, self),
                                  main_grads = unpack(main_grads_, self);
    const at::Tensor &x = s[0], &fc1_out = s[1], &probs = s[2], &splits = s[3];
    const OptTensor status = s[4].defined() ? OptTensor(s[4]) : std::nullopt;
    const at::Tensor dy = dy_of(grads[0], x, Registry::get().find<TorchGroupedMLP>(layer_)->out_features());
    const bool last = last_use(s);
    const EagerCall scope(eager(s));
    at::Tensor dx, dprobs, dw1, db1, dw2, db2;
    if (grad_input_.has_value()) {
      std::tie(dprobs, dw1, db1, dw2, db2) = mlp_backward_into_op().call(
          layer_, x, fc1_out, probs, dy, splits, params, main_grads, flags_, *grad_input_, status, last);
    } else {
      std::tie(dx, dprobs, dw1, db1, dw2, db2) =
          mlp_backward_op().call(layer_, x, fc1_out, probs, dy, splits, params, main_grads, flags_, status, last);
    }
    variable_list out;
    if (out_edge_) out.emplace_back();
    out.push_back(dx_of(dx, x));
    out.push_back(dprobs);
    size_t at = 0;
    append_param_grads(out, 0, dw1, db1, params, at);
    append_param_grads(out, 1, dw2, db2, params, at);
    return out;
  }
};

// The caller's buffer `out`, written in place below autograd, takes `node` as its history as an
// in-place op's output does (its version bumped; CopySlices where it is a view). Without a node
// only the version is bumped.
void rebase_out(const at::Tensor& out, const std::shared_ptr<torch::autograd::Node>& node) {
  torch::autograd::increment_version(out);
  if (node) torch::autograd::rebase_history(out, node);
}

at::Tensor linear_forward_autograd(int64_t layer, const at::Tensor& x, const at::Tensor& splits, at::TensorList params,
                                   at::TensorList main_grads, int64_t flags, const OptTensor& status,
                                   const OptTensor& grad_input) {
  const bool record = recorded({&x}, params, "GroupedLinear");
  at::Tensor y;
  {
    const at::AutoDispatchBelowADInplaceOrView below;
    y = linear_forward_op().call(layer, x, splits, params, main_grads, flags, status, grad_input);
  }
  if (record) {
    auto node = make_node<GroupedLinearBackward, TorchGroupedLinear>(
        layer, flags, std::nullopt, grad_input, {x, splits, status.value_or(at::Tensor())}, params, main_grads, {x});
    torch::autograd::set_history(y, node);
  }
  return y;
}

void linear_forward_into_autograd(int64_t layer, const at::Tensor& x, const at::Tensor& splits, at::TensorList params,
                                  at::TensorList main_grads, int64_t flags, const at::Tensor& out,
                                  const OptTensor& status, const OptTensor& grad_input) {
  std::shared_ptr<torch::autograd::Node> node;
  if (recorded({&x}, params, "GroupedLinear"))
    node = make_node<GroupedLinearBackward, TorchGroupedLinear>(
        layer, flags, out, grad_input, {x, splits, status.value_or(at::Tensor())}, params, main_grads, {x});
  {
    const at::AutoDispatchBelowADInplaceOrView below;
    linear_forward_into_op().call(layer, x, splits, params, main_grads, flags, out, status, grad_input);
  }
  rebase_out(out, node);
}

std::tuple<at::Tensor, at::Tensor> mlp_forward_autograd(int64_t layer, const at::Tensor& x, const at::Tensor& splits,
                                                        const at::Tensor& probs, at::TensorList params,
                                                        at::TensorList main_grads, int64_t flags,
                                                        const OptTensor& status, const OptTensor& grad_input) {
  const bool record = recorded({&x, &probs}, params, "GroupedMLP");
  at::Tensor y, fc1_out;
  {
    const at::AutoDispatchBelowADInplaceOrView below;
    std::tie(y, fc1_out) =
        mlp_forward_op().call(layer, x, splits, probs, params, main_grads, flags, status, grad_input);
  }
  if (record) {
    // Saved activations: x, fc1's pre-activation output and probs (the activation is recomputed).
    auto node = make_node<GroupedMLPBackward, TorchGroupedMLP>(
        layer, flags, std::nullopt, grad_input, {x, fc1_out, probs, splits, status.value_or(at::Tensor())}, params,
        main_grads, {x, probs});
    torch::autograd::set_history(y, node);
  }
  return {y, fc1_out};
}

at::Tensor mlp_forward_into_autograd(int64_t layer, const at::Tensor& x, const at::Tensor& splits,
                                     const at::Tensor& probs, at::TensorList params, at::TensorList main_grads,
                                     int64_t flags, const at::Tensor& out, const OptTensor& status,
                                     const OptTensor& grad_input) {
  const bool record = recorded({&x, &probs}, params, "GroupedMLP");
  at::Tensor fc1_out;
  {
    const at::AutoDispatchBelowADInplaceOrView below;
    fc1_out = mlp_forward_into_op().call(layer, x, splits, probs, params, main_grads, flags, out, status, grad_input);
  }
  std::shared_ptr<torch::autograd::Node> node;
  if (record)
    node = make_node<GroupedMLPBackward, TorchGroupedMLP>(
        layer, flags, out, grad_input, {x, fc1_out, probs, splits, status.value_or(at::Tensor())}, params,
        main_grads, {x, probs});
  rebase_out(out, node);
  return fc1_out;
}

// --- the Python module ----------------------------------------------------------------------------

// Whether the AccumulateGrad node of every leaf in `params` that has one runs on the stream now
// current on its device (a node runs on the stream current when it was made). A layer holds its
// parameters' nodes only then: see DelayedWgrad._hold_grad_accumulators in sparsetrain.torch.grouped_linear.
bool grad_accumulators_on_current_stream(const std::vector<at::Tensor>& params) {
  for (const at::Tensor& p : params) {
    const std::shared_ptr<torch::autograd::Node> node = torch::autograd::impl::try_get_grad_accumulator(p);
    const std::optional<c10::Stream> stream = node ? node->stream() : std::nullopt;
    if (stream && *stream != at::accelerator::getCurrentStream(stream->device_index())) return false;
  }
  return true;
}

// The forward operators called from Python without torch.ops' entry (each argument converted to
// an IValue, the __torch_function__ scan: ~10 us a call), where that entry has nothing to do: eager
// calls on plain tensors with no mode active (sparsetrain.torch.native.direct). The same operators
// through the same dispatcher.
void register_entries(pybind11::module_& m) {
  using Tensors = const std::vector<at::Tensor>&;
  using T = const at::Tensor&;
  using O = const OptTensor&;
  m.def("grouped_linear_forward", [](int64_t layer, T x, T splits, Tensors params, Tensors main_grads, int64_t flags,
                                     O status, O grad_input) {
    const EagerCall eager;
    return linear_forward_op().call(layer, x, splits, params, main_grads, flags, status, grad_input);
  });
  m.def("grouped_linear_forward_into", [](int64_t layer, T x, T splits, Tensors params, Tensors main_grads,
                                          int64_t flags, T out, O status, O grad_input) {
    const EagerCall eager;
    linear_forward_into_op().call(layer, x, splits, params, main_grads, flags, out, status, grad_input);
  });
  m.def("grouped_mlp_forward", [](int64_t layer, T x, T splits, T probs, Tensors params, Tensors main_grads,
                                  int64_t flags, O status, O grad_input) {
    const EagerCall eager;
    return mlp_forward_op().call(layer, x, splits, probs, params, main_grads, flags, status, grad_input);
  });
  m.def("grouped_mlp_forward_into", [](int64_t layer, T x, T splits, T probs, Tensors params, Tensors main_grads,
                                       int64_t flags, T out, O status, O grad_input) {
    const EagerCall eager;
    return mlp_forward_into_op().call(layer, x, splits, probs, params, main_grads, flags, out, status, grad_input);
  });
}

}  // namespace

// Imported by sparsetrain.torch after torch (whose libraries it links); importing it also
// registers the operators (this file's and torch_ops.cpp's).
PYBIND11_MODULE(_torch_ops, m) {
  st::torch_ops::register_attention(m);
  st::torch_ops::register_moe_layer(m);
  st::torch_ops::register_block_mask(m);
  m.def("grad_accumulators_on_current_stream", &grad_accumulators_on_current_stream);
  register_layer<TorchGroupedLinear, int64_t, int64_t, int64_t, bool, bool, bool, bool, bool>(m, "GroupedLinear");
  register_layer<TorchGroupedMLP, int64_t, int64_t, int64_t, int64_t, int64_t, bool, bool, bool, bool, bool>(
      m, "GroupedMLP");
  register_entries(m);
}

// The operators (the library's TORCH_LIBRARY block is attention's, torch_ops.cpp). main_grads are
// written by the backward operators (wgrad accumulation); the forward ones only bind them.
TORCH_LIBRARY_FRAGMENT(sparsetrain, m) {
  m.set_python_module("sparsetrain.torch.grouped_linear");
  m.def("grouped_linear_forward(int layer_id, Tensor x, Tensor splits, Tensor[] params, Tensor[] main_grads, "
        "int flags, Tensor? status=None, Tensor? grad_input=None) -> Tensor");
  m.def("grouped_linear_forward_into(int layer_id, Tensor x, Tensor splits, Tensor[] params, Tensor[] main_grads, "
        "int flags, Tensor(a!) out, Tensor? status=None, Tensor? grad_input=None) -> ()");
  m.def("grouped_linear_backward(int layer_id, Tensor x, Tensor dy, Tensor splits, Tensor[] params, "
        "Tensor(a!)[] main_grads, int flags, Tensor? status=None) -> (Tensor, Tensor, Tensor)");
  m.def("grouped_linear_backward_into(int layer_id, Tensor x, Tensor dy, Tensor splits, Tensor[] params, "
        "Tensor(a!)[] main_grads, int flags, Tensor(b!) grad_input, Tensor? status=None) -> (Tensor, Tensor)");
  m.set_python_module("sparsetrain.torch.grouped_mlp");
  m.def("grouped_mlp_forward(int layer_id, Tensor x, Tensor splits, Tensor probs, Tensor[] params, "
        "Tensor[] main_grads, int flags, Tensor? status=None, Tensor? grad_input=None) -> (Tensor, Tensor)");
  m.def("grouped_mlp_forward_into(int layer_id, Tensor x, Tensor splits, Tensor probs, Tensor[] params, "
        "Tensor[] main_grads, int flags, Tensor(a!) out, Tensor? status=None, Tensor? grad_input=None) -> Tensor");
  // last_use: the caller's promise that nothing reads fc1_out after this call (the node's, in an
  // eager backward that does not retain the graph): its gradient is then written over it.
  // A backward operator's dummy weight grad is the layer's cached zero tensor in an eager call
  // (EagerCall: the eager node's), a new one otherwise, as any output a graph owns.
  m.def("grouped_mlp_backward(int layer_id, Tensor x, Tensor fc1_out, Tensor probs, Tensor dy, Tensor splits, "
        "Tensor[] params, Tensor(a!)[] main_grads, int flags, Tensor? status=None, bool last_use=False) "
        "-> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)");
  m.def("grouped_mlp_backward_into(int layer_id, Tensor x, Tensor fc1_out, Tensor probs, Tensor dy, Tensor splits, "
        "Tensor[] params, Tensor(a!)[] main_grads, int flags, Tensor(b!) grad_input, Tensor? status=None, "
        "bool last_use=False) -> (Tensor, Tensor, Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(sparsetrain, CompositeExplicitAutograd, m) {
  m.impl("grouped_linear_forward", &linear_forward);
  m.impl("grouped_linear_forward_into", &linear_forward_into);
  m.impl("grouped_linear_backward", &linear_backward);
  m.impl("grouped_linear_backward_into", &linear_backward_into);
  m.impl("grouped_mlp_forward", &mlp_forward);
  m.impl("grouped_mlp_forward_into", &mlp_forward_into);
  m.impl("grouped_mlp_backward", &mlp_backward);
  m.impl("grouped_mlp_backward_into", &mlp_backward_into);
}

// The backward operators have no derivative: a graph that differentiates them (create_graph=True)
// gets autograd's "not implemented" error when that is used, not silently wrong second derivatives.
TORCH_LIBRARY_IMPL(sparsetrain, Autograd, m) {
  m.impl("grouped_linear_forward", &linear_forward_autograd);
  m.impl("grouped_linear_forward_into", &linear_forward_into_autograd);
  m.impl("grouped_mlp_forward", &mlp_forward_autograd);
  m.impl("grouped_mlp_forward_into", &mlp_forward_into_autograd);
  for (const char* name : {"grouped_linear_backward", "grouped_linear_backward_into", "grouped_mlp_backward",
                           "grouped_mlp_backward_into"})
    m.impl(name, torch::autograd::autogradNotImplementedFallback());
}

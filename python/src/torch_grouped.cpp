// GroupedLinear and GroupedMLP as C++ torch operators (sparsetrain::grouped_linear_* and
// grouped_mlp_*): the one route of sparsetrain.torch's GroupedLinear and GroupedMLP, eager, under
// autograd, torch.compile, fake tensors, dispatch modes and CUDA graphs alike, with their autograd
// in C++ (no Python in a backward but the Megatron attribute a dummy weight grad sets).
//
// A module's state lives in its C++ layer (the class sparsetrain._torch_ops.GroupedLinear /
// GroupedMLP, made with the module): the st::GroupedLinear / st::GroupedMLP over the module's
// parameters, its delayed-wgrad queue, its cached dummy wgrad. The operators find it by the
// module's id in this file's registry; the module passes its parameter tensors with every call,
// for each linear layer its weights then its biases (`params`; one packed tensor or G of each), its
// main_grads (`main_grads`, with fusion), and `flags` (bit 0 overwrite_main_grad, bit 1 + i: layer
// i's weights have Megatron's grad_added_to_main_grad). The C++ layer holds views of them, so it
// is rebuilt when one moved (another tensor, `.data =`, `.to()`: address, shape, strides, dtype or
// device) or a flag changed, never while delayed wgrads are pending.
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
#include <c10/core/impl/TorchDispatchModeTLS.h>
#include <torch/autograd.h>
#include <torch/csrc/autograd/VariableTypeUtils.h>  // rebase_history, increment_version
#include <torch/csrc/autograd/autograd_not_implemented_fallback.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/graph_task.h>  // get_current_graph_task_keep_graph
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/autograd/saved_variable.h>
#include <torch/library.h>
#include <torch/python.h>

#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <tuple>
#include <unordered_map>
#include <utility>
#include <vector>

#include "sparsetrain/error.h"
#include "sparsetrain/grouped_linear.h"
#include "sparsetrain/grouped_mlp.h"
#include "sparsetrain/weight_grad.h"
#include "torch_common.h"

namespace st = sparsetrain;

namespace {

using namespace st::torch_ops;  // NOLINT(google-build-using-namespace): this file's toolbox
using OptTensor = std::optional<at::Tensor>;
using torch::autograd::variable_list;

// --- the module's parameters -------------------------------------------------------------------

bool overwrite_main_grad(int64_t flags) { return (flags & 1) != 0; }
bool has_grad_added_attr(int64_t flags, size_t layer) { return ((flags >> (1 + layer)) & 1) != 0; }

// The options a module fixes at construction that both layers' options carry (the rest but
// dtype and overwrite_main_grad, which come with the parameters, are set by each layer).
template <class Options>
Options module_options(int64_t num_groups, bool fuse_wgrad_accumulation, bool delay_wgrad_compute,
                       bool check_device_splits) {
  Options o;
  o.num_groups = num_groups;
  o.fuse_wgrad_accumulation = fuse_wgrad_accumulation;
  o.delay_wgrad_compute = delay_wgrad_compute;
  o.check_device_splits = check_device_splits;
  return o;
}

// How one linear layer's parameters sit in a module's lists.
struct LinearLayout {
  int64_t num_groups;
  bool packed, bias, fuse, delay;
  size_t per_param() const { return packed ? 1 : size_t(num_groups); }
  size_t params() const { return per_param() * (1 + size_t(bias)); }  // weights, biases
  size_t main_grads() const { return fuse ? per_param() : 0; }
};

st::GroupedParam grouped_param(at::TensorList ts, size_t& at, size_t n, bool packed, const std::string& name) {
  std::vector<st::TensorView> views;
  for (size_t i = 0; i < n; ++i) views.push_back(view_of(ts[at++], name.c_str()));
  return packed ? st::GroupedParam::packed(views[0]) : st::GroupedParam::per_group(std::move(views));
}

// Where a parameter tensor lives and how it is laid out, to tell whether it moved.
struct Placement {
  explicit Placement(const at::Tensor& t)
      : data(t.data_ptr()), type(t.scalar_type()), device(t.device()), sizes(t.sizes()), strides(t.strides()) {}
  bool operator==(const Placement& o) const {
    return data == o.data && type == o.type && device == o.device && sizes == o.sizes && strides == o.strides;
  }
  const void* data;
  at::ScalarType type;
  at::Device device;
  at::DimVector sizes, strides;
};

st::Splits splits_of(const at::Tensor& splits, const OptTensor& status) {
  if (splits.is_cuda()) return st::Splits::device(view_of(splits, "splits"), view_of(status, "splits status"));
  return st::Splits::host(view_of(splits, "splits"));
}

// The call's stream and, for a backward that may queue a delayed wgrad, the tensors the queue
// entry refers to (held by the C++ layer's queue until backward_dw pops it).
st::CallArgs call_args(const at::Tensor& on, std::vector<at::Tensor> keep = {}) {
  st::CallArgs a;
  a.stream = stream_of(on);
  if (!keep.empty()) a.keep_alive = std::make_shared<const std::vector<at::Tensor>>(std::move(keep));
  return a;
}

// --- the layers and their registry -------------------------------------------------------------

class RegisteredLayer;

// Every module's C++ layer by the module's id: the operators' kernels (run where autograd runs
// them, without the GIL) find a module's state through it. Weak: the module owns its layer.
class Registry {
 public:
  static Registry& get() {
    static Registry* r = new Registry();  // never destroyed: layers may outlive static destruction
    return *r;
  }
  void add(int64_t id, const std::shared_ptr<RegisteredLayer>& layer) {
    const std::lock_guard<std::mutex> lock(mutex_);
    layers_[id] = layer;
  }
  void remove_expired(int64_t id) {
    const std::lock_guard<std::mutex> lock(mutex_);
    auto it = layers_.find(id);
    if (it != layers_.end() && it->second.expired()) layers_.erase(it);
  }
  template <class Layer>
  std::shared_ptr<Layer> find(int64_t id) {
    std::shared_ptr<RegisteredLayer> l;
    {
      const std::lock_guard<std::mutex> lock(mutex_);
      auto it = layers_.find(id);
      if (it != layers_.end()) l = it->second.lock();
    }
    auto typed = std::dynamic_pointer_cast<Layer>(l);
    TORCH_CHECK(typed, "sparsetrain layer ", id, " no longer exists");
    return typed;
  }

 private:
  std::mutex mutex_;
  std::unordered_map<int64_t, std::weak_ptr<RegisteredLayer>> layers_;
};

// A module's C++ layer, in the registry under the module's id while it lives.
class RegisteredLayer {
 public:
  virtual ~RegisteredLayer() {
    if (id_ >= 0) Registry::get().remove_expired(id_);
  }
  void registered_as(int64_t id) { id_ = id; }

 private:
  int64_t id_ = -1;
};

// What backward hands autograd for one linear layer's weights and biases: the weight-grad rule
// (weight_grad.h) under this call's flags, and how many tensors each list has.
struct GradRule {
  st::WeightGradDisposition disposition;
  bool packed;
  size_t weights, biases;
};

// The C++ layer of a module over the parameters it passed last (see the top of the file). Every
// method holds the layer's lock: autograd runs backwards on its own threads.
template <class Layer>
class ModuleLayer : public RegisteredLayer {
 public:
  int64_t pending_wgrads() {
    const std::lock_guard<std::mutex> lock(mutex_);
    return layer_ ? int64_t(layer_->pending_wgrads()) : 0;
  }

  // Each layer's GradRule under `flags`.
  std::vector<GradRule> grad_rules(int64_t flags) const {
    std::vector<GradRule> rules;
    for (size_t i = 0; i < layouts_.size(); ++i) {
      const LinearLayout& l = layouts_[i];
      rules.push_back({st::weight_grad_disposition(l.delay, l.fuse, has_grad_added_attr(flags, i)), l.packed,
                       l.per_param(), l.bias ? l.per_param() : 0});
    }
    return rules;
  }

 protected:
  ModuleLayer(const char* what, std::vector<LinearLayout> layouts) : what_(what), layouts_(std::move(layouts)) {}

  // A layer over the module's tensors (checked in number), `flags` as the module passed them.
  virtual std::unique_ptr<Layer> make(at::TensorList params, at::TensorList main_grads, int64_t flags) = 0;

  // The layer over the module's tensors and flags, made anew when they differ from the last call's.
  // The caller holds mutex_.
  Layer& bound(at::TensorList params, at::TensorList main_grads, int64_t flags) {
    size_t n_params = 0, n_main_grads = 0;
    for (const LinearLayout& l : layouts_) n_params += l.params(), n_main_grads += l.main_grads();
    ST_CHECK_ARG(params.size() == n_params, "params", std::to_string(n_params) + " tensors (weights, biases of each layer)",
                 params.size());
    ST_CHECK_ARG(main_grads.size() == n_main_grads, "main_grads",
                 std::to_string(n_main_grads) + " tensors (each layer's, with fuse_wgrad_accumulation)",
                 main_grads.size());
    if (layer_ && flags == flags_ && same(params, 0) && same(main_grads, params.size())) return *layer_;
    if (layer_ && layer_->pending_wgrads())
      ST_FAIL(what_, ": parameters or main_grad changed while ", layer_->pending_wgrads(),
              " delayed wgrad(s) are pending; call backward_dw() first");
    std::unique_ptr<Layer> fresh = make(params, main_grads, flags);  // may throw: the old layer then stays
    layer_ = std::move(fresh);
    held_.assign(params.begin(), params.end());
    held_.insert(held_.end(), main_grads.begin(), main_grads.end());
    placements_.clear();
    for (const at::Tensor& t : held_) placements_.emplace_back(t);
    flags_ = flags;
    return *layer_;
  }

  // Layer `i`'s parameters from the module's lists, from `at` and `mg_at` on (moved past them).
  st::GroupedLinearParams layer_params(at::TensorList params, size_t& at, at::TensorList main_grads, size_t& mg_at,
                                       size_t i, int64_t flags, const std::string& prefix) const {
    const LinearLayout& l = layouts_[i];
    st::GroupedLinearParams p;
    const size_t n = l.per_param();
    p.weight = grouped_param(params, at, n, l.packed, prefix + "weight");
    if (l.bias) p.bias = grouped_param(params, at, n, l.packed, prefix + "bias");
    if (l.fuse) p.main_grad = grouped_param(main_grads, mg_at, n, l.packed, prefix + "main_grad");
    p.has_grad_added_to_main_grad = has_grad_added_attr(flags, i);
    return p;
  }

  // One layer's weight grad and bias grad as tensors, an empty tensor (`like`'s dtype) for none:
  // the packed wgrad, or the dummy (packed, or the one [out, in] tensor of per-group weights). Two
  // nones are two tensors: an operator's outputs may not alias each other.
  std::tuple<at::Tensor, at::Tensor> layer_grads(const st::WeightGrad& w, const st::Tensor& bias_grad,
                                                 const at::Tensor& like) const {
    at::Tensor dw = w.kind == st::WeightGradKind::kNone
                        ? at::empty({0}, like.options())
                        : alloc_.take(w.packed.defined() ? w.packed : w.per_group[0]);
    return {dw, bias_grad.defined() ? alloc_.take(bias_grad) : at::empty({0}, like.options())};
  }

  // The device the layer computes on (its first parameter's), for calls without activations.
  const at::Tensor& first_param() const { return held_.at(0); }

  std::mutex mutex_;
  TorchAllocator alloc_;  // declared before layer_: the layer's cached tensors are returned to it

 private:
  bool same(at::TensorList ts, size_t from) const {
    for (size_t i = 0; i < ts.size(); ++i)
      if (!(Placement(ts[i]) == placements_[from + i])) return false;
    return true;
  }

  const char* what_;
  std::vector<LinearLayout> layouts_;
  std::vector<at::Tensor> held_;  // params then main_grads: keeps what the layer views alive
  std::vector<Placement> placements_;  // theirs when the layer was made
  int64_t flags_ = 0;
  std::unique_ptr<Layer> layer_;
};

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
      return alloc_.take(l.forward(xv, s, view_of(out, "out"), call_args(x)), out);
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
                     call_args(x, {x, dy, splits, status.value_or(at::Tensor())}));
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
    return std::make_unique<st::GroupedLinear>(o, p, &alloc_);
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
      const st::GroupedMLPForward r = m.forward(xv, s, view_of(probs, "probs"), view_of(out, "out"), call_args(x));
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
          splits_of(splits, status), view_of(grad_input, "grad_input"), call_args(x, std::move(keep)),
          last_use ? st::Fc1OutUse::kReuse : st::Fc1OutUse::kKeep);
      return std::tuple_cat(std::make_tuple(alloc_.take(g.grad_input, grad_input), alloc_.take(g.dprobs)),
                            layer_grads(g.fc1.weight, g.fc1.bias_grad, x),
                            layer_grads(g.fc2.weight, g.fc2.bias_grad, x));
    });
  }

  // Both layers' oldest pending delayed wgrads: (fc1's dw, db, fc2's dw, db).
  std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> backward_dw(at::TensorList params,
                                                                         at::TensorList main_grads, int64_t flags) {
    return translated([&] {
      const std::lock_guard<std::mutex> lock(mutex_);
      st::GroupedMLP& m = bound(params, main_grads, flags);
      const st::GroupedMLPGrads g = m.backward_dw(call_args(first_param()));
      return std::tuple_cat(layer_grads(g.fc1.weight, g.fc1.bias_grad, first_param()),
                            layer_grads(g.fc2.weight, g.fc2.bias_grad, first_param()));
    });
  }

 private:
  std::unique_ptr<st::GroupedMLP> make(at::TensorList params, at::TensorList main_grads, int64_t flags) override {
    size_t at = 0, mg_at = 0;
    st::GroupedMLPParams p;
    p.fc1 = layer_params(params, at, main_grads, mg_at, 0, flags, "fc1.");
    p.fc2 = layer_params(params, at, main_grads, mg_at, 1, flags, "fc2.");
    st::GroupedMLPOptions o = o_;
    o.dtype = p.fc1.weight.views()[0].dtype();
    o.overwrite_main_grad = overwrite_main_grad(flags);
    return std::make_unique<st::GroupedMLP>(o, p, &alloc_);
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
  auto [dx, dw, db] = Registry::get().find<TorchGroupedLinear>(layer)->backward(x, dy, splits, status, grad_input,
                                                                                params, main_grads, flags);
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
#define ST_HANDLE(fn, name)                                                                   \
  const c10::TypedOperatorHandle<decltype(fn)>& fn##_op() {                                   \
    static const auto h = c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<decltype(fn)>(); \
    return h;                                                                                 \
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

// --- autograd -----------------------------------------------------------------------------------

// What a grouped layer's backward node keeps: the saved tensors (version-checked as
// save_for_backward's), the module's id and flags, each linear layer's GradRule, and the caller's
// grad_input buffer (not saved: backward writes it).
class GroupedBackward : public torch::autograd::Node {
 public:
  GroupedBackward(int64_t layer, int64_t flags, std::vector<GradRule> rules, bool out_edge, OptTensor grad_input,
                  const std::vector<at::Tensor>& saved, at::TensorList params, at::TensorList main_grads)
      : layer_(layer), flags_(flags), rules_(std::move(rules)), out_edge_(out_edge),
        grad_input_(std::move(grad_input)) {
    for (const at::Tensor& t : saved) saved_.emplace_back(t, false);
    for (const at::Tensor& t : params) params_.emplace_back(t, false);
    for (const at::Tensor& t : main_grads) main_grads_.emplace_back(t, false);
  }

  void release_variables() override {
    for (torch::autograd::SavedVariable& v : saved_) v.reset_data();
    for (torch::autograd::SavedVariable& v : params_) v.reset_data();
    for (torch::autograd::SavedVariable& v : main_grads_) v.reset_data();
  }

 protected:
  static std::vector<at::Tensor> unpack(std::vector<torch::autograd::SavedVariable>& vs,
                                        const std::shared_ptr<Node>& self) {
    std::vector<at::Tensor> r;
    r.reserve(vs.size());
    for (torch::autograd::SavedVariable& v : vs) r.push_back(v.unpack(self));
    return r;
  }

  // The output's gradient as backward takes it: zeros where autograd gave none, exactly x's T
  // rows (a caller `out` may have more, or as few as S with host splits: the rows >= S of a
  // gradient are never read, the missing ones are zeros), the last dim contiguous.
  static at::Tensor dy_of(const at::Tensor& grad, const at::Tensor& x, int64_t out_features) {
    const int64_t T = x.size(0);
    if (!grad.defined()) return at::zeros({T, out_features}, x.options());
    at::Tensor dy = grad;
    if (dy.size(0) > T) dy = dy.narrow(0, 0, T);
    if (dy.size(0) < T) dy = at::cat({dy, dy.new_zeros({T - dy.size(0), dy.size(1)})});
    return dy.stride(-1) == 1 ? dy : dy.contiguous();
  }

  // dx as autograd takes it: the caller's buffer's first T rows (zeros below a buffer of fewer),
  // or the op's dx.
  at::Tensor dx_of(const at::Tensor& dx, const at::Tensor& x) const {
    if (!grad_input_.has_value()) return dx;
    const at::Tensor& b = *grad_input_;
    const int64_t T = x.size(0);
    if (b.size(0) > T) return b.narrow(0, 0, T);
    if (b.size(0) < T) return at::cat({b, b.new_zeros({T - b.size(0), b.size(1)})});
    return b;
  }

  // Layer i's weight then bias grads into `out`, from the op's (dw, db), under its GradRule: none,
  // the wgrad (packed, or unbound per group), or the cached dummy for every weight, which tells
  // Megatron through the weights' grad_added_to_main_grad that main_grad already holds the wgrad.
  void append_param_grads(variable_list& out, size_t i, const at::Tensor& dw, const at::Tensor& db,
                          const std::vector<at::Tensor>& params, size_t& at) const {
    const GradRule& r = rules_[i];
    const size_t first_weight = at;
    switch (r.disposition.weight) {
      case st::WeightGradKind::kNone:
        out.resize(out.size() + r.weights);
        break;
      case st::WeightGradKind::kWgrad:
        if (r.packed) {
          out.push_back(dw);
        } else {
          for (const at::Tensor& g : dw.unbind(0)) out.push_back(g);
        }
        break;
      case st::WeightGradKind::kDummy:
        out.insert(out.end(), r.weights, dw);
        mark_grad_added(params, first_weight, r.weights);
        break;
    }
    at += r.weights;
    if (r.biases && r.disposition.bias_grad_now) {
      if (r.packed) {
        out.push_back(db);
      } else {
        for (const at::Tensor& g : db.unbind(0)) out.push_back(g);
      }
    } else {
      out.resize(out.size() + r.biases);
    }
    at += r.biases;
  }

  // Whether this backward is the saved tensors' last reader: the graph is not retained, and the
  // call is plain eager (under tracing, a compiled graph's backward may be run again).
  static bool last_use(const std::vector<at::Tensor>& saved) {
    if (torch::autograd::get_current_graph_task_keep_graph()) return false;
    if (c10::impl::TorchDispatchModeTLS::stack_len() > 0) return false;
    for (const at::Tensor& t : saved)
      if (t.defined() && t.key_set().has_any(c10::python_ks)) return false;
    return true;
  }

  int64_t layer_, flags_;
  std::vector<GradRule> rules_;
  bool out_edge_;  // the first edge is a caller `out`'s old history (which gets no gradient)
  OptTensor grad_input_;
  std::vector<torch::autograd::SavedVariable> saved_, params_, main_grads_;

 private:
  static void mark_grad_added(const std::vector<at::Tensor>& params, size_t from, size_t n) {
    if (!Py_IsInitialized()) return;
    const pybind11::gil_scoped_acquire gil;
    for (size_t i = from; i < from + n; ++i) {
      PyObject* w = THPVariable_Wrap(params[i]);
      const int rc = w ? PyObject_SetAttrString(w, "grad_added_to_main_grad", Py_True) : -1;
      Py_XDECREF(w);
      if (rc != 0) {
        PyErr_Clear();
        TORCH_CHECK(false, "sparsetrain: could not set grad_added_to_main_grad on a weight");
      }
    }
  }
};

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
    if (grad_input_.has_value()) {
      std::tie(dw, db) =
          linear_backward_into_op().call(layer_, x, dy, splits, params, main_grads, flags_, *grad_input_, status);
    } else {
      std::tie(dx, dw, db) = linear_backward_op().call(layer_, x, dy, splits, params, main_grads, flags_, status);
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

// Whether autograd records a call whose differentiable inputs are `inputs` and `params`; forward-
// mode AD is refused (no forward derivative is defined).
bool recorded(std::initializer_list<const at::Tensor*> inputs, at::TensorList params, const char* what) {
  for (const at::Tensor* t : inputs)
    TORCH_CHECK(!t->_fw_grad(/*level=*/0).defined(), what, ": forward-mode AD is not supported");
  if (!at::GradMode::is_enabled()) return false;
  for (const at::Tensor* t : inputs)
    if (t->requires_grad()) return true;
  for (const at::Tensor& p : params)
    if (p.requires_grad()) return true;
  return false;
}

template <class Node, class Layer>
std::shared_ptr<Node> make_node(int64_t layer, int64_t flags, const OptTensor& out, const OptTensor& grad_input,
                                const std::vector<at::Tensor>& saved, at::TensorList params, at::TensorList main_grads,
                                const std::vector<at::Tensor>& inputs) {
  auto node = std::shared_ptr<Node>(
      new Node(layer, flags, Registry::get().find<Layer>(layer)->grad_rules(flags), out.has_value(), grad_input,
               saved, params, main_grads),
      torch::autograd::deleteNode);
  if (out.has_value()) {
    node->set_next_edges(torch::autograd::collect_next_edges(*out, at::TensorList(inputs), params));
  } else {
    node->set_next_edges(torch::autograd::collect_next_edges(at::TensorList(inputs), params));
  }
  return node;
}

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
    std::tie(y, fc1_out) = mlp_forward_op().call(layer, x, splits, probs, params, main_grads, flags, status, grad_input);
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

// Registers a module layer class: made with the module's id (and registered under it), its
// delayed-wgrad method and count.
template <class Layer, class... Args>
void register_layer(pybind11::module_& m, const char* name) {
  pybind11::class_<Layer, std::shared_ptr<Layer>>(m, name)
      .def(pybind11::init([](int64_t id, Args... args) {
        auto layer = std::make_shared<Layer>(args...);
        Registry::get().add(id, layer);
        layer->registered_as(id);
        return layer;
      }))
      .def("backward_dw",
           [](Layer& l, const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& main_grads,
              int64_t flags) { return l.backward_dw(params, main_grads, flags); })
      .def_property_readonly("pending_wgrads", &Layer::pending_wgrads);
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
    return linear_forward_op().call(layer, x, splits, params, main_grads, flags, status, grad_input);
  });
  m.def("grouped_linear_forward_into", [](int64_t layer, T x, T splits, Tensors params, Tensors main_grads,
                                          int64_t flags, T out, O status, O grad_input) {
    linear_forward_into_op().call(layer, x, splits, params, main_grads, flags, out, status, grad_input);
  });
  m.def("grouped_mlp_forward", [](int64_t layer, T x, T splits, T probs, Tensors params, Tensors main_grads,
                                  int64_t flags, O status, O grad_input) {
    return mlp_forward_op().call(layer, x, splits, probs, params, main_grads, flags, status, grad_input);
  });
  m.def("grouped_mlp_forward_into", [](int64_t layer, T x, T splits, T probs, Tensors params, Tensors main_grads,
                                       int64_t flags, T out, O status, O grad_input) {
    return mlp_forward_into_op().call(layer, x, splits, probs, params, main_grads, flags, out, status, grad_input);
  });
}

}  // namespace

// Imported by sparsetrain.torch after torch (whose libraries it links); importing it also
// registers the operators (this file's and torch_ops.cpp's).
PYBIND11_MODULE(_torch_ops, m) {
  st::torch_ops::register_attention(m);
  m.def("grad_accumulators_on_current_stream", &grad_accumulators_on_current_stream);
  register_layer<TorchGroupedLinear, int64_t, int64_t, int64_t, bool, bool, bool, bool, bool>(m, "GroupedLinear");
  register_layer<TorchGroupedMLP, int64_t, int64_t, int64_t, int64_t, int64_t, bool, bool, bool, bool, bool>(
      m, "GroupedMLP");
  register_entries(m);
}

// The operators (the library's TORCH_LIBRARY block is attention's, torch_ops.cpp). main_grads are
// written by the backward operators (wgrad accumulation); the forward ones only bind them.
TORCH_LIBRARY_FRAGMENT(sparsetrain, m) {
  m.def("grouped_linear_forward(int layer_id, Tensor x, Tensor splits, Tensor[] params, Tensor[] main_grads, "
        "int flags, Tensor? status=None, Tensor? grad_input=None) -> Tensor");
  m.def("grouped_linear_forward_into(int layer_id, Tensor x, Tensor splits, Tensor[] params, Tensor[] main_grads, "
        "int flags, Tensor(a!) out, Tensor? status=None, Tensor? grad_input=None) -> ()");
  m.def("grouped_linear_backward(int layer_id, Tensor x, Tensor dy, Tensor splits, Tensor[] params, "
        "Tensor(a!)[] main_grads, int flags, Tensor? status=None) -> (Tensor, Tensor, Tensor)");
  m.def("grouped_linear_backward_into(int layer_id, Tensor x, Tensor dy, Tensor splits, Tensor[] params, "
        "Tensor(a!)[] main_grads, int flags, Tensor(b!) grad_input, Tensor? status=None) -> (Tensor, Tensor)");
  m.def("grouped_mlp_forward(int layer_id, Tensor x, Tensor splits, Tensor probs, Tensor[] params, "
        "Tensor[] main_grads, int flags, Tensor? status=None, Tensor? grad_input=None) -> (Tensor, Tensor)");
  m.def("grouped_mlp_forward_into(int layer_id, Tensor x, Tensor splits, Tensor probs, Tensor[] params, "
        "Tensor[] main_grads, int flags, Tensor(a!) out, Tensor? status=None, Tensor? grad_input=None) -> Tensor");
  // last_use: the caller's promise that nothing reads fc1_out after this call (the node's, in an
  // eager backward that does not retain the graph): its gradient is then written over it.
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

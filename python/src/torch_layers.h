// What the C++ torch library's grouped-layer modules share (torch_grouped.cpp: GroupedLinear and
// GroupedMLP; torch_moe.cpp: the MoE layer): a module's C++ layer over the parameter tensors it
// passes with every call (rebuilt when one moved), the registry the operators find it in by the
// module's id, and the base of their autograd nodes (saved tensors, the output's gradient as the
// core takes it, the weight-grad rule applied to each linear layer's grads).
//
// A module passes, for each linear layer, its weights then its biases (`params`; one packed tensor
// or G of each), its main_grads (`main_grads`, with fusion), and `flags` (bit 0
// overwrite_main_grad, bit 1 + i: layer i's weights have Megatron's grad_added_to_main_grad).
#pragma once

#include <ATen/ATen.h>
#include <c10/core/impl/TorchDispatchModeTLS.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/graph_task.h>  // get_current_graph_task_keep_graph
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/autograd/saved_variable.h>
#include <torch/python.h>

#include <initializer_list>
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

namespace sparsetrain::torch_ops {

using OptTensor = std::optional<at::Tensor>;
using torch::autograd::variable_list;

// --- the module's parameters -------------------------------------------------------------------

// An operator's flags: bit 0 overwrite_main_grad, bit 1 + layer that layer's weights carry
// grad_added_to_main_grad, bit kFp8Bit the FP8 recipe (sparsetrain/torch/fp8.py sets it).
constexpr int kFp8Bit = 8;
inline bool overwrite_main_grad(int64_t flags) { return (flags & 1) != 0; }
inline bool has_grad_added_attr(int64_t flags, size_t layer) { return ((flags >> (1 + layer)) & 1) != 0; }
inline st::Fp8Recipe fp8_recipe(int64_t flags) {
  return ((flags >> kFp8Bit) & 1) != 0 ? st::Fp8Recipe::kBlockwise : st::Fp8Recipe::kOff;
}

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

inline st::GroupedParam grouped_param(at::TensorList ts, size_t& at, size_t n, bool packed, const std::string& name) {
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

inline st::Splits splits_of(const at::Tensor& splits, const OptTensor& status) {
  if (splits.is_cuda()) return st::Splits::device(view_of(splits, "splits"), view_of(status, "splits status"));
  return st::Splits::host(view_of(splits, "splits"));
}

// The call's stream and, for a backward that may queue a delayed wgrad, the tensors the queue
// entry refers to (held by the C++ layer's queue until backward_dw pops it). cache_dummy_wgrad:
// st::CallArgs' (eager_call() for a backward operator); weight_version: st::CallArgs' (the
// module layer's weight_version()).
inline st::CallArgs call_args(const at::Tensor& on, std::vector<at::Tensor> keep = {},
                              bool cache_dummy_wgrad = true, uint64_t weight_version = 0) {
  st::CallArgs a;
  a.stream = stream_of(on);
  if (!keep.empty()) a.keep_alive = std::make_shared<const std::vector<at::Tensor>>(std::move(keep));
  a.cache_dummy_wgrad = cache_dummy_wgrad;
  a.weight_version = weight_version;
  return a;
}

// Whether the operator call running on this thread comes from eager code: a module's C++ entry, or
// an eager autograd node (GroupedBackward::eager). Only such a call may leave the layer holding
// memory it made or hand it out (the cached dummy weight grad, FP8 weights quantized for later
// calls): a graph's calls (torch.compile, CUDA graph trees, whose warm-up runs in the graph's
// pool and which free a replay's outputs at the next one) must own all they allocate.
inline bool& eager_call() {
  thread_local bool on = false;
  return on;
}
// Marks the calls made in its scope as eager (or not), restoring the outer mark on exit.
class EagerCall {
 public:
  explicit EagerCall(bool on = true) : outer_(eager_call()) { eager_call() = on; }
  ~EagerCall() { eager_call() = outer_; }
  EagerCall(const EagerCall&) = delete;
  EagerCall& operator=(const EagerCall&) = delete;

 private:
  bool outer_;
};

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

  // Each fused linear layer's main_grad moved (the parameters did not): pointed at the new tensors
  // in place, so that the layer, its cached dummy wgrad and its pending delayed wgrads stay (under
  // torch.compile a backward may be handed a functional copy of main_grad on every call).
  virtual void set_main_grads(Layer& layer, const std::vector<st::GroupedParam>& main_grads) = 0;

  // The layer over the module's tensors and flags, made anew when they differ from the last call's.
  // The caller holds mutex_.
  Layer& bound(at::TensorList params, at::TensorList main_grads, int64_t flags) {
    size_t n_params = 0, n_main_grads = 0;
    for (const LinearLayout& l : layouts_) n_params += l.params(), n_main_grads += l.main_grads();
    ST_CHECK_ARG(params.size() == n_params, "params",
                 std::to_string(n_params) + " tensors (weights, biases of each layer)", params.size());
    ST_CHECK_ARG(main_grads.size() == n_main_grads, "main_grads",
                 std::to_string(n_main_grads) + " tensors (each layer's, with fuse_wgrad_accumulation)",
                 main_grads.size());
    if (layer_ && flags == flags_ && same(params, 0)) {
      if (!same(main_grads, params.size())) {
        std::vector<st::GroupedParam> moved;
        size_t at = 0;
        for (const LinearLayout& l : layouts_)
          if (l.fuse) moved.push_back(grouped_param(main_grads, at, l.per_param(), l.packed, "main_grad"));
        set_main_grads(*layer_, moved);  // may throw: the layer then keeps the old ones
        hold(params, main_grads, flags);
      }
      return *layer_;
    }
    if (layer_ && layer_->pending_wgrads())
      ST_FAIL(what_, ": parameters changed while ", layer_->pending_wgrads(),
              " delayed wgrad(s) are pending; call backward_dw() first");
    std::unique_ptr<Layer> fresh = make(params, main_grads, flags);  // may throw: the old layer then stays
    layer_ = std::move(fresh);
    hold(params, main_grads, flags);
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
    at::Tensor dw = w.kind == st::WeightGradKind::kNone ? at::empty({0}, like.options())
                                                        : alloc_.take(w.packed.defined() ? w.packed : w.per_group[0]);
    return {dw, bias_grad.defined() ? alloc_.take(bias_grad) : at::empty({0}, like.options())};
  }

  // A module of two linear layers (GroupedMLP, the MoE layer's experts): fc1's and fc2's
  // parameters, their names prefixed in errors.
  st::GroupedMLPParams mlp_params(at::TensorList params, at::TensorList main_grads, int64_t flags,
                                  const std::string& prefix) const {
    size_t at = 0, mg_at = 0;
    st::GroupedMLPParams p;
    p.fc1 = layer_params(params, at, main_grads, mg_at, 0, flags, prefix + "fc1.");
    p.fc2 = layer_params(params, at, main_grads, mg_at, 1, flags, prefix + "fc2.");
    return p;
  }

  // Such a module's oldest pending delayed wgrads: (fc1's dw, db, fc2's dw, db).
  std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> mlp_backward_dw(at::TensorList params,
                                                                             at::TensorList main_grads, int64_t flags) {
    return translated([&] {
      const std::lock_guard<std::mutex> lock(mutex_);
      const st::GroupedMLPGrads g = bound(params, main_grads, flags).backward_dw(call_args(first_param()));
      return mlp_grads(g.fc1, g.fc2, first_param());
    });
  }

  // Such a module's weight and bias grads, fc1's then fc2's, as layer_grads gives each layer's.
  std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> mlp_grads(const st::GroupedMLPLayerGrads& fc1,
                                                                       const st::GroupedMLPLayerGrads& fc2,
                                                                       const at::Tensor& like) const {
    return std::tuple_cat(layer_grads(fc1.weight, fc1.bias_grad, like), layer_grads(fc2.weight, fc2.bias_grad, like));
  }

  // st::CallArgs::weight_version of a call over `params`: a number that changes exactly when a
  // parameter's storage or version counter does (an optimizer's in-place step bumps it), so that
  // FP8 weights are quantized once a version; 0, nothing reused or kept, without FP8 in `flags`
  // (no host work then), for a call that is not eager (eager_call), while the stream is being
  // captured (a graph's replays must quantize the weights they find) or for inference tensors (no
  // version counter). The caller holds mutex_.
  uint64_t weight_version(at::TensorList params, int64_t flags) {
    if (fp8_recipe(flags) == st::Fp8Recipe::kOff || !eager_call()) return 0;
    std::vector<std::pair<const void*, int64_t>> now;
    for (const at::Tensor& p : params) {
      if (p.is_inference()) return 0;
      now.emplace_back(p.data_ptr(), int64_t(p._version()));
    }
#ifdef SPARSETRAIN_TORCH_CUDA
    if (!params.empty() && params[0].is_cuda() &&
        c10::cuda::currentStreamCaptureStatusMayInitCtx() != c10::cuda::CaptureStatus::None)
      return 0;
#endif
    if (now != versions_seen_) {
      versions_seen_ = std::move(now);
      ++weight_version_;
    }
    return weight_version_;
  }

  // The device the layer computes on (its first parameter's), for calls without activations.
  const at::Tensor& first_param() const { return held_.at(0); }

  std::mutex mutex_;
  TorchAllocator alloc_;  // declared before layer_: the layer's cached tensors are returned to it
  std::vector<std::pair<const void*, int64_t>> versions_seen_;  // weight_version()'s last parameters
  uint64_t weight_version_ = 0;

 private:
  void hold(at::TensorList params, at::TensorList main_grads, int64_t flags) {
    held_.assign(params.begin(), params.end());
    held_.insert(held_.end(), main_grads.begin(), main_grads.end());
    placements_.clear();
    for (const at::Tensor& t : held_) placements_.emplace_back(t);
    flags_ = flags;
  }

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

  // Whether the node runs in plain eager mode, not traced (make_fx, AOT autograd under
  // torch.compile: the backward operator's call then becomes part of a graph run again later).
  static bool eager(const std::vector<at::Tensor>& saved) {
    if (c10::impl::TorchDispatchModeTLS::stack_len() > 0) return false;
    for (const at::Tensor& t : saved)
      if (t.defined() && t.key_set().has_any(c10::python_ks)) return false;
    return true;
  }

  // Whether this backward is the saved tensors' last reader: eager, and the graph not retained.
  static bool last_use(const std::vector<at::Tensor>& saved) {
    return eager(saved) && !torch::autograd::get_current_graph_task_keep_graph();
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

// Whether autograd records a call whose differentiable inputs are `inputs` and `params`; forward-
// mode AD is refused (no forward derivative is defined).
inline bool recorded(std::initializer_list<const at::Tensor*> inputs, at::TensorList params, const char* what) {
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

}  // namespace sparsetrain::torch_ops

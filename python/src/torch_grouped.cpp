// GroupedLinear and GroupedMLP for torch (the classes of the Python module sparsetrain._torch_ops,
// the library that also registers attention's torch operators), the eager path of
// sparsetrain.torch's modules: at::Tensor arguments become views, outputs come from torch's
// caching allocator on the current stream and go back as tensors over that memory, with no Python
// per allocation or result (the `_C` path calls back into Python for both). Plain pybind11 methods
// with torch's tensor caster, neither dispatcher ops nor torch.classes: they are called only from
// the implementations of the Python custom ops (sparsetrain::grouped_linear_*, grouped_mlp_*),
// which torch.compile and dispatch modes trace, and a call costs ~1 us against ~5 us for a
// torch.classes method (~7 against ~20 us with 128 parameter tensors).
//
// A module passes its parameter tensors with every call: for each linear layer its weights, then
// its biases (with bias), then its main_grads (with fusion), one packed tensor or G of each; and
// the flags [overwrite_main_grad, has_grad_added_to_main_grad of each layer]. The C++ layer holds
// views of them, so it is rebuilt when one moved (another tensor, `.data =`, `.to()`: address,
// shape, strides, dtype or device) or a flag changed, never while delayed wgrads are pending.
#include <ATen/DeviceAccelerator.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/graph_task.h>  // get_current_graph_task_keep_graph
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/saved_variable.h>
#include <torch/python.h>

#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "sparsetrain/error.h"
#include "sparsetrain/grouped_linear.h"
#include "sparsetrain/grouped_mlp.h"
#include "torch_common.h"

namespace st = sparsetrain;

namespace {

using namespace st::torch_ops;  // NOLINT(google-build-using-namespace): this file's toolbox
using OptTensor = std::optional<at::Tensor>;

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

// How one linear layer's parameters sit in a module's list.
struct LinearLayout {
  int64_t num_groups;
  bool packed, bias, fuse;
  size_t per_param() const { return packed ? 1 : size_t(num_groups); }
  size_t count() const { return per_param() * (1 + size_t(bias) + size_t(fuse)); }
};

st::GroupedParam grouped_param(const std::vector<at::Tensor>& ts, size_t& at, size_t n, bool packed,
                               const std::string& name) {
  std::vector<st::TensorView> views;
  for (size_t i = 0; i < n; ++i) views.push_back(view_of(ts[at++], name.c_str()));
  return packed ? st::GroupedParam::packed(views[0]) : st::GroupedParam::per_group(std::move(views));
}

// One layer's parameters from the module's list, from `at` on (moved past them).
st::GroupedLinearParams linear_params(const std::vector<at::Tensor>& ts, size_t& at, const LinearLayout& l,
                                      bool has_attr, const std::string& prefix) {
  st::GroupedLinearParams p;
  const size_t n = l.per_param();
  p.weight = grouped_param(ts, at, n, l.packed, prefix + "weight");
  if (l.bias) p.bias = grouped_param(ts, at, n, l.packed, prefix + "bias");
  if (l.fuse) p.main_grad = grouped_param(ts, at, n, l.packed, prefix + "main_grad");
  p.has_grad_added_to_main_grad = has_attr;
  return p;
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

// The C++ layer of a module over the parameters it passed last (see the top of the file).
template <class Layer>
class ModuleLayer {
 public:
  virtual ~ModuleLayer() = default;
  int64_t pending_wgrads() const { return layer_ ? int64_t(layer_->pending_wgrads()) : 0; }

 protected:
  ModuleLayer(const char* what, std::vector<LinearLayout> layouts) : what_(what), layouts_(std::move(layouts)) {}

  // A layer over `params` and `flags` (checked in number).
  virtual std::unique_ptr<Layer> make(const std::vector<at::Tensor>& params, const std::vector<bool>& flags) = 0;

  // The layer over `params` and `flags`, made anew when they differ from the last call's.
  Layer& bound(const std::vector<at::Tensor>& params, const std::vector<bool>& flags) {
    size_t expected = 0;
    for (const LinearLayout& l : layouts_) expected += l.count();
    ST_CHECK_ARG(params.size() == expected, "params",
                 std::to_string(expected) + " tensors (weights, biases, main_grads of each layer)", params.size());
    ST_CHECK_ARG(flags.size() == 1 + layouts_.size(), "flags",
                 "overwrite_main_grad and has_grad_added_to_main_grad of each layer", flags.size());
    if (layer_ && flags == flags_ && same(params)) return *layer_;
    if (layer_ && layer_->pending_wgrads())
      ST_FAIL(what_, ": parameters or main_grad changed while ", layer_->pending_wgrads(),
              " delayed wgrad(s) are pending; call backward_dw() first");
    std::unique_ptr<Layer> fresh = make(params, flags);  // may throw: the old layer then stays
    layer_ = std::move(fresh);
    params_ = params;
    placements_.clear();
    for (const at::Tensor& t : params) placements_.emplace_back(t);
    flags_ = flags;
    return *layer_;
  }

  // What a forward starts with: the layer, x and the splits; grad_input, the buffer backward will
  // write, checked now (before anything runs).
  struct Forward {
    Layer& layer;
    st::TensorView x;
    st::Splits splits;
  };
  Forward begin_forward(const at::Tensor& x, const at::Tensor& splits, const OptTensor& status,
                        const OptTensor& grad_input, const std::vector<at::Tensor>& params,
                        const std::vector<bool>& flags) {
    Forward f{bound(params, flags), view_of(x, "x"), splits_of(splits, status)};
    if (grad_input.has_value()) f.layer.check_grad_input(f.x, f.splits, view_of(grad_input, "grad_input"));
    return f;
  }

  st::GroupedLinearParams layer_params(const std::vector<at::Tensor>& params, size_t& at, size_t layer,
                                       const std::vector<bool>& flags, const std::string& prefix) const {
    return linear_params(params, at, layouts_[layer], flags[1 + layer], prefix);
  }

  // One layer's weight grad and bias grad as tensors, an empty tensor (`like`'s dtype) for none:
  // the packed wgrad, or the dummy (packed, or the one [out, in] tensor of per-group weights). Two
  // nones are two tensors: a custom op's outputs may not alias each other (torch checks it on every
  // call through the dispatcher: torch.compile, dispatch modes; delayed wgrad returns both none).
  std::tuple<at::Tensor, at::Tensor> layer_grads(const st::WeightGrad& w, const st::Tensor& bias_grad,
                                                 const at::Tensor& like) const {
    at::Tensor dw = w.kind == st::WeightGradKind::kNone
                        ? at::empty({0}, like.options())
                        : alloc_.take(w.packed.defined() ? w.packed : w.per_group[0]);
    return {dw, bias_grad.defined() ? alloc_.take(bias_grad) : at::empty({0}, like.options())};
  }

  // The device the layer computes on (its first parameter's), for calls without activations.
  const at::Tensor& first_param() const { return params_.at(0); }

  TorchAllocator alloc_;  // declared before layer_: the layer's cached tensors are returned to it

 private:
  bool same(const std::vector<at::Tensor>& params) const {
    for (size_t i = 0; i < params.size(); ++i)
      if (!(Placement(params[i]) == placements_[i])) return false;
    return true;
  }

  const char* what_;
  std::vector<LinearLayout> layouts_;
  std::vector<at::Tensor> params_;  // keeps what the layer views alive
  std::vector<Placement> placements_;  // theirs when the layer was made
  std::vector<bool> flags_;
  std::unique_ptr<Layer> layer_;
};

class TorchGroupedLinear final : public ModuleLayer<st::GroupedLinear> {
 public:
  TorchGroupedLinear(int64_t num_groups, int64_t in_features, int64_t out_features, bool packed, bool bias,
                     bool fuse_wgrad_accumulation, bool delay_wgrad_compute, bool check_device_splits)
      : ModuleLayer("GroupedLinear", {{num_groups, packed, bias, fuse_wgrad_accumulation}}),
        o_(module_options<st::GroupedLinearOptions>(num_groups, fuse_wgrad_accumulation, delay_wgrad_compute,
                                                    check_device_splits)) {
    o_.in_features = in_features;
    o_.out_features = out_features;
  }

  // y (the caller's `out` when given). grad_input: the buffer backward will write, checked now.
  at::Tensor forward(const at::Tensor& x, const at::Tensor& splits, const OptTensor& status, const OptTensor& out,
                     const OptTensor& grad_input, const std::vector<at::Tensor>& params,
                     const std::vector<bool>& flags) {
    return translated([&] {
      Forward f = begin_forward(x, splits, status, grad_input, params, flags);
      return alloc_.take(f.layer.forward(f.x, f.splits, view_of(out, "out"), call_args(x)), out);
    });
  }

  // (dx, dw, db): dx is the caller's grad_input when given; dw the packed wgrad or the dummy, db
  // [G, out], each an empty tensor where the weight-grad rule gives none.
  std::tuple<at::Tensor, at::Tensor, at::Tensor> backward(const at::Tensor& x, const at::Tensor& dy,
                                                          const at::Tensor& splits, const OptTensor& status,
                                                          const OptTensor& grad_input,
                                                          const std::vector<at::Tensor>& params,
                                                          const std::vector<bool>& flags) {
    return translated([&] {
      st::GroupedLinear& l = bound(params, flags);
      const st::GroupedLinearGrads g =
          l.backward(view_of(x, "x"), view_of(dy, "dy"), splits_of(splits, status), view_of(grad_input, "grad_input"),
                     call_args(x, {x, dy, splits, status.value_or(at::Tensor())}));
      auto [dw, db] = layer_grads(g.weight, g.bias_grad, x);
      return std::make_tuple(alloc_.take(g.grad_input, grad_input), dw, db);
    });
  }

  // The oldest pending delayed wgrad: (dw, db) as backward's.
  std::tuple<at::Tensor, at::Tensor> backward_dw(const std::vector<at::Tensor>& params, const std::vector<bool>& flags) {
    return translated([&] {
      st::GroupedLinear& l = bound(params, flags);
      const st::GroupedLinearGrads g = l.backward_dw(call_args(first_param()));
      return layer_grads(g.weight, g.bias_grad, first_param());
    });
  }

 private:
  std::unique_ptr<st::GroupedLinear> make(const std::vector<at::Tensor>& params,
                                          const std::vector<bool>& flags) override {
    size_t at = 0;
    const st::GroupedLinearParams p = layer_params(params, at, 0, flags, "");
    st::GroupedLinearOptions o = o_;
    o.dtype = p.weight.views()[0].dtype();
    o.overwrite_main_grad = flags[0];
    return std::make_unique<st::GroupedLinear>(o, p, &alloc_);
  }

  st::GroupedLinearOptions o_;  // all but dtype and overwrite_main_grad, which come with the parameters
};

class TorchGroupedMLP final : public ModuleLayer<st::GroupedMLP> {
 public:
  TorchGroupedMLP(int64_t num_groups, int64_t in_features, int64_t ffn_features, int64_t out_features,
                  int64_t glu_interleave_size, bool packed, bool bias, bool fuse_wgrad_accumulation,
                  bool delay_wgrad_compute, bool check_device_splits)
      : ModuleLayer("GroupedMLP", {{num_groups, packed, bias, fuse_wgrad_accumulation},
                                   {num_groups, packed, bias, fuse_wgrad_accumulation}}),
        o_(module_options<st::GroupedMLPOptions>(num_groups, fuse_wgrad_accumulation, delay_wgrad_compute,
                                                 check_device_splits)) {
    o_.in_features = in_features;
    o_.ffn_features = ffn_features;
    o_.out_features = out_features;
    o_.glu_interleave_size = glu_interleave_size;
  }

  // (y, fc1_out): y is the caller's `out` when given.
  std::tuple<at::Tensor, at::Tensor> forward(const at::Tensor& x, const at::Tensor& splits, const OptTensor& status,
                                             const at::Tensor& probs, const OptTensor& out,
                                             const OptTensor& grad_input, const std::vector<at::Tensor>& params,
                                             const std::vector<bool>& flags) {
    return translated([&] {
      Forward f = begin_forward(x, splits, status, grad_input, params, flags);
      const st::GroupedMLPForward r =
          f.layer.forward(f.x, f.splits, view_of(probs, "probs"), view_of(out, "out"), call_args(x));
      return std::make_tuple(alloc_.take(r.out, out), alloc_.take(r.fc1_out));
    });
  }

  // (dx, dprobs, fc1's dw, db, fc2's dw, db), as GroupedLinear's backward. last_use: no backward
  // will read fc1_out again (st::Fc1OutUse::kReuse: its gradient is written over it).
  std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> backward(
      const at::Tensor& x, const at::Tensor& fc1_out, const at::Tensor& probs, const at::Tensor& dy,
      const at::Tensor& splits, const OptTensor& status, const OptTensor& grad_input, bool last_use,
      const std::vector<at::Tensor>& params, const std::vector<bool>& flags) {
    return translated([&] {
      st::GroupedMLP& m = bound(params, flags);
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
  std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> backward_dw(const std::vector<at::Tensor>& params,
                                                                         const std::vector<bool>& flags) {
    return translated([&] {
      st::GroupedMLP& m = bound(params, flags);
      const st::GroupedMLPGrads g = m.backward_dw(call_args(first_param()));
      return std::tuple_cat(layer_grads(g.fc1.weight, g.fc1.bias_grad, first_param()),
                            layer_grads(g.fc2.weight, g.fc2.bias_grad, first_param()));
    });
  }

 private:
  std::unique_ptr<st::GroupedMLP> make(const std::vector<at::Tensor>& params, const std::vector<bool>& flags) override {
    size_t at = 0;
    st::GroupedMLPParams p;
    p.fc1 = layer_params(params, at, 0, flags, "fc1.");
    p.fc2 = layer_params(params, at, 1, flags, "fc2.");
    st::GroupedMLPOptions o = o_;
    o.dtype = p.fc1.weight.views()[0].dtype();
    o.overwrite_main_grad = flags[0];
    return std::make_unique<st::GroupedMLP>(o, p, &alloc_);
  }

  st::GroupedMLPOptions o_;  // all but dtype and overwrite_main_grad, which come with the parameters
};

// A node of autograd's graph whose backward is a Python function: the modules' eager forwards
// record it instead of going through Python's autograd.Function.apply (~18 us a call with 4
// experts, ~200 us with 64: apply walks every parameter in Python), while their backward stays the
// Python code it was (sparsetrain.torch's: the weight-grad rule, grad_input, the module's current
// parameters). Saved tensors are version-checked as save_for_backward's.
class PythonBackward final : public torch::autograd::Node {
 public:
  PythonBackward(pybind11::object fn, const std::vector<at::Tensor>& saved) : fn_(std::move(fn)) {
    for (const at::Tensor& t : saved) saved_.emplace_back(t, false);
  }
  ~PythonBackward() override {
    if (Py_IsInitialized()) {
      pybind11::gil_scoped_acquire gil;
      fn_ = pybind11::object();
    } else {
      fn_.release();  // no interpreter left to hand it back to
    }
  }
  std::string name() const override { return "sparsetrain::PythonBackward"; }

  // fn(saved tensors, output grad or None, last use) -> one grad (or None) per recorded input.
  // Last use: the graph is not retained, so no other backward reads the saved tensors (a backward
  // may then write over an intermediate it saved; the engine frees them right after anyway).
  torch::autograd::variable_list apply(torch::autograd::variable_list&& grads) override {
    std::vector<at::Tensor> saved;
    for (torch::autograd::SavedVariable& v : saved_) saved.push_back(v.unpack(shared_from_this()));
    const bool last_use = !torch::autograd::get_current_graph_task_keep_graph();
    pybind11::gil_scoped_acquire gil;
    try {
      const pybind11::object r =
          fn_(saved, grads.at(0).defined() ? pybind11::cast(grads[0]) : pybind11::none(), last_use);
      torch::autograd::variable_list out;
      for (pybind11::handle h : r) out.push_back(h.is_none() ? at::Tensor() : h.cast<at::Tensor>());
      TORCH_CHECK(out.size() == num_outputs(), "sparsetrain: a backward returned ", out.size(),
                  " gradients, expected ", num_outputs());
      return out;
    } catch (pybind11::error_already_set& e) {
      e.restore();  // as torch's own Python nodes: the Python exception crosses the engine as it is
      python_error err;
      err.persist();
      throw err;
    }
  }

  void release_variables() override {
    for (torch::autograd::SavedVariable& v : saved_) v.reset_data();
  }

 private:
  pybind11::object fn_;
  std::vector<torch::autograd::SavedVariable> saved_;
};

// Makes `y` (a fresh tensor from this library) the output of a PythonBackward node over `inputs`
// that saves `saved` and runs `backward`, where an input requires grad and grad mode is on.
void record(const at::Tensor& y, const std::vector<at::Tensor>& inputs, const std::vector<at::Tensor>& saved,
            pybind11::object backward) {
  if (!torch::autograd::compute_requires_grad(inputs)) return;
  TORCH_CHECK(!y.requires_grad(), "sparsetrain: record() takes an output that does not require grad yet");
  auto node = std::shared_ptr<PythonBackward>(new PythonBackward(std::move(backward), saved),
                                              torch::autograd::deleteNode);
  node->set_next_edges(torch::autograd::collect_next_edges(inputs));
  torch::autograd::set_history(y, node);
}

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

// Registers a module layer class with its constructor `Init` and its methods.
template <class Layer, class Init>
void register_layer(pybind11::module_& m, const char* name, Init init) {
  pybind11::class_<Layer>(m, name)
      .def(init)
      .def("forward", &Layer::forward)
      .def("backward", &Layer::backward)
      .def("backward_dw", &Layer::backward_dw)
      .def_property_readonly("pending_wgrads", &Layer::pending_wgrads);
}

}  // namespace

// Imported by sparsetrain.torch after torch (whose libraries it links); importing it also
// registers attention's operators (torch_ops.cpp), whose eager entry it also holds.
PYBIND11_MODULE(_torch_ops, m) {
  st::torch_ops::register_attention(m);
  m.def("record", &record);
  m.def("grad_accumulators_on_current_stream", &grad_accumulators_on_current_stream);
  register_layer<TorchGroupedLinear>(m, "GroupedLinear",
                                     pybind11::init<int64_t, int64_t, int64_t, bool, bool, bool, bool, bool>());
  register_layer<TorchGroupedMLP>(
      m, "GroupedMLP", pybind11::init<int64_t, int64_t, int64_t, int64_t, int64_t, bool, bool, bool, bool, bool>());
}

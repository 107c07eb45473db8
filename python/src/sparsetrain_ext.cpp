// sparsetrain._C: the C++ API over DLPack arrays (numpy, torch, any producer), zero-copy.
// Inputs become TensorViews of the callers' memory. Memory the library allocates comes from a
// Python allocator callback (numpy.empty / torch.empty on the current stream), and results go
// back as views of those Python objects, never as arrays built from raw pointers: the framework
// keeps tracking their streams and lifetimes. sparsetrain::Error maps to ValueError (bad argument)
// or RuntimeError, with the C++ message.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "sparsetrain/attention.h"
#include "sparsetrain/block_mask.h"
#include "sparsetrain/cu_seqlens.h"
#include "sparsetrain/error.h"
#include "sparsetrain/grouped_linear.h"
#include "sparsetrain/grouped_mlp.h"
#include "sparsetrain/moe_layer.h"
#include "sparsetrain/moe_router.h"
#include "sparsetrain/runtime.h"
#include "mask_options.h"
#include "mask_wire.h"
#include "router_options.h"

namespace nb = nanobind;
namespace st = sparsetrain;

namespace {

using Array = nb::ndarray<nb::ro>;  // inputs: read-only producers are fine
using WritableArray = nb::ndarray<>;  // outputs: a read-only array is refused, never written

// A dtype by the library's name (the torch front's descriptors carry names: fp64 too, so that the
// op's own check refuses it); the long float names are taken as well.
st::DType parse_dtype(const std::string& s, const char* arg) {
  for (st::DType t : st::kAllDTypes)
    if (s == st::dtype_name(t)) return t;
  if (s == "bfloat16") return st::DType::kBF16;
  if (s == "float16") return st::DType::kFP16;
  if (s == "float32") return st::DType::kFP32;
  st::detail::throw_arg_error(arg, "a dtype the library can view (bf16, fp16, fp32, int32, int64, uint8, ...)", s);
}

// DLPack's type codes as the library's element kinds (nanobind names them).
bool element_kind_of(uint8_t code, st::ElementKind& kind) {
  using Code = nb::dlpack::dtype_code;
  switch (Code(code)) {
    case Code::Int: kind = st::ElementKind::kInt; return true;
    case Code::UInt: kind = st::ElementKind::kUInt; return true;
    case Code::Float: kind = st::ElementKind::kFloat; return true;
    case Code::Bfloat: kind = st::ElementKind::kBFloat; return true;
    case Code::Complex: kind = st::ElementKind::kComplex; return true;
    case Code::Bool: kind = st::ElementKind::kBool; return true;
    default: return false;
  }
}

enum class Access { kRead, kWrite };

// A torch tensor described by the Python front as ("torch", data_ptr, dtype, shape, strides,
// device_type, device_index). Torch tensors skip DLPack: torch's __dlpack__ synchronises streams,
// which is not allowed while a CUDA graph is being captured. This only reads torch's metadata;
// the tensor stays torch's.
st::TensorView torch_view(const nb::tuple& t, const char* arg) {
  ST_CHECK_ARG(t.size() == 7, arg, "a torch tensor descriptor of 7 fields", t.size(), " fields");
  const auto shape = nb::cast<std::vector<int64_t>>(t[3]);
  const auto strides = nb::cast<std::vector<int64_t>>(t[4]);
  ST_CHECK_ARG(!shape.empty() && shape.size() <= size_t(st::TensorView::kMaxDims) && shape.size() == strides.size(),
               arg, "1 to 5 dimensions", shape.size());
  const std::string dev = nb::cast<std::string>(t[5]);
  ST_CHECK_ARG(dev == "cpu" || dev == "cuda", arg, "a tensor on the CPU or a CUDA device", dev);
  const st::Device device = dev == "cpu" ? st::Device::cpu() : st::Device::cuda(nb::cast<int>(t[6]));
  return st::TensorView(reinterpret_cast<void*>(nb::cast<uintptr_t>(t[1])), parse_dtype(nb::cast<std::string>(t[2]), arg),
                        shape.data(), strides.data(), int(shape.size()), device);
}

// A Python object (an array, or a tuple (array_of_uint16, "bf16"|"fp16") for 16-bit float
// types the producer cannot describe, such as numpy arrays of ml_dtypes.bfloat16) as a view.
// Arrays the library writes (Access::kWrite) must be writable.
st::TensorView view_of(nb::handle obj, const char* arg, Access access = Access::kRead) {
  nb::handle arr = obj;
  std::string dtype_override;
  if (nb::isinstance<nb::tuple>(obj) && nb::len(obj) == 7) return torch_view(nb::borrow<nb::tuple>(obj), arg);
  if (nb::isinstance<nb::tuple>(obj)) {
    nb::tuple t = nb::borrow<nb::tuple>(obj);
    ST_CHECK_ARG(t.size() == 2, arg, "an array or a tuple (array, dtype)", "a tuple of ", t.size());
    arr = t[0];
    dtype_override = nb::cast<std::string>(t[1]);
  }
  Array a;
  if (!nb::try_cast(arr, a, false))
    ST_CHECK_ARG(false, arg, "an array supporting DLPack or the buffer protocol",
                 nb::cast<std::string>(nb::str(arr.type())));
  if (access == Access::kWrite) {
    WritableArray w;
    ST_CHECK_ARG(nb::try_cast(arr, w, false), arg, "a writable array (the library writes it)",
                 "a read-only array");
  }
  ST_CHECK_ARG(a.ndim() >= 1 && a.ndim() <= size_t(st::TensorView::kMaxDims), arg, "1 to 5 dimensions", a.ndim());
  const nb::dlpack::dtype dt = a.dtype();
  st::DType dtype;
  if (!dtype_override.empty()) {
    ST_CHECK_ARG(dt.bits == 16, arg, "a 16-bit array for dtype " + dtype_override, int(dt.bits), "-bit elements");
    dtype = parse_dtype(dtype_override, arg);
  } else {
    st::ElementKind kind{};
    ST_CHECK_ARG(element_kind_of(dt.code, kind) && st::dtype_of_element(kind, int(dt.bits), dtype), arg,
                 "a dtype the library can view (bf16, fp16, fp32, int32, int64, uint8, ...)", "DLPack type code ",
                 int(dt.code), " with ", int(dt.bits), " bits");
  }
  st::Device device;
  if (a.device_type() == nb::device::cpu::value) {
    device = st::Device::cpu();
  } else if (a.device_type() == nb::device::cuda::value) {
    device = st::Device::cuda(int(a.device_id()));
  } else {
    ST_CHECK_ARG(false, arg, "memory on the CPU or a CUDA device", "DLPack device type ", a.device_type());
  }
  int64_t shape[st::TensorView::kMaxDims], strides[st::TensorView::kMaxDims];
  for (size_t i = 0; i < a.ndim(); ++i) {
    shape[i] = int64_t(a.shape(i));
    strides[i] = int64_t(a.stride(i));
  }
  return st::TensorView(const_cast<void*>(a.data()), dtype, shape, strides, int(a.ndim()), device);
}

st::TensorView optional_view(nb::handle obj, const char* arg, Access access = Access::kRead) {
  return obj.is_none() ? st::TensorView() : view_of(obj, arg, access);
}

// Allocations through a Python callable factory(nbytes, device_type, device_index, stream) ->
// (owner, address): the owner (numpy or torch array) keeps the memory; address is 256-aligned.
class PyAllocator final : public st::Allocator {
 public:
  explicit PyAllocator(nb::callable factory) : factory_(std::move(factory)) {}
  void* allocate(size_t bytes, st::Device device, st::Stream stream) override {
    nb::tuple r = nb::cast<nb::tuple>(factory_(bytes, device.is_cpu() ? "cpu" : "cuda", device.index,
                                               reinterpret_cast<uintptr_t>(stream.handle)));
    void* p = reinterpret_cast<void*>(nb::cast<uintptr_t>(r[1]));
    live_[p] = {nb::borrow<nb::object>(r[0]), bytes};
    return p;
  }
  void deallocate(void* p, size_t, st::Device, st::Stream) override { live_.erase(p); }

  // The owner of the allocation holding `p` and the address it started at.
  std::pair<nb::object, uintptr_t> owner_of(const void* p) const {
    auto it = live_.upper_bound(const_cast<void*>(p));
    if (it == live_.begin()) ST_FAIL("internal: no allocation holds address ", p);
    --it;
    return {it->second.owner, reinterpret_cast<uintptr_t>(it->first)};
  }

 private:
  struct Allocation {
    nb::object owner;
    size_t bytes;
  };
  nb::callable factory_;
  std::map<void*, Allocation> live_;
};

// A tensor the library allocated, for Python to view: (owner, byte offset into the owner's
// allocation start, dtype, shape, strides). None for a borrowed caller buffer.
nb::object export_tensor(const st::Tensor& t, const PyAllocator& alloc) {
  if (!t.defined() || !t.owns_storage()) return nb::none();
  const st::TensorView& v = t.view();
  auto [owner, base] = alloc.owner_of(v.data());
  std::vector<int64_t> shape(v.shape(), v.shape() + v.dim()), strides(v.strides(), v.strides() + v.dim());
  return nb::make_tuple(owner, reinterpret_cast<uintptr_t>(v.data()) - base, st::dtype_name(v.dtype()),
                        nb::cast(shape), nb::cast(strides));
}

st::GroupedParam grouped_param(nb::handle obj, const std::string& arg, Access access = Access::kRead) {
  if (obj.is_none()) return {};
  if (nb::isinstance<nb::list>(obj)) {
    std::vector<st::TensorView> views;
    for (nb::handle h : nb::borrow<nb::list>(obj)) views.push_back(view_of(h, arg.c_str(), access));
    return st::GroupedParam::per_group(views);
  }
  return st::GroupedParam::packed(view_of(obj, arg.c_str(), access));
}

// One GroupedLinear's parameters; `prefix` names them in errors ("fc1." inside a GroupedMLP).
st::GroupedLinearParams linear_params(nb::handle weight, nb::handle bias, nb::handle main_grad,
                                      bool has_grad_added_to_main_grad, const std::string& prefix = "") {
  st::GroupedLinearParams p;
  p.weight = grouped_param(weight, prefix + "weight");
  p.bias = grouped_param(bias, prefix + "bias");
  p.main_grad = grouped_param(main_grad, prefix + "main_grad", Access::kWrite);
  p.has_grad_added_to_main_grad = has_grad_added_to_main_grad;
  return p;
}

// Splits from Python: a list of ints or a host array (host splits), or ("device", array[, status]).
struct PySplits {
  st::Splits splits;
  nb::object keep;  // the arrays device splits refer to
};

PySplits make_splits(nb::handle obj) {
  PySplits s;
  if (nb::isinstance<nb::tuple>(obj) && nb::len(obj) >= 2 && nb::isinstance<nb::str>(nb::borrow<nb::tuple>(obj)[0]) &&
      nb::cast<std::string>(nb::borrow<nb::tuple>(obj)[0]) == "device") {
    nb::tuple t = nb::borrow<nb::tuple>(obj);
    s.splits = st::Splits::device(view_of(t[1], "splits"),
                                  t.size() > 2 ? optional_view(t[2], "splits status", Access::kWrite)
                                               : st::TensorView());
    s.keep = nb::borrow<nb::object>(obj);
    return s;
  }
  if (nb::isinstance<nb::list>(obj)) {
    s.splits = st::Splits::host(nb::cast<std::vector<int64_t>>(obj));
    return s;
  }
  s.splits = st::Splits::host(view_of(obj, "splits"));
  return s;
}

st::CallArgs call_args(uintptr_t stream, nb::handle workspace, nb::handle keep = nb::handle()) {
  st::CallArgs a;
  // The arrays a delayed wgrad refers to ride in the layer's own queue (CallArgs::keep_alive):
  // the reference is dropped, under the GIL, when backward_dw pops the entry or the layer dies.
  if (keep.is_valid() && !keep.is_none())
    a.keep_alive = std::shared_ptr<const void>(new nb::object(nb::borrow(keep)), [](const void* o) {
      nb::gil_scoped_acquire gil;
      delete static_cast<const nb::object*>(o);
    });
  a.stream.handle = reinterpret_cast<void*>(stream);
  if (nb::isinstance<nb::tuple>(workspace)) {  // a torch tensor descriptor
    const st::TensorView w = view_of(workspace, "workspace");
    a.workspace = {w.data(), size_t(w.numel()) * w.element_size()};
  } else if (!workspace.is_none()) {  // any writable contiguous array: only its bytes matter
    nb::ndarray<nb::c_contig> w;
    ST_CHECK_ARG(nb::try_cast(workspace, w, false), "workspace", "a writable contiguous array",
                 nb::cast<std::string>(nb::str(workspace.type())));
    a.workspace = {w.data(), w.nbytes()};
  }
  return a;
}

// One layer's weight and bias grads, as the keys the Python side reads (weight_kind, ...).
void export_layer_grads(nb::dict& d, const st::WeightGrad& w, const st::Tensor& bias_grad, const PyAllocator& alloc) {
  d["weight_kind"] = st::weight_grad_kind_name(w.kind);
  // Where a packed [G, out, in] view exists the per-group grads are its slices: the Python side
  // takes them from it in one op (G exported views cost ~5 us each: 0.7 ms a call at G = 128).
  // Otherwise (the dummy over per-group weights: G views of one tensor) each distinct view is
  // exported once and repeated, so Python views it once.
  const nb::object packed = export_tensor(w.packed, alloc);
  nb::list per_group;
  if (packed.is_none()) {
    const st::TensorView* last = nullptr;
    nb::object exported;
    for (const st::Tensor& t : w.per_group) {
      const st::TensorView& v = t.view();
      const bool same = last != nullptr && v.data() == last->data() && v.dtype() == last->dtype() &&
                        v.dim() == last->dim() && std::equal(v.shape(), v.shape() + v.dim(), last->shape()) &&
                        std::equal(v.strides(), v.strides() + v.dim(), last->strides());
      if (!same) exported = export_tensor(t, alloc), last = &v;
      per_group.append(exported);
    }
  }
  d["weight_per_group"] = per_group;
  d["weight_packed"] = packed;
  d["grad_added_to_main_grad"] = w.grad_added_to_main_grad;
  d["bias_grad"] = export_tensor(bias_grad, alloc);
}

nb::dict export_grads(const st::GroupedLinearGrads& g, const PyAllocator& alloc) {
  nb::dict d;
  d["grad_input"] = export_tensor(g.grad_input, alloc);
  export_layer_grads(d, g.weight, g.bias_grad, alloc);
  return d;
}

nb::dict export_grads(const st::GroupedMLPGrads& g, const PyAllocator& alloc) {
  nb::dict d, fc1, fc2;
  d["grad_input"] = export_tensor(g.grad_input, alloc);
  d["dprobs"] = export_tensor(g.dprobs, alloc);
  export_layer_grads(fc1, g.fc1.weight, g.fc1.bias_grad, alloc);
  export_layer_grads(fc2, g.fc2.weight, g.fc2.bias_grad, alloc);
  d["fc1"] = fc1;
  d["fc2"] = fc2;
  return d;
}

// GroupedLinear holding Python references to everything its views point at: the parameters
// for its lifetime; each pending delayed wgrad's arrays (`keep`: the caller's x, dy and splits)
// ride in the C++ layer's queue until backward_dw.
class PyGroupedLinear {
 public:
  PyGroupedLinear(int64_t num_groups, int64_t in_features, int64_t out_features, const std::string& dtype,
                  nb::object weight, nb::object bias, nb::object main_grad, bool fuse_wgrad_accumulation,
                  bool overwrite_main_grad, bool delay_wgrad_compute, bool has_grad_added_to_main_grad,
                  bool check_device_splits, bool fp8, nb::callable allocator)
      : alloc_(std::move(allocator)), params_keep_(nb::make_tuple(weight, bias, main_grad)) {
    st::GroupedLinearOptions o;
    o.num_groups = num_groups;
    o.in_features = in_features;
    o.out_features = out_features;
    o.dtype = parse_dtype(dtype, "dtype");
    o.fuse_wgrad_accumulation = fuse_wgrad_accumulation;
    o.overwrite_main_grad = overwrite_main_grad;
    o.delay_wgrad_compute = delay_wgrad_compute;
    o.check_device_splits = check_device_splits;
    o.fp8 = fp8 ? st::Fp8Recipe::kBlockwise : st::Fp8Recipe::kOff;
    layer_ = std::make_unique<st::GroupedLinear>(
        o, linear_params(weight, bias, main_grad, has_grad_added_to_main_grad), &alloc_);
  }

  nb::object forward(nb::handle x, nb::handle splits, nb::handle out, uintptr_t stream, nb::handle workspace) {
    const PySplits s = make_splits(splits);
    return export_tensor(layer_->forward(view_of(x, "x"), s.splits, optional_view(out, "out", Access::kWrite),
                                         call_args(stream, workspace)),
                         alloc_);
  }

  nb::dict backward(nb::handle x, nb::handle dy, nb::handle splits, nb::handle grad_input, uintptr_t stream,
                    nb::handle workspace, nb::handle keep) {
    PySplits s = make_splits(splits);
    const st::GroupedLinearGrads g = layer_->backward(view_of(x, "x"), view_of(dy, "dy"), s.splits,
                                                      optional_view(grad_input, "grad_input", Access::kWrite),
                                                      call_args(stream, workspace, keep));
    return export_grads(g, alloc_);
  }

  nb::dict backward_dw(uintptr_t stream, nb::handle workspace) {
    return export_grads(layer_->backward_dw(call_args(stream, workspace)), alloc_);
  }

  void check_grad_input(nb::handle x, nb::handle splits, nb::handle grad_input) const {
    layer_->check_grad_input(view_of(x, "x"), make_splits(splits).splits,
                             view_of(grad_input, "grad_input", Access::kWrite));
  }

  size_t workspace_size(int64_t T) const { return layer_->workspace_size(T); }
  size_t pending_wgrads() const { return layer_->pending_wgrads(); }

 private:
  PyAllocator alloc_;  // declared before layer_: the layer's cached tensors are returned to it
  nb::object params_keep_;
  std::unique_ptr<st::GroupedLinear> layer_;
};

// GroupedMLP likewise: the parameters of both layers for its lifetime; x, dy, probs and splits
// of each pending delayed wgrad in the C++ queue (the layer owns the intermediates it keeps).
// fc1 and fc2 are each (weight, bias, main_grad, has_grad_added_to_main_grad).
class PyGroupedMLP {
 public:
  PyGroupedMLP(int64_t num_groups, int64_t in_features, int64_t ffn_features, int64_t out_features,
               const std::string& dtype, int64_t glu_interleave_size, nb::tuple fc1, nb::tuple fc2,
               bool fuse_wgrad_accumulation, bool overwrite_main_grad, bool delay_wgrad_compute,
               bool check_device_splits, bool fp8, nb::callable allocator)
      : alloc_(std::move(allocator)), params_keep_(nb::make_tuple(fc1, fc2)) {
    st::GroupedMLPOptions o;
    o.num_groups = num_groups;
    o.in_features = in_features;
    o.ffn_features = ffn_features;
    o.out_features = out_features;
    o.dtype = parse_dtype(dtype, "dtype");
    o.glu_interleave_size = glu_interleave_size;
    o.fuse_wgrad_accumulation = fuse_wgrad_accumulation;
    o.overwrite_main_grad = overwrite_main_grad;
    o.delay_wgrad_compute = delay_wgrad_compute;
    o.check_device_splits = check_device_splits;
    o.fp8 = fp8 ? st::Fp8Recipe::kBlockwise : st::Fp8Recipe::kOff;
    st::GroupedMLPParams p;
    p.fc1 = layer(fc1, "fc1.");
    p.fc2 = layer(fc2, "fc2.");
    mlp_ = std::make_unique<st::GroupedMLP>(o, p, &alloc_);
  }

  // (out, fc1_out): out is None when the caller's buffer was written.
  nb::tuple forward(nb::handle x, nb::handle splits, nb::handle probs, nb::handle out, uintptr_t stream,
                    nb::handle workspace) {
    const PySplits s = make_splits(splits);
    const st::GroupedMLPForward f =
        mlp_->forward(view_of(x, "x"), s.splits, view_of(probs, "probs"),
                      optional_view(out, "out", Access::kWrite), call_args(stream, workspace));
    return nb::make_tuple(export_tensor(f.out, alloc_), export_tensor(f.fc1_out, alloc_));
  }

  nb::dict backward(nb::handle x, nb::handle fc1_out, nb::handle probs, nb::handle dy, nb::handle splits,
                    nb::handle grad_input, uintptr_t stream, nb::handle workspace, nb::handle keep) {
    PySplits s = make_splits(splits);
    const st::GroupedMLPGrads g = mlp_->backward(
        view_of(x, "x"), view_of(fc1_out, "fc1_out"), view_of(probs, "probs"), view_of(dy, "dy"), s.splits,
        optional_view(grad_input, "grad_input", Access::kWrite), call_args(stream, workspace, keep));
    return export_grads(g, alloc_);
  }

  nb::dict backward_dw(uintptr_t stream, nb::handle workspace) {
    return export_grads(mlp_->backward_dw(call_args(stream, workspace)), alloc_);
  }

  void check_grad_input(nb::handle x, nb::handle splits, nb::handle grad_input) const {
    mlp_->check_grad_input(view_of(x, "x"), make_splits(splits).splits,
                           view_of(grad_input, "grad_input", Access::kWrite));
  }

  size_t workspace_size(int64_t T) const { return mlp_->workspace_size(T); }
  size_t pending_wgrads() const { return mlp_->pending_wgrads(); }

 private:
  static st::GroupedLinearParams layer(const nb::tuple& t, const std::string& prefix) {
    ST_CHECK_ARG(t.size() == 4, (prefix + "params").c_str(), "(weight, bias, main_grad, has_grad_added_to_main_grad)",
                 t.size(), " fields");
    return linear_params(t[0], t[1], t[2], nb::cast<bool>(t[3]), prefix);
  }

  PyAllocator alloc_;  // declared before mlp_: the layer's cached tensors are returned to it
  nb::object params_keep_;
  std::unique_ptr<st::GroupedMLP> mlp_;
};


// ---- block masks and attention ---------------------------------------------------------------
// A BlockMask crosses the binding as its wire (mask_wire.h), read by mask_of below; a mask the
// library builds comes back as a dict of exported tensors (export_mask). Specs and schedules
// passed to the builders are read by spec_of and parse_schedule.

// A schedule from Python: "left_to_right", "shortest_first", or a list of column ids ("auto" is
// handled by the callers: it is a choice made when the mask is built), and its walk order (None:
// the default); mask_options.h reads them.
st::ColumnSchedule parse_schedule(nb::handle obj, nb::handle walk = nb::none()) {
  const std::string w = walk.is_none() ? std::string() : nb::cast<std::string>(walk);
  if (nb::isinstance<nb::str>(obj)) {
    const std::string name = nb::cast<std::string>(obj);
    if (name.empty() || name == st::schedule_kind_name(st::ScheduleKind::kPermutation))
      st::detail::throw_arg_error("schedule", "\"auto\", \"left_to_right\", \"shortest_first\" or a permutation",
                                  name);
    return st::wire::column_schedule(name, {}, w);
  }
  return st::wire::column_schedule("", nb::cast<std::vector<int32_t>>(obj), w);
}

st::MaskSpec spec_of(const nb::dict& d) {
  st::MaskSpec spec;
  spec.kind = st::parse_mask_kind(nb::cast<std::string>(d["kind"]));
  spec.window_left = nb::cast<int64_t>(d["window_left"]);
  spec.window_right = nb::cast<int64_t>(d["window_right"]);
  spec.prefix_length = nb::cast<int64_t>(d["prefix_length"]);
  spec.doc_q = optional_view(d["doc_q"], "doc_q");
  spec.doc_kv = optional_view(d["doc_kv"], "doc_kv");
  return spec;
}

// The mask of its wire (mask_wire.h; _block_mask.py's BlockMask._core_mask: (tensors, sizes, kinds)),
// views of the arrays the caller's list keeps alive for the call.
st::wire::Mask mask_of(const nb::tuple& wire) {
  ST_CHECK_ARG(wire.size() == 3, "mask", "(tensors, sizes, kinds), sparsetrain.BlockMask's wire", wire.size());
  const nb::list tensors = nb::cast<nb::list>(wire[0]);
  return st::wire::parse([&](int i, const char* name) { return optional_view(tensors[size_t(i)], name); },
                         int64_t(tensors.size()), nb::cast<std::vector<int64_t>>(wire[1]),
                         nb::cast<std::string>(wire[2]));
}

// The tensors of a mask the library built, as exported tensors (None where absent or borrowed),
// with the sizes, the schedule and the spec kind.
nb::dict export_mask(st::BlockMaskTensors& t, const PyAllocator& alloc) {
  nb::dict d;
  const st::BlockMask& m = t.mask;
  d["seq_q"] = m.seq_q;
  d["seq_kv"] = m.seq_kv;
  d["block_q"] = m.block_q;
  d["block_kv"] = m.block_kv;
  for (int i = 0; i < st::kBlockMaskTensors; ++i)
    d[st::block_mask_tensor_name(i)] = export_tensor(st::block_mask_tensor(t, i), alloc);
  d["schedule"] = st::schedule_kind_name(m.schedule.kind);
  d["schedule_walk"] = st::walk_order_name(m.schedule.walk);
  d["schedule_permutation"] =
      m.schedule.kind == st::ScheduleKind::kPermutation ? nb::cast(m.schedule.permutation) : nb::none();
  d["spec_kind"] = st::mask_kind_name(m.spec.kind);
  return d;
}

// "auto"'s problem from Python: None, or (batch, heads_q, heads_kv, workers), 0 = the default.
st::ScheduleProblem parse_problem(nb::handle obj) {
  if (obj.is_none()) return {};
  const auto v = nb::cast<std::vector<int64_t>>(obj);
  if (v.empty()) st::detail::throw_arg_error("auto_problem", "(batch, heads_q, heads_kv, workers)", "0 values");
  return st::wire::schedule_problem(v);
}

st::BlockMaskOptions mask_options(int64_t block_q, int64_t block_kv, nb::handle schedule, st::Allocator* alloc,
                                  nb::handle walk = nb::none(), nb::handle problem = nb::none()) {
  const bool is_auto = nb::isinstance<nb::str>(schedule) && nb::cast<std::string>(schedule) == "auto";
  const st::ColumnSchedule s = is_auto ? st::ColumnSchedule{} : parse_schedule(schedule, walk);
  return st::wire::mask_options(block_q, block_kv, is_auto, s, parse_problem(problem), alloc);
}

// device "cpu" builds on the host; "cuda" (device_index) builds there on `stream` without a host
// sync (block_mask.h: document ids on that device, an explicit schedule), the tensors coming from
// the allocator callback on that device (torch.empty on the current stream).
nb::dict build_mask(nb::dict spec, int64_t seq_q, int64_t seq_kv, int64_t block_q, int64_t block_kv,
                    nb::handle schedule, nb::callable allocator, const std::string& device,
                    int device_index, uintptr_t stream, nb::handle walk, nb::handle problem) {
  PyAllocator alloc(std::move(allocator));
  st::BlockMaskOptions o = mask_options(block_q, block_kv, schedule, &alloc, walk, problem);
  ST_CHECK_ARG(device == "cpu" || device == "cuda", "device", "cpu or cuda", device);
  if (device == "cuda") {
    o.device = st::Device::cuda(device_index);
    o.stream.handle = reinterpret_cast<void*>(stream);
  }
  st::BlockMaskTensors t = st::build_block_mask(spec_of(spec), seq_q, seq_kv, o);
  return export_mask(t, alloc);
}

// build_doc_padded_mask (block_mask.h): export_mask's dict plus the padded ids and real_rows.
nb::dict build_padded_mask(nb::dict spec, int64_t seq, int64_t min_length, int64_t block_q, int64_t block_kv,
                           nb::handle schedule, nb::callable allocator, const std::string& device, int device_index,
                           uintptr_t stream, nb::handle walk) {
  PyAllocator alloc(std::move(allocator));
  st::BlockMaskOptions o = mask_options(block_q, block_kv, schedule, &alloc, walk);
  ST_CHECK_ARG(device == "cpu" || device == "cuda", "device", "cpu or cuda", device);
  if (device == "cuda") {
    o.device = st::Device::cuda(device_index);
    o.stream.handle = reinterpret_cast<void*>(stream);
  }
  st::BlockMaskTensors t = st::build_doc_padded_mask(spec_of(spec), seq, min_length, o);
  nb::dict d = export_mask(t, alloc);
  d["doc_q"] = export_tensor(t.doc_q, alloc);
  d["doc_kv"] = export_tensor(t.doc_kv, alloc);
  d["real_rows"] = export_tensor(t.real_rows, alloc);
  return d;
}

nb::dict build_mask_from_blocks(nb::handle blocks, int64_t seq_q, int64_t seq_kv, int64_t block_q, int64_t block_kv,
                                nb::handle schedule, nb::callable allocator, nb::handle walk,
                                nb::handle problem) {
  PyAllocator alloc(std::move(allocator));
  st::BlockMaskTensors t = st::build_block_mask_from_blocks(
      view_of(blocks, "blocks"), seq_q, seq_kv,
      mask_options(block_q, block_kv, schedule, &alloc, walk, problem));
  return export_mask(t, alloc);
}

// A flex BlockMask's lists (host arrays; the full ones None when absent) as the dense block matrix
// (block_mask.h block_matrix_from_flex), exported.
nb::object block_matrix_from_flex(nb::handle kv_num_blocks, nb::handle kv_indices, nb::handle full_kv_num_blocks,
                                  nb::handle full_kv_indices, int64_t batch, int64_t heads, int64_t num_kv_blocks,
                                  nb::callable allocator) {
  PyAllocator alloc(std::move(allocator));
  st::FlexBlockLists l;
  l.kv_num_blocks = view_of(kv_num_blocks, "kv_num_blocks");
  l.kv_indices = view_of(kv_indices, "kv_indices");
  if (!full_kv_num_blocks.is_none()) l.full_kv_num_blocks = view_of(full_kv_num_blocks, "full_kv_num_blocks");
  if (!full_kv_indices.is_none()) l.full_kv_indices = view_of(full_kv_indices, "full_kv_indices");
  return export_tensor(st::block_matrix_from_flex(l, batch, heads, num_kv_blocks, &alloc), alloc);
}

// (width, the partial blocks' places) of a dense block matrix (block_mask.h partial_block_places).
nb::tuple partial_block_places(nb::handle blocks, int64_t block_q, int64_t block_kv, nb::callable allocator) {
  PyAllocator alloc(std::move(allocator));
  int64_t width = 0;
  const st::Tensor places = st::partial_block_places(view_of(blocks, "blocks"), block_q, block_kv, &width, &alloc);
  return nb::make_tuple(width, export_tensor(places, alloc));
}

// The transposes and write orders of a mask given by its forward lists (the caller's arrays):
// a dict with q_*, dq_write_order(_full) and the schedule (other tensors None).
nb::dict complete_mask(nb::tuple mask, nb::handle schedule, nb::callable allocator,
                       nb::handle walk, nb::handle problem) {
  PyAllocator alloc(std::move(allocator));
  st::BlockMaskTensors t;
  t.mask = mask_of(mask).mask;
  t.mask.backward_padded = nullptr;  // it pointed into the parsed wire, gone; the lists alone are completed
  st::transpose_block_mask(t, &alloc);
  const bool is_auto = nb::isinstance<nb::str>(schedule) && nb::cast<std::string>(schedule) == "auto";
  const st::ColumnSchedule s = is_auto ? st::choose_schedule(t.mask, parse_problem(problem)) : parse_schedule(schedule, walk);
  st::compute_dq_write_order(t, s, &alloc);
  return export_mask(t, alloc);
}

// FlashAttention's cu_seqlens -> (doc_q, doc_kv) int32 [1, S], exported, on the offsets' device
// (cu_seqlens.h); on CUDA by a kernel on `stream`, without a host synchronisation.
nb::tuple document_ids_from_cu_seqlens(nb::handle cu_seqlens_q, nb::handle cu_seqlens_k, int64_t seq_q,
                                       int64_t seq_kv, nb::callable allocator, uintptr_t stream) {
  PyAllocator alloc(std::move(allocator));
  st::Stream s;
  s.handle = reinterpret_cast<void*>(stream);
  const st::DocumentIds ids = st::document_ids_from_cu_seqlens(view_of(cu_seqlens_q, "cu_seqlens_q"),
                                                               view_of(cu_seqlens_k, "cu_seqlens_k"), seq_q, seq_kv,
                                                               &alloc, s);
  return nb::make_tuple(export_tensor(ids.doc_q, alloc), export_tensor(ids.doc_kv, alloc));
}

st::AttentionOptions attention_options(float scale, bool deterministic, int sm_limit) {
  st::AttentionOptions o;
  o.scale = scale;
  o.deterministic = deterministic;
  o.sm_limit = sm_limit;
  return o;
}

nb::tuple attention_forward(nb::handle q, nb::handle k, nb::handle v, nb::tuple mask, float scale, bool deterministic,
                            int sm_limit, uintptr_t stream, nb::callable allocator) {
  PyAllocator alloc(std::move(allocator));
  st::AttentionCall call;
  call.stream.handle = reinterpret_cast<void*>(stream);
  call.allocator = &alloc;
  const st::AttentionForward f = st::block_sparse_attention_forward(
      view_of(q, "q"), view_of(k, "k"), view_of(v, "v"), mask_of(mask).mask,
      attention_options(scale, deterministic, sm_limit), call);
  return nb::make_tuple(export_tensor(f.o, alloc), export_tensor(f.lse, alloc));
}

nb::tuple attention_backward(nb::handle q, nb::handle k, nb::handle v, nb::handle o, nb::handle lse, nb::handle dout,
                             nb::tuple mask, float scale, bool deterministic, int sm_limit, uintptr_t stream,
                             nb::callable allocator) {
  PyAllocator alloc(std::move(allocator));
  st::AttentionCall call;
  call.stream.handle = reinterpret_cast<void*>(stream);
  call.allocator = &alloc;
  const st::wire::Mask m = mask_of(mask);
  const st::AttentionGrads g = st::block_sparse_attention_backward(
      view_of(q, "q"), view_of(k, "k"), view_of(v, "v"), view_of(o, "o"), view_of(lse, "lse"),
      view_of(dout, "dout"), m.mask, attention_options(scale, deterministic, sm_limit), call);
  return nb::make_tuple(export_tensor(g.dq, alloc), export_tensor(g.dk, alloc), export_tensor(g.dv, alloc));
}

// The MoE router (moe_router.h): (experts, probs, counts, row_of, token_of_row, score_sum), exported.
nb::tuple moe_route(nb::handle logits, nb::handle expert_bias, int64_t num_experts, int64_t top_k,
                    const std::string& score, bool normalize, uintptr_t stream, nb::callable allocator) {
  PyAllocator alloc(std::move(allocator));
  st::Stream s;
  s.handle = reinterpret_cast<void*>(stream);
  const st::RouterOutput r = st::route(st::wire::router_options(num_experts, top_k, score, normalize),
                                       view_of(logits, "logits"), optional_view(expert_bias, "expert_bias"), &alloc, s);
  return nb::make_tuple(export_tensor(r.experts, alloc), export_tensor(r.probs, alloc), export_tensor(r.counts, alloc),
                        export_tensor(r.row_of, alloc), export_tensor(r.token_of_row, alloc),
                        export_tensor(r.score_sum, alloc));
}

nb::object moe_route_backward(nb::handle logits, nb::handle experts, nb::handle dprobs, nb::handle dscore_sum,
                              int64_t num_experts, int64_t top_k, const std::string& score, bool normalize,
                              uintptr_t stream, nb::callable allocator) {
  PyAllocator alloc(std::move(allocator));
  st::Stream s;
  s.handle = reinterpret_cast<void*>(stream);
  return export_tensor(st::route_backward(st::wire::router_options(num_experts, top_k, score, normalize),
                                          view_of(logits, "logits"), view_of(experts, "experts"),
                                          view_of(dprobs, "dprobs"), optional_view(dscore_sum, "dscore_sum"), &alloc, s),
                       alloc);
}

// The layer's combine (moe_layer.h combine_rows): out [N, H], exported.
nb::object moe_combine_rows(nb::handle rows, nb::handle row_of, uintptr_t stream, nb::callable allocator) {
  PyAllocator alloc(std::move(allocator));
  st::Stream s;
  s.handle = reinterpret_cast<void*>(stream);
  return export_tensor(st::combine_rows(view_of(rows, "rows"), view_of(row_of, "row_of"), &alloc, s), alloc);
}

}  // namespace

NB_MODULE(_C, m) {
  m.doc() = "sparsetrain C++ core over DLPack (see the sparsetrain package for the Python API)";

  // An invalid argument is a ValueError; anything else the library raises is a RuntimeError.
  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const st::Error& e) {
      PyErr_SetString(e.kind() == st::Error::Kind::kInvalidArgument ? PyExc_ValueError : PyExc_RuntimeError,
                      e.what());
    }
  });

  m.def("version", &st::version);
  m.def("built_with_cuda", &st::built_with_cuda);
  m.def("sm90_kernel_set", &st::sm90_kernel_set);
  m.def("cuda_archs", &st::cuda_archs);
  m.def("cuda_device_count", &st::cuda_device_count);
  m.def("weight_grad_disposition", [](bool delay, bool fuse, bool has_attr) {
    const st::WeightGradDisposition d = st::weight_grad_disposition(delay, fuse, has_attr);
    return nb::make_tuple(st::weight_grad_kind_name(d.weight), d.bias_grad_now);
  }, nb::arg("delay_wgrad"), nb::arg("fuse_into_main_grad"), nb::arg("has_grad_added_to_main_grad"),
     "The one weight-grad rule: (weight grad 'wgrad'|'none'|'dummy', bias grad now?).");
  m.def("dtype_name_of_element", [](const std::string& kind, int bits) {
    // kind: how the Python front describes a framework's dtype (sparsetrain._arrays.dtype_name)
    const char* kinds[] = {"int", "uint", "float", "bfloat", "complex", "bool"};  // in ElementKind's order
    static_assert(int(st::ElementKind::kBool) == 5, "kinds[] follows ElementKind");
    st::DType t;
    for (int k = 0; k < 6; ++k)
      if (kind == kinds[k] && st::dtype_of_element(st::ElementKind(k), bits, t)) return std::string(st::dtype_name(t));
    return std::string();
  }, nb::arg("kind"), nb::arg("bits"),
     "The library's name of an element type (kind: int, uint, float, bfloat, complex or bool; its width in "
     "bits), '' for one no dtype of the library describes: the one table every front names types by.");
  m.attr("SPLITS_NEGATIVE") = int(st::kSplitsNegative);
  m.attr("SPLITS_SUM_EXCEEDS_ROWS") = int(st::kSplitsSumExceedsRows);
  m.attr("ALLOC_ALIGNMENT") = st::kAllocAlignment;
  m.def("packed_wgrad_group_stride", [](int64_t out_features, int64_t in_features, const std::string& dtype) {
    return st::packed_wgrad_group_stride(out_features, in_features, parse_dtype(dtype, "dtype"));
  }, nb::arg("out_features"), nb::arg("in_features"), nb::arg("dtype"),
     "Per-group stride (elements) of the packed weight-grad buffer (each group 256-byte aligned).");

  nb::class_<PyGroupedLinear>(m, "GroupedLinear")
      .def(nb::init<int64_t, int64_t, int64_t, const std::string&, nb::object, nb::object, nb::object, bool, bool,
                    bool, bool, bool, bool, nb::callable>(),
           nb::arg("num_groups"), nb::arg("in_features"), nb::arg("out_features"), nb::arg("dtype"),
           nb::arg("weight"), nb::arg("bias").none(), nb::arg("main_grad").none(),
           nb::arg("fuse_wgrad_accumulation"), nb::arg("overwrite_main_grad"), nb::arg("delay_wgrad_compute"),
           nb::arg("has_grad_added_to_main_grad"), nb::arg("check_device_splits"), nb::arg("fp8"),
           nb::arg("allocator"))
      .def("forward", &PyGroupedLinear::forward, nb::arg("x"), nb::arg("splits"), nb::arg("out").none(),
           nb::arg("stream"), nb::arg("workspace").none())
      .def("backward", &PyGroupedLinear::backward, nb::arg("x"), nb::arg("dy"), nb::arg("splits"),
           nb::arg("grad_input").none(), nb::arg("stream"), nb::arg("workspace").none(), nb::arg("keep").none())
      .def("backward_dw", &PyGroupedLinear::backward_dw, nb::arg("stream"), nb::arg("workspace").none())
      .def("check_grad_input", &PyGroupedLinear::check_grad_input, nb::arg("x"), nb::arg("splits"),
           nb::arg("grad_input"))
      .def("workspace_size", &PyGroupedLinear::workspace_size)
      .def_prop_ro("pending_wgrads", &PyGroupedLinear::pending_wgrads);

  nb::class_<PyGroupedMLP>(m, "GroupedMLP")
      .def(nb::init<int64_t, int64_t, int64_t, int64_t, const std::string&, int64_t, nb::tuple, nb::tuple, bool,
                    bool, bool, bool, bool, nb::callable>(),
           nb::arg("num_groups"), nb::arg("in_features"), nb::arg("ffn_features"), nb::arg("out_features"),
           nb::arg("dtype"), nb::arg("glu_interleave_size"), nb::arg("fc1"), nb::arg("fc2"),
           nb::arg("fuse_wgrad_accumulation"), nb::arg("overwrite_main_grad"), nb::arg("delay_wgrad_compute"),
           nb::arg("check_device_splits"), nb::arg("fp8"), nb::arg("allocator"))
      .def("forward", &PyGroupedMLP::forward, nb::arg("x"), nb::arg("splits"), nb::arg("probs"),
           nb::arg("out").none(), nb::arg("stream"), nb::arg("workspace").none())
      .def("backward", &PyGroupedMLP::backward, nb::arg("x"), nb::arg("fc1_out"), nb::arg("probs"), nb::arg("dy"),
           nb::arg("splits"), nb::arg("grad_input").none(), nb::arg("stream"), nb::arg("workspace").none(),
           nb::arg("keep").none())
      .def("backward_dw", &PyGroupedMLP::backward_dw, nb::arg("stream"), nb::arg("workspace").none())
      .def("check_grad_input", &PyGroupedMLP::check_grad_input, nb::arg("x"), nb::arg("splits"),
           nb::arg("grad_input"))
      .def("workspace_size", &PyGroupedMLP::workspace_size)
      .def_prop_ro("pending_wgrads", &PyGroupedMLP::pending_wgrads);

  // Block masks (block_mask.h): each builder returns a dict of exported tensors (see export_mask).
  m.def("moe_route", &moe_route, nb::arg("logits"), nb::arg("expert_bias").none(), nb::arg("num_experts"),
        nb::arg("top_k"), nb::arg("score"), nb::arg("normalize"), nb::arg("stream"), nb::arg("allocator"));
  m.def("moe_combine_rows", &moe_combine_rows, nb::arg("rows"), nb::arg("row_of"), nb::arg("stream"),
        nb::arg("allocator"));
  m.def("moe_route_backward", &moe_route_backward, nb::arg("logits"), nb::arg("experts"), nb::arg("dprobs"),
        nb::arg("dscore_sum").none(), nb::arg("num_experts"), nb::arg("top_k"), nb::arg("score"), nb::arg("normalize"),
        nb::arg("stream"), nb::arg("allocator"));
  m.def("build_block_mask", &build_mask, nb::arg("spec"), nb::arg("seq_q"), nb::arg("seq_kv"), nb::arg("block_q"),
        nb::arg("block_kv"), nb::arg("schedule"), nb::arg("allocator"),
        nb::arg("device") = "cpu", nb::arg("device_index") = 0, nb::arg("stream") = 0, nb::arg("walk").none() = nb::none(),
        nb::arg("problem").none() = nb::none());
  m.def("build_doc_padded_mask", &build_padded_mask, nb::arg("spec"), nb::arg("seq"), nb::arg("min_length"),
        nb::arg("block_q"), nb::arg("block_kv"), nb::arg("schedule"), nb::arg("allocator"), nb::arg("device") = "cpu",
        nb::arg("device_index") = 0, nb::arg("stream") = 0, nb::arg("walk").none() = nb::none());
  m.def("document_ids_from_cu_seqlens", &document_ids_from_cu_seqlens, nb::arg("cu_seqlens_q"),
        nb::arg("cu_seqlens_k"), nb::arg("seq_q"), nb::arg("seq_kv"), nb::arg("allocator"), nb::arg("stream") = 0);
  m.def("build_block_mask_from_blocks", &build_mask_from_blocks, nb::arg("blocks"), nb::arg("seq_q"),
        nb::arg("seq_kv"), nb::arg("block_q"), nb::arg("block_kv"), nb::arg("schedule"), nb::arg("allocator"), nb::arg("walk").none() = nb::none(), nb::arg("problem").none() = nb::none());
  m.def("block_matrix_from_flex", &block_matrix_from_flex, nb::arg("kv_num_blocks"), nb::arg("kv_indices"),
        nb::arg("full_kv_num_blocks").none(), nb::arg("full_kv_indices").none(), nb::arg("batch"), nb::arg("heads"),
        nb::arg("num_kv_blocks"), nb::arg("allocator"));
  m.def("partial_block_places", &partial_block_places, nb::arg("blocks"), nb::arg("block_q"), nb::arg("block_kv"),
        nb::arg("allocator"));
  m.def("complete_block_mask", &complete_mask, nb::arg("mask"), nb::arg("schedule"), nb::arg("allocator"), nb::arg("walk").none() = nb::none(), nb::arg("problem").none() = nb::none());
  m.def("validate_block_mask", [](nb::tuple mask, int64_t batch, int64_t heads) {
    st::validate_block_mask(mask_of(mask).mask, batch, heads);
  }, nb::arg("mask"), nb::arg("batch"), nb::arg("heads"));
  m.def("check_write_order", [](nb::tuple mask) { return st::check_write_order(mask_of(mask).mask); }, nb::arg("mask"));
  // "auto"'s choice and the model's critical paths of every candidate (the bench reports them).
  m.def("choose_schedule", [](nb::tuple mask, nb::handle problem) {
    return std::string(st::schedule_kind_name(st::choose_schedule(mask_of(mask).mask, parse_problem(problem)).kind));
  }, nb::arg("mask"), nb::arg("problem").none() = nb::none());
  m.def("schedule_candidates", [](nb::tuple mask, nb::handle problem) {
    nb::list out;
    for (const st::ScheduleCandidate& c : st::schedule_candidates(mask_of(mask).mask, parse_problem(problem))) {
      nb::dict d;
      d["schedule"] = st::schedule_kind_name(c.schedule.kind);
      d["walk"] = st::walk_order_name(c.schedule.walk);
      d["critical_path"] = c.critical_path;
      d["nondeterministic_critical_path"] = c.nondeterministic_critical_path;
      out.append(d);
    }
    return out;
  }, nb::arg("mask"), nb::arg("problem").none() = nb::none());
  m.def("attention_forward", &attention_forward, nb::arg("q"), nb::arg("k"), nb::arg("v"), nb::arg("mask"),
        nb::arg("scale"), nb::arg("deterministic"), nb::arg("sm_limit"), nb::arg("stream"), nb::arg("allocator"));
  m.def("attention_backward", &attention_backward, nb::arg("q"), nb::arg("k"), nb::arg("v"), nb::arg("o"),
        nb::arg("lse"), nb::arg("dout"), nb::arg("mask"), nb::arg("scale"), nb::arg("deterministic"),
        nb::arg("sm_limit"), nb::arg("stream"), nb::arg("allocator"));
}

// sparsetrain's block-sparse attention as C++ torch operators, sparsetrain::block_sparse_attention
// and sparsetrain::block_sparse_attention_backward: the one route of
// sparsetrain.torch.block_sparse_attention, eager, under autograd, torch.compile, fake tensors,
// dispatch modes and CUDA graphs alike. q, k, v in FlexAttention's [B, H, S, D] layout become the
// core's [B, S, H, D] views here; outputs come from torch's caching allocator (at::empty on the
// current stream) as tensors over that memory, o and the gradients as [B, H, S, D] views of the
// core's [B, S, H, D] results, with no Python in between.
//
// The forward op's Autograd kernel is a torch::autograd::Function: its forward calls the op again
// below autograd, its backward calls the backward op, both through the dispatcher, so fake
// tensors, make_fx and torch.compile reach the fake implementations (sparsetrain/torch/attention.py)
// and see both ops in their graphs. The compute kernels are CompositeExplicitAutograd (CPU and
// CUDA; the fakes' Meta kernels take precedence on meta tensors). The grouped layers of the same
// library are in torch_grouped.cpp; what both share in torch_common.h.
//
// The mask arrives as its wire (mask_wire.h, the layout the numpy/DLPack module `_C` reads too):
// flat tensors, sizes and "kind,schedule,walk", so that a compiler sees every tensor the op reads.
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/DeviceGuard.h>
#include <torch/autograd.h>
#include <torch/csrc/autograd/autograd_not_implemented_fallback.h>
#include <torch/library.h>
#include <torch/python.h>

#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <tuple>
#include <vector>

#include "sparsetrain/attention.h"
#include "sparsetrain/block_mask.h"
#include "sparsetrain/error.h"
#include "mask_wire.h"
#include "torch_common.h"

namespace st = sparsetrain;

namespace {

using st::torch_ops::stream_of;
using st::torch_ops::TorchAllocator;
using st::torch_ops::translated;
using st::torch_ops::view_of;

using MaskTensors = c10::List<std::optional<at::Tensor>>;

// The kernels' C++ signatures (one per op: every kernel of an op and its typed handle share it).
using ForwardSignature = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                            const MaskTensors&, at::IntArrayRef, std::string_view,
                                                            double, bool, int64_t);
using BackwardSignature = std::tuple<at::Tensor, at::Tensor, at::Tensor>(
    const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
    const MaskTensors&, at::IntArrayRef, std::string_view, double, bool, int64_t);

// The ops' mask arguments: the mask's wire (mask_wire.h), parsed on every call (views and a few
// integers; the permutation, a host array, is copied): nothing outlives the call, so nothing can
// go stale.
st::wire::Mask mask_of(const MaskTensors& tensors, at::IntArrayRef sizes, std::string_view kinds) {
  return st::wire::parse([&](int i, const char* name) { return view_of(tensors.get(size_t(i)), name); },
                         int64_t(tensors.size()), sizes, kinds);
}

// q, k or v in FlexAttention's [B, H, S, D] layout as the core's [B, S, H, D] view (the transpose
// without a dispatcher call).
st::TensorView bshd_view_of(const at::Tensor& t, const char* arg) {
  ST_CHECK_ARG(t.dim() == 4, arg, "a 4-d tensor [B, H, S, D]", t.dim());
  const at::IntArrayRef n = t.sizes(), s = t.strides();
  const int64_t sizes[4] = {n[0], n[2], n[1], n[3]}, strides[4] = {s[0], s[2], s[1], s[3]};
  return st::TensorView(t.data_ptr(), st::torch_ops::dtype_of(t, arg), sizes, strides, 4,
                        st::torch_ops::device_of(t, arg));
}

st::AttentionOptions options_of(double scale, bool deterministic, int64_t sm_limit) {
  st::AttentionOptions o;
  o.scale = float(scale);
  o.deterministic = deterministic;
  o.sm_limit = int(sm_limit);
  return o;
}

st::AttentionCall call_on(const at::Tensor& q, TorchAllocator* alloc) {
  st::AttentionCall call;
  call.allocator = alloc;
  call.stream = stream_of(q);
  return call;
}

// (o [B, Hq, Sq, D], lse [B, Hq, Sq] fp32) of q, k, v in [B, H, S, D], with q's device current
// (the core launches on the current device).
std::tuple<at::Tensor, at::Tensor> attention_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                     const MaskTensors& mask_tensors, at::IntArrayRef mask_sizes,
                                                     std::string_view mask_kinds, double scale, bool deterministic,
                                                     int64_t sm_limit) {
  return translated([&] {
    const c10::DeviceGuard guard(q.device());
    TorchAllocator alloc;
    const st::AttentionForward f = st::block_sparse_attention_forward(
        bshd_view_of(q, "q"), bshd_view_of(k, "k"), bshd_view_of(v, "v"),
        mask_of(mask_tensors, mask_sizes, mask_kinds).mask, options_of(scale, deterministic, sm_limit),
        call_on(q, &alloc));
    return std::make_tuple(alloc.take(f.o, /*swap_1_2=*/true), alloc.take(f.lse));
  });
}

// (dq, dk, dv), each laid out as q, k, v ([B, H, S, D] views of [B, S, H, D] results). torch's
// deterministic mode is read here, when the backward runs, as torch's own kernels read it:
// switched on between the forward and the backward, it still applies (also in a compiled graph,
// where this op is called without the autograd kernel).
std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_backward(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& o, const at::Tensor& lse,
    const at::Tensor& dout, const MaskTensors& mask_tensors, at::IntArrayRef mask_sizes, std::string_view mask_kinds,
    double scale, bool deterministic, int64_t sm_limit) {
  return translated([&] {
    const c10::DeviceGuard guard(q.device());
    const bool det = deterministic || at::globalContext().deterministicAlgorithms();
    TorchAllocator alloc;
    const st::AttentionGrads g = st::block_sparse_attention_backward(
        bshd_view_of(q, "q"), bshd_view_of(k, "k"), bshd_view_of(v, "v"), bshd_view_of(o, "o"), view_of(lse, "lse"),
        bshd_view_of(dout, "dout"), mask_of(mask_tensors, mask_sizes, mask_kinds).mask,
        options_of(scale, det, sm_limit), call_on(q, &alloc));
    return std::make_tuple(alloc.take(g.dq, true), alloc.take(g.dk, true), alloc.take(g.dv, true));
  });
}

const c10::TypedOperatorHandle<ForwardSignature>& forward_op() {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("sparsetrain::block_sparse_attention", "")
                             .typed<ForwardSignature>();
  return op;
}

const c10::TypedOperatorHandle<BackwardSignature>& backward_op() {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("sparsetrain::block_sparse_attention_backward", "")
                             .typed<BackwardSignature>();
  return op;
}

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Attention's autograd: saves q, k, v, o, lse and the mask's tensors (version-checked as
// save_for_backward does); lse has no gradient.
struct AttentionFunction : public torch::autograd::Function<AttentionFunction> {
  static constexpr size_t kInputs = 9;  // forward's arguments after ctx; gradients for q, k, v only

  static variable_list forward(AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                               const MaskTensors& mask_tensors, at::IntArrayRef mask_sizes,
                               std::string_view mask_kinds, double scale, bool deterministic, int64_t sm_limit) {
    at::Tensor o, lse;
    {
      const at::AutoDispatchBelowADInplaceOrView below_autograd;
      std::tie(o, lse) =
          forward_op().call(q, k, v, mask_tensors, mask_sizes, mask_kinds, scale, deterministic, sm_limit);
    }
    ctx->mark_non_differentiable({lse});
    // lse has no gradient: no zero tensor for it (a fill kernel a backward); o's may be undefined
    // (o unused), then so are q's, k's and v's.
    ctx->set_materialize_grads(false);
    std::vector<at::Tensor> saved{q, k, v, o, lse};
    saved.reserve(5 + mask_tensors.size());
    for (size_t i = 0; i < mask_tensors.size(); ++i) {
      const auto t = mask_tensors.get(i);
      saved.push_back(t.has_value() ? at::Tensor(*t) : at::Tensor());
    }
    ctx->save_for_backward(std::move(saved));
    ctx->saved_data["sizes"] = mask_sizes.vec();
    ctx->saved_data["kinds"] = std::string(mask_kinds);
    ctx->saved_data["scale"] = scale;
    ctx->saved_data["deterministic"] = deterministic;
    ctx->saved_data["sm_limit"] = sm_limit;
    return {o, lse};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    at::Tensor dout = grads[0];
    if (!dout.defined()) return variable_list(kInputs);
    if (dout.stride(-1) != 1) dout = dout.contiguous();
    const variable_list s = ctx->get_saved_variables();
    MaskTensors mask_tensors;
    mask_tensors.reserve(s.size() - 5);
    for (size_t i = 5; i < s.size(); ++i)
      mask_tensors.push_back(s[i].defined() ? std::optional<at::Tensor>(s[i]) : std::nullopt);
    const auto [dq, dk, dv] = backward_op().call(
        s[0], s[1], s[2], s[3], s[4], dout, mask_tensors, ctx->saved_data["sizes"].toIntVector(),
        ctx->saved_data["kinds"].toStringRef(), ctx->saved_data["scale"].toDouble(),
        ctx->saved_data["deterministic"].toBool(), ctx->saved_data["sm_limit"].toInt());
    variable_list out(kInputs);
    out[0] = dq, out[1] = dk, out[2] = dv;
    return out;
  }
};

// Where autograd has nothing to record (grad mode off or no input requiring grad, and no forward
// gradient, which AttentionFunction refuses), the compute kernel is called straight away: a node
// built and dropped costs an eager forward more than its compute on small problems.
std::tuple<at::Tensor, at::Tensor> attention_autograd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                      const MaskTensors& mask_tensors, at::IntArrayRef mask_sizes,
                                                      std::string_view mask_kinds, double scale, bool deterministic,
                                                      int64_t sm_limit) {
  const auto recorded = [](const at::Tensor& t) {
    return (at::GradMode::is_enabled() && t.requires_grad()) || t._fw_grad(/*level=*/0).defined();
  };
  if (!recorded(q) && !recorded(k) && !recorded(v)) {
    const at::AutoDispatchBelowADInplaceOrView below_autograd;
    return forward_op().call(q, k, v, mask_tensors, mask_sizes, mask_kinds, scale, deterministic, sm_limit);
  }
  const variable_list r =
      AttentionFunction::apply(q, k, v, mask_tensors, mask_sizes, mask_kinds, scale, deterministic, sm_limit);
  return std::make_tuple(r[0], r[1]);
}

// The forward operator called from Python without torch.ops' entry (each argument converted to an
// IValue, the __torch_function__ scan, the GIL released and taken again: ~10 us a call, more than
// a tiny problem's kernels). sparsetrain.torch calls it where that entry has nothing to do: eager
// calls on plain tensors with no mode active (sparsetrain.torch.native.direct). It is the same
// operator through the same dispatcher, so the same Autograd and compute kernels run.
std::tuple<at::Tensor, at::Tensor> attention_entry(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                   const std::vector<std::optional<at::Tensor>>& mask_tensors,
                                                   const std::vector<int64_t>& mask_sizes, const std::string& mask_kinds,
                                                   double scale, bool deterministic, int64_t sm_limit) {
  MaskTensors tensors;
  tensors.reserve(mask_tensors.size());
  for (const auto& t : mask_tensors) tensors.push_back(t);
  return forward_op().call(q, k, v, tensors, mask_sizes, mask_kinds, scale, deterministic, sm_limit);
}

}  // namespace

void st::torch_ops::register_attention(pybind11::module_& m) { m.def("attention", &attention_entry); }

// The fake implementations are Python (torch.library.register_fake in the module named here,
// which torch imports when a fake tensor meets an op without one): they take symbolic shapes as
// they come, where a C++ Meta kernel would need SymInt signatures of its own.
TORCH_LIBRARY(sparsetrain, m) {
  m.set_python_module("sparsetrain.torch.attention");
  m.def("block_sparse_attention(Tensor q, Tensor k, Tensor v, Tensor?[] mask_tensors, int[] mask_sizes, "
        "str mask_kinds, float scale, bool deterministic, int sm_limit) -> (Tensor, Tensor)");
  m.def("block_sparse_attention_backward(Tensor q, Tensor k, Tensor v, Tensor o, Tensor lse, Tensor dout, "
        "Tensor?[] mask_tensors, int[] mask_sizes, str mask_kinds, float scale, bool deterministic, int sm_limit) "
        "-> (Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(sparsetrain, CompositeExplicitAutograd, m) {
  m.impl("block_sparse_attention", &attention_forward);
  m.impl("block_sparse_attention_backward", &attention_backward);
}

// The backward op has no derivative: a graph that differentiates it (create_graph=True) gets
// autograd's "not implemented" error when that is used, not silently wrong second derivatives.
TORCH_LIBRARY_IMPL(sparsetrain, Autograd, m) {
  m.impl("block_sparse_attention", &attention_autograd);
  m.impl("block_sparse_attention_backward", torch::autograd::autogradNotImplementedFallback());
}

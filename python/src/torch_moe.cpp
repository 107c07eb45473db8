// The MoE router and the MoE layer's combine as C++ torch operators of the library
// sparsetrain._torch_ops: sparsetrain::moe_route and moe_route_backward (moe_router.h), the route
// of sparsetrain.torch.moe_route, and sparsetrain::moe_combine_rows (moe_layer.h combine_rows),
// each token's expert rows summed by token_rows.take. As attention's (torch_ops.cpp): compute
// kernels that call the core on the current stream with outputs from torch's caching allocator
// (CompositeExplicitAutograd), moe_route's Autograd kernel a torch::autograd::Function that calls
// the op again below autograd and the backward op through the dispatcher (so fake tensors, make_fx
// and torch.compile reach the Python fakes and see both ops), and fake implementations in Python
// (register_fake in the modules named below). The combine's autograd is token_rows.Rows (a gather
// both ways), so the op itself has none.
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

namespace st = sparsetrain;

namespace {

using st::torch_ops::stream_of;
using st::torch_ops::TorchAllocator;
using st::torch_ops::translated;
using st::torch_ops::view_of;

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

}  // namespace

// torch_ops.cpp's TORCH_LIBRARY defines the namespace; the fakes are Python, in the modules named
// here (imported by torch when a fake tensor meets an op without one).
TORCH_LIBRARY_FRAGMENT(sparsetrain, m) {
  m.set_python_module("sparsetrain.torch.moe");
  m.def("moe_route(Tensor logits, Tensor? expert_bias, int top_k, str score, bool normalize) "
        "-> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)");
  m.def("moe_route_backward(Tensor logits, Tensor experts, Tensor dprobs, Tensor? dscore_sum, int top_k, str score, "
        "bool normalize) -> Tensor");
  m.set_python_module("sparsetrain.torch.token_rows");
  m.def("moe_combine_rows(Tensor rows, Tensor row_of) -> Tensor");
}

TORCH_LIBRARY_IMPL(sparsetrain, CompositeExplicitAutograd, m) {
  m.impl("moe_route", &route);
  m.impl("moe_route_backward", &route_backward);
  m.impl("moe_combine_rows", &combine_rows);
}

// The backward op has no derivative (create_graph=True gets autograd's "not implemented" error
// when that is used, not silently wrong second derivatives); the combine's is token_rows.Rows.
TORCH_LIBRARY_IMPL(sparsetrain, Autograd, m) {
  m.impl("moe_route", &route_autograd);
  m.impl("moe_route_backward", torch::autograd::autogradNotImplementedFallback());
  m.impl("moe_combine_rows", torch::autograd::autogradNotImplementedFallback());
}

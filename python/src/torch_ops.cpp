// sparsetrain's attention as C++ torch operators (`torch.ops.sparsetrain_native.*`), the eager
// path of sparsetrain.torch: at::Tensor arguments become views here, outputs come from torch's
// caching allocator (at::empty on the current stream) and go back as tensors sharing that memory,
// with no Python in between (the numpy/DLPack module `_C` crosses into Python for each allocation
// and each result). Built where the Python build's torch has its C++ headers; without this library
// importing sparsetrain.torch raises an ImportError. torch.compile keeps tracing the Python custom
// ops (sparsetrain::block_sparse_attention_*), whose implementations call these. The grouped
// layers of the same library are in torch_grouped.cpp; what both share in torch_common.h.
//
// The mask arrives as the custom ops pass it: its tensors in sparsetrain._block_mask.TENSOR_NAMES
// order then doc_q, doc_kv and the schedule permutation (undefined where absent), its sizes
// (seq_q, seq_kv, block_q, block_kv, window_left, window_right, prefix_length) and
// "kind,schedule,walk".
//
// Eager calls take a shorter way: `attention` (a function of the Python module
// sparsetrain._torch_ops) over an AttentionMask parsed once per BlockMask, in FlexAttention's
// [B, H, S, D] layout, with its autograd in C++ (a torch::autograd::Function: no Python
// autograd.Function, no dispatcher). sparsetrain.torch takes it only where the custom ops would
// see nothing of interest (not under torch.compile, fake tensors, dispatch modes or forward AD).
#include <c10/core/DeviceGuard.h>
#include <torch/autograd.h>
#include <torch/library.h>
#include <torch/python.h>

#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "sparsetrain/attention.h"
#include "sparsetrain/block_mask.h"
#include "sparsetrain/error.h"
#include "torch_common.h"

namespace st = sparsetrain;

namespace {

using st::torch_ops::stream_of;
using st::torch_ops::TorchAllocator;
using st::torch_ops::translated;
using st::torch_ops::view_of;

// A mask as the ops pass it, and its padded backward form (BlockMask::backward_padded) beside it:
// mask.backward_padded points into `padded`, which a move keeps where it is.
struct ParsedMask {
  st::BlockMask mask;
  std::unique_ptr<st::BlockMask> padded;
};

// The ops' mask arguments: tensors = the 11 index tensors (kBlockMaskTensors order), doc_q, doc_kv,
// the schedule permutation, then the padded form's 10 list tensors, doc_q, doc_kv and real_rows
// (None without one); sizes = seq_q, seq_kv, block_q, block_kv, window_left, window_right,
// prefix_length, the padded length (0: none); kinds = "kind,schedule,walk" (the padded form takes
// the mask's kind, schedule and walk).
ParsedMask mask_of(const std::vector<std::optional<at::Tensor>>& tensors, at::IntArrayRef sizes,
                   const std::string& kinds) {
  ST_CHECK_ARG(tensors.size() == 27, "mask tensors",
               "27 (the index tensors, doc_q, doc_kv, the permutation; the padded form's lists, ids and real_rows)",
               tensors.size());
  ST_CHECK_ARG(sizes.size() == 8, "mask sizes", "8", sizes.size());
  auto at_ = [&](size_t i) { return tensors[i].has_value() ? *tensors[i] : at::Tensor(); };
  ParsedMask parsed;
  st::BlockMask& m = parsed.mask;
  m.seq_q = sizes[0], m.seq_kv = sizes[1], m.block_q = sizes[2], m.block_kv = sizes[3];
  for (int i = 0; i < st::kBlockMaskTensors; ++i)
    st::block_mask_tensor(m, i) = view_of(at_(size_t(i)), st::block_mask_tensor_name(i));
  const size_t c1 = kinds.find(','), c2 = kinds.find(',', c1 + 1);
  ST_CHECK_ARG(c1 != std::string::npos && c2 != std::string::npos, "mask kinds", "\"kind,schedule,walk\"", kinds);
  m.spec.kind = st::parse_mask_kind(kinds.substr(0, c1));
  m.spec.window_left = sizes[4], m.spec.window_right = sizes[5], m.spec.prefix_length = sizes[6];
  m.spec.doc_q = view_of(at_(11), "doc_q");
  m.spec.doc_kv = view_of(at_(12), "doc_kv");
  m.schedule.kind = st::parse_schedule_kind(kinds.substr(c1 + 1, c2 - c1 - 1));
  m.schedule.walk = st::parse_walk_order(kinds.substr(c2 + 1));
  if (m.schedule.kind == st::ScheduleKind::kPermutation) {
    const at::Tensor perm = at_(13);
    ST_CHECK_ARG(perm.defined() && perm.is_cpu() && perm.dim() == 1, "schedule_permutation",
                 "a 1-d CPU tensor of column ids", perm.defined() ? perm.toString() : std::string("none"));
    const at::Tensor p32 = perm.to(at::kInt).contiguous();
    m.schedule.permutation.assign(p32.data_ptr<int32_t>(), p32.data_ptr<int32_t>() + p32.numel());
  }
  if (sizes[7] > 0) {
    ST_CHECK_ARG(m.schedule.kind != st::ScheduleKind::kPermutation, "mask schedule",
                 "left_to_right or shortest_first with a padded backward form (a permutation names the mask's columns)",
                 "permutation");
    parsed.padded = std::make_unique<st::BlockMask>();
    st::BlockMask& pm = *parsed.padded;
    pm.seq_q = pm.seq_kv = sizes[7];
    pm.block_q = m.block_q, pm.block_kv = m.block_kv;
    for (int i = 0; i < 10; ++i)  // the lists (no bitmasks: a document kind)
      st::block_mask_tensor(pm, i) = view_of(at_(size_t(14 + i)), st::block_mask_tensor_name(i));
    pm.spec = m.spec;
    pm.spec.doc_q = view_of(at_(24), "backward_padded doc_q");
    pm.spec.doc_kv = view_of(at_(25), "backward_padded doc_kv");
    pm.real_rows = view_of(at_(26), "backward_padded real_rows");
    pm.schedule.kind = m.schedule.kind;
    pm.schedule.walk = m.schedule.walk;
    m.backward_padded = &pm;
  }
  return parsed;
}

// q, k or v in FlexAttention's [B, H, S, D] layout as the core's [B, S, H, D] view (the transpose
// the custom ops take, without a dispatcher call).
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

std::tuple<at::Tensor, at::Tensor> attention_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                     const std::vector<std::optional<at::Tensor>>& mask_tensors,
                                                     at::IntArrayRef mask_sizes, const std::string& mask_kinds,
                                                     double scale, bool deterministic, int64_t sm_limit) {
  return translated([&] {
    TorchAllocator alloc;
    const st::AttentionForward f =
        st::block_sparse_attention_forward(view_of(q, "q"), view_of(k, "k"), view_of(v, "v"),
                                           mask_of(mask_tensors, mask_sizes, mask_kinds).mask,
                                           options_of(scale, deterministic, sm_limit), call_on(q, &alloc));
    return std::make_tuple(alloc.take(f.o), alloc.take(f.lse));
  });
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_backward(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& o, const at::Tensor& lse,
    const at::Tensor& dout, const std::vector<std::optional<at::Tensor>>& mask_tensors, at::IntArrayRef mask_sizes,
    const std::string& mask_kinds, double scale, bool deterministic, int64_t sm_limit) {
  return translated([&] {
    TorchAllocator alloc;
    const st::AttentionGrads g = st::block_sparse_attention_backward(
        view_of(q, "q"), view_of(k, "k"), view_of(v, "v"), view_of(o, "o"), view_of(lse, "lse"),
        view_of(dout, "dout"), mask_of(mask_tensors, mask_sizes, mask_kinds).mask,
        options_of(scale, deterministic, sm_limit), call_on(q, &alloc));
    return std::make_tuple(alloc.take(g.dq), alloc.take(g.dk), alloc.take(g.dv));
  });
}

// A BlockMask as the custom ops pass it, parsed once: sparsetrain.torch keeps one per BlockMask
// (while that holds the same tensor objects) for its eager calls. A tensor moved in place since
// (set_, resize_ to another address) makes a call parse the mask anew.
class AttentionMask {
 public:
  AttentionMask(std::vector<std::optional<at::Tensor>> tensors, std::vector<int64_t> sizes, std::string kinds)
      : tensors_(std::move(tensors)), sizes_(std::move(sizes)), kinds_(std::move(kinds)),
        mask_(translated([&] { return mask_of(tensors_, sizes_, kinds_); })) {
    for (const auto& t : tensors_) data_.push_back(data_of(t));
  }

  // The parsed mask, or `scratch` parsed anew where a tensor moved.
  const st::BlockMask& current(ParsedMask& scratch) const {
    for (size_t i = 0; i < tensors_.size(); ++i)
      if (data_of(tensors_[i]) != data_[i]) return (scratch = mask_of(tensors_, sizes_, kinds_)).mask;
    return mask_.mask;
  }

  const std::vector<std::optional<at::Tensor>>& tensors() const { return tensors_; }
  const std::vector<int64_t>& sizes() const { return sizes_; }
  const std::string& kinds() const { return kinds_; }

 private:
  static const void* data_of(const std::optional<at::Tensor>& t) {
    return t.has_value() && t->defined() ? t->data_ptr() : nullptr;
  }

  std::vector<std::optional<at::Tensor>> tensors_;
  std::vector<int64_t> sizes_;
  std::string kinds_;
  ParsedMask mask_;
  std::vector<const void*> data_;
};

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Attention's autograd in C++, the same computation as sparsetrain.torch's _AttentionFunction:
// saves q, k, v, o, lse and the mask's tensors (version-checked as save_for_backward does); lse has
// no gradient; the backward reads torch's deterministic mode again when it runs.
struct AttentionFunction : public torch::autograd::Function<AttentionFunction> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                               const AttentionMask* mask, double scale, bool deterministic, int64_t sm_limit) {
    const c10::DeviceGuard guard(q.device());  // q's device current, as the `_C` path's torch.cuda.device
    ParsedMask scratch;
    TorchAllocator alloc;
    const st::AttentionForward f = st::block_sparse_attention_forward(
        bshd_view_of(q, "q"), bshd_view_of(k, "k"), bshd_view_of(v, "v"), mask->current(scratch),
        options_of(scale, deterministic, sm_limit), call_on(q, &alloc));
    at::Tensor o = alloc.take(f.o, /*swap_1_2=*/true), lse = alloc.take(f.lse);
    ctx->mark_non_differentiable({lse});
    // lse has no gradient: no zero tensor for it (a fill kernel a backward); o's may be undefined
    // (o unused), then so are q's, k's and v's.
    ctx->set_materialize_grads(false);
    std::vector<at::Tensor> saved{q, k, v, o, lse};
    for (const auto& t : mask->tensors()) saved.push_back(t.value_or(at::Tensor()));
    ctx->save_for_backward(saved);
    ctx->saved_data["sizes"] = mask->sizes();
    ctx->saved_data["kinds"] = mask->kinds();
    ctx->saved_data["scale"] = scale;
    ctx->saved_data["deterministic"] = deterministic;
    ctx->saved_data["sm_limit"] = sm_limit;
    return {o, lse};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return translated([&] {
      const variable_list s = ctx->get_saved_variables();
      const c10::DeviceGuard guard(s[0].device());
      std::vector<std::optional<at::Tensor>> mask_tensors;
      for (size_t i = 5; i < s.size(); ++i)
        mask_tensors.push_back(s[i].defined() ? std::optional<at::Tensor>(s[i]) : std::nullopt);
      const std::vector<int64_t> sizes = ctx->saved_data["sizes"].toIntVector();
      at::Tensor dout = grads[0];
      if (!dout.defined()) return variable_list(7);  // as the inputs: q, k, v, then four without gradients
      if (dout.stride(-1) != 1) dout = dout.contiguous();
      const bool deterministic =
          ctx->saved_data["deterministic"].toBool() || at::globalContext().deterministicAlgorithms();
      TorchAllocator alloc;
      const st::AttentionGrads g = st::block_sparse_attention_backward(
          bshd_view_of(s[0], "q"), bshd_view_of(s[1], "k"), bshd_view_of(s[2], "v"), bshd_view_of(s[3], "o"),
          view_of(s[4], "lse"), bshd_view_of(dout, "dout"),
          mask_of(mask_tensors, sizes, ctx->saved_data["kinds"].toStringRef()).mask,
          options_of(ctx->saved_data["scale"].toDouble(), deterministic, ctx->saved_data["sm_limit"].toInt()),
          call_on(s[0], &alloc));
      return variable_list{alloc.take(g.dq, true), alloc.take(g.dk, true), alloc.take(g.dv, true), {}, {}, {}, {}};
    });
  }
};

// (o [B, Hq, Sq, D], lse [B, Hq, Sq]) of q, k, v in [B, H, S, D], recorded by autograd where an
// input requires grad.
std::tuple<at::Tensor, at::Tensor> attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                             const AttentionMask& mask, double scale, bool deterministic,
                                             int64_t sm_limit) {
  return translated([&] {
    const variable_list r = AttentionFunction::apply(q, k, v, &mask, scale, deterministic, sm_limit);
    return std::make_tuple(r[0], r[1]);
  });
}

}  // namespace

void st::torch_ops::register_attention(pybind11::module_& m) {
  pybind11::class_<AttentionMask>(m, "AttentionMask")
      .def(pybind11::init<std::vector<std::optional<at::Tensor>>, std::vector<int64_t>, std::string>());
  m.def("attention", &attention);
}

TORCH_LIBRARY(sparsetrain_native, m) {
  m.def("attention_forward(Tensor q, Tensor k, Tensor v, Tensor?[] mask_tensors, int[] mask_sizes, str mask_kinds, "
        "float scale, bool deterministic, int sm_limit) -> (Tensor, Tensor)");
  m.def("attention_backward(Tensor q, Tensor k, Tensor v, Tensor o, Tensor lse, Tensor dout, Tensor?[] mask_tensors, "
        "int[] mask_sizes, str mask_kinds, float scale, bool deterministic, int sm_limit) -> (Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(sparsetrain_native, CompositeExplicitAutograd, m) {
  m.impl("attention_forward", &attention_forward);
  m.impl("attention_backward", &attention_backward);
}

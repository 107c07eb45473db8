// sparsetrain's attention as C++ torch operators (`torch.ops.sparsetrain_native.*`), the eager
// path of sparsetrain.torch: at::Tensor arguments become views here, outputs come from torch's
// caching allocator (at::empty on the current stream) and go back as tensors sharing that memory,
// with no Python in between (the numpy/DLPack module `_C` crosses into Python for each allocation
// and each result). Built where the Python build's torch has its C++ headers; sparsetrain.torch
// falls back to `_C` where this library is absent. torch.compile keeps tracing the Python custom
// ops (sparsetrain::block_sparse_attention_*), whose implementations call these. The grouped
// layers of the same library are in torch_grouped.cpp; what both share in torch_common.h.
//
// The mask arrives as the custom ops pass it: its tensors in sparsetrain._block_mask.TENSOR_NAMES
// order then doc_q, doc_kv and the schedule permutation (undefined where absent), its sizes
// (seq_q, seq_kv, block_q, block_kv, sub_tiles, window_left, window_right, prefix_length) and
// "kind,schedule,walk".
#include <torch/library.h>

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

st::BlockMask mask_of(const std::vector<std::optional<at::Tensor>>& tensors, at::IntArrayRef sizes,
                      const std::string& kinds) {
  ST_CHECK_ARG(tensors.size() == 14, "mask tensors", "14 (the index tensors, doc_q, doc_kv, the permutation)",
               tensors.size());
  ST_CHECK_ARG(sizes.size() == 8, "mask sizes", "8", sizes.size());
  auto at_ = [&](size_t i) { return tensors[i].has_value() ? *tensors[i] : at::Tensor(); };
  st::BlockMask m;
  m.seq_q = sizes[0], m.seq_kv = sizes[1], m.block_q = sizes[2], m.block_kv = sizes[3];
  m.write_order_sub_tiles = sizes[4];
  for (int i = 0; i < st::kBlockMaskTensors; ++i)
    st::block_mask_tensor(m, i) = view_of(at_(size_t(i)), st::block_mask_tensor_name(i));
  const size_t c1 = kinds.find(','), c2 = kinds.find(',', c1 + 1);
  ST_CHECK_ARG(c1 != std::string::npos && c2 != std::string::npos, "mask kinds", "\"kind,schedule,walk\"", kinds);
  m.spec.kind = st::parse_mask_kind(kinds.substr(0, c1));
  m.spec.window_left = sizes[5], m.spec.window_right = sizes[6], m.spec.prefix_length = sizes[7];
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
  return m;
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
                                           mask_of(mask_tensors, mask_sizes, mask_kinds),
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
        view_of(dout, "dout"), mask_of(mask_tensors, mask_sizes, mask_kinds),
        options_of(scale, deterministic, sm_limit), call_on(q, &alloc));
    return std::make_tuple(alloc.take(g.dq), alloc.take(g.dk), alloc.take(g.dv));
  });
}

}  // namespace

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

// BlockMask.build's torch route (sparsetrain/_block_mask.py): the core's builders (block_mask.h)
// with memory from torch's caching allocator on the current stream, the results handed back as
// tensors over it (TorchAllocator::take). Through the numpy/DLPack module `_C` every allocation
// and every result tensor is a Python call, most of a GPU build's host time (docs/PERF.md,
// Block-mask build); here none is. One call also builds a document mask's padded backward form.
#include <pybind11/stl.h>
#include <torch/python.h>

#ifdef SPARSETRAIN_TORCH_CUDA
#include <c10/cuda/CUDAStream.h>
#endif

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "sparsetrain/block_mask.h"
#include "sparsetrain/error.h"
#include "mask_options.h"
#include "torch_common.h"

namespace st = sparsetrain;
namespace py = pybind11;

namespace {

using st::torch_ops::TorchAllocator;

// A built mask as BlockMask._from_core reads it (the keys of `_C`'s export_mask), its tensors
// torch tensors (None where absent).
py::dict exported(const st::BlockMaskTensors& t, const TorchAllocator& alloc) {
  py::dict d;
  const st::BlockMask& m = t.mask;
  d["seq_q"] = m.seq_q;
  d["seq_kv"] = m.seq_kv;
  d["block_q"] = m.block_q;
  d["block_kv"] = m.block_kv;
  for (int i = 0; i < st::kBlockMaskTensors; ++i) {
    const st::Tensor& owned = st::block_mask_tensor(t, i);
    d[st::block_mask_tensor_name(i)] = owned.defined() ? py::cast(alloc.take(owned)) : py::none();
  }
  d["schedule"] = st::schedule_kind_name(m.schedule.kind);
  d["schedule_walk"] = st::walk_order_name(m.schedule.walk);
  d["schedule_permutation"] =
      m.schedule.kind == st::ScheduleKind::kPermutation ? py::cast(m.schedule.permutation) : py::none();
  return d;
}

// schedule: "auto", "left_to_right", "shortest_first", or "" with `permutation`; walk "" for the
// default; problem empty or 4 values; device_index -1 builds on the host, else on that CUDA device
// (torch's current stream there); doc_padding > 0 (a document kind, seq_q == seq_kv) adds the
// padded backward form as "padded" (with its doc_q, doc_kv and real_rows), for the schedule and
// walk the mask resolved to.
py::dict build_block_mask_entry(const std::string& kind, int64_t seq_q, int64_t seq_kv, int64_t window_left,
                                int64_t window_right, int64_t prefix_length, const std::optional<at::Tensor>& doc_q,
                                const std::optional<at::Tensor>& doc_kv, int64_t block_q, int64_t block_kv,
                                const std::string& schedule, const std::vector<int32_t>& permutation,
                                const std::string& walk, const std::vector<int64_t>& problem, int64_t device_index,
                                int64_t doc_padding) {
  return st::torch_ops::translated([&] {
    TorchAllocator alloc;
    st::MaskSpec spec;
    spec.kind = st::parse_mask_kind(kind);
    spec.window_left = window_left, spec.window_right = window_right, spec.prefix_length = prefix_length;
    spec.doc_q = st::torch_ops::view_of(doc_q, "doc_q");
    spec.doc_kv = st::torch_ops::view_of(doc_kv, "doc_kv");
    const bool is_auto = schedule == "auto";
    const st::ColumnSchedule s =
        is_auto ? st::ColumnSchedule{} : st::wire::column_schedule(schedule, permutation, walk);
    st::BlockMaskOptions o =
        st::wire::mask_options(block_q, block_kv, is_auto, s, st::wire::schedule_problem(problem), &alloc);
    if (device_index >= 0) {
#ifdef SPARSETRAIN_TORCH_CUDA
      o.device = st::Device::cuda(int(device_index));
      o.stream.handle = c10::cuda::getCurrentCUDAStream(c10::DeviceIndex(device_index)).stream();
#else
      st::detail::throw_arg_error("device", "cpu (this torch library was built without CUDA)",
                                  "cuda:" + std::to_string(device_index));
#endif
    }
    const st::BlockMaskTensors t = st::build_block_mask(spec, seq_q, seq_kv, o);
    py::dict d = exported(t, alloc);
    d["padded"] = py::none();
    if (doc_padding > 0) {
      st::BlockMaskOptions po = o;
      po.auto_schedule = false;
      po.schedule = t.mask.schedule;
      const st::BlockMaskTensors p = st::build_doc_padded_mask(spec, seq_q, doc_padding, po);
      py::dict pd = exported(p, alloc);
      pd["doc_q"] = alloc.take(p.doc_q);
      pd["doc_kv"] = alloc.take(p.doc_kv);
      pd["real_rows"] = alloc.take(p.real_rows);
      d["padded"] = pd;
    }
    return d;
  });
}

}  // namespace

void st::torch_ops::register_block_mask(py::module_& m) { m.def("build_block_mask", &build_block_mask_entry); }

// BlockMask.build's and BlockMask.from_torch's torch routes (sparsetrain/_block_mask.py): the core's
// builders (block_mask.h) with memory from torch's caching allocator on the current stream, the
// results handed back as tensors over it (TorchAllocator::take). Through the numpy/DLPack module `_C`
// every allocation and every result tensor is a Python call, most of a GPU build's host time
// (docs/PERF.md, Block-mask build); here none is. One call also builds a document mask's padded
// backward form, or moves a mask built on the host to a GPU.
#include <pybind11/stl.h>
#include <torch/python.h>

#ifdef SPARSETRAIN_TORCH_CUDA
#include <c10/cuda/CUDAStream.h>
#endif

#include <cstdint>
#include <cstring>
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

// The build options both entries take. schedule: "auto", "left_to_right", "shortest_first", or ""
// with `permutation`; walk "" for the default; problem empty or 4 values.
st::BlockMaskOptions options_of(int64_t block_q, int64_t block_kv, const std::string& schedule,
                                const std::vector<int32_t>& permutation, const std::string& walk,
                                const std::vector<int64_t>& problem, TorchAllocator* alloc) {
  const bool is_auto = schedule == "auto";
  const st::ColumnSchedule s = is_auto ? st::ColumnSchedule{} : st::wire::column_schedule(schedule, permutation, walk);
  return st::wire::mask_options(block_q, block_kv, is_auto, s, st::wire::schedule_problem(problem), alloc);
}

// device_index -1: the host; else that CUDA device.
void check_cuda_built(int64_t device_index) {
#ifndef SPARSETRAIN_TORCH_CUDA
  if (device_index >= 0)
    st::detail::throw_arg_error("device", "cpu (this torch library was built without CUDA)",
                                "cuda:" + std::to_string(device_index));
#endif
  (void)device_index;
}

// Host tensors on CUDA device `device_index` in one copy: packed at 256-byte boundaries (as
// allocations of their own would be) into one pinned buffer, copied on torch's current stream
// without waiting, and handed back as views of one device allocation. One at a time each would be
// a copy from pageable memory, which waits for the GPU: a dozen of them a mask.
std::vector<at::Tensor> to_device_packed(const std::vector<at::Tensor>& host, int64_t device_index) {
  constexpr int64_t kAlign = 256;
  std::vector<int64_t> offsets;
  int64_t total = 0;
  for (const at::Tensor& t : host) {
    if (!t.is_contiguous()) ST_FAIL("internal: to_device_packed of a non-contiguous tensor");
    offsets.push_back(total);
    total += (int64_t(t.nbytes()) + kAlign - 1) / kAlign * kAlign;
  }
  at::Tensor pinned = at::empty({total}, at::TensorOptions().dtype(at::kByte).pinned_memory(true));
  for (size_t i = 0; i < host.size(); ++i)
    if (host[i].nbytes() > 0)
      std::memcpy(static_cast<char*>(pinned.data_ptr()) + offsets[i], host[i].data_ptr(), host[i].nbytes());
  at::Tensor device = at::empty({total}, at::TensorOptions().dtype(at::kByte).device(at::kCUDA, device_index));
  device.copy_(pinned, /*non_blocking=*/true);  // the pinned block is held until the copy is done
  std::vector<at::Tensor> out;
  for (size_t i = 0; i < host.size(); ++i)
    out.push_back(
        device.narrow(0, offsets[i], int64_t(host[i].nbytes())).view(host[i].scalar_type()).view(host[i].sizes()));
  return out;
}

// device_index -1 builds on the host, else on that CUDA device (torch's current stream there);
// doc_padding > 0 (a document kind, seq_q == seq_kv) adds the padded backward form as "padded"
// (with its doc_q, doc_kv and real_rows), for the schedule and walk the mask resolved to.
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
    st::BlockMaskOptions o = options_of(block_q, block_kv, schedule, permutation, walk, problem, &alloc);
    check_cuda_built(device_index);
#ifdef SPARSETRAIN_TORCH_CUDA
    if (device_index >= 0) {
      o.device = st::Device::cuda(int(device_index));
      o.stream.handle = c10::cuda::getCurrentCUDAStream(c10::DeviceIndex(device_index)).stream();
    }
#endif
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

// BlockMask.from_torch's route: a flex BlockMask's lists (host tensors; the full ones None when
// absent, leading dims broadcast to [batch, heads]) as the dense block matrix
// (block_matrix_from_flex), the mask built from it on the host (build_block_mask_from_blocks) and
// the partial blocks' places (partial_block_places: "partial_blocks", "partial_width"); for
// device_index >= 0 all of them then on that CUDA device in one copy (to_device_packed).
py::dict build_block_mask_from_flex_entry(const at::Tensor& kv_num_blocks, const at::Tensor& kv_indices,
                                          const std::optional<at::Tensor>& full_kv_num_blocks,
                                          const std::optional<at::Tensor>& full_kv_indices, int64_t batch,
                                          int64_t heads, int64_t seq_q, int64_t seq_kv, int64_t block_q,
                                          int64_t block_kv, const std::string& schedule,
                                          const std::vector<int32_t>& permutation, const std::string& walk,
                                          const std::vector<int64_t>& problem, int64_t device_index) {
  return st::torch_ops::translated([&] {
    check_cuda_built(device_index);
    TorchAllocator alloc;
    const st::BlockMaskOptions o = options_of(block_q, block_kv, schedule, permutation, walk, problem, &alloc);
    st::FlexBlockLists l;
    l.kv_num_blocks = st::torch_ops::view_of(kv_num_blocks, "kv_num_blocks");
    l.kv_indices = st::torch_ops::view_of(kv_indices, "kv_indices");
    l.full_kv_num_blocks = st::torch_ops::view_of(full_kv_num_blocks, "full_kv_num_blocks");
    l.full_kv_indices = st::torch_ops::view_of(full_kv_indices, "full_kv_indices");
    ST_CHECK_ARG(block_q >= 1 && block_kv >= 1, "block_q / block_kv", ">= 1", block_q, ", ", block_kv);
    const st::Tensor blocks = st::block_matrix_from_flex(l, batch, heads, (seq_kv + block_kv - 1) / block_kv, &alloc);
    int64_t width = 0;
    const at::Tensor places = alloc.take(st::partial_block_places(blocks.view(), block_q, block_kv, &width, &alloc));
    const st::BlockMaskTensors t = st::build_block_mask_from_blocks(blocks.view(), seq_q, seq_kv, o);
    py::dict d = exported(t, alloc);
    d["partial_width"] = width;
    if (device_index < 0) {
      d["partial_blocks"] = places;
      return d;
    }
    std::vector<at::Tensor> host{places};
    std::vector<const char*> names;
    for (int i = 0; i < st::kBlockMaskTensors; ++i)
      if (!d[st::block_mask_tensor_name(i)].is_none()) {
        names.push_back(st::block_mask_tensor_name(i));
        host.push_back(d[names.back()].cast<at::Tensor>());
      }
    const std::vector<at::Tensor> moved = to_device_packed(host, device_index);
    d["partial_blocks"] = moved[0];
    for (size_t i = 0; i < names.size(); ++i) d[names[i]] = moved[i + 1];
    return d;
  });
}

}  // namespace

void st::torch_ops::register_block_mask(py::module_& m) {
  m.def("build_block_mask", &build_block_mask_entry);
  m.def("build_block_mask_from_flex", &build_block_mask_from_flex_entry);
}

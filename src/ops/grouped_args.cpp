// The argument rules of the row-grouped ops (see grouped_args.h).
#include "ops/grouped_args.h"

#include <vector>

#include "common/group_offsets.h"
#include "ops/checks.h"

namespace sparsetrain::ops {

using backend::GroupedLinearBackend;

void check_grouped_param(const GroupedParam& p, const std::string& name, int64_t G,
                         std::initializer_list<int64_t> slice_shape, const std::string& slice_desc,
                         DType dtype, Device device) {
  const int slice_dim = int(slice_shape.size());
  if (p.is_packed()) {
    const TensorView& v = p.views()[0];
    checks::defined(v, name, "a packed tensor of shape [G, " + slice_desc + "]");
    bool shape_ok = v.dim() == slice_dim + 1 && v.size(0) == G;
    int d = 1;
    for (int64_t s : slice_shape) shape_ok = shape_ok && v.size(d++) == s;
    ST_CHECK_ARG(shape_ok, name.c_str(),
                 "packed shape [" + std::to_string(G) + " (num_groups), " + slice_desc + "]", v.shape_str());
    int64_t slice_numel = 1;
    for (int64_t s : slice_shape) slice_numel *= s;
    ST_CHECK_ARG(G == 1 || v.stride(0) >= slice_numel, name.c_str(),
                 "non-overlapping groups (stride of dim 0 >= " + std::to_string(slice_numel) + ")", v.stride(0));
  } else {
    ST_CHECK_ARG(int64_t(p.views().size()) == G, name.c_str(),
                 std::to_string(G) + " per-group tensors (num_groups)", p.views().size());
  }
  for (int64_t g = 0; g < G; ++g) {
    const TensorView v = p.is_packed() ? p.views()[0].select(g) : p.views()[size_t(g)];
    const std::string n = p.is_packed() ? name : name + "[" + std::to_string(g) + "]";
    checks::defined(v, n, "a tensor of shape [" + slice_desc + "]");
    checks::shape(v, n, slice_shape, "[" + slice_desc + "]");
    checks::dtype(v, n, dtype);
    checks::device(v, n, device);
    checks::contiguous(v, n);
    checks::non_null(v, n);
  }
}

void check_out_buffer(const TensorView& buf, const char* name, DType dtype, Device device, int64_t cols,
                      int64_t min_rows, const char* rows_rule) {
  ST_CHECK_ARG(buf.dim() == 2 && buf.size(1) == cols && buf.size(0) >= min_rows, name,
               "shape [>= " + std::to_string(min_rows) + " (" + rows_rule + "), " + std::to_string(cols) + "]",
               buf.shape_str());
  checks::dtype(buf, name, dtype, " (the layer's dtype)");
  checks::device(buf, name, device);
  checks::contiguous(buf, name);
  checks::non_null(buf, name);
}

void check_activation(const TensorView& t, const char* name, DType dtype, Device device, int64_t rows,
                      int64_t cols, const char* cols_desc) {
  checks::defined(t, name, "a tensor of shape [T, " + std::string(cols_desc) + "]");
  ST_CHECK_ARG(t.dim() == 2 && t.size(1) == cols && (rows < 0 || t.size(0) == rows), name,
               "shape [" + (rows < 0 ? std::string("T") : std::to_string(rows) + " (the rows of x)") + ", " +
                   std::to_string(cols) + " (" + cols_desc + ")]",
               t.shape_str());
  checks::dtype(t, name, dtype, " (the layer's dtype)");
  checks::device(t, name, device);
  checks::rows_contiguous(t, name);
  checks::non_null(t, name);
}

namespace {

void check_host_split_values(const std::vector<int64_t>& v, int64_t T, const char* name) {
  int64_t sum = 0;
  for (size_t g = 0; g < v.size(); ++g) {
    ST_CHECK_ARG(v[g] >= 0, name, "entries >= 0", v[g], " at index ", g);
    ST_CHECK_ARG(v[g] <= T - sum, name, "a sum <= " + std::to_string(T) + " (the rows of x)",
                 "a sum of at least ", sum + v[g], " at index ", g);
    sum += v[g];
  }
}

}  // namespace

int64_t check_splits(const Splits& s, int64_t G, int64_t T, Device device, bool checked_mode,
                     GroupedLinearBackend& be, Stream stream) {
  ST_CHECK_ARG(s.defined(), "splits", "host or device splits of shape [" + std::to_string(G) + "]", "none");
  const std::string shape_rule = "shape [" + std::to_string(G) + "] (num_groups)";
  if (!s.on_device()) {
    const auto& v = s.host_values();
    ST_CHECK_ARG(int64_t(v.size()) == G, "splits", shape_rule, "[", v.size(), "]");
    check_host_split_values(v, T, "splits");
    int64_t sum = 0;
    for (int64_t x : v) sum += x;
    return sum;
  }
  const TensorView& v = s.device_values();
  checks::shape(v, "splits", {G}, "[" + std::to_string(G) + "] (num_groups)");
  checks::dtype(v, "splits", DType::kInt64, " (device splits)");
  checks::device(v, "splits", device);
  checks::contiguous(v, "splits");
  checks::non_null(v, "splits");
  if (s.status().defined()) {
    const TensorView& st = s.status();
    ST_CHECK_ARG(st.numel() == 1, "splits status", "one element", st.shape_str());
    checks::dtype(st, "splits status", DType::kInt32);
    checks::device(st, "splits status", device);
    checks::non_null(st, "splits status");
  }
  if (checked_mode) check_host_split_values(be.read_int64(v, stream), T, "splits (device, checked mode)");
  return -1;
}

const int64_t* prepare_offsets(const Splits& s, int64_t T, int64_t* offsets, int32_t* status_sink,
                               GroupedLinearBackend& be, Device device, Stream stream, std::vector<int64_t>* fold) {
  if (s.on_device()) {
    int32_t* status = s.status().defined() ? s.status().data_as<int32_t>() : status_sink;
    be.setup_device_splits(s.device_values(), T, offsets, status, stream);
    return nullptr;
  }
  const auto& v = s.host_values();
  std::vector<int64_t> local;
  const bool folded = fold != nullptr && be.folds_host_offsets();
  std::vector<int64_t>& host_offsets = folded ? *fold : local;
  host_offsets.resize(v.size() + 1);
  compute_group_offsets(v.data(), int64_t(v.size()), T, host_offsets.data(), nullptr);
  if (folded) return host_offsets.data();  // the backend's first kernel writes them
  be.write_host_offsets(offsets, host_offsets.data(), int64_t(host_offsets.size()), device, stream);
  return nullptr;
}

void check_workspace(size_t required, const Workspace& given) {
  if (given.data == nullptr) return;
  ST_CHECK_ARG(given.bytes >= required, "workspace", ">= " + std::to_string(required) + " bytes", given.bytes,
               " bytes");
  ST_CHECK_ARG(reinterpret_cast<uintptr_t>(given.data) % kAllocAlignment == 0, "workspace",
               "a 256-byte aligned address", given.data);
}

WorkspaceMemory::WorkspaceMemory(size_t bytes, const Workspace& given, Device device, Allocator& alloc,
                                 Stream stream) {
  // Every op makes its workspace first, once its arguments are checked: the one place to refuse a
  // GPU that has no kernel image in this build.
  checks::device_runs(device, checks::Kernels::kGeneric, "device");
  if (given.data != nullptr) {
    base_ = static_cast<char*>(given.data);
  } else {
    owned_ = Tensor::empty(DType::kInt32, {int64_t(round_up(bytes, 4) / 4)}, device, alloc, stream);
    base_ = static_cast<char*>(owned_.view().data());
  }
}

std::vector<TensorView> group_views(const GroupedParam& p, int64_t G) {
  std::vector<TensorView> v;
  if (!p.present()) return v;
  for (int64_t g = 0; g < G; ++g) v.push_back(p.group(g));
  return v;
}

}  // namespace sparsetrain::ops

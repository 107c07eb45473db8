// Argument rules of the row-grouped ops (GroupedLinear, GroupedMLP), held once: grouped
// parameters, activations, caller output buffers, host/device splits and the splits -> group
// offsets set-up. Every check raises sparsetrain::Error naming the argument; callers run all of
// them before writing or allocating anything.
#pragma once

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <string>
#include <vector>

#include "ops/grouped_linear_backend.h"
#include "sparsetrain/grouped_linear.h"

namespace sparsetrain::ops {

constexpr size_t round_up(size_t n, size_t to) { return (n + to - 1) / to * to; }

// One grouped parameter: G slices of `slice_shape` (described by `slice_desc` in messages), each
// contiguous, of `dtype` on `device`; packed [G, ...] or G per-group views.
void check_grouped_param(const GroupedParam& p, const std::string& name, int64_t G,
                         std::initializer_list<int64_t> slice_shape, const std::string& slice_desc,
                         DType dtype, Device device);

// A 2-D activation input [rows, cols] (rows < 0: any) with contiguous rows.
void check_activation(const TensorView& t, const char* name, DType dtype, Device device, int64_t rows,
                      int64_t cols, const char* cols_desc);

// A caller output buffer: contiguous [>= min_rows, cols] of `dtype` on `device`.
void check_out_buffer(const TensorView& buf, const char* name, DType dtype, Device device, int64_t cols,
                      int64_t min_rows, const char* rows_rule);

// Validates splits for G groups over T rows; returns S for host splits and -1 for device splits
// (S unknown to the host). `checked_mode` reads device splits back (a sync) and checks them too.
int64_t check_splits(const Splits& s, int64_t G, int64_t T, Device device, bool checked_mode,
                     backend::GroupedLinearBackend& be, Stream stream);

// The rows a caller output buffer needs: S with host splits, T with device splits (S < 0).
inline int64_t min_out_rows(int64_t S, int64_t T) { return S < 0 ? T : S; }
inline const char* min_out_rows_rule(int64_t S) { return S < 0 ? "T: device splits" : "S: host splits"; }

// Whether a library-allocated output of T rows has rows past the splits' sum to zero: unless host
// splits cover every row (S == T); with device splits (S < 0) the host cannot tell. Skipping the
// zeroing kernel saves its launch (~3 us of host time a call).
inline bool has_tail_rows(int64_t S, int64_t T) { return S != T; }

// Fills offsets[G + 1] on the compute device `device` from validated splits. `status_sink`: where
// device splits without a caller status word report (one int32 on the device). With `fold` and a
// backend that folds_host_offsets(), host splits' offsets go into *fold instead, and the result
// points at them, for GroupedProblem::host_offsets (the backend's first kernel writes them);
// otherwise the result is null.
const int64_t* prepare_offsets(const Splits& s, int64_t T, int64_t* offsets, int32_t* status_sink,
                               backend::GroupedLinearBackend& be, Device device, Stream stream,
                               std::vector<int64_t>* fold = nullptr);

// A caller workspace must hold `required` bytes at a 256-byte aligned address (none given is fine:
// the op takes one from its allocator).
void check_workspace(size_t required, const Workspace& given);

// The workspace memory of one call: the caller's, or `bytes` taken from the allocator for the
// duration of the call.
class WorkspaceMemory {
 public:
  WorkspaceMemory(size_t bytes, const Workspace& given, Device device, Allocator& alloc, Stream stream);
  char* at(size_t offset) const { return base_ + offset; }

 private:
  char* base_ = nullptr;
  Tensor owned_;
};

// The G per-group views of a parameter (none if absent).
std::vector<TensorView> group_views(const GroupedParam& p, int64_t G);

}  // namespace sparsetrain::ops

// The internal interface every GroupedLinear backend implements (CPU reference now, CUDA later).
// ops/grouped_linear.cpp owns every rule (validation, workspace planning, output allocation, the
// weight-grad disposition); a backend only runs the three grouped GEMMs on validated arguments.
// Params are framework-free (views + the device-resident group offsets) in the style of FA3's
// params structs.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "sparsetrain/allocator.h"
#include "sparsetrain/splits.h"
#include "sparsetrain/tensor.h"

namespace sparsetrain::backend {

struct GroupedProblem {
  DType dtype;
  int64_t num_groups;
  int64_t num_rows;  // T
  int64_t in;
  int64_t out;
  const int64_t* offsets;  // [G + 1] on the compute device: group g owns rows [offsets[g], offsets[g+1])
  // Host splits' offsets [G + 1] not yet in `offsets` (prepare_offsets with folding, on a backend
  // whose folds_host_offsets()): the call's first kernel writes them there.
  const int64_t* host_offsets = nullptr;
};

struct FpropParams {
  GroupedProblem problem;
  TensorView x;                    // [T, in]
  std::vector<TensorView> weight;  // G x [out, in]
  std::vector<TensorView> bias;    // empty or G x [out]
  TensorView y;                    // [>= S rows, out], contiguous
  bool zero_tail;                  // also zero y's rows [S, y rows)
};

struct DgradParams {
  GroupedProblem problem;
  TensorView dy;                   // [T, out]
  std::vector<TensorView> weight;  // G x [out, in]
  TensorView dx;                   // [>= S rows, in], contiguous
  bool zero_tail;
};

enum class WgradTarget {
  kWeightGrad,          // dw in the layer's dtype; a group with no rows gets 0
  kMainGradAccumulate,  // fp32 dw += wgrad; a group with no rows is left untouched
  kMainGradOverwrite,   // fp32 dw = wgrad; a group with no rows gets 0
};

struct WgradParams {
  GroupedProblem problem;
  TensorView x, dy;            // [T, in], [T, out]
  WgradTarget target;
  std::vector<TensorView> dw;  // G x [out, in]
  std::vector<TensorView> db;  // empty or G x [out] in the layer's dtype; 0 for a group with no rows
};

class GroupedLinearBackend {
 public:
  virtual ~GroupedLinearBackend() = default;

  // Largest number of groups one launch takes.
  virtual int64_t max_groups() const = 0;
  // Scratch the GEMMs need beyond the offsets; a function of the shapes only.
  virtual size_t scratch_bytes(DType dtype, int64_t num_groups, int64_t num_rows, int64_t in,
                               int64_t out) const = 0;
  // Device splits -> offsets[G + 1] (and status bits), on the stream, without a host sync.
  virtual void setup_device_splits(const TensorView& splits, int64_t num_rows, int64_t* offsets,
                                   int32_t* status, Stream stream) = 0;
  // Host splits' offsets (`count` values, at most max_groups() + 1) into `dst` on the compute
  // device `device`, on the stream. CUDA: a kernel that takes the values in its parameters, so the
  // host neither stages a pageable copy nor waits, and a captured graph keeps the values.
  virtual void write_host_offsets(int64_t* dst, const int64_t* values, int64_t count, Device device,
                                  Stream stream) = 0;
  // Whether fprop and dgrad take host splits' offsets in GroupedProblem::host_offsets and write
  // them with their first kernel (CUDA: the sm90 GEMM's set-up kernel; one launch fewer a call).
  virtual bool folds_host_offsets() const { return false; }
  // Read a device tensor of int64 back to the host (synchronises: checked mode only).
  virtual std::vector<int64_t> read_int64(const TensorView& t, Stream stream) = 0;
  virtual void fill_zero(const TensorView& t, Stream stream) = 0;

  virtual void fprop(const FpropParams& p, void* scratch, Stream stream) = 0;
  virtual void dgrad(const DgradParams& p, void* scratch, Stream stream) = 0;
  virtual void wgrad(const WgradParams& p, void* scratch, Stream stream) = 0;
};

GroupedLinearBackend& reference_backend();
#if SPARSETRAIN_WITH_CUDA
GroupedLinearBackend& cuda_backend();
#endif
// The backend that runs on `device`; an Error naming `arg` if this build has none for it.
GroupedLinearBackend& backend_for(Device device, const char* arg);

}  // namespace sparsetrain::backend

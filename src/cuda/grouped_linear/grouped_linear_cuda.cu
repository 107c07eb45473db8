// The CUDA backend of GroupedLinear: the device set-up kernel (device splits -> offsets, never
// read by the host), and dispatch of the grouped GEMMs by element type. Every launch goes on the
// caller's stream; nothing synchronises the host except read_int64 (checked mode only).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstring>
#include <initializer_list>
#include <type_traits>

#include "common/dispatch_dtype.h"
#include "common/group_offsets.h"
#include "cuda/cuda_check.h"
#include "cuda/device_cache.h"
#include "cuda/grouped_linear/grouped_gemm_params.h"
#include "cuda/runtime_cuda.h"
#include "ops/grouped_linear_backend.h"
#include "sm90/sm90_instances.h"
#include "sparsetrain/error.h"

namespace sparsetrain::backend {
namespace {

using cuda::GemmKind;
using cuda::GroupedGemmParams;

cudaStream_t as_cuda(Stream s) { return static_cast<cudaStream_t>(s.handle); }

// One thread: G is at most cuda::kMaxGroups and this runs once per call.
__global__ void setup_offsets_kernel(const int64_t* splits, int64_t num_groups, int64_t num_rows, int64_t* offsets,
                                     int32_t* status) {
  compute_group_offsets(splits, num_groups, num_rows, offsets, status);
}

GroupedGemmParams base_params(GemmKind kind, const GroupedProblem& pr) {
  GroupedGemmParams p;
  std::memset(&p, 0, sizeof(p));
  p.kind = kind;
  p.num_groups = pr.num_groups;
  p.num_rows = pr.num_rows;
  p.in = pr.in;
  p.out = pr.out;
  p.offsets = pr.offsets;
  return p;
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

using cuda::sm90::Variant;

// Which sm90 kernels this build has: the generated instance list (SPARSETRAIN_SM90_KERNELS; MINIMAL:
// bf16 without bias; ALL: bf16 and fp16, biased fprop included).
constexpr bool sm90_built([[maybe_unused]] Variant v, [[maybe_unused]] DType dtype) {
#define ST_GEMM_BUILT(V, E) \
  if (v == Variant::V && dtype == dtype_of<E>()) return true;
  SPARSETRAIN_SM90_GEMM_INSTANCES(ST_GEMM_BUILT)
#undef ST_GEMM_BUILT
  return false;
}

template <Variant V, typename E>
size_t sm90_scratch_of([[maybe_unused]] int64_t num_groups) {
#if SPARSETRAIN_WITH_CUTLASS
  if constexpr (sm90_built(V, dtype_of<E>())) return cuda::sm90::workspace_bytes<V, E>(num_groups);
#endif
  return 0;
}
template <typename E>
size_t sm90_scratch(int64_t g) {
  return std::max({sm90_scratch_of<Variant::kFprop, E>(g), sm90_scratch_of<Variant::kFpropBias, E>(g),
                   sm90_scratch_of<Variant::kDgrad, E>(g), sm90_scratch_of<Variant::kWgrad, E>(g),
                   sm90_scratch_of<Variant::kWgradF32, E>(g)});
}

template <Variant V, typename E>
void sm90_launch([[maybe_unused]] const cuda::sm90::Tuning& t, [[maybe_unused]] const GroupedGemmParams& p,
                 [[maybe_unused]] void* scratch, [[maybe_unused]] size_t bytes, [[maybe_unused]] Stream stream) {
#if SPARSETRAIN_WITH_CUTLASS
  if constexpr (sm90_built(V, dtype_of<E>())) cuda::sm90::run<V, E>(p, t, scratch, bytes, stream.handle);
#endif
}

class CudaBackend final : public GroupedLinearBackend {
 public:
  int64_t max_groups() const override { return cuda::kMaxGroups; }
  size_t scratch_bytes(DType dtype, int64_t num_groups, int64_t, int64_t, int64_t) const override {
    if (dtype != DType::kBF16 && dtype != DType::kFP16) return 0;  // fp32: the SIMT kernels only
    size_t bytes = 0;
    dispatch_dtype<bf16_t, fp16_t>(dtype, "CUDA GroupedLinear",
                                   [&](auto e) { bytes = sm90_scratch<decltype(e)>(num_groups); });
    return bytes;
  }

  void setup_device_splits(const TensorView& splits, int64_t num_rows, int64_t* offsets, int32_t* status,
                           Stream stream) override {
    cuda::DeviceGuard guard(splits.device().index);
    setup_offsets_kernel<<<1, 1, 0, as_cuda(stream)>>>(splits.data_as<const int64_t>(), splits.size(0), num_rows,
                                                        offsets, status);
    ST_CUDA_CHECK(cudaGetLastError(), "setup_offsets_kernel launch");
  }
  void copy_from_host(void* dst, const void* src, size_t bytes, Device device, Stream stream) override {
    cuda::DeviceGuard guard(device.index);
    // From pageable memory: returns once the source is staged, so `src` may go away after.
    ST_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, as_cuda(stream)),
                  "cudaMemcpyAsync (host splits)");
  }
  std::vector<int64_t> read_int64(const TensorView& t, Stream stream) override {
    cuda::DeviceGuard guard(t.device().index);
    std::vector<int64_t> v(static_cast<size_t>(t.numel()));
    ST_CUDA_CHECK(
        cudaMemcpyAsync(v.data(), t.data(), v.size() * sizeof(int64_t), cudaMemcpyDeviceToHost, as_cuda(stream)),
        "cudaMemcpyAsync (checked splits)");
    ST_CUDA_CHECK(cudaStreamSynchronize(as_cuda(stream)), "cudaStreamSynchronize (checked splits)");
    return v;
  }
  void fill_zero(const TensorView& t, Stream stream) override {
    ST_CHECK_ARG(t.is_contiguous(), "fill_zero", "a contiguous tensor", t.str());
    cuda::DeviceGuard guard(t.device().index);
    ST_CUDA_CHECK(cudaMemsetAsync(t.data(), 0, size_t(t.numel()) * t.element_size(), as_cuda(stream)),
                  "cudaMemsetAsync");
  }

  // The TMA fast path (sm90 CUTLASS): a kernel built for (variant, dtype), every row and base
  // 16-byte aligned (in and out multiples of 8, activations with packed rows), an sm_90 device.
  // Anything else runs the SIMT kernels.
  static bool fast_path(Variant v, const GroupedProblem& pr, std::initializer_list<const TensorView*> rows,
                        const std::vector<TensorView>& per_group) {
    if (!sm90_built(v, pr.dtype) || pr.in % 8 || pr.out % 8) return false;
    for (const TensorView* t : rows)
      if (t->stride(0) != t->size(1) || !aligned16(t->data())) return false;
    for (const TensorView& w : per_group)
      if (!aligned16(w.data())) return false;
    return cuda::is_sm90(rows.begin()[0]->device().index);
  }

  // The sm90 kernel of variant v, launched with the heuristic's tuning.
  void run_sm90(Variant v, DType dtype, const GroupedGemmParams& p, void* scratch, Stream stream) {
    const cuda::sm90::Tuning s = cuda::sm90::tuning_override(cuda::sm90::pick_tuning(v, p.in, p.out));
    const size_t bytes = scratch_bytes(dtype, p.num_groups, 0, 0, 0);
    auto go = [&](auto e) {
      using E = decltype(e);
      switch (v) {
        case Variant::kFprop: sm90_launch<Variant::kFprop, E>(s, p, scratch, bytes, stream); break;
        case Variant::kFpropBias: sm90_launch<Variant::kFpropBias, E>(s, p, scratch, bytes, stream); break;
        case Variant::kDgrad: sm90_launch<Variant::kDgrad, E>(s, p, scratch, bytes, stream); break;
        case Variant::kWgrad: sm90_launch<Variant::kWgrad, E>(s, p, scratch, bytes, stream); break;
        case Variant::kWgradF32: sm90_launch<Variant::kWgradF32, E>(s, p, scratch, bytes, stream); break;
      }
    };
    dispatch_dtype<bf16_t, fp16_t>(dtype, "CUDA GroupedLinear sm90", go);
  }

  // fprop and dgrad: a GEMM over the ragged rows (act [T, k] -> c [rows, n]), then the zeroed
  // tail of a library-allocated output.
  void rows_gemm(GemmKind kind, const GroupedProblem& pr, const TensorView& act, const TensorView& c,
                 const std::vector<TensorView>& weight, const std::vector<TensorView>& bias, bool zero_tail,
                 void* scratch, Stream stream) {
    cuda::DeviceGuard guard(act.device().index);
    GroupedGemmParams p = base_params(kind, pr);
    p.act = act.data();
    p.act_ld = act.stride(0);
    p.c = c.data();
    p.c_ld = c.size(1);
    for (int64_t g = 0; g < pr.num_groups; ++g) {
      p.weight[g] = weight[size_t(g)].data();
      p.bias[g] = bias.empty() ? nullptr : bias[size_t(g)].data();
    }
    const Variant v = kind == GemmKind::kDgrad ? Variant::kDgrad : bias.empty() ? Variant::kFprop : Variant::kFpropBias;
    const bool fast = fast_path(v, pr, {&act, &c}, weight);
    if (fast) run_sm90(v, pr.dtype, p, scratch, stream);
    dispatch_dtype(pr.dtype, "CUDA GroupedLinear", [&](auto e) {
      using E = decltype(e);
      if (!fast) cuda::launch_grouped_gemm<E>(p, stream.handle);
      if (zero_tail) cuda::launch_zero_tail<E>(pr.offsets, pr.num_groups, c.data(), c.size(0), c.size(1), stream.handle);
    });
  }

  void fprop(const FpropParams& f, void* scratch, Stream stream) override {
    rows_gemm(GemmKind::kFprop, f.problem, f.x, f.y, f.weight, f.bias, f.zero_tail, scratch, stream);
  }

  void dgrad(const DgradParams& d, void* scratch, Stream stream) override {
    rows_gemm(GemmKind::kDgrad, d.problem, d.dy, d.dx, d.weight, {}, d.zero_tail, scratch, stream);
  }

  void wgrad(const WgradParams& w, void* scratch, Stream stream) override {
    cuda::DeviceGuard guard(w.dy.device().index);
    GroupedGemmParams p = base_params(GemmKind::kWgrad, w.problem);
    p.act = w.dy.data();
    p.act_ld = w.dy.stride(0);
    p.act2 = w.x.data();
    p.act2_ld = w.x.stride(0);
    p.wgrad_store = w.target == WgradTarget::kWeightGrad           ? cuda::WgradStore::kWeightGrad
                    : w.target == WgradTarget::kMainGradAccumulate ? cuda::WgradStore::kMainGradAccumulate
                                                                   : cuda::WgradStore::kMainGradOverwrite;
    for (int64_t g = 0; g < w.problem.num_groups; ++g) p.dw[g] = w.dw[size_t(g)].data();
    const Variant v = w.target == WgradTarget::kWeightGrad ? Variant::kWgrad : Variant::kWgradF32;
    const bool fast = fast_path(v, w.problem, {&w.dy, &w.x}, w.dw);
    if (fast) run_sm90(v, w.problem.dtype, p, scratch, stream);
    dispatch_dtype(w.problem.dtype, "CUDA GroupedLinear", [&](auto e) {
      using E = decltype(e);
      if (!fast) cuda::launch_grouped_gemm<E>(p, stream.handle);
      if (!w.db.empty())  // db views are the rows of one [G, out] tensor
        cuda::launch_bias_grad<E>(w.problem.offsets, w.problem.num_groups, w.problem.out, w.dy.data(),
                                  w.dy.stride(0), w.db[0].data(), stream.handle);
    });
  }
};

}  // namespace

GroupedLinearBackend& cuda_backend() {
  static CudaBackend backend;
  return backend;
}

}  // namespace sparsetrain::backend

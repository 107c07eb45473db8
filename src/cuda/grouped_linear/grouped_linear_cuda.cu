// The CUDA backend of GroupedLinear: the device set-up kernel (device splits -> offsets, never
// read by the host), and dispatch of the grouped GEMMs by element type. Every launch goes on the
// caller's stream; nothing synchronises the host except read_int64 (checked mode only).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstring>
#include <initializer_list>

#include "common/group_offsets.h"
#include "cuda/grouped_linear/grouped_gemm_params.h"
#include "cuda/runtime_cuda.h"
#include "ops/grouped_linear_backend.h"
#include "sparsetrain/error.h"

namespace sparsetrain::backend {
namespace {

using cuda::GemmKind;
using cuda::GroupedGemmParams;

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) ST_FAIL(what, " failed: ", cudaGetErrorString(e));
}

cudaStream_t as_cuda(Stream s) { return static_cast<cudaStream_t>(s.handle); }

// One thread: G is at most cuda::kMaxGroups and this runs once per call.
__global__ void setup_offsets_kernel(const int64_t* splits, int64_t num_groups, int64_t num_rows, int64_t* offsets,
                                     int32_t* status) {
  compute_group_offsets(splits, num_groups, num_rows, offsets, status);
}

template <typename Fn>
void dispatch_dtype(DType t, Fn&& fn) {
  switch (t) {
    case DType::kBF16: fn(bf16_t{}); break;
    case DType::kFP16: fn(fp16_t{}); break;
    case DType::kFP32: fn(float{}); break;
    default: ST_FAIL("CUDA GroupedLinear: unsupported dtype ", dtype_name(t));
  }
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

// The sm90a kernels run on compute capability 9.0 only; other GPUs take the SIMT kernels.
bool is_sm90(int device) {
  cudaDeviceProp prop{};
  return cudaGetDeviceProperties(&prop, device) == cudaSuccess && prop.major == 9 && prop.minor == 0;
}

class CudaBackend final : public GroupedLinearBackend {
 public:
  int64_t max_groups() const override { return cuda::kMaxGroups; }
  size_t scratch_bytes(DType dtype, int64_t num_groups, int64_t, int64_t, int64_t) const override {
#if SPARSETRAIN_WITH_CUTLASS
    using V = cuda::sm90::Variant;
    if (dtype == DType::kBF16)
      return std::max({cuda::sm90::workspace_bytes<V::kFpropBf16>(num_groups),
                       cuda::sm90::workspace_bytes<V::kDgradBf16>(num_groups),
                       cuda::sm90::workspace_bytes<V::kWgradBf16>(num_groups),
                       cuda::sm90::workspace_bytes<V::kWgradF32>(num_groups)});
#else
    (void)dtype;
    (void)num_groups;
#endif
    return 0;
  }

  void setup_device_splits(const TensorView& splits, int64_t num_rows, int64_t* offsets, int32_t* status,
                           Stream stream) override {
    cuda::DeviceGuard guard(splits.device().index);
    setup_offsets_kernel<<<1, 1, 0, as_cuda(stream)>>>(splits.data_as<const int64_t>(), splits.size(0), num_rows,
                                                        offsets, status);
    check(cudaGetLastError(), "setup_offsets_kernel launch");
  }
  void copy_from_host(void* dst, const void* src, size_t bytes, Stream stream) override {
    // From pageable memory: returns once the source is staged, so `src` may go away after.
    check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, as_cuda(stream)), "cudaMemcpyAsync (host splits)");
  }
  std::vector<int64_t> read_int64(const TensorView& t, Stream stream) override {
    std::vector<int64_t> v(static_cast<size_t>(t.numel()));
    check(cudaMemcpyAsync(v.data(), t.data(), v.size() * sizeof(int64_t), cudaMemcpyDeviceToHost, as_cuda(stream)),
          "cudaMemcpyAsync (checked splits)");
    check(cudaStreamSynchronize(as_cuda(stream)), "cudaStreamSynchronize (checked splits)");
    return v;
  }
  void fill_zero(const TensorView& t, Stream stream) override {
    ST_CHECK_ARG(t.is_contiguous(), "fill_zero", "a contiguous tensor", t.str());
    cuda::DeviceGuard guard(t.device().index);
    check(cudaMemsetAsync(t.data(), 0, size_t(t.numel()) * t.element_size(), as_cuda(stream)), "cudaMemsetAsync");
  }

  // The TMA fast path (sm90 CUTLASS): bf16, every row and base 16-byte aligned (in and out
  // multiples of 8, activations with packed rows). Anything else runs the SIMT kernels.
  static bool fast_path(DType dtype, const GroupedProblem& pr, std::initializer_list<const TensorView*> rows,
                        const std::vector<TensorView>& per_group) {
#if SPARSETRAIN_WITH_CUTLASS
    if (dtype != DType::kBF16 || pr.in % 8 || pr.out % 8) return false;
    for (const TensorView* t : rows)
      if (t->stride(0) != t->size(1) || !aligned16(t->data())) return false;
    for (const TensorView& w : per_group)
      if (!aligned16(w.data())) return false;
    static const bool sm90 = is_sm90(rows.begin()[0]->device().index);
    return sm90;
#else
    (void)dtype, (void)pr, (void)rows, (void)per_group;
    return false;
#endif
  }

  template <cuda::sm90::Variant V>
  void run_sm90(const GroupedGemmParams& p, void* scratch, Stream stream) {
#if SPARSETRAIN_WITH_CUTLASS
    cuda::sm90::run<V>(p, scratch, scratch_bytes(DType::kBF16, p.num_groups, 0, 0, 0), stream.handle);
#else
    (void)p, (void)scratch, (void)stream;
#endif
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
    const bool fast = bias.empty() && fast_path(pr.dtype, pr, {&act, &c}, weight);
    if (fast && kind == GemmKind::kFprop) run_sm90<cuda::sm90::Variant::kFpropBf16>(p, scratch, stream);
    if (fast && kind == GemmKind::kDgrad) run_sm90<cuda::sm90::Variant::kDgradBf16>(p, scratch, stream);
    dispatch_dtype(pr.dtype, [&](auto e) {
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
    const bool fast = fast_path(w.problem.dtype, w.problem, {&w.dy, &w.x}, w.dw);
    if (fast && w.target == WgradTarget::kWeightGrad) run_sm90<cuda::sm90::Variant::kWgradBf16>(p, scratch, stream);
    if (fast && w.target != WgradTarget::kWeightGrad) run_sm90<cuda::sm90::Variant::kWgradF32>(p, scratch, stream);
    dispatch_dtype(w.problem.dtype, [&](auto e) {
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

// The CUDA backend of GroupedLinear: the device set-up kernel (device splits -> offsets, never
// read by the host), and dispatch of the grouped GEMMs by element type. Every launch goes on the
// caller's stream; nothing synchronises the host except read_int64 (checked mode only).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstring>
#include <initializer_list>
#include <map>
#include <mutex>
#include <optional>
#include <tuple>

#include <cub/block/block_scan.cuh>

#include "common/dispatch_dtype.h"
#include "common/gpu_arch.h"
#include "common/group_offsets.h"
#include "cuda/cuda_check.h"
#include "cuda/cuda_stream.h"
#include "cuda/device_cache.h"
#include "cuda/grouped_linear/grouped_gemm_params.h"
#include "cuda/runtime_cuda.h"
#include "cuda/tuning.h"
#include "ops/grouped_linear_backend.h"
#include "sm90/sm90_instances.h"
#include "sparsetrain/error.h"

namespace sparsetrain::backend {
namespace {

using cuda::GemmKind;
using cuda::GroupedGemmParams;

using cuda::as_cuda;

// One block (G is at most cuda::kMaxGroups = 128 threads x 4 entries): valid splits (every entry in
// range, the sum within num_rows: common/group_offsets.h's splits_valid) take their offsets from a
// block scan; any other goes through the rule itself (compute_group_offsets, by one thread over
// the entries staged in shared memory), which alone decides the status bits. One thread looping
// over global memory waited for each load in turn, 4-8x the time of torch._grouped_mm's whole
// set-up at G = 64-128.
constexpr int kOffsetsThreads = 128, kOffsetsPerThread = cuda::kMaxGroups / kOffsetsThreads;
static_assert(kOffsetsThreads * kOffsetsPerThread == cuda::kMaxGroups, "one entry per thread slot");
__global__ void __launch_bounds__(kOffsetsThreads)
    setup_offsets_kernel(const int64_t* splits, int64_t num_groups, int64_t num_rows, int64_t* offsets,
                         int32_t* status) {
  using Scan = cub::BlockScan<long long, kOffsetsThreads>;
  __shared__ typename Scan::TempStorage scan;
  __shared__ int64_t staged[cuda::kMaxGroups];
  long long v[kOffsetsPerThread];
  bool out_of_range = false;
  for (int i = 0; i < kOffsetsPerThread; ++i) {  // blocked: thread t holds entries 4t .. 4t + 3
    const int64_t g = int64_t(threadIdx.x) * kOffsetsPerThread + i;
    v[i] = g < num_groups ? splits[g] : 0;
    out_of_range |= !split_in_range(v[i], num_rows);
    if (g < num_groups) staged[g] = v[i];
  }
  long long total;
  Scan(scan).ExclusiveSum(v, v, total);  // total: every thread's
  if (__syncthreads_or(out_of_range) || total > num_rows) {  // also publishes `staged`
    if (threadIdx.x == 0) compute_group_offsets(staged, num_groups, num_rows, offsets, status);
    return;
  }
  for (int i = 0; i < kOffsetsPerThread; ++i) {
    const int64_t g = int64_t(threadIdx.x) * kOffsetsPerThread + i;
    if (g < num_groups) offsets[g] = v[i];
  }
  if (threadIdx.x == 0) offsets[num_groups] = total;
}

// Host splits' offsets into device memory through a kernel's parameters rather than a pageable
// cudaMemcpyAsync: as fast on the host, nothing staged or waited for, and
// a captured graph keeps the values. Only where no GEMM launch carries them (folds them in): a
// problem with no output tiles.
template <int N>
struct HostOffsets {
  int64_t v[N];
};
template <int N>
__global__ void write_offsets_kernel(const HostOffsets<N> h, int64_t count, int64_t* dst) {
  for (int64_t i = threadIdx.x; i < count; i += blockDim.x) dst[i] = h.v[i];
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
  p.host_offsets = nullptr;  // a caller that folds sets it
  return p;
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

using cuda::sm90::Variant;

// Which sm90 kernels this build has: the generated instance list (SPARSETRAIN_SM90_KERNELS; MINIMAL:
// bf16 without bias; ALL: bf16 and fp16, biased fprop included). Every dispatch below reads it.
constexpr bool sm90_built([[maybe_unused]] Variant v, [[maybe_unused]] DType dtype) {
#define ST_GEMM_BUILT(V, E) \
  if (v == Variant::V && dtype == dtype_of<E>()) return true;
  SPARSETRAIN_SM90_GEMM_INSTANCES(ST_GEMM_BUILT)
#undef ST_GEMM_BUILT
  return false;
}

// The scratch of the largest built sm90 kernel for dtype (0 without one). Each instance's size
// asks CUTLASS (its arguments and tile scheduler: ~0.5 us), ~15 instances in a full build, twice a
// call (the plan and the launch): cached per (dtype, G, device), the same for every call.
size_t sm90_scratch([[maybe_unused]] DType dtype, [[maybe_unused]] int64_t num_groups) {
  size_t bytes = 0;
#if SPARSETRAIN_WITH_CUTLASS
  static std::mutex mutex;
  static std::map<std::tuple<DType, int64_t, int>, size_t> cache;
  const auto key = std::make_tuple(dtype, num_groups, cuda::current_device());
  const std::lock_guard<std::mutex> lock(mutex);
  const auto it = cache.find(key);
  if (it != cache.end()) return it->second;
#define ST_GEMM_SCRATCH(V, E) \
  if (dtype == dtype_of<E>()) bytes = std::max(bytes, cuda::sm90::workspace_bytes<Variant::V, E>(num_groups));
  SPARSETRAIN_SM90_GEMM_INSTANCES(ST_GEMM_SCRATCH)
#undef ST_GEMM_SCRATCH
  cache.emplace(key, bytes);
#endif
  return bytes;
}

// The sm90 kernel of (v, dtype), launched with the heuristic's tuning; the caller checked
// sm90_built.
void run_sm90([[maybe_unused]] Variant v, DType dtype, [[maybe_unused]] const GroupedGemmParams& p,
              [[maybe_unused]] void* scratch, [[maybe_unused]] Stream stream) {
#if SPARSETRAIN_WITH_CUTLASS
  const cuda::sm90::Tuning t = cuda::tuning::sm90_override(cuda::sm90::pick_tuning(v, p.in, p.out));
  const size_t bytes = sm90_scratch(dtype, p.num_groups);
#define ST_GEMM_RUN(V, E)                                                                 \
  if (v == Variant::V && dtype == dtype_of<E>())                                          \
    return cuda::sm90::run<Variant::V, E>(p, t, scratch, bytes, stream.handle);
  SPARSETRAIN_SM90_GEMM_INSTANCES(ST_GEMM_RUN)
#undef ST_GEMM_RUN
#endif
  ST_FAIL("CUDA GroupedLinear: no sm90 kernel for ", dtype_name(dtype), " in this build");
}

class CudaBackend final : public GroupedLinearBackend {
 public:
  int64_t max_groups() const override { return cuda::kMaxGroups; }
  bool folds_host_offsets() const override { return true; }
  size_t scratch_bytes(DType dtype, int64_t num_groups, int64_t, int64_t, int64_t) const override {
    if (dtype != DType::kBF16 && dtype != DType::kFP16) return 0;  // fp32: the SIMT kernels only
    return sm90_scratch(dtype, num_groups);
  }

  void setup_device_splits(const TensorView& splits, int64_t num_rows, int64_t* offsets, int32_t* status,
                           Stream stream) override {
    cuda::DeviceGuard guard(splits.device().index);
    if (splits.size(0) > cuda::kMaxGroups)  // max_groups() bounds G before any call gets here
      ST_FAIL("setup_device_splits: ", splits.size(0), " splits, more than one launch takes");
    setup_offsets_kernel<<<1, kOffsetsThreads, 0, as_cuda(stream)>>>(splits.data_as<const int64_t>(), splits.size(0),
                                                                      num_rows, offsets, status);
    ST_CUDA_CHECK(cudaGetLastError(), "setup_offsets_kernel launch");
  }
  void write_host_offsets(int64_t* dst, const int64_t* values, int64_t count, Device device,
                          Stream stream) override {
    cuda::DeviceGuard guard(device.index);
    if (count > cuda::kMaxGroups + 1)  // max_groups() bounds G before any call gets here
      ST_FAIL("write_host_offsets: ", count, " offsets, more than one launch takes");
    cuda::with_group_cap(count - 1, [&](auto cap) {
      HostOffsets<decltype(cap)::value + 1> h;
      std::copy(values, values + count, h.v);
      write_offsets_kernel<<<1, 128, 0, as_cuda(stream)>>>(h, count, dst);
    });
    ST_CUDA_CHECK(cudaGetLastError(), "write_offsets_kernel launch");
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

  // Which sm90 kernel runs a GEMM of variant v, if any: the device and the build decide first
  // (arch::grouped_gemm_kernels, CPU-tested with made-up capabilities), then the size (tiny
  // problems: arch::simt_by_size) and TMA's needs: the inputs (activation rows, per-group
  // weights) 16-byte aligned with packed rows, in and out multiples of 8; otherwise the SIMT
  // kernels run. A caller output (out, grad_input, main_grad) off a 16-byte boundary takes the
  // direct-store twin: bit-identical to the TMA store (docs/DESIGN.md section 4).
  static std::optional<Variant> sm90_kernel(Variant v, const GroupedProblem& pr,
                                            std::initializer_list<const TensorView*> inputs,
                                            const std::vector<TensorView>& weights, bool outputs_aligned) {
    if (pr.in % 8 || pr.out % 8) return std::nullopt;
    if (arch::simt_by_size(pr.num_rows, pr.in, pr.out, cuda::tuning::gemm_simt_max_macs())) return std::nullopt;
    const Variant k = outputs_aligned ? v : cuda::sm90::direct_store(v);
    const bool built = sm90_built(v, pr.dtype) && sm90_built(k, pr.dtype);  // both or neither
    const cuda::DeviceInfo d = cuda::device_info(inputs.begin()[0]->device().index);
    if (arch::grouped_gemm_kernels({d.cc_major, d.cc_minor}, built) != arch::GemmKernels::kSm90) return std::nullopt;
    if (k == v && !outputs_aligned) return std::nullopt;  // no twin (dW is always the library's)
    for (const TensorView* t : inputs)
      if (t->stride(0) != t->size(1) || !aligned16(t->data())) return std::nullopt;
    for (const TensorView& w : weights)
      if (!aligned16(w.data())) return std::nullopt;
    // The fprop's and dgrad's one-CTA-cluster twins for small expert weights (bit-identical; ALL
    // builds have them).
    const Variant single = cuda::sm90::no_cluster(k);
    if (single != k && sm90_built(single, pr.dtype) &&
        cuda::tuning::sm90_no_cluster(cuda::sm90::no_cluster_pays(k, pr.in, pr.out)))
      return single;
    return k;
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
    const std::optional<Variant> sm90 = sm90_kernel(v, pr, {&act}, weight, aligned16(c.data()));
    const bool fast = sm90.has_value();
    p.host_offsets = pr.host_offsets;  // folded host splits: the first kernel (either GEMM's) writes them
    if (fast) run_sm90(*sm90, pr.dtype, p, scratch, stream);
    dispatch_dtype(pr.dtype, "CUDA GroupedLinear", [&](auto e) {
      using E = decltype(e);
      if (!fast && !cuda::launch_grouped_gemm<E>(p, stream.handle) && p.host_offsets != nullptr)
        write_host_offsets(const_cast<int64_t*>(pr.offsets), pr.host_offsets, pr.num_groups + 1, act.device(), stream);
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
    const bool dw_aligned =
        std::all_of(w.dw.begin(), w.dw.end(), [](const TensorView& d) { return aligned16(d.data()); });
    // main_grad accumulated by the TMA store's reduce-add where it can be (aligned, built) and
    // pays; the register epilogue (kWgradF32, its direct twin off 16 bytes) otherwise and to
    // overwrite it.
    const bool reduce_add =
        w.target == WgradTarget::kMainGradAccumulate && dw_aligned &&
        sm90_built(Variant::kWgradF32Add, w.problem.dtype) &&
        cuda::tuning::main_grad_reduce_add(cuda::sm90::reduce_add_pays(w.problem.num_rows, w.problem.num_groups));
    const Variant v = w.target == WgradTarget::kWeightGrad ? Variant::kWgrad
                      : reduce_add                         ? Variant::kWgradF32Add
                                                           : Variant::kWgradF32;
    const std::optional<Variant> sm90 = sm90_kernel(v, w.problem, {&w.dy, &w.x}, {}, dw_aligned);
    const bool fast = sm90.has_value();
    if (fast) run_sm90(*sm90, w.problem.dtype, p, scratch, stream);
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

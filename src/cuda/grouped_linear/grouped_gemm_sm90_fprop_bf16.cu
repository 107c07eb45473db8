// The sm90 CUTLASS grouped fprop for bf16 (one instantiation per .cu: CUTLASS TUs are slow).
#include "cuda/grouped_linear/grouped_gemm_sm90.cuh"

namespace sparsetrain::cuda::sm90 {
namespace {

using G = FpropGemm<cutlass::bfloat16_t>;

size_t align_up(size_t n) { return (n + 255) / 256 * 256; }

G::Arrays carve(void* ws, int64_t groups) {
  char* p = static_cast<char*>(ws);
  G::Arrays a;
  auto take = [&](auto*& ptr, size_t each) {
    ptr = reinterpret_cast<std::remove_reference_t<decltype(ptr)>>(p);
    p += align_up(each * size_t(groups));
  };
  take(a.problems, sizeof(G::Shape3));
  take(a.a, sizeof(void*));
  take(a.b, sizeof(void*));
  take(a.d, sizeof(void*));
  take(a.stride_a, sizeof(G::StrideA));
  take(a.stride_b, sizeof(G::StrideB));
  take(a.stride_d, sizeof(G::StrideD));
  return a;
}

size_t arrays_bytes(int64_t groups) {
  return align_up(sizeof(G::Shape3) * size_t(groups)) + 3 * align_up(sizeof(void*) * size_t(groups)) +
         align_up(sizeof(G::StrideA) * size_t(groups)) + align_up(sizeof(G::StrideB) * size_t(groups)) +
         align_up(sizeof(G::StrideD) * size_t(groups));
}

// One thread per group: problem g = rows [offsets[g], offsets[g+1]) of x times W_g^T.
__global__ void fprop_setup_kernel(const GroupedGemmParams p, G::Arrays a) {
  const int64_t g = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (g >= p.num_groups) return;
  const int64_t row = p.offsets[g], rows = p.offsets[g + 1] - row;
  const int m = int(rows), n = int(p.out), k = int(p.in);
  a.problems[g] = G::Shape3(m, n, k);
  a.a[g] = static_cast<const cutlass::bfloat16_t*>(p.act) + row * p.act_ld;
  a.b[g] = static_cast<const cutlass::bfloat16_t*>(p.weight[g]);
  a.d[g] = static_cast<cutlass::bfloat16_t*>(p.c) + row * p.c_ld;
  a.stride_a[g] = cutlass::make_cute_packed_stride(G::StrideA{}, cute::make_shape(m, k, 1));
  a.stride_b[g] = cutlass::make_cute_packed_stride(G::StrideB{}, cute::make_shape(n, k, 1));
  a.stride_d[g] = cutlass::make_cute_packed_stride(G::StrideD{}, cute::make_shape(m, n, 1));
}

G::Gemm::Arguments arguments(const GroupedGemmParams& p, const G::Arrays& a, int device) {
  typename G::Gemm::Arguments args;
  decltype(args.epilogue.thread) fusion;
  fusion.alpha = 1.f;
  fusion.beta = 0.f;
  cutlass::KernelHardwareInfo hw = cutlass::KernelHardwareInfo::make_kernel_hardware_info<G::Kernel>(device);
  args = typename G::Gemm::Arguments{cutlass::gemm::GemmUniversalMode::kGrouped,
                                     {int(p.num_groups), a.problems, nullptr},
                                     {a.a, a.stride_a, a.b, a.stride_b},
                                     {fusion, nullptr, nullptr, a.d, a.stride_d},
                                     hw};
  return args;
}

}  // namespace

template <>
size_t fprop_workspace_bytes<cutlass::bfloat16_t>(int64_t num_groups) {
  GroupedGemmParams p{};
  p.num_groups = num_groups;
  G::Arrays a{};
  int device = 0;
  cudaGetDevice(&device);
  return arrays_bytes(num_groups) + align_up(G::Gemm::get_workspace_size(arguments(p, a, device)));
}

template <>
void run_fprop<cutlass::bfloat16_t>(const GroupedGemmParams& p, void* workspace, size_t workspace_bytes,
                                    void* stream) {
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  const G::Arrays a = carve(workspace, p.num_groups);
  fprop_setup_kernel<<<unsigned((p.num_groups + 127) / 128), 128, 0, s>>>(p, a);
  int device = 0;
  cudaGetDevice(&device);
  const auto args = arguments(p, a, device);
  G::Gemm gemm;
  void* cutlass_ws = static_cast<char*>(workspace) + arrays_bytes(p.num_groups);
  if (arrays_bytes(p.num_groups) + G::Gemm::get_workspace_size(args) > workspace_bytes)
    ST_FAIL("sm90 grouped fprop: workspace too small");
  if (gemm.can_implement(args) != cutlass::Status::kSuccess) ST_FAIL("sm90 grouped fprop: cannot implement");
  if (gemm.initialize(args, cutlass_ws, s) != cutlass::Status::kSuccess) ST_FAIL("sm90 grouped fprop: initialize");
  if (gemm.run(s) != cutlass::Status::kSuccess) ST_FAIL("sm90 grouped fprop: run failed");
}

}  // namespace sparsetrain::cuda::sm90

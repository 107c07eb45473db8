// Kernel parameters of the CUDA grouped GEMMs: a framework-free struct of pointers and leading
// dimensions passed by value (so a captured CUDA graph holds everything it needs and nothing is
// copied from the host per launch). Per-group pointers live in the struct, which bounds G.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "cuda/grouped_linear/grouped_gemm_tuning_sm90.h"

namespace sparsetrain::cuda {

constexpr int kMaxGroups = 512;  // 3 pointer tables of 4 KiB: within the 32 KiB kernel-parameter limit

enum class GemmKind : int { kFprop, kDgrad, kWgrad };
enum class WgradStore : int { kWeightGrad, kMainGradAccumulate, kMainGradOverwrite };

struct GroupedGemmParams {
  GemmKind kind;
  int64_t num_groups, num_rows, in, out;
  const int64_t* offsets;  // [G + 1], device memory (set-up kernel or host copy)
  // Host splits' offsets [G + 1] that the first kernel (the sm90 set-up kernel, or the SIMT GEMM)
  // writes into `offsets` (the call's workspace) as it reads them; null: `offsets` holds them already.
  const int64_t* host_offsets;
  const void* act;         // fprop: x [T, in]; dgrad and wgrad: dy [T, out]
  int64_t act_ld;
  const void* act2;        // wgrad: x [T, in]
  int64_t act2_ld;
  void* c;                 // fprop: y [rows, out]; dgrad: dx [rows, in] (row-contiguous)
  int64_t c_ld;
  WgradStore wgrad_store;
  const void* weight[kMaxGroups];  // [out, in] contiguous
  const void* bias[kMaxGroups];    // fprop: [out] or null
  void* dw[kMaxGroups];            // wgrad: [out, in] contiguous, dtype or fp32 main_grad
};

// A kernel's per-group tables are cut to a capacity before its launch: the parameters go through
// the driver on the host, and three tables of kMaxGroups pointers (12 KiB) cost a few-group call
// several microseconds of host time a launch more than a few hundred bytes. Calls
// f(std::integral_constant<int, Cap>) with the smallest of 16, 128 and kMaxGroups that holds
// num_groups (the caller bounds it by kMaxGroups).
template <typename F>
void with_group_cap(int64_t num_groups, F&& f) {
  if (num_groups <= 16) f(std::integral_constant<int, 16>{});
  else if (num_groups <= 128) f(std::integral_constant<int, 128>{});
  else f(std::integral_constant<int, kMaxGroups>{});
}

// GroupedGemmParams as a kernel takes it: the per-group tables cut to Cap entries (with_group_cap),
// host splits' offsets folded in (the kernel reads them from its parameters and writes them to
// write_offsets, the call's workspace, for the kernels after it).
template <int Cap>
struct CappedGemmParams {
  GemmKind kind;
  WgradStore wgrad_store;
  int64_t num_groups, num_rows, in, out;
  const int64_t* offsets;  // [G + 1] in device memory, read unless host offsets are folded in
  int64_t* write_offsets;  // folded host splits: where host_offsets go; else null
  int64_t host_offsets[Cap + 1];
  const void* act;
  int64_t act_ld;
  const void* act2;
  int64_t act2_ld;
  void* c;
  int64_t c_ld;
  const void* weight[Cap];
  const void* bias[Cap];
  void* dw[Cap];
};

template <int Cap>
CappedGemmParams<Cap> capped_params(const GroupedGemmParams& p) {
  CappedGemmParams<Cap> s;
  s.kind = p.kind, s.wgrad_store = p.wgrad_store;
  s.num_groups = p.num_groups, s.num_rows = p.num_rows, s.in = p.in, s.out = p.out;
  s.offsets = p.offsets;
  s.write_offsets = p.host_offsets != nullptr ? const_cast<int64_t*>(p.offsets) : nullptr;
  if (p.host_offsets != nullptr) std::copy(p.host_offsets, p.host_offsets + p.num_groups + 1, s.host_offsets);
  s.act = p.act, s.act_ld = p.act_ld, s.act2 = p.act2, s.act2_ld = p.act2_ld, s.c = p.c, s.c_ld = p.c_ld;
  std::copy(p.weight, p.weight + p.num_groups, s.weight);
  std::copy(p.bias, p.bias + p.num_groups, s.bias);
  std::copy(p.dw, p.dw + p.num_groups, s.dw);
  return s;
}

// Launchers, one explicit instantiation per element type and .cu file. launch_grouped_gemm folds
// p.host_offsets in (the kernel reads them from its parameters and writes them to p.offsets for
// the kernels after it) and says whether it launched: a problem with no output tiles launches
// nothing, and then the caller must write host offsets itself.
template <typename E>
bool launch_grouped_gemm(const GroupedGemmParams& p, void* stream);
template <typename E>
void launch_bias_grad(const int64_t* offsets, int64_t num_groups, int64_t out, const void* dy, int64_t dy_ld,
                      void* db, void* stream);  // db: [G, out] contiguous
template <typename E>
void launch_zero_tail(const int64_t* offsets, int64_t num_groups, void* c, int64_t rows, int64_t cols, void* stream);

// The sm90 CUTLASS fast paths (bf16/fp16 operands, fp32 accumulation); compiled when CUTLASS
// headers are found. Each (variant, element) is explicitly specialised in its own .cu, generated
// by CMake from the list of instantiations (SPARSETRAIN_SM90_KERNELS).
namespace sm90 {
template <Variant V, typename E>
size_t workspace_bytes(int64_t num_groups);  // per-launch arrays + CUTLASS workspace, from G only
template <Variant V, typename E>
void run(const GroupedGemmParams& p, const Tuning& tuning, void* workspace, size_t bytes, void* stream);
}  // namespace sm90

}  // namespace sparsetrain::cuda

// Kernel parameters of the FP8 grouped GEMMs (grouped_gemm_fp8_sm90.cuh): pointers, leading
// dimensions and per-group tables by value, as for the bf16 GEMMs (grouped_gemm_params.h), so a
// captured graph holds everything it needs. Group offsets are on the device.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "cuda/grouped_linear/grouped_gemm_params.h"  // kMaxGroups, WgradStore, with_group_cap

namespace sparsetrain::cuda {

enum class Fp8Variant : int { kActWeight, kWgrad, kWgradF32 };

// One launch. Unused fields are zero.
template <int Cap>
struct Fp8GemmParams {
  WgradStore wgrad_store;  // kWgradF32
  int64_t num_groups;
  int64_t m, n, k;         // act x weight: n, k (m: each group's rows); wgrad: m = out, n = in
  const int64_t* offsets;  // [G + 1], device memory
  const void* a;           // e4m3: act x weight [rows, k]; wgrad dy^T [m, columns]
  const float* sfa;
  int64_t a_ld;
  const void* b;           // wgrad: e4m3 x^T [n, columns]
  const float* sfb;
  int64_t b_ld;
  void* d;                 // act x weight: [rows, n] in the layer's dtype
  int64_t d_ld;
  const void* weight[Cap];        // act x weight: e4m3 [n, k] per group (W_g, or W_g^T for dgrad)
  const float* weight_scale[Cap];  // its 128 x 128 grid [n/128][k/128]
  void* dw[Cap];                  // wgrad: [m, n] contiguous, the layer's dtype or fp32 main_grad
};
using Fp8GemmArgs = Fp8GemmParams<kMaxGroups>;

template <int Cap>
Fp8GemmParams<Cap> capped_params(const Fp8GemmArgs& p) {
  Fp8GemmParams<Cap> s;
  s.wgrad_store = p.wgrad_store;
  s.num_groups = p.num_groups, s.m = p.m, s.n = p.n, s.k = p.k;
  s.offsets = p.offsets;
  s.a = p.a, s.sfa = p.sfa, s.a_ld = p.a_ld, s.b = p.b, s.sfb = p.sfb, s.b_ld = p.b_ld, s.d = p.d, s.d_ld = p.d_ld;
  std::copy(p.weight, p.weight + p.num_groups, s.weight);
  std::copy(p.weight_scale, p.weight_scale + p.num_groups, s.weight_scale);
  std::copy(p.dw, p.dw + p.num_groups, s.dw);
  return s;
}

// One explicit specialisation per variant and .cu file (bf16 outputs: the recipe's layer dtype).
namespace sm90 {
template <Fp8Variant V>
size_t fp8_workspace_bytes(int64_t num_groups);  // per-launch arrays + CUTLASS workspace, from G only
template <Fp8Variant V>
void run_fp8(const Fp8GemmArgs& p, void* workspace, size_t bytes, void* stream);
}  // namespace sm90

}  // namespace sparsetrain::cuda

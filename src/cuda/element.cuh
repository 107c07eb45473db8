// Scalar and 16-byte vector access to the library's element types (fp32, bf16, fp16) in fp32
// math, for the CUDA kernels: loads widen exactly, stores round to nearest even.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "sparsetrain/dtype.h"

namespace sparsetrain::cuda {

__device__ inline float load_f32(const float* p, int64_t i) { return p[i]; }
__device__ inline float load_f32(const bf16_t* p, int64_t i) { return __uint_as_float(uint32_t(p[i].bits) << 16); }
__device__ inline float load_f32(const fp16_t* p, int64_t i) { return __half2float(__ushort_as_half(p[i].bits)); }
__device__ inline void store_f32(float* p, int64_t i, float v) { p[i] = v; }
__device__ inline void store_f32(bf16_t* p, int64_t i, float v) { p[i].bits = __bfloat16_as_ushort(__float2bfloat16_rn(v)); }
__device__ inline void store_f32(fp16_t* p, int64_t i, float v) { p[i].bits = __half_as_ushort(__float2half_rn(v)); }

// V consecutive elements (V * sizeof(E) = 16 bytes when vectorised, or V = 1) as fp32.
template <typename E, int V>
struct Pack {
  float v[V];
  __device__ void load(const E* p) {  // p: 16-byte aligned when V > 1
    if constexpr (V == 1) {
      v[0] = load_f32(p, 0);
    } else {
      static_assert(V * sizeof(E) == 16, "a vector pack is 16 bytes");
      const uint4 raw = *reinterpret_cast<const uint4*>(p);
      const E* e = reinterpret_cast<const E*>(&raw);
#pragma unroll
      for (int i = 0; i < V; ++i) v[i] = load_f32(e, i);
    }
  }
  __device__ void store(E* p) const {
    if constexpr (V == 1) {
      store_f32(p, 0, v[0]);
    } else {
      uint4 raw;
      E* e = reinterpret_cast<E*>(&raw);
#pragma unroll
      for (int i = 0; i < V; ++i) store_f32(e, i, v[i]);
      *reinterpret_cast<uint4*>(p) = raw;
    }
  }
};

}  // namespace sparsetrain::cuda

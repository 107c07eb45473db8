// The backward's preprocessing, before the kernel (attention_bwd_sm90.cuh): per padded q row,
// delta = rowsum(dO * o), lse in log2 units, and (for the atomic adds of the non-deterministic
// mode; the deterministic one's first writer stores) the row of the fp32 dQ accumulator zeroed.
#pragma once

#include <cmath>
#include <cstdint>

#include "cuda/element.cuh"  // load_f32

namespace sparsetrain::cuda::attn {

// Per padded row (b, h, q): delta = rowsum(dout * o), lse * log2(e) (+inf where the row has no
// allowed key or lies past Sq: P = 0 there), and the row of the dQ accumulator zeroed unless
// dq_accum is null (the deterministic mode: zeroing was half of this kernel's traffic). kLanes
// threads a row: 16 with 16-byte loads and stores (kVector: rows 16-byte aligned, head_dim a
// multiple of 8 and at most 128; two rows a warp), else 32 with one element a load. (The scalar
// form alone took 102 us on an H100 for 64 MiB each of o and dout, 9 % of a short-row backward.)
template <class E, bool kVector>
__global__ void bwd_preprocess_kernel(const E* o, int64_t o_sb, int64_t o_ss, int64_t o_sh, const E* dout,
                                      int64_t do_sb, int64_t do_ss, int64_t do_sh, const float* lse, int64_t l_sb,
                                      int64_t l_sh, int64_t l_ss, int32_t heads_q, int32_t seq_q, int32_t rows,
                                      int32_t head_dim, int64_t total_rows, float* lse_log2, float* delta,
                                      float* dq_accum) {
  constexpr int kLanes = kVector ? 16 : 32;
  constexpr int kPer = kVector ? 16 / int(sizeof(E)) : 1;  // elements a thread loads at once
  constexpr int kRowsPerWarp = 32 / kLanes;
  const int lane = threadIdx.x % kLanes;
  const int64_t warps = int64_t(gridDim.x) * (blockDim.x / 32);
  // Whole warps go round the loop together (the shuffles take every lane); a row past the end
  // only idles.
  for (int64_t r0 = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / 32 * kRowsPerWarp; r0 < total_rows;
       r0 += warps * kRowsPerWarp) {
    const int64_t r = r0 + threadIdx.x % 32 / kLanes;
    const bool row_ok = r < total_rows;
    const int64_t bh = r / rows;
    const int32_t q = int32_t(r % rows);
    const int64_t b = bh / heads_q, h = bh % heads_q;
    float sum = 0.f;
    if (row_ok && q < seq_q) {
      const E* orow = o + b * o_sb + q * o_ss + h * o_sh;
      const E* drow = dout + b * do_sb + q * do_ss + h * do_sh;
      for (int d = lane * kPer; d < head_dim; d += kLanes * kPer) {
        cuda::Pack<E, kPer> x, y;
        x.load(orow + d);
        y.load(drow + d);
#pragma unroll
        for (int e = 0; e < kPer; ++e) sum += x.v[e] * y.v[e];
      }
    }
    for (int off = kLanes / 2; off > 0; off /= 2) sum += __shfl_xor_sync(0xffffffff, sum, off);
    if (!row_ok) continue;
    if (dq_accum != nullptr) {
      float* acc = dq_accum + r * head_dim;
      if constexpr (kVector) {
        for (int d = lane * 4; d < head_dim; d += kLanes * 4) *reinterpret_cast<float4*>(acc + d) = float4{};
      } else {
        for (int d = lane; d < head_dim; d += kLanes) acc[d] = 0.f;
      }
    }
    if (lane == 0) {
      const float l = q < seq_q ? lse[b * l_sb + h * l_sh + q * l_ss] : -INFINITY;
      delta[r] = sum;
      lse_log2[r] = l == -INFINITY ? INFINITY : l * float(M_LOG2E);
    }
  }
}

}  // namespace sparsetrain::cuda::attn

// The backward's preprocessing, before the kernel (attention_bwd_sm90.cuh): per padded q row,
// delta = rowsum(dO * o), lse in log2 units, and the row of the fp32 dQ accumulator zeroed.
#pragma once

#include <cmath>
#include <cstdint>

#include "cuda/element.cuh"  // load_f32

namespace sparsetrain::cuda::attn {

// One warp per padded row (b, h, q): delta = rowsum(dout * o), lse * log2(e) (+inf where the row
// has no allowed key or lies past Sq: P = 0 there), and the row of the dQ accumulator zeroed.
template <class E>
__global__ void bwd_preprocess_kernel(const E* o, int64_t o_sb, int64_t o_ss, int64_t o_sh, const E* dout,
                                      int64_t do_sb, int64_t do_ss, int64_t do_sh, const float* lse, int64_t l_sb,
                                      int64_t l_sh, int64_t l_ss, int32_t heads_q, int32_t seq_q, int32_t rows,
                                      int32_t head_dim, int64_t total_rows, float* lse_log2, float* delta,
                                      float* dq_accum) {
  const int lane = threadIdx.x % 32;
  const int64_t warps = int64_t(gridDim.x) * (blockDim.x / 32);
  for (int64_t r = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / 32; r < total_rows; r += warps) {
    const int64_t bh = r / rows;
    const int32_t q = int32_t(r % rows);
    const int64_t b = bh / heads_q, h = bh % heads_q;
    float sum = 0.f;
    if (q < seq_q) {
      const E* orow = o + b * o_sb + q * o_ss + h * o_sh;
      const E* drow = dout + b * do_sb + q * do_ss + h * do_sh;
      for (int d = lane; d < head_dim; d += 32) sum += cuda::load_f32(orow, d) * cuda::load_f32(drow, d);
    }
    for (int off = 16; off > 0; off /= 2) sum += __shfl_xor_sync(0xffffffff, sum, off);
    float* acc = dq_accum + r * head_dim;
    for (int d = lane; d < head_dim; d += 32) acc[d] = 0.f;
    if (lane == 0) {
      const float l = q < seq_q ? lse[b * l_sb + h * l_sh + q * l_ss] : -INFINITY;
      delta[r] = sum;
      lse_log2[r] = l == -INFINITY ? INFINITY : l * float(M_LOG2E);
    }
  }
}

}  // namespace sparsetrain::cuda::attn

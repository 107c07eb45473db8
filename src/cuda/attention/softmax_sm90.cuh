// The forward's online softmax for the rows a consumer thread holds (each row in 4 adjacent
// lanes), in base 2 with the scale folded into one FFMA per element: P = exp2(S * scale_log2 -
// max * scale_log2).
//
// The running max is raised only when a row's new max exceeds it by more than kRescaleLog2 (in
// log2 units of P), FlashAttention-4's trick: below that, P = exp2(S - stale max) <= 2^8 (no
// trouble for fp32 sums nor for P in bf16 / fp16), the rescale factor is exactly 1 and the 64
// multiplies of O per row are skipped. O and the row sum share the stale max, so o = O / sum and
// lse = max * scale + log(sum) stay exact.
#pragma once

#include <cmath>

#include "cuda/attention/attention_common_sm90.cuh"

namespace sparsetrain::cuda::attn {

template <int kRows>
struct OnlineSoftmax {
  static constexpr float kRescaleLog2 = 8.f;
  float row_max[kRows], row_sum[kRows];  // row_sum: this thread's columns only (summed at the end)

  __device__ __forceinline__ void reset() {
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < kRows; ++i) row_max[i] = -INFINITY, row_sum[i] = 0.f;
  }

  // S (rows, cols), already masked, becomes P in place. correction[i]: the factor for what row i
  // accumulated before (1 when the max stayed); returns whether any of this thread's rows needs
  // it applied to O.
  template <class TS>
  __device__ __forceinline__ bool update(TS& S, float scale_log2, float (&correction)[kRows]) {
    bool rescale = false;
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < kRows; ++i) {
      float mx = row_max[i];
      CUTLASS_PRAGMA_UNROLL
      for (int j = 0; j < size<1>(S); ++j) mx = fmaxf(mx, S(i, j));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, 2));
      // A row with nothing allowed so far (max -inf) has O = 0 and sum = 0: it takes the new max
      // with a factor of 1 as well.
      const bool raise = row_max[i] == -INFINITY || (mx - row_max[i]) * scale_log2 > kRescaleLog2;
      correction[i] = 1.f;
      if (raise) {
        if (row_max[i] != -INFINITY) {
          correction[i] = fast_exp2((row_max[i] - mx) * scale_log2);
          rescale = true;
        }
        row_max[i] = mx;
      }
      const float offset = row_max[i] == -INFINITY ? 0.f : row_max[i] * scale_log2;  // all masked: P = 0
      float sum = 0.f;
      CUTLASS_PRAGMA_UNROLL
      for (int j = 0; j < size<1>(S); ++j) {
        S(i, j) = fast_exp2(S(i, j) * scale_log2 - offset);
        sum += S(i, j);
      }
      row_sum[i] = row_sum[i] * correction[i] + sum;
    }
    return rescale;
  }

  // The row sums over the 4 lanes of each row (once, at the end of an item).
  __device__ __forceinline__ void reduce_sums() {
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < kRows; ++i) {
      row_sum[i] += __shfl_xor_sync(0xffffffff, row_sum[i], 1);
      row_sum[i] += __shfl_xor_sync(0xffffffff, row_sum[i], 2);
    }
  }
};

}  // namespace sparsetrain::cuda::attn

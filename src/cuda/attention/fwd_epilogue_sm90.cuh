// The forward's epilogue: o = O / rowsum in the input dtype (pairs of adjacent columns straight
// from the accumulator registers) and the natural-log lse, for the rows a consumer thread holds;
// rows past Sq are dropped. A row with no allowed key gets o = 0 and lse = -inf, as does every
// row of an item whose walk is empty (store_empty: no accumulator involved, so nothing left in the
// registers can leak into it).
#pragma once

#include <cmath>

#include "cuda/attention/attention_fwd_params.h"
#include "cuda/attention/attention_sm90_common.cuh"

namespace sparsetrain::cuda::attn {

template <class Element, int kHeadDim, bool kEmpty, class TO, class TC, int kRows>
__device__ __forceinline__ void fwd_store_rows(const FwdArgs& a, int b, int h, int q0, TO const& O,
                                               TC const& O_coord, const float (&row_max)[kRows],
                                               const float (&row_sum)[kRows]) {
  const bool lse_lane = threadIdx.x % 4 == 0;  // one of a row's 4 lanes writes its lse
  Element* out = static_cast<Element*>(a.o);
  CUTLASS_PRAGMA_UNROLL
  for (int i = 0; i < kRows; ++i) {
    const float sum = kEmpty ? 0.f : row_sum[i];  // summed over the row's 4 lanes already
    const bool any = sum > 0.f;
    const float inv = any ? 1.f / sum : 0.f;
    const int q = q0 + get<0>(O_coord(i, 0));
    if (q >= a.seq_q) continue;
    Element* orow = out + ((int64_t(b) * a.seq_q + q) * a.heads_q + h) * kHeadDim;
    CUTLASS_PRAGMA_UNROLL
    for (int j = 0; j < size<1>(O); j += 2) {
      cutlass::Array<Element, 2> pair;
      pair[0] = Element(kEmpty || !any ? 0.f : O(i, j) * inv);
      pair[1] = Element(kEmpty || !any ? 0.f : O(i, j + 1) * inv);
      *reinterpret_cast<cutlass::Array<Element, 2>*>(orow + get<1>(O_coord(i, j))) = pair;
    }
    if (lse_lane) a.lse[(int64_t(b) * a.heads_q + h) * a.seq_q + q] = any ? row_max[i] * a.scale + logf(sum) : -INFINITY;
  }
}

}  // namespace sparsetrain::cuda::attn

// The forward's epilogue: o = O / rowsum in the input dtype and the natural-log lse, for the rows
// a consumer thread holds; rows past Sq are dropped. A row with no allowed key gets o = 0 and
// lse = -inf, as does every row of an item whose walk is empty (fwd_store_empty: no accumulator
// involved, so nothing left in the registers can leak into it).
//
// fwd_stage_o writes o into shared memory (a few matrix stores per thread) for the kernel's one
// TMA store per item; fwd_store_empty stores the zeros of an empty item from the registers.
#pragma once

#include <cmath>

#include "cuda/attention/attention_fwd_params.h"
#include "cuda/attention/attention_common_sm90.cuh"

namespace sparsetrain::cuda::attn {

// 1 / rowsum, or 0 for a row with no allowed key (its o is 0). Only an exact 0 means none: a NaN
// sum (a NaN or +inf score, a NaN or inf v) gives a NaN inverse, so that o and lse carry it, as
// the CPU reference's do (docs/DESIGN.md section 6, non-finite inputs).
__device__ __forceinline__ float fwd_inv_sum(float sum) { return sum == 0.f ? 0.f : 1.f / sum; }

// lse of the rows this thread holds; one lane of each row's four writes it.
template <bool kEmpty, class TC, int kRows>
__device__ __forceinline__ void fwd_store_lse(const FwdArgs& a, int b, int h, int q0, TC const& O_coord,
                                              const float (&row_max)[kRows], const float (&row_sum)[kRows]) {
  if (threadIdx.x % 4 != 0) return;
  CUTLASS_PRAGMA_UNROLL
  for (int i = 0; i < kRows; ++i) {
    const float sum = kEmpty ? 0.f : row_sum[i];  // summed over the row's 4 lanes already
    const int q = q0 + get<0>(O_coord(i, 0));
    if (q < a.seq_q)
      a.lse[(int64_t(b) * a.heads_q + h) * a.seq_q + q] = sum == 0.f ? -INFINITY : row_max[i] * a.scale + logf(sum);
  }
}

// An empty item's o (zeros) and lse (-inf). O_coord: this thread's (row, column) of each
// accumulator element; O_coord0: thread 0's, whose columns are compile-time constants. A thread's
// columns are its first one plus the pattern every thread shares (thread 0's), so each row is
// stored through one pointer with immediate offsets (built from O_coord alone, every store paid a
// 64-bit address computation: 4 instructions).
template <class Element, int kHeadDim, class TC, class TC0>
__device__ __forceinline__ void fwd_store_empty(const FwdArgs& a, int b, int h, int q0, TC const& O_coord,
                                                TC0 const& O_coord0) {
  constexpr int kRows = decltype(size<0>(O_coord))::value;
  Element* out = static_cast<Element*>(a.o);
  cutlass::Array<Element, 2> zero;
  zero.fill(Element(0.f));
  CUTLASS_PRAGMA_UNROLL
  for (int i = 0; i < kRows; ++i) {
    const int q = q0 + get<0>(O_coord(i, 0));
    if (q >= a.seq_q) continue;
    Element* orow = out + ((int64_t(b) * a.seq_q + q) * a.heads_q + h) * kHeadDim + get<1>(O_coord(i, 0));
    CUTLASS_PRAGMA_UNROLL
    for (int j = 0; j < size<1>(O_coord); j += 2) {
      const int col = get<1>(O_coord0(i, j)) - get<1>(O_coord0(i, 0));
      *reinterpret_cast<cutlass::Array<Element, 2>*>(orow + col) = zero;
    }
  }
  const float none[kRows] = {};
  fwd_store_lse<true>(a, b, h, q0, O_coord, none, none);
}

// o (normalised, in the input dtype) into sO, the item's [kBlockM, D] tile in shared memory, with
// matrix stores (stmatrix) from the accumulator fragment tOrO of `mma` (thread `tid` of the
// consumers); and lse from the registers. The caller fences, syncs and issues the TMA store.
template <class Element, class Mma, class TOrO, class TC, class TsO, int kRows>
__device__ __forceinline__ void fwd_stage_o(const FwdArgs& a, int b, int h, int q0, Mma const& mma, int tid,
                                            TOrO const& tOrO, TC const& O_coord, TsO& sO, const float (&row_max)[kRows],
                                            const float (&row_sum)[kRows]) {
  Tensor rO = make_tensor_like<Element>(tOrO);
  Tensor O = make_tensor(tOrO.data(), acc_rowcol(tOrO.layout()));
  Tensor O16 = make_tensor(rO.data(), acc_rowcol(rO.layout()));
  CUTLASS_PRAGMA_UNROLL
  for (int i = 0; i < kRows; ++i) {
    const float inv = fwd_inv_sum(row_sum[i]);
    CUTLASS_PRAGMA_UNROLL
    for (int j = 0; j < size<1>(O); ++j) O16(i, j) = Element(inv == 0.f ? 0.f : O(i, j) * inv);
  }
  auto copy_o = make_tiled_copy_C(Copy_Atom<SM90_U32x4_STSM_N, Element>{}, mma);
  auto thr = copy_o.get_thread_slice(tid);
  copy(copy_o, thr.retile_S(rO), thr.partition_D(sO));
  fwd_store_lse<false>(a, b, h, q0, O_coord, row_max, row_sum);
}

}  // namespace sparsetrain::cuda::attn

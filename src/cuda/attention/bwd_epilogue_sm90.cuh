// The backward's epilogue: an item's dK and dV from the consumers' registers to global memory.
#pragma once

#include <cstdint>

#include "cuda/attention/bwd_traits_sm90.cuh"

namespace sparsetrain::cuda::attn {

using namespace cute;

// dK * scale and dV in the input dtype, from the consumers' registers to global, keys past Skv
// dropped. Each row through one pointer with immediate offsets: a thread's columns are its first
// one plus the pattern every thread shares (thread 0's: compile-time constants), as the forward's
// fwd_store_empty (a 64-bit address per store made this epilogue ~11 % of the samples on short
// columns, ncu).
template <class T, class TdK, class TdV, class TC, class TC0>
__device__ __forceinline__ void bwd_store_dkdv(const BwdArgs& a, int b, int hkv, int kv0, TdK& tdKrdK, TdV& tdVrdV,
                                               TC const& tdKVcdKV, TC0 const& tdKVcdKV0) {
  using Element = typename T::Element;
  constexpr int D = T::kHeadDim;
  Tensor dK = make_tensor(tdKrdK.data(), acc_rowcol(tdKrdK.layout()));
  Tensor dV = make_tensor(tdVrdV.data(), acc_rowcol(tdVrdV.layout()));
  Tensor dKV_coord = make_tensor(tdKVcdKV.data(), acc_rowcol(tdKVcdKV.layout()));
  Tensor dKV_coord0 = make_tensor(tdKVcdKV0.data(), acc_rowcol(tdKVcdKV0.layout()));
  CUTLASS_PRAGMA_UNROLL
  for (int i = 0; i < size<0>(dK); ++i) {
    const int kv = kv0 + get<0>(dKV_coord(i, 0));
    if (kv >= a.seq_kv) continue;
    const int64_t off = ((int64_t(b) * a.seq_kv + kv) * a.heads_kv + hkv) * D + get<1>(dKV_coord(i, 0));
    Element* dk = static_cast<Element*>(a.dk) + off;
    Element* dv = static_cast<Element*>(a.dv) + off;
    CUTLASS_PRAGMA_UNROLL
    for (int j = 0; j < size<1>(dK); j += 2) {
      const int d = get<1>(dKV_coord0(i, j)) - get<1>(dKV_coord0(i, 0));
      cutlass::Array<Element, 2> k2, v2;
      k2[0] = Element(dK(i, j) * a.scale);
      k2[1] = Element(dK(i, j + 1) * a.scale);
      v2[0] = Element(dV(i, j));
      v2[1] = Element(dV(i, j + 1));
      *reinterpret_cast<cutlass::Array<Element, 2>*>(dk + d) = k2;
      *reinterpret_cast<cutlass::Array<Element, 2>*>(dv + d) = v2;
    }
  }
}

}  // namespace sparsetrain::cuda::attn

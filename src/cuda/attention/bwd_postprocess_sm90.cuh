// The backward's postprocessing: the fp32 dQ accumulator (fragment order) to dq in the input dtype.
#pragma once

#include <cstdint>
#include <cstdio>

#include "cuda/attention/bwd_traits_sm90.cuh"

namespace sparsetrain::cuda::attn {

using namespace cute;

// dq [B, Sq, Hq, D] (contiguous) = scale * the fp32 accumulator, whose q tiles are in fragment
// order (dq_fragment_offset): one CTA of kMmaThreads per q tile, each thread converting the values
// its namesake in the dQ GEMM produced. Also reports a dQ wait the kernel gave up (abandoned).
template <class T>
__global__ void __launch_bounds__(T::kMmaThreads) bwd_convert_dq_kernel(const BwdArgs a, void* dq_out) {
  using Element = typename T::Element;
  constexpr int M = T::kBlockM, D = T::kHeadDim;
  if (blockIdx.x == 0 && threadIdx.x == 0 && a.abandoned[0] != 0)
    printf("sparsetrain attention backward: a dQ wait timed out (q tile semaphore %d held %d, waiting for turn %d): "
           "the mask's dq_write_order does not match its lists; the deterministic dQ order was given up\n",
           a.abandoned[1], a.abandoned[3], a.abandoned[2]);
  typename T::MmaDq mma_dq;
  const int tid = threadIdx.x;
  Tensor coord = mma_dq.get_thread_slice(tid).partition_C(make_identity_tensor(Shape<Int<M>, Int<D>>{}));
  const int tiles = a.lists.num_q_tiles;
  Element* dq = static_cast<Element*>(dq_out);
  for (int64_t tile = blockIdx.x; tile < int64_t(a.batch) * a.heads_q * tiles; tile += gridDim.x) {
    const int q_tile = int(tile % tiles);
    const int64_t bh = tile / tiles;
    const int64_t b = bh / a.heads_q, h = bh % a.heads_q;
    const float* acc = a.dq_accum + tile * (M * D);
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < size(coord); i += 2) {
      const int q = q_tile * M + get<0>(coord(i));
      if (q >= a.seq_q) continue;
      const float2 v = *reinterpret_cast<const float2*>(acc + dq_fragment_offset<T>(tid, i));
      cutlass::Array<Element, 2> pair;  // fragment values i, i + 1: adjacent columns
      pair[0] = Element(v.x * a.scale);
      pair[1] = Element(v.y * a.scale);
      *reinterpret_cast<cutlass::Array<Element, 2>*>(dq + ((b * a.seq_q + q) * a.heads_q + h) * D + get<1>(coord(i))) =
          pair;
    }
  }
}

}  // namespace sparsetrain::cuda::attn

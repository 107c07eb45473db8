// The backward's postprocessing: the fp32 dQ accumulator (fragment order) to dq in the input dtype.
#pragma once

#include <cstdint>
#include <cstdio>

#include "cuda/attention/bwd_traits_sm90.cuh"
#include "cuda/pdl.cuh"

namespace sparsetrain::cuda::attn {

using namespace cute;

// dq [B, Sq, Hq, D] (contiguous) = scale * the fp32 accumulator, whose q tiles are in fragment
// order (dq_fragment_offset): one CTA of kMmaThreads per q tile. Each thread reads the values its
// namesake in the dQ GEMM produced, four at a time (one 16-byte load: two column pairs of rows r
// and r + 8), into a [q, D] tile in shared memory in the input dtype; the tile then leaves in
// 16-byte stores along its rows. (Storing each column pair from the fragment straight to global,
// 4 bytes a thread and 8 rows a warp instruction, ran at a quarter of the memory's bandwidth,
// a fifth of a short-row backward.)
// Also reports a dQ wait the kernel gave up (abandoned).
template <class T>
__global__ void __launch_bounds__(T::kMmaThreads) bwd_convert_dq_kernel(const BwdArgs a, void* dq_out) {
  using Element = typename T::Element;
  constexpr int M = T::kBlockM, D = T::kHeadDim;
  // 16 bytes of padding a row: the 8 rows of a fragment store fall in distinct banks.
  constexpr int kPitch = D + 16 / int(sizeof(Element));
  constexpr int kPerChunk = 16 / int(sizeof(Element)), kChunks = D / kPerChunk;  // 16-byte pieces of a row
  static_assert(D % kPerChunk == 0, "rows leave in 16-byte stores (dq: the library's, 256-byte aligned)");
  __shared__ alignas(16) Element tile[M * kPitch];
  pdl_wait();  // launched as a dependent of the backward kernel (cuda/pdl.cuh): its dQ, complete
  if (blockIdx.x == 0 && threadIdx.x == 0 && a.abandoned[0] != 0)
    printf("sparsetrain attention backward: a dQ wait timed out (q tile semaphore %d held %d, waiting for turn %d): "
           "the mask's dq_write_order does not match its lists; the deterministic dQ order was given up\n",
           a.abandoned[1], a.abandoned[3], a.abandoned[2]);
  typename T::MmaDq mma_dq;
  const int tid = threadIdx.x;
  Tensor coord = mma_dq.get_thread_slice(tid).partition_C(make_identity_tensor(Shape<Int<M>, Int<D>>{}));
  static_assert(decltype(size(coord))::value % 4 == 0, "fragment values go in fours");
  const int tiles = a.lists.num_q_tiles;
  Element* dq = static_cast<Element*>(dq_out);
  const int64_t total = int64_t(a.batch) * a.heads_q * tiles;
  // Last tiles first: the hand-out's last L2 sections are the highest (batch, head) groups, whose
  // accumulator tiles were written last and may still be in L2 (-3 % of this kernel's time, PERF).
  for (int64_t n = blockIdx.x; n < total; n += gridDim.x) {
    const int64_t tile_index = total - 1 - n;
    const int q_tile = int(tile_index % tiles);
    const int64_t bh = tile_index / tiles;
    const int64_t b = bh / a.heads_q, h = bh % a.heads_q;
    const float* acc = a.dq_accum + tile_index * (M * D);
    // The deterministic mode's accumulator is not zeroed: a tile that no writer stored to (its
    // semaphore still 0: no visit) is dQ = 0.
    const bool written = !a.deterministic || a.semaphores[tile_index] != 0;
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < size(coord); i += 4) {
      const float4 v = written ? *reinterpret_cast<const float4*>(acc + dq_fragment_offset<T>(tid, i)) : float4{};
      cutlass::Array<Element, 2> lo, hi;  // fragment values i, i + 1 and i + 2, i + 3: adjacent columns
      lo[0] = Element(v.x * a.scale);
      lo[1] = Element(v.y * a.scale);
      hi[0] = Element(v.z * a.scale);
      hi[1] = Element(v.w * a.scale);
      *reinterpret_cast<cutlass::Array<Element, 2>*>(tile + get<0>(coord(i)) * kPitch + get<1>(coord(i))) = lo;
      *reinterpret_cast<cutlass::Array<Element, 2>*>(tile + get<0>(coord(i + 2)) * kPitch + get<1>(coord(i + 2))) = hi;
    }
    __syncthreads();
    for (int c = tid; c < M * kChunks; c += blockDim.x) {
      const int row = c / kChunks, chunk = c % kChunks;
      const int pos = q_tile * M + row;  // a mask position; its token (padded documents: -1 for padding)
      const int q = bwd_real_row(a, int32_t(b), pos);
      if (q >= 0 && q < a.seq_q)
        *reinterpret_cast<uint4*>(dq + ((b * a.seq_q + q) * a.heads_q + h) * D + chunk * kPerChunk) =
            *reinterpret_cast<const uint4*>(tile + row * kPitch + chunk * kPerChunk);
    }
    __syncthreads();  // the tile is read before the next one is written
  }
}

}  // namespace sparsetrain::cuda::attn

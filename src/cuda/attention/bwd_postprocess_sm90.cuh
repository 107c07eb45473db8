// The backward's dQ conversion: the fp32 accumulator (fragment order, times scale) to dq in the
// input dtype. In the deterministic mode a converter warp of the main kernel converts each q tile
// after its last turn (from shared memory, where the tile's writer brings it back from L2); a kernel
// after the main one converts every tile the main kernel did not (the non-deterministic mode's,
// and any whose landed turns differ from the mask's hint) and reports a dQ wait that gave up.
#pragma once

#include <cstdint>
#include <cstdio>

#include "cuda/attention/bwd_traits_sm90.cuh"
#include "cuda/pdl.cuh"

namespace sparsetrain::cuda::attn {

using namespace cute;

// One warp converts q tile `q_tile` of (b, h), finished and in fragment order in shared memory,
// into dq [B, Sq, Hq, D] (a.dq: contiguous, 16-byte aligned; the library allocates it). Lane l
// takes every 32nd quad: the four float4s of values i..i+3 of consumer threads t..t+3 (t % 4 == 0,
// i % 4 == 0), which the dQ GEMM's accumulator puts in 8 adjacent columns of one row (values i,
// i + 1 of each thread) and of the row 8 below (i + 2, i + 3), so each row's piece leaves in one
// 16-byte store (tests/cpp/test_bwd_fragment_layout.cu checks that layout against CuTe's).
template <class T>
__device__ void bwd_convert_dq_tile_warp(const BwdArgs& a, const float* tile, int b, int h, int q_tile, int lane) {
  using Element = typename T::Element;
  constexpr int M = T::kBlockM, D = T::kHeadDim;
  constexpr int kQuads = T::kMmaThreads / 4, kFours = M * D / T::kMmaThreads / 4;
  static_assert(D % 8 == 0 && sizeof(Element) == 2, "8 adjacent columns are one 16-byte store");
  typename T::MmaDq mma;
  const int64_t row_stride = int64_t(a.heads_q) * D;
  Element* dq = static_cast<Element*>(a.dq) + (int64_t(b) * a.seq_q * a.heads_q + h) * D;  // + q * row_stride
  for (int u = lane; u < kQuads * kFours; u += 32) {
    const int t = u % kQuads * 4, i = u / kQuads * 4;
    const auto rc = mma.get_thread_slice(t).partition_C(make_identity_tensor(Shape<Int<M>, Int<D>>{}))(i);
    float4 x[4];
    CUTLASS_PRAGMA_UNROLL
    for (int j = 0; j < 4; ++j) x[j] = *reinterpret_cast<const float4*>(tile + dq_fragment_offset<T>(t + j, i));
    cutlass::Array<Element, 8> top, below;  // thread t + j's values: columns 2j, 2j + 1
    CUTLASS_PRAGMA_UNROLL
    for (int j = 0; j < 4; ++j) {
      top[2 * j] = Element(x[j].x * a.scale);
      top[2 * j + 1] = Element(x[j].y * a.scale);
      below[2 * j] = Element(x[j].z * a.scale);
      below[2 * j + 1] = Element(x[j].w * a.scale);
    }
    const int q = q_tile * M + int(get<0>(rc));
    Element* at = dq + int64_t(q) * row_stride + int(get<1>(rc));
    if (q < a.seq_q) *reinterpret_cast<uint4*>(at) = reinterpret_cast<const uint4&>(top);
    if (q + 8 < a.seq_q) *reinterpret_cast<uint4*>(at + 8 * row_stride) = reinterpret_cast<const uint4&>(below);
  }
}

// The converter warp of the main kernel (warp 3 of the producer warpgroup; deterministic mode):
// takes each finished q tile a dQ writer hands over in a dQ buffer (bwd_write_dq: the writer of the
// tile's last turn, with the tile back from L2), converts it with its 32 lanes and returns the
// buffer to the consumers. It polls the buffers (lane 0, so the warp stays converged) and leaves
// once both writers are done and every job they counted is converted.
template <class T>
__device__ void bwd_convert_finished_tiles(const BwdArgs& a, typename T::SharedStorage& ss) {
  const int lane = cutlass::canonical_lane_idx();
  uint32_t parity = 0;  // bit i: the phase of buffer i's next job
  for (int converted = 0;;) {
    int buf = -1;
    if (lane == 0) {
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < T::kDqBuffers; ++i)
        if (buf < 0 && cutlass::arch::ClusterBarrier::test_wait(&ss.dq_loaded[i], (parity >> i) & 1, 1u)) buf = i;
      if (buf < 0 && *reinterpret_cast<volatile int32_t*>(&ss.dq_writers_done) == T::kDqWriters) {
        __threadfence_block();
        if (*reinterpret_cast<volatile int32_t*>(&ss.dq_jobs) == converted) buf = -2;
      }
      if (buf == -1) __nanosleep(64);
    }
    buf = __shfl_sync(0xffffffffu, buf, 0);
    if (buf == -2) break;
    if (buf < 0) continue;
    cutlass::arch::ClusterBarrier::wait(&ss.dq_loaded[buf], (parity >> buf) & 1);  // each lane's view
    parity ^= 1u << buf;
    const int32_t tile = ss.dq_job[buf], tiles = a.lists.num_q_tiles, bh = tile / tiles;
    bwd_convert_dq_tile_warp<T>(a, ss.dq.data() + buf * (T::kBlockM * T::kHeadDim), bh / a.heads_q, bh % a.heads_q,
                                tile % tiles, lane);
    __syncwarp();
    if (lane == 0) cutlass::arch::ClusterBarrier::arrive(&ss.dq_empty[buf]);
    ++converted;
  }
}

// Whether the main kernel converted q tile `tile_index` itself: deterministic, no dQ wait given up,
// and the turns that landed (its semaphore) exactly the mask's hint (dq_tile_turns), so the writer
// of the hint's last turn converted the whole sum. A device mask's row lists are not checked
// against its column lists: a wrong hint means the tile was converted too early (more turns came
// after) or never, and the conversion kernel does it.
__device__ __forceinline__ bool dq_converted_in_kernel(const BwdArgs& a, int64_t tile_index, int b, int h, int q_tile) {
  if (!a.deterministic || a.abandoned[0] != 0) return false;
  const int32_t turns = dq_tile_turns(a, b, h, q_tile / a.lists.q_tiles_per_block);
  return turns > 0 && a.semaphores[tile_index] == turns;
}

// dq [B, Sq, Hq, D] (contiguous) = scale * the fp32 accumulator, whose q tiles are in fragment
// order (dq_fragment_offset), for the tiles the main kernel did not convert: one CTA of
// kMmaThreads per q tile. Each thread reads the values its
// namesake in the dQ GEMM produced, four at a time (one 16-byte load: two column pairs of rows r
// and r + 8), into a [q, D] tile in shared memory in the input dtype; the tile then leaves in
// 16-byte stores along its rows. (Storing each column pair from the fragment straight to global,
// 4 bytes a thread and 8 rows a warp instruction, ran at a quarter of the memory's bandwidth:
// 220 us for 128 MiB of accumulator on an H100, 19 % of a short-row backward; docs/PERF.md.)
// Also reports a dQ wait the kernel gave up (abandoned).
template <class T>
__global__ void __launch_bounds__(T::kMmaThreads) bwd_convert_dq_kernel(const BwdArgs a) {
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
  Element* dq = static_cast<Element*>(a.dq);
  const int64_t total = int64_t(a.batch) * a.heads_q * tiles;
  // Last tiles first: the hand-out's last L2 sections are the highest (batch, head) groups, whose
  // accumulator tiles were written last and may still be in L2 (-3 % of this kernel's time, PERF).
  for (int64_t n = blockIdx.x; n < total; n += gridDim.x) {
    const int64_t tile_index = total - 1 - n;
    const int q_tile = int(tile_index % tiles);
    const int64_t bh = tile_index / tiles;
    const int64_t b = bh / a.heads_q, h = bh % a.heads_q;
    if (dq_converted_in_kernel(a, tile_index, int(b), int(h), q_tile)) continue;  // the same for the whole CTA
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
      const int q = q_tile * M + row;
      if (q < a.seq_q)
        *reinterpret_cast<uint4*>(dq + ((b * a.seq_q + q) * a.heads_q + h) * D + chunk * kPerChunk) =
            *reinterpret_cast<const uint4*>(tile + row * kPitch + chunk * kPerChunk);
    }
    __syncthreads();  // the tile is read before the next one is written
  }
}

}  // namespace sparsetrain::cuda::attn

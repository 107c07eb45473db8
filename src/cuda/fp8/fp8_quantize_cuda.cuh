// The FP8 recipe's quantizers on the GPU (docs/DESIGN.md section 12): the rules of
// common/fp8_blockwise.h run unchanged, so codes and scales are bitwise the CPU reference's. Group
// offsets are read on the device (no host sync, capturable); every launch is shaped by T, K, C and
// G only, so a captured graph replays with new splits. A tile's amax is a reduction of a
// maximum, exact in any order: the results are deterministic.
//
//   rowwise     16 threads per (row, 128-channel tile), 8 channels each (16-byte loads), two
//               rows a thread, the amax a shuffle reduction; codes [T, K], scales grouped M-major
//   columnwise  one block per (128-token tile, 64 channels): the tile staged in shared memory,
//               a channel's amax over its 128 tokens, codes written transposed ([C, columns],
//               tokens contiguous, 16 bytes a store), the rest of an expert's last tile zero codes
//   both        one block per (128-token tile, 128 channels): rowwise from the registers as the
//               tile is read, columnwise from shared memory; one read for a gradient's two layouts
//   weights     one block per (expert, 128 x 128 block), read once into registers: both copies (W
//               and W^T) and both grids
// All are bound by memory traffic once the encoding is the hardware's (fp8_quantize).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "common/fp8_blockwise.h"
#include "common/group_offsets.h"
#include "cuda/element.cuh"

namespace sparsetrain::cuda::fp8 {

constexpr int kTile = int(kFp8Tile);

__device__ inline float warp_amax(float a) {
#pragma unroll
  for (int o = 16; o > 0; o /= 2) a = fp8_amax(a, __shfl_xor_sync(0xffffffffu, a, o));
  return a;
}

// Eight consecutive elements k0 .. k0 + 7 of a row as fp32, zeros past K. kVec: one 16-byte load
// (the caller checked that E is 2 bytes, K and the row stride multiples of 8, the base 16-byte
// aligned; k0 is a multiple of 8, so k0 < K means all eight are in the row).
template <typename E, bool kVec>
__device__ inline void load8(const E* row, int64_t k0, int64_t K, float (&v)[8]) {
  if constexpr (kVec) {
    if (k0 < K) {
      Pack<E, 8> p;
      p.load(row + k0);
#pragma unroll
      for (int i = 0; i < 8; ++i) v[i] = p.v[i];
      return;
    }
#pragma unroll
    for (int i = 0; i < 8; ++i) v[i] = 0.f;
  } else {
#pragma unroll
    for (int i = 0; i < 8; ++i) v[i] = k0 + i < K ? load_f32(row, k0 + i) : 0.f;
  }
}

// The codes of eight consecutive elements k .. k + 7 of a row (scale s), none past K; kVec: one
// 8-byte store (k and K multiples of 8, the row 8-byte aligned).
template <bool kVec>
__device__ inline void store8_codes(uint8_t* out, int64_t k, int64_t K, const float (&v)[8], float s) {
  if constexpr (kVec) {
    if (k < K) {
      uint32_t lo = 0, hi = 0;
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        lo |= uint32_t(fp8_quantize(v[j], s)) << (8 * j);
        hi |= uint32_t(fp8_quantize(v[j + 4], s)) << (8 * j);
      }
      *reinterpret_cast<uint2*>(out) = make_uint2(lo, hi);
    }
  } else {
#pragma unroll
    for (int j = 0; j < 8; ++j)
      if (k + j < K) out[j] = fp8_quantize(v[j], s);
  }
}

// Rowwise: rows [0, S) of src [T, K] (row stride src_ld): codes q [T, K], scales
// (fp8_rowwise_scale_index). Grid (ceil(T / 32), KB), block 256: sixteen threads a (row, 128-channel
// tile), eight channels each, two rows a thread (both loads in flight before either is used); the
// tile's amax a shuffle reduction within the half warp. No integer division: the tile is the
// block's y, the row its x and the thread's place. kVec: 16-byte loads, 8-byte code stores (K a
// multiple of 8 too).
constexpr int kRowThreads = 16, kRowsPerThread = 2, kRowsPerBlock = 256 / kRowThreads * kRowsPerThread;
template <typename E, bool kVec>
__global__ void __launch_bounds__(256) quantize_rowwise_kernel(const int64_t* offsets, int64_t G, const E* src,
                                                               int64_t src_ld, int64_t K, uint8_t* q, float* scale) {
  const int64_t S = offsets[G], first = int64_t(blockIdx.x) * kRowsPerBlock;
  if (first >= S) return;  // the whole block in the padded tail
  const int64_t KB = fp8_tiles(K), kb = blockIdx.y, k = kb * kTile + int(threadIdx.x) % kRowThreads * 8;
  const int64_t r0 = first + int(threadIdx.x) / kRowThreads;
  float v[kRowsPerThread][8];
#pragma unroll
  for (int p = 0; p < kRowsPerThread; ++p) {
    const int64_t r = r0 + p * (256 / kRowThreads);
    if (r < S) {
      load8<E, kVec>(src + r * src_ld, k, K, v[p]);
    } else {
#pragma unroll
      for (int j = 0; j < 8; ++j) v[p][j] = 0.f;
    }
  }
#pragma unroll
  for (int p = 0; p < kRowsPerThread; ++p) {
    const int64_t r = r0 + p * (256 / kRowThreads);
    float amax = 0.f;
#pragma unroll
    for (int j = 0; j < 8; ++j) amax = fp8_amax(amax, v[p][j]);
#pragma unroll
    for (int o = kRowThreads / 2; o > 0; o /= 2) amax = fp8_amax(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    if (r >= S) continue;  // after the shuffles, which every lane joins
    const float s = fp8_scale(amax);
    store8_codes<kVec>(q + r * K + k, k, K, v[p], s);
    if (threadIdx.x % kRowThreads == 0) {
      const int64_t g = group_of_row(offsets, G, r);
      scale[fp8_rowwise_scale_index(offsets[g], offsets[g + 1] - offsets[g], KB, r, kb)] = s;
    }
  }
}

// The expert owning columnwise tile `global_tile` (the experts' tiles in order) and its first
// tile's number, g == G for a tile past them all; by a whole warp, 32 experts a step (a scan of
// their tile counts and a ballot: G / 32 steps, not G dependent ones), the same on every lane.
struct ExpertTile {
  int64_t g, base;
};
__device__ inline ExpertTile expert_tile(const int64_t* offsets, int64_t G, int64_t global_tile) {
  const int lane = int(threadIdx.x) % 32;
  int64_t base = 0;
  for (int64_t g0 = 0; g0 < G; g0 += 32) {
    const int64_t g = g0 + lane;
    const int64_t n = g < G ? fp8_tiles(offsets[g + 1] - offsets[g]) : 0;
    int64_t inclusive = n;
#pragma unroll
    for (int o = 1; o < 32; o *= 2) {
      const int64_t up = __shfl_up_sync(0xffffffffu, inclusive, o);
      if (lane >= o) inclusive += up;
    }
    const int64_t own_first = base + inclusive - n;
    const unsigned hit = __ballot_sync(0xffffffffu, global_tile >= own_first && global_tile < own_first + n);
    if (hit != 0) {
      const int owner = __ffs(int(hit)) - 1;
      return {g0 + owner, __shfl_sync(0xffffffffu, own_first, owner)};
    }
    base += __shfl_sync(0xffffffffu, inclusive, 31);
  }
  return {G, base};
}

// The column where a staged tile keeps element (token i, channel j) of a row of `width` elements:
// rotated by `shift` elements per 16 tokens. The columnwise reads have eight threads a channel,
// 16 tokens apart (i0 = 0, 16, .., 112), over a row stride of an odd number of words: unrotated,
// i0 = 0, 32, 64, 96 fall in one bank (4-way conflicts); rotated by 4 words per 16 tokens they
// fall in eight distinct ones (20 m mod 32 over m = 0..7).
__device__ inline int staged_column(int i, int j, int shift, int width) { return (j + shift * (i / 16)) % width; }

// One channel of a columnwise tile, by eight adjacent threads holding 16 consecutive tokens each
// (v): the channel's amax over the eight (every lane shuffles), its scale, and where `write` (the
// channel exists) 16 codes in one 16-byte store at `codes` (16-byte aligned), zero codes from token
// `live` on (past the expert's rows), the scale by the first of the eight.
__device__ inline void channel_codes(const float (&v)[16], int64_t live, bool write, uint8_t* codes,
                                     float* scale_slot) {
  float amax = 0.f;
#pragma unroll
  for (int i = 0; i < 16; ++i) amax = fp8_amax(amax, v[i]);
#pragma unroll
  for (int o = 4; o > 0; o /= 2) amax = fp8_amax(amax, __shfl_xor_sync(0xffffffffu, amax, o));
  const float s = fp8_scale(amax);
  if (!write) return;
  uint32_t w[4] = {0, 0, 0, 0};
#pragma unroll
  for (int i = 0; i < 16; ++i)
    if (i < live) w[i / 4] |= uint32_t(fp8_quantize(v[i], s)) << (8 * (i % 4));
  *reinterpret_cast<uint4*>(codes) = make_uint4(w[0], w[1], w[2], w[3]);
  if (threadIdx.x % 8 == 0) *scale_slot = s;
}

// Columnwise: grid (max tiles, ceil(C / 64)); block 256. The block's (128-token tile of one
// expert, 64 channels) is staged in shared memory (rows loaded eight channels a thread, 16-byte
// loads with kVec), then each channel's 128 tokens are eight threads' 16 (adjacent lanes: the
// amax a 3-step shuffle), written as 16 codes in one 16-byte store (columns and the tile base
// are multiples of 128), tokens past the expert's rows zero codes. A block past the experts'
// tiles returns.
constexpr int kColChannels = 64;
template <typename E, bool kVec>
__global__ void __launch_bounds__(256) quantize_columnwise_kernel(const int64_t* offsets, int64_t G, const E* src,
                                                                  int64_t src_ld, int64_t C, int64_t columns,
                                                                  uint8_t* q, float* scale) {
  __shared__ float tile[kTile][kColChannels + 1];
  const ExpertTile et = expert_tile(offsets, G, blockIdx.x);
  if (et.g == G) return;
  const int64_t base = et.base, begin = offsets[et.g], rows = offsets[et.g + 1] - begin, t = blockIdx.x - base;
  const int64_t c0 = int64_t(blockIdx.y) * kColChannels;
  const int tid = int(threadIdx.x);
  for (int i = tid / 8; i < kTile; i += 32) {  // row i of the tile, channels c0 + (tid % 8) * 8 ..
    const int cc = (tid % 8) * 8;
    float v[8];
    if (t * kTile + i < rows) {
      load8<E, kVec>(src + (begin + t * kTile + i) * src_ld, c0 + cc, C, v);
    } else {
#pragma unroll
      for (int k = 0; k < 8; ++k) v[k] = 0.f;
    }
#pragma unroll
    for (int k = 0; k < 8; ++k) tile[i][staged_column(i, cc + k, 4, kColChannels)] = v[k];
  }
  __syncthreads();
  for (int j = tid / 8; j < kColChannels; j += 32) {  // channel c0 + j, tokens i0 .. i0 + 15
    const int i0 = (tid % 8) * 16;
    float v[16];
#pragma unroll
    for (int i = 0; i < 16; ++i) v[i] = tile[i0 + i][staged_column(i0 + i, j, 4, kColChannels)];
    const int64_t c = c0 + j;
    channel_codes(v, rows - (t * kTile + i0), c < C,
                  q + fp8_columnwise_data_index(columns, base, begin, begin + t * kTile + i0, c),
                  scale + fp8_columnwise_scale_index(base, t, C, c));
  }
}

// Both layouts from one read (a gradient dgrad reads rowwise and wgrad columnwise), 2-byte
// elements: grid (max tiles, ceil(K / 128)); block 256. The block's (128-token tile of one expert,
// 128-channel tile) is read sixteen threads a row, eight channels each: the row's tile is quantized
// rowwise from the registers (the rowwise kernel's steps) and kept in shared memory as read; then
// each channel's 128 tokens are quantized columnwise from there (the columnwise kernel's steps).
// The experts' tiles cover rows [0, S) once, so every rowwise code below S is written once.
constexpr int kBothRowStride = kTile + 2;  // elements: 65 words a row (staged_column)
template <typename E, bool kVec>
__global__ void __launch_bounds__(256) quantize_both_kernel(const int64_t* offsets, int64_t G, const E* src,
                                                            int64_t src_ld, int64_t K, uint8_t* q_row,
                                                            float* s_row, int64_t columns, uint8_t* q_col,
                                                            float* s_col) {
  static_assert(sizeof(E) == 2, "the tile is kept as 2-byte elements");
  __shared__ uint16_t raw[kTile * kBothRowStride];
  E* tile = reinterpret_cast<E*>(raw);
  const ExpertTile et = expert_tile(offsets, G, blockIdx.x);
  if (et.g == G) return;
  const int64_t base = et.base, begin = offsets[et.g], rows = offsets[et.g + 1] - begin, t = blockIdx.x - base;
  const int64_t KB = fp8_tiles(K), kb = blockIdx.y, k0 = kb * kTile;
  const int tid = int(threadIdx.x), sub = tid % kRowThreads;
  for (int i = tid / kRowThreads; i < kTile; i += 256 / kRowThreads) {  // row t * 128 + i of the expert
    const int64_t r = t * kTile + i, k = k0 + sub * 8;
    const bool live = r < rows;
    float v[8];
    if (live) {
      load8<E, kVec>(src + (begin + r) * src_ld, k, K, v);
    } else {
#pragma unroll
      for (int j = 0; j < 8; ++j) v[j] = 0.f;
    }
    float amax = 0.f;
#pragma unroll
    for (int j = 0; j < 8; ++j) amax = fp8_amax(amax, v[j]);
#pragma unroll
    for (int o = kRowThreads / 2; o > 0; o /= 2) amax = fp8_amax(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    const float s = fp8_scale(amax);
    if (live) {
      store8_codes<kVec>(q_row + (begin + r) * K + k, k, K, v, s);
      if (sub == 0) s_row[fp8_rowwise_scale_index(begin, rows, KB, begin + r, kb)] = s;
    }
#pragma unroll
    for (int j = 0; j < 8; ++j)  // exact: read back as E
      store_f32(tile + i * kBothRowStride, staged_column(i, sub * 8 + j, 8, kTile), v[j]);
  }
  __syncthreads();
  for (int j = tid / 8; j < kTile; j += 32) {  // channel k0 + j, tokens i0 .. i0 + 15
    const int i0 = (tid % 8) * 16;
    float v[16];
#pragma unroll
    for (int i = 0; i < 16; ++i) v[i] = load_f32(tile + (i0 + i) * kBothRowStride, staged_column(i0 + i, j, 8, kTile));
    const int64_t c = k0 + j;
    channel_codes(v, rows - (t * kTile + i0), c < K,
                  q_col + fp8_columnwise_data_index(columns, base, begin, begin + t * kTile + i0, c),
                  s_col + fp8_columnwise_scale_index(base, t, K, c));
  }
}

// Weights: grid (blocks of out, blocks of in, G); block 256. w[g] [out, in] row-major (the
// pointer table), codes q[g] [out, in] and qt[g] [in, out], grids s[g] and st[g].
template <int Cap>
struct WeightTables {
  const void* w[Cap];
  uint8_t* q[Cap];
  uint8_t* qt[Cap];
  float* s[Cap];
  float* st[Cap];
};
// Thread (tid / 16 + 16 p, (tid % 16) * 8) holds rows i0 + tid / 16 + 16 p, p < 8, eight columns
// each: the block's 128 x 128 elements in registers, read once (16-byte loads with kVec: in a
// multiple of 8, the bases aligned); its amax, then W's codes from the registers (8-byte stores)
// and, staged in shared memory, W^T's (lanes along a column of the block: coalesced rows of W^T).
template <typename E, int Cap, bool kVec>
__global__ void __launch_bounds__(256) quantize_weights_kernel(const __grid_constant__ WeightTables<Cap> p,
                                                               int64_t out, int64_t in) {
  constexpr int kRows = kTile / 16;  // rows a thread
  __shared__ float amax_part[8];
  __shared__ float block_scale;
  // A row of 132 bytes (33 words) puts a column's 32 bytes in 32 banks.
  __shared__ uint8_t codes[kTile][kTile + 4];
  const int64_t g = blockIdx.z, i0 = int64_t(blockIdx.x) * kTile, j0 = int64_t(blockIdx.y) * kTile;
  const E* w = static_cast<const E*>(p.w[g]);
  const int tid = int(threadIdx.x), lane = tid % 32, warp = tid / 32, col = (tid % 16) * 8;
  float v[kRows][8];
  float amax = 0.f;
#pragma unroll
  for (int k = 0; k < kRows; ++k) {
    const int64_t r = i0 + tid / 16 + 16 * k;
    if (r < out) {
      load8<E, kVec>(w + r * in, j0 + col, in, v[k]);
    } else {
#pragma unroll
      for (int j = 0; j < 8; ++j) v[k][j] = 0.f;
    }
#pragma unroll
    for (int j = 0; j < 8; ++j) amax = fp8_amax(amax, v[k][j]);
  }
  amax = warp_amax(amax);
  if (lane == 0) amax_part[warp] = amax;
  __syncthreads();
  if (tid == 0) {
    float a = 0.f;
    for (int k = 0; k < 8; ++k) a = fp8_amax(a, amax_part[k]);
    block_scale = fp8_scale(a);
    p.s[g][fp8_block_scale_index(in, i0, j0)] = block_scale;
    p.st[g][fp8_block_scale_index(out, j0, i0)] = block_scale;
  }
  __syncthreads();
  const float s = block_scale;
#pragma unroll
  for (int k = 0; k < kRows; ++k) {
    const int i = tid / 16 + 16 * k;
    if (i0 + i < out) store8_codes<kVec>(p.q[g] + (i0 + i) * in + j0 + col, j0 + col, in, v[k], s);
#pragma unroll
    for (int j = 0; j < 8; ++j) codes[i][col + j] = fp8_quantize(v[k][j], s);
  }
  __syncthreads();
  for (int j = warp; j < kTile; j += 8)
    for (int i = lane; i < kTile; i += 32) {
      const int64_t r = i0 + i, c = j0 + j;
      if (r < out && c < in) p.qt[g][c * out + r] = codes[i][j];
    }
}

}  // namespace sparsetrain::cuda::fp8

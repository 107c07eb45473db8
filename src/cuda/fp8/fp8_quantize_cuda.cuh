// The FP8 recipe's quantizers on the GPU (docs/DESIGN.md section 12): the rules of
// common/fp8_blockwise.h run unchanged, so codes and scales are bitwise the CPU reference's. Group
// offsets are read on the device (no host sync, capturable); every launch is shaped by T, K, C and
// G only, so a captured graph replays with new splits. A tile's amax is a reduction of a
// maximum, exact in any order: the results are deterministic.
//
//   rowwise     one warp per (row, 128-channel tile): each lane holds 4 channels, the amax a
//               shuffle reduction; codes [T, K], scales grouped M-major
//   columnwise  one block per (128-token tile, 32 channels): the tile staged in shared memory,
//               a channel's amax over its 128 tokens, codes written transposed ([C, columns],
//               tokens contiguous), the rest of an expert's last tile zero codes
//   weights     one block per (expert, 128 x 128 block): both copies (W and W^T) and both grids
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

// Rows [0, S) of src [T, K] (row stride src_ld): codes q [T, K], scales (fp8_rowwise_scale_index).
template <typename E>
__global__ void __launch_bounds__(256) quantize_rowwise_kernel(const int64_t* offsets, int64_t G, const E* src,
                                                               int64_t src_ld, int64_t T, int64_t K, uint8_t* q,
                                                               float* scale) {
  const int64_t KB = fp8_tiles(K);
  const int lane = int(threadIdx.x) % 32;
  const int64_t S = offsets[G];
  for (int64_t w = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / 32; w < T * KB;
       w += int64_t(gridDim.x) * blockDim.x / 32) {
    const int64_t r = w / KB, kb = w % KB;
    if (r >= S) break;  // warps walk rows in order: every later one is in the tail too
    const E* row = src + r * src_ld;
    float v[4];
    float amax = 0.f;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int64_t k = kb * kTile + i * 32 + lane;
      v[i] = k < K ? load_f32(row, k) : 0.f;
      amax = fp8_amax(amax, v[i]);
    }
    amax = warp_amax(amax);
    const float s = fp8_scale(amax);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int64_t k = kb * kTile + i * 32 + lane;
      if (k < K) q[r * K + k] = fp8_quantize(v[i], s);
    }
    if (lane == 0) {
      const int64_t g = group_of_row(offsets, G, r);
      scale[fp8_rowwise_scale_index(offsets[g], offsets[g + 1] - offsets[g], KB, r, kb)] = s;
    }
  }
}

// Columnwise: grid (max tiles, ceil(C / 32)); block 256 = 8 warps, each warp 16 of the tile's 128
// tokens. A block past the experts' tiles returns.
constexpr int kColChannels = 32;
template <typename E>
__global__ void __launch_bounds__(256) quantize_columnwise_kernel(const int64_t* offsets, int64_t G, const E* src,
                                                                  int64_t src_ld, int64_t C, int64_t columns,
                                                                  uint8_t* q, float* scale) {
  __shared__ float tile[kTile][kColChannels + 1];
  __shared__ float amax_part[8][kColChannels];
  __shared__ float tile_scale[kColChannels];
  // The expert owning this tile and the tile's place in it: the experts' tiles in order.
  const int64_t global_tile = blockIdx.x;
  int64_t g = 0, base = 0;
  for (; g < G; ++g) {
    const int64_t n = fp8_tiles(offsets[g + 1] - offsets[g]);
    if (global_tile < base + n) break;
    base += n;
  }
  if (g == G) return;
  const int64_t begin = offsets[g], rows = offsets[g + 1] - begin, t = global_tile - base;
  const int lane = int(threadIdx.x) % 32, warp = int(threadIdx.x) / 32;
  const int64_t c = int64_t(blockIdx.y) * kColChannels + lane;
  float amax = 0.f;
  for (int i = warp; i < kTile; i += 8) {  // token i of the tile, channel c
    const int64_t r = t * kTile + i;
    const float v = r < rows && c < C ? load_f32(src + (begin + r) * src_ld, c) : 0.f;
    tile[i][lane] = v;
    amax = fp8_amax(amax, v);
  }
  amax_part[warp][lane] = amax;
  __syncthreads();
  if (warp == 0) {
    float a = 0.f;
    for (int w = 0; w < 8; ++w) a = fp8_amax(a, amax_part[w][lane]);
    const float s = fp8_scale(a);
    tile_scale[lane] = s;
    if (c < C) scale[fp8_columnwise_scale_index(base, t, C, c)] = s;
  }
  __syncthreads();
  // Codes, transposed: warp w writes channels w, w + 8, ..., lanes along the 128 tokens (4 each);
  // tokens past the expert's rows are zero codes.
  for (int j = warp; j < kColChannels; j += 8) {
    const int64_t cj = int64_t(blockIdx.y) * kColChannels + j;
    if (cj >= C) break;
    uint8_t* out = q + fp8_columnwise_data_index(columns, base, begin, begin + t * kTile, cj);
    for (int i = lane; i < kTile; i += 32) out[i] = t * kTile + i < rows ? fp8_quantize(tile[i][j], tile_scale[j]) : 0;
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
template <typename E, int Cap>
__global__ void __launch_bounds__(256) quantize_weights_kernel(const __grid_constant__ WeightTables<Cap> p,
                                                               int64_t out, int64_t in) {
  __shared__ float amax_part[8];
  __shared__ float block_scale;
  const int64_t g = blockIdx.z, i0 = int64_t(blockIdx.x) * kTile, j0 = int64_t(blockIdx.y) * kTile;
  const E* w = static_cast<const E*>(p.w[g]);
  const int lane = int(threadIdx.x) % 32, warp = int(threadIdx.x) / 32;
  // Rows i0 + warp, + 8, ...; lanes along the row (4 columns each).
  float amax = 0.f;
  for (int i = warp; i < kTile; i += 8)
    for (int j = lane; j < kTile; j += 32) {
      const int64_t r = i0 + i, c = j0 + j;
      if (r < out && c < in) amax = fp8_amax(amax, load_f32(w + r * in, c));
    }
  amax = warp_amax(amax);
  if (lane == 0) amax_part[warp] = amax;
  __syncthreads();
  if (threadIdx.x == 0) {
    float a = 0.f;
    for (int k = 0; k < 8; ++k) a = fp8_amax(a, amax_part[k]);
    block_scale = fp8_scale(a);
    p.s[g][fp8_block_scale_index(in, i0, j0)] = block_scale;
    p.st[g][fp8_block_scale_index(out, j0, i0)] = block_scale;
  }
  __syncthreads();
  // W's codes from the registers' rows (lanes along a row: coalesced), staged in shared memory so
  // that W^T's rows go out coalesced too (lanes along a column of the block). A row of 132 bytes
  // (33 words) puts a column's 32 bytes in 32 banks.
  __shared__ uint8_t codes[kTile][kTile + 4];
  const float s = block_scale;
  for (int i = warp; i < kTile; i += 8)
    for (int j = lane; j < kTile; j += 32) {
      const int64_t r = i0 + i, c = j0 + j;
      if (r < out && c < in) {
        const uint8_t code = fp8_quantize(load_f32(w + r * in, c), s);
        p.q[g][r * in + c] = code;
        codes[i][j] = code;
      }
    }
  __syncthreads();
  for (int j = warp; j < kTile; j += 8)
    for (int i = lane; i < kTile; i += 32) {
      const int64_t r = i0 + i, c = j0 + j;
      if (r < out && c < in) p.qt[g][c * out + r] = codes[i][j];
    }
}

}  // namespace sparsetrain::cuda::fp8

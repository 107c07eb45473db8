// The FP8 recipe's quantizers on the GPU (docs/DESIGN.md section 12): the rules of
// common/fp8_blockwise.h run unchanged, so codes and scales are bitwise the CPU reference's. Group
// offsets are read on the device (no host sync, capturable); every launch is shaped by T, K, C and
// G only, so a captured graph replays with new splits. A tile's amax is a reduction of a
// maximum, exact in any order: the results are deterministic.
//
//   rowwise     16 threads per (row, 128-channel tile), 8 channels each (16-byte loads), two
//               rows a thread, the amax a shuffle reduction; codes [T, K], scales grouped M-major
//   tile        2-byte elements: one block per (128-token tile of one expert, 128 channels), read
//               once, staged in shared memory as read; the columnwise codes from there (a thread
//               two channels x 16 tokens: codes written transposed, [C, columns], tokens
//               contiguous, 16 bytes a store; the rest of an expert's last tile zero codes), and
//               with `rowwise` the rowwise codes too from the registers as the tile is read: a
//               gradient's two layouts from one read
//   columnwise  fp32 elements: the same, 64 channels a block, staged as floats
//   weights     one block per (expert, 128 x 128 block), read once into registers: both copies (W
//               and W^T) and both grids
// Two-byte elements stay as read (Chunk): the amax is a 16-bit-pair maximum of their bits and the
// codes come two a conversion (fp8_quantize2). At about four instructions an element the kernels
// are bound by memory traffic, not by issue.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

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

// The codes of eight values of one tile (scale s), value i in byte i: two a conversion.
__device__ inline uint2 codes8(const float* v, float s) {
  uint32_t w[4];
#pragma unroll
  for (int j = 0; j < 4; ++j) w[j] = fp8_quantize2(v[2 * j], v[2 * j + 1], s);
  return make_uint2(w[0] | w[1] << 16, w[2] | w[3] << 16);
}

// A 2-byte element's bits (the low 16 of `bits`) as fp32, exactly.
template <typename E>
__device__ inline float widen(uint32_t bits) {
  static_assert(sizeof(E) == 2, "2-byte elements");
  if constexpr (std::is_same_v<E, bf16_t>) return __uint_as_float(bits << 16);
  else return __half2float(__ushort_as_half(uint16_t(bits)));
}

// |x|'s bits of two 2-byte elements of a word folded into m, one 16-bit-pair maximum: fp8_amax's
// order (|x|'s bits order finite values as their magnitudes and put inf and NaN above them).
__device__ inline uint32_t abs_bits_max2(uint32_t m, uint32_t w) { return __vmaxu2(m, w & 0x7fff7fffu); }

// Eight consecutive elements k0 .. k0 + 7 of a row as a quantizer holds them, zeros past K (and
// where not loaded). 2-byte E: the four words as read, element 2i in the low half of w[i] (the
// amax a pair maximum a word, the codes two a conversion); fp32: the eight floats. kVec: one
// 16-byte load (the caller checked that E is 2 bytes, K and the row stride multiples of 8, the
// base 16-byte aligned; k0 is a multiple of 8, so k0 < K means all eight are in the row).
template <typename E, bool kTwoBytes = sizeof(E) == 2>
struct Chunk {
  uint32_t w[4];
  template <bool kVec>
  __device__ void load(const E* row, int64_t k0, int64_t K) {
    if constexpr (kVec) {
      if (k0 < K) {
        const uint4 r = *reinterpret_cast<const uint4*>(row + k0);
        w[0] = r.x, w[1] = r.y, w[2] = r.z, w[3] = r.w;
      }
    } else {
#pragma unroll
      for (int i = 0; i < 8; ++i)
        if (k0 + i < K) w[i / 2] |= uint32_t(row[k0 + i].bits) << (16 * (i % 2));
    }
  }
  __device__ float amax() const {
    uint32_t m = 0;
#pragma unroll
    for (int i = 0; i < 4; ++i) m = abs_bits_max2(m, w[i]);
    return widen<E>(max(m & 0xffffu, m >> 16));
  }
  __device__ uint2 codes(float s) const {
    float v[8];
#pragma unroll
    for (int i = 0; i < 4; ++i) v[2 * i] = widen<E>(w[i] & 0xffffu), v[2 * i + 1] = widen<E>(w[i] >> 16);
    return codes8(v, s);
  }
  __device__ uint4 raw() const { return make_uint4(w[0], w[1], w[2], w[3]); }
  // Eight values as E holds them (what a kernel storing them in E and this chunk loading them
  // back would see): a producer's output quantized without a round trip through memory.
  __device__ void round_from(const float* v) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      E lo, hi;
      store_f32(&lo, 0, v[2 * i]);
      store_f32(&hi, 0, v[2 * i + 1]);
      w[i] = uint32_t(lo.bits) | uint32_t(hi.bits) << 16;
    }
  }
};
template <typename E>
struct Chunk<E, false> {
  float v[8];
  template <bool>
  __device__ void load(const E* row, int64_t k0, int64_t K) {
#pragma unroll
    for (int i = 0; i < 8; ++i) v[i] = k0 + i < K ? load_f32(row, k0 + i) : 0.f;
  }
  __device__ float amax() const {
    float a = 0.f;
#pragma unroll
    for (int i = 0; i < 8; ++i) a = fp8_amax(a, v[i]);
    return a;
  }
  __device__ uint2 codes(float s) const { return codes8(v, s); }
};

// Eight codes of a row, byte i for element k + i, none past K; kVec: one 8-byte store (k and K
// multiples of 8, the row 8-byte aligned).
template <bool kVec>
__device__ inline void store8_codes(uint8_t* out, int64_t k, int64_t K, uint2 c) {
  if constexpr (kVec) {
    if (k < K) *reinterpret_cast<uint2*>(out) = c;
  } else {
#pragma unroll
    for (int j = 0; j < 8; ++j)
      if (k + j < K) out[j] = uint8_t((j < 4 ? c.x : c.y) >> (8 * (j % 4)));
  }
}

// A 128-channel tile's amax from its sixteen threads' own (a shuffle within the half warp; every
// lane joins).
__device__ inline float tile_amax(float a) {
#pragma unroll
  for (int o = 8; o > 0; o /= 2) a = fp8_amax(a, __shfl_xor_sync(0xffffffffu, a, o));
  return a;
}

constexpr int kRowThreads = 16;  // threads a row of a 128-channel tile, eight channels each

// The source row of operand row r: src_rows[r] when the quantizer gathers, else r.
__device__ inline int64_t source_row(const int32_t* src_rows, int64_t r) { return src_rows ? src_rows[r] : r; }

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

// The column (in words) where a staged tile keeps word j of token i's row of `width` words,
// rotated by 4 words per 16 tokens. The columnwise reads have eight threads a column, 16 tokens
// apart (i0 = 0, 16, .., 112), four columns a warp: over a row stride of a multiple of 32 words
// (the 2-byte tile) all eight would read one bank, over an odd one (the fp32 tile, 65 words) i0 =
// 0, 32, 64, 96 would; rotated, the warp's 32 reads fall in 32 distinct banks (4 tg + j mod 32,
// resp. 20 m + j mod 32 over m = 0..7). Whole 16-byte groups move together (rows are written in them).
__device__ inline int staged_column(int i, int j, int width) { return (j + 4 * (i / 16)) % width; }

// 16 codes of one channel of a columnwise tile (tokens i0 .. i0 + 15, token i0 + i in byte i of
// c) in one 16-byte store at `codes` (16-byte aligned), zero codes from token `live` on (past the
// expert's rows).
__device__ inline void store16_codes(uint32_t (&c)[4], int64_t live, uint8_t* codes) {
  if (live < 16) {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int64_t n = live - 4 * j;  // this word's live bytes
      c[j] &= n >= 4 ? ~0u : n <= 0 ? 0u : (1u << (8 * n)) - 1u;
    }
  }
  *reinterpret_cast<uint4*>(codes) = make_uint4(c[0], c[1], c[2], c[3]);
}

constexpr int kTileWords = kTile / 2;  // a staged row of 2-byte elements: 128 in 64 words

// The columnwise codes of a staged 2-byte tile (128 tokens of tile t of the expert at rows
// [begin, begin + rows), channels k0 ..): a thread takes one word column (two channels) x 16
// tokens; both channels' amaxes a pair maximum, then over the column's eight threads a 3-step
// shuffle; each channel's 16 codes one store.
template <typename E>
__device__ inline void columnwise_from_stage(const uint32_t* tile, int64_t base, int64_t begin, int64_t rows,
                                             int64_t t, int64_t K, int64_t k0, int64_t columns, uint8_t* q_col,
                                             float* s_col) {
  const int tid = int(threadIdx.x), i0 = (tid % 8) * 16;
  for (int j = tid / 8; j < kTileWords; j += 32) {  // channels k0 + 2j and k0 + 2j + 1, tokens i0 .. i0 + 15
    uint32_t w[16], m = 0;
    const int col = staged_column(i0, j, kTileWords);
#pragma unroll
    for (int i = 0; i < 16; ++i) m = abs_bits_max2(m, w[i] = tile[(i0 + i) * kTileWords + col]);
#pragma unroll
    for (int o = 4; o > 0; o /= 2) m = __vmaxu2(m, __shfl_xor_sync(0xffffffffu, m, o));
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int64_t ch = k0 + 2 * j + h;
      const float s = fp8_scale(widen<E>(h ? m >> 16 : m & 0xffffu));
      if (ch >= K) continue;
      uint32_t codes[4];
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        float v[4];
#pragma unroll
        for (int u = 0; u < 4; ++u) v[u] = widen<E>(h ? w[4 * q + u] >> 16 : w[4 * q + u] & 0xffffu);
        codes[q] = fp8_quantize2(v[0], v[1], s) | uint32_t(fp8_quantize2(v[2], v[3], s)) << 16;
      }
      store16_codes(codes, rows - (t * kTile + i0),
                    q_col + fp8_columnwise_data_index(columns, base, begin, begin + t * kTile + i0, ch));
      if (i0 == 0) s_col[fp8_columnwise_scale_index(base, t, K, ch)] = s;
    }
  }
}

constexpr int kTileRowsPerPass = 256 / kRowThreads, kTilePasses = kTile / kTileRowsPerPass;

// Shared memory of one staged 2-byte tile, in 16-byte groups (columnwise codes from a tile).
constexpr int kStagedTileVecs = kTile * kTileWords / 4;

// One chunk of a tile as a 256-thread block holds it: thread tid's chunk p is row i = tid / 16 +
// 16 p of the tile (row t * 128 + i of the expert at [begin, begin + rows)), channels k0 + (tid %
// 16) * 8 .. + 7 of K; rows past the expert's zero. kRowwise: the row's codes from the registers,
// its amax a shuffle within the half warp (every lane calls, rows past the expert included).
// kColumnwise (2-byte elements): the words staged in `stage` (kStagedTileVecs), for
// columnwise_from_stage once the block's chunks are all staged and synced.
template <typename E, bool kVec, bool kRowwise, bool kColumnwise>
__device__ inline void quantize_held_chunk(const Chunk<E>& c, int p, uint4* stage, int64_t begin, int64_t rows,
                                           int64_t t, int64_t K, int64_t kb, uint8_t* q_row, float* s_row) {
  static_assert(!kColumnwise || sizeof(E) == 2, "the tile is staged as 2-byte elements");
  const int tid = int(threadIdx.x), sub = tid % kRowThreads;
  const int i = tid / kRowThreads + kTileRowsPerPass * p;
  if constexpr (kRowwise) {
    const float amax = tile_amax(c.amax());
    const int64_t r = t * kTile + i, k = kb * kTile + sub * 8;
    if (r < rows) {
      const float s = fp8_scale(amax);
      store8_codes<kVec>(q_row + (begin + r) * K + k, k, K, c.codes(s));
      if (sub == 0) s_row[fp8_rowwise_scale_index(begin, rows, fp8_tiles(K), begin + r, kb)] = s;
    }
  }
  if constexpr (kColumnwise) stage[(i * kTileWords + staged_column(i, sub * 4, kTileWords)) / 4] = c.raw();
}

// A whole held tile: each chunk's step, then (kColumnwise) the columnwise codes from the stage
// (the caller syncs before staging another tile).
template <typename E, bool kVec, bool kRowwise, bool kColumnwise>
__device__ inline void quantize_held_tile(const Chunk<E> (&c)[kTilePasses], uint4* stage, int64_t base,
                                          int64_t begin, int64_t rows, int64_t t, int64_t K, int64_t kb,
                                          uint8_t* q_row, float* s_row, int64_t columns, uint8_t* q_col,
                                          float* s_col) {
#pragma unroll
  for (int p = 0; p < kTilePasses; ++p)
    quantize_held_chunk<E, kVec, kRowwise, kColumnwise>(c[p], p, stage, begin, rows, t, K, kb, q_row, s_row);
  if constexpr (kColumnwise) {
    __syncthreads();
    columnwise_from_stage<E>(reinterpret_cast<const uint32_t*>(stage), base, begin, rows, t, K, kb * kTile,
                             columns, q_col, s_col);
  }
}

// The tile kernel: grid (max tiles, KB); block 256. The block's (128-token tile of one expert,
// 128-channel tile) is read sixteen threads a row, eight channels each, a thread's eight rows all
// in flight (a block past the experts' tiles returns), then quantize_held_tile: rowwise,
// columnwise or both (a gradient's two layouts from one read). The experts' tiles cover rows [0,
// S) once, so every code below S is written once; the tile's expert comes from expert_tile, no
// search per row. kVec: 16-byte loads, 8-byte rowwise code stores (K and the row stride multiples
// of 8). src_rows (or null): operand row r is src's row src_rows[r], a gather as the rows are read.
template <typename E, bool kVec, bool kRowwise, bool kColumnwise>
__global__ void __launch_bounds__(256) quantize_tile_kernel(const int64_t* offsets, int64_t G, const E* src,
                                                            int64_t src_ld, const int32_t* src_rows, int64_t K,
                                                            uint8_t* q_row, float* s_row, int64_t columns,
                                                            uint8_t* q_col, float* s_col) {
  __shared__ uint4 staged[kColumnwise ? kStagedTileVecs : 1];
  const ExpertTile et = expert_tile(offsets, G, blockIdx.x);
  if (et.g == G) return;
  const int64_t base = et.base, begin = offsets[et.g], rows = offsets[et.g + 1] - begin, t = blockIdx.x - base;
  const int64_t kb = blockIdx.y;
  const int tid = int(threadIdx.x);
  const int64_t k = kb * kTile + (tid % kRowThreads) * 8;
  Chunk<E> c[kTilePasses] = {};
#pragma unroll
  for (int p = 0; p < kTilePasses; ++p) {
    const int64_t r = t * kTile + tid / kRowThreads + kTileRowsPerPass * p;  // a row of the expert
    if (r < rows) c[p].template load<kVec>(src + source_row(src_rows, begin + r) * src_ld, k, K);
  }
  quantize_held_tile<E, kVec, kRowwise, kColumnwise>(c, staged, base, begin, rows, t, K, kb, q_row, s_row,
                                                     columns, q_col, s_col);
}

// Columnwise, fp32 elements: grid (max tiles, ceil(C / 64)); block 256. The block's (128-token
// tile of one expert, 64 channels) is staged in shared memory as floats (rows loaded eight channels
// a thread), then each channel's 128 tokens are eight threads' 16 (adjacent lanes: the amax a
// 3-step shuffle), written as 16 codes in one 16-byte store (columns and the tile base are
// multiples of 128), tokens past the expert's rows zero codes. A block past the experts' tiles
// returns.
constexpr int kColChannels = 64;
template <typename E>
__global__ void __launch_bounds__(256) quantize_columnwise_kernel(const int64_t* offsets, int64_t G, const E* src,
                                                                  int64_t src_ld, const int32_t* src_rows, int64_t C,
                                                                  int64_t columns, uint8_t* q, float* scale) {
  __shared__ float tile[kTile][kColChannels + 1];
  const ExpertTile et = expert_tile(offsets, G, blockIdx.x);
  if (et.g == G) return;
  const int64_t base = et.base, begin = offsets[et.g], rows = offsets[et.g + 1] - begin, t = blockIdx.x - base;
  const int64_t c0 = int64_t(blockIdx.y) * kColChannels;
  const int tid = int(threadIdx.x);
  for (int i = tid / 8; i < kTile; i += 32) {  // row i of the tile, channels c0 + (tid % 8) * 8 ..
    const int cc = (tid % 8) * 8;
    Chunk<E> v = {};
    if (t * kTile + i < rows)
      v.template load<false>(src + source_row(src_rows, begin + t * kTile + i) * src_ld, c0 + cc, C);
#pragma unroll
    for (int k = 0; k < 8; ++k) tile[i][staged_column(i, cc + k, kColChannels)] = v.v[k];
  }
  __syncthreads();
  for (int j = tid / 8; j < kColChannels; j += 32) {  // channel c0 + j, tokens i0 .. i0 + 15
    const int i0 = (tid % 8) * 16;
    float v[16], amax = 0.f;
#pragma unroll
    for (int i = 0; i < 16; ++i) amax = fp8_amax(amax, v[i] = tile[i0 + i][staged_column(i0 + i, j, kColChannels)]);
#pragma unroll
    for (int o = 4; o > 0; o /= 2) amax = fp8_amax(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    const float s = fp8_scale(amax);
    const int64_t c = c0 + j;
    if (c >= C) continue;
    const uint2 lo = codes8(v, s), hi = codes8(v + 8, s);
    uint32_t codes[4] = {lo.x, lo.y, hi.x, hi.y};
    store16_codes(codes, rows - (t * kTile + i0),
                  q + fp8_columnwise_data_index(columns, base, begin, begin + t * kTile + i0, c));
    if (i0 == 0) scale[fp8_columnwise_scale_index(base, t, C, c)] = s;
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
  __shared__ uint32_t codes[kTile][(kTile + 4) / 4];
  const int64_t g = blockIdx.z, i0 = int64_t(blockIdx.x) * kTile, j0 = int64_t(blockIdx.y) * kTile;
  const E* w = static_cast<const E*>(p.w[g]);
  const int tid = int(threadIdx.x), lane = tid % 32, warp = tid / 32, col = (tid % 16) * 8;
  Chunk<E> v[kRows] = {};
  float amax = 0.f;
#pragma unroll
  for (int k = 0; k < kRows; ++k) {
    const int64_t r = i0 + tid / 16 + 16 * k;
    if (r < out) v[k].template load<kVec>(w + r * in, j0 + col, in);
  }
#pragma unroll
  for (int k = 0; k < kRows; ++k) amax = fp8_amax(amax, v[k].amax());
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
    const uint2 c = v[k].codes(s);
    if (i0 + i < out) store8_codes<kVec>(p.q[g] + (i0 + i) * in + j0 + col, j0 + col, in, c);
    codes[i][col / 4] = c.x;
    codes[i][col / 4 + 1] = c.y;
  }
  __syncthreads();
  const uint8_t* bytes = reinterpret_cast<const uint8_t*>(codes);
  for (int j = warp; j < kTile; j += 8)
    for (int i = lane; i < kTile; i += 32) {
      const int64_t r = i0 + i, c = j0 + j;
      if (r < out && c < in) p.qt[g][c * out + r] = bytes[i * (kTile + 4) + j];
    }
}

}  // namespace sparsetrain::cuda::fp8

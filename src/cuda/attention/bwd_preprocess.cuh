// The backward's preprocessing, before the kernel (attention_bwd_sm90.cuh): per padded q row,
// delta = rowsum(dO * o), lse in log2 units, and (for the atomic adds of the non-deterministic
// mode; the deterministic one's first writer stores) the row of the fp32 dQ accumulator zeroed;
// for document masks each padded q row's document id, once per batch (the kernel's loader stages a
// visit's ids with its lse and delta); also the kernel's semaphores and counters zeroed (no memset
// launch of their own). Before it, for bitmask masks, the partial blocks' bits transposed
// (bwd_bits_copy_kernel).
#pragma once

#include <cmath>
#include <cstdint>

#include "common/attention/bitmask_transpose.h"
#include "common/attention/bwd_preprocess_tiling.h"
#include "common/attention/bwd_sections.h"
#include "cuda/attention/attention_bwd_params.h"  // kBwdTileQ
#include "cuda/element.cuh"                        // load_f32
#include "cuda/pdl.cuh"

namespace sparsetrain::cuda::attn {

// How the rows split (common/attention/bwd_preprocess_tiling.h); every head's padded rows (whole 64- or 128-row
// q tiles) into whole tiles.
using ::sparsetrain::BwdPreprocessTiling;
static_assert(BwdPreprocessTiling<8, true>::tiles_divide(kBwdTileQ) &&
                  BwdPreprocessTiling<16, true>::tiles_divide(kBwdTileQ) &&
                  BwdPreprocessTiling<32, false>::tiles_divide(kBwdTileQ),
              "a head's padded rows split into whole tiles, at any heads");

// A bitmask mask's partial blocks to copy transposed (BitmaskBlocks).
struct BwdBitsCopy {
  KernelMaskSpec in;  // the mask's bits (bitmask_block)
  BitmaskBlocks blocks;
  int32_t seq_q = 0;  // mask rows at or past it get no bits
  uint32_t* out = nullptr;
};

// The copy (common/attention/bitmask_transpose.h): 32 x 32 bits a warp, the grid's warps striding
// over the tiles. A kernel of its own, before the preprocessing, whose 48-register bound the
// 64-bit tile arithmetic broke (spills).
constexpr int kBitsCopyThreads = 256;
__global__ void __launch_bounds__(kBitsCopyThreads) bwd_bits_copy_kernel(const BwdBitsCopy bits) {
  const int64_t warps = int64_t(gridDim.x) * (kBitsCopyThreads / 32);
  const int lane = int(threadIdx.x % 32);
  for (int64_t t = int64_t(blockIdx.x) * (kBitsCopyThreads / 32) + threadIdx.x / 32; t < bits.blocks.tiles();
       t += warps) {
    const BitTile x = bit_tile(bits.blocks, t);
    const uint32_t* src = reinterpret_cast<const uint32_t*>(bitmask_block(bits.in, x.b, x.h, x.m, x.w));
    const bool live = x.m * bits.blocks.block_q + 32 * x.q_group + lane < bits.seq_q;
    const uint32_t row = live ? src[bit_tile_source_word(bits.blocks, x, lane)] : 0u;
    bits.out[x.block * bits.blocks.block_words() + bit_tile_copy_word(bits.blocks, x, lane)] =
        transpose_bit_tile(row, lane, [](int, uint32_t pred) { return __ballot_sync(0xffffffffu, pred); });
  }
}

// Per padded row (b, h, q): delta = rowsum(dout * o), lse * log2(e) (+inf where the row has no
// allowed key or holds no token: past Sq, or a padding position of a padded document mask, whose
// rows are mask positions with tokens from real_rows, bwd_token_at; P = 0 there), and the row of
// the dQ accumulator zeroed unless dq_accum is null (the deterministic mode: zeroing was half of
// this kernel's traffic). Tiles of heads x q rows (BwdPreprocessTiling) read o as the forward
// wrote it ([B, S, H, D]: the heads of a q row side by side) and dout (from torch, usually
// [B, H, S, D]: the rows of a head) in runs of several rows, at ~75 % of the memory bandwidth (a
// row at a time, the kernel was bound by its index arithmetic). Five blocks an SM (at most 48
// registers; no spills on any built architecture): 80 KiB of loads in flight an SM.
template <class E, class Tiling>
__global__ void __launch_bounds__(Tiling::kThreads, 5)
    bwd_preprocess_kernel(const E* o, int64_t o_sb, int64_t o_ss, int64_t o_sh, const E* dout, int64_t do_sb,
                          int64_t do_ss, int64_t do_sh, const float* lse, int64_t l_sb, int64_t l_sh, int64_t l_ss,
                          int32_t batch, int32_t heads_q, int32_t seq_q, int32_t mask_seq_q, const int32_t* real_rows,
                          int32_t real_rows_stride_b, int32_t rows, int32_t head_dim,
                          int32_t heads_log2, float* lse_log2, float* delta, float* dq_accum, int32_t* zeroed,
                          int64_t zeroed_words, const int32_t* doc_q, int64_t doc_q_stride_b, int32_t* doc_q_rows,
                          const BwdSectionsOnDevice sections) {
  constexpr int kLanes = Tiling::kLanes, kRows = Tiling::kRows;
  constexpr int kPer = Tiling::kVector ? 16 / int(sizeof(E)) : 1;  // elements a lane loads at once
  const int lane = threadIdx.x % kLanes;
  const auto [h, q0] = Tiling::rows_of(blockIdx.x, blockIdx.y, int(threadIdx.x) / kLanes, heads_log2);
  pdl_launch_dependents();  // the backward kernel may set up while the last blocks run (cuda/pdl.cuh)
  {  // the semaphores and counters: each word by one thread of the grid
    const int64_t threads = int64_t(gridDim.x) * gridDim.y * gridDim.z * blockDim.x;
    const int64_t block = (int64_t(blockIdx.z) * gridDim.y + blockIdx.y) * gridDim.x + blockIdx.x;
    for (int64_t i = block * blockDim.x + threadIdx.x; i < zeroed_words; i += threads) zeroed[i] = 0;
  }
  if (sections.out != nullptr && blockIdx.x == 0 && blockIdx.y == 0 && blockIdx.z == 0) {
    __shared__ unsigned long long tiles;
    __shared__ unsigned int longest;
    if (threadIdx.x == 0) tiles = longest = 0;
    __syncthreads();
    // Every (batch, column), a thread's in steps of the block (no 64-bit division: 48 registers).
    BwdColumnWalks mine;
    for (int32_t b = 0, n = int32_t(threadIdx.x); b < sections.batch;) {
      if (n >= sections.columns) {
        n -= sections.columns, ++b;
        continue;
      }
      mine.add(bwd_column_tiles(sections.lists, b, n));
      n += int32_t(blockDim.x);
    }
    atomicAdd(&tiles, (unsigned long long)mine.tiles);
    atomicMax(&longest, (unsigned int)mine.longest);
    __syncthreads();
    if (threadIdx.x == 0) {
      const BwdColumnWalks all{int64_t(sections.batch) * sections.columns, int64_t(tiles), int64_t(longest)};
      *sections.out = int32_t(bwd_auto_section_groups(
          sections.deterministic, sections.ascending, sections.groups, sections.group_bytes, sections.l2_budget,
          sections.workers, all, int64_t(sections.columns) * sections.sub_tiles, sections.heads_per_group));
    }
  }
  // The batch along z, in steps of the grid's z (at most 65535).
  for (int32_t b = int32_t(blockIdx.z); b < batch; b += int32_t(gridDim.z)) {
    // A head past the last only idles (every lane still takes part in the shuffles).
    const bool head_ok = h < heads_q;
    // The token of mask row q (-1: none): the identity but for padded document masks.
    auto token = [&](int32_t q) -> int32_t {
      const int32_t t = bwd_token_at(real_rows, real_rows_stride_b, mask_seq_q, b, q);
      return t < seq_q ? t : -1;
    };
    const E* orow = o + b * o_sb + h * o_sh;
    const E* drow = dout + b * do_sb + h * do_sh;
    float sum[kRows];
    if constexpr (Tiling::kVector) {
      cuda::Pack<E, kPer> x[kRows], y[kRows];
      const int d = lane * kPer;
#pragma unroll
      for (int i = 0; i < kRows; ++i) {
        const int32_t t = token(q0 + i);
        if (head_ok && t >= 0 && d < head_dim) {
          x[i].load(orow + t * o_ss + d);
          y[i].load(drow + t * do_ss + d);
        } else {
          for (int e = 0; e < kPer; ++e) x[i].v[e] = y[i].v[e] = 0.f;
        }
      }
#pragma unroll
      for (int i = 0; i < kRows; ++i) {
        sum[i] = 0.f;
        for (int e = 0; e < kPer; ++e) sum[i] += x[i].v[e] * y[i].v[e];
      }
    } else {
      sum[0] = 0.f;
      const int32_t t = token(q0);
      if (head_ok && t >= 0)
        for (int d = lane; d < head_dim; d += kLanes) sum[0] += load_f32(orow + t * o_ss, d) * load_f32(drow + t * do_ss, d);
    }
    // Lane i of the group writes row i's delta and lse (consecutive floats); its lse read first.
    const bool writes = head_ok && lane < kRows;
    const int32_t q = q0 + (lane < kRows ? lane : 0), t = token(q);
    const float l = writes && t >= 0 ? lse[b * l_sb + h * l_sh + t * l_ss] : -INFINITY;
    float mine = 0.f;
#pragma unroll
    for (int i = 0; i < kRows; ++i) {
      float s = sum[i];
      for (int off = kLanes / 2; off > 0; off /= 2) s += __shfl_xor_sync(0xffffffff, s, off);
      if (lane == i) mine = s;
    }
    if (!head_ok) continue;
    const int64_t r0 = (int64_t(b) * heads_q + h) * rows + q0;  // the padded row of (b, h, q0)
    if (dq_accum != nullptr) {  // kRows rows, contiguous in the accumulator
      float* acc = dq_accum + r0 * head_dim;
      if constexpr (Tiling::kVector) {
        for (int d = lane * 4; d < kRows * head_dim; d += kLanes * 4) *reinterpret_cast<float4*>(acc + d) = float4{};
      } else {
        for (int d = lane; d < kRows * head_dim; d += kLanes) acc[d] = 0.f;
      }
    }
    if (writes) {
      delta[r0 + lane] = mine;
      lse_log2[r0 + lane] = l == -INFINITY ? INFINITY : l * float(M_LOG2E);
      if (doc_q_rows != nullptr && h == 0)  // once per (b, q): head 0's groups
        doc_q_rows[int64_t(b) * rows + q] = q < mask_seq_q ? doc_q[b * doc_q_stride_b + q] : 0;
    }
  }
}

}  // namespace sparsetrain::cuda::attn

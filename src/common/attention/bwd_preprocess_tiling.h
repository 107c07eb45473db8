// How the backward's preprocessing (cuda/attention/bwd_preprocess.cuh) splits the padded q rows
// of every (batch, query head) over blocks and lanes: host / device code, tested on the CPU
// (tests/cpp/test_bwd_preprocess_tiling.cpp).
//
// kLanes threads a row: with 16-byte loads (kVector: rows 16-byte aligned, head_dim a multiple of
// 8 and at most 128) one load of o and one of dout a lane, 16 lanes a row, 8 where head_dim <= 64;
// else 32 lanes with one element a load. A lane group takes kRows consecutive q rows of one head at
// once (all their loads before any reduction), and a block's groups take 2^heads_log2 heads side
// by side (group g: head g % heads, rows (g / heads) * kRows ...): a tile of heads x tile_rows q
// rows. Block (x, y, z) = (q tile, head tile, batch; z steps by the grid's z past 65535), so the
// kernel needs no division: a row at a time with 64-bit index arithmetic per row was issue-bound.
#pragma once

#include <algorithm>
#include <cstdint>

#include "common/host_device.h"

namespace sparsetrain {

template <int kLanes_, bool kVector_>
struct BwdPreprocessTiling {
  static constexpr int kLanes = kLanes_;
  static constexpr bool kVector = kVector_;
  static constexpr int kThreads = 256;
  static constexpr int kRows = kVector ? 2 : 1;
  static constexpr int kGroups = kThreads / kLanes;
  static constexpr int kMaxHeadsLog2 = 3;
  // Every head's padded rows (a multiple of `row_multiple`) split into whole tiles at any heads_log2.
  static constexpr bool tiles_divide(int row_multiple) { return row_multiple % (kGroups * kRows) == 0; }

  ST_HOST_DEVICE static constexpr int tile_rows(int heads_log2) { return (kGroups >> heads_log2) * kRows; }

  // The most heads a tile, up to 8, that heads_q has (a power of two).
  static int heads_log2_for(int64_t heads_q) {
    int l = 0;
    while (l < kMaxHeadsLog2 && (int64_t(2) << l) <= heads_q) ++l;
    return l;
  }

  // The grid: q tiles, head tiles, batches (at most 65535: the kernel steps by it).
  static void grid(int64_t rows, int64_t heads_q, int64_t batch, int heads_log2, int64_t out[3]) {
    out[0] = rows / tile_rows(heads_log2);
    out[1] = (heads_q + (int64_t(1) << heads_log2) - 1) >> heads_log2;
    out[2] = std::min<int64_t>(batch, 65535);
  }

  // Lane group `group` of block (x, y): its head (past the last: idle) and its first q row.
  struct Rows {
    int32_t head, q0;
  };
  ST_HOST_DEVICE static Rows rows_of(uint32_t block_x, uint32_t block_y, int group, int heads_log2) {
    return {int32_t(block_y << heads_log2) + (group & ((1 << heads_log2) - 1)),
            int32_t(block_x) * tile_rows(heads_log2) + (group >> heads_log2) * kRows};
  }
};

}  // namespace sparsetrain

// The backward's copy of a bitmask mask's partial blocks, each block transposed: the backward's
// S^T tile holds a few keys of a thread against many queries, so it wants a key's bits over the
// queries in one word, where the mask (BlockMask::partial_bitmasks) stores a query's bits over the
// keys. A kernel before the preprocessing writes the copy (bwd_bits_copy_kernel), 32 x 32 bits a
// warp, and the backward loads a key's words directly (bwd_mask_bits) instead of spreading the
// rows' words across the warp with ballots at every partial visit (H200: a dilated-window mask_mod's
// backward 1.62 -> 1.38 ms, a causal window of 640's 0.72 -> 0.69-0.71). Host and device:
// tests/cpp/test_bwd_mask_layout.cu runs it on the CPU.
//
// Layout: blocks [lead_b, lead_h, rows, width] (the mask's leading dims as stored: 1 broadcasts),
// compact, block_q x block_kv bits each; in the copy bit (j * block_q + i) of a block is key
// column j, query row i (bitmask_word(j, i, block_q), LSB first), rows at or past Sq 0.
#pragma once

#include <cstdint>

#include "common/attention/mask_predicate.h"  // bitmask_word
#include "common/host_device.h"

namespace sparsetrain {

struct BitmaskBlocks {
  int32_t lead_b = 1, lead_h = 1, rows = 0, width = 0;  // rows: q blocks (Mq); width: partial entries (W)
  int32_t block_q = 128, block_kv = 128;                // multiples of 32

  ST_HOST_DEVICE int64_t blocks() const { return int64_t(lead_b) * lead_h * rows * width; }
  ST_HOST_DEVICE int64_t block_words() const { return int64_t(block_q) * block_kv / 32; }
  ST_HOST_DEVICE int64_t words() const { return blocks() * block_words(); }
  // 32 x 32-bit tiles: a warp's unit of the transposition.
  ST_HOST_DEVICE int64_t tiles() const { return blocks() * (block_q / 32) * (block_kv / 32); }
  // The copy's byte strides for KernelMaskSpec (bitmask_block): a broadcast dim's is 0.
  ST_HOST_DEVICE int64_t stride_w() const { return block_words() * 4; }
  ST_HOST_DEVICE int64_t stride_m() const { return stride_w() * width; }
  ST_HOST_DEVICE int64_t stride_h() const { return lead_h == 1 ? 0 : stride_m() * rows; }
  ST_HOST_DEVICE int64_t stride_b() const { return lead_b == 1 ? 0 : stride_m() * rows * lead_h; }
};

// Tile t of the transposition: its block (b, h, m, w: index in the compact order), and its
// 32-row query group and 32-column key group inside the block.
struct BitTile {
  int64_t block;
  int32_t b, h, m, w;
  int32_t q_group, key_group;
};
ST_HOST_DEVICE inline BitTile bit_tile(const BitmaskBlocks& s, int64_t t) {
  BitTile x;
  const int32_t key_groups = s.block_kv / 32, q_groups = s.block_q / 32;
  x.key_group = int32_t(t % key_groups), t /= key_groups;
  x.q_group = int32_t(t % q_groups), t /= q_groups;
  x.block = t;
  x.w = int32_t(t % s.width), t /= s.width;
  x.m = int32_t(t % s.rows), t /= s.rows;
  x.h = int32_t(t % s.lead_h), t /= s.lead_h;
  x.b = int32_t(t);
  return x;
}

// One lane's part of a tile's transposition: lane i holds query row i's word of the tile's 32 keys
// (row_word; 0 for a row past Sq) and gets key `lane`'s word of the tile's 32 queries.
// ballot(k, pred): the warp's ballot of pred at step k (bit l: lane l's).
template <class Ballot>
ST_HOST_DEVICE uint32_t transpose_bit_tile(uint32_t row_word, int lane, Ballot&& ballot) {
  uint32_t mine = 0;
  for (int k = 0; k < 32; ++k) {
    const uint32_t column = ballot(k, (row_word >> k) & 1u);
    if (k == lane) mine = column;
  }
  return mine;
}

// Where a tile's words are: the source word of query row (32 q_group + lane) in the mask's block,
// and the copy's word of key (32 key_group + lane) in the copy's block.
ST_HOST_DEVICE inline int32_t bit_tile_source_word(const BitmaskBlocks& s, const BitTile& x, int lane) {
  return bitmask_word(32 * x.q_group + lane, 32 * x.key_group, s.block_kv);
}
ST_HOST_DEVICE inline int32_t bit_tile_copy_word(const BitmaskBlocks& s, const BitTile& x, int lane) {
  return bitmask_word(32 * x.key_group + lane, 32 * x.q_group, s.block_q);
}

}  // namespace sparsetrain

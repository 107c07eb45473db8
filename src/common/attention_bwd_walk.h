// The backward kernel's index math, as plain host/device code tested on the CPU: how one work item
// (batch, kv head, kv sub-column, handed out by DqColumnHandout in common/dq_schedule_model.h)
// walks its q tiles, and where each visit's dQ partial goes and whose turn it is.
//
// A kv column n visits, for one query head, the q blocks of its transposed lists (q_indices:
// partial, full_q_indices: full) merged in ascending q-block order (the walk order of DESIGN.md
// section 6), and inside each block the kernel's q tiles in ascending order. The dQ partial of
// a visit goes to q tile `q_tile` of (b, h); in the deterministic mode every q tile of block m has
// a semaphore that follows block m's write order, so a visit waits for turn
// stored_turn(n, m) + sub_tile (the stored turn is that of sub-column 0, block_mask.h).
//
// Like the forward walk (common/attention_fwd_walk.h) this never trusts a device mask: counts are
// clamped to the index width (and the write orders' width), q block ids outside [0, Mq) are skipped, and a partial block whose
// entry in the forward lists (needed for its bitmask) is missing gives bit_entry = -1 (the kernel
// then treats the block as empty). A corrupt write order can only make a wait time out (the
// kernel bounds its spins), never an access go out of bounds.
#pragma once

#include <cstdint>

#include "common/attention_fwd_walk.h"  // MaskIndexView, clamp_count

namespace sparsetrain {

// The transposed lists of a mask (q_* and full_q_*), their dQ write orders, and the forward's
// partial lists (to find a partial block's bitmask), as the backward walk reads them.
struct MaskColumnLists {
  MaskIndexView partial_count, partial_index, full_count, full_index;  // [B, H, Nk(, W)]
  MaskIndexView partial_turn, full_turn;  // parallel to partial_index / full_index; null: turn 0
  MaskIndexView kv_count, kv_index;       // [B, H, Mq(, W)]: read only when find_bit_entry
  bool find_bit_entry = false;            // bitmask masks: look up each partial block's entry
  int32_t num_q_blocks = 0;               // Mq of the mask
  int32_t q_tiles_per_block = 1;          // block_q / the kernel's q tile
  int32_t num_q_tiles = 0;                // ceil(Sq / the kernel's q tile)
};

// One q tile of a column's walk.
struct BwdVisit {
  int32_t q_block;    // the mask's q block m
  int32_t q_tile;     // the kernel's q tile (within the sequence)
  int32_t turn;       // stored write-order turn of (n, m): sub-column t waits for turn + t
  int32_t bit_entry;  // partial blocks of a bitmask mask: the entry in row m's kv list (-1: none)
  bool partial;       // the mask applies inside
};

// Where a walk stands: the next entries of the two lists and the q tiles of the current block.
struct BwdColumnCursor {
  int32_t next_partial = 0, next_full = 0;
  int32_t num_partial = 0, num_full = 0;  // clamped counts
  int32_t tile = 0, tile_end = 0;         // q tiles [tile, tile_end) of `block` still to visit
  BwdVisit block{};
};

// The entry of value n in row m of a sorted index list (clamped count), or -1.
ST_HOST_DEVICE inline int32_t find_in_row(const MaskIndexView& count, const MaskIndexView& index, int64_t b,
                                          int64_t h, int64_t m, int32_t n) {
  int32_t lo = 0, hi = clamp_count(count, index, b, h, m) - 1;
  const int32_t* row = index.data != nullptr ? index.row(b, h, m) : nullptr;
  while (lo <= hi) {
    const int32_t mid = (lo + hi) / 2;
    const int32_t v = row[int64_t(mid) * index.stride_w];
    if (v == n) return mid;
    if (v < n) lo = mid + 1;
    else hi = mid - 1;
  }
  return -1;
}

ST_HOST_DEVICE inline BwdColumnCursor bwd_column_begin(const MaskColumnLists& l, int64_t b, int64_t h, int32_t n) {
  BwdColumnCursor c;
  c.num_partial = clamp_count(l.partial_count, l.partial_index, b, h, n);
  c.num_full = clamp_count(l.full_count, l.full_index, b, h, n);
  // The write orders may be narrower than the index tensors (compact): never read past them.
  if (l.partial_turn.data != nullptr && c.num_partial > l.partial_turn.width) c.num_partial = l.partial_turn.width;
  if (l.full_turn.data != nullptr && c.num_full > l.full_turn.width) c.num_full = l.full_turn.width;
  return c;
}

// The next q tile of column n's walk for (b, h) into *v; false when the walk is done.
ST_HOST_DEVICE inline bool bwd_column_next(const MaskColumnLists& l, int64_t b, int64_t h, int32_t n,
                                           BwdColumnCursor& c, BwdVisit* v) {
  while (c.tile >= c.tile_end) {
    if (c.next_partial >= c.num_partial && c.next_full >= c.num_full) return false;
    const int32_t mp = c.next_partial < c.num_partial
                           ? l.partial_index.row(b, h, n)[int64_t(c.next_partial) * l.partial_index.stride_w]
                           : INT32_MAX;
    const int32_t mf = c.next_full < c.num_full
                           ? l.full_index.row(b, h, n)[int64_t(c.next_full) * l.full_index.stride_w]
                           : INT32_MAX;
    const bool partial = c.next_full >= c.num_full || (c.next_partial < c.num_partial && mp <= mf);
    const int32_t entry = partial ? c.next_partial++ : c.next_full++;
    const int32_t m = partial ? mp : mf;
    if (m < 0 || m >= l.num_q_blocks) continue;  // a corrupt id: skip the block
    const MaskIndexView& turns = partial ? l.partial_turn : l.full_turn;
    c.block.q_block = m;
    c.block.partial = partial;
    c.block.turn = turns.data != nullptr ? turns.row(b, h, n)[int64_t(entry) * turns.stride_w] : 0;
    c.block.bit_entry = partial && l.find_bit_entry ? find_in_row(l.kv_count, l.kv_index, b, h, m, n) : -1;
    c.tile = m * l.q_tiles_per_block;
    const int32_t end = c.tile + l.q_tiles_per_block;
    c.tile_end = end < l.num_q_tiles ? end : l.num_q_tiles;
  }
  *v = c.block;
  v->q_tile = c.tile++;
  return true;
}

// The semaphore of q tile `q_tile` of (b, h) (one int32 each, zeroed before every backward), and
// the first float of its rows in the fp32 dQ accumulator [B, Hq, num_q_tiles * tile_q, D].
ST_HOST_DEVICE inline int64_t bwd_q_tile_index(int64_t b, int64_t h, int64_t heads_q, int32_t num_q_tiles,
                                               int32_t q_tile) {
  return (b * heads_q + h) * num_q_tiles + q_tile;
}

}  // namespace sparsetrain

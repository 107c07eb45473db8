// The backward kernel's index math, as plain host/device code tested on the CPU: how one work item
// (batch, kv head, kv sub-column, handed out by DqColumnHandout in common/attention/dq_schedule_model.h)
// walks its visits (q tile, query head), and where each visit's dQ partial goes and whose turn it is.
//
// A kv column n touches, for one query head, the q blocks of its transposed lists (q_indices:
// partial, full_q_indices: full). The item visits them in the schedule's walk order (WalkOrder,
// block_mask.h; bwd_walk_shape below): by default q blocks *descending* (the lists merged from
// their ends), inside each block the kernel's q tiles descending, and at each q tile every query
// head of the kv head's group (heads innermost); kAscendingHeadsOuter walks each head's blocks
// and tiles ascending, one head after the other. The dQ partial of a visit goes to q tile
// `q_tile` of (b, q_head); in the deterministic mode every q tile of block m has a
// semaphore that follows block m's write order, so a visit waits for turn
// dq_visit_turn(stored rank of (n, m), sub_tiles, sub_tile) (common/attention/dq_turn.h).
//
// Like the forward walk (common/attention/attention_fwd_walk.h) this never trusts a device mask: counts are
// clamped to the index width (and the write orders' width), q block ids outside [0, Mq) are skipped, and a partial block whose
// entry in the forward lists (needed for its bitmask) is missing gives bit_entry = -1 (the kernel
// then treats the block as empty). A corrupt write order can only make a wait time out (the
// kernel bounds its spins), never an access go out of bounds.
#pragma once

#include <cstdint>

#include "common/host_device.h"
#include "common/attention/mask_index_view.h"  // MaskIndexView, clamp_count, find_in_row
#include "sparsetrain/block_mask.h"  // WalkOrder

namespace sparsetrain {

// How an item orders its visits, from the schedule's WalkOrder and the mask's heads. This is the
// one place the rule lives (the kernel's loader, compute and dQ writer, and the scheduler model
// all walk through it):
//   kDescendingHeadsInner  q blocks and q tiles descending; at each q tile the group's query heads
//                          0..G-1 in turn (heads innermost). Heads can only be innermost when the
//                          group's heads share one list (a mask with H = 1, broadcast over heads):
//                          a per-head mask (H > 1) walks descending, one head after the other.
//   kAscendingHeadsOuter   per query head, q blocks and tiles ascending.
//   kAscendingHeadsInner   q blocks and tiles ascending, heads innermost as above (per-head masks:
//                          one head after the other). For columns that do not nest (a long first
//                          column beside short ones), where the later columns must follow the
//                          first one down (block_mask.h choose_schedule).
// Why descending: under a left-to-right hand-out, of two columns sharing a q block the one with the earlier turn (further left) reaches at least as far down (causal and
// document-causal masks), so walking from the bottom both reach each (tile, head) at the same
// offset, the earlier one having started first: they run in lock step one hand-off apart. Walking
// ascending, column k reaches each tile before column k - 1, whose turn comes first, and every
// column of a causal chain finishes with the longest; heads outermost restart that race per head.
//
// Why the walk order cannot break the guarantees (the argument, once):
// - Bitwise repeatable, independent of the grid (sm_limit): the adds into one q tile's dQ happen in
//   turn order, and the turns are a function of the mask and its schedule alone (block_mask.h:
//   rank of the writer among the columns touching the block, in hand-out position order). Each
//   visit's partial depends only on (column, sub-column, q tile, head), not on when it runs. dK and
//   dV are summed on chip in walk order, which is a function of the schedule's WalkOrder and the
//   mask's shape: never of the worker count or the timing.
// - Deadlock-free under the dynamic hand-out, for any walk order: turns at every semaphore increase
//   with ticket order (same b and kv head: ticket order is schedule position order, sub-columns
//   consecutive). Take the unfinished item X with the lowest ticket. Every writer with an earlier
//   turn on any semaphore X visits holds a lower ticket, so it has finished and added: each of X's
//   waits is satisfied at once, in whatever order X makes them. X is running: the CTA that drew it
//   processes its tickets in order and all its earlier ones are finished (lower tickets). So X
//   finishes, and by induction every item does. Only the order of X's own waits changed here,
//   which the argument never uses; nor does it use how many dQ writer threads a CTA has, as long
//   as none waits for a turn while holding back a release of an earlier add (bwd_dq_writer_sm90.cuh).
//   (simulate_dq_backward checks it: no wait cycle, no race.)
struct BwdWalkShape {
  bool descending = true;   // q blocks and tiles from the bottom up
  bool heads_inner = true;  // at each q tile, every query head of the group
};
ST_HOST_DEVICE inline BwdWalkShape bwd_walk_shape(WalkOrder walk, bool per_head_mask) {
  if (walk == WalkOrder::kAscendingHeadsOuter) return {false, false};
  return {walk == WalkOrder::kDescendingHeadsInner, !per_head_mask};
}

// The transposed lists of a mask (q_* and full_q_*), their dQ write orders, and the forward's
// partial lists (to find a partial block's bitmask), as the backward walk reads them. The walk
// indexes them in int32 (BwdOffset): whoever fills this struct from tensors checks
// offsets_fit_int32 on each (the CUDA backend does).
using BwdOffset = int32_t;
struct MaskColumnLists {
  MaskIndexView partial_count, partial_index, full_count, full_index;  // [B, H, Nk(, W)]
  MaskIndexView partial_turn, full_turn;  // parallel to partial_index / full_index; null: turn 0
  MaskIndexView kv_count, kv_index;       // [B, H, Mq(, W)]: read only when find_bit_entry
  bool find_bit_entry = false;            // bitmask masks: look up each partial block's entry
  int32_t num_q_blocks = 0;               // Mq of the mask
  int32_t q_tiles_per_block = 1;          // block_q / the kernel's q tile
  int32_t num_q_tiles = 0;                // ceil(Sq / the kernel's q tile)
  // mask_walk_shape (ops/block_mask_internal.h) for the kernel; unset, the old ascending walk.
  BwdWalkShape walk{false, false};
};

// One q tile of a column's walk.
struct BwdVisit {
  int32_t q_block;    // the mask's q block m
  int32_t q_tile;     // the kernel's q tile (within the sequence)
  int32_t turn;       // stored write order of (n, m): n's rank at m (common/attention/dq_turn.h)
  int32_t bit_entry;  // partial blocks of a bitmask mask: the entry in row m's kv list (-1: none)
  bool partial;       // the mask applies inside
  int32_t q_head;     // the query head (set by bwd_item_next)
};

// Where one head's walk of a column stands: the next entries of the two lists (ascending: counting
// up from 0; descending: down from count - 1) and the q tiles of the current block still to visit.
struct BwdColumnCursor {
  int32_t next_partial = 0, next_full = 0;
  int32_t num_partial = 0, num_full = 0;  // clamped counts
  int32_t tile = 0, tiles_left = 0;       // the next q tile of `block`, and how many remain
  BwdVisit block{};
};

ST_HOST_DEVICE inline BwdColumnCursor bwd_column_begin(const MaskColumnLists& l, int64_t b, int64_t h, int32_t n) {
  BwdColumnCursor c;
  c.num_partial = clamp_count<BwdOffset>(l.partial_count, l.partial_index, b, h, n);
  c.num_full = clamp_count<BwdOffset>(l.full_count, l.full_index, b, h, n);
  // The write orders may be narrower than the index tensors (compact): never read past them.
  if (l.partial_turn.data != nullptr && c.num_partial > l.partial_turn.width) c.num_partial = l.partial_turn.width;
  if (l.full_turn.data != nullptr && c.num_full > l.full_turn.width) c.num_full = l.full_turn.width;
  if (l.walk.descending) {
    c.next_partial = c.num_partial - 1;
    c.next_full = c.num_full - 1;
  }
  return c;
}

// The next q tile of column n's walk for (b, h) into *v, in the direction of l.walk (the merge of
// the two lists, from the front or from the back); false when the walk is done. kFields: which of
// a visit's optional fields the caller reads (BwdVisitField bits); the others stay turn 0 /
// bit_entry -1. The kernel's loader (neither) and dQ writers (turns) walk in the producer
// warpgroup's 40 registers, where the loads and the bitmask entry's search they never read
// spilled (ptxas); the consumers read bit entries, not turns.
enum BwdVisitField : int { kVisitTurn = 1, kVisitBitEntry = 2, kVisitAll = 3 };

template <int kFields = kVisitAll>
ST_HOST_DEVICE inline bool bwd_column_next(const MaskColumnLists& l, int64_t b, int64_t h, int32_t n,
                                           BwdColumnCursor& c, BwdVisit* v) {
  const bool down = l.walk.descending;
  while (c.tiles_left <= 0) {
    const bool has_p = down ? c.next_partial >= 0 : c.next_partial < c.num_partial;
    const bool has_f = down ? c.next_full >= 0 : c.next_full < c.num_full;
    if (!has_p && !has_f) return false;
    const int32_t mp = has_p ? l.partial_index.row_in<BwdOffset>(b, h, n)[c.next_partial * BwdOffset(l.partial_index.stride_w)] : 0;
    const int32_t mf = has_f ? l.full_index.row_in<BwdOffset>(b, h, n)[c.next_full * BwdOffset(l.full_index.stride_w)] : 0;
    // Ascending: the smaller id first; descending: the larger (a block in both lists, which
    // validation refuses, is visited once from each).
    const bool partial = !has_f || (has_p && (down ? mp >= mf : mp <= mf));
    const int32_t entry = partial ? c.next_partial : c.next_full;
    const int32_t step = down ? -1 : 1;
    if (partial) c.next_partial += step;
    else c.next_full += step;
    const int32_t m = partial ? mp : mf;
    if (m < 0 || m >= l.num_q_blocks) continue;  // a corrupt id: skip the block
    const MaskIndexView& turns = partial ? l.partial_turn : l.full_turn;
    c.block.q_block = m;
    c.block.partial = partial;
    c.block.turn = (kFields & kVisitTurn) != 0 && turns.data != nullptr
                       ? turns.row_in<BwdOffset>(b, h, n)[entry * BwdOffset(turns.stride_w)]
                       : 0;
    c.block.bit_entry = (kFields & kVisitBitEntry) != 0 && partial && l.find_bit_entry
                            ? find_in_row<BwdOffset>(l.kv_count, l.kv_index, b, h, m, n)
                            : -1;
    const int32_t first = m * l.q_tiles_per_block;
    const int32_t end = first + l.q_tiles_per_block < l.num_q_tiles ? first + l.q_tiles_per_block : l.num_q_tiles;
    c.tiles_left = end - first;
    c.tile = down ? end - 1 : first;
  }
  *v = c.block;
  v->q_tile = c.tile;
  c.tile += l.walk.descending ? -1 : 1;
  --c.tiles_left;
  return true;
}

// A work item's walk: the columns of the group's query heads hkv * group + g, g = 0..group-1, in
// the order of l.walk (heads innermost: each q tile of the shared walk once per head; else one
// head's column walk after the other).
struct BwdItemCursor {
  BwdColumnCursor column;  // heads innermost: its last visit is the current q tile, once per head
  int32_t head = 0;      // g of the visit handed out next
  int32_t head0 = 0, group = 1;
};

ST_HOST_DEVICE inline BwdItemCursor bwd_item_begin(const MaskColumnLists& l, int64_t b, int32_t kv_head,
                                                   int32_t group, int32_t n) {
  BwdItemCursor c;
  c.head0 = kv_head * group;
  c.group = group;
  c.column = bwd_column_begin(l, b, c.head0, n);
  c.head = l.walk.heads_inner ? group : 0;  // heads innermost: no q tile fetched yet
  return c;
}

// The next visit of the item (v->q_head set); false when the item is done. kFields: as
// bwd_column_next's.
template <int kFields = kVisitAll>
ST_HOST_DEVICE inline bool bwd_item_next(const MaskColumnLists& l, int64_t b, int32_t n, BwdItemCursor& c,
                                         BwdVisit* v) {
  if (l.walk.heads_inner) {
    if (c.head >= c.group) {  // the shared lists (those of head0) are every head's: the next q tile
      if (!bwd_column_next<kFields>(l, b, c.head0, n, c.column, v)) return false;
      c.head = 0;
    } else {
      // The column's last visit again, rebuilt from the cursor (not held: the kernel's loader and
      // dQ writers walk in 40 registers): its block, and the tile before the cursor's next one.
      *v = c.column.block;
      v->q_tile = c.column.tile + (l.walk.descending ? 1 : -1);
    }
    v->q_head = c.head0 + c.head++;
    return true;
  }
  if (c.head >= c.group) return false;  // done: never read the lists of a head past the group
  while (!bwd_column_next<kFields>(l, b, c.head0 + c.head, n, c.column, v)) {
    if (++c.head >= c.group) return false;
    c.column = bwd_column_begin(l, b, c.head0 + c.head, n);
  }
  v->q_head = c.head0 + c.head;
  return true;
}

// The semaphore of q tile `q_tile` of (b, h) (one int32 each, zeroed before every backward), and
// the first float of its rows in the fp32 dQ accumulator [B, Hq, num_q_tiles * tile_q, D].
ST_HOST_DEVICE inline int64_t bwd_q_tile_index(int64_t b, int64_t h, int64_t heads_q, int32_t num_q_tiles,
                                               int32_t q_tile) {
  return (b * heads_q + h) * num_q_tiles + q_tile;
}

}  // namespace sparsetrain

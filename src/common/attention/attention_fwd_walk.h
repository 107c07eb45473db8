// The forward kernel's index math, as plain host/device code tested on the CPU: which work items
// there are (one per (batch, query head, q tile)), how a q tile walks the kv tiles its mask row
// lists (partial blocks first, then full ones, each block split into kernel-sized kv tiles), and
// the cost the longest-first scheduler sorts by.
//
// A mask that lives on the device cannot be validated on the host without a synchronisation, so
// the walk never trusts it: counts are clamped to [0, width] and a block id outside [0, Nk) makes
// its tiles invalid (skipped by the loads and the math alike). Bad device masks thus give wrong
// numbers at worst, never out-of-bounds memory accesses.
#pragma once

#include <cstdint>

#include "common/host_device.h"
#include "common/attention/mask_index_view.h"  // MaskIndexView, clamp_count

namespace sparsetrain {

// The forward lists of a mask (kv_* and full_kv_*), as the walk reads them: in int32 offsets
// (MaskIndexViewOf::row_in; 64-bit products on every kv tile cost the kernel issue slots), so
// whoever fills this from tensors checks offsets_fit_int32 on each (the CUDA backend does).
struct MaskWalkLists {
  MaskIndexView partial_count, partial_index, full_count, full_index;
  int32_t num_kv_blocks = 0;  // Nk of the mask
  int32_t block_q = 128;      // mask block rows (a multiple of the kernel's q tile)
  int32_t sub_tiles = 1;      // kernel kv tiles per mask block column (block_kv / kernel kv tile)
};

// One kv tile of a walk: kernel kv tile `tile` (units of the kernel's kv tile), from a partial
// block (`entry`: its position in the partial list, which indexes the bitmasks) or a full one.
struct WalkTile {
  int32_t tile;  // -1: invalid (a block id out of range): skip it
  int32_t entry;
  bool partial;
};

// The clamped counts of mask row m of (b, h): partial and full blocks (clamp_count).
struct WalkCounts {
  int32_t partial, full;
};

ST_HOST_DEVICE inline WalkCounts walk_counts(const MaskWalkLists& l, int64_t b, int64_t h, int64_t m) {
  return {clamp_count(l.partial_count, l.partial_index, b, h, m), clamp_count(l.full_count, l.full_index, b, h, m)};
}

// Number of kernel kv tiles the walk of row m visits (invalid ones included).
ST_HOST_DEVICE inline int32_t walk_length(const MaskWalkLists& l, const WalkCounts& c) {
  return (c.partial + c.full) * l.sub_tiles;
}

// t / sub_tiles for a kernel kv tile t (or a walk position): the mask block it lies in. One kernel
// tile per block (block_kv = the kernel's kv tile) is the common case and divides nothing: the
// division's instructions (and its MUFU.RCP, which competes with the softmax's exponentials) were
// 5 % of the forward's stall samples and cost it 4-12 %.
ST_HOST_DEVICE inline int32_t sub_tile_block(const MaskWalkLists& l, int32_t t) {
  return l.sub_tiles == 1 ? t : t / l.sub_tiles;
}

// Tile t in [0, walk_length) of the walk of mask row m of (b, h): the partial blocks' tiles, then
// the full blocks'; a block's sub-tiles consecutively.
ST_HOST_DEVICE inline WalkTile walk_tile(const MaskWalkLists& l, const WalkCounts& c, int64_t b, int64_t h, int64_t m,
                                         int32_t t) {
  const int32_t block = sub_tile_block(l, t), sub = t - block * l.sub_tiles;
  const bool partial = block < c.partial;
  const int32_t entry = partial ? block : block - c.partial;
  const MaskIndexView& idx = partial ? l.partial_index : l.full_index;
  const int32_t n = idx.row_in<int32_t>(b, h, m)[entry * int32_t(idx.stride_w)];
  const bool valid = n >= 0 && n < l.num_kv_blocks;
  return {valid ? n * l.sub_tiles + sub : -1, entry, partial};
}

// The first valid tile at or after t (its index; walk_length when none is left), in *tile. The
// producer and the consumers walk the same valid tiles this way: the loads and the math agree.
ST_HOST_DEVICE inline int32_t walk_next_valid(const MaskWalkLists& l, const WalkCounts& c, int64_t b, int64_t h,
                                              int64_t m, int32_t t, WalkTile* tile) {
  const int32_t length = walk_length(l, c);
  for (; t < length; ++t) {
    *tile = walk_tile(l, c, b, h, m, t);
    if (tile->tile >= 0) break;
  }
  return t;
}

// Work items: one per (batch b, query head h, q tile), numbered so that the q tiles of one head
// are adjacent, and the heads of one kv head (GQA) next to each other.
struct FwdWorkItem {
  int32_t b, h, q_tile;
};

// In 32 bits (the kernels decode an item at every item boundary; 64-bit divisions are subroutine
// calls there): items are counted in int32 (FwdArgs::num_items).
ST_HOST_DEVICE inline FwdWorkItem fwd_work_item(int32_t item, int32_t heads_q, int32_t q_tiles) {
  const int32_t q_tile = item % q_tiles, bh = item / q_tiles;
  return {bh / heads_q, bh % heads_q, q_tile};
}

// Mask row of a q tile: tile rows [q_tile * tile_q, ...) lie in block q_tile * tile_q / block_q.
// (q_tile * tile_q < Sq fits int32; block_q = tile_q, the common case, divides nothing.)
ST_HOST_DEVICE inline int32_t fwd_mask_row(int32_t q_tile, int32_t tile_q, int32_t block_q) {
  return block_q == tile_q ? q_tile : q_tile * tile_q / block_q;
}

// L2 sections of the work order. Items of a section (consecutive (b, h) heads, numbered as above)
// are handed out together, longest first inside the section, so the CTAs in flight share the few
// heads whose K and V the L2 cache holds: ordering all items longest first instead puts one item
// of every head in flight at once (128 heads at B = 8, H = 16), each CTA streaming its own head's
// K and V from DRAM (81 % of DRAM bandwidth, 12 % L2 hits, slower than the numbered order at
// S = 4096). A section holds whole GQA groups (the query
// heads of one K/V head are adjacent), at least one, and at most kFwdMaxKvHeadsPerSection kv
// heads: with small heads more of them only widen the working set (a sweep of the section size:
// 8-16 kv heads best from 1 to 8 MB of K/V a head, 30 at S = 2048 ran 6 % slower than 16).
constexpr int64_t kFwdMaxKvHeadsPerSection = 16;

ST_HOST_DEVICE inline int32_t fwd_heads_per_section(int64_t kv_bytes_per_kv_head, int64_t l2_budget_bytes,
                                                    int32_t group, int64_t heads_total) {
  int64_t kv_heads = kv_bytes_per_kv_head > 0 && l2_budget_bytes > kv_bytes_per_kv_head
                         ? l2_budget_bytes / kv_bytes_per_kv_head : 1;
  if (kv_heads > kFwdMaxKvHeadsPerSection) kv_heads = kFwdMaxKvHeadsPerSection;
  const int64_t heads = kv_heads * group;
  return int32_t(heads < heads_total ? heads : (heads_total > 0 ? heads_total : 1));
}

// The sections in order, and section s's items [first, last): whole heads (the last section may
// hold fewer).
struct FwdSection {
  int32_t first, last;
};

ST_HOST_DEVICE inline int32_t fwd_sections(int32_t num_items, int32_t q_tiles, int32_t heads_per_section) {
  const int32_t per = q_tiles * heads_per_section;
  return (num_items + per - 1) / per;
}

ST_HOST_DEVICE inline FwdSection fwd_section(int32_t s, int32_t num_items, int32_t q_tiles, int32_t heads_per_section) {
  const int32_t per = q_tiles * heads_per_section, first = s * per;
  return {first, num_items - first < per ? num_items : first + per};
}

// An item with its walk counts, as the forward's scheduler hands it out: a CTA learns an item's
// work with one 16-byte load (no chain of dependent loads). `cost`, the sort key, is its kv tiles
// (partial ones cost the same: the mask is a few instructions per element next to two GEMMs);
// inside a section items are handed out by decreasing cost (longest processing time first), so
// that the long rows of a skewed mask start early and the short ones fill the gaps.
struct alignas(16) FwdWorkRecord {
  int32_t item;
  int32_t partial, full;  // WalkCounts of the item's mask row
  int32_t cost;           // walk_length
};

ST_HOST_DEVICE inline FwdWorkRecord fwd_work_record(const MaskWalkLists& l, int32_t item, int32_t heads_q,
                                                    int32_t q_tiles, int32_t tile_q) {
  const FwdWorkItem w = fwd_work_item(item, heads_q, q_tiles);
  const WalkCounts c = walk_counts(l, w.b, w.h, fwd_mask_row(w.q_tile, tile_q, l.block_q));
  return {item, c.partial, c.full, walk_length(l, c)};
}

}  // namespace sparsetrain

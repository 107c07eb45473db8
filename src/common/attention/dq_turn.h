// The deterministic backward's dQ turns, the one rule that the host and device mask builders, the
// validator, the scheduler model and the kernel follow.
//
// At each q block m, the block columns touching it take turns in schedule order: the mask stores,
// per (column n, q block m), n's rank among them (0, 1, ...), in the mask's own block units. A
// backend whose kv tile is narrower than block_kv runs each block column as `sub_tiles`
// consecutive writers (each sub-column adds its own dQ partial); it derives that count itself
// (dq_sub_tiles) and expands the rank with dq_visit_turn. The mask never depends on a kernel's
// tile, and every expansion keeps the invariant deadlock freedom needs (turns increasing with
// hand-out position), because the sub-columns of a block column are handed out consecutively.
#pragma once

#include <cstdint>

#include "common/host_device.h"

namespace sparsetrain {

// The CUDA backward's kv tile: the keys of one work item, so one dQ writer's width. Host-visible
// because the scheduler model ("auto") must split block columns as the kernel does.
inline constexpr int kBwdTileKv = 128;

// Writers per block column for a kernel kv tile of kBwdTileKv: block_kv / kBwdTileKv. A block_kv
// that is not a multiple of the tile (a mask only the CPU reference runs: the CUDA backend refuses
// it) counts as one writer, so the model still describes the mask's own blocks.
ST_HOST_DEVICE constexpr int32_t dq_sub_tiles(int64_t block_kv) {
  return block_kv >= kBwdTileKv && block_kv % kBwdTileKv == 0 ? int32_t(block_kv / kBwdTileKv) : 1;
}

// The turn that sub-column `sub_tile` of a column with stored rank `rank` at a q block waits for:
// the sub-columns of earlier columns all come first, its own earlier sub-columns next.
ST_HOST_DEVICE constexpr int32_t dq_visit_turn(int32_t rank, int32_t sub_tiles, int32_t sub_tile) {
  return rank * sub_tiles + sub_tile;
}

}  // namespace sparsetrain

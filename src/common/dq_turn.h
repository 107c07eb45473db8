// The deterministic backward's dQ turns, the one rule that the host and device mask builders, the
// validator, the scheduler model and the kernel follow.
//
// At each q block, the block columns touching it take turns in schedule order (a column's rank
// among them, from 0), each as `sub_tiles` consecutive writers: the kernel's kv tile may be a
// fraction of the mask's block, and each of its sub-columns adds its own dQ partial. The mask
// stores, per (column, q block), the turn of its first sub-column; sub-column t of a visit waits
// until the q block's semaphore reaches that turn + t.
#pragma once

#include <cstdint>

#include "common/group_offsets.h"  // ST_HOST_DEVICE

namespace sparsetrain {

ST_HOST_DEVICE constexpr int64_t dq_stored_turn(int64_t rank, int64_t sub_tiles) { return rank * sub_tiles; }

ST_HOST_DEVICE constexpr int32_t dq_visit_turn(int32_t stored_turn, int32_t sub_tile) { return stored_turn + sub_tile; }

}  // namespace sparsetrain

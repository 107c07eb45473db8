// Internal helpers of the block-mask code (src/ops/block_mask*.cpp) that the tests use too: (b, h)
// slices of a mask's index tensors with broadcasting, and the scheduler model's input built from a
// mask (src/common/attention/dq_schedule_model.h).
#pragma once

#include <cstdint>

#include "common/attention/block_mask_rows.h"
#include "common/attention/dq_schedule_model.h"
#include "sparsetrain/block_mask.h"

namespace sparsetrain {

// Slice (b, h) of counts [B, H, R] / indices [B, H, R, W] (mask_index_view: a size-1 leading dim
// broadcasts). Undefined tensors give an empty list (count 0 everywhere).
IndexRows mask_rows(const TensorView& counts, const TensorView& indices, int64_t b, int64_t h);
// Slice (b, h) of a write order, to fill (read it with b = h = 0).
MaskIndexOut mask_write_order(const TensorView& order, int64_t b, int64_t h);

// validate_block_mask's structural half, for a mask whose tensors live on `device`: presence,
// dtypes, ranks, row counts, broadcastable leading dims, the bitmask / document-id tensors; not
// the contents (validate_block_mask reads those on the host).
void check_block_mask_structure(const BlockMask& mask, int64_t batch, int64_t heads, Device device);

// The leading dims [B, H] of a mask: the largest over its tensors (each is 1 or that).
void mask_leading_dims(const BlockMask& mask, int64_t* batch, int64_t* heads);

// How the backward walks this mask's items under `walk` (bwd_walk_shape: the heads innermost only
// for a mask with H = 1); the kernel's arguments and the model both take it from here.
BwdWalkShape mask_walk_shape(const BlockMask& mask, WalkOrder walk);

// The hand-out of a schedule over num_columns block columns.
DqColumnHandout dq_handout(const ColumnSchedule& schedule, int64_t batch, int64_t kv_heads, int64_t num_columns,
                           int64_t sub_tiles);

// The model's input for an attention of `batch` x `q_heads` (kv_heads divides q_heads) over the
// mask (broadcast), for a kernel that runs each block column as `sub_tiles` writers (the CUDA
// backward: dq_sub_tiles(block_kv), common/attention/dq_turn.h): ranks from the mask's stored write orders ...
DqModelProblem dq_model_problem(const BlockMask& mask, int64_t sub_tiles, int64_t batch, int64_t q_heads,
                                int64_t kv_heads);
// ... or computed here for `schedule` from the q-side lists (independently of compute_dq_write_order).
DqModelProblem dq_model_problem(const BlockMask& mask, const ColumnSchedule& schedule, int64_t sub_tiles,
                                int64_t batch, int64_t q_heads, int64_t kv_heads);

}  // namespace sparsetrain

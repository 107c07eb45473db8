// BlockMask: which (query block, key block) pairs of an attention are computed, in FlexAttention's
// layout (docs/DESIGN.md section 6), plus what the deterministic backward needs: the transposes, the
// dQ write order for a column schedule, and the mask inside partial blocks.
//
// Index tensors are int32 with leading dims [B, H] broadcastable (size 1 or the batch / heads of
// the attention), block counts Mq = ceil(Sq / block_q) and Nk = ceil(Skv / block_kv):
//   kv_num_blocks [B, H, Mq]       partial kv blocks of each q block (the mask applies inside)
//   kv_indices    [B, H, Mq, Wkv]  their kv block ids in the first kv_num_blocks entries
//   full_kv_*                      the same for full blocks (no mask inside); may be absent
//   q_num_blocks / q_indices [B, H, Nk(, Wq)], full_q_*: the transposes (backward walks columns)
//   dq_write_order (_full)         int32, parallel to q_indices (full_q_indices): see below
// W may be compact: any width >= the largest count (FlexAttention pads to Nk / Mq); every tensor
// parallel to an index tensor, the write orders included, may be compact the same way.
//
// Lists: each q-side list is strictly increasing (builders sort; validation checks it and that no
// block is both partial and full). The backward walks a kv column's q blocks, partial and full
// merged, in the order of its schedule's WalkOrder (below): by default from the last one up.
//
// dQ write order: for a column schedule (the order in which backward hands out kv columns), every
// q block m is written by the columns touching it one at a time, in schedule order; the entry
// parallel to (n, m) is n's turn (0, 1, ...) among those columns, in the mask's own block units.
// A backend whose kv tile is narrower than block_kv expands it (its sub-columns of n take
// consecutive turns: src/common/attention/dq_turn.h); the mask does not depend on any kernel's tile.
// Deadlock freedom (docs/DESIGN.md section 6) holds when, at every q block, turns increase with
// the writers' positions in the schedule — true of every order built here, and checked by
// check_write_order().
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "sparsetrain/allocator.h"
#include "sparsetrain/mask_spec.h"
#include "sparsetrain/tensor.h"

namespace sparsetrain {

// The order in which backward hands out kv columns: left to right, right to left (SPT: on a
// causal mask the shortest columns come first), or an explicit permutation of [0, Nk).
enum class ScheduleKind { kLeftToRight, kShortestFirst, kPermutation };

// How the backward walks one work item (a kv column of one kv head): the q tiles it touches, for
// each query head of the kv head's group. Only the order of one item's visits changes: turns,
// tickets and write orders do not (src/common/attention/attention_bwd_walk.h: bwd_walk_shape, and why
// neither determinism nor deadlock freedom depends on it). dK / dV are summed in this order, so
// the schedule (this included) fixes the backward's bits.
//   kDescendingHeadsInner  q tiles bottom-up, at each tile every query head of the group in turn
//                          (a mask with H > 1, whose heads' lists differ: one head after the
//                          other, each bottom-up). The default: the columns of a left-to-right
//                          chain then run in lock step.
//   kAscendingHeadsOuter   per query head in turn, q tiles top-down.
//   kAscendingHeadsInner   q tiles top-down, at each tile every query head of the group in turn
//                          (H > 1: as kAscendingHeadsOuter). Behind a long first column (sinks,
//                          global or strided tokens: columns that do not nest), walking top-down
//                          lets the later columns follow it, and with the heads innermost a GQA
//                          group follows it once, not once per head ("auto", choose_schedule).
enum class WalkOrder { kDescendingHeadsInner, kAscendingHeadsOuter, kAscendingHeadsInner };

struct ColumnSchedule {
  ScheduleKind kind = ScheduleKind::kLeftToRight;
  std::vector<int32_t> permutation;  // kPermutation: column ids in hand-out order
  WalkOrder walk = WalkOrder::kDescendingHeadsInner;
  // Column n's position in the hand-out order (Nk columns).
  int64_t position(int64_t n, int64_t num_columns) const;
  // "left-to-right", "shortest-first", "permutation[...]"; "+ ascending heads outer" appended
  // for that walk.
  std::string str() const;
};
const char* walk_order_name(WalkOrder w);  // "descending_heads_inner", "ascending_heads_outer"
WalkOrder parse_walk_order(const std::string& name);  // the inverse; an error naming `walk` otherwise
const char* schedule_kind_name(ScheduleKind k);  // "left_to_right", "shortest_first", "permutation"
ScheduleKind parse_schedule_kind(const std::string& name);  // the inverse; an error naming `schedule`

// Non-owning views of a block mask (host or device memory; int32 index tensors).
struct BlockMask {
  int64_t seq_q = 0, seq_kv = 0;
  int64_t block_q = 128, block_kv = 128;
  TensorView kv_num_blocks, kv_indices;            // required
  TensorView full_kv_num_blocks, full_kv_indices;  // optional (both or neither)
  TensorView q_num_blocks, q_indices;              // the transposes (required for backward)
  TensorView full_q_num_blocks, full_q_indices;
  TensorView dq_write_order, dq_write_order_full;  // parallel to q_indices / full_q_indices
  ColumnSchedule schedule;                         // the schedule the write orders were built for
  // The mask inside partial blocks: a built-in spec, or per-partial-block bitmasks
  // (MaskKind::kBitmask): uint8 [B, H, Mq, Wkv, block_q * block_kv / 8] parallel to kv_indices,
  // bit (i * block_kv + j) of a block = query row i, key column j of the block allowed (LSB first).
  MaskSpec spec;
  TensorView partial_bitmasks;
  // Documents as ranges in the backward (optional; document masks on CUDA): the same mask over a
  // padded layout of its tokens, where every document of at least a minimum length starts and
  // ends on a 128-token boundary (build_doc_padded_mask; common/attention/doc_padding.h), so that no kv or
  // q tile of the backward straddles a long document's edge. The CUDA backward runs its lists,
  // ids and scratch rows on that mask and loads and stores the tokens at their real rows; the
  // forward and the CPU reference read this mask only. Non-owning; null: none.
  const BlockMask* backward_padded = nullptr;
  // In a padded mask only: int32 [B or 1, seq_q] (= seq_kv), the token at each padded position,
  // -1 for padding; a position's tokens stay in order and a tile's real rows come first.
  TensorView real_rows;

  int64_t num_q_blocks() const { return (seq_q + block_q - 1) / block_q; }
  int64_t num_kv_blocks() const { return (seq_kv + block_kv - 1) / block_kv; }
};

// A mask's 11 index tensors in the one order the fronts pass them as a list (Python's
// sparsetrain._block_mask.TENSOR_NAMES): kv_num_blocks, kv_indices, full_kv_*, q_*, full_q_*,
// dq_write_order, dq_write_order_full, partial_bitmasks.
constexpr int kBlockMaskTensors = 11;
const char* block_mask_tensor_name(int i);
TensorView& block_mask_tensor(BlockMask& m, int i);

// Owning storage for a BlockMask built by the library (tensors from the caller's allocator).
struct BlockMaskTensors {
  BlockMask mask;  // views into the tensors below
  Tensor kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices;
  Tensor q_num_blocks, q_indices, full_q_num_blocks, full_q_indices;
  Tensor dq_write_order, dq_write_order_full, partial_bitmasks;
  std::vector<int32_t> schedule_permutation;
  Tensor doc_q, doc_kv, real_rows;  // build_doc_padded_mask: the padded ids and real_rows
};
// The built mask's tensor i in block_mask_tensor's order.
const Tensor& block_mask_tensor(const BlockMaskTensors& t, int i);

// Checks shapes, dtypes, broadcastable leading dims (against batch / heads when > 0), index
// ranges, duplicates, sorted walks, a block listed as both partial and full, counts larger than
// the index width, transposes consistent with the forward lists, and, when present, the write
// orders against check_write_order(). Throws sparsetrain::Error naming the tensor. Host memory
// only (a device mask is validated by copying it back: debug use).
void validate_block_mask(const BlockMask& mask, int64_t batch = 0, int64_t heads = 0);

// Builders (host memory; the caller's allocator, default_allocator() if null). `schedule`:
// the column schedule whose dQ write order is stored; ScheduleKind "auto" is chosen by
// choose_schedule() below when `auto_schedule` is true.
// What "auto" models besides the mask: the attention's batch and heads, and the backward's
// workers (persistent CTAs: the GPU's SM count, or sm_limit when one is passed). 0: the mask's
// leading dims (batch, heads_q = heads_kv = its H) and 132 workers (an H100 SXM / H200).
struct ScheduleProblem {
  int64_t batch = 0, heads_q = 0, heads_kv = 0, workers = 0;
};

struct BlockMaskOptions {
  int64_t block_q = 128, block_kv = 128;
  bool auto_schedule = true;   // choose_schedule(mask, problem); otherwise `schedule`
  ColumnSchedule schedule;
  ScheduleProblem problem;     // for auto_schedule
  Allocator* allocator = nullptr;
  // build_block_mask only: a CUDA device builds the same tensors there (document ids on that
  // device), one thread per row / column, on `stream`, without a host synchronisation; index
  // tensors are full width.
  Device device = Device::cpu();
  Stream stream;
};
// A block is full when every element inside the sequences is allowed (the last row / column of
// blocks may be cut short: positions past seq_q / seq_kv do not count), skipped when none is.
// From a built-in spec (MaskKind other than kBitmask); batch / heads as the spec needs (document
// ids may differ per batch row; everything else broadcasts with B = H = 1).
BlockMaskTensors build_block_mask(const MaskSpec& spec, int64_t seq_q, int64_t seq_kv,
                                  const BlockMaskOptions& options = {});
// The padded backward mask of a document mask (spec kDocument / kDocumentCausal, seq_q == seq_kv
// == seq): every document (of doc_q) of at least min_length tokens (>= 128) starts and ends on a
// 128-token boundary, runs of shorter ones stay packed (doc_padded_positions), one layout for both
// sides (doc_kv's ids move with their tokens: they may differ from doc_q's, as cu_seqlens' past
// the last document), padding positions get ids no token has, and the mask is built over the
// padded ids with `options`, plus real_rows. Attach it with `mask.backward_padded = &padded.mask`
// (kept alive as long as mask). On the host: at the longest row's padded length (a multiple of
// 128); on a device (options.device): without a synchronisation, at doc_padded_length_bound.
// min_length 1024 is what the Python front attaches by default to document masks built on a CUDA
// device: there the build costs about twice the plain mask's and makes the backward 5-8 % faster
// on packed documents.
BlockMaskTensors build_doc_padded_mask(const MaskSpec& spec, int64_t seq, int64_t min_length,
                                       const BlockMaskOptions& options = {});
// From a dense boolean (uint8) block matrix [B, H, Mq, Nk]: 0 = skipped, 1 = partial, 2 = full.
// The mask's spec is kFull (nothing masked inside partial blocks): set mask.spec for another.
BlockMaskTensors build_block_mask_from_blocks(const TensorView& blocks, int64_t seq_q, int64_t seq_kv,
                                              const BlockMaskOptions& options = {});
// FlexAttention's form of a mask's blocks (torch.nn.attention.flex_attention.BlockMask), host
// memory, int32 or int64: per row of q blocks the partial blocks' count and ids, kv_num_blocks
// [B', H', Mq] and kv_indices [B', H', Mq, W] (the first count entries of a row are its ids, in any
// order), and the full blocks' likewise (optional: both undefined); leading dims B', H' are 1 or
// the mask's batch / heads.
struct FlexBlockLists {
  TensorView kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices;
};
// The dense block matrix uint8 [batch, heads, Mq, Nk] of `lists` (build_block_mask_from_blocks's
// input). Everything is checked before the matrix is allocated; an error names the list and the
// entry: a count outside [0, W], an id outside [0, Nk), an id twice in a row, a block both partial
// and full.
Tensor block_matrix_from_flex(const FlexBlockLists& lists, int64_t batch, int64_t heads, int64_t num_kv_blocks,
                              Allocator* allocator = nullptr);
// Where the partial blocks of a dense block matrix [B, H, Mq, Nk] go in a bitmask tensor
// [B, H, Mq, W, nbytes] (build_block_mask_from_function's layout; *width = W, the longest row of
// partial blocks, at least 1): int64 [5, P], the partial blocks in list order (rows in order, kv
// blocks ascending), each one's row of that tensor viewed as [B * H * Mq * W, nbytes], then its b,
// h, first query and first key. What the Python front evaluates a flex mask_mod on.
Tensor partial_block_places(const TensorView& blocks, int64_t block_q, int64_t block_kv, int64_t* width,
                            Allocator* allocator = nullptr);
// From any mask function: allowed(b, h, q, kv) evaluated once per element; blocks with every
// element allowed become full, with none skipped, the rest partial with a bitmask. Bits of
// positions past the sequences are 0. The bitmask tensor's width is the largest partial count
// (compact; this builder runs the host function, so it may size by data).
using MaskFunction = bool (*)(void* context, int64_t b, int64_t h, int64_t q, int64_t kv);
BlockMaskTensors build_block_mask_from_function(MaskFunction allowed, void* context, int64_t batch, int64_t heads,
                                                int64_t seq_q, int64_t seq_kv, const BlockMaskOptions& options = {});

// The transposes (q_* from kv_*), and the dQ write orders for `schedule`, written into `out`
// (which already holds the forward lists).
void transpose_block_mask(BlockMaskTensors& out, Allocator* allocator = nullptr);
void compute_dq_write_order(BlockMaskTensors& out, const ColumnSchedule& schedule, Allocator* allocator = nullptr);

// The deadlock-freedom invariant: for every (b, h) and q block, the writers' turns are exactly
// 0..k-1 and increase with their position in `mask.schedule`. Returns "" or the first violation.
std::string check_write_order(const BlockMask& mask);

// "auto": what measured fastest on the GPU. Columns handed out left to right (it beat shortest
// first on every mask measured). The kDescendingHeadsInner walk on built-in band and document
// masks: their columns nest (an earlier-turn column reaches at least as far down), so walking
// bottom-up keeps the columns in flight one hand-off apart; with the backward's L2 sections it
// beat the ascending walk on every such mask measured, by 1-23 %. Masks given block by block
// (spec kFull or kBitmask, transposes on the host) need not nest: a long early column followed by
// short ones (attention sinks, global or strided tokens beside a window) reaches the short
// columns' tiles last when walking bottom-up, and they wait for it. Where a mask's columns do not
// nest (checked on its lists) and the model's size stays within 2^21 visits (its host time within
// ~0.3 s), the model runs both walks on `problem` and the ascending walk (heads innermost) is
// taken where its deterministic critical path is at most 0.9x the descending one's (sinks + a
// 1024 window, B2 H16 S8192: 30 % faster; at GQA 8:1, 33 %). A mask built on a device keeps the
// descending walk (its lists are not on the host). schedule_candidates reports the model's view
// of every candidate.
ColumnSchedule choose_schedule(const BlockMask& mask, const ScheduleProblem& problem = {});

// Every hand-out x walk the kernel runs, with its modelled critical paths (deterministic and not):
// left to right with the descending and the ascending-heads-outer walks, shortest first with
// those two walks, then left to right with the ascending-heads-inner walk ("auto" weighs the
// first and the last).
// What the bench reports next to the choice.
struct ScheduleCandidate {
  ColumnSchedule schedule;
  int64_t critical_path = 0, nondeterministic_critical_path = 0;
};
std::vector<ScheduleCandidate> schedule_candidates(const BlockMask& mask, const ScheduleProblem& problem = {});

}  // namespace sparsetrain

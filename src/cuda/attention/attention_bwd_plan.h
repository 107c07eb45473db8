// The attention backward's plan, on the host: the mask it runs on, its scratch, and its hand-out's
// L2 sections (common/attention/bwd_sections.h's rule, or a fixed order from the sweep switch
// tuning::attention_bwd_order), decided here from the mask's spec or left to the preprocessing,
// which reads the column lists on the device.
#pragma once

#include <cstddef>
#include <cstdint>

#include "common/attention/bitmask_transpose.h"
#include "cuda/attention/attention_bwd_params.h"
#include "ops/attention_backend.h"
#include "sparsetrain/block_mask.h"

namespace sparsetrain::cuda::attn {

// The backward kernel's q tile rows for this problem's head dim (bwd_tile_q).
inline int32_t bwd_tile_rows(const backend::AttentionProblem& p) { return bwd_tile_q(int(p.head_dim)); }

// The mask the backward runs on: a document mask's padded form where it has one
// (BlockMask::backward_padded: lists, ids and scratch rows over its positions).
inline const BlockMask& bwd_mask(const BlockMask& m) { return m.backward_padded != nullptr ? *m.backward_padded : m; }

// Rows of one (b, h) in the backward's scratch: the backward mask's positions, padded to whole q
// tiles.
inline int64_t bwd_q_tiles(const backend::AttentionProblem& p, const BlockMask& bm) {
  return (bm.seq_q + bwd_tile_rows(p) - 1) / bwd_tile_rows(p);
}

// A bitmask mask's partial blocks as the backward's transposed copy holds them (the mask's leading
// dims as stored); blocks() 0 for other masks.
BitmaskBlocks bwd_bitmask_blocks(const BlockMask& bm);

// The backward's scratch, in order (each region 256-byte aligned); base null: the sizes alone.
// The regions only the preprocessing and the main kernel use (lse_log2, delta, doc_q_rows, bits_t)
// live in dq's own bytes where they fit (in_dq; not for a bitmask larger than dq, nor for a few
// queries whose rows, padded to whole tiles, outgrow it): dq, [B, Sq, Hq, D] contiguous from the
// library, is written only after the main kernel, by the conversion (bwd_convert_dq_kernel), which
// reads none of them. That keeps a fwd + bwd's peak memory at the fp32 dQ accumulator's plus the
// outputs' (FlashAttention-4 holds its lse_log2 and dpsum beside them). `bytes` counts the
// workspace alone.
struct BwdScratch {
  float* dq_accum;
  float* lse_log2;
  float* delta;
  int32_t* doc_q_rows;  // [B, rows]: document masks' q ids, padded (BwdArgs::doc_q_rows); null for other kinds
  uint32_t* bits_t;     // bitmask masks' partial blocks transposed (bwd_bitmask_blocks); null for other kinds
  int32_t* semaphores;  // then the ticket counter and the abandoned report: zeroed together by the preprocessing
  int32_t* counters;
  int32_t* permutation;
  int32_t* sections;  // the hand-out's section size where the preprocessing decides it (BwdSectionsOnDevice)
  size_t bytes;
  size_t zeroed_bytes;  // semaphores + counters
  bool in_dq;           // lse_log2, delta, doc_q_rows and bits_t in dq's bytes (a rule of the sizes alone)

  // base, dq null: the sizes alone.
  BwdScratch(const backend::AttentionProblem& p, const BlockMask& bm, void* base, void* dq);
};

// The hand-out's sections for a backward on `device` over the backward mask `m`, whose arguments
// `a` are filled but for them (a.grid, a.lists and a.sched.handout set): a.sched.handout's
// section_groups decided here, or (documents and bitmasks under the default rule) the
// preprocessing's decision on the device, returned with `out` = `sections` (ws.sections) and
// a.sched.device_sections pointed at it; otherwise the result's out is null.
BwdSectionsOnDevice plan_bwd_sections(const backend::AttentionProblem& p, const BlockMask& m, bool deterministic,
                                      int device, int32_t* sections, BwdArgs& a);

}  // namespace sparsetrain::cuda::attn

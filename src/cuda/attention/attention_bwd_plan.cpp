// The attention backward's plan (attention_bwd_plan.h): the scratch layout, and the hand-out's L2
// sections. Host code only: nothing here launches or synchronises.
#include "cuda/attention/attention_bwd_plan.h"

#include "common/attention/bwd_sections.h"
#include "common/attention/mask_predicate.h"
#include "cuda/device_cache.h"
#include "cuda/tuning.h"
#include "sparsetrain/dtype.h"

namespace sparsetrain::cuda::attn {

BitmaskBlocks bwd_bitmask_blocks(const BlockMask& bm) {
  BitmaskBlocks s;
  s.block_q = int32_t(bm.block_q), s.block_kv = int32_t(bm.block_kv);
  if (bm.spec.kind != MaskKind::kBitmask) return s;  // rows = width = 0: no blocks
  const TensorView& bits = bm.partial_bitmasks;
  s.lead_b = int32_t(bits.size(0)), s.lead_h = int32_t(bits.size(1));
  s.rows = int32_t(bits.size(2)), s.width = int32_t(bits.size(3));
  return s;
}

BwdScratch::BwdScratch(const backend::AttentionProblem& p, const BlockMask& bm, void* base, void* dq) {
  const int64_t bh = p.batch * p.heads_q, tiles = bwd_q_tiles(p, bm), rows = tiles * bwd_tile_rows(p);
  const bool docs = mask_has_documents(bm.spec.kind);
  auto round = [](size_t n) { return (n + 255) / 256 * 256; };  // each region 256-byte aligned
  // The regions only the kernel and its preprocessing read, and whether they all fit in dq.
  const size_t row_bytes = size_t(bh * rows) * sizeof(float);
  const size_t doc_bytes = docs ? size_t(p.batch * rows) * sizeof(int32_t) : 0;
  const size_t bit_bytes = size_t(bwd_bitmask_blocks(bm).words()) * sizeof(uint32_t);
  in_dq = 2 * round(row_bytes) + round(doc_bytes) + round(bit_bytes) <=
          size_t(p.batch * p.seq_q * p.heads_q * p.head_dim) * dtype_size(p.dtype);
  size_t off = 0, dq_off = 0;
  auto take = [&](size_t n, bool kernel_only = false) {
    const bool there = kernel_only && in_dq;
    char* at = static_cast<char*>(there ? dq : base);
    size_t& o = there ? dq_off : off;
    char* r = at == nullptr ? nullptr : at + o;
    o += round(n);
    return r;
  };
  dq_accum = reinterpret_cast<float*>(take(size_t(bh * rows * p.head_dim) * sizeof(float)));
  lse_log2 = reinterpret_cast<float*>(take(row_bytes, true));
  delta = reinterpret_cast<float*>(take(row_bytes, true));
  doc_q_rows = docs ? reinterpret_cast<int32_t*>(take(doc_bytes, true)) : nullptr;
  bits_t = bit_bytes > 0 ? reinterpret_cast<uint32_t*>(take(bit_bytes, true)) : nullptr;
  const size_t sem_bytes = size_t(bh * tiles) * sizeof(int32_t);
  zeroed_bytes = sem_bytes + 5 * sizeof(int32_t);  // + the ticket and abandoned[4]
  semaphores = reinterpret_cast<int32_t*>(take(zeroed_bytes));
  counters = semaphores == nullptr ? nullptr : semaphores + bh * tiles;
  // Mask columns are at least one kernel kv tile wide: ceil(Skv / 128) bounds Nk.
  permutation = reinterpret_cast<int32_t*>(take(size_t((bm.seq_kv + kBwdTileKv - 1) / kBwdTileKv) * sizeof(int32_t)));
  sections = reinterpret_cast<int32_t*>(take(sizeof(int32_t)));
  bytes = off;
}

BwdSectionsOnDevice plan_bwd_sections(const backend::AttentionProblem& p, const BlockMask& m, bool deterministic,
                                      int device, int32_t* sections, BwdArgs& a) {
  DqColumnHandout& handout = a.sched.handout;
  const int64_t l2_budget = tuning::attention_l2_budget(int64_t(device_info(device).l2_bytes));
  BwdSectionsOnDevice on_device;  // out = null: the sections are decided here
  const int64_t groups = p.batch * p.heads_kv, group = p.heads_q / p.heads_kv;  // a group shares Q and dO
  const int64_t group_bytes = group * 2 * p.seq_q * p.head_dim * int64_t(dtype_size(p.dtype));
  const int64_t items_per_group = handout.num_columns * handout.sub_tiles;
  switch (const tuning::AttentionBwdOrder order = tuning::attention_bwd_order(); order.how) {
    case tuning::AttentionBwdOrder::kFixed: handout.section_groups = order.groups; break;
    case tuning::AttentionBwdOrder::kColumns: break;
    case tuning::AttentionBwdOrder::kBudget:  // the L2 budget alone
      handout.section_groups =
          bwd_section_groups(groups, group_bytes, l2_budget, a.grid, {}, items_per_group, group, false);
      break;
    case tuning::AttentionBwdOrder::kAuto: {
      // The deterministic mode walking ascending queues its columns behind each other whatever
      // their length: the plain hand-out but for a few long columns (common/attention/bwd_sections.h).
      const bool ascending = !a.lists.walk.descending;
      const BwdColumnWalks walks = bwd_column_walks(m.spec, m.seq_q, m.seq_kv, m.block_kv, bwd_tile_rows(p));
      if (walks.known()) {
        handout.section_groups = bwd_auto_section_groups(deterministic, ascending, groups, group_bytes,
                                                         l2_budget, a.grid, walks, items_per_group, group);
      } else {
        // Documents, bitmasks: the same rule with the walks from the column lists, on the device
        // (the deterministic plain hand-out ran them 5-7 % slower; the atomic mode's budget-sized
        // sections 9-26 % slower on sinks and landmarks; common/attention/bwd_sections.h).
        on_device = {a.lists, a.batch, int32_t(handout.num_columns), groups, group_bytes, l2_budget,
                     a.grid, int32_t(group), int32_t(handout.sub_tiles), deterministic, ascending, sections};
        a.sched.device_sections = sections;  // handout.section_groups stays 0: the draws map
      }
      break;
    }
  }
  return on_device;
}

}  // namespace sparsetrain::cuda::attn

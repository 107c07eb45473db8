// The sm90 attention backward's arguments, framework-free (no CuTe, no CUDA types), filled by the
// backend (attention_cuda.cu) and read by every instantiation (attention_bwd_sm90.cuh).
#pragma once

#include <cstdint>

#include "common/attention/attention_bwd_walk.h"
#include "common/attention/dq_schedule_model.h"
#include "common/host_device.h"
#include "cuda/attention/attention_fwd_params.h"  // KernelMaskSpec: the mask inside partial blocks
#include "cuda/attention/tile_scheduler.h"        // BwdTicketScheduler

namespace sparsetrain::cuda::attn {

// The backward kernel's tiles: 64 query rows, 128 at D <= 64 (bwd_tile_q: the dQ partial of a
// visit, the unit of a dQ turn)
// by kBwdTileKv = 128 keys (one work item's kv sub-column; common/attention/dq_turn.h holds it, since the
// dQ turn rule and the scheduler model need it on the host).
constexpr int kBwdTileQ = 64;
// At D <= 64, 128-row q tiles (FlashAttention-3's 128 x 128 at D = 64): a visit's fixed latency
// (barriers, waits, the walk) is the same at any D, so the smaller GEMMs need more rows to carry
// it (64-row tiles took 4-7 % longer at D = 64). BwdTraits::kBlockM; the host's scratch rows,
// lists and sections rule take it from here.
constexpr int bwd_tile_q(int head_dim) { return head_dim <= 64 ? 2 * kBwdTileQ : kBwdTileQ; }
using sparsetrain::kBwdTileKv;

struct BwdArgs {
  const void* q;     // [B, Sq, Hq, D], strides in elements (last dim 1)
  const void* k;     // [B, Skv, Hkv, D]
  const void* v;
  const void* dout;  // [B, Sq, Hq, D]
  int64_t q_stride_b, q_stride_s, q_stride_h;
  int64_t k_stride_b, k_stride_s, k_stride_h;
  int64_t v_stride_b, v_stride_s, v_stride_h;
  int64_t do_stride_b, do_stride_s, do_stride_h;
  void* dk;  // [B, Skv, Hkv, D] contiguous
  void* dv;
  // Scratch, rows padded to num_q_tiles * bwd_tile_q(D) per (b, h): written by the preprocessing.
  const float* lse_log2;  // lse * log2(e); +inf for a row with no allowed key or past Sq (P = 0)
  const float* delta;     // rowsum(dout * o)
  // Document masks: each padded q row's document id ([B, num_q_tiles * bwd_tile_q(D)]; 0 past Sq), loaded with
  // a visit's lse and delta, so that a partial tile's mask reads its queries' ids from shared
  // memory; null for other masks.
  const int32_t* doc_q_rows;
  float* dq_accum;        // [B, Hq, num_q_tiles, 64 * D] fp32 (tiles in fragment order), zeroed first
  int32_t* semaphores;    // [B * Hq * num_q_tiles], zeroed before every backward
  // [4]: set when a dQ wait timed out (a corrupt write order; no more waits), then the q tile's
  // semaphore index, the turn waited for and the value found, for the report.
  int32_t* abandoned;
  int32_t batch, seq_q, seq_kv, heads_q, heads_kv;
  // Documents as ranges (BlockMask::backward_padded): the lists, the document ids, the in-tile
  // mask and the scratch rows (lse, delta, doc_q_rows, the dQ accumulator, semaphores) are over
  // mask_seq_q = mask_seq_kv padded positions per batch row, and real_rows ([B or 1, mask_seq_q],
  // batch stride real_rows_stride_b, 0 to broadcast) gives each position's token (-1: padding):
  // where the loader's boxes start and the dK, dV and dQ rows go (bwd_real_row). Null: positions
  // are tokens, mask_seq_q / _kv = seq_q / seq_kv.
  const int32_t* real_rows;
  int32_t real_rows_stride_b;
  int32_t mask_seq_q, mask_seq_kv;
  // heads_q / heads_kv, divided once here: each role reads it from the parameters at an item's
  // start instead of holding it in a register (the producer's 24 at 128-row q tiles).
  int32_t group;
  float scale;
  MaskColumnLists lists;  // q tiles in units of bwd_tile_q(D)
  // The mask inside partial tiles; for bitmasks `bits` is the preprocessing's transposed copy
  // (BwdScratch::bits_t, common/attention/bitmask_transpose.h: bit j * block_q + i of a block is
  // key j, query i), its strides the copy's.
  KernelMaskSpec spec;
  int32_t block_q, block_kv;
  // The hand-out (sub_tiles = dq_sub_tiles(block_kv); permutation in device memory) and the work
  // counter, zeroed before every backward. Held here, not built in the kernel as the forward's is,
  // so every role reads it from the parameters by reference (a copy cost the producer ~36 B of
  // spills).
  BwdTicketScheduler sched;
  int32_t grid;             // persistent CTAs
  bool deterministic;
  int64_t spin_limit_ns;    // a dQ wait longer than this reports and gives up (no hang)
};

// The token at mask position `pos` of batch b: -1 for a padding position or one at or past
// mask_seq; the identity without padding (real_rows null). The one rule for the kernel, the
// preprocessing and the dQ conversion.
ST_HOST_DEVICE inline int32_t bwd_token_at(const int32_t* real_rows, int32_t real_rows_stride_b, int32_t mask_seq,
                                           int32_t b, int32_t pos) {
  if (pos >= mask_seq) return -1;
  return real_rows == nullptr ? pos : real_rows[b * real_rows_stride_b + pos];
}
// A query position's token and a key position's: one layout when padded (mask_seq_q ==
// mask_seq_kv), each bounded by its own length when not (seq_kv may exceed seq_q).
ST_HOST_DEVICE inline int32_t bwd_real_row(const BwdArgs& a, int32_t b, int32_t pos) {
  return bwd_token_at(a.real_rows, a.real_rows_stride_b, a.mask_seq_q, b, pos);
}
ST_HOST_DEVICE inline int32_t bwd_real_key(const BwdArgs& a, int32_t b, int32_t pos) {
  return bwd_token_at(a.real_rows, a.real_rows_stride_b, a.mask_seq_kv, b, pos);
}

// The hand-out's section size where only the device knows the walks (document and bitmask masks;
// common/attention/bwd_sections.h): block 0 of the preprocessing sums the column lists' walks over batch x
// columns (BwdColumnWalks) and applies the rule, and the kernel's ticket draws read it
// (BwdTicketScheduler::device_sections). out = null: decided on the host.
struct BwdSectionsOnDevice {
  MaskColumnLists lists;
  int32_t batch = 0, columns = 0;
  int64_t groups = 0, group_bytes = 0, l2_budget = 0;
  int32_t workers = 0, heads_per_group = 1, sub_tiles = 1;
  bool deterministic = false;  // the rule's walk-length bound (common/attention/bwd_sections.h)
  bool ascending = false;      // the walk (bwd_auto_section_groups)
  int32_t* out = nullptr;
};

// The main kernel, then dq [B, Sq, Hq, D] (contiguous, the input dtype) from the accumulator.
// One explicit instantiation per translation unit (attention_bwd_sm90_instance.cu.in).
template <FwdElement E, int HeadDim>
void run_bwd_sm90(const BwdArgs& args, void* dq, void* stream);

}  // namespace sparsetrain::cuda::attn

// The attention forward's work order: its (batch, query head, q tile) items in L2 sections of
// heads, longest first inside each (common/attention/attention_fwd_walk.h says why), written on the
// device by one small kernel before the forward's, with no host synchronisation. Its switches are
// tuning::attention_fwd_order's (cuda/tuning.h).
#pragma once

#include <cstddef>

#include "cuda/attention/attention_fwd_params.h"
#include "ops/attention_backend.h"

namespace sparsetrain::cuda::attn {

// The order's scratch for a.num_items items: the work records, then the dynamic hand-out's counter.
size_t fwd_order_scratch_bytes(int64_t num_items);

// Writes the work order of `a` (lists, heads_q, q_tiles and num_items set) into `scratch`
// (fwd_order_scratch_bytes) on `stream` of `device`, and points a.records and a.ticket (null for
// the static hand-out) at it. The kernel zeroes the counter, so every launch (and graph replay)
// starts it at zero.
void order_fwd_work(const backend::AttentionProblem& p, FwdArgs& a, void* scratch, int device, void* stream);

}  // namespace sparsetrain::cuda::attn

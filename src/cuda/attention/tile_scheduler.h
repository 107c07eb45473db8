// The persistent tile schedulers of the sm90 attention kernels, behind one small interface (as
// FlashAttention-3's): grid_shape(items, SMs, sm_limit) on the host; initial_work() and
// next_work(current) on the device, each giving a work index, valid(index) saying whether it is
// one. The index math is plain host/device code (tested on the CPU); only the ticket draw needs a
// device atomic.
//
//   FwdTicketScheduler  the forward: work items (batch, query head, q tile) in the work order
//                       (L2 sections of heads, longest first inside each; attention_fwd_order.cu
//                       builds it on the device), CTA c starts with position c and draws the
//                       next from an atomic counter whenever it starts an item, so the CTAs
//                       finish together whatever the items cost. Each position is a
//                       FwdWorkRecord (common/attention/attention_fwd_walk.h).
//   BwdTicketScheduler  the backward: tickets from an atomic counter (zeroed on the stream before
//                       every launch) in the mask's column schedule (DqColumnHandout), never by
//                       blockIdx, so the earliest unfinished column always runs.
#pragma once

#include <cstdint>

#include "common/attention/attention_fwd_walk.h"
#include "common/attention/dq_schedule_model.h"
#include "common/host_device.h"

namespace sparsetrain::cuda::attn {

// Persistent CTAs: one per SM at most, at most sm_limit (> 0), at least one.
ST_HOST_DEVICE inline int32_t persistent_grid(int64_t items, int32_t sms, int32_t sm_limit) {
  int64_t g = items < sms ? items : sms;
  if (sm_limit > 0 && g > sm_limit) g = sm_limit;
  return int32_t(g < 1 ? 1 : g);
}

struct FwdTicketScheduler {
  const FwdWorkRecord* records = nullptr;  // [num_items] in the work order
  int32_t num_items = 0;
  int32_t* ticket = nullptr;  // zeroed before every launch; null: static hand-out (a sweep switch)

  static int32_t grid_shape(int64_t items, int32_t sms, int32_t sm_limit) {
    return persistent_grid(items, sms, sm_limit);
  }
  // cta, grid: blockIdx.x and gridDim.x (plain arguments: the CPU tests drive them).
  ST_HOST_DEVICE int32_t initial_work(int32_t cta) const { return cta; }
  ST_HOST_DEVICE bool valid(int32_t index) const { return index < num_items; }
  // The static hand-out: CTA c takes positions c, c + grid, ...
  ST_HOST_DEVICE int32_t next_static(int32_t current, int32_t grid) const { return current + grid; }
#if defined(__CUDACC__)
  // One draw per call, by one thread of a CTA (it passes the index on: item_ring_sm90.cuh).
  // Positions below grid are the CTAs' first items, so the counter starts past them.
  __device__ int32_t next_work(int32_t current, int32_t grid) const {
    return ticket == nullptr ? next_static(current, grid) : grid + atomicAdd(ticket, 1);
  }
#endif
};

struct BwdTicketScheduler {
  DqColumnHandout handout;   // sub_tiles = dq_sub_tiles(block_kv)
  int32_t* ticket = nullptr;  // the counter, zeroed before every launch
  // Set where the section size is decided on the device (written by the preprocessing before the
  // kernel starts; common/attention/bwd_sections.h): a draw maps its ticket to the one-section hand-out's
  // position (DqColumnHandout::plain_position), which is what every role reads, so handout's own
  // section_groups is 0 then.
  const int32_t* device_sections = nullptr;

  static int32_t grid_shape(int64_t items, int32_t sms, int32_t sm_limit) {
    return persistent_grid(items, sms, sm_limit);
  }
  ST_HOST_DEVICE bool valid(int32_t index) const { return index < handout.num_items(); }
  ST_HOST_DEVICE DqWorkItem item(int32_t index) const { return handout.item_in<int32_t>(index); }
  // A drawn ticket as the roles read it.
  ST_HOST_DEVICE int32_t drawn(int32_t t, int32_t sections) const {
    return handout.plain_position<int32_t>(t, sections);
  }
#if defined(__CUDACC__)
  // Every call draws the next ticket: one thread of a CTA draws and passes it on to the others.
  __device__ int32_t initial_work() const { return draw(); }
  __device__ int32_t next_work(int32_t /*current*/) const { return draw(); }
  __device__ int32_t draw() const {
    const int32_t t = atomicAdd(ticket, 1);
    return device_sections == nullptr ? t : drawn(t, __ldg(device_sections));
  }
#endif
};

}  // namespace sparsetrain::cuda::attn

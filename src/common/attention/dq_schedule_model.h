// The deterministic block-sparse backward's scheduler (docs/DESIGN.md section 6): the dynamic column
// hand-out the kernel uses (plain host/device code: a ticket from a shared counter -> a work item),
// and a CPU model of the persistent kernel built on it, which reports success or the blocked
// workers, and the critical path in unit costs per block.
//
// Work items: one per (batch, kv head, kv sub-column). A block column n of the mask splits into
// `sub_tiles` sub-columns n * sub_tiles + t when the kernel's kv tile is block_kv / sub_tiles;
// each is a separate writer. Hand-out order (ticket order): sub-column position major, then
// (batch, kv head) — every head's first sub-column goes out before any head's second, so that
// independent heads run side by side. Within a block column, sub-columns go out in ascending t,
// so sub-column (n, t) has position position(n) * sub_tiles + t in the schedule.
// A worker walks its item's visits (q block, query head of its kv head's group) in the kernel's
// walk order (bwd_walk_shape, common/attention/attention_bwd_walk.h: by default q blocks descending with the
// heads innermost, or per head ascending); at each it waits until q block m's semaphore (per
// batch, query head and q block) equals its turn, adds its dQ partial (one unit of time), and
// increments it. The turn of sub-column t: dq_visit_turn(stored rank, sub_tiles, t) (common/attention/dq_turn.h).
// The non-deterministic mode (atomic adds) is the same walk without the waits: the ratio of the
// two critical paths is the model's det / nondet. The unit is a q block (the kernel's 64-row q
// tiles of one block run back to back, so a block's cost scales both modes alike).
#pragma once

#include <algorithm>
#include <cstdint>
#include <sstream>
#include <string>
#include <vector>

#include "common/attention/attention_bwd_walk.h"  // BwdWalkShape: the walk order, shared with the kernel
#include "common/attention/block_mask_rows.h"     // schedule_column
#include "common/attention/dq_turn.h"
#include "common/host_device.h"
#include "sparsetrain/block_mask.h"

namespace sparsetrain {

struct DqWorkItem {
  int64_t batch, kv_head, column, sub_tile;  // column: the mask's block column
};

// Tickets 0, 1, ... (an atomic counter on the device, reset inside the graph) -> work items: the
// sub-columns in schedule order, each position handed to every (batch, kv head) group before the
// next position. With section_groups > 0 the groups are handed out in sections of that many
// consecutive groups (the last may hold fewer), the whole schedule of one section before the next:
// the CTAs in flight then share a few heads' Q and dO in L2 instead of one head each (the forward's
// L2 sections, common/attention/attention_fwd_walk.h). A group's own order of positions is the same either
// way and its items keep their relative hand-out order, so the turns (per q tile, within one
// group) still increase with hand-out position: determinism and deadlock freedom hold as they are.
struct DqColumnHandout {
  int64_t batch = 1, kv_heads = 1, num_columns = 0, sub_tiles = 1;
  ScheduleKind kind = ScheduleKind::kLeftToRight;
  const int32_t* permutation = nullptr;  // kPermutation: block column ids in hand-out order
  int64_t section_groups = 0;            // groups per section; 0 (or >= all): one section

  ST_HOST_DEVICE int64_t num_items() const { return batch * kv_heads * num_columns * sub_tiles; }
  ST_HOST_DEVICE DqWorkItem item(int64_t ticket) const { return item_in<int64_t>(ticket); }
  // The same in index type I: the kernel's int32 (its tickets are; the backend checks that
  // num_items fits), whose divisions are a few instructions where int64's are a call that spilled
  // the 40-register loader and dQ writer.
  template <class I>
  ST_HOST_DEVICE DqWorkItem item_in(I ticket) const {
    const I groups = I(batch * kv_heads), subs = I(sub_tiles);
    const I plain = plain_position<I>(ticket, I(section_groups));
    const I sub_position = plain / groups, g = plain % groups;
    const I column = I(schedule_column(kind, permutation, sub_position / subs, num_columns));
    return {g / I(kv_heads), g % I(kv_heads), column, sub_position % subs};
  }
  // Ticket `ticket` of the hand-out in sections of `section` groups (0 or >= all: one section) as
  // a position of the one-section hand-out (sub-column position x groups + group): the item both
  // name. A bijection of [0, num_items) (tickets past it are returned as they are), so a kernel
  // whose section size is decided on the device maps each drawn ticket once and lets every other
  // role read the result with section_groups = 0 (BwdTicketScheduler::device_sections).
  template <class I>
  ST_HOST_DEVICE I plain_position(I ticket, I section) const {
    const I groups = I(batch * kv_heads), per_group = I(num_columns * sub_tiles);
    if (section <= 0 || section >= groups || ticket >= groups * per_group) return ticket;
    const I first = ticket / (section * per_group) * section;  // every earlier section is full
    const I size = groups - first < section ? groups - first : section;
    const I r = ticket - first * per_group;
    return r / size * groups + first + r % size;
  }
};

// What the model runs on: for every (b, query head) slice and block column n, the q blocks n
// touches in ascending order with n's rank at each (the mask's write order, in block units), and how the kernel
// walks them (heads_inner needs every head's list of a column to be the same: a mask with H = 1).
struct DqModelProblem {
  int64_t batch = 1, q_heads = 1, kv_heads = 1, num_q_blocks = 0, num_columns = 0;
  int64_t sub_tiles = 1;  // writers per block column (the kernel's: dq_sub_tiles(block_kv))
  BwdWalkShape walk;
  std::vector<int64_t> walk_begin;  // [batch * q_heads * num_columns + 1]
  std::vector<int32_t> walk_q_block, walk_turn;
  // 1 where the visit's block is partial (its mask applied in the tile); may be empty (none known).
  std::vector<uint8_t> walk_partial;

  int64_t walk_index(int64_t b, int64_t h, int64_t n) const { return (b * q_heads + h) * num_columns + n; }
};

struct DqBlockedWorker {
  int64_t worker;
  DqWorkItem item;
  int64_t q_head, q_block, turn, semaphore;  // waiting for `turn` while the semaphore holds this
};

struct DqModelResult {
  bool ok = false;
  int64_t critical_path = 0;  // time steps until the last add (or until nothing could move)
  int64_t total_work = 0;     // block visits done
  int64_t items_not_handed_out = 0;
  std::vector<DqBlockedWorker> blocked;  // every worker left waiting, when !ok
  // Adds that ran at the same step on the same semaphore (two writers holding one turn): a race
  // in the kernel, so not ok even when nothing blocks.
  int64_t races = 0;

  std::string str() const {
    std::ostringstream os;
    if (ok) {
      os << "ok: critical path " << critical_path << ", work " << total_work;
      return os.str();
    }
    if (races > 0) os << races << " racing add(s) (writers sharing a turn); ";
    if (blocked.empty()) {
      os << "nothing blocked: critical path " << critical_path;
      return os.str();
    }
    os << "blocked after " << critical_path << " steps (" << total_work << " adds done, " << items_not_handed_out
       << " items never handed out):";
    for (size_t i = 0; i < blocked.size() && i < 8; ++i) {
      const auto& w = blocked[i];
      os << " [worker " << w.worker << ": b " << w.item.batch << " kv head " << w.item.kv_head << " column "
         << w.item.column << "." << w.item.sub_tile << ", q head " << w.q_head << " q block " << w.q_block
         << " waits for turn " << w.turn << ", semaphore at " << w.semaphore << "]";
    }
    if (blocked.size() > 8) os << " ... (" << blocked.size() << " in all)";
    return os.str();
  }
};

// Discrete-time simulation: in each step every worker whose turn has come starts an add; an add
// takes visit_steps steps, after which the worker starts its next visit (or takes the next
// ticket), and the semaphore's increment becomes visible handoff_steps later (the partial landing
// in global memory, the release reaching the next writer's spin: the deterministic mode's
// hand-off latency, which the default of 0 leaves out). Event-driven (a waiting worker is woken
// only by the increment it waits for), so a run costs O(work + workers + time). When no worker can
// move and work is left, the model stops and reports the waiting workers: a dependency cycle, or
// starvation (everyone waits on an item not handed out). Two writers holding the same turn either
// race (both starting in one step: counted in `races`) or leave one of them waiting for a value the
// semaphore has passed (blocked). deterministic = false: no waits (the atomic adds), only the
// hand-out and the walks. A visit of a partial block (walk_partial) takes partial_steps more (the
// in-tile mask). The critical path: the step in which the last add completes.
inline DqModelResult simulate_dq_backward(const DqModelProblem& pb, const DqColumnHandout& handout, int64_t workers,
                                          bool deterministic = true, int64_t visit_steps = 1,
                                          int64_t handoff_steps = 0, int64_t partial_steps = 0) {
  DqModelResult res;
  const int64_t group = pb.q_heads / pb.kv_heads, s = pb.sub_tiles;
  const int64_t num_sems = pb.batch * pb.q_heads * pb.num_q_blocks;
  // Writers per semaphore (sub-columns touching it): the wait slots for each turn.
  std::vector<int64_t> slot_begin(size_t(num_sems + 1), 0);
  for (int64_t b = 0; b < pb.batch; ++b)
    for (int64_t h = 0; h < pb.q_heads; ++h)
      for (int64_t n = 0; n < pb.num_columns; ++n) {
        const int64_t w = pb.walk_index(b, h, n);
        for (int64_t i = pb.walk_begin[size_t(w)]; i < pb.walk_begin[size_t(w + 1)]; ++i)
          slot_begin[size_t((b * pb.q_heads + h) * pb.num_q_blocks + pb.walk_q_block[size_t(i)] + 1)] += s;
      }
  for (int64_t i = 0; i < num_sems; ++i) slot_begin[size_t(i + 1)] += slot_begin[size_t(i)];
  std::vector<int32_t> sem(size_t(num_sems), 0);
  std::vector<int32_t> slot_head(static_cast<size_t>(slot_begin.back()), -1), next_waiter(size_t(workers), -1);

  struct Worker {
    int64_t ticket = -1;  // -1: no item (done)
    DqWorkItem item{};
    int64_t head = 0, k = 0;  // head within the group, and the visit's rank in that head's walk
    int64_t pos = 0;          // the visit's entry in walk_q_block / walk_turn
    int64_t sem = 0, turn = 0;
  };
  std::vector<Worker> ws(static_cast<size_t>(workers));
  int64_t next_ticket = 0;
  const int64_t num_items = handout.num_items();

  // Head g's walk of w's column: [*begin, *begin + *len).
  auto walk_of = [&](const Worker& w, int64_t g, int64_t* begin, int64_t* len) {
    const int64_t widx = pb.walk_index(w.item.batch, w.item.kv_head * group + g, w.item.column);
    *begin = pb.walk_begin[size_t(widx)];
    *len = pb.walk_begin[size_t(widx + 1)] - *begin;
  };
  // (head, k) moved on to an existing visit, w pointed at its block; false when the item is done.
  // The order is the kernel's (bwd_item_next): heads innermost, or one head's walk after another,
  // each walk ascending or descending.
  auto settle = [&](Worker& w) {
    int64_t begin = 0, len = 0;
    for (;;) {
      if (w.head >= group) return false;
      walk_of(w, w.head, &begin, &len);
      if (w.k < len) break;
      if (pb.walk.heads_inner) return false;  // every head's walk has the same length
      ++w.head;
      w.k = 0;
    }
    w.pos = begin + (pb.walk.descending ? len - 1 - w.k : w.k);
    const int64_t h = w.item.kv_head * group + w.head;
    w.sem = (w.item.batch * pb.q_heads + h) * pb.num_q_blocks + pb.walk_q_block[size_t(w.pos)];
    w.turn = dq_visit_turn(pb.walk_turn[size_t(w.pos)], int32_t(s), int32_t(w.item.sub_tile));
    return true;
  };
  auto take_item = [&](Worker& w) {
    while (next_ticket < num_items) {
      w.ticket = next_ticket++;
      w.item = handout.item(w.ticket);
      w.head = 0;
      w.k = 0;
      if (settle(w)) return true;
    }
    w.ticket = -1;
    return false;
  };
  auto advance = [&](Worker& w) {
    if (pb.walk.heads_inner) {
      if (++w.head == group) {
        w.head = 0;
        ++w.k;
      }
    } else {
      ++w.k;
    }
    return settle(w) || take_item(w);
  };
  std::vector<int32_t> ready, stuck;
  // A worker at a block: ready now, waiting in its turn's slot, or stuck (its turn passed, or
  // lies outside 0..writers-1: it can never come).
  auto place = [&](int32_t wi) {
    Worker& w = ws[size_t(wi)];
    const int64_t writers = slot_begin[size_t(w.sem + 1)] - slot_begin[size_t(w.sem)];
    const int64_t v = sem[size_t(w.sem)];
    if (!deterministic || w.turn == v) {
      ready.push_back(wi);
    } else if (w.turn > v && w.turn < writers) {
      int32_t& head = slot_head[size_t(slot_begin[size_t(w.sem)] + w.turn)];
      next_waiter[size_t(wi)] = head;
      head = wi;
    } else {
      stuck.push_back(wi);
    }
  };
  // Future events in a ring of time slots (no event lies further ahead than the ring is long):
  // workers whose add completes (free) and semaphore increments that become visible (bump).
  const int64_t V = visit_steps < 1 ? 1 : visit_steps, H = handoff_steps < 0 ? 0 : handoff_steps;
  const int64_t P = partial_steps < 0 || pb.walk_partial.empty() ? 0 : partial_steps;
  const size_t ring = size_t(V + P + H + 1);
  std::vector<std::vector<int32_t>> free_at(ring);
  std::vector<std::vector<int64_t>> bump_at(ring);
  int64_t pending = 0, t = 0, last_add = 0;
  for (int64_t i = 0; i < workers; ++i)
    if (take_item(ws[size_t(i)])) place(int32_t(i));
  std::vector<int64_t> last_step(static_cast<size_t>(num_sems), -1);
  while (!ready.empty() || pending > 0) {
    ++t;
    const size_t slot = size_t(t % int64_t(ring));
    // Increments that reach the waiters now: whoever waits for the new value starts this step.
    for (int64_t sm : bump_at[slot]) {
      --pending;
      const int64_t v = ++sem[size_t(sm)];
      if (v >= slot_begin[size_t(sm + 1)] - slot_begin[size_t(sm)]) continue;
      int32_t& head = slot_head[size_t(slot_begin[size_t(sm)] + v)];
      for (int32_t wi = head; wi >= 0;) {
        const int32_t nx = next_waiter[size_t(wi)];
        ready.push_back(wi);
        wi = nx;
      }
      head = -1;
    }
    bump_at[slot].clear();
    // Workers whose add completed: on to their next visit (seeing this step's increments).
    for (int32_t wi : free_at[slot]) {
      --pending;
      if (advance(ws[size_t(wi)])) place(wi);
    }
    free_at[slot].clear();
    if (ready.empty()) continue;
    for (int32_t wi : ready) {
      const int64_t sm = ws[size_t(wi)].sem;
      if (deterministic && last_step[size_t(sm)] == t) ++res.races;
      last_step[size_t(sm)] = t;
      ++res.total_work;
      const int64_t steps = V + (P > 0 && pb.walk_partial[size_t(ws[size_t(wi)].pos)] ? P : 0);
      free_at[size_t((t + steps) % int64_t(ring))].push_back(wi);
      ++pending;
      if (deterministic) {
        bump_at[size_t((t + steps + H) % int64_t(ring))].push_back(sm);
        ++pending;
      } else {
        ++sem[size_t(sm)];
      }
      last_add = std::max(last_add, t + steps - 1);
    }
    ready.clear();
  }
  res.critical_path = last_add;
  res.items_not_handed_out = num_items - next_ticket;
  for (int64_t i = 0; i < workers; ++i) {
    const Worker& w = ws[size_t(i)];
    if (w.ticket < 0) continue;
    res.blocked.push_back({i, w.item, w.item.kv_head * group + w.head,
                           pb.walk_q_block[size_t(w.pos)], w.turn, sem[size_t(w.sem)]});
  }
  res.ok = res.blocked.empty() && res.races == 0;
  return res;
}

}  // namespace sparsetrain

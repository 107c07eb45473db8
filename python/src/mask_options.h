// A block mask's build options as both Python bindings receive them (the numpy/DLPack module `_C`
// and the C++ torch library's build_block_mask, torch_block_mask.cpp): the schedule by name
// ("left_to_right", "shortest_first"; "auto" is the callers' flag) or as a permutation of the kv
// block columns, the walk by name (empty: the default), and "auto"'s problem (none, or batch,
// heads_q, heads_kv, workers).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "sparsetrain/block_mask.h"
#include "sparsetrain/error.h"

namespace sparsetrain::wire {

// name empty: the permutation.
inline ColumnSchedule column_schedule(std::string_view name, std::vector<int32_t> permutation, std::string_view walk) {
  ColumnSchedule s;
  s.walk = walk.empty() ? WalkOrder::kDescendingHeadsInner : parse_walk_order(std::string(walk));
  if (name.empty()) {
    s.kind = ScheduleKind::kPermutation;
    s.permutation = std::move(permutation);
    return s;
  }
  for (ScheduleKind k : {ScheduleKind::kLeftToRight, ScheduleKind::kShortestFirst})
    if (name == schedule_kind_name(k)) {
      s.kind = k;
      return s;
    }
  detail::throw_arg_error("schedule", "\"auto\", \"left_to_right\", \"shortest_first\" or a permutation",
                          std::string(name));
}

inline ScheduleProblem schedule_problem(const std::vector<int64_t>& v) {
  ScheduleProblem p;
  if (v.empty()) return p;
  if (v.size() != 4)
    detail::throw_arg_error("auto_problem", "(batch, heads_q, heads_kv, workers)",
                            std::to_string(v.size()) + " values");
  p.batch = v[0], p.heads_q = v[1], p.heads_kv = v[2], p.workers = v[3];
  return p;
}

// schedule: ignored when auto_schedule (the builder chooses one for `problem`).
inline BlockMaskOptions mask_options(int64_t block_q, int64_t block_kv, bool auto_schedule, ColumnSchedule schedule,
                                     const ScheduleProblem& problem, Allocator* alloc) {
  BlockMaskOptions o;
  o.block_q = block_q;
  o.block_kv = block_kv;
  o.auto_schedule = auto_schedule;
  if (!auto_schedule) o.schedule = std::move(schedule);
  o.problem = problem;
  o.allocator = alloc;
  return o;
}

}  // namespace sparsetrain::wire

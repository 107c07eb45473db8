// How many (batch, kv head) groups one L2 section of the backward's hand-out holds
// (DqColumnHandout::section_groups in common/attention/dq_schedule_model.h; 0: one section, the plain
// column hand-out). Host and device code (the preprocessing applies the rule where only the
// device knows the walk), tested on the CPU (tests/cpp/test_bwd_sections.cpp).
//
// Why sections: the plain hand-out gives every group's column c before any group's column c + 1,
// so with many groups (B x H = 128 at S = 2048) the CTAs in flight each read another head's Q
// and dO, and L2 misses (a quarter of the consumers' stalls wait for the Q / dO pipeline).
// Handing out as many groups at a time as fill the forward's L2 budget (fwd_heads_per_section)
// ran the backward 25-41 % faster at S = 2048 / 4096, B = 8.
//
// Why the deterministic mode sometimes wants bigger sections: a section's columns start together
// and the later ones queue for the earlier ones' turns, each of the m = workers / section_groups
// columns of a group in flight waiting up to a hand-off per column ahead of it. That stays cheap
// while m is at most one column's walk length (its visits: q tiles x the group's query heads), so
// the deterministic mode takes at least workers / visits groups a section. Where only the device
// knows the walk length (document ids, bitmasks) the preprocessing averages it from the column
// lists (bwd_column_tiles) and applies the same rule there. The bound holds for the descending
// walk only, where the columns in flight run one hand-off apart (common/attention/attention_bwd_walk.h);
// walking ascending, each column reaches every tile before the column whose turn comes first, so
// the queue grows with every column in flight: the budget's sections ran 1.5-4x slower there.
// So the deterministic mode walking ascending takes the plain hand-out, except for a few long
// columns that want sections larger than the budget's anyway (bwd_ascending_section_groups: a
// landmark mask, which "auto" walks ascending); the nesting masks, whose longest column is at
// most 2x the mean walk, keep the plain hand-out.
//
// Why masks with a few long columns want bigger sections, in both modes: a section's columns go
// out in column order, so the last section's longest column starts only when the hand-out reaches
// that section, about its work / workers before the end, and a column longer than that runs on
// alone at the end (a sink or landmark column beside 1024-token windows). So a section holds at
// least workers x the longest walk / a group's work, and the last section as many
// (bwd_tail_groups).
#pragma once

#include <algorithm>
#include <cstdint>

#include "common/attention/attention_bwd_walk.h"  // MaskColumnLists
#include "common/attention/attention_fwd_walk.h"  // fwd_heads_per_section: the forward's L2 budget rule
#include "common/host_device.h"
#include "sparsetrain/mask_spec.h"

namespace sparsetrain {

// The walk lengths of a mask's kv block columns, per query head, in q tiles: what the section rule
// reads (their mean and the longest), summed column by column (add) from a spec's closed form on
// the host or from the column lists on the device.
struct BwdColumnWalks {
  int64_t columns = 0;  // columns added (x batch where the lists give them)
  int64_t tiles = 0;    // the sum of their walks
  int64_t longest = 0;

  ST_HOST_DEVICE void add(int64_t t) {
    ++columns;
    tiles += t;
    longest = t > longest ? t : longest;
  }
  ST_HOST_DEVICE bool known() const { return columns > 0 && tiles > 0; }
  ST_HOST_DEVICE double mean() const { return known() ? double(tiles) / double(columns) : 0.0; }
};

// The walks of the mask's kv block columns from a built-in spec's closed form (q tiles of `tile_q`
// rows a column visits); none (columns = 0) where the host cannot know (documents, bitmasks).
inline BwdColumnWalks bwd_column_walks(const MaskSpec& spec, int64_t seq_q, int64_t seq_kv, int64_t block_kv,
                                       int64_t tile_q) {
  BwdColumnWalks w;
  if (seq_q <= 0 || seq_kv <= 0 || block_kv <= 0 || tile_q <= 0) return w;
  switch (spec.kind) {
    case MaskKind::kFull: case MaskKind::kCausal: case MaskKind::kCausalBottomRight: case MaskKind::kPrefixLM:
    case MaskKind::kSlidingWindow: break;
    default: return w;  // documents, bitmasks: on the device
  }
  const int64_t columns = (seq_kv + block_kv - 1) / block_kv;
  for (int64_t n = 0; n < columns; ++n) {
    const int64_t x0 = n * block_kv, x1 = std::min(seq_kv, x0 + block_kv) - 1;  // the column's keys
    int64_t lo = 0, hi = seq_q - 1;  // the rows any of them sees
    switch (spec.kind) {
      case MaskKind::kCausal: lo = x0; break;
      case MaskKind::kCausalBottomRight: lo = x0 - (seq_kv - seq_q); break;
      case MaskKind::kPrefixLM: lo = x0 < spec.prefix_length ? 0 : x0; break;
      case MaskKind::kSlidingWindow:  // q - left <= kv <= q + right
        if (spec.window_right >= 0) lo = x0 - spec.window_right;
        if (spec.window_left >= 0) hi = std::min(hi, x1 + spec.window_left);
        break;
      default: break;  // full
    }
    lo = std::max<int64_t>(lo, 0);
    w.add(lo <= hi ? hi / tile_q - lo / tile_q + 1 : 0);
  }
  return w;
}

// ceil(x) for x >= 0, host and device.
ST_HOST_DEVICE inline int64_t bwd_ceil(double x) {
  const int64_t i = int64_t(x);
  return double(i) < x ? i + 1 : i;
}

// The fewest groups a section holds so that the last one's longest column does not run on alone
// (the header says why): workers x the longest walk / a group's work, where a group's work is its
// items (columns x sub-columns) x the mean walk (the query heads of a group scale both alike),
// rounded to the nearest: an estimate (even columns give workers / items, which must not grow the
// budget's sections for a fraction). 0 when the walks are unknown.
ST_HOST_DEVICE inline int64_t bwd_tail_groups(int64_t workers, const BwdColumnWalks& walks, int64_t items_per_group) {
  if (!walks.known() || items_per_group <= 0) return 0;
  return int64_t(double(workers) * double(walks.longest) / (walks.mean() * double(items_per_group)) + 0.5);
}

// `section` grown until the last section of `groups` holds at least `least` groups too (or it
// divides them); 0 when it is one section.
ST_HOST_DEVICE inline int64_t bwd_whole_last_section(int64_t groups, int64_t section, int64_t least) {
  while (section < groups && groups % section != 0 && groups % section < least) ++section;
  return section >= groups ? 0 : section;
}

// Groups a section: as many as fill l2_budget with group_bytes each (the forward's rule, at most
// kFwdMaxKvHeadsPerSection); deterministic: at least workers / walk groups, where walk = mean
// visits x query heads a group (unknown walks: the plain hand-out); and at least bwd_tail_groups,
// the last section as many (the section grows until it divides the groups or leaves that many).
// 0 when it is one section. On the host from bwd_column_walks, on the device (the preprocessing)
// from the mask's column lists where the host cannot know the walks (bwd_column_tiles).
ST_HOST_DEVICE inline int64_t bwd_section_groups(int64_t groups, int64_t group_bytes, int64_t l2_budget,
                                                 int64_t workers, const BwdColumnWalks& walks,
                                                 int64_t items_per_group, int64_t heads_per_group,
                                                 bool deterministic) {
  int64_t section = fwd_heads_per_section(group_bytes, l2_budget, 1, groups);
  if (deterministic) {
    const double walk = walks.mean() * double(heads_per_group);
    if (walk <= 0) return 0;
    const int64_t least = bwd_ceil(double(workers) / walk);
    if (least > section) section = least;
  }
  const int64_t tail = bwd_tail_groups(workers, walks, items_per_group);
  return bwd_whole_last_section(groups, section > tail ? section : tail, tail);
}

// The deterministic mode walking ascending: the plain hand-out, whose queues sections lengthen,
// unless a few long columns (the longest at least 4x the mean walk: sinks, landmarks, global
// tokens; causal has 2x, windows 1x) want sections larger than the L2 budget's anyway: then the
// tail bound's (a landmark mask's deterministic backward ran up to 12 % faster so than in the
// plain hand-out); sinks at GQA 8:1 keep the plain one.
ST_HOST_DEVICE inline int64_t bwd_ascending_section_groups(int64_t groups, int64_t group_bytes, int64_t l2_budget,
                                                           int64_t workers, const BwdColumnWalks& walks,
                                                           int64_t items_per_group) {
  const int64_t tail = bwd_tail_groups(workers, walks, items_per_group);
  if (double(walks.longest) < 4.0 * walks.mean() || tail <= fwd_heads_per_section(group_bytes, l2_budget, 1, groups))
    return 0;
  return bwd_whole_last_section(groups, tail, tail);
}

// "auto"'s section size, on the host and in the preprocessing alike: the deterministic mode walking
// ascending by bwd_ascending_section_groups, everything else by bwd_section_groups.
ST_HOST_DEVICE inline int64_t bwd_auto_section_groups(bool deterministic, bool ascending, int64_t groups,
                                                      int64_t group_bytes, int64_t l2_budget, int64_t workers,
                                                      const BwdColumnWalks& walks, int64_t items_per_group,
                                                      int64_t heads_per_group) {
  return deterministic && ascending
             ? bwd_ascending_section_groups(groups, group_bytes, l2_budget, workers, walks, items_per_group)
             : bwd_section_groups(groups, group_bytes, l2_budget, workers, walks, items_per_group, heads_per_group,
                                  deterministic);
}

// The q tiles column n of batch b visits (its first query head's walk: clamped counts x q tiles a
// block), from the mask's column lists: what bwd_column_walks gives in closed form, for the
// masks whose lists only the device holds (documents, bitmasks), summed over batch x columns by
// the preprocessing (bwd_preprocess.cuh).
ST_HOST_DEVICE inline int64_t bwd_column_tiles(const MaskColumnLists& l, int64_t b, int64_t n) {
  return int64_t(clamp_count(l.partial_count, l.partial_index, b, 0, n) +
                 clamp_count(l.full_count, l.full_index, b, 0, n)) *
         l.q_tiles_per_block;
}

}  // namespace sparsetrain

// The attention kernels' tile schedulers (src/cuda/attention/tile_scheduler.h) on the CPU: the
// persistent grid, the forward's static hand-out, and the backward's ticket -> work item mapping
// (the device-side draws are atomicAdds on a counter, exercised by the GPU tests).
#include <gtest/gtest.h>

#include <cstdint>
#include <set>
#include <tuple>

#include "cuda/attention/tile_scheduler.h"

namespace attn = sparsetrain::cuda::attn;

TEST(AttentionTileScheduler, PersistentGridIsAtMostTheSmsTheLimitAndTheItemsAndAtLeastOne) {
  EXPECT_EQ(attn::persistent_grid(1000, 132, 0), 132);
  EXPECT_EQ(attn::persistent_grid(50, 132, 0), 50);
  EXPECT_EQ(attn::persistent_grid(1000, 132, 7), 7);
  EXPECT_EQ(attn::persistent_grid(5, 132, 7), 5);
  EXPECT_EQ(attn::persistent_grid(0, 132, 0), 1);  // an empty problem still launches one CTA
  EXPECT_EQ(attn::FwdTicketScheduler::grid_shape(1000, 132, 61), 61);
  EXPECT_EQ(attn::BwdTicketScheduler::grid_shape(1000, 132, 0), 132);
}

TEST(AttentionTileScheduler, ForwardStaticHandOutCoversEveryPositionOnce) {
  attn::FwdTicketScheduler s;
  s.num_items = 23;
  const int32_t grid = 5;
  std::multiset<int32_t> seen;
  for (int32_t cta = 0; cta < grid; ++cta)
    for (int32_t i = s.initial_work(cta); s.valid(i); i = s.next_static(i, grid)) seen.insert(i);
  ASSERT_EQ(seen.size(), 23u);
  for (int32_t i = 0; i < 23; ++i) EXPECT_EQ(seen.count(i), 1u) << i;
}

TEST(AttentionTileScheduler, BackwardTicketsMapToTheHandOutsItemsAndEndAtItsCount) {
  // The kernel's int32 index math (item_in<int32_t>) gives the model's int64 items.
  for (const int64_t sections : {int64_t(0), int64_t(4), int64_t(5)})
    for (const auto kind : {sparsetrain::ScheduleKind::kLeftToRight, sparsetrain::ScheduleKind::kShortestFirst}) {
      attn::BwdTicketScheduler s;
      s.handout.batch = 2, s.handout.kv_heads = 3, s.handout.num_columns = 5, s.handout.sub_tiles = 2;
      s.handout.section_groups = sections;  // 4: a short last section
      s.handout.kind = kind;
      const int64_t n = s.handout.num_items();
      ASSERT_EQ(n, 2 * 3 * 5 * 2);
      std::set<std::tuple<int64_t, int64_t, int64_t, int64_t>> items;
      for (int32_t t = 0; t < n; ++t) {
        ASSERT_TRUE(s.valid(t)) << t;
        const sparsetrain::DqWorkItem w = s.item(t), h = s.handout.item(t);
        EXPECT_EQ(std::tie(w.batch, w.kv_head, w.column, w.sub_tile), std::tie(h.batch, h.kv_head, h.column, h.sub_tile))
            << "sections " << sections << " ticket " << t;
        items.insert({w.batch, w.kv_head, w.column, w.sub_tile});
      }
      EXPECT_EQ(int64_t(items.size()), n);  // every (batch, kv head, column, sub-column) once
      EXPECT_FALSE(s.valid(int32_t(n)));    // the first ticket past the end stops every role
    }
}

TEST(AttentionTileScheduler, SectionsDecidedOnTheDeviceReachTheRolesAsPlainPositions) {
  // A draw under device-decided sections (BwdTicketScheduler::drawn) maps ticket t to the position
  // of the one-section hand-out whose item is the sectioned hand-out's item t: every role then
  // reads the same item with section_groups = 0. A bijection of [0, n); past n, tickets stay.
  for (const int32_t sections : {0, 1, 2, 4, 5, 6, 7})
    for (const int64_t sub : {int64_t(1), int64_t(2)}) {
      attn::BwdTicketScheduler plain, sectioned;
      for (auto* s : {&plain, &sectioned}) {
        s->handout.batch = 2, s->handout.kv_heads = 3, s->handout.num_columns = 5, s->handout.sub_tiles = sub;
        s->handout.kind = sparsetrain::ScheduleKind::kLeftToRight;
      }
      sectioned.handout.section_groups = sections;
      const int32_t n = int32_t(plain.handout.num_items());
      std::set<int32_t> positions;
      for (int32_t t = 0; t < n; ++t) {
        const int32_t p = plain.drawn(t, sections);
        ASSERT_TRUE(plain.valid(p)) << t;
        positions.insert(p);
        const sparsetrain::DqWorkItem want = sectioned.item(t), got = plain.item(p);
        EXPECT_EQ(std::tie(got.batch, got.kv_head, got.column, got.sub_tile),
                  std::tie(want.batch, want.kv_head, want.column, want.sub_tile))
            << "sections " << sections << " sub " << sub << " ticket " << t;
      }
      EXPECT_EQ(int32_t(positions.size()), n);
      for (int32_t t = n; t < n + 3; ++t) EXPECT_EQ(plain.drawn(t, sections), t);
    }
}

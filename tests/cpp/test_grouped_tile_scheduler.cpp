// The row-tile scheduler of the grouped GEMMs: every row < S is covered exactly once, by a tile
// inside its own group, and the shape-only grid bound holds for any splits.
#include <gtest/gtest.h>

#include <numeric>
#include <random>
#include <vector>

#include "common/group_offsets.h"
#include "common/grouped_tile_scheduler.h"

namespace st = sparsetrain;

TEST(GroupedTileScheduler, CoversEveryRowOnceWithinItsGroupForRandomSplits) {
  std::mt19937_64 rng(7);
  for (int trial = 0; trial < 2000; ++trial) {
    const int64_t G = 1 + int64_t(rng() % 130), T = int64_t(rng() % 3000), tile_m = int64_t(1) << (rng() % 8);
    std::vector<int64_t> splits(size_t(G), 0);
    int64_t S = T - int64_t(rng() % (T + 1)) / 4;
    for (int64_t r = 0; r < S; ++r) splits[size_t(rng() % uint64_t(G))]++;
    if (rng() % 3 == 0) splits[0] += S - std::accumulate(splits.begin(), splits.end(), int64_t(0));
    std::vector<int64_t> off(size_t(G + 1));
    ASSERT_EQ(st::compute_group_offsets(splits.data(), G, T, off.data(), nullptr), st::kSplitsOk);
    std::vector<int> seen(size_t(T), 0);
    const int64_t bound = st::max_row_tiles(T, G, tile_m);
    int64_t used = 0;
    for (int64_t t = 0; t < bound; ++t) {
      const st::RowTile rt = st::map_row_tile(off.data(), G, tile_m, t);
      if (rt.group < 0) continue;
      ++used;
      ASSERT_LT(rt.row_begin, rt.row_end);
      ASSERT_LE(rt.row_end - rt.row_begin, tile_m);
      ASSERT_GE(rt.row_begin, off[size_t(rt.group)]);
      ASSERT_LE(rt.row_end, off[size_t(rt.group + 1)]);
      for (int64_t r = rt.row_begin; r < rt.row_end; ++r) seen[size_t(r)]++;
    }
    for (int64_t r = 0; r < T; ++r) ASSERT_EQ(seen[size_t(r)], r < off[size_t(G)] ? 1 : 0) << "row " << r;
    EXPECT_EQ(st::map_row_tile(off.data(), G, tile_m, used).group, -1) << "tiles past the last are empty";
  }
}

// The backward preprocessing's split of the padded q rows (common/attention/bwd_preprocess_tiling.h): every
// (batch, query head, padded row) taken by exactly one lane group's row, for each of the kernel's
// three forms, any head count and several batches, with the grid the launch computes.
#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <vector>

#include "common/attention/bwd_preprocess_tiling.h"

namespace st = sparsetrain;

namespace {

template <class Tiling>
void check_cover(int64_t batch, int64_t heads_q, int64_t rows) {
  SCOPED_TRACE("lanes " + std::to_string(Tiling::kLanes) + " batch " + std::to_string(batch) + " heads " +
               std::to_string(heads_q) + " rows " + std::to_string(rows));
  const int heads_log2 = Tiling::heads_log2_for(heads_q);
  ASSERT_LE(int64_t(1) << heads_log2, heads_q);
  ASSERT_TRUE(heads_log2 == Tiling::kMaxHeadsLog2 || (int64_t(2) << heads_log2) > heads_q) << "the most heads";
  int64_t grid[3];
  Tiling::grid(rows, heads_q, batch, heads_log2, grid);
  std::vector<int> hits(size_t(batch * heads_q * rows), 0);
  int64_t idle = 0;
  for (int64_t z = 0; z < grid[2]; ++z)
    for (int64_t b = z; b < batch; b += grid[2])  // the kernel's batch loop
      for (int64_t y = 0; y < grid[1]; ++y)
        for (int64_t x = 0; x < grid[0]; ++x)
          for (int g = 0; g < Tiling::kGroups; ++g) {
            const auto r = Tiling::rows_of(uint32_t(x), uint32_t(y), g, heads_log2);
            if (r.head >= heads_q) {
              ++idle;
              continue;
            }
            ASSERT_GE(r.head, 0);
            for (int i = 0; i < Tiling::kRows; ++i) {
              const int64_t q = r.q0 + i;
              ASSERT_TRUE(q >= 0 && q < rows) << "head " << r.head << " row " << q;
              ++hits[size_t((b * heads_q + r.head) * rows + q)];
            }
          }
  for (size_t i = 0; i < hits.size(); ++i) ASSERT_EQ(hits[i], 1) << "row " << i;
  // Idle groups only for the heads past the last of the last head tile.
  EXPECT_EQ(idle, batch * grid[0] * (grid[1] * (int64_t(1) << heads_log2) - heads_q) *
                      (Tiling::kGroups >> heads_log2));
}

template <class Tiling>
void check_all() {
  for (const int64_t batch : {1, 3})
    for (const int64_t heads : {1, 2, 3, 5, 8, 12, 16, 40})
      for (const int64_t rows : {64, 128, 320}) check_cover<Tiling>(batch, heads, rows);
}

}  // namespace

TEST(BwdPreprocessTiling, EveryRowOnceVector16) { check_all<st::BwdPreprocessTiling<16, true>>(); }
TEST(BwdPreprocessTiling, EveryRowOnceVector8) { check_all<st::BwdPreprocessTiling<8, true>>(); }
TEST(BwdPreprocessTiling, EveryRowOnceScalar) { check_all<st::BwdPreprocessTiling<32, false>>(); }

TEST(BwdPreprocessTiling, ByHand) {
  using T = st::BwdPreprocessTiling<16, true>;  // 16 groups of 2 rows
  EXPECT_EQ(T::heads_log2_for(1), 0);
  EXPECT_EQ(T::heads_log2_for(3), 1);
  EXPECT_EQ(T::heads_log2_for(12), 3);
  EXPECT_EQ(T::tile_rows(3), 4);  // 8 heads x 4 rows
  // Block (2, 1) with 8 heads a tile: group 13 is head 8 + 5, rows 2 * 4 + 1 * 2.
  const auto r = T::rows_of(2, 1, 13, 3);
  EXPECT_EQ(r.head, 13);
  EXPECT_EQ(r.q0, 10);
  int64_t g[3];
  T::grid(128, 12, 70000, 3, g);
  EXPECT_EQ(g[0], 32);
  EXPECT_EQ(g[1], 2);
  EXPECT_EQ(g[2], 65535);  // the kernel steps through the rest
  EXPECT_TRUE(T::tiles_divide(64));
  EXPECT_FALSE(T::tiles_divide(48));
}

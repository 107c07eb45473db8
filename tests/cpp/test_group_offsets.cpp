// Splits -> group offsets (the set-up step shared by both backends), including the invalid-splits
// rule: every group empty, sticky status bits.
#include <gtest/gtest.h>

#include <random>
#include <vector>

#include "common/group_offsets.h"

namespace st = sparsetrain;

TEST(GroupOffsets, PrefixSumsWithEmptyGroupsAndATail) {
  const std::vector<int64_t> splits = {3, 0, 5, 0};
  std::vector<int64_t> off(5, -1);
  int32_t status = 0;
  EXPECT_EQ(st::compute_group_offsets(splits.data(), 4, 10, off.data(), &status), st::kSplitsOk);
  EXPECT_EQ(off, (std::vector<int64_t>{0, 3, 3, 8, 8}));
  EXPECT_EQ(status, 0);
}

TEST(GroupOffsets, NegativeEntryEmptiesEveryGroupAndSetsABit) {
  const std::vector<int64_t> splits = {3, -1, 2};
  std::vector<int64_t> off(4, -1);
  int32_t status = 0;
  EXPECT_EQ(st::compute_group_offsets(splits.data(), 3, 10, off.data(), &status), st::kSplitsNegative);
  EXPECT_EQ(off, (std::vector<int64_t>{0, 0, 0, 0}));
  EXPECT_EQ(status, st::kSplitsNegative);
}

TEST(GroupOffsets, SumAboveRowsIsStickyAcrossCalls) {
  const std::vector<int64_t> bad = {6, 5}, good = {1, 2};
  std::vector<int64_t> off(3, -1);
  int32_t status = 0;
  EXPECT_EQ(st::compute_group_offsets(bad.data(), 2, 10, off.data(), &status), st::kSplitsSumExceedsRows);
  EXPECT_EQ(off, (std::vector<int64_t>{0, 0, 0}));
  EXPECT_EQ(st::compute_group_offsets(good.data(), 2, 10, off.data(), &status), st::kSplitsOk);
  EXPECT_EQ(off, (std::vector<int64_t>{0, 1, 3}));
  EXPECT_EQ(status, st::kSplitsSumExceedsRows) << "the status word is never cleared";
}

TEST(GroupOffsets, HugeEntriesCannotOverflowTheSum) {
  const std::vector<int64_t> splits = {INT64_MAX, INT64_MAX};
  std::vector<int64_t> off(3, -1);
  EXPECT_EQ(st::compute_group_offsets(splits.data(), 2, 100, off.data(), nullptr), st::kSplitsSumExceedsRows);
  EXPECT_EQ(off, (std::vector<int64_t>{0, 0, 0}));
}

TEST(GroupOffsets, SumEqualToRowsIsValid) {
  const std::vector<int64_t> splits = {4, 6};
  std::vector<int64_t> off(3);
  EXPECT_EQ(st::compute_group_offsets(splits.data(), 2, 10, off.data(), nullptr), st::kSplitsOk);
  EXPECT_EQ(off.back(), 10);
}

TEST(GroupOffsets, GroupOfRowSkipsEmptyGroups) {
  // Splits {0, 3, 0, 0, 2, 1, 0}: rows 0-2 -> group 1, 3-4 -> group 4, 5 -> group 5.
  const int64_t splits[] = {0, 3, 0, 0, 2, 1, 0};
  int64_t offsets[8];
  ASSERT_EQ(st::compute_group_offsets(splits, 7, 6, offsets, nullptr), st::kSplitsOk);
  const int64_t expected[] = {1, 1, 1, 4, 4, 5};
  for (int64_t t = 0; t < 6; ++t) EXPECT_EQ(st::group_of_row(offsets, 7, t), expected[t]) << "row " << t;
  // Against a linear scan over random splits.
  std::mt19937 rng(1);
  for (int trial = 0; trial < 200; ++trial) {
    const int64_t G = 1 + int64_t(rng() % 40);
    std::vector<int64_t> s(static_cast<size_t>(G)), off(static_cast<size_t>(G + 1));
    int64_t T = 0;
    for (auto& v : s) T += (v = rng() % 3 == 0 ? 0 : int64_t(rng() % 5));
    st::compute_group_offsets(s.data(), G, T, off.data(), nullptr);
    for (int64_t t = 0; t < T; ++t) {
      int64_t g = 0;
      while (!(off[size_t(g)] <= t && t < off[size_t(g + 1)])) ++g;
      ASSERT_EQ(st::group_of_row(off.data(), G, t), g);
    }
  }
}

// Splits -> group offsets (the set-up step shared by both backends), including the invalid-splits
// rule: every group empty, sticky status bits.
#include <gtest/gtest.h>

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

// Splits -> group offsets (the set-up step shared by both backends), including the invalid-splits
// rule: every group empty, sticky status bits.
#include <gtest/gtest.h>

#include <algorithm>
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

// The word is ORed into, never assigned: a bit already set (the caller's own, or an earlier call's)
// stays, and two kinds of invalid splits in two calls leave both bits. Random splits each run: one
// call with a negative entry (sum within the rows), one whose sum exceeds them (no negative entry).
TEST(GroupOffsets, StatusBitsOfTwoCallsAndAPresetBitAreAllORed) {
  std::mt19937_64 rng(20261201);
  for (int trial = 0; trial < 100; ++trial) {
    const int64_t G = 2 + int64_t(rng() % 30), R = 1 + int64_t(rng() % 1000);
    std::vector<int64_t> negative(size_t(G), 0), too_many(size_t(G), 0);
    negative[rng() % size_t(G)] = -1 - int64_t(rng() % 1000);
    for (int64_t left = R + 1 + int64_t(rng() % 100); left > 0;) {  // sum R + 1 .. R + 100
      const int64_t take = std::min<int64_t>(left, 1 + int64_t(rng() % uint64_t(R + 1)));
      too_many[rng() % size_t(G)] += take;
      left -= take;
    }
    const int32_t preset = int32_t(1) << (8 + rng() % 20);  // a bit outside SplitsStatus
    int32_t status = preset;
    std::vector<int64_t> off(size_t(G + 1), -1);
    const bool negative_first = rng() % 2 == 0;
    const std::vector<int64_t>& first = negative_first ? negative : too_many;
    const std::vector<int64_t>& second = negative_first ? too_many : negative;
    const int32_t first_bit = negative_first ? st::kSplitsNegative : st::kSplitsSumExceedsRows;
    const int32_t second_bit = negative_first ? st::kSplitsSumExceedsRows : st::kSplitsNegative;
    ASSERT_EQ(st::compute_group_offsets(first.data(), G, R, off.data(), &status), first_bit);
    ASSERT_EQ(status, preset | first_bit) << "trial " << trial << ": the preset bit kept, the first kind ORed in";
    ASSERT_EQ(st::compute_group_offsets(second.data(), G, R, off.data(), &status), second_bit);
    ASSERT_EQ(status, preset | st::kSplitsNegative | st::kSplitsSumExceedsRows)
        << "trial " << trial << ": both kinds and the preset bit";
    ASSERT_EQ(off, std::vector<int64_t>(size_t(G + 1), 0));
  }
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

// The CUDA set-up kernel's fast path: splits_valid (entries in range, sum within the rows) must say
// "valid" exactly when the rule does, and then the offsets are the plain prefix sums (what its scan
// writes). Random splits around the edges: sums just below, at and above the rows, negative and
// huge entries.
TEST(GroupOffsets, SplitsValidIsExactlyTheRulesOkAndItsOffsetsArePrefixSums) {
  std::mt19937_64 rng(20261126);
  int valid = 0, invalid = 0;
  for (int trial = 0; trial < 20000; ++trial) {
    const int64_t G = 1 + int64_t(rng() % 600), R = int64_t(rng() % 5000);
    std::vector<int64_t> splits(static_cast<size_t>(G));
    const int64_t mean = R / G + 1;
    for (int64_t& s : splits) s = int64_t(rng() % uint64_t(2 * mean));  // sums around R
    switch (rng() % 6) {
      case 0: splits[rng() % size_t(G)] = -1 - int64_t(rng() % 3); break;
      case 1: splits[rng() % size_t(G)] = INT64_MAX - int64_t(rng() % 3); break;
      case 2: splits[rng() % size_t(G)] = R + 1; break;
      default: break;
    }
    std::vector<int64_t> off(static_cast<size_t>(G + 1), -7);
    const bool ok = st::compute_group_offsets(splits.data(), G, R, off.data(), nullptr) == st::kSplitsOk;
    ASSERT_EQ(st::splits_valid(splits.data(), G, R), ok) << "trial " << trial << " G " << G << " R " << R;
    (ok ? valid : invalid)++;
    if (!ok) continue;
    int64_t sum = 0;
    for (int64_t g = 0; g < G; ++g) {
      ASSERT_EQ(off[size_t(g)], sum);
      sum += splits[size_t(g)];
    }
    ASSERT_EQ(off[size_t(G)], sum);
  }
  EXPECT_GT(valid, 2000);  // both sides of the rule drawn often
  EXPECT_GT(invalid, 2000);
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

// The backward hand-out's L2 section size (src/common/attention/bwd_sections.h) on the CPU: the walks of the
// block columns against a brute-force count over the element mask, and the section rule's cases.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <random>
#include <string>

#include "common/attention/bwd_sections.h"
#include "common/attention/mask_predicate.h"
#include "ops/block_mask_internal.h"
#include "sparsetrain/block_mask.h"

namespace st = sparsetrain;

namespace {

// The oracle: per column, the q tiles holding at least one allowed (q, kv) pair, by mask_allows.
st::BwdColumnWalks brute_walks(const st::MaskSpec& s, int64_t sq, int64_t skv, int64_t block_kv, int64_t tile_q) {
  st::BwdColumnWalks w;
  const int64_t columns = (skv + block_kv - 1) / block_kv;
  for (int64_t n = 0; n < columns; ++n) {
    int64_t tiles = 0;
    for (int64_t t = 0; t * tile_q < sq; ++t) {
      bool any = false;
      for (int64_t q = t * tile_q; q < std::min(sq, (t + 1) * tile_q) && !any; ++q)
        for (int64_t kv = n * block_kv; kv < std::min(skv, (n + 1) * block_kv) && !any; ++kv)
          any = st::mask_allows(s.kind, s.window_left, s.window_right, s.prefix_length, nullptr, nullptr, sq, skv, q, kv);
      tiles += any;
    }
    w.add(tiles);
  }
  return w;
}

// `columns` columns of `t` tiles each, then `long_columns` of `long_t`.
st::BwdColumnWalks walks_of(int64_t columns, int64_t t, int64_t long_columns = 0, int64_t long_t = 0) {
  st::BwdColumnWalks w;
  for (int64_t i = 0; i < columns; ++i) w.add(t);
  for (int64_t i = 0; i < long_columns; ++i) w.add(long_t);
  return w;
}

void expect_same_walks(const st::BwdColumnWalks& a, const st::BwdColumnWalks& b) {
  EXPECT_EQ(a.columns, b.columns);
  EXPECT_EQ(a.tiles, b.tiles);
  EXPECT_EQ(a.longest, b.longest);
}

}  // namespace

TEST(BwdSections, ColumnWalksMatchTheElementMaskOnRandomSpecsAndSizes) {
  std::mt19937 rng(20261125);
  const st::MaskKind kinds[] = {st::MaskKind::kFull, st::MaskKind::kCausal, st::MaskKind::kCausalBottomRight,
                                st::MaskKind::kSlidingWindow, st::MaskKind::kPrefixLM};
  for (int trial = 0; trial < 300; ++trial) {
    st::MaskSpec s;
    s.kind = kinds[rng() % 5];
    const int64_t sq = 1 + rng() % 700, skv = 1 + rng() % 700;
    const int64_t block_kv = int64_t(16) << (rng() % 4), tile_q = int64_t(8) << (rng() % 4);
    s.window_left = int64_t(rng() % 300) - 40;  // some negative: unbounded
    s.window_right = int64_t(rng() % 120) - 30;
    s.prefix_length = rng() % 400;
    SCOPED_TRACE(s.str() + " sq " + std::to_string(sq) + " skv " + std::to_string(skv) + " block_kv " +
                 std::to_string(block_kv) + " tile_q " + std::to_string(tile_q));
    expect_same_walks(st::bwd_column_walks(s, sq, skv, block_kv, tile_q), brute_walks(s, sq, skv, block_kv, tile_q));
  }
}

TEST(BwdSections, ColumnWalksAreUnknownForDocumentsAndBitmasks) {
  for (st::MaskKind k : {st::MaskKind::kDocument, st::MaskKind::kDocumentCausal, st::MaskKind::kBitmask}) {
    st::MaskSpec s;
    s.kind = k;
    EXPECT_FALSE(st::bwd_column_walks(s, 4096, 4096, 128, 64).known()) << st::mask_kind_name(k);
  }
  st::MaskSpec causal;
  causal.kind = st::MaskKind::kCausal;
  EXPECT_FALSE(st::bwd_column_walks(causal, 0, 4096, 128, 64).known());  // nothing to walk
  const st::BwdColumnWalks w = st::bwd_column_walks(causal, 8192, 8192, 128, 64);
  EXPECT_DOUBLE_EQ(w.mean(), 65.0);  // (128 + 2) / 2 by hand
  EXPECT_EQ(w.longest, 128);
}

TEST(BwdSections, SectionsFillTheL2BudgetAndTheDeterministicModeKeepsAWalkPerColumnInFlight) {
  const int64_t mb = int64_t(1) << 20, budget = 32 * mb, workers = 132;
  // Even columns (a window's): the tail bound, workers / items, stays below the others.
  const auto even = [](double t) { return walks_of(64, int64_t(t)); };
  // Atomic mode: as many groups as fill the budget, at most the forward's cap; all of them: 0.
  EXPECT_EQ(st::bwd_section_groups(128, 1 * mb, budget, workers, even(16), 64, 1, false), st::kFwdMaxKvHeadsPerSection);
  EXPECT_EQ(st::bwd_section_groups(32, 4 * mb, budget, workers, even(64), 64, 1, false), 8);
  EXPECT_EQ(st::bwd_section_groups(8, 64 * mb, budget, workers, even(64), 128, 8, false), 1);  // a group over budget: 1
  EXPECT_EQ(st::bwd_section_groups(8, 4 * mb, budget, workers, even(64), 64, 1, false), 0);   // all fit: one section
  EXPECT_EQ(st::bwd_section_groups(32, 8 * mb, budget, workers, {}, 64, 1, false), 4);        // walks unknown: budget
  // Deterministic: at least workers / walk groups (walk 64: 3 < budget's 8).
  EXPECT_EQ(st::bwd_section_groups(32, 4 * mb, budget, workers, even(64), 64, 1, true), 8);
  EXPECT_EQ(st::bwd_section_groups(64, 4 * mb, budget, workers, even(10), 64, 1, true), 14);  // ceil(132 / 10)
  EXPECT_EQ(st::bwd_section_groups(64, 4 * mb, budget, workers, walks_of(64, 5, 64, 0), 128, 4, true),
            14);  // the group's heads walk too (mean 2.5 x 4 heads)
  EXPECT_EQ(st::bwd_section_groups(32, 4 * mb, budget, workers, even(4), 64, 1, true), 0);   // 33 >= 32 groups
  EXPECT_EQ(st::bwd_section_groups(32, 8 * mb, budget, workers, {}, 64, 1, true), 0);        // unknown: plain hand-out
  EXPECT_EQ(st::bwd_section_groups(8, 64 * mb, budget, workers, even(65), 128, 8, true), 1);  // GQA 8:1 walks 520
}

namespace {

// A mask's column walks as the preprocessing sums them (bwd_column_tiles over its column lists),
// over `batches` batches (a mask built for B = 1 reads its lists for every batch).
st::BwdColumnWalks walks_from_lists(const st::BlockMask& m, int64_t tile_q, int64_t batches = 1) {
  st::MaskColumnLists l;
  l.partial_count = st::mask_index_view(m.q_num_blocks);
  l.partial_index = st::mask_index_view(m.q_indices);
  l.full_count = st::mask_index_view(m.full_q_num_blocks);
  l.full_index = st::mask_index_view(m.full_q_indices);
  l.q_tiles_per_block = int32_t(m.block_q / tile_q);
  st::BwdColumnWalks w;
  for (int64_t b = 0; b < batches; ++b)
    for (int64_t n = 0; n < m.num_kv_blocks(); ++n) w.add(st::bwd_column_tiles(l, b, n));
  return w;
}

// Causal 1024-token windows, plus the first 64 keys (sinks) or the first 64 of every 1024
// (landmarks), as a FlexAttention user's mask_mod gives them (bitmasks).
bool sinks_window(void*, int64_t, int64_t, int64_t q, int64_t kv) { return kv <= q && (q - kv <= 1024 || kv < 64); }
bool landmarks_window(void*, int64_t, int64_t, int64_t q, int64_t kv) {
  return kv <= q && (q - kv <= 1024 || kv % 1024 < 64);
}

}  // namespace

TEST(BwdSections, AFewLongColumnsGetSectionsLongEnoughForThemAndAWholeLastSection) {
  const int64_t mb = int64_t(1) << 20, budget = 32 * mb, workers = 132;
  // S = 8192 (64 columns, 64-row q tiles), B = 2, H = 16: 32 groups of 4 MB, the budget's 8 a
  // section. Sinks: one column of 128 tiles, the rest up to 18; the tail bound 132 x 128 / (64 x
  // 18.6) = 14.2, then 16, since a last section of 4 would leave the sink column alone at the end:
  // 16 ran the atomic backward 18-26 % faster than 8 (H100, H200).
  const st::BwdColumnWalks sinks = walks_from_lists(
      st::build_block_mask_from_function(sinks_window, nullptr, 1, 1, 8192, 8192, {}).mask, 64);
  EXPECT_EQ(sinks.longest, 128);
  EXPECT_EQ(st::bwd_tail_groups(workers, sinks, 64), 14);
  for (bool det : {false, true}) EXPECT_EQ(st::bwd_section_groups(32, 4 * mb, budget, workers, sinks, 64, 1, det), 16);
  // At GQA 8:1 (8 groups of 32 MB: the budget's 1) the bound exceeds the groups: one section (the
  // atomic backward 20-24 % faster than one-group sections).
  EXPECT_EQ(st::bwd_section_groups(8, 32 * mb, budget, workers, sinks, 64, 8, false), 0);
  // Landmarks: 8 long columns of 128, 112, ..., 16 tiles: 11.2, then 16; 12 (12, 12, 8) ran as
  // slowly as 8 and 16 12 % faster (H100), 11 (11, 11, 10) 7 % slower than 16 (H200, atomic).
  const st::BwdColumnWalks landmarks = walks_from_lists(
      st::build_block_mask_from_function(landmarks_window, nullptr, 1, 1, 8192, 8192, {}).mask, 64);
  EXPECT_EQ(st::bwd_tail_groups(workers, landmarks, 64), 11);
  EXPECT_EQ(st::bwd_section_groups(32, 4 * mb, budget, workers, landmarks, 64, 1, false), 16);
  // Causal: 132 x 128 / (64 x 65) = 4.1, 4; with GQA 8:1 at D = 64 (16 MB groups: the budget's
  // 2) 4 (2-3 % faster than 2 in the deterministic mode, 1-2 % in the atomic one, H100, H200); at
  // 32 groups the budget's 8 stands.
  st::MaskSpec causal_spec;
  causal_spec.kind = st::MaskKind::kCausal;
  const st::BwdColumnWalks causal = st::bwd_column_walks(causal_spec, 8192, 8192, 128, 64);
  EXPECT_EQ(st::bwd_tail_groups(workers, causal, 64), 4);
  EXPECT_EQ(st::bwd_section_groups(8, 16 * mb, budget, workers, causal, 64, 8, false), 4);
  EXPECT_EQ(st::bwd_section_groups(32, 4 * mb, budget, workers, causal, 64, 1, false), 8);
  // Even columns: workers / items (2.06 at 64 items, 1.03 at 128).
  EXPECT_EQ(st::bwd_tail_groups(workers, walks_of(64, 18), 64), 2);
  EXPECT_EQ(st::bwd_tail_groups(workers, walks_of(128, 18), 128), 1);
  // Sub-columns share a group's work: twice the items, half the bound (7.1).
  EXPECT_EQ(st::bwd_tail_groups(workers, sinks, 128), 7);
  // The last section holds the bound too: 30 groups at least 14 a section take 15 (two of 15).
  EXPECT_EQ(st::bwd_section_groups(30, 64 * mb, budget, workers, sinks, 64, 1, false), 15);
  // Nothing known, or nothing to walk: no bound.
  EXPECT_EQ(st::bwd_tail_groups(workers, {}, 64), 0);
  EXPECT_EQ(st::bwd_tail_groups(workers, walks_of(64, 0), 64), 0);
}

TEST(BwdSections, TheDeterministicAscendingWalkTakesSectionsOnlyForAFewLongColumns) {
  const int64_t mb = int64_t(1) << 20, budget = 32 * mb, workers = 132;
  const st::BwdColumnWalks landmarks = walks_from_lists(
      st::build_block_mask_from_function(landmarks_window, nullptr, 1, 1, 8192, 8192, {}).mask, 64);
  EXPECT_EQ(st::bwd_ascending_section_groups(32, 4 * mb, budget, workers, landmarks, 64), 16);
  // Sinks at GQA 8:1: more than the groups; causal and windows: the plain hand-out.
  const st::BwdColumnWalks sinks = walks_from_lists(
      st::build_block_mask_from_function(sinks_window, nullptr, 1, 1, 8192, 8192, {}).mask, 64);
  EXPECT_EQ(st::bwd_ascending_section_groups(8, 32 * mb, budget, workers, sinks, 64), 0);
  st::MaskSpec causal;
  causal.kind = st::MaskKind::kCausal;
  EXPECT_EQ(st::bwd_ascending_section_groups(8, 16 * mb, budget, workers, st::bwd_column_walks(causal, 8192, 8192, 128, 64),
                                             64),
            0);
  EXPECT_EQ(st::bwd_ascending_section_groups(32, 4 * mb, budget, workers, walks_of(64, 18), 64), 0);
  // A long column that the budget's sections hold already (132 x 45 / (128 x 10.3) = 4.5 < 8): plain.
  EXPECT_EQ(st::bwd_ascending_section_groups(32, 4 * mb, budget, workers, walks_of(127, 10, 1, 45), 128), 0);
  EXPECT_EQ(st::bwd_ascending_section_groups(32, 4 * mb, budget, workers, {}, 64), 0);
}

TEST(BwdSections, ColumnTilesFromTheListsSumToTheClosedForm) {
  // What the preprocessing sums on the device where the host cannot know the walks (documents,
  // bitmasks): per (batch, column) the column lists' blocks x q tiles a block. On masks built on
  // the host from specs with a closed form, its walks over batch x columns are the closed form's
  // (sequences of whole blocks, where a block's q tiles are all real), at 64- and 128-row tiles.
  struct Case {
    st::MaskKind kind;
    int64_t seq, window, prefix;
  };
  for (const Case c : {Case{st::MaskKind::kCausal, 2048, 0, 0}, Case{st::MaskKind::kSlidingWindow, 4096, 1000, 0},
                       Case{st::MaskKind::kPrefixLM, 2048, 0, 512}, Case{st::MaskKind::kFull, 1024, 0, 0}})
    for (const int64_t tile_q : {int64_t(64), int64_t(128)}) {
      st::MaskSpec spec;
      spec.kind = c.kind;
      spec.window_left = c.kind == st::MaskKind::kSlidingWindow ? c.window : -1;
      spec.window_right = c.kind == st::MaskKind::kSlidingWindow ? 0 : -1;
      spec.prefix_length = c.prefix;
      const st::BlockMaskTensors built = st::build_block_mask(spec, c.seq, c.seq);  // B = 1, read as 3
      const st::BlockMask& m = built.mask;
      const st::BwdColumnWalks lists = walks_from_lists(m, tile_q, 3);
      st::BwdColumnWalks closed;
      for (int64_t b = 0; b < 3; ++b) {
        const st::BwdColumnWalks one = st::bwd_column_walks(spec, c.seq, c.seq, m.block_kv, tile_q);
        closed.columns += one.columns, closed.tiles += one.tiles;
        closed.longest = std::max(closed.longest, one.longest);
      }
      SCOPED_TRACE(spec.str() + " tile_q " + std::to_string(tile_q));
      expect_same_walks(lists, closed);
    }
}

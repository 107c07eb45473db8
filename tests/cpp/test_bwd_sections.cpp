// The backward hand-out's L2 section size (src/common/bwd_sections.h) on the CPU: the mean walk of
// a block column against a brute-force count over the element mask, and the section rule's cases.
#include <gtest/gtest.h>

#include <cstdint>
#include <random>

#include "common/bwd_sections.h"
#include "common/mask_predicate.h"
#include "ops/block_mask_internal.h"
#include "sparsetrain/block_mask.h"

namespace st = sparsetrain;

namespace {

// The oracle: q tiles holding at least one allowed (q, kv) pair of the column, by mask_allows.
double brute_mean_visits(const st::MaskSpec& s, int64_t sq, int64_t skv, int64_t block_kv, int64_t tile_q) {
  const int64_t columns = (skv + block_kv - 1) / block_kv;
  int64_t tiles = 0;
  for (int64_t n = 0; n < columns; ++n)
    for (int64_t t = 0; t * tile_q < sq; ++t) {
      bool any = false;
      for (int64_t q = t * tile_q; q < std::min(sq, (t + 1) * tile_q) && !any; ++q)
        for (int64_t kv = n * block_kv; kv < std::min(skv, (n + 1) * block_kv) && !any; ++kv)
          any = st::mask_allows(s.kind, s.window_left, s.window_right, s.prefix_length, nullptr, nullptr, sq, skv, q, kv);
      tiles += any;
    }
  return double(tiles) / double(columns);
}

}  // namespace

TEST(BwdSections, MeanColumnVisitsMatchTheElementMaskOnRandomSpecsAndSizes) {
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
    EXPECT_DOUBLE_EQ(st::bwd_mean_column_visits(s, sq, skv, block_kv, tile_q),
                     brute_mean_visits(s, sq, skv, block_kv, tile_q))
        << s.str() << " sq " << sq << " skv " << skv << " block_kv " << block_kv << " tile_q " << tile_q;
  }
}

TEST(BwdSections, MeanColumnVisitsAreUnknownForDocumentsAndBitmasks) {
  for (st::MaskKind k : {st::MaskKind::kDocument, st::MaskKind::kDocumentCausal, st::MaskKind::kBitmask}) {
    st::MaskSpec s;
    s.kind = k;
    EXPECT_EQ(st::bwd_mean_column_visits(s, 4096, 4096, 128, 64), 0.0) << st::mask_kind_name(k);
  }
  st::MaskSpec causal;
  causal.kind = st::MaskKind::kCausal;
  EXPECT_EQ(st::bwd_mean_column_visits(causal, 0, 4096, 128, 64), 0.0);  // nothing to walk
  EXPECT_DOUBLE_EQ(st::bwd_mean_column_visits(causal, 8192, 8192, 128, 64), 65.0);  // (128 + 2) / 2 by hand
}

TEST(BwdSections, SectionsFillTheL2BudgetAndTheDeterministicModeKeepsAWalkPerColumnInFlight) {
  const int64_t mb = int64_t(1) << 20, budget = 32 * mb, workers = 132;
  // Atomic mode: as many groups as fill the budget, at most the forward's cap; all of them: 0.
  EXPECT_EQ(st::bwd_section_groups(128, 1 * mb, budget, workers, 16.0, 1, false), st::kFwdMaxKvHeadsPerSection);
  EXPECT_EQ(st::bwd_section_groups(32, 4 * mb, budget, workers, 65.0, 1, false), 8);
  EXPECT_EQ(st::bwd_section_groups(8, 64 * mb, budget, workers, 65.0, 8, false), 1);  // a group over budget: 1
  EXPECT_EQ(st::bwd_section_groups(8, 4 * mb, budget, workers, 65.0, 1, false), 0);   // all fit: one section
  EXPECT_EQ(st::bwd_section_groups(32, 8 * mb, budget, workers, 0.0, 1, false), 4);   // walk unknown: budget
  // Deterministic: at least workers / walk groups (causal S = 8192, walk 65: 3 < budget's 8).
  EXPECT_EQ(st::bwd_section_groups(32, 4 * mb, budget, workers, 65.0, 1, true), 8);
  EXPECT_EQ(st::bwd_section_groups(64, 4 * mb, budget, workers, 10.0, 1, true), 14);  // ceil(132 / 10)
  EXPECT_EQ(st::bwd_section_groups(64, 4 * mb, budget, workers, 2.5, 4, true), 14);   // the group's heads walk too
  EXPECT_EQ(st::bwd_section_groups(32, 4 * mb, budget, workers, 4.0, 1, true), 0);    // 33 >= 32 groups
  EXPECT_EQ(st::bwd_section_groups(32, 8 * mb, budget, workers, 0.0, 1, true), 0);    // unknown: plain hand-out
  EXPECT_EQ(st::bwd_section_groups(8, 64 * mb, budget, workers, 65.0, 8, true), 1);   // GQA 8:1 walks 520
}

TEST(BwdSections, ColumnTilesFromTheListsAverageToTheClosedForm) {
  // What the preprocessing sums on the device where the host cannot know the walk (documents,
  // bitmasks): per (batch, column) the column lists' blocks x q tiles a block. On masks built on
  // the host from specs with a closed form, its mean over batch x columns is the closed form's
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
      st::MaskColumnLists l;
      l.partial_count = st::mask_index_view(m.q_num_blocks);
      l.partial_index = st::mask_index_view(m.q_indices);
      l.full_count = st::mask_index_view(m.full_q_num_blocks);
      l.full_index = st::mask_index_view(m.full_q_indices);
      l.q_tiles_per_block = int32_t(m.block_q / tile_q);
      int64_t tiles = 0;
      for (int64_t b = 0; b < 3; ++b)
        for (int64_t n = 0; n < m.num_kv_blocks(); ++n) tiles += st::bwd_column_tiles(l, b, n);
      EXPECT_DOUBLE_EQ(double(tiles) / double(3 * m.num_kv_blocks()),
                       st::bwd_mean_column_visits(spec, c.seq, c.seq, m.block_kv, tile_q))
          << spec.str() << " tile_q " << tile_q;
    }
}

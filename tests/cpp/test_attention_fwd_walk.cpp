// The forward kernel's index math on the CPU (common/attention/attention_fwd_walk.h): work items cover every
// (b, h, q tile) once; a q tile's walk visits exactly the kernel kv tiles of its mask row's
// partial and full blocks (mask blocks larger than the kernel tiles included, broadcast leading
// dims, compact widths), partial ones first with their list entries; a bad device mask (counts
// above the width or below 0, block ids out of range) is clamped or skipped, never read past; and
// the cost the longest-first order sorts by is the walk's length.
#include <gtest/gtest.h>

#include <set>
#include <tuple>
#include <vector>

#include "common/attention/attention_fwd_walk.h"
#include "common/attention/mask_predicate.h"
#include "sparsetrain/block_mask.h"

namespace st = sparsetrain;

namespace {

st::MaskWalkLists lists_of(const st::BlockMask& m, int32_t tile_kv) {
  st::MaskWalkLists l;
  l.partial_count = st::mask_index_view(m.kv_num_blocks);
  l.partial_index = st::mask_index_view(m.kv_indices);
  l.full_count = st::mask_index_view(m.full_kv_num_blocks);
  l.full_index = st::mask_index_view(m.full_kv_indices);
  l.num_kv_blocks = int32_t(m.num_kv_blocks());
  l.block_q = int32_t(m.block_q);
  l.sub_tiles = int32_t(m.block_kv / tile_kv);
  return l;
}

}  // namespace

TEST(AttentionFwdWalk, VisitsExactlyTheRowsBlocks) {
  struct Geo {
    st::MaskKind kind;
    int64_t B, Sq, Skv, block_q, block_kv, left, right;
  };
  const Geo geos[] = {
      {st::MaskKind::kCausal, 1, 1000, 1000, 128, 128, -1, -1},
      {st::MaskKind::kCausalBottomRight, 1, 300, 517, 128, 256, -1, -1},
      {st::MaskKind::kSlidingWindow, 1, 777, 777, 256, 256, 200, 0},
      {st::MaskKind::kFull, 1, 45, 300, 128, 128, -1, -1},
  };
  const int32_t tile_q = 128, tile_kv = 128, heads = 3;
  for (const Geo& g : geos) {
    st::MaskSpec spec;
    spec.kind = g.kind;
    spec.window_left = g.left;
    spec.window_right = g.right;
    st::BlockMaskOptions o;
    o.block_q = g.block_q;
    o.block_kv = g.block_kv;
    const st::BlockMaskTensors t = st::build_block_mask(spec, g.Sq, g.Skv, o);
    const st::MaskWalkLists l = lists_of(t.mask, tile_kv);
    const int32_t q_tiles = int32_t((g.Sq + tile_q - 1) / tile_q);
    const int64_t items = g.B * heads * q_tiles;
    std::set<std::tuple<int, int, int>> seen;
    for (int64_t it = 0; it < items; ++it) {
      const st::FwdWorkItem w = st::fwd_work_item(it, heads, q_tiles);
      EXPECT_TRUE(seen.insert({w.b, w.h, w.q_tile}).second);
      const int32_t row = st::fwd_mask_row(w.q_tile, tile_q, l.block_q);
      const st::WalkCounts c = st::walk_counts(l, w.b, w.h, row);
      const int32_t n = st::walk_length(l, c);
      const st::FwdWorkRecord r = st::fwd_work_record(l, it, heads, q_tiles, tile_q);
      EXPECT_EQ(r.item, it);
      EXPECT_EQ(r.partial, c.partial);
      EXPECT_EQ(r.full, c.full);
      EXPECT_EQ(r.cost, n);
      // Expected: every kernel tile of the row's partial blocks, then of its full blocks.
      const int32_t* pc = static_cast<const int32_t*>(t.mask.kv_num_blocks.data());
      const int32_t* pi = static_cast<const int32_t*>(t.mask.kv_indices.data());
      const int32_t* fc = static_cast<const int32_t*>(t.mask.full_kv_num_blocks.data());
      const int32_t* fi = static_cast<const int32_t*>(t.mask.full_kv_indices.data());
      const int64_t W = t.mask.kv_indices.size(3), FW = t.mask.full_kv_indices.size(3);
      std::vector<std::tuple<int, int, bool>> want;
      for (int e = 0; e < pc[row]; ++e)
        for (int s = 0; s < l.sub_tiles; ++s) want.emplace_back(pi[row * W + e] * l.sub_tiles + s, e, true);
      for (int e = 0; e < fc[row]; ++e)
        for (int s = 0; s < l.sub_tiles; ++s) want.emplace_back(fi[row * FW + e] * l.sub_tiles + s, e, false);
      ASSERT_EQ(size_t(n), want.size()) << "item " << it;
      for (int32_t k = 0; k < n; ++k) {
        const st::WalkTile tile = st::walk_tile(l, c, w.b, w.h, row, k);
        EXPECT_EQ(std::make_tuple(int(tile.tile), int(tile.entry), tile.partial), want[size_t(k)]) << "tile " << k;
      }
    }
    EXPECT_EQ(int64_t(seen.size()), items);
  }
}

TEST(AttentionFwdWalk, BadCountsAndIdsAreClampedOrSkipped) {
  // One row, width 2: count 5 reads 2 entries; count -3 reads none; ids -1 and 9 (Nk = 4) are skipped.
  int32_t counts[1] = {5}, idx[2] = {-1, 2}, fcounts[1] = {-3}, fidx[2] = {9, 9};
  st::MaskWalkLists l;
  l.partial_count = {counts, 0, 0, 1, 0, 0};
  l.partial_index = {idx, 0, 0, 2, 1, 2};
  l.full_count = {fcounts, 0, 0, 1, 0, 0};
  l.full_index = {fidx, 0, 0, 2, 1, 2};
  l.num_kv_blocks = 4;
  l.sub_tiles = 2;
  const st::WalkCounts c = st::walk_counts(l, 0, 0, 0);
  EXPECT_EQ(c.partial, 2);
  EXPECT_EQ(c.full, 0);
  ASSERT_EQ(st::walk_length(l, c), 4);
  EXPECT_EQ(st::walk_tile(l, c, 0, 0, 0, 0).tile, -1);
  EXPECT_EQ(st::walk_tile(l, c, 0, 0, 0, 1).tile, -1);
  EXPECT_EQ(st::walk_tile(l, c, 0, 0, 0, 2).tile, 4);
  EXPECT_EQ(st::walk_tile(l, c, 0, 0, 0, 3).tile, 5);
  // The producer and the consumers skip to the same valid tiles.
  st::WalkTile tile{};
  EXPECT_EQ(st::walk_next_valid(l, c, 0, 0, 0, 0, &tile), 2);
  EXPECT_EQ(tile.tile, 4);
  EXPECT_EQ(st::walk_next_valid(l, c, 0, 0, 0, 3, &tile), 3);
  EXPECT_EQ(tile.tile, 5);
  fcounts[0] = 1;
  const st::WalkCounts c2 = st::walk_counts(l, 0, 0, 0);
  EXPECT_EQ(st::walk_tile(l, c2, 0, 0, 0, 4).tile, -1);  // full id 9 >= Nk
  EXPECT_EQ(st::walk_next_valid(l, c2, 0, 0, 0, 4, &tile), st::walk_length(l, c2));  // none left
  idx[1] = 7;  // every entry out of range: the item has nothing to load
  EXPECT_EQ(st::walk_next_valid(l, c2, 0, 0, 0, 0, &tile), st::walk_length(l, c2));
  // An absent full list counts 0.
  l.full_count = {};
  EXPECT_EQ(st::walk_counts(l, 0, 0, 0).full, 0);
}

TEST(AttentionFwdWalk, RowIntervalsAreTheSpecsRows) {
  // mask_row_interval (the kernels' fast path) against mask_allows (the definition) per element.
  struct Spec {
    st::MaskKind kind;
    int64_t left, right, prefix;
  };
  const Spec specs[] = {{st::MaskKind::kFull, -1, -1, 0},          {st::MaskKind::kCausal, -1, -1, 0},
                        {st::MaskKind::kCausalBottomRight, -1, -1, 0}, {st::MaskKind::kSlidingWindow, 7, 0, 0},
                        {st::MaskKind::kSlidingWindow, 5, 3, 0},   {st::MaskKind::kSlidingWindow, -1, 2, 0},
                        {st::MaskKind::kSlidingWindow, 4, -1, 0},  {st::MaskKind::kPrefixLM, -1, -1, 9}};
  for (const auto& [sq, skv] : {std::pair<int64_t, int64_t>{23, 23}, {17, 31}, {31, 17}})
    for (const Spec& s : specs)
      for (int64_t q = 0; q < sq; ++q) {
        int64_t lo = -7, hi = -7;
        ASSERT_TRUE(st::mask_row_interval(s.kind, s.left, s.right, s.prefix, sq, skv, q, &lo, &hi));
        for (int64_t kv = 0; kv < skv; ++kv)
          EXPECT_EQ(kv >= lo && kv < hi,
                    st::mask_allows(s.kind, s.left, s.right, s.prefix, nullptr, nullptr, sq, skv, q, kv))
              << "kind " << int(s.kind) << " q " << q << " kv " << kv;
      }
  int64_t lo, hi;
  for (st::MaskKind k : {st::MaskKind::kDocument, st::MaskKind::kDocumentCausal, st::MaskKind::kBitmask})
    EXPECT_FALSE(st::mask_row_interval(k, -1, -1, 0, 8, 8, 0, &lo, &hi));
}

TEST(AttentionFwdWalk, BandsAreTheSpecsRows) {
  // mask_band (the backward's transposed tiles) against mask_allows (the definition) per element,
  // with windows wider than the sequences, one-sided and empty-sided ones, Sq != Skv both ways.
  struct Spec {
    st::MaskKind kind;
    int64_t left, right;
  };
  const int64_t huge = int64_t(1) << 40;
  const Spec specs[] = {{st::MaskKind::kCausal, -1, -1},       {st::MaskKind::kCausalBottomRight, -1, -1},
                        {st::MaskKind::kSlidingWindow, 7, 0},  {st::MaskKind::kSlidingWindow, 5, 3},
                        {st::MaskKind::kSlidingWindow, -1, 2}, {st::MaskKind::kSlidingWindow, 4, -1},
                        {st::MaskKind::kSlidingWindow, 0, 0},  {st::MaskKind::kSlidingWindow, huge, huge},
                        {st::MaskKind::kSlidingWindow, -1, -1}};
  for (const auto& [sq, skv] : {std::pair<int64_t, int64_t>{23, 23}, {17, 31}, {31, 17}, {1, 40}, {40, 1}})
    for (const Spec& s : specs) {
      int32_t lo = -7, hi = -7;
      ASSERT_TRUE(st::mask_band(s.kind, s.left, s.right, sq, skv, &lo, &hi));
      for (int64_t q = 0; q < sq; ++q)
        for (int64_t kv = 0; kv < skv; ++kv)
          EXPECT_EQ(st::in_mask_band(int32_t(kv - q), lo, hi),
                    st::mask_allows(s.kind, s.left, s.right, 0, nullptr, nullptr, sq, skv, q, kv))
              << "kind " << int(s.kind) << " left " << s.left << " right " << s.right << " q " << q << " kv " << kv;
    }
  // The extremes of the kernels' bound (Sq, Skv < 2^30): the band's ends and an open side.
  const int32_t big = (int32_t(1) << 30) - 1;
  int32_t lo, hi;
  ASSERT_TRUE(st::mask_band(st::MaskKind::kCausal, -1, -1, big, big, &lo, &hi));
  EXPECT_TRUE(st::in_mask_band(-big, lo, hi));
  EXPECT_TRUE(st::in_mask_band(0, lo, hi));
  EXPECT_FALSE(st::in_mask_band(1, lo, hi));
  ASSERT_TRUE(st::mask_band(st::MaskKind::kSlidingWindow, huge, -1, big, big, &lo, &hi));
  EXPECT_TRUE(st::in_mask_band(-big, lo, hi));
  EXPECT_TRUE(st::in_mask_band(big, lo, hi));
  ASSERT_TRUE(st::mask_band(st::MaskKind::kCausalBottomRight, -1, -1, 1, big, &lo, &hi));
  EXPECT_TRUE(st::in_mask_band(big - 1, lo, hi));
  EXPECT_FALSE(st::in_mask_band(big, lo, hi));
  for (st::MaskKind k : {st::MaskKind::kFull, st::MaskKind::kPrefixLM, st::MaskKind::kDocument,
                         st::MaskKind::kDocumentCausal, st::MaskKind::kBitmask})
    EXPECT_FALSE(st::mask_band(k, -1, -1, 8, 8, &lo, &hi));
}

TEST(AttentionFwdWalk, L2SectionsHoldWholeGqaGroupsWithinTheBudget) {
  // Heads per section: a multiple of the GQA group, at least one group, at most every head and
  // kFwdMaxKvHeadsPerSection kv heads, and the K/V of its kv heads within the budget unless one kv
  // head alone exceeds it.
  for (int64_t kv_bytes : {int64_t(1) << 18, int64_t(1) << 20, int64_t(3) << 20, int64_t(8) << 20, int64_t(64) << 20, int64_t(0)})
    for (int32_t group : {1, 2, 4, 8})
      for (int64_t heads_total : {int64_t(group), int64_t(group) * 3, int64_t(group) * 16, int64_t(group) * 128}) {
        const int64_t budget = int64_t(30) << 20;
        const int32_t hps = st::fwd_heads_per_section(kv_bytes, budget, group, heads_total);
        EXPECT_EQ(hps % group, 0) << kv_bytes << " " << group << " " << heads_total;
        EXPECT_GE(hps, group);
        EXPECT_LE(hps, heads_total);
        EXPECT_LE(hps / group, st::kFwdMaxKvHeadsPerSection);
        if (kv_bytes > 0 && kv_bytes <= budget) {
          EXPECT_LE(hps / group * kv_bytes, budget);
          // As many as fit: one more kv head would exceed the budget or the cap, or every head is in.
          EXPECT_TRUE(hps == heads_total || (hps / group + 1) * kv_bytes > budget ||
                      hps / group == st::kFwdMaxKvHeadsPerSection);
        }
      }
  // The sections partition the items in order, each into whole heads.
  for (const auto& [heads, q_tiles, hps] : {std::tuple<int32_t, int32_t, int32_t>{16, 5, 6}, {16, 5, 16}, {3, 1, 1},
                                            {128, 32, 16}, {7, 3, 7}}) {
    const int32_t items = heads * q_tiles, n = st::fwd_sections(items, q_tiles, hps);
    int32_t next = 0;
    for (int32_t s = 0; s < n; ++s) {
      const st::FwdSection sec = st::fwd_section(s, items, q_tiles, hps);
      EXPECT_EQ(sec.first, next);
      EXPECT_LT(sec.first, sec.last);
      EXPECT_EQ(sec.first % q_tiles, 0);
      EXPECT_EQ(sec.last % q_tiles, 0);
      EXPECT_LE(sec.last - sec.first, hps * q_tiles);
      next = sec.last;
    }
    EXPECT_EQ(next, items);
  }
}

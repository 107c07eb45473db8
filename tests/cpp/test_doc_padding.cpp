// The padded document layout (common/attention/doc_padding.h): long documents start and end on 128-token
// boundaries, runs of short ones stay packed, positions keep the order, and the padded length stays
// under the bound computed from the sequence length alone; one layout worked by hand.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "common/attention/doc_padding.h"
#include "common/attention/mask_predicate.h"

namespace st = sparsetrain;

namespace {

std::vector<int32_t> documents(int64_t seq, int64_t max_length, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<int32_t> ids;
  for (int32_t doc = 0; int64_t(ids.size()) < seq; ++doc)
    ids.insert(ids.end(), size_t(1 + rng() % uint64_t(max_length)), doc);
  ids.resize(size_t(seq));
  return ids;
}

// The documents of a row of ids: [start, end) of each maximal run of equal ids.
std::vector<std::pair<int64_t, int64_t>> document_runs(const std::vector<int32_t>& ids) {
  std::vector<std::pair<int64_t, int64_t>> runs;
  const int64_t seq = int64_t(ids.size());
  for (int64_t s = 0; s < seq;) {
    int64_t e = s;
    while (e < seq && ids[size_t(e)] == ids[size_t(s)]) ++e;
    runs.emplace_back(s, e);
    s = e;
  }
  return runs;
}

TEST(DocPadding, ByHand) {
  // 130 and 5 tokens (short at 256: packed from 0), then 300 (long: 256..555), padded to 640.
  std::vector<int32_t> ids(130, 0);
  ids.insert(ids.end(), 5, 1);
  ids.insert(ids.end(), 300, 2);
  int64_t length = 0;
  const std::vector<int64_t> pos = st::doc_padded_positions(ids.data(), int64_t(ids.size()), 256, &length);
  EXPECT_EQ(pos[0], 0);
  EXPECT_EQ(pos[129], 129);
  EXPECT_EQ(pos[130], 130);
  EXPECT_EQ(pos[134], 134);
  EXPECT_EQ(pos[135], 256);
  EXPECT_EQ(pos[434], 555);
  EXPECT_EQ(length, 640);
  EXPECT_EQ(st::doc_padded_length_bound(435, 256), 896);  // 435 + (2 x 1 + 1) x 127 = 816, to whole tiles
}

TEST(DocPadding, LongDocumentsOnBoundariesShortOnesPacked) {
  for (const int64_t seq : {1, 127, 128, 1000, 16384})
    for (const int64_t max_length : {1, 50, 300, 3000})
      for (const int64_t min_length : {1, 64, 256, 1024}) {
        SCOPED_TRACE("seq " + std::to_string(seq) + " lengths 1.." + std::to_string(max_length) + " min " +
                     std::to_string(min_length));
        const std::vector<int32_t> ids = documents(seq, max_length, uint64_t(seq * 31 + max_length));
        int64_t length = 0;
        const std::vector<int64_t> pos = st::doc_padded_positions(ids.data(), seq, min_length, &length);
        ASSERT_EQ(int64_t(pos.size()), seq);
        EXPECT_EQ(length % st::kDocPadAlign, 0);
        EXPECT_GT(length, pos.back());
        EXPECT_LE(length, st::doc_padded_length_bound(seq, min_length));
        int64_t rounded = 0;  // every document padded: the sum of the rounded-up lengths
        bool prev_long = true;
        for (const auto& [s, e] : document_runs(ids)) {
          for (int64_t i = s + 1; i < e; ++i) ASSERT_EQ(pos[size_t(i)], pos[size_t(i - 1)] + 1) << "inside a document";
          const bool long_doc = e - s >= min_length;
          if (long_doc || prev_long) {
            EXPECT_EQ(pos[size_t(s)] % st::kDocPadAlign, 0) << "a long document, or what follows one, starts a tile: " << s;
          } else {
            EXPECT_EQ(pos[size_t(s)], pos[size_t(s - 1)] + 1) << "short documents packed: " << s;
          }
          if (s > 0) {
            EXPECT_GT(pos[size_t(s)], pos[size_t(s - 1)]);
          }
          rounded += (e - s + st::kDocPadAlign - 1) / st::kDocPadAlign * st::kDocPadAlign;
          prev_long = long_doc;
        }
        if (min_length == 1) {
          EXPECT_EQ(length, rounded);
        }
      }
}

// The point of the layout: a document mask over the padded ids at the padded length is the
// original mask under the position map, and padding rows and columns allow nothing; also when the
// key side's ids differ from the layout's (query) ids (every third document's key id moved past
// the query ids, as cu_seqlens gives each side its own id past the last document).
TEST(DocPadding, PaddedMaskIsTheOriginal) {
  for (const st::MaskKind kind : {st::MaskKind::kDocumentCausal, st::MaskKind::kDocument})
    for (const int64_t min_length : {1, 100, 400})
      for (const bool same_ids : {true, false}) {
        SCOPED_TRACE("min " + std::to_string(min_length) + (same_ids ? " same ids" : " other key ids"));
        const int64_t seq = 900;
        const std::vector<int32_t> ids = documents(seq, 500, uint64_t(min_length));
        std::vector<int32_t> kids = ids;
        if (!same_ids)
          for (int32_t& id : kids) id += id % 3 == 2 ? 10000 : 0;
        int64_t length = 0;
        const std::vector<int64_t> pos = st::doc_padded_positions(ids.data(), seq, min_length, &length);
        std::vector<int32_t> q_ids, kv_ids;
        st::doc_padded_ids(ids.data(), kids.data(), seq, pos, length, &q_ids, &kv_ids);
        ASSERT_EQ(int64_t(q_ids.size()), length);
        std::vector<bool> real(size_t(length), false);
        for (const int64_t p : pos) real[size_t(p)] = true;
        auto padded = [&](int64_t q, int64_t kv) {
          return st::mask_allows(kind, -1, -1, 0, q_ids.data(), kv_ids.data(), length, length, q, kv);
        };
        for (int64_t q = 0; q < seq; ++q)
          for (int64_t kv = 0; kv < seq; ++kv)
            ASSERT_EQ(padded(pos[size_t(q)], pos[size_t(kv)]),
                      st::mask_allows(kind, -1, -1, 0, ids.data(), kids.data(), seq, seq, q, kv))
                << q << ", " << kv;
        for (int64_t p = 0; p < length; ++p) {
          if (real[size_t(p)]) continue;
          for (int64_t x = 0; x < length; ++x) {
            ASSERT_FALSE(padded(p, x)) << "padding row " << p;
            ASSERT_FALSE(padded(x, p)) << "padding column " << p;
          }
        }
      }
}

// The combination of steps[lo, hi) as a random binary tree would combine them: associativity is
// what a parallel scan relies on.
st::DocPadStep combine(const std::vector<st::DocPadStep>& steps, size_t lo, size_t hi, std::mt19937_64& rng) {
  if (hi == lo) return st::DocPadStep{};
  if (hi - lo == 1) return steps[lo];
  const size_t mid = lo + 1 + size_t(rng() % uint64_t(hi - lo - 1));
  return st::doc_pad_then(combine(steps, lo, mid, rng), combine(steps, mid, hi, rng));
}

TEST(DocPadding, TheLayoutAsAScanOfDocumentSteps) {
  {  // ByHand's documents (130, 5 short; 300 long at min 256): starts 0, 130, 256; length 640
    const st::DocPadStep a = st::doc_pad_step(130, 256), b = st::doc_pad_step(5, 256), c = st::doc_pad_step(300, 256);
    EXPECT_EQ(st::doc_pad_apply(st::doc_pad_then(a, b), 0), 135);
    EXPECT_EQ(st::doc_pad_align(st::doc_pad_apply(st::doc_pad_then(st::doc_pad_then(a, b), c), 0)), 640);
    EXPECT_EQ(st::doc_pad_apply(st::doc_pad_then(a, st::doc_pad_then(b, c)), 0), 640);
  }
  std::mt19937_64 rng(26);
  for (const int64_t seq : {1, 300, 5000})
    for (const int64_t max_length : {1, 200, 3000})
      for (const int64_t min_length : {1, 128, 129, 1024}) {
        SCOPED_TRACE("seq " + std::to_string(seq) + " lengths 1.." + std::to_string(max_length) + " min " +
                     std::to_string(min_length));
        const std::vector<int32_t> ids = documents(seq, max_length, uint64_t(seq + max_length + min_length));
        int64_t length = 0;
        const std::vector<int64_t> pos = st::doc_padded_positions(ids.data(), seq, min_length, &length);
        std::vector<int64_t> starts, lengths;
        for (const auto& [s, e] : document_runs(ids)) {
          starts.push_back(s);
          lengths.push_back(e - s);
        }
        std::vector<st::DocPadStep> steps;
        for (const int64_t n : lengths) steps.push_back(st::doc_pad_step(n, min_length));
        for (size_t d = 0; d < steps.size(); ++d) {
          const int64_t x = st::doc_pad_apply(combine(steps, 0, d, rng), 0);
          const int64_t start = lengths[d] >= min_length ? st::doc_pad_align(x) : x;
          ASSERT_EQ(start, pos[size_t(starts[d])]) << "document " << d;
        }
        EXPECT_EQ(st::doc_pad_align(st::doc_pad_apply(combine(steps, 0, steps.size(), rng), 0)), length);
      }
}

// The per-token form (the device build's): each token's step from whether it starts or ends a long
// document, combined in random tree orders, places every token where doc_padded_positions does.
TEST(DocPadding, TheLayoutAsAScanOfTokenSteps) {
  std::mt19937_64 rng(28);
  for (const int64_t seq : {1, 300, 3000})
    for (const int64_t max_length : {1, 200, 2000})
      for (const int64_t min_length : {1, 128, 129, 1024}) {
        SCOPED_TRACE("seq " + std::to_string(seq) + " lengths 1.." + std::to_string(max_length) + " min " +
                     std::to_string(min_length));
        const std::vector<int32_t> ids = documents(seq, max_length, uint64_t(seq * 3 + max_length + min_length));
        int64_t length = 0;
        const std::vector<int64_t> pos = st::doc_padded_positions(ids.data(), seq, min_length, &length);
        std::vector<st::DocPadStep> steps(static_cast<size_t>(seq));
        std::vector<bool> starts_long(static_cast<size_t>(seq));
        for (const auto& [s, e] : document_runs(ids))
          for (int64_t t = s; t < e; ++t) {
            starts_long[size_t(t)] = t == s && e - s >= min_length;
            steps[size_t(t)] = st::doc_pad_token_step(starts_long[size_t(t)], t == e - 1 && e - s >= min_length);
          }
        // Every token for the short sequences, a sample of 200 for the long one (each a fresh tree).
        for (int64_t i = 0; i < std::min<int64_t>(seq, 200); ++i) {
          const int64_t t = seq <= 200 ? i : int64_t(rng() % uint64_t(seq));
          const int64_t x = st::doc_pad_apply(combine(steps, 0, size_t(t), rng), 0);
          ASSERT_EQ(st::doc_pad_token_position(x, starts_long[size_t(t)]), pos[size_t(t)]) << "token " << t;
        }
        EXPECT_EQ(st::doc_pad_align(st::doc_pad_apply(combine(steps, 0, steps.size(), rng), 0)), length);
      }
}

// The device build's long flags from a sum scan of document starts (doc_token_starts_long /
// _ends_long) are the documents' own, token by token, ids coming back included (a run of id 0,
// then 1, then 0 again is three documents).
TEST(DocPadding, LongFlagsFromTheCountOfDocumentStarts) {
  for (const int64_t seq : {1, 2, 300, 3000})
    for (const int64_t max_length : {1, 129, 2000})
      for (const int64_t min_length : {1, 2, 128, 129, 1024})
        for (const int32_t recur : {0, 2}) {
          SCOPED_TRACE("seq " + std::to_string(seq) + " lengths 1.." + std::to_string(max_length) + " min " +
                       std::to_string(min_length) + " ids modulo " + std::to_string(recur));
          std::vector<int32_t> ids = documents(seq, max_length, uint64_t(seq * 5 + max_length + min_length));
          if (recur) for (int32_t& id : ids) id %= recur;  // 0 1 0 1 ...: every id comes back
          std::vector<int32_t> starts(static_cast<size_t>(seq), 0);
          for (int64_t t = 0, n = 0; t < seq; ++t) starts[size_t(t)] = int32_t(n += st::doc_first_token(ids.data(), t));
          for (const auto& [s, e] : document_runs(ids))
            for (int64_t t = s; t < e; ++t) {
              const bool is_long = e - s >= min_length;
              ASSERT_EQ(st::doc_token_starts_long(ids.data(), starts.data(), seq, t, min_length), t == s && is_long)
                  << "token " << t << " of [" << s << ", " << e << ")";
              ASSERT_EQ(st::doc_token_ends_long(ids.data(), starts.data(), seq, t, min_length), t == e - 1 && is_long)
                  << "token " << t << " of [" << s << ", " << e << ")";
            }
        }
}

// Each tile of the padded layout is real rows from its start, then padding: for 64- and 128-row
// tiles over random document mixes, row r < rows of a tile is the real row start + r and every
// later row is padding, checked against the inverse of the position map; the rows add up to seq.
TEST(DocPadding, TilesAreRealRowsThenPadding) {
  for (const int64_t tile_rows : {64, 128})
    for (const int64_t max_length : {1, 70, 200, 3000})
      for (const int64_t min_length : {1, 64, 300}) {
        SCOPED_TRACE("tile " + std::to_string(tile_rows) + " lengths 1.." + std::to_string(max_length) + " min " +
                     std::to_string(min_length));
        const int64_t seq = 4000;
        const std::vector<int32_t> ids = documents(seq, max_length, uint64_t(tile_rows + max_length * 7 + min_length));
        int64_t length = 0;
        const std::vector<int64_t> pos = st::doc_padded_positions(ids.data(), seq, min_length, &length);
        std::vector<int64_t> real_at(size_t(length), -1);  // the inverse map; -1: padding
        for (int64_t t = 0; t < seq; ++t) real_at[size_t(pos[size_t(t)])] = t;
        const std::vector<st::DocPaddedTile> tiles = st::doc_padded_tiles(pos, length, tile_rows);
        ASSERT_EQ(int64_t(tiles.size()) * tile_rows, length);
        int64_t covered = 0;
        for (size_t t = 0; t < tiles.size(); ++t) {
          const st::DocPaddedTile& tile = tiles[t];
          for (int64_t r = 0; r < tile_rows; ++r) {
            const int64_t real = real_at[t * size_t(tile_rows) + size_t(r)];
            if (r < tile.rows) {
              ASSERT_EQ(real, tile.start + r) << "tile " << t << " row " << r;
            } else {
              ASSERT_EQ(real, -1) << "tile " << t << " row " << r << ": real rows after padding";
            }
          }
          covered += tile.rows;
        }
        EXPECT_EQ(covered, seq);
      }
}

}  // namespace

// The backward's bitmask mask (mask_key_words, mask_tile_sm90.cuh) relies on where the S^T
// accumulator puts a consumer thread's elements: a warp's keys (rows) are one 16-key half of a
// 32-key group, the same keys in every query column, and a thread's query column j lies in
// 32-row group j / 8 of the q tile. Checked against CuTe's partition of the S^T GEMM for every
// head dim the kernels are built for (at D <= 64 the q tile has 128 rows); then the
// backward's transposed copy (common/attention/bitmask_transpose.h, its warps' ballots
// emulated) and the mask made from it (the words loaded as bwd_mask_bits loads them) against the
// block's bits read one by one. Host tests: no GPU.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <set>
#include <vector>

#include "common/attention/bitmask_transpose.h"
#include "cuda/attention/bwd_traits_sm90.cuh"
#include "cuda/attention/mask_tile_sm90.cuh"

namespace {

using namespace sparsetrain::cuda::attn;

template <class T>
void expect_bitmask_layout() {
  constexpr int N = T::kBlockN, M = T::kBlockM;
  typename T::MmaSdP mma;
  const auto tile = cute::make_identity_tensor(cute::Shape<cute::Int<N>, cute::Int<M>>{});
  std::set<std::pair<int, int>> seen;
  for (int warp = 0; warp < T::kMmaThreads / 32; ++warp) {
    int warp_half = -1;
    for (int lane = 0; lane < 32; ++lane) {
      const int t = warp * 32 + lane;
      const auto part = mma.get_thread_slice(t).partition_C(tile);
      const auto c = cute::make_tensor(part.data(), acc_rowcol(part.layout()));
      const int keys = int(cute::size<0>(c)), queries = int(cute::size<1>(c));
      ASSERT_EQ(queries, 8 * (M / 32)) << "D " << T::kHeadDim;
      for (int i = 0; i < keys; ++i)
        for (int j = 0; j < queries; ++j) {
          const int key = int(cute::get<0>(c(i, j))), q = int(cute::get<1>(c(i, j)));
          const int half = key & ~15;
          if (warp_half < 0) warp_half = half;
          ASSERT_EQ(half, warp_half) << "D " << T::kHeadDim << " thread " << t << ": the warp's keys, one 16-key half";
          ASSERT_EQ(key, int(cute::get<0>(c(i, 0)))) << "D " << T::kHeadDim << " thread " << t << " key " << i;
          ASSERT_EQ(q, int(cute::get<1>(c(0, j)))) << "D " << T::kHeadDim << " thread " << t << " query " << j;
          ASSERT_EQ(q / 32, j / 8) << "D " << T::kHeadDim << " thread " << t << " query " << j;
          seen.insert({key, q});
        }
    }
  }
  EXPECT_EQ(int(seen.size()), N * M) << "every element of the tile, once";
}

TEST(BwdMaskLayout, WarpsHoldOneKeyHalfAndQueryColumnsInGroupsOfEight) {
  expect_bitmask_layout<BwdTraits<cutlass::bfloat16_t, 64>>();
  expect_bitmask_layout<BwdTraits<cutlass::bfloat16_t, 96>>();
  expect_bitmask_layout<BwdTraits<cutlass::bfloat16_t, 128>>();
  expect_bitmask_layout<BwdTraits<cutlass::half_t, 128>>();
}

// The backward's transposed copy of blocks `s` (source words `src` in the compact order of the
// mask's blocks), a warp per tile as bwd_bits_copy_kernel runs it, ballots emulated.
std::vector<uint32_t> transposed_copy(const sparsetrain::BitmaskBlocks& s, const std::vector<uint32_t>& src,
                                      int seq_q) {
  std::vector<uint32_t> out(size_t(s.words()), 0xdeadbeefu);  // poisoned: every word must be written
  for (int64_t t = 0; t < s.tiles(); ++t) {
    const sparsetrain::BitTile x = sparsetrain::bit_tile(s, t);
    uint32_t rows[32];
    for (int lane = 0; lane < 32; ++lane) {
      const bool live = x.m * s.block_q + 32 * x.q_group + lane < seq_q;
      rows[lane] = live ? src[size_t(x.block * s.block_words() + sparsetrain::bit_tile_source_word(s, x, lane))] : 0u;
    }
    auto ballot = [&](int k, uint32_t) {
      uint32_t b = 0;
      for (int l = 0; l < 32; ++l) b |= ((rows[l] >> k) & 1u) << l;
      return b;
    };
    for (int lane = 0; lane < 32; ++lane)
      out[size_t(x.block * s.block_words() + sparsetrain::bit_tile_copy_word(s, x, lane))] =
          sparsetrain::transpose_bit_tile(rows[lane], lane, ballot);
  }
  return out;
}

TEST(BwdMaskBits, TheTransposedCopyHoldsEachKeysBitsOverTheQueries) {
  sparsetrain::BitmaskBlocks s;
  s.lead_b = 2, s.lead_h = 3, s.rows = 3, s.width = 2, s.block_q = 128, s.block_kv = 256;
  EXPECT_EQ(s.stride_w(), 128 * 256 / 8);
  EXPECT_EQ(s.stride_m(), 2 * s.stride_w());
  EXPECT_EQ(s.stride_h(), 3 * s.stride_m());
  EXPECT_EQ(s.stride_b(), 3 * s.stride_h());
  sparsetrain::BitmaskBlocks one = s;
  one.lead_b = one.lead_h = 1;
  EXPECT_EQ(one.stride_b(), 0) << "a broadcast batch";
  EXPECT_EQ(one.stride_h(), 0) << "broadcast heads";
  std::mt19937 rng(7);
  std::vector<uint32_t> src(size_t(s.words()));
  for (uint32_t& w : src) w = uint32_t(rng());
  const int seq_q = 2 * 128 + 77;  // the last q block's rows from 77 on lie past Sq
  const std::vector<uint32_t> out = transposed_copy(s, src, seq_q);
  for (int64_t blk = 0; blk < s.blocks(); ++blk) {
    const int m = int(blk / s.width % s.rows);
    for (int i = 0; i < s.block_q; ++i)
      for (int j = 0; j < s.block_kv; ++j) {
        const uint32_t want = m * s.block_q + i < seq_q
                                  ? (src[size_t(blk * s.block_words() + sparsetrain::bitmask_word(i, j, s.block_kv))] >>
                                     (j & 31)) & 1u
                                  : 0u;
        const uint32_t got =
            (out[size_t(blk * s.block_words() + sparsetrain::bitmask_word(j, i, s.block_q))] >> (i & 31)) & 1u;
        ASSERT_EQ(got, want) << "block " << blk << " query " << i << " key " << j;
      }
  }
}

// One partial visit's mask over every consumer thread: a random block of block_q x block_kv bits,
// the q tile at row row0 of it, the kernel's 128 keys at column 128 * sub_tile, valid_rows rows
// before Sq and key_end keys before Skv.
template <class T>
void expect_bits_of_the_block(int block_q, int block_kv, int row0, int sub_tile, int valid_rows, int key_end,
                              unsigned seed) {
  constexpr int N = T::kBlockN, M = T::kBlockM, kGroups = M / 32;
  SCOPED_TRACE(::testing::Message() << "D " << T::kHeadDim << " block " << block_q << " x " << block_kv << " row0 "
                                    << row0 << " sub_tile " << sub_tile << " rows " << valid_rows << " keys " << key_end);
  std::mt19937 rng(seed);
  sparsetrain::BitmaskBlocks blocks;
  blocks.rows = blocks.width = 1, blocks.block_q = block_q, blocks.block_kv = block_kv;
  std::vector<uint32_t> block(size_t(blocks.words()));
  for (uint32_t& w : block) w = uint32_t(rng());
  auto bit = [&](int row, int col) {
    return (block[size_t(sparsetrain::bitmask_word(row, col, block_kv))] >> (col & 31)) & 1u;
  };
  const std::vector<uint32_t> copy = transposed_copy(blocks, block, row0 + valid_rows);
  typename T::MmaSdP mma;
  const auto tile = cute::make_identity_tensor(cute::Shape<cute::Int<N>, cute::Int<M>>{});
  for (int t = 0; t < T::kMmaThreads; ++t) {
    const auto part = mma.get_thread_slice(t).partition_C(tile);
    const auto c = cute::make_tensor(part.data(), acc_rowcol(part.layout()));
    auto frag = cute::partition_fragment_C(mma, cute::Shape<cute::Int<N>, cute::Int<M>>{});
    auto s = cute::make_tensor(frag.data(), acc_rowcol(frag.layout()));
    constexpr int kKeys = decltype(cute::size<0>(s))::value;
    uint32_t mine[kKeys][kGroups];  // the thread's loads (bwd_mask_bits)
    for (int ki = 0; ki < kKeys; ++ki)
      for (int g = 0; g < kGroups; ++g)
        mine[ki][g] = copy[size_t(sparsetrain::bitmask_word(128 * sub_tile + int(cute::get<0>(c(ki, 0))),
                                                            row0 + 32 * g, block_q))];
    for (int e = 0; e < int(cute::size(s)); ++e) s(e) = 0.f;
    mask_key_words(s, c, key_end, mine);
    for (int i = 0; i < int(cute::size<0>(s)); ++i)
      for (int j = 0; j < int(cute::size<1>(s)); ++j) {
        const int key = int(cute::get<0>(c(i, j))), q = int(cute::get<1>(c(i, j)));
        const bool allowed = q < valid_rows && key < key_end && bit(row0 + q, 128 * sub_tile + key) != 0;
        ASSERT_EQ(s(i, j), allowed ? 0.f : -INFINITY) << "thread " << t << " key " << key << " row " << q;
      }
  }
}

template <class T>
void expect_bits_of_blocks() {
  constexpr int M = T::kBlockM;
  unsigned seed = 1;
  expect_bits_of_the_block<T>(128, 128, 0, 0, M, 128, seed++);
  expect_bits_of_the_block<T>(128, 128, 128 - M, 0, M - 5, 128, seed++);  // the last tile, past Sq
  expect_bits_of_the_block<T>(128, 128, 0, 0, M, 77, seed++);            // keys past Skv
  expect_bits_of_the_block<T>(256, 256, 256 - M, 1, M, 128, seed++);     // the second tile of wider blocks
  expect_bits_of_the_block<T>(256, 384, M, 2, 3, 40, seed++);
  expect_bits_of_the_block<T>(128, 128, 0, 0, 0, 128, seed++);           // no row before Sq: nothing
}

TEST(BwdMaskBits, TransposedTilesTakeEachElementsBitFromTheCopy) {
  expect_bits_of_blocks<BwdTraits<cutlass::bfloat16_t, 64>>();
  expect_bits_of_blocks<BwdTraits<cutlass::bfloat16_t, 96>>();
  expect_bits_of_blocks<BwdTraits<cutlass::bfloat16_t, 128>>();
}

}  // namespace

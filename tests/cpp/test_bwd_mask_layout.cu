// The backward's bitmask mask (mask_bits_transposed, mask_tile_sm90.cuh) relies on where the S^T
// accumulator puts a consumer thread's elements: a warp's keys (rows) are one 16-key half of a
// 32-key group, the same keys in every query column, and a thread's query column j lies in
// 32-row group j / 8 of the q tile. Checked against CuTe's partition of the S^T GEMM for every
// head dim the kernels are built for (at D <= 64 the q tile has 128 rows); then the function
// itself over an emulated warp (its loads as bwd_mask_bits makes them, its ballots from every
// lane's words) against the block's bits read one by one. Host tests: no GPU.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <set>
#include <vector>

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
  std::vector<uint32_t> block(size_t(block_q * block_kv / 32));
  for (uint32_t& w : block) w = uint32_t(rng());
  auto bit = [&](int row, int col) {
    return (block[size_t(sparsetrain::bitmask_word(row, col, block_kv))] >> (col & 31)) & 1u;
  };
  typename T::MmaSdP mma;
  const auto tile = cute::make_identity_tensor(cute::Shape<cute::Int<N>, cute::Int<M>>{});
  auto coord_of = [&](int t) {
    const auto part = mma.get_thread_slice(t).partition_C(tile);
    return cute::make_tensor(part.data(), acc_rowcol(part.layout()));
  };
  for (int warp = 0; warp < T::kMmaThreads / 32; ++warp) {
    uint32_t words[32][kGroups];  // what each lane loads (bwd_mask_bits)
    for (int lane = 0; lane < 32; ++lane) {
      const int col = 128 * sub_tile + (int(cute::get<0>(coord_of(warp * 32 + lane)(0, 0))) & ~31);
      for (int g = 0; g < kGroups; ++g) {
        const int i = 32 * g + lane;
        words[lane][g] = i < valid_rows ? block[size_t(sparsetrain::bitmask_word(row0 + i, col, block_kv))] : 0u;
      }
    }
    auto ballot = [&](int g, int key, uint32_t) {
      uint32_t b = 0;
      for (int l = 0; l < 32; ++l) b |= ((words[l][g] >> (key & 31)) & 1u) << l;
      return b;
    };
    for (int lane = 0; lane < 32; ++lane) {
      const int t = warp * 32 + lane;
      const auto c = coord_of(t);
      auto frag = cute::partition_fragment_C(mma, cute::Shape<cute::Int<N>, cute::Int<M>>{});
      auto s = cute::make_tensor(frag.data(), acc_rowcol(frag.layout()));
      for (int e = 0; e < int(cute::size(s)); ++e) s(e) = 0.f;
      mask_bits_transposed(s, c, key_end, words[lane], ballot);
      for (int i = 0; i < int(cute::size<0>(s)); ++i)
        for (int j = 0; j < int(cute::size<1>(s)); ++j) {
          const int key = int(cute::get<0>(c(i, j))), q = int(cute::get<1>(c(i, j)));
          const bool allowed = q < valid_rows && key < key_end && bit(row0 + q, 128 * sub_tile + key) != 0;
          ASSERT_EQ(s(i, j), allowed ? 0.f : -INFINITY) << "thread " << t << " key " << key << " row " << q;
        }
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

TEST(BwdMaskBits, TransposedTilesTakeEachElementsBitThroughTheWarpsBallots) {
  expect_bits_of_blocks<BwdTraits<cutlass::bfloat16_t, 64>>();
  expect_bits_of_blocks<BwdTraits<cutlass::bfloat16_t, 96>>();
  expect_bits_of_blocks<BwdTraits<cutlass::bfloat16_t, 128>>();
}

}  // namespace

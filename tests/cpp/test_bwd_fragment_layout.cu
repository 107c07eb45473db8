// The dQ tile's fragment order as the in-kernel conversion reads it (bwd_convert_dq_tile_warp,
// bwd_postprocess_sm90.cuh): values i..i+3 of consumer threads t..t+3 (t % 4 == 0, i % 4 == 0) are
// 8 adjacent columns of one row (values i, i + 1 of each thread, in thread order) and of the row 8
// below (i + 2, i + 3), so each row's piece is one 16-byte store. Checked against CuTe's partition
// of the dQ GEMM's accumulator for every head dim the kernels are built for (a wrong assumption
// would scramble dq for that head dim only: D = 96's wgmma block is 16 columns wide, D = 64's and
// 128's half of D). A host test: no GPU needed.
#include <gtest/gtest.h>

#include <set>
#include <utility>

#include "cuda/attention/bwd_traits_sm90.cuh"

namespace {

using namespace sparsetrain::cuda::attn;

template <class T>
void expect_quads_of_eight_columns() {
  typename T::MmaDq mma;
  const auto tile = cute::make_identity_tensor(cute::Shape<cute::Int<T::kBlockM>, cute::Int<T::kHeadDim>>{});
  auto at = [&](int t, int i) {
    const auto c = mma.get_thread_slice(t).partition_C(tile)(i);
    return std::pair<int, int>(int(cute::get<0>(c)), int(cute::get<1>(c)));
  };
  const int values = int(cute::size(mma.get_thread_slice(0).partition_C(tile)));
  ASSERT_EQ(values * T::kMmaThreads, T::kBlockM * T::kHeadDim);
  std::set<std::pair<int, int>> seen;
  for (int t = 0; t < T::kMmaThreads; t += 4)
    for (int i = 0; i < values; i += 4) {
      const auto [r, c] = at(t, i);
      ASSERT_EQ(c % 8, 0) << "D " << T::kHeadDim << " thread " << t << " value " << i;
      for (int j = 0; j < 4; ++j)
        for (int e = 0; e < 4; ++e) {
          const std::pair<int, int> want{r + 8 * (e / 2), c + 2 * j + e % 2};
          ASSERT_EQ(at(t + j, i + e), want) << "D " << T::kHeadDim << " thread " << t + j << " value " << i + e;
          seen.insert(want);
        }
    }
  EXPECT_EQ(int(seen.size()), T::kBlockM * T::kHeadDim);  // every element of the tile, once
}

TEST(BwdFragmentLayout, QuadsOfThreadsHoldEightAdjacentColumns) {
  expect_quads_of_eight_columns<BwdTraits<cutlass::bfloat16_t, 64>>();
  expect_quads_of_eight_columns<BwdTraits<cutlass::bfloat16_t, 96>>();
  expect_quads_of_eight_columns<BwdTraits<cutlass::bfloat16_t, 128>>();
  expect_quads_of_eight_columns<BwdTraits<cutlass::half_t, 128>>();
}

}  // namespace

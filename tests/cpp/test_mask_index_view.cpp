// The one mask-row view (src/common/attention/mask_index_view.h) on the CPU: broadcast leading dims, (b, h)
// slices, counts clamped to the list width (a device mask is never trusted), sorted-row search,
// and writes through the mutable view, each against plain index arithmetic.
#include <gtest/gtest.h>

#include <cstdint>
#include <limits>
#include <vector>

#include "common/attention/mask_index_view.h"
#include "host_tensor.h"

namespace st = sparsetrain;
using st::testing::HostTensor;

namespace {

// A [B, H, R, W] list whose entry (b, h, r, i) is 1000 b + 100 h + 10 r + i (sorted in i).
HostTensor numbered_list(int64_t B, int64_t H, int64_t R, int64_t W) {
  HostTensor t(st::DType::kInt32, {B, H, R, W});
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t r = 0; r < R; ++r)
        for (int64_t i = 0; i < W; ++i) t.set(((b * H + h) * R + r) * W + i, double(1000 * b + 100 * h + 10 * r + i));
  return t;
}

TEST(MaskIndexView, SizeOneLeadingDimsBroadcastOverTheAttentionsBatchAndHeads) {
  for (const auto& [B, H] : {std::pair<int64_t, int64_t>{1, 1}, {1, 3}, {2, 1}, {2, 3}}) {
    const HostTensor t = numbered_list(B, H, 4, 5);
    const st::MaskIndexView v = st::mask_index_view(t.view());
    EXPECT_EQ(v.width, 5);
    EXPECT_EQ(v.stride_b == 0, B == 1);
    EXPECT_EQ(v.stride_h == 0, H == 1);
    for (int64_t b = 0; b < 2; ++b)
      for (int64_t h = 0; h < 3; ++h)
        for (int64_t r = 0; r < 4; ++r)
          for (int64_t i = 0; i < 5; ++i) {
            const int64_t sb = B == 1 ? 0 : b, sh = H == 1 ? 0 : h;
            ASSERT_EQ(v.at(b, h, r, i), 1000 * sb + 100 * sh + 10 * r + i);
            ASSERT_EQ(v.slice(b, h).at(0, 0, r, i), v.at(b, h, r, i));
          }
  }
}

TEST(MaskIndexView, CountTensorsHaveNoWidthAndAbsentTensorsAreNull) {
  HostTensor counts(st::DType::kInt32, {2, 1, 3});
  for (int64_t i = 0; i < 6; ++i) counts.set(i, double(i));
  const st::MaskIndexView c = st::mask_index_view(counts.view());
  EXPECT_EQ(c.width, 0);
  EXPECT_EQ(c.stride_w, 0);
  EXPECT_EQ(c.at(1, 7, 2), 5) << "H = 1 broadcasts; a count is entry 0";
  const st::MaskIndexView absent = st::mask_index_view(st::TensorView());
  EXPECT_EQ(absent.data, nullptr);
  EXPECT_EQ(absent.slice(1, 1).data, nullptr);
}

TEST(MaskIndexView, CountsAreClampedToTheListWidth) {
  HostTensor counts(st::DType::kInt32, {1, 1, 4});
  const int32_t stored[] = {-3, 0, 4, 9};
  for (int64_t i = 0; i < 4; ++i) counts.set(i, stored[i]);
  const HostTensor list = numbered_list(1, 1, 4, 4);
  const st::MaskIndexView c = st::mask_index_view(counts.view()), l = st::mask_index_view(list.view());
  const int32_t want[] = {0, 0, 4, 4};
  for (int64_t r = 0; r < 4; ++r) EXPECT_EQ(st::clamp_count(c, l, 0, 0, r), want[r]) << "row " << r;
  EXPECT_EQ(st::clamp_count(c, st::MaskIndexView{}, 0, 0, 2), 0) << "no list: nothing to index";
  EXPECT_EQ(st::clamp_count(st::MaskIndexView{}, l, 0, 0, 2), 0) << "no counts: an empty list";
}

TEST(MaskIndexView, FindSearchesTheCountedPrefixOfASortedRow) {
  // A strided (non-contiguous last dim) list: every other int of a wider buffer.
  const HostTensor wide = numbered_list(1, 2, 3, 8);
  const int64_t shape[4] = {1, 2, 3, 4}, strides[4] = {48, 24, 8, 2};
  const st::TensorView v(wide.view().data(), st::DType::kInt32, shape, strides, 4);
  const st::MaskIndexView l = st::mask_index_view(v);
  EXPECT_EQ(l.stride_w, 2);
  for (int32_t count = 0; count <= 4; ++count)
    for (int32_t i = 0; i < 4; ++i) {
      const int32_t value = 100 + 10 * 2 + 2 * i;  // entry i of (b 0, h 1, r 2)
      EXPECT_EQ(st::find_sorted(l, 0, 1, 2, count, value), i < count ? i : -1) << "count " << count << " i " << i;
      EXPECT_EQ(st::find_sorted(l, 0, 1, 2, count, value + 1), -1) << "between entries";
    }
  HostTensor counts(st::DType::kInt32, {1, 2, 3});
  for (int64_t i = 0; i < 6; ++i) counts.set(i, 99.0);  // past the width: clamped to 4
  EXPECT_EQ(st::find_in_row(st::mask_index_view(counts.view()), l, 0, 1, 2, 126), 3);
  EXPECT_EQ(st::find_sorted(st::MaskIndexView{}, 0, 0, 0, 0, 5), -1) << "an absent list holds nothing";
}

TEST(MaskIndexView, TheMutableViewWritesWhereTheReaderReads) {
  HostTensor t(st::DType::kInt32, {2, 1, 3, 4});
  const st::MaskIndexOut out = st::mask_index_view<int32_t>(t.view()).slice(1, 0);
  out.at(0, 0, 2, 3) = 77;
  EXPECT_EQ(st::mask_index_view(t.view()).at(1, 5, 2, 3), 77);
  EXPECT_EQ(t.get(((1 * 1 + 0) * 3 + 2) * 4 + 3), 77.0);
}


// The backward walk indexes the lists in int32 (row_in<int32_t>) after the CUDA backend's
// offsets_fit_int32 check: both must agree with plain int64 arithmetic.
TEST(MaskIndexView, Int32OffsetsEqualInt64OnesAndTheFitCheckIsExact) {
  for (const auto& [B, H] : {std::pair<int64_t, int64_t>{1, 1}, {2, 3}}) {
    const HostTensor t = numbered_list(B, H, 4, 5);
    const st::MaskIndexView v = st::mask_index_view(t.view());
    EXPECT_TRUE(st::offsets_fit_int32(t.view()));
    EXPECT_EQ(st::max_element_offset(t.view()), B * H * 4 * 5 - 1);
    for (int64_t b = 0; b < 2; ++b)
      for (int64_t h = 0; h < 3; ++h)
        for (int64_t r = 0; r < 4; ++r) {
          ASSERT_EQ(v.row_in<int32_t>(b, h, r), v.row(b, h, r));
          ASSERT_EQ(st::clamp_count<int32_t>(v, v, b, h, r), st::clamp_count(v, v, b, h, r));
          const int32_t value = int32_t(v.at(b, h, r, 3));
          ASSERT_EQ(st::find_in_row<int32_t>(v, v, b, h, r, value), st::find_in_row(v, v, b, h, r, value));
        }
  }
  EXPECT_EQ(st::max_element_offset(st::TensorView()), 0);
  // Views over no real memory (never read): the largest offset just below / at 2^31.
  int32_t cell = 0;
  const int64_t half = int64_t(1) << 30;
  const int64_t shape[] = {3, 2, 2}, fits[] = {half - 1, 1, 0}, too_far[] = {half - 1, 1, 1};
  const st::TensorView below(&cell, st::DType::kInt32, shape, fits, 3);
  const st::TensorView at(&cell, st::DType::kInt32, shape, too_far, 3);
  EXPECT_EQ(st::max_element_offset(below), (int64_t(1) << 31) - 1);
  EXPECT_TRUE(st::offsets_fit_int32(below));
  EXPECT_EQ(st::max_element_offset(at), int64_t(1) << 31);
  EXPECT_FALSE(st::offsets_fit_int32(at));
  // Absurd strides saturate instead of wrapping back below 2^31.
  const int64_t huge[] = {int64_t(1) << 62, 1, 1}, most_negative[] = {std::numeric_limits<int64_t>::min(), 1, 1};
  EXPECT_EQ(st::max_element_offset(st::TensorView(&cell, st::DType::kInt32, shape, huge, 3)),
            std::numeric_limits<int64_t>::max());
  EXPECT_FALSE(st::offsets_fit_int32(st::TensorView(&cell, st::DType::kInt32, shape, most_negative, 3)));
}

}  // namespace

// Exact fp32 <-> bf16/fp16 conversions, checked against an independent nearest-value search over
// every representable 16-bit value (ties to even), plus the special values.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <vector>

#include "sparsetrain/dtype.h"

namespace st = sparsetrain;

namespace {

// All finite values of a 16-bit format with their bit patterns, sorted by value (negative zero
// dropped: it compares equal to +0).
template <typename H>
std::vector<std::pair<double, uint16_t>> finite_table() {
  std::vector<std::pair<double, uint16_t>> t;
  for (uint32_t b = 0; b < 0x10000; ++b) {
    const float f = st::to_float(H{uint16_t(b)});
    if (std::isfinite(f) && !(f == 0 && std::signbit(f))) t.push_back({double(f), uint16_t(b)});
  }
  std::sort(t.begin(), t.end());
  return t;
}

// Nearest representable value of v, ties to the even pattern; +-inf past the overflow threshold.
template <typename H>
double nearest(const std::vector<std::pair<double, uint16_t>>& t, double v, double overflow) {
  if (std::fabs(v) >= overflow) return v > 0 ? INFINITY : -INFINITY;
  auto hi = std::lower_bound(t.begin(), t.end(), std::make_pair(v, uint16_t(0)));
  if (hi == t.begin()) return hi->first;
  if (hi == t.end()) return std::prev(hi)->first;
  auto lo = std::prev(hi);
  const double dl = v - lo->first, dh = hi->first - v;
  if (dl < dh) return lo->first;
  if (dh < dl) return hi->first;
  return (lo->second & 1) == 0 ? lo->first : hi->first;
}

template <typename H, typename ToH>
void check_rounding(ToH to_h, double max_finite, double ulp_at_max, const char* name) {
  const auto table = finite_table<H>();
  const double overflow = max_finite + ulp_at_max / 2;  // halfway to the next power: ties go to inf
  std::mt19937_64 rng(1234);
  std::uniform_int_distribution<uint32_t> bits;
  int checked = 0;
  for (int i = 0; i < 400000; ++i) {
    uint32_t b = bits(rng);
    if (i % 4 == 1) b = (b & 0x8000ffffu) | (uint32_t(103 + (i / 4) % 48) << 23);  // near fp16's range
    if (i % 4 == 2) b = (b & 0xffff0000u) | 0x8000u;                              // exact bf16 ties
    if (i % 4 == 3) b = (b & 0xffffe000u) | 0x1000u;                              // exact fp16 ties
    const float f = st::bits_float(b);
    if (!std::isfinite(f)) continue;
    const double want = nearest<H>(table, double(f), overflow);
    const float got = st::to_float(to_h(f));
    ASSERT_EQ(double(got), want) << name << " of " << f << " (bits 0x" << std::hex << b << ")";
    if (want == 0) {
      ASSERT_EQ(std::signbit(got), std::signbit(f)) << name << " keeps the sign of zero";
    }
    ++checked;
  }
  EXPECT_GT(checked, 300000);
}

}  // namespace

TEST(DType, SizesAndNames) {
  EXPECT_EQ(st::dtype_size(st::DType::kBF16), 2u);
  EXPECT_EQ(st::dtype_size(st::DType::kFP16), 2u);
  EXPECT_EQ(st::dtype_size(st::DType::kFP32), 4u);
  EXPECT_EQ(st::dtype_size(st::DType::kInt32), 4u);
  EXPECT_EQ(st::dtype_size(st::DType::kInt64), 8u);
  EXPECT_STREQ(st::dtype_name(st::DType::kBF16), "bf16");
  EXPECT_TRUE(st::is_floating(st::DType::kFP16));
  EXPECT_FALSE(st::is_floating(st::DType::kInt64));
}

TEST(DType, Bf16RoundTripsEveryPattern) {
  for (uint32_t b = 0; b < 0x10000; ++b) {
    const float f = st::to_float(st::bf16_t{uint16_t(b)});
    if (std::isnan(f)) {
      EXPECT_TRUE(std::isnan(st::to_float(st::to_bf16(f))));
      continue;
    }
    ASSERT_EQ(st::to_bf16(f).bits, b) << "bf16 pattern " << b;
  }
}

TEST(DType, Fp16RoundTripsEveryPattern) {
  for (uint32_t b = 0; b < 0x10000; ++b) {
    const float f = st::to_float(st::fp16_t{uint16_t(b)});
    if (std::isnan(f)) {
      EXPECT_TRUE(std::isnan(st::to_float(st::to_fp16(f))));
      continue;
    }
    ASSERT_EQ(st::to_fp16(f).bits, b) << "fp16 pattern " << b;
  }
}

TEST(DType, Fp16KnownValues) {
  EXPECT_EQ(st::to_float(st::fp16_t{0x3c00}), 1.0f);
  EXPECT_EQ(st::to_float(st::fp16_t{0x7bff}), 65504.0f);
  EXPECT_EQ(st::to_float(st::fp16_t{0x0001}), std::ldexp(1.0f, -24));  // smallest subnormal
  EXPECT_EQ(st::to_float(st::fp16_t{0x0400}), std::ldexp(1.0f, -14));  // smallest normal
  EXPECT_TRUE(std::isinf(st::to_float(st::to_fp16(65520.0f))));
  EXPECT_EQ(st::to_fp16(65519.0f).bits, 0x7bff);
  EXPECT_EQ(st::to_fp16(std::ldexp(1.0f, -25)).bits, 0x0000);        // tie to even: 0
  EXPECT_EQ(st::to_fp16(std::ldexp(3.0f, -25)).bits, 0x0002);        // tie to even: 2
  EXPECT_EQ(st::to_fp16(-std::ldexp(1.0f, -26)).bits, 0x8000);       // -0
}

TEST(DType, Bf16RoundsToNearestEven) {
  check_rounding<st::bf16_t>([](float f) { return st::to_bf16(f); }, double(st::to_float(st::bf16_t{0x7f7f})),
                             std::ldexp(1.0, 127 - 7), "bf16");
}

TEST(DType, Fp16RoundsToNearestEven) {
  check_rounding<st::fp16_t>([](float f) { return st::to_fp16(f); }, 65504.0, 32.0, "fp16");
}

TEST(DType, NaNStaysNaNAndInfStaysInf) {
  const float nan = std::nanf(""), inf = INFINITY;
  EXPECT_TRUE(std::isnan(st::to_float(st::to_bf16(nan))));
  EXPECT_TRUE(std::isnan(st::to_float(st::to_fp16(nan))));
  EXPECT_TRUE(std::isnan(st::to_float(st::to_bf16(st::bits_float(0x7f800001u)))));  // signalling NaN
  EXPECT_TRUE(std::isnan(st::to_float(st::to_fp16(st::bits_float(0x7f800001u)))));
  EXPECT_EQ(st::to_float(st::to_bf16(-inf)), -inf);
  EXPECT_EQ(st::to_float(st::to_fp16(inf)), inf);
}

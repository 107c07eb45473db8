// e4m3 encode / decode (src/common/fp8_e4m3.h) against oracles written from the e4m3fn
// definition (tests/support/fp8_testing.h): every code's value, every midpoint between neighbours,
// random values against the exhaustive nearest code, saturation, NaN and signed zero, and the
// scaled encoding's exactness where an fp32 product would round or flush.
#include <gtest/gtest.h>

#include <cfloat>
#include <cmath>
#include <random>

#include "common/fp8_e4m3.h"
#include "fp8_testing.h"

namespace st = sparsetrain;
using st::testing::e4m3_nearest;
using st::testing::e4m3_value;

namespace {

std::string hex(unsigned v) {
  char b[16];
  std::snprintf(b, sizeof b, "0x%02X", v);
  return b;
}

TEST(E4M3, EveryCodeDecodesToItsDefinedValue) {
  for (int b = 0; b < 256; ++b) {
    const float got = st::e4m3_decode(uint8_t(b));
    const double want = e4m3_value(uint8_t(b));
    if (std::isnan(want)) {
      EXPECT_TRUE(std::isnan(got)) << hex(unsigned(b));
      EXPECT_TRUE((b & 0x7F) == 0x7F) << hex(unsigned(b));
    } else {
      EXPECT_EQ(double(got), want) << hex(unsigned(b));
      EXPECT_EQ(std::signbit(got), b >= 0x80) << hex(unsigned(b)) << ": the sign, zero included";
    }
  }
  EXPECT_EQ(st::e4m3_decode(0x7E), 448.f);
  EXPECT_EQ(st::e4m3_decode(0x01), std::ldexp(1.f, -9));
  EXPECT_EQ(st::e4m3_decode(0x08), std::ldexp(1.f, -6));
}

TEST(E4M3, EncodingEveryFiniteCodesValueGivesTheCodeBack) {
  for (int b = 0; b < 256; ++b) {
    if ((b & 0x7F) == 0x7F) continue;
    EXPECT_EQ(unsigned(st::e4m3_encode(float(e4m3_value(uint8_t(b))))), unsigned(b)) << hex(unsigned(b));
  }
}

// The midpoint of two neighbouring codes goes to the even one; a step either side of it, to the
// nearer. Both signs; from 0 | smallest subnormal up to 416 | 448 (0x7D | 0x7E).
TEST(E4M3, MidpointsRoundToEvenAndNeighboursToTheNearer) {
  for (int b = 0; b < 0x7E; ++b) {
    const double lo = e4m3_value(uint8_t(b)), hi = e4m3_value(uint8_t(b + 1));
    const float mid = float((lo + hi) / 2);
    ASSERT_EQ(double(mid), (lo + hi) / 2) << "midpoints have 5 significant bits: exact in fp32";
    const unsigned even = (b & 1) == 0 ? unsigned(b) : unsigned(b + 1);
    for (const unsigned sign : {0u, 0x80u}) {
      const float s = sign ? -1.f : 1.f;
      EXPECT_EQ(unsigned(st::e4m3_encode(s * mid)), sign | even) << "midpoint of " << hex(unsigned(b));
      EXPECT_EQ(unsigned(st::e4m3_encode(s * std::nextafter(mid, 0.f))), sign | unsigned(b)) << hex(unsigned(b));
      EXPECT_EQ(unsigned(st::e4m3_encode(s * std::nextafter(mid, 1e9f))), sign | unsigned(b + 1)) << hex(unsigned(b));
    }
  }
}

// Random fp32 values over e4m3's range and beyond (2^-14 .. 2^10, fp32 subnormals, both signs).
TEST(E4M3, RandomValuesEncodeToTheNearestCode) {
  std::mt19937_64 rng(20260301);
  std::uniform_int_distribution<uint32_t> mant(0, 0x7fffff), expo(127 - 14, 127 + 10), tiny(1, 0x7fffff);
  for (int i = 0; i < 200000; ++i) {
    const uint32_t sign = (rng() & 1) << 31;
    const uint32_t bits = i % 16 == 0 ? sign | tiny(rng) : sign | expo(rng) << 23 | mant(rng);
    const float x = st::bits_float(bits);
    ASSERT_EQ(unsigned(st::e4m3_encode(x)), unsigned(e4m3_nearest(double(x)))) << "x = " << x;
  }
}

TEST(E4M3, ValuesPastTheLargestSaturate) {
  for (const float x : {448.f, std::nextafter(448.f, 1e9f), 463.99f, 464.f, std::nextafter(464.f, 1e9f), 480.f,
                        511.f, 512.f, 1e30f, FLT_MAX, INFINITY}) {
    EXPECT_EQ(st::e4m3_encode(x), 0x7E) << x;
    EXPECT_EQ(st::e4m3_encode(-x), 0xFE) << -x;
  }
  // The same past 448 * 2^e for a scale exponent e, however large or small.
  for (const int e : {-126, -40, -1, 1, 100, 119}) {
    const float edge = std::ldexp(448.f, e);
    EXPECT_EQ(st::e4m3_encode_scaled(edge, e), 0x7E) << e;
    EXPECT_EQ(st::e4m3_encode_scaled(std::nextafter(edge, INFINITY), e), 0x7E) << e;
    EXPECT_EQ(st::e4m3_encode_scaled(-std::nextafter(edge, INFINITY), e), 0xFE) << e;
  }
}

TEST(E4M3, NaNStaysNaNAndZeroKeepsItsSign) {
  for (const uint32_t nan_bits : {0x7fc00000u, 0xffc00000u, 0x7f800001u, 0xff812345u, 0x7fffffffu}) {
    EXPECT_EQ(st::e4m3_encode(st::bits_float(nan_bits)), st::kE4M3NaN);
    EXPECT_EQ(st::e4m3_encode_scaled(st::bits_float(nan_bits), 50), st::kE4M3NaN);
  }
  EXPECT_TRUE(std::isnan(st::e4m3_decode(0x7F)));
  EXPECT_TRUE(std::isnan(st::e4m3_decode(0xFF)));
  EXPECT_EQ(st::e4m3_encode(0.f), 0x00);
  EXPECT_EQ(st::e4m3_encode(-0.f), 0x80);
  EXPECT_EQ(st::e4m3_encode(-1e-30f), 0x80) << "a negative value rounding to zero keeps its sign";
  EXPECT_EQ(st::e4m3_encode(-std::ldexp(1.f, -10)), 0x80) << "half of the smallest subnormal: a tie to even, 0";
  EXPECT_EQ(st::e4m3_encode(-std::ldexp(1.5f, -10)), 0x81);
  EXPECT_TRUE(std::signbit(st::e4m3_decode(0x80)));
}

// e4m3_encode_scaled(x, e) rounds the exact x * 2^-e once: against the exhaustive nearest code of
// that value in double, including fp32 subnormal x (whose fp32 product would be inexact or
// flushed) and products an fp32 multiply would underflow.
TEST(E4M3, ScaledEncodingRoundsTheExactProductOnce) {
  std::mt19937_64 rng(20260302);
  std::uniform_int_distribution<int> es(-126, 126);
  std::uniform_int_distribution<uint32_t> bits(0, 0xffffffffu);
  int checked = 0;
  while (checked < 100000) {
    const float x = st::bits_float(bits(rng));
    if (!std::isfinite(x)) continue;
    // An e near x's own binade, so that most products land in e4m3's range.
    int ex = 0;
    std::frexp(x, &ex);
    const int e = std::max(-126, std::min(126, ex - 8 + int(rng() % 24) - 12 + (rng() % 8 == 0 ? es(rng) : 0)));
    ASSERT_EQ(unsigned(st::e4m3_encode_scaled(x, e)), unsigned(e4m3_nearest(std::ldexp(double(x), -e))))
        << "x = " << x << ", e = " << e;
    ++checked;
  }
  // 3 * 2^-149 (an fp32 subnormal) * 2^140 = 3 * 2^-9: code 0x03, with no fp32 value in between.
  EXPECT_EQ(st::e4m3_encode_scaled(st::bits_float(3u), -140), 0x03);
  // 2^-100 * 2^-119 is far below fp32's range but e4m3 rounds it to 0, as the exact value says.
  EXPECT_EQ(st::e4m3_encode_scaled(std::ldexp(1.f, -100), 119), 0x00);
}

}  // namespace

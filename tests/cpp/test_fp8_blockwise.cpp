// The FP8 recipe's blockwise scaling (src/common/fp8_blockwise.h) and the CPU quantizers and
// dequantizers (src/reference/fp8_blockwise_reference.cpp): the scale rule against a search
// oracle, every layout's index function a bijection onto its range, and each quantizer's scales
// and codes against the definitions (tile amax -> exponent by search, nearest code by exhaustive
// search, scale slots by the layouts' formulas written out here), with the round-trip bound,
// untouched tails, non-finite tiles, and tiles that never span two experts.
#include <gtest/gtest.h>

#include <cfloat>
#include <cmath>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "common/fp8_blockwise.h"
#include "fp8_testing.h"

namespace st = sparsetrain;
using st::testing::e4m3_nearest;
using st::testing::e4m3_value;
using st::testing::Fp8Operand;
using st::testing::HostTensor;
using st::testing::kPoisonScaleBits;
using st::testing::offsets_of;

namespace {

// Matrix shapes for the block layouts: one element, partial edges both ways, exact blocks.
const std::vector<std::pair<int64_t, int64_t>> kBlockShapes = {{1, 1}, {200, 130}, {129, 300}, {128, 128}, {257, 5}};

constexpr int kMin = st::kFp8ScaleExpMin, kMax = st::kFp8ScaleExpMax;
constexpr uint32_t kNaNScaleBits = 0x7fc00000u;

int oracle_exponent(double amax) { return st::testing::scale_exponent_oracle(amax, kMin, kMax); }

// ---- the scale rule --------------------------------------------------------------------------

TEST(Fp8Scale, AmaxAt448TimesPowersOfTwoAndOneStepEitherSide) {
  for (int k = kMin; k <= 119; ++k) {  // 448 * 2^120 is past fp32's range
    const float a = std::ldexp(448.f, k);
    EXPECT_EQ(st::fp8_scale_exponent(a), k) << k;
    EXPECT_EQ(st::fp8_scale_exponent(std::nextafter(a, INFINITY)), k + 1) << k;
    EXPECT_EQ(st::fp8_scale_exponent(std::nextafter(a, 0.f)), k) << k;
    EXPECT_EQ(st::fp8_scale(a), std::ldexp(1.f, k)) << k;
    EXPECT_EQ(st::fp8_scale_exponent(std::ldexp(1.f, k + 8)), k) << "2^(k+8) <= 448 * 2^k";
  }
  EXPECT_EQ(st::fp8_scale_exponent(448.f), 0);
  EXPECT_EQ(st::fp8_scale_exponent(449.f), 1);
  EXPECT_EQ(st::fp8_scale_exponent(1.f), -8);
  EXPECT_EQ(st::fp8_scale_exponent(FLT_MAX), 120) << "the largest any finite fp32 amax reaches: below the clamp";
}

TEST(Fp8Scale, RandomAmaxMatchesTheSearch) {
  std::mt19937_64 rng(20260303);
  for (int i = 0; i < 200000; ++i) {
    const uint32_t bits = uint32_t(rng()) & 0x7fffffffu;
    const float a = st::bits_float(bits);
    if (!std::isfinite(a)) continue;
    ASSERT_EQ(st::fp8_scale_exponent(a), oracle_exponent(double(a))) << a;
  }
}

TEST(Fp8Scale, ZeroAmaxGivesOneAndNonFiniteGivesNaN) {
  EXPECT_EQ(st::fp8_scale(0.f), 1.f);
  EXPECT_EQ(st::fp8_scale(-0.f), 1.f);
  for (const float a : {INFINITY, -INFINITY, NAN, st::bits_float(0xff812345u)}) {
    EXPECT_EQ(st::float_bits(st::fp8_scale(a)), kNaNScaleBits) << a;
    EXPECT_EQ(st::fp8_quantize(1.f, st::fp8_scale(a)), st::kE4M3NaN);
  }
}

TEST(Fp8Scale, AmaxFoldSeesEveryNaNAndInf) {
  float amax = 0.f;
  for (const float x : {1.f, -3.f, 2.f}) amax = st::fp8_amax(amax, x);
  EXPECT_EQ(amax, 3.f);
  EXPECT_FALSE(st::fp8_amax_finite(st::fp8_amax(st::fp8_amax(amax, NAN), 5.f))) << "NaN, then a larger number";
  EXPECT_FALSE(st::fp8_amax_finite(st::fp8_amax(amax, -INFINITY)));
  EXPECT_TRUE(st::fp8_amax_finite(st::fp8_amax(amax, -FLT_MAX)));
}

// ---- layouts: bijections onto their ranges ---------------------------------------------------

// Splits with empty experts, 1..127 rows, 128, 129 and 300 rows, and often a padded tail.
std::vector<int64_t> awkward_splits(std::mt19937_64& rng, int64_t& T) {
  const int64_t sizes[] = {0, 0, 128, 129, 300, 1, 127};
  const int64_t G = 1 + int64_t(rng() % 9);
  std::vector<int64_t> s;
  for (int64_t g = 0; g < G; ++g) s.push_back(rng() % 2 ? sizes[rng() % 7] : int64_t(1 + rng() % 127));
  T = 0;
  for (int64_t v : s) T += v;
  if (rng() % 2) T += 1 + int64_t(rng() % 200);
  return s;
}

struct Hits {
  std::vector<int> count;
  explicit Hits(int64_t n) : count(size_t(n), 0) {}
  void add(int64_t i) {
    ASSERT_GE(i, 0);
    ASSERT_LT(i, int64_t(count.size()));
    ++count[size_t(i)];
  }
  // Exactly the slots [0, used) hit, once each.
  void expect_exactly_first(int64_t used, const std::string& what) const {
    for (int64_t i = 0; i < int64_t(count.size()); ++i)
      ASSERT_EQ(count[size_t(i)], i < used ? 1 : 0) << what << ": slot " << i;
  }
};

// f(splits, offsets, T) for 60 lists of awkward splits.
template <class F>
void for_awkward_splits(uint64_t seed, F f) {
  std::mt19937_64 rng(seed);
  for (int trial = 0; trial < 60; ++trial) {
    int64_t T = 0;
    const std::vector<int64_t> splits = awkward_splits(rng, T);
    f(splits, offsets_of(splits, T), T);
    if (::testing::Test::HasFatalFailure()) return;
  }
}

TEST(Fp8Layout, RowwiseScalesAreABijectionOntoTheGroupedRows) {
  for_awkward_splits(20260304, [](const std::vector<int64_t>& splits, const std::vector<int64_t>& off, int64_t T) {
    const int64_t G = int64_t(splits.size()), S = off.back();
    for (const int64_t K : {1, 8, 127, 128, 129, 200, 1000}) {
      const int64_t KB = st::fp8_tiles(K);
      Hits h(st::fp8_rowwise_scale_count(T, K));
      for (int64_t g = 0; g < G; ++g)
        for (int64_t r = off[size_t(g)]; r < off[size_t(g) + 1]; ++r)
          for (int64_t kb = 0; kb < KB; ++kb)
            h.add(st::fp8_rowwise_scale_index(off[size_t(g)], splits[size_t(g)], KB, r, kb));
      h.expect_exactly_first(S * KB, "rowwise K " + std::to_string(K));
    }
  });
  // One group: [KB, T].
  for (int64_t r = 0; r < 300; ++r)
    for (int64_t kb = 0; kb < 3; ++kb) ASSERT_EQ(st::fp8_rowwise_scale_index(0, 300, 3, r, kb), kb * 300 + r);
}

TEST(Fp8Layout, ColumnwiseTilesRestartPerExpertAndTheirScalesAreABijection) {
  for_awkward_splits(20260305, [](const std::vector<int64_t>& splits, const std::vector<int64_t>& off, int64_t T) {
    const int64_t G = int64_t(splits.size()), S = off.back();
    int64_t tiles = 0;  // each expert's ceil(M_g / 128), from the definition
    for (int64_t g = 0; g < G; ++g) {
      ASSERT_EQ(st::fp8_columnwise_tile_base(off.data(), g), tiles);
      tiles += (splits[size_t(g)] + 127) / 128;
    }
    ASSERT_EQ(st::fp8_columnwise_tile_base(off.data(), G), tiles);
    ASSERT_LE(tiles, st::fp8_columnwise_max_tiles(T, G));
    const int64_t columns = st::fp8_columnwise_columns(T, G);
    ASSERT_EQ(columns % 16, 0) << "rows of codes on 16-byte boundaries";
    for (const int64_t C : {1, 3, 130}) {
      Hits scales(st::fp8_columnwise_scale_count(T, C, G)), data(C * columns);
      for (int64_t g = 0; g < G; ++g) {
        const int64_t base = st::fp8_columnwise_tile_base(off.data(), g);
        for (int64_t t = 0; t < st::fp8_tiles(splits[size_t(g)]); ++t)
          for (int64_t c = 0; c < C; ++c) scales.add(st::fp8_columnwise_scale_index(base, t, C, c));
        for (int64_t r = off[size_t(g)]; r < off[size_t(g) + 1]; ++r)
          for (int64_t c = 0; c < C; ++c) {
            const int64_t i = st::fp8_columnwise_data_index(columns, base, off[size_t(g)], r, c);
            ASSERT_EQ(i, c * columns + 128 * base + r - off[size_t(g)]);
            ASSERT_EQ((c * columns + 128 * base) % 16, 0) << "an expert's codes start on a 16-byte boundary";
            data.add(i);
          }
      }
      scales.expect_exactly_first(tiles * C, "columnwise scales C " + std::to_string(C));
      int64_t hits = 0;
      for (const int n : data.count) {
        ASSERT_LE(n, 1);
        hits += n;
      }
      ASSERT_EQ(hits, S * C);
    }
  });
}

TEST(Fp8Layout, ColumnwiseTileBoundHoldsForTheWorstSplits) {
  for (const int64_t M : {1, 127, 128, 129, 255, 257}) {
    const int64_t G = 50, T = G * M + 3;
    const std::vector<int64_t> off = offsets_of(std::vector<int64_t>(size_t(G), M), T);
    EXPECT_LE(st::fp8_columnwise_tile_base(off.data(), G), st::fp8_columnwise_max_tiles(T, G)) << M;
  }
}

TEST(Fp8Layout, BlockScalesAreABijectionInBothOrientations) {
  for (const auto& [R, C] : kBlockShapes) {
    Hits h(st::fp8_block_scale_count(R, C)), ht(st::fp8_block_scale_count(C, R));
    for (int64_t i = 0; i < R; i += 128)
      for (int64_t j = 0; j < C; j += 128) {
        h.add(st::fp8_block_scale_index(C, i, j));
        ht.add(st::fp8_block_scale_index(R, j, i));
      }
    h.expect_exactly_first(st::fp8_block_scale_count(R, C), "blocks");
    ht.expect_exactly_first(st::fp8_block_scale_count(C, R), "transposed blocks");
    for (int64_t i = 0; i < R; ++i)  // every element in its block's slot: the grid is row-major
      for (int64_t j = 0; j < C; ++j)
        ASSERT_EQ(st::fp8_block_scale_index(C, i, j), (i / 128) * ((C + 127) / 128) + j / 128);
  }
}

// ---- quantizers against the definitions --------------------------------------------------------

// One tile: elements (value, code position) and the scale slot. Checks the scale against the
// search oracle of the tile's amax, every code against the nearest code of x * 2^-e, and the
// dequantized value (when given) as the exact product and within the round-trip bound:
// |x - x'| <= max(2^-4 |x|, 2^(e-10)) (half a spacing: 3 mantissa bits, subnormal spacing 2^(e-9)).
struct TileCheck {
  const Fp8Operand& q;
  const HostTensor* deq;  // fp32 dequantized values, or null
  std::string name;
  void operator()(const std::vector<double>& x, const std::vector<int64_t>& code_at,
                  const std::vector<int64_t>& deq_at, int64_t scale_slot) const {
    double amax = 0;
    bool finite = true;
    for (double v : x) {
      finite = finite && std::isfinite(v);
      amax = std::max(amax, std::fabs(v));
    }
    if (!finite) {
      ASSERT_EQ(q.scale_bits(scale_slot), kNaNScaleBits) << name;
      for (int64_t i : code_at) ASSERT_EQ(q.code(i), st::kE4M3NaN) << name;
      return;
    }
    const int e = oracle_exponent(amax);
    ASSERT_EQ(double(q.scale_at(scale_slot)), std::ldexp(1.0, e)) << name << ": scale slot " << scale_slot;
    for (size_t i = 0; i < x.size(); ++i) {
      const uint8_t c = q.code(code_at[i]);
      ASSERT_EQ(unsigned(c), unsigned(e4m3_nearest(std::ldexp(x[i], -e)))) << name << ": x = " << x[i] << ", e = " << e;
      if (!deq) continue;
      const double got = deq->get(deq_at[i]), want = std::ldexp(e4m3_value(c), e);
      ASSERT_EQ(got, want) << name << ": dequantized exactly";
      ASSERT_LE(std::fabs(x[i] - got), std::max(std::ldexp(std::fabs(x[i]), -4), std::ldexp(1.0, e - 10)))
          << name << ": x = " << x[i];
    }
  }
};

// Values over a wide range: uniform rows and rows whose elements span 2^-30 .. 2^30 (so that
// tiles hold e4m3 subnormals and zeros), in the given dtype.
HostTensor random_matrix(st::DType dtype, int64_t R, int64_t C, std::mt19937_64& rng) {
  HostTensor t(dtype, {R, C});
  std::uniform_real_distribution<double> u(-1, 1);
  std::uniform_int_distribution<int> ex(dtype == st::DType::kFP16 ? -14 : -30, dtype == st::DType::kFP16 ? 12 : 30);
  for (int64_t r = 0; r < R; ++r) {
    const bool wide = r % 3 == 1;
    const int row_exp = ex(rng) / 2;
    for (int64_t c = 0; c < C; ++c) t.set(r * C + c, std::ldexp(u(rng), wide ? ex(rng) : row_exp));
  }
  return t;
}

struct QuantCase {
  st::DType dtype;
  std::vector<int64_t> splits;
  int64_t T, K;
};
std::string quant_case_name(const ::testing::TestParamInfo<QuantCase>& info) {
  const QuantCase& c = info.param;
  int64_t S = 0;
  for (int64_t s : c.splits) S += s;
  return std::string(st::dtype_name(c.dtype)) + "_G" + std::to_string(c.splits.size()) + "_T" + std::to_string(c.T) +
         "_S" + std::to_string(S) + "_K" + std::to_string(c.K);
}

class Fp8Quantizers : public ::testing::TestWithParam<QuantCase> {};

TEST_P(Fp8Quantizers, RowwiseMatchesTheDefinitionAndLeavesTheTail) {
  const QuantCase& c = GetParam();
  std::mt19937_64 rng(uint64_t(c.T * 1009 + c.K));
  const HostTensor x = random_matrix(c.dtype, c.T, c.K, rng);
  const std::vector<int64_t> off = offsets_of(c.splits, c.T);
  const Fp8Operand q = st::testing::quantize_rowwise(x, off);
  const HostTensor d = st::testing::dequantize_rowwise(q, off, c.T, c.K);
  const int64_t KB = (c.K + 127) / 128, S = off.back();
  const TileCheck check{q, &d, "rowwise"};
  for (size_t g = 0; g < c.splits.size(); ++g)
    for (int64_t r = off[g]; r < off[g + 1]; ++r)
      for (int64_t kb = 0; kb < KB; ++kb) {
        std::vector<double> v;
        std::vector<int64_t> at;
        for (int64_t k = kb * 128; k < std::min(c.K, kb * 128 + 128); ++k) {
          v.push_back(x.get(r * c.K + k));
          at.push_back(r * c.K + k);
        }
        check(v, at, at, off[g] * KB + kb * c.splits[g] + (r - off[g]));  // grouped M-major
        if (HasFatalFailure()) return;
      }
  for (int64_t i = S * c.K; i < c.T * c.K; ++i) ASSERT_EQ(q.code(i), 0xFF) << "tail code " << i << " written";
  for (int64_t i = S * KB; i < c.T * KB; ++i) ASSERT_EQ(q.scale_bits(i), kPoisonScaleBits) << "slot " << i;
  for (int64_t i = S * c.K; i < c.T * c.K; ++i) ASSERT_TRUE(std::isnan(d.get(i))) << "tail dequantized";
}

TEST_P(Fp8Quantizers, ColumnwiseMatchesTheDefinitionAndLeavesTheTail) {
  const QuantCase& c = GetParam();
  const int64_t C = c.K;
  std::mt19937_64 rng(uint64_t(c.T * 1013 + C));
  const HostTensor x = random_matrix(c.dtype, c.T, C, rng);
  const std::vector<int64_t> off = offsets_of(c.splits, c.T);
  const Fp8Operand q = st::testing::quantize_columnwise(x, off);
  const HostTensor d = st::testing::dequantize_columnwise(q, off, c.T, C);
  const int64_t S = off.back();
  const TileCheck check{q, &d, "columnwise"};
  // Codes [C, columns]: expert g's tokens from column 128 * (its first tile), the rest of its last
  // tile zero codes, every column past the experts' tiles untouched.
  const int64_t columns = q.data.view().size(1);
  ASSERT_EQ(columns % 128, 0);
  ASSERT_GE(columns, 128 * (c.T / 128 + int64_t(c.splits.size())));
  std::vector<bool> written(size_t(C * columns), false);
  int64_t tile = 0;  // global tile index: experts' tiles in order
  for (size_t g = 0; g < c.splits.size(); ++g) {
    const int64_t col0 = 128 * tile;
    for (int64_t r0 = off[g]; r0 < off[g + 1]; r0 += 128, ++tile)
      for (int64_t ch = 0; ch < C; ++ch) {
        std::vector<double> v;
        std::vector<int64_t> code_at, deq_at;
        for (int64_t r = r0; r < std::min(off[g + 1], r0 + 128); ++r) {
          v.push_back(x.get(r * C + ch));
          code_at.push_back(ch * columns + col0 + (r - off[g]));
          deq_at.push_back(r * C + ch);
        }
        check(v, code_at, deq_at, tile * C + ch);
        if (HasFatalFailure()) return;
      }
    for (int64_t ch = 0; ch < C; ++ch)
      for (int64_t col = col0; col < 128 * tile; ++col) {
        written[size_t(ch * columns + col)] = true;
        if (col - col0 >= off[g + 1] - off[g]) {
          ASSERT_EQ(q.code(ch * columns + col), 0) << "padding code " << col;
        }
      }
  }
  for (int64_t i = 0; i < C * columns; ++i)
    if (!written[size_t(i)]) {
      ASSERT_EQ(q.code(i), 0xFF) << "code " << i << " past the experts' tiles written";
    }
  for (int64_t i = tile * C; i < q.scale.numel(); ++i) ASSERT_EQ(q.scale_bits(i), kPoisonScaleBits) << "slot " << i;
  for (int64_t i = S * C; i < c.T * C; ++i) ASSERT_TRUE(std::isnan(d.get(i))) << "tail dequantized";
}

// The quantizers gathering as they read (src_rows, the MoE layer's rows straight from its tokens):
// bitwise the codes and scales of the gathered matrix, every slot the plain call leaves alone left
// alone too; rows repeat and come in any order, from a source of fewer rows than the operand (a
// top-k routing's layout) and of more.
TEST_P(Fp8Quantizers, GatheringAsTheyReadGivesTheGatheredMatrixsCodes) {
  const QuantCase& c = GetParam();
  std::mt19937_64 rng(uint64_t(c.T * 1019 + c.K));
  const std::vector<int64_t> off = offsets_of(c.splits, c.T);
  const int64_t G = int64_t(c.splits.size());
  for (const int64_t n : {c.T / 2 + 1, c.T + 5}) {
    SCOPED_TRACE("source rows " + std::to_string(n));
    const HostTensor x = random_matrix(c.dtype, n, c.K, rng);
    const st::testing::GatheredRows g = st::testing::gather_random_rows(x, c.T, rng);
    const Fp8Operand row = st::testing::quantize_rowwise(g.gathered, off);
    const Fp8Operand col = st::testing::quantize_columnwise(g.gathered, off);
    const Fp8Operand row_g = st::testing::quantize_rowwise(x, off, &g.rows);
    const Fp8Operand col_g = st::testing::quantize_columnwise(x, off, &g.rows);
    const Fp8Operand both_row = st::testing::rowwise_operand(x.view(), &g.rows);
    const Fp8Operand both_col = st::testing::columnwise_operand(x.view(), G, &g.rows);
    st::testing::fp8_ref().quantize_both({{G, off.data()}, x.view(), both_row.view(), both_col.view(), g.rows.view()},
                                         st::Stream{});
    auto same = [](const Fp8Operand& got, const Fp8Operand& want, const char* what) {
      EXPECT_TRUE(got.data.bytes_equal(want.data)) << what << " codes";
      EXPECT_TRUE(got.scale.bytes_equal(want.scale)) << what << " scales";
    };
    same(row_g, row, "rowwise");
    same(col_g, col, "columnwise");
    same(both_row, row, "both, rowwise");
    same(both_col, col, "both, columnwise");
  }
}

const QuantCase kQuantCases[] = {
    {st::DType::kBF16, {3, 0, 129, 128, 1, 0, 300}, 600, 200},
    {st::DType::kFP16, {127, 0, 2}, 140, 8},
    {st::DType::kFP32, {257, 0}, 257, 1000},
    {st::DType::kBF16, {0, 0}, 9, 129},  // only a padded tail
    {st::DType::kFP32, {5, 130, 1}, 136, 1},
    {st::DType::kFP16, {128}, 128, 128},
};
INSTANTIATE_TEST_SUITE_P(Reference, Fp8Quantizers, ::testing::ValuesIn(kQuantCases), quant_case_name);

TEST(Fp8Weights, BothCopiesMatchTheDefinitionAndEachOtherBitwise) {
  std::mt19937_64 rng(20260306);
  for (const st::DType dtype : {st::DType::kBF16, st::DType::kFP16, st::DType::kFP32})
    for (const auto& [out, in] : kBlockShapes) {
      SCOPED_TRACE(std::string(st::dtype_name(dtype)) + " out " + std::to_string(out) + " in " + std::to_string(in));
      const HostTensor w = random_matrix(dtype, out, in, rng);
      const st::testing::Fp8WeightPair p = st::testing::quantize_weight(w.view());
      const HostTensor d = st::testing::dequantize_blocks(p.w, out, in);
      const HostTensor dt = st::testing::dequantize_blocks(p.wt, in, out);
      const int64_t IB = (in + 127) / 128, OB = (out + 127) / 128;
      const TileCheck check{p.w, &d, "weight"};
      for (int64_t i0 = 0; i0 < out; i0 += 128)
        for (int64_t j0 = 0; j0 < in; j0 += 128) {
          std::vector<double> v;
          std::vector<int64_t> at;
          for (int64_t i = i0; i < std::min(out, i0 + 128); ++i)
            for (int64_t j = j0; j < std::min(in, j0 + 128); ++j) {
              v.push_back(w.get(i * in + j));
              at.push_back(i * in + j);
            }
          check(v, at, at, (i0 / 128) * IB + j0 / 128);
          if (HasFatalFailure()) return;
          ASSERT_EQ(p.wt.scale_bits((j0 / 128) * OB + i0 / 128), p.w.scale_bits((i0 / 128) * IB + j0 / 128));
        }
      for (int64_t i = 0; i < out; ++i)
        for (int64_t j = 0; j < in; ++j) {
          ASSERT_EQ(p.wt.code(j * out + i), p.w.code(i * in + j)) << "the copy is the transpose, byte for byte";
          ASSERT_EQ(st::float_bits(float(dt.get(j * out + i))), st::float_bits(float(d.get(i * in + j))));
        }
    }
}

// ---- edge cases of the rule through the quantizers --------------------------------------------

// An inf or NaN makes its own tile NaN (scale and every code) and no other.
TEST(Fp8NonFinite, ANonFiniteElementTurnsItsTileNaNAndNoOther) {
  std::mt19937_64 rng(20260307);
  const int64_t T = 6, K = 300;
  const std::vector<int64_t> off = offsets_of({2, 4}, T);
  HostTensor x = random_matrix(st::DType::kBF16, T, K, rng), clean = x;
  x.set(0 * K + 130, INFINITY);  // row 0, k block 1; columnwise: expert 0, channel 130
  x.set(3 * K + 290, NAN);       // row 3, k block 2 (the short one); expert 1, channel 290
  x.set(5 * K + 0, -INFINITY);   // row 5, k block 0; expert 1, channel 0
  const Fp8Operand q = st::testing::quantize_rowwise(x, off), qc = st::testing::quantize_rowwise(clean, off);
  const TileCheck check{q, nullptr, "rowwise non-finite"};
  for (size_t g = 0; g < 2; ++g)
    for (int64_t r = off[g]; r < off[g + 1]; ++r)
      for (int64_t kb = 0; kb < 3; ++kb) {
        std::vector<double> v;
        std::vector<int64_t> at;
        for (int64_t k = kb * 128; k < std::min(K, kb * 128 + 128); ++k) {
          v.push_back(x.get(r * K + k));
          at.push_back(r * K + k);
        }
        const int64_t slot = off[g] * 3 + kb * (off[g + 1] - off[g]) + (r - off[g]);
        check(v, at, {}, slot);
        const bool hit = (r == 0 && kb == 1) || (r == 3 && kb == 2) || (r == 5 && kb == 0);
        ASSERT_EQ(q.scale_bits(slot) == kNaNScaleBits, hit) << r << " " << kb;
        if (!hit) {
          for (int64_t i : at) ASSERT_EQ(q.code(i), qc.code(i)) << "a clean tile changed";
        }
      }
  const HostTensor d = st::testing::dequantize_rowwise(q, off, T, K);
  for (int64_t k = 128; k < 256; ++k) EXPECT_TRUE(std::isnan(d.get(k))) << "NaN propagates through dequantization";
  EXPECT_FALSE(std::isnan(d.get(0)));

  const Fp8Operand c = st::testing::quantize_columnwise(x, off);
  const int64_t columns = c.data.view().size(1);
  for (int64_t ch = 0; ch < K; ++ch) {  // one tile per expert and channel: columns 0.. and 128..
    const bool hit0 = ch == 130, hit1 = ch == 290 || ch == 0;
    ASSERT_EQ(c.scale_bits(0 * K + ch) == kNaNScaleBits, hit0) << ch;
    ASSERT_EQ(c.scale_bits(1 * K + ch) == kNaNScaleBits, hit1) << ch;
    for (int64_t r = 0; r < T; ++r) {
      const int64_t col = r < 2 ? r : 128 + r - 2;
      ASSERT_EQ(c.code(ch * columns + col) == st::kE4M3NaN, r < 2 ? hit0 : hit1) << ch << " " << r;
    }
  }

  HostTensor w = random_matrix(st::DType::kFP32, 130, 140, rng);
  w.set(129 * 140 + 0, NAN);  // block (1, 0)
  const st::testing::Fp8WeightPair p = st::testing::quantize_weight(w.view());
  for (int64_t b = 0; b < 4; ++b) {
    EXPECT_EQ(p.w.scale_bits(b) == kNaNScaleBits, b == 2) << b;
    EXPECT_EQ(p.wt.scale_bits(b) == kNaNScaleBits, b == 1) << b << " (the transposed grid)";
  }
}

// Tiles restart at each expert's first row: a huge value there is not in the previous expert's
// last tile, whose small values keep their precision.
TEST(Fp8Columnwise, NoTileSpansTwoExperts) {
  const int64_t T = 150, C = 3;
  const std::vector<int64_t> splits = {130, 5, 0, 7};
  const std::vector<int64_t> off = offsets_of(splits, T);
  HostTensor x(st::DType::kBF16, {T, C});
  for (int64_t i = 0; i < T * C; ++i) x.set(i, 0.01 * double(1 + i % 7));
  x.set(130 * C + 1, 1e6);  // expert 1's first row
  const Fp8Operand q = st::testing::quantize_columnwise(x, off);
  // Tiles: expert 0 -> 0 (rows 0..127), 1 (rows 128, 129); expert 1 -> 2; expert 3 -> 3.
  EXPECT_EQ(q.scale_at(1 * C + 1), std::ldexp(1.f, oracle_exponent(std::max(x.get(128 * C + 1), x.get(129 * C + 1)))));
  EXPECT_LE(q.scale_at(1 * C + 1), std::ldexp(1.f, -8));
  EXPECT_EQ(q.scale_at(2 * C + 1), std::ldexp(1.f, oracle_exponent(x.get(130 * C + 1))));
  const HostTensor d = st::testing::dequantize_columnwise(q, off, T, C);
  for (int64_t r = 128; r < 130; ++r)
    EXPECT_NEAR(d.get(r * C + 1), x.get(r * C + 1), x.get(r * C + 1) / 16) << "row " << r << " kept its precision";
}

// A tile of bf16 subnormals gets the smallest scale, and values of few significant bits come
// back exactly (k * 2^-133 * 2^126 = k * 2^-7, exact in e4m3 for k < 16).
TEST(Fp8Scale, TinyAmaxClampsAndSmallValuesStayExact) {
  const int64_t K = 32;
  HostTensor x(st::DType::kBF16, {1, K});
  for (int64_t k = 0; k < K; ++k) x.set(k, (k % 2 ? -1 : 1) * std::ldexp(double(1 + k % 15), -133));
  ASSERT_EQ(x.get(0), std::ldexp(1.0, -133)) << "a bf16 subnormal";
  const std::vector<int64_t> off = offsets_of({1}, 1);
  const Fp8Operand q = st::testing::quantize_rowwise(x, off);
  EXPECT_EQ(q.scale_at(0), std::ldexp(1.f, kMin));
  EXPECT_EQ(st::fp8_scale_exponent(std::ldexp(1.f, -133)), kMin);
  const HostTensor d = st::testing::dequantize_rowwise(q, off, 1, K);
  for (int64_t k = 0; k < K; ++k) EXPECT_EQ(d.get(k), x.get(k)) << k;
}

// bf16's largest value: a finite scale, 2^120. Rounded to e4m3 it carries into 2^8, so its
// dequantized value is 2^128: inf in fp32 (docs/DESIGN.md section 12); smaller values stay finite.
TEST(Fp8Scale, HugeAmaxHasAFiniteScale) {
  HostTensor x(st::DType::kBF16, {1, 4});
  const double bf16_max = st::to_float(st::bf16_t{0x7f7f});
  x.set(0, bf16_max);
  x.set(1, -1e38);
  x.set(2, 3e38);
  x.set(3, 1.0);
  const std::vector<int64_t> off = offsets_of({1}, 1);
  const Fp8Operand q = st::testing::quantize_rowwise(x, off);
  EXPECT_EQ(q.scale_at(0), std::ldexp(1.f, 120));
  const HostTensor d = st::testing::dequantize_rowwise(q, off, 1, 4);
  EXPECT_EQ(d.get(0), INFINITY) << "2^8 * 2^120 is past fp32's range";
  for (int64_t k = 1; k < 4; ++k) {
    EXPECT_TRUE(std::isfinite(d.get(k))) << k;
    EXPECT_LE(std::fabs(d.get(k) - x.get(k)), std::max(std::fabs(x.get(k)) / 16, std::ldexp(1.0, 110))) << k;
  }
}

}  // namespace

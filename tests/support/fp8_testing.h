// Test support for the FP8 recipe (docs/DESIGN.md section 12): oracles written from the
// definitions in double precision, independent of src/common/fp8_*.h (e4m3's values, the nearest
// code by exhaustive search, the scale exponent by search), and quantized operands of a case
// (codes and scales poisoned before the reference backend writes them).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include <gtest/gtest.h>

#include "common/fp8_blockwise.h"
#include "common/group_offsets.h"
#include "host_tensor.h"
#include "ops/fp8_blockwise_backend.h"

namespace sparsetrain::testing {

// e4m3fn from its definition: sign, 4 exponent bits with bias 7, 3 mantissa bits; exponent 0 is
// subnormal (M/8 * 2^-6); S.1111.111 is NaN; there is no inf.
inline double e4m3_value(uint8_t b) {
  const int s = b >> 7, E = (b >> 3) & 15, M = b & 7;
  if (E == 15 && M == 7) return std::numeric_limits<double>::quiet_NaN();
  const double v = E == 0 ? std::ldexp(M / 8.0, -6) : std::ldexp(1.0 + M / 8.0, E - 7);
  return s ? -v : v;
}

// The code nearest to v by exhaustive search, ties to the even code (mantissa's last bit 0); past
// 448 the largest finite code (satfinite); NaN -> 0x7F; the sign kept on a zero result.
inline uint8_t e4m3_nearest(double v) {
  if (std::isnan(v)) return 0x7F;
  const uint8_t sign = std::signbit(v) ? 0x80 : 0x00;
  const double a = std::fabs(v);
  if (a >= 448) return uint8_t(sign | 0x7E);
  uint8_t best = 0;
  for (int b = 1; b <= 0x7E; ++b) {
    const double d = std::fabs(e4m3_value(uint8_t(b)) - a), db = std::fabs(e4m3_value(best) - a);
    if (d < db || (d == db && (b & 1) == 0)) best = uint8_t(b);
  }
  return uint8_t(sign | best);
}

// The smallest e with amax <= 448 * 2^e, by search, clamped to the recipe's range; 0 for amax 0.
inline int scale_exponent_oracle(double amax, int lo, int hi) {
  if (amax == 0) return 0;
  int e = -400;
  while (!(amax <= std::ldexp(448.0, e))) ++e;
  return e < lo ? lo : e > hi ? hi : e;
}

inline std::vector<int64_t> offsets_of(const std::vector<int64_t>& splits, int64_t T) {
  std::vector<int64_t> off(splits.size() + 1);
  EXPECT_EQ(compute_group_offsets(splits.data(), int64_t(splits.size()), T, off.data(), nullptr), kSplitsOk);
  return off;
}

// A quantized operand: uint8 codes and fp32 scales, poisoned with 0xFF bytes until written: code
// 0xFF, a NaN the quantizers never write (theirs is 0x7F), and scale bits 0xFFFFFFFF, a NaN other
// than theirs (0x7FC00000), so an unwritten slot shows even where NaN is the right value.
struct Fp8Operand {
  HostTensor data, scale;
  Fp8Operand(std::vector<int64_t> data_shape, int64_t scales)
      : data(DType::kUInt8, std::move(data_shape)), scale(DType::kFP32, {scales}) {
    data.poison();
    scale.poison();
  }
  backend::Fp8Tensor view() const { return {data.view(), scale.view()}; }
  uint8_t code(int64_t i) const { return static_cast<const uint8_t*>(data.data())[i]; }
  float scale_at(int64_t i) const { return static_cast<const float*>(scale.data())[i]; }
  uint32_t scale_bits(int64_t i) const { return float_bits(scale_at(i)); }
};
constexpr uint32_t kPoisonScaleBits = 0xFFFFFFFFu;

inline backend::Fp8BlockwiseBackend& fp8_ref() { return backend::fp8_blockwise_reference_backend(); }

// The operands of x, or with `rows` (int32 [T]) of x's rows gathered in that order (the
// quantizers' src_rows).
inline TensorView rows_view(const HostTensor* rows) { return rows != nullptr ? rows->view() : TensorView(); }
inline Fp8Operand rowwise_operand(const TensorView& x, const HostTensor* rows = nullptr) {
  const int64_t T = backend::fp8_operand_rows(x, rows_view(rows)), K = x.size(1);
  return Fp8Operand({T, K}, fp8_rowwise_scale_count(T, K));
}
inline Fp8Operand columnwise_operand(const TensorView& x, int64_t G, const HostTensor* rows = nullptr) {
  const int64_t T = backend::fp8_operand_rows(x, rows_view(rows)), C = x.size(1);
  return Fp8Operand({C, fp8_columnwise_columns(T, G)}, fp8_columnwise_scale_count(T, C, G));
}

inline Fp8Operand quantize_rowwise(const HostTensor& x, const std::vector<int64_t>& offsets,
                                   const HostTensor* rows = nullptr) {
  Fp8Operand q = rowwise_operand(x.view(), rows);
  fp8_ref().quantize_rowwise({{int64_t(offsets.size()) - 1, offsets.data()}, x.view(), q.view(), rows_view(rows)},
                             Stream{});
  return q;
}

inline Fp8Operand quantize_columnwise(const HostTensor& x, const std::vector<int64_t>& offsets,
                                      const HostTensor* rows = nullptr) {
  const int64_t G = int64_t(offsets.size()) - 1;
  Fp8Operand q = columnwise_operand(x.view(), G, rows);
  fp8_ref().quantize_columnwise({{G, offsets.data()}, x.view(), q.view(), rows_view(rows)}, Stream{});
  return q;
}

// rows (int32 [T]) drawn from [0, n), repeats and any order, and x's rows gathered by them.
struct GatheredRows {
  HostTensor rows, gathered;
};
inline GatheredRows gather_random_rows(const HostTensor& x, int64_t T, std::mt19937_64& rng) {
  const int64_t n = x.view().size(0), K = x.view().size(1);
  GatheredRows g{HostTensor(DType::kInt32, {T}), HostTensor(x.dtype(), {T, K})};
  std::uniform_int_distribution<int64_t> pick(0, n - 1);
  for (int64_t r = 0; r < T; ++r) {
    const int64_t i = pick(rng);
    g.rows.set(r, double(i));
    for (int64_t k = 0; k < K; ++k) g.gathered.set(r * K + k, x.get(i * K + k));
  }
  return g;
}

// W [out, in] and its transposed copy, from one call.
struct Fp8WeightPair {
  Fp8Operand w, wt;
};
inline Fp8WeightPair quantize_weight(const TensorView& w) {
  const int64_t out = w.size(0), in = w.size(1);
  Fp8WeightPair p{Fp8Operand({out, in}, fp8_block_scale_count(out, in)),
                  Fp8Operand({in, out}, fp8_block_scale_count(in, out))};
  fp8_ref().quantize_weights({{w}, {p.w.view()}, {p.wt.view()}}, Stream{});
  return p;
}

// Dequantized operands, fp32 [rows, cols], NaN-poisoned first (rows of no group stay NaN).
inline HostTensor dequantize_rowwise(const Fp8Operand& q, const std::vector<int64_t>& offsets, int64_t T, int64_t K) {
  HostTensor d(DType::kFP32, {T, K});
  d.poison();
  fp8_ref().dequantize_rowwise({{int64_t(offsets.size()) - 1, offsets.data()}, q.view(), d.view()}, Stream{});
  return d;
}
inline HostTensor dequantize_columnwise(const Fp8Operand& q, const std::vector<int64_t>& offsets, int64_t T,
                                        int64_t C) {
  HostTensor d(DType::kFP32, {T, C});
  d.poison();
  fp8_ref().dequantize_columnwise({{int64_t(offsets.size()) - 1, offsets.data()}, q.view(), d.view()}, Stream{});
  return d;
}
inline HostTensor dequantize_blocks(const Fp8Operand& q, int64_t R, int64_t C) {
  HostTensor d(DType::kFP32, {R, C});
  d.poison();
  fp8_ref().dequantize_blocks(q.view(), d.view(), Stream{});
  return d;
}

}  // namespace sparsetrain::testing

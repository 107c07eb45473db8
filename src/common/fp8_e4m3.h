// The FP8 recipe's element format (docs/DESIGN.md section 12): e4m3 "fn" (sign, 4 exponent bits
// with bias 7, 3 mantissa bits, subnormals, no inf; 0x7F and 0xFF are NaN; largest finite 448).
// Encoding rounds to nearest even and saturates to +-448 (as cvt.rn.satfinite does), and is
// computed on the bits alone: exact whatever the floating-point environment (flush-to-zero too).
// Host/device code: the CPU reference and the CUDA kernels run these same functions.
#pragma once

#include <cstdint>

#include "common/host_device.h"
#include "sparsetrain/dtype.h"  // float_bits, bits_float: the host's bit casts

namespace sparsetrain {

constexpr uint8_t kE4M3NaN = 0x7F;  // the NaN the encoder writes (0xFF, also NaN, it never writes)
constexpr uint8_t kE4M3MaxFinite = 0x7E;  // 448 = 1.75 * 2^8
constexpr float kE4M3Max = 448.f;

// fp32 bit casts that run on both sides.
ST_HOST_DEVICE inline uint32_t hd_float_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  return float_bits(f);
#endif
}
ST_HOST_DEVICE inline float hd_bits_float(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  return bits_float(u);
#endif
}

// The e4m3 code of x * 2^-e, rounded to nearest even: the exact product, never an fp32 one that
// could round or flush first. NaN -> 0x7F; inf and finite values past 448 -> +-448 (satfinite);
// the sign survives a result of zero (-tiny -> 0x80, -0.0).
ST_HOST_DEVICE inline uint8_t e4m3_encode_scaled(float x, int32_t e) {
  const uint32_t u = hd_float_bits(x);
  const uint8_t sign = uint8_t((u >> 24) & 0x80u);
  const uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return kE4M3NaN;
  if (a == 0x7f800000u) return uint8_t(sign | kE4M3MaxFinite);
  if (a == 0) return sign;
  // |x| * 2^-e = m * 2^p exactly, m < 2^24 with its leading bit at `lead`.
  const int32_t biased = int32_t(a >> 23);
  uint32_t m = a & 0x7fffffu;
  int32_t p = -149;
  if (biased != 0) {
    m |= 0x800000u;
    p = biased - 150;
  }
  p -= e;
  int32_t lead = 23;
  while ((m >> lead) == 0) --lead;  // only fp32 subnormals loop
  const int32_t exp = lead + p;     // the value lies in [2^exp, 2^(exp+1))
  if (exp > 8) return uint8_t(sign | kE4M3MaxFinite);  // >= 512
  // e4m3's spacing at that value: 2^(exp-3), or 2^-9 among the subnormals (below 2^-6).
  const int32_t quantum = (exp < -6 ? -6 : exp) - 3;
  const int32_t drop = quantum - p;  // bits of m below the spacing
  uint32_t n;                        // the value in units of the spacing, rounded to even: 0..16
  if (drop <= 0) {
    n = m << -drop;
  } else if (drop >= 25) {
    n = 0;  // below half a spacing
  } else {
    n = m >> drop;
    const uint32_t rest = m & ((1u << drop) - 1u), half = 1u << (drop - 1);
    if (rest > half || (rest == half && (n & 1u))) ++n;
  }
  // Subnormals: n is the code (8 carries into the smallest normal, 0x08). Normals: n in [8, 16] is
  // the significand with its leading bit; 16 carries into the next exponent.
  uint32_t code = exp < -6 ? n : (uint32_t(exp + 7) << 3) + (n - 8u);
  if (code > kE4M3MaxFinite) code = kE4M3MaxFinite;  // 464 and up (480 would be next): saturate
  return uint8_t(sign | code);
}

ST_HOST_DEVICE inline uint8_t e4m3_encode(float x) { return e4m3_encode_scaled(x, 0); }

// The value of an e4m3 code, exactly (every code is an fp32 normal, zero or NaN).
ST_HOST_DEVICE inline float e4m3_decode(uint8_t q) {
  const uint32_t sign = uint32_t(q & 0x80u) << 24;
  const uint32_t mag = q & 0x7fu;
  if (mag == 0x7fu) return hd_bits_float(sign | 0x7fc00000u);
  const uint32_t exp = mag >> 3, man = mag & 7u;
  if (exp != 0) return hd_bits_float(sign | ((exp + 120u) << 23) | (man << 20));
  if (man == 0) return hd_bits_float(sign);
  // Subnormal man * 2^-9 with its leading bit at `lead`: 1.f * 2^(lead - 9) in fp32.
  const uint32_t lead = man >= 4u ? 2u : man >= 2u ? 1u : 0u;
  return hd_bits_float(sign | ((lead + 118u) << 23) | ((man << (23u - lead)) & 0x7fffffu));
}

}  // namespace sparsetrain

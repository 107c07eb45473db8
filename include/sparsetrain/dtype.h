// Element types and exact host conversions between fp32 and the 16-bit float formats.
// Conversions round to nearest even (as the hardware does), keep NaN a NaN, overflow to inf and
// handle fp16 subnormals: they are used by the reference backend and the tests' oracle, so they
// must be bit-exact rather than approximately right.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

namespace sparsetrain {

// kUInt8: block-mask matrices and per-block bitmasks (block_mask.h); no arithmetic op takes it.
// The types after kUInt8 are never computed with or allocated: they let a view describe any array
// a framework hands over, so that the op's own dtype check refuses it with the op's rule and the
// type's name ("x: expected dtype bf16 (the layer's dtype), got fp64"), as it does a supported
// type in the wrong place, instead of the conversion failing without knowing the rule.
enum class DType : uint8_t {
  kBF16, kFP16, kFP32, kInt32, kInt64, kUInt8,
  kFP64, kInt8, kInt16, kUInt16, kUInt32, kUInt64, kBool, kComplex64, kComplex128,
};
constexpr DType kAllDTypes[] = {
    DType::kBF16,  DType::kFP16,  DType::kFP32,   DType::kInt32,  DType::kInt64,  DType::kUInt8,     DType::kFP64,
    DType::kInt8,  DType::kInt16, DType::kUInt16, DType::kUInt32, DType::kUInt64, DType::kBool,      DType::kComplex64,
    DType::kComplex128};

constexpr size_t dtype_size(DType t) {
  switch (t) {
    case DType::kUInt8:
    case DType::kInt8:
    case DType::kBool: return 1;
    case DType::kBF16:
    case DType::kFP16:
    case DType::kInt16:
    case DType::kUInt16: return 2;
    case DType::kFP32:
    case DType::kInt32:
    case DType::kUInt32: return 4;
    case DType::kInt64:
    case DType::kUInt64:
    case DType::kFP64:
    case DType::kComplex64: return 8;
    case DType::kComplex128: return 16;
  }
  return 0;
}

// The library's names, used in every message; every front names a framework's types through
// these (dtype_of_element), so torch's float64 and numpy's float64 are both "fp64".
constexpr const char* dtype_name(DType t) {
  switch (t) {
    case DType::kBF16: return "bf16";
    case DType::kFP16: return "fp16";
    case DType::kFP32: return "fp32";
    case DType::kInt32: return "int32";
    case DType::kInt64: return "int64";
    case DType::kUInt8: return "uint8";
    case DType::kFP64: return "fp64";
    case DType::kInt8: return "int8";
    case DType::kInt16: return "int16";
    case DType::kUInt16: return "uint16";
    case DType::kUInt32: return "uint32";
    case DType::kUInt64: return "uint64";
    case DType::kBool: return "bool";
    case DType::kComplex64: return "complex64";
    case DType::kComplex128: return "complex128";
  }
  return "?";
}

// An element type as a kind and a width in bits: DLPack's description, onto which numpy's and
// torch's dtypes map directly.
enum class ElementKind : uint8_t { kInt, kUInt, kFloat, kBFloat, kComplex, kBool };

constexpr ElementKind element_kind(DType t) {
  switch (t) {
    case DType::kBF16: return ElementKind::kBFloat;
    case DType::kFP16:
    case DType::kFP32:
    case DType::kFP64: return ElementKind::kFloat;
    case DType::kInt8:
    case DType::kInt16:
    case DType::kInt32:
    case DType::kInt64: return ElementKind::kInt;
    case DType::kUInt8:
    case DType::kUInt16:
    case DType::kUInt32:
    case DType::kUInt64: return ElementKind::kUInt;
    case DType::kBool: return ElementKind::kBool;
    case DType::kComplex64:
    case DType::kComplex128: return ElementKind::kComplex;
  }
  return ElementKind::kInt;
}

// The DType of an element type (the one table every front converts through): false for a type no
// DType describes (the fp8 formats, complex32, ...), which a front refuses by its own name.
constexpr bool dtype_of_element(ElementKind kind, int bits, DType& out) {
  for (DType t : kAllDTypes)
    if (element_kind(t) == kind && int(dtype_size(t)) * 8 == bits) {
      out = t;
      return true;
    }
  return false;
}

// The float types the library computes in (fp64 is a type it names, not one it computes with).
constexpr bool is_floating(DType t) {
  return t == DType::kBF16 || t == DType::kFP16 || t == DType::kFP32;
}

// Storage types: plain 16-bit patterns, so they are trivially copyable and identical on host and
// device (no CUDA headers in the public API).
struct bf16_t { uint16_t bits; };
struct fp16_t { uint16_t bits; };

inline uint32_t float_bits(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }
inline float bits_float(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }

inline float to_float(bf16_t h) { return bits_float(uint32_t(h.bits) << 16); }

inline bf16_t to_bf16(float f) {
  uint32_t u = float_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return bf16_t{uint16_t((u >> 16) | 0x40u)};  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest, ties to even; overflows into inf correctly
  return bf16_t{uint16_t(u >> 16)};
}

inline float to_float(fp16_t h) {
  const uint32_t sign = uint32_t(h.bits & 0x8000u) << 16;
  const uint32_t exp = (h.bits >> 10) & 0x1fu;
  const uint32_t man = h.bits & 0x3ffu;
  if (exp == 0x1f) return bits_float(sign | 0x7f800000u | (man << 13));  // inf / NaN
  if (exp != 0) return bits_float(sign | ((exp + 112u) << 23) | (man << 13));
  // Zero or subnormal: man * 2^-24 is exact in fp32.
  const float v = float(man) * bits_float(0x33800000u);  // 2^-24
  return sign ? -v : v;
}

inline fp16_t to_fp16(float f) {
  const uint32_t u = float_bits(f);
  const uint16_t sign = uint16_t((u >> 16) & 0x8000u);
  const uint32_t abs = u & 0x7fffffffu;
  if (abs > 0x7f800000u) return fp16_t{uint16_t(sign | 0x7e00u | ((abs >> 13) & 0x3ffu))};  // NaN
  if (abs >= 0x477ff000u) return fp16_t{uint16_t(sign | 0x7c00u)};  // >= 65520 rounds to inf
  if (abs < 0x38800000u) {
    // Result is subnormal (or zero) in fp16: round abs / 2^-24 to an integer, ties to even.
    // Adding 0.5 (2^-1) in fp32 does exactly that rounding because the sum's ulp is 2^-24 here.
    const float scaled = bits_float(abs) + 0.5f;  // value in units of 2^-24 lands in the mantissa
    return fp16_t{uint16_t(sign | uint16_t(float_bits(scaled) - 0x3f000000u))};
  }
  uint32_t r = abs + 0xfffu + ((abs >> 13) & 1u);  // round the 13 dropped bits, ties to even
  return fp16_t{uint16_t(sign | uint16_t((r - 0x38000000u) >> 13))};
}

// Reads element i of a float tensor of type t as fp32; writes an fp32 value rounded to t.
inline float load_float(const void* p, DType t, int64_t i) {
  switch (t) {
    case DType::kBF16: return to_float(static_cast<const bf16_t*>(p)[i]);
    case DType::kFP16: return to_float(static_cast<const fp16_t*>(p)[i]);
    default: return static_cast<const float*>(p)[i];
  }
}

inline void store_float(void* p, DType t, int64_t i, float v) {
  switch (t) {
    case DType::kBF16: static_cast<bf16_t*>(p)[i] = to_bf16(v); break;
    case DType::kFP16: static_cast<fp16_t*>(p)[i] = to_fp16(v); break;
    default: static_cast<float*>(p)[i] = v; break;
  }
}

}  // namespace sparsetrain

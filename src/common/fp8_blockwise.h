// The FP8 recipe's blockwise scaling (docs/DESIGN.md section 12): the scale rule of a tile, the
// quantization of its elements, and the tiles and physical layouts of the three kinds of operand.
// Host/device code: the CPU quantizers and the CUDA kernels run these same functions.
//
//   scale     2^e per tile, e the smallest integer with amax <= 448 * 2^e, clamped to
//             [kFp8ScaleExpMin, kFp8ScaleExpMax] (2^e and 2^-e both fp32 normals); amax == 0 -> 1;
//             a NaN or inf in the tile -> scale NaN and every code of the tile NaN (0x7F)
//   code      q = e4m3_rne(x * 2^-e), exact (|x * 2^-e| <= 448 for every finite fp32 amax)
//   value     x' = e4m3(q) * 2^e, exact in fp32
//   rowwise   [T, K] operands of fprop / dgrad: 1 x 128 tiles along K, the last one of a row
//             possibly shorter; codes [T, K]; scales grouped M-major (per group [KB, M_g])
//   columnwise the [T, C] operands of wgrad: 128 x 1 tiles of one expert's tokens (restarting at
//             its first row); codes transposed, [C, columns], each expert's tokens from column
//             128 * (its first tile), the rest of its last tile zero codes; scales [tiles, C],
//             experts' tiles in order
//   weights   128 x 128 blocks of [out, in]; codes and a row-major block grid, plus the transpose
//             (codes [in, out], grid transposed): the same bytes, one pass writes both
// Rows from S = offsets[G] on (a padded tail) belong to no group and are not quantized.
#pragma once

#include <cstdint>

#include "common/fp8_e4m3.h"
#include "common/host_device.h"

#if defined(__CUDACC__)
#include <cuda_fp8.h>
#endif

namespace sparsetrain {

constexpr int64_t kFp8Tile = 128;  // the tile's length (rowwise, columnwise) and the block's side
constexpr int32_t kFp8ScaleExpMin = -126, kFp8ScaleExpMax = 126;

// ---- the scale rule ------------------------------------------------------------------------

// A tile's amax, folded one element at a time. Ordered on |x|'s bits, which order finite values
// as floats do and put NaN and inf above all of them, so one non-finite element marks the tile
// (fmaxf would drop a NaN).
ST_HOST_DEVICE inline float fp8_amax(float amax, float x) {
  const uint32_t a = hd_float_bits(amax) & 0x7fffffffu, b = hd_float_bits(x) & 0x7fffffffu;
  return hd_bits_float(a > b ? a : b);
}

ST_HOST_DEVICE inline bool fp8_amax_finite(float amax) {
  return (hd_float_bits(amax) & 0x7fffffffu) < 0x7f800000u;
}

// e of a finite amax: with amax = f * 2^E, f in [1, 2), the smallest e with f * 2^E <= 1.75 *
// 2^(8 + e) is E - 8, or E - 7 when f > 1.75. Integer arithmetic on the bits: exact.
ST_HOST_DEVICE inline int32_t fp8_scale_exponent(float amax) {
  const uint32_t a = hd_float_bits(amax) & 0x7fffffffu;
  if (a == 0) return 0;
  const int32_t biased = int32_t(a >> 23);
  // An fp32 subnormal amax (biased 0) needs e < -134: the clamp below.
  const int32_t e = biased == 0 ? kFp8ScaleExpMin
                                : biased - 127 - 8 + ((a & 0x7fffffu) > 0x600000u ? 1 : 0);  // 0x600000: f = 1.75
  return e < kFp8ScaleExpMin ? kFp8ScaleExpMin : e > kFp8ScaleExpMax ? kFp8ScaleExpMax : e;
}

// The tile's scale as stored: 2^e, or NaN (0x7FC00000) for an amax that is NaN or inf.
ST_HOST_DEVICE inline float fp8_scale(float amax) {
  if (!fp8_amax_finite(amax)) return hd_bits_float(0x7fc00000u);
  return hd_bits_float(uint32_t(fp8_scale_exponent(amax) + 127) << 23);
}

// A NaN scale: its tile had a NaN or inf, and every code of the tile is NaN (kE4M3NaN).
ST_HOST_DEVICE inline bool fp8_scale_is_nan(float scale) {
  return (hd_float_bits(scale) & 0x7fffffffu) > 0x7f800000u;
}

// The code of x in a tile of scale `scale` (from fp8_scale): e read back from the scale's bits.
// On GPUs with an e4m3 conversion (sm_89 and up) the hardware's cvt.rn.satfinite of x * 2^-e
// (fp8_quantize2), which is the same code: the product by a power of two is exact wherever it can
// matter (a product below fp32's normals, where bits could drop, is below half e4m3's smallest
// subnormal and rounds to a signed zero either way; this build never flushes subnormals), round to
// nearest even and satfinite are the encoder's rules (inf and past 464 -> +-448); the CUDA tests
// compare the two bitwise. It is ~10x fewer instructions than the encoder's integer steps, which
// bound the quantizers' speed.
// fp8_quantize2: the codes of two elements of one tile, a's in the low byte (on the GPU one
// conversion for the pair).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
__device__ inline uint16_t fp8_quantize2(float a, float b, float scale) {
  if (fp8_scale_is_nan(scale)) return uint16_t(kE4M3NaN * 0x101u);
  const float inverse = __uint_as_float((254u - (__float_as_uint(scale) >> 23)) << 23);  // 2^-e, e in [-126, 126]
  return __nv_cvt_float2_to_fp8x2(make_float2(__fmul_rn(a, inverse), __fmul_rn(b, inverse)), __NV_SATFINITE,
                                  __NV_E4M3);
}
ST_HOST_DEVICE inline uint8_t fp8_quantize(float x, float scale) { return uint8_t(fp8_quantize2(x, 0.f, scale)); }
#else
ST_HOST_DEVICE inline uint8_t fp8_quantize(float x, float scale) {
  if (fp8_scale_is_nan(scale)) return kE4M3NaN;
  return e4m3_encode_scaled(x, int32_t((hd_float_bits(scale) >> 23) & 0xffu) - 127);
}
ST_HOST_DEVICE inline uint16_t fp8_quantize2(float a, float b, float scale) {
  return uint16_t(fp8_quantize(a, scale) | fp8_quantize(b, scale) << 8);
}
#endif

// Exact in fp32 (a product by a power of two, no rounding) as long as subnormal results, which
// tiles of e < -117 can give, are not flushed to zero.
ST_HOST_DEVICE inline float fp8_dequantize(uint8_t q, float scale) { return e4m3_decode(q) * scale; }
// fp8_dequantize of two codes of one tile (a's in the low byte): on GPUs with e4m3 conversions one
// cvt to fp16 for the pair (exact: every e4m3 value, subnormals and 448 included, is an fp16 one;
// a NaN code gives a NaN), then the same product.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
__device__ inline float2 fp8_dequantize2(uint16_t q, float scale) {
  const float2 v = __half22float2(__half2(__nv_cvt_fp8x2_to_halfraw2(q, __NV_E4M3)));
  return make_float2(v.x * scale, v.y * scale);
}
#elif defined(__CUDACC__)
ST_HOST_DEVICE inline float2 fp8_dequantize2(uint16_t q, float scale) {
  return {fp8_dequantize(uint8_t(q), scale), fp8_dequantize(uint8_t(q >> 8), scale)};
}
#endif

// ---- tiles and layouts ---------------------------------------------------------------------

// Tiles of kFp8Tile covering n elements (the last one possibly shorter).
ST_HOST_DEVICE inline int64_t fp8_tiles(int64_t n) { return (n + kFp8Tile - 1) / kFp8Tile; }

// Rowwise: the scale of (row r, k block kb) of group g, which owns rows [group_begin, group_begin
// + group_rows) of a [T, K] operand, k_blocks = fp8_tiles(K). Per group an M-major [KB, M_g] grid,
// the groups one after another: the layout CUTLASS's sm90 blockwise grouped GEMM reads through one
// pointer per group (group_begin * k_blocks). One group: [KB, T].
ST_HOST_DEVICE inline int64_t fp8_rowwise_scale_index(int64_t group_begin, int64_t group_rows, int64_t k_blocks,
                                                      int64_t r, int64_t kb) {
  return group_begin * k_blocks + kb * group_rows + (r - group_begin);
}
ST_HOST_DEVICE inline int64_t fp8_rowwise_scale_count(int64_t rows, int64_t k) { return rows * fp8_tiles(k); }

// Columnwise: the first tile of group g, counting every earlier group's tiles (an empty group has
// none), from the group offsets [G + 1] (common/group_offsets.h).
ST_HOST_DEVICE inline int64_t fp8_columnwise_tile_base(const int64_t* offsets, int64_t g) {
  int64_t base = 0;
  for (int64_t h = 0; h < g; ++h) base += fp8_tiles(offsets[h + 1] - offsets[h]);
  return base;
}
// A bound on the total from the shapes alone: sum_g ceil(M_g / 128) < S / 128 + G.
ST_HOST_DEVICE inline int64_t fp8_columnwise_max_tiles(int64_t rows, int64_t num_groups) {
  return fp8_tiles(rows) + num_groups;
}
// The scale of (channel c, tile t of group g) with tile_base = fp8_columnwise_tile_base(.., g).
ST_HOST_DEVICE inline int64_t fp8_columnwise_scale_index(int64_t tile_base, int64_t t, int64_t channels, int64_t c) {
  return (tile_base + t) * channels + c;
}
ST_HOST_DEVICE inline int64_t fp8_columnwise_scale_count(int64_t rows, int64_t channels, int64_t num_groups) {
  return fp8_columnwise_max_tiles(rows, num_groups) * channels;
}
// The columns of the codes [C, columns]: whole tiles, from the shapes alone. Each expert's tokens
// start a tile (column kFp8Tile * tile_base), so that its block starts on a 16-byte boundary, as
// the wgrad GEMM's TMA loads need (one descriptor per expert, at a token offset of any value).
ST_HOST_DEVICE inline int64_t fp8_columnwise_columns(int64_t rows, int64_t num_groups) {
  return kFp8Tile * fp8_columnwise_max_tiles(rows, num_groups);
}
// The code of (row r of the group starting at row group_begin, channel c): tokens contiguous.
ST_HOST_DEVICE inline int64_t fp8_columnwise_data_index(int64_t columns, int64_t tile_base, int64_t group_begin,
                                                        int64_t r, int64_t c) {
  return c * columns + kFp8Tile * tile_base + (r - group_begin);
}

// Weights: the scale of element (i, j) of a [rows, cols] matrix quantized in 128 x 128 blocks, a
// row-major grid [fp8_tiles(rows), fp8_tiles(cols)]. W [out, in] and its transposed copy [in, out]
// both use it (the copy's grid is the transpose of W's).
ST_HOST_DEVICE inline int64_t fp8_block_scale_index(int64_t cols, int64_t i, int64_t j) {
  return (i / kFp8Tile) * fp8_tiles(cols) + j / kFp8Tile;
}
ST_HOST_DEVICE inline int64_t fp8_block_scale_count(int64_t rows, int64_t cols) {
  return fp8_tiles(rows) * fp8_tiles(cols);
}

}  // namespace sparsetrain

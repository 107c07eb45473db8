// The CUDA backend of GroupedMLP's elementwise stages (ops/grouped_mlp_backend.h): SwiGLU x probs
// forward (h' from fc1's output), its backward (d fc1_out and dprobs), and fc2's probs-scaled bias
// and bias grad. One pass over the data each, 16-byte vector loads where the layout allows, S
// read from the device offsets (no host sync, capturable), every reduction in a fixed order
// (bitwise deterministic, no atomics).
//
// Row kernels run one block per row (grid = T): rows >= S write their zero tail in the same pass.
// The FP8 backward runs a block per 128-token tile of one expert instead, as the quantizers do.
#include <cuda_runtime.h>

#include <initializer_list>
#include <string>
#include <type_traits>

#include "common/dispatch_dtype.h"
#include "common/group_offsets.h"
#include "cuda/cuda_check.h"
#include "cuda/cuda_stream.h"
#include "cuda/device_cache.h"
#include "cuda/element.cuh"
#include "cuda/fp8/fp8_quantize_cuda.cuh"
#include "cuda/grouped_linear/grouped_gemm_params.h"  // kMaxGroups
#include "cuda/runtime_cuda.h"
#include "ops/grouped_mlp_backend.h"
#include "sparsetrain/error.h"

namespace sparsetrain::backend {
namespace {

using cuda::load_f32;
using cuda::Pack;
using cuda::store_f32;

constexpr int kRowThreads = 256;

struct PtrTable {  // per-group pointers by value: a captured graph holds them
  void* ptr[cuda::kMaxGroups];
};

__device__ inline float sigmoid(float v) { return 1.f / (1.f + __expf(-v)); }

// h'_j = probs * silu(a_j) * b_j, one expression for the bf16 and the FP8 forward (the same bits).
__device__ inline float swiglu_value(float a, float b, float pr) { return pr * (a * sigmoid(a) * b); }

// v as the layer's dtype holds it (exact round trip through E).
template <typename E>
__device__ inline float rounded(float v) {
  E e;
  store_f32(&e, 0, v);
  return load_f32(&e, 0);
}

// d fc1_out at a_j and b_j from dh'_j (da = probs dh' b silu'(a), db = probs dh' silu(a)) and
// dprobs' term h_j dh'_j: one expression for the bf16 and the FP8 backward (the same bits).
struct SwigluGrad {
  float da, db, dprob;
};
__device__ inline SwigluGrad swiglu_grad(float a, float b, float d, float pr) {
  const float sig = sigmoid(a), silu = a * sig;
  const float dhv = pr * d;  // dL/dh, h' = probs * h
  return {dhv * b * sig * (1.f + a * (1.f - sig)), dhv * silu, silu * b * d};
}

// Sum over the block in a fixed pattern (shuffle tree, then warp partials in order): the same
// inputs in the same threads give the same bits on every run.
__device__ float block_sum(float v, float* smem /* [kRowThreads / 32] */) {
#pragma unroll
  for (int o = 16; o > 0; o /= 2) v += __shfl_xor_sync(0xffffffffu, v, o);
  const int warp = int(threadIdx.x) / 32, lane = int(threadIdx.x) % 32;
  if (lane == 0) smem[warp] = v;
  __syncthreads();
  float s = 0.f;
  for (int w = 0; w < kRowThreads / 32; ++w) s += smem[w];
  __syncthreads();
  return s;
}

// Element offsets within fc1_out's row of a_j .. a_{j+V-1} (b: + b_off). With V > 1 the host
// has checked that a pack never straddles an interleave block.
struct GluLayout {
  int64_t ffn, interleave, b_off;
};

template <typename E, int V>
__global__ void __launch_bounds__(kRowThreads)
    swiglu_forward_kernel(const int64_t* offsets, int64_t G, GluLayout L, const E* z, int64_t z_ld,
                          const float* probs, int64_t probs_stride, E* h, int64_t h_ld) {
  const int64_t t = blockIdx.x;
  E* hr = h + t * h_ld;
  if (t >= offsets[G]) {
    Pack<E, V> zero{};
    for (int64_t j = int64_t(threadIdx.x) * V; j < L.ffn; j += int64_t(kRowThreads) * V) zero.store(hr + j);
    return;
  }
  const E* zr = z + t * z_ld;
  const float pr = probs[t * probs_stride];
  for (int64_t j = int64_t(threadIdx.x) * V; j < L.ffn; j += int64_t(kRowThreads) * V) {
    const int64_t ca = backend::glu_a_column(j, L.interleave);
    Pack<E, V> a, b, out;
    a.load(zr + ca);
    b.load(zr + ca + L.b_off);
#pragma unroll
    for (int i = 0; i < V; ++i) out.v[i] = swiglu_value(a.v[i], b.v[i], pr);
    out.store(hr + j);
  }
}

// The FP8 forward: h' quantized rowwise as it is made (h' never in memory). One block per row;
// sixteen threads a 128-column tile of h', eight columns each (the rowwise quantizer's mapping:
// the tile's amax a shuffle within the half warp), each value rounded to E first, so that the
// codes are those of quantize_rowwise over the h' that swiglu_forward_kernel writes. Rows >= S
// write nothing (the rowwise layout has no tail). kVec: a and b by 16-byte packs.
template <typename E, bool kVec>
__global__ void __launch_bounds__(kRowThreads)
    swiglu_forward_fp8_kernel(const int64_t* offsets, int64_t G, GluLayout L, const E* z, int64_t z_ld,
                              const float* probs, int64_t probs_stride, uint8_t* q, float* scale) {
  constexpr int kTileThreads = cuda::fp8::kRowThreads;
  const int64_t t = blockIdx.x;
  if (t >= offsets[G]) return;
  const E* zr = z + t * z_ld;
  const float pr = probs[t * probs_stride];
  const int64_t KB = fp8_tiles(L.ffn);
  const int sub = int(threadIdx.x) % kTileThreads;
  const unsigned half = 0xffffu << (threadIdx.x & 16u);
  for (int64_t tile = int(threadIdx.x) / kTileThreads; tile < KB; tile += kRowThreads / kTileThreads) {
    const int64_t j = tile * kFp8Tile + sub * 8;
    float v[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) v[i] = 0.f;
    if constexpr (kVec) {
      if (j < L.ffn) {
        const int64_t ca = backend::glu_a_column(j, L.interleave);
        Pack<E, 8> a, b;
        a.load(zr + ca);
        b.load(zr + ca + L.b_off);
#pragma unroll
        for (int i = 0; i < 8; ++i) v[i] = rounded<E>(swiglu_value(a.v[i], b.v[i], pr));
      }
    } else {
#pragma unroll
      for (int i = 0; i < 8; ++i)
        if (j + i < L.ffn) {
          const int64_t ca = backend::glu_a_column(j + i, L.interleave);
          v[i] = rounded<E>(swiglu_value(load_f32(zr, ca), load_f32(zr, ca + L.b_off), pr));
        }
    }
    float amax = 0.f;
#pragma unroll
    for (int i = 0; i < 8; ++i) amax = fp8_amax(amax, v[i]);
#pragma unroll
    for (int o = kTileThreads / 2; o > 0; o /= 2) amax = fp8_amax(amax, __shfl_xor_sync(half, amax, o));
    const float s = fp8_scale(amax);
    cuda::fp8::store8_codes<kVec>(q + t * L.ffn + j, j, L.ffn, cuda::fp8::codes8(v, s));
    if (sub == 0) {
      const int64_t g = group_of_row(offsets, G, t);
      scale[fp8_rowwise_scale_index(offsets[g], offsets[g + 1] - offsets[g], KB, t, tile)] = s;
    }
  }
}

template <typename E, int V>
__global__ void __launch_bounds__(kRowThreads)
    swiglu_backward_kernel(const int64_t* offsets, int64_t G, GluLayout L, const E* z, int64_t z_ld,
                           const float* probs, int64_t probs_stride, const E* dh, int64_t dh_ld, const E* dy,
                           int64_t dy_ld, int64_t out, const PtrTable bias, bool has_bias, E* dz, int64_t dz_ld,
                           float* dprobs) {
  __shared__ float smem[kRowThreads / 32];
  const int64_t t = blockIdx.x;
  E* dzr = dz + t * dz_ld;
  if (t >= offsets[G]) {
    Pack<E, V> zero{};
    for (int64_t j = int64_t(threadIdx.x) * V; j < 2 * L.ffn; j += int64_t(kRowThreads) * V) zero.store(dzr + j);
    if (threadIdx.x == 0) dprobs[t] = 0.f;
    return;
  }
  const E* zr = z + t * z_ld;
  const E* dhr = dh + t * dh_ld;
  const float pr = probs[t * probs_stride];
  float dp = 0.f;
  for (int64_t j = int64_t(threadIdx.x) * V; j < L.ffn; j += int64_t(kRowThreads) * V) {
    const int64_t ca = backend::glu_a_column(j, L.interleave);
    Pack<E, V> a, b, d, da, db;
    a.load(zr + ca);
    b.load(zr + ca + L.b_off);
    d.load(dhr + j);
#pragma unroll
    for (int i = 0; i < V; ++i) {
      const SwigluGrad g = swiglu_grad(a.v[i], b.v[i], d.v[i], pr);
      dp += g.dprob;  // h . dh'
      da.v[i] = g.da;
      db.v[i] = g.db;
    }
    da.store(dzr + ca);
    db.store(dzr + ca + L.b_off);
  }
  if (has_bias) {  // + dy . b2_g: fc2's output is probs * (h W2^T + b2)
    const E* b2 = static_cast<const E*>(bias.ptr[group_of_row(offsets, G, t)]);
    const E* dyr = dy + t * dy_ld;
    for (int64_t o = threadIdx.x; o < out; o += kRowThreads) dp += load_f32(dyr, o) * load_f32(b2, o);
  }
  dp = block_sum(dp, smem);
  if (threadIdx.x == 0) dprobs[t] = dp;
}

// One row's a_j .. a_{j+7} and b_j .. b_{j+7} as the FP8 backward reads them: from z (kVec: two
// 16-byte loads), or with kCodes from its rowwise codes zq [T, 2F] and scales zs, each value
// decoded and rounded to E (z's values had it been restored from them; kVec: two 8-byte loads).
// Row `row` of the expert at [begin, begin + rows); ca0 the pair's first a column, ca = ca0 + this
// thread's eight.
template <typename E, bool kVec, bool kCodes>
__device__ inline void load_glu_pair(const E* z, int64_t z_ld, const uint8_t* zq, const float* zs, int64_t K,
                                     const GluLayout& L, int64_t begin, int64_t rows, int64_t row, int64_t ca0,
                                     int64_t ca, float (&a)[8], float (&b)[8]) {
  if constexpr (kCodes) {
    const uint8_t* qr = zq + row * K;
    const int64_t KB = fp8_tiles(K);
    const float sa = zs[fp8_rowwise_scale_index(begin, rows, KB, row, ca0 / kFp8Tile)];
    const float sb = zs[fp8_rowwise_scale_index(begin, rows, KB, row, (ca0 + L.b_off) / kFp8Tile)];
    uint2 qa = {}, qb = {};  // code i in byte i
    if constexpr (kVec) {
      qa = *reinterpret_cast<const uint2*>(qr + ca);
      qb = *reinterpret_cast<const uint2*>(qr + ca + L.b_off);
    } else {
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        (i < 4 ? qa.x : qa.y) |= uint32_t(qr[ca + i]) << (8 * (i % 4));
        (i < 4 ? qb.x : qb.y) |= uint32_t(qr[ca + L.b_off + i]) << (8 * (i % 4));
      }
    }
#pragma unroll
    for (int i = 0; i < 8; i += 2) {
      const int shift = 8 * (i % 4);
      const float2 va = fp8_dequantize2(uint16_t((i < 4 ? qa.x : qa.y) >> shift), sa);
      const float2 vb = fp8_dequantize2(uint16_t((i < 4 ? qb.x : qb.y) >> shift), sb);
      a[i] = rounded<E>(va.x), a[i + 1] = rounded<E>(va.y), b[i] = rounded<E>(vb.x), b[i + 1] = rounded<E>(vb.y);
    }
  } else {
    const E* zr = z + row * z_ld;
    if constexpr (kVec) {
      Pack<E, 8> pa, pb;
      pa.load(zr + ca);
      pb.load(zr + ca + L.b_off);
#pragma unroll
      for (int i = 0; i < 8; ++i) a[i] = pa.v[i], b[i] = pb.v[i];
    } else {
#pragma unroll
      for (int i = 0; i < 8; ++i) a[i] = load_f32(zr, ca + i), b[i] = load_f32(zr, ca + L.b_off + i);
    }
  }
}

// The FP8 backward: d fc1_out's two layouts as quantize_both writes them from the d fc1_out that
// swiglu_backward_kernel writes, h' (fc2's input) as quantize_columnwise writes it from the h'
// swiglu_forward_kernel writes (each value rounded to E first: the same codes), and dprobs, with
// neither in memory. One block per 128-token tile of one expert (expert_tile; a block past them
// returns); it walks the F / 128 pairs of 128-column tiles (128 j: their a tile and their b tile,
// glu_tiles_pair), each thread eight rows x eight j, as quantize_tile_kernel holds a tile. Each
// row of eight values goes out as it is made (quantize_held_chunk): d a's and d b's rowwise codes
// from the registers, and the three tiles (h', d a, d b) staged in shared memory; once the pair is
// staged, their columnwise codes from there. Nothing held across rows keeps the kernel at two
// blocks an SM (96 KiB of shared memory each, 92-96 registers): one block's loads run under the
// other's columnwise pass (held in registers, at 223 registers and one block an SM, the kernel
// ran at a third of its traffic's speed).
// dprobs: a pair's terms summed over each thread's eight j, then over a row's sixteen threads in a
// fixed tree, then pair after pair in shared memory (deterministic; another order than
// swiglu_backward_kernel's block sum, so not its bits). Rows in [S, T): dprobs zero (a grid-stride
// loop), codes not written (quantize_both's rule). No bias (an FP8 layer has none). kVec: 16-byte
// loads and 8-byte code stores (checked by the launcher). kCodes: z read as its rowwise codes
// (load_glu_pair).
constexpr int kSwigluBwdStages = 3;  // h', d a, d b
constexpr int kSwigluBwdSmem = kSwigluBwdStages * cuda::fp8::kStagedTileVecs * int(sizeof(uint4));
template <typename E, bool kVec, bool kCodes>
__global__ void __launch_bounds__(256, 2)
    swiglu_backward_fp8_kernel(const int64_t* offsets, int64_t G, int64_t T, GluLayout L, const E* z, int64_t z_ld,
                               const uint8_t* zq, const float* zs, const float* probs, int64_t probs_stride,
                               const E* dh, int64_t dh_ld, uint8_t* q_row,
                               float* s_row, int64_t columns, uint8_t* q_col, float* s_col, uint8_t* h_col,
                               float* h_scale, float* dprobs) {
  namespace fp8 = cuda::fp8;
  constexpr int kSub = fp8::kRowThreads, kPasses = fp8::kTilePasses, kRowsPerPass = fp8::kTileRowsPerPass;
  extern __shared__ uint4 stages[];
  __shared__ float dprob_rows[kFp8Tile];  // the tile's rows' dprobs, summed a pair at a time
  uint4* const stage_h = stages;
  uint4* const stage_a = stages + fp8::kStagedTileVecs;
  uint4* const stage_b = stages + 2 * fp8::kStagedTileVecs;
  const int tid = int(threadIdx.x), sub = tid % kSub;
  const int64_t S = offsets[G];
  for (int64_t r = S + int64_t(blockIdx.x) * blockDim.x + tid; r < T; r += int64_t(gridDim.x) * blockDim.x)
    dprobs[r] = 0.f;
  const fp8::ExpertTile et = fp8::expert_tile(offsets, G, blockIdx.x);
  if (et.g == G) return;
  const int64_t base = et.base, begin = offsets[et.g], rows = offsets[et.g + 1] - begin, t = blockIdx.x - base;
  const int64_t K = 2 * L.ffn;
  if (tid < kFp8Tile) dprob_rows[tid] = 0.f;
  __syncthreads();
  for (int64_t j0 = 0; j0 < L.ffn; j0 += kFp8Tile) {
    // The pair's a tile starts at column ca0, its b tile at ca0 + b_off; this thread's j .. j + 7
    // sit at ca0 + sub * 8 .. in each.
    const int64_t ca0 = backend::glu_a_column(j0, L.interleave), j = j0 + sub * 8, ca = ca0 + sub * 8;
    const int64_t kb_h = j0 / kFp8Tile, kb_a = ca0 / kFp8Tile, kb_b = (ca0 + L.b_off) / kFp8Tile;
#pragma unroll 4
    for (int p = 0; p < kPasses; ++p) {
      const int row = tid / kSub + kRowsPerPass * p;  // the tile's row
      const int64_t r = t * kFp8Tile + row;          // the expert's
      fp8::Chunk<E> h = {}, da = {}, db = {};
      float dp = 0.f;
      if (r < rows) {
        float a[8], b[8], d[8], vh[8], vda[8], vdb[8];
        const float pr = probs[(begin + r) * probs_stride];
        load_glu_pair<E, kVec, kCodes>(z, z_ld, zq, zs, K, L, begin, rows, begin + r, ca0, ca, a, b);
        const E* dhr = dh + (begin + r) * dh_ld;
        if constexpr (kVec) {
          Pack<E, 8> pd;
          pd.load(dhr + j);
#pragma unroll
          for (int i = 0; i < 8; ++i) d[i] = pd.v[i];
        } else {
#pragma unroll
          for (int i = 0; i < 8; ++i) d[i] = load_f32(dhr, j + i);
        }
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          const SwigluGrad g = swiglu_grad(a[i], b[i], d[i], pr);
          dp += g.dprob;
          vh[i] = swiglu_value(a[i], b[i], pr);
          vda[i] = g.da;
          vdb[i] = g.db;
        }
        h.round_from(vh);
        da.round_from(vda);
        db.round_from(vdb);
      }
#pragma unroll
      for (int o = kSub / 2; o > 0; o /= 2) dp += __shfl_xor_sync(0xffffffffu, dp, o);  // the row's 16 threads
      if (sub == 0) dprob_rows[row] += dp;  // this thread's row in every pair: no race
      fp8::quantize_held_chunk<E, kVec, false, true>(h, p, stage_h, begin, rows, t, L.ffn, kb_h, nullptr, nullptr);
      fp8::quantize_held_chunk<E, kVec, true, true>(da, p, stage_a, begin, rows, t, K, kb_a, q_row, s_row);
      fp8::quantize_held_chunk<E, kVec, true, true>(db, p, stage_b, begin, rows, t, K, kb_b, q_row, s_row);
    }
    __syncthreads();  // the pair's three tiles staged
    auto words = [](const uint4* stage) { return reinterpret_cast<const uint32_t*>(stage); };
    fp8::columnwise_from_stage<E>(words(stage_h), base, begin, rows, t, L.ffn, j0, columns, h_col, h_scale);
    fp8::columnwise_from_stage<E>(words(stage_a), base, begin, rows, t, K, ca0, columns, q_col, s_col);
    fp8::columnwise_from_stage<E>(words(stage_b), base, begin, rows, t, K, ca0 + L.b_off, columns, q_col, s_col);
    __syncthreads();  // the stages read before the next pair's are written
  }
  if (tid < kFp8Tile && t * kFp8Tile + tid < rows) dprobs[begin + t * kFp8Tile + tid] = dprob_rows[tid];
}

// y[t] += probs[t] * b2_g for rows t < S (fp32 add, one rounding).
template <typename E>
__global__ void __launch_bounds__(kRowThreads)
    scaled_bias_add_kernel(const int64_t* offsets, int64_t G, int64_t out, E* y, int64_t y_ld, const float* probs,
                           int64_t probs_stride, const PtrTable bias) {
  const int64_t t = blockIdx.x;
  if (t >= offsets[G]) return;
  const E* b2 = static_cast<const E*>(bias.ptr[group_of_row(offsets, G, t)]);
  const float pr = probs[t * probs_stride];
  E* yr = y + t * y_ld;
  for (int64_t o = threadIdx.x; o < out; o += kRowThreads) store_f32(yr, o, load_f32(yr, o) + pr * load_f32(b2, o));
}

// db2_g[o] = sum over g's rows (ascending) of probs[t] * dy[t, o]: one thread per (g, o), so the
// order is fixed; 0 for an empty group. Grid (column blocks, G). Used for fc2's bias only (MoE
// experts rarely have one), hence the simple schedule.
template <typename E>
__global__ void scaled_bias_grad_kernel(const int64_t* offsets, int64_t out, const E* dy, int64_t dy_ld,
                                        const float* probs, int64_t probs_stride, PtrTable db) {
  const int64_t g = blockIdx.y, o = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (o >= out) return;
  float s = 0.f;
  for (int64_t t = offsets[g]; t < offsets[g + 1]; ++t) s += probs[t * probs_stride] * load_f32(dy, t * dy_ld + o);
  store_f32(static_cast<E*>(db.ptr[g]), o, s);
}

PtrTable table(const std::vector<TensorView>& views) {
  PtrTable t{};
  for (size_t g = 0; g < views.size(); ++g) t.ptr[g] = views[g].data();
  return t;
}

bool aligned16(const TensorView& t) {
  return reinterpret_cast<uintptr_t>(t.data()) % 16 == 0 && (t.stride(0) * int64_t(t.element_size())) % 16 == 0;
}

// 16-byte packs when every pack lies inside one interleave block and every row start is aligned.
bool vectorisable(DType dtype, int64_t ffn, int64_t interleave, std::initializer_list<const TensorView*> rows) {
  const int64_t v = 16 / int64_t(dtype_size(dtype));
  if (ffn % v != 0 || (interleave != 0 && interleave % v != 0)) return false;
  for (const TensorView* t : rows)
    if (!aligned16(*t)) return false;
  return true;
}

using cuda::as_cuda;

class CudaMLPBackend final : public GroupedMLPBackend {
 public:
  size_t scratch_bytes(DType, int64_t, int64_t, int64_t, int64_t) const override { return 0; }

  void swiglu_forward(const SwigluForwardParams& p, void*, Stream stream) override {
    if (p.rows.num_rows == 0) return;
    if (p.h_fp8.data.defined()) return swiglu_forward_fp8(p, stream);
    cuda::DeviceGuard guard(p.h.device().index);
    const GluLayout L{p.ffn, p.interleave, glu_b_offset(p.ffn, p.interleave)};
    const bool vec = vectorisable(p.rows.dtype, p.ffn, p.interleave, {&p.fc1_out, &p.h});
    dispatch_dtype(p.rows.dtype, "CUDA GroupedMLP", [&](auto e) {
      using E = decltype(e);
      constexpr int V = 16 / sizeof(E);
      auto launch = [&](auto kernel) {
        kernel<<<unsigned(p.rows.num_rows), kRowThreads, 0, as_cuda(stream)>>>(
            p.rows.offsets, p.rows.num_groups, L, p.fc1_out.data_as<const E>(), p.fc1_out.stride(0),
            p.probs.data_as<const float>(), p.probs.stride(0), p.h.data_as<E>(), p.h.stride(0));
      };
      if (vec) launch(swiglu_forward_kernel<E, V>);
      else launch(swiglu_forward_kernel<E, 1>);
    });
    ST_CUDA_CHECK(cudaGetLastError(), "swiglu_forward_kernel launch");
  }

  void swiglu_forward_fp8(const SwigluForwardParams& p, Stream stream) {
    cuda::DeviceGuard guard(p.fc1_out.device().index);
    const GluLayout L{p.ffn, p.interleave, glu_b_offset(p.ffn, p.interleave)};
    // 8-byte code stores: the codes' rows (ffn bytes) on 8-byte boundaries.
    const bool vec = vectorisable(p.rows.dtype, p.ffn, p.interleave, {&p.fc1_out}) &&
                     reinterpret_cast<uintptr_t>(p.h_fp8.data.data()) % 8 == 0;
    dispatch_dtype(p.rows.dtype, "CUDA GroupedMLP", [&](auto e) {
      using E = decltype(e);
      if constexpr (sizeof(E) != 2) {
        ST_FAIL("CUDA GroupedMLP: the FP8 SwiGLU forward takes a 2-byte dtype (the FP8 recipe's layer is bf16)");
      } else {
        auto launch = [&](auto kernel) {
          kernel<<<unsigned(p.rows.num_rows), kRowThreads, 0, as_cuda(stream)>>>(
              p.rows.offsets, p.rows.num_groups, L, p.fc1_out.data_as<const E>(), p.fc1_out.stride(0),
              p.probs.data_as<const float>(), p.probs.stride(0), p.h_fp8.data.data_as<uint8_t>(),
              p.h_fp8.scale.data_as<float>());
        };
        if (vec) launch(swiglu_forward_fp8_kernel<E, true>);
        else launch(swiglu_forward_fp8_kernel<E, false>);
      }
    });
    ST_CUDA_CHECK(cudaGetLastError(), "swiglu_forward_fp8_kernel launch");
  }

  void swiglu_backward(const SwigluBackwardParams& p, void*, Stream stream) override {
    if (p.rows.num_rows == 0) return;
    if (p.dz_rowwise.data.defined()) return swiglu_backward_fp8(p, stream);
    cuda::DeviceGuard guard(p.fc1_out_grad.device().index);
    const GluLayout L{p.ffn, p.interleave, glu_b_offset(p.ffn, p.interleave)};
    const bool vec = vectorisable(p.rows.dtype, p.ffn, p.interleave, {&p.fc1_out, &p.dh, &p.fc1_out_grad});
    const PtrTable bias = table(p.bias);
    dispatch_dtype(p.rows.dtype, "CUDA GroupedMLP", [&](auto e) {
      using E = decltype(e);
      constexpr int V = 16 / sizeof(E);
      auto launch = [&](auto kernel) {
        kernel<<<unsigned(p.rows.num_rows), kRowThreads, 0, as_cuda(stream)>>>(
            p.rows.offsets, p.rows.num_groups, L, p.fc1_out.data_as<const E>(), p.fc1_out.stride(0),
            p.probs.data_as<const float>(), p.probs.stride(0), p.dh.data_as<const E>(), p.dh.stride(0),
            p.dy.data_as<const E>(), p.dy.defined() ? p.dy.stride(0) : 0, p.out, bias, !p.bias.empty(),
            p.fc1_out_grad.data_as<E>(), p.fc1_out_grad.stride(0), p.dprobs.data_as<float>());
      };
      if (vec) launch(swiglu_backward_kernel<E, V>);
      else launch(swiglu_backward_kernel<E, 1>);
    });
    ST_CUDA_CHECK(cudaGetLastError(), "swiglu_backward_kernel launch");
  }

  void swiglu_backward_fp8(const SwigluBackwardParams& p, Stream stream) {
    ST_CHECK_ARG(glu_tiles_pair(p.ffn, p.interleave) && p.bias.empty(), "SwiGLU's FP8 backward",
                 "128-column tiles of a's and b's in pairs and no bias",
                 "ffn " + std::to_string(p.ffn) + ", interleave " + std::to_string(p.interleave) +
                     (p.bias.empty() ? "" : ", a bias"));
    cuda::DeviceGuard guard(p.fc1_out.device().index);
    const int64_t T = p.rows.num_rows, G = p.rows.num_groups;
    const GluLayout L{p.ffn, p.interleave, glu_b_offset(p.ffn, p.interleave)};
    // 16-byte loads of z (or 8-byte ones of its codes) and dh' rows, 8-byte rowwise code stores,
    // 16-byte columnwise ones.
    const bool codes = p.fc1_out_codes.data.defined();
    const bool vec = (codes ? vectorisable(p.rows.dtype, p.ffn, p.interleave, {&p.dh}) &&
                                  reinterpret_cast<uintptr_t>(p.fc1_out_codes.data.data()) % 8 == 0
                            : vectorisable(p.rows.dtype, p.ffn, p.interleave, {&p.fc1_out, &p.dh})) &&
                     reinterpret_cast<uintptr_t>(p.dz_rowwise.data.data()) % 8 == 0;
    for (const Fp8Tensor* c : {&p.dz_columnwise, &p.h_columnwise}) {
      const uintptr_t base = reinterpret_cast<uintptr_t>(c->data.data());
      ST_CHECK_ARG(base % 16 == 0, c == &p.h_columnwise ? "h_columnwise" : "dz_columnwise", "a 16-byte aligned base",
                   "an address of " + std::to_string(base % 16) + " mod 16");
    }
    ST_CHECK_ARG(p.h_columnwise.data.size(1) == p.dz_columnwise.data.size(1), "h_columnwise",
                 "the columns of dz_columnwise (the same rows and groups)", p.h_columnwise.data.size(1));
    dispatch_dtype(p.rows.dtype, "CUDA GroupedMLP", [&](auto e) {
      using E = decltype(e);
      if constexpr (!std::is_same_v<E, bf16_t>) {
        ST_FAIL("CUDA GroupedMLP: the FP8 SwiGLU backward takes bf16 (the FP8 recipe's layer dtype)");
      } else {
        auto launch = [&](auto kernel) {
          cuda::opt_in_smem(reinterpret_cast<const void*>(kernel), kSwigluBwdSmem);
          kernel<<<unsigned(fp8_columnwise_max_tiles(T, G)), 256, kSwigluBwdSmem, as_cuda(stream)>>>(
              p.rows.offsets, G, T, L, codes ? nullptr : p.fc1_out.data_as<const E>(),
              codes ? 0 : p.fc1_out.stride(0), codes ? p.fc1_out_codes.data.data_as<const uint8_t>() : nullptr,
              codes ? p.fc1_out_codes.scale.data_as<const float>() : nullptr, p.probs.data_as<const float>(),
              p.probs.stride(0), p.dh.data_as<const E>(), p.dh.stride(0),
              p.dz_rowwise.data.data_as<uint8_t>(), p.dz_rowwise.scale.data_as<float>(),
              p.dz_columnwise.data.size(1), p.dz_columnwise.data.data_as<uint8_t>(),
              p.dz_columnwise.scale.data_as<float>(), p.h_columnwise.data.data_as<uint8_t>(),
              p.h_columnwise.scale.data_as<float>(), p.dprobs.data_as<float>());
        };
        if (codes) {
          if (vec) launch(swiglu_backward_fp8_kernel<E, true, true>);
          else launch(swiglu_backward_fp8_kernel<E, false, true>);
        } else {
          if (vec) launch(swiglu_backward_fp8_kernel<E, true, false>);
          else launch(swiglu_backward_fp8_kernel<E, false, false>);
        }
      }
    });
    ST_CUDA_CHECK(cudaGetLastError(), "swiglu_backward_fp8_kernel launch");
  }

  void scaled_bias_add(const ScaledBiasAddParams& p, void*, Stream stream) override {
    if (p.rows.num_rows == 0) return;
    cuda::DeviceGuard guard(p.y.device().index);
    const PtrTable bias = table(p.bias);
    dispatch_dtype(p.rows.dtype, "CUDA GroupedMLP", [&](auto e) {
      using E = decltype(e);
      scaled_bias_add_kernel<E><<<unsigned(p.rows.num_rows), kRowThreads, 0, as_cuda(stream)>>>(
          p.rows.offsets, p.rows.num_groups, p.out, p.y.data_as<E>(), p.y.stride(0), p.probs.data_as<const float>(),
          p.probs.stride(0), bias);
    });
    ST_CUDA_CHECK(cudaGetLastError(), "scaled_bias_add_kernel launch");
  }

  void scaled_bias_grad(const ScaledBiasGradParams& p, void*, Stream stream) override {
    if (p.rows.num_groups == 0 || p.out == 0) return;
    cuda::DeviceGuard guard(p.dy.device().index);
    const PtrTable db = table(p.db);
    const dim3 grid(unsigned((p.out + 255) / 256), unsigned(p.rows.num_groups));
    dispatch_dtype(p.rows.dtype, "CUDA GroupedMLP", [&](auto e) {
      using E = decltype(e);
      scaled_bias_grad_kernel<E><<<grid, 256, 0, as_cuda(stream)>>>(p.rows.offsets, p.out, p.dy.data_as<const E>(),
                                                                    p.dy.stride(0), p.probs.data_as<const float>(),
                                                                    p.probs.stride(0), db);
    });
    ST_CUDA_CHECK(cudaGetLastError(), "scaled_bias_grad_kernel launch");
  }
};

}  // namespace

GroupedMLPBackend& grouped_mlp_cuda_backend() {
  static CudaMLPBackend backend;
  return backend;
}

}  // namespace sparsetrain::backend

// The CUDA backend of GroupedMLP's elementwise stages (ops/grouped_mlp_backend.h): SwiGLU x probs
// forward (h' from fc1's output), its backward (d fc1_out and dprobs), and fc2's probs-scaled bias
// and bias grad. One pass over the data each, 16-byte vector loads where the layout allows, S
// read from the device offsets (no host sync, capturable), every reduction in a fixed order
// (bitwise deterministic, no atomics).
//
// Row kernels run one block per row (grid = T): rows >= S write their zero tail in the same pass.
#include <cuda_runtime.h>

#include <initializer_list>

#include "common/dispatch_dtype.h"
#include "common/group_offsets.h"
#include "cuda/cuda_check.h"
#include "cuda/cuda_stream.h"
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
      const float sig = sigmoid(a.v[i]), silu = a.v[i] * sig;
      dp += silu * b.v[i] * d.v[i];  // h . dh'
      const float dhv = pr * d.v[i];  // dL/dh, h' = probs * h
      da.v[i] = dhv * b.v[i] * sig * (1.f + a.v[i] * (1.f - sig));
      db.v[i] = dhv * silu;
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

// The simple CUDA grouped GEMMs (SIMT, fp32 accumulate), the reference-shaped fallback that runs
// every shape and alignment: scheduler x mainloop x epilogue in one small kernel.
//  - scheduler: fprop/dgrad tiles walk the ragged rows with map_row_tile (a tile never spans two
//    groups); wgrad tiles are (group, out tile, in tile) with the group's rows as ragged K.
//  - mainloop: 64x64 output tile, K in steps of 16 through shared memory, 4x4 per thread.
//  - epilogue: bias, rounding to the output type, or fp32 main_grad += / =.
// Every output element is one thread's sum in ascending k: bitwise deterministic, no atomics.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "common/grouped_tile_scheduler.h"
#include "cuda/cuda_check.h"
#include "cuda/element.cuh"
#include "cuda/grouped_linear/grouped_gemm_params.h"
#include "sparsetrain/dtype.h"
#include "sparsetrain/error.h"

namespace sparsetrain::cuda {

constexpr int kTileM = 64, kTileN = 64, kTileK = 16, kThreads = 256;

// __grid_constant__: the tables are read where the launch put them (a by-value array indexed at
// run time would otherwise be copied to local memory first).
template <typename E, int Cap>
__global__ void __launch_bounds__(kThreads) grouped_gemm_simt_kernel(const __grid_constant__ CappedGemmParams<Cap> p) {
  __shared__ float As[kTileK][kTileM];
  __shared__ float Bs[kTileK][kTileN];
  const int tid = int(threadIdx.x), tx = tid % 16, ty = tid / 16;
  const int64_t n0 = int64_t(blockIdx.x) * kTileN;
  const int64_t* offsets = p.write_offsets != nullptr ? p.host_offsets : p.offsets;
  if (p.write_offsets != nullptr && blockIdx.x == 0 && blockIdx.y == 0 && blockIdx.z == 0)
    for (int64_t i = tid; i <= p.num_groups; i += kThreads) p.write_offsets[i] = p.host_offsets[i];

  // Scheduler: which rows (M) and which K range this tile covers.
  int64_t g, m0, m_end, k_begin, k_end, N;
  const E* act = static_cast<const E*>(p.act);
  if (p.kind == GemmKind::kWgrad) {
    g = blockIdx.z;
    m0 = int64_t(blockIdx.y) * kTileM;
    m_end = min(m0 + kTileM, p.out);
    k_begin = offsets[g];
    k_end = offsets[g + 1];
    N = p.in;
  } else {
    const RowTile rt = map_row_tile(offsets, p.num_groups, kTileM, blockIdx.y);
    if (rt.group < 0) return;
    g = rt.group;
    m0 = rt.row_begin;
    m_end = rt.row_end;
    k_begin = 0;
    k_end = p.kind == GemmKind::kFprop ? p.in : p.out;
    N = p.kind == GemmKind::kFprop ? p.out : p.in;
  }
  if (m0 >= m_end || n0 >= N) return;
  const E* w = static_cast<const E*>(p.weight[g]);
  const E* act2 = static_cast<const E*>(p.act2);

  // A(m, k) and B(k, n) of each GEMM, from row-major operands.
  auto load_a = [&](int64_t m, int64_t k) -> float {
    if (m >= m_end || k >= k_end) return 0.f;
    if (p.kind == GemmKind::kWgrad) return load_f32(act, k * p.act_ld + m);  // dy[t, o]
    return load_f32(act, m * p.act_ld + k);                                  // x[t, k] or dy[t, o]
  };
  auto load_b = [&](int64_t k, int64_t n) -> float {
    if (n >= N || k >= k_end) return 0.f;
    switch (p.kind) {
      case GemmKind::kFprop: return load_f32(w, n * p.in + k);  // W[o, k]
      case GemmKind::kDgrad: return load_f32(w, k * p.in + n);  // W[o, k] with o as K
      default: return load_f32(act2, k * p.act2_ld + n);        // x[t, k] with t as K
    }
  };

  float acc[4][4] = {};
  for (int64_t k0 = k_begin; k0 < k_end; k0 += kTileK) {
    for (int i = tid; i < kTileK * kTileM; i += kThreads) {
      const int kk = i / kTileM, mm = i % kTileM;
      As[kk][mm] = load_a(m0 + mm, k0 + kk);
    }
    for (int i = tid; i < kTileK * kTileN; i += kThreads) {
      const int kk = i / kTileN, nn = i % kTileN;
      Bs[kk][nn] = load_b(k0 + kk, n0 + nn);
    }
    __syncthreads();
#pragma unroll
    for (int kk = 0; kk < kTileK; ++kk) {
      float a[4], b[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) a[i] = As[kk][ty * 4 + i];
#pragma unroll
      for (int j = 0; j < 4; ++j) b[j] = Bs[kk][tx * 4 + j];
#pragma unroll
      for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[i][j] = fmaf(a[i], b[j], acc[i][j]);
    }
    __syncthreads();
  }

  // Epilogue.
  for (int i = 0; i < 4; ++i) {
    const int64_t m = m0 + ty * 4 + i;
    if (m >= m_end) continue;
    for (int j = 0; j < 4; ++j) {
      const int64_t n = n0 + tx * 4 + j;
      if (n >= N) continue;
      float v = acc[i][j];
      if (p.kind == GemmKind::kWgrad) {
        const int64_t at = m * p.in + n;
        switch (p.wgrad_store) {
          case WgradStore::kWeightGrad: store_f32(static_cast<E*>(p.dw[g]), at, v); break;
          case WgradStore::kMainGradAccumulate:
            // An expert with no rows leaves main_grad bit-for-bit alone (even a -0.0).
            if (k_end > k_begin) static_cast<float*>(p.dw[g])[at] += v;
            break;
          case WgradStore::kMainGradOverwrite: static_cast<float*>(p.dw[g])[at] = v; break;
        }
      } else {
        if (p.kind == GemmKind::kFprop && p.bias[g] != nullptr) v += load_f32(static_cast<const E*>(p.bias[g]), n);
        store_f32(static_cast<E*>(p.c), m * p.c_ld + n, v);
      }
    }
  }
}

// db[g, o] = sum over g's rows of dy[t, o], rows ascending: one thread per (g, o), deterministic.
template <typename E>
__global__ void bias_grad_kernel(const int64_t* offsets, int64_t out, const E* dy, int64_t dy_ld, E* db) {
  const int64_t g = blockIdx.y, o = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (o >= out) return;
  float s = 0.f;
  for (int64_t t = offsets[g]; t < offsets[g + 1]; ++t) s += load_f32(dy, t * dy_ld + o);
  store_f32(db, g * out + o, s);
}

// Zero rows [S, rows) of a contiguous [rows, cols] output (S = offsets[G], read on the device).
template <typename E>
__global__ void zero_tail_kernel(const int64_t* offsets, int64_t num_groups, E* c, int64_t rows, int64_t cols) {
  const int64_t begin = offsets[num_groups] * cols, end = rows * cols;
  for (int64_t i = begin + int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < end;
       i += int64_t(gridDim.x) * blockDim.x)
    store_f32(c, i, 0.f);
}

template <typename E>
bool launch_grouped_gemm(const GroupedGemmParams& p, void* stream) {
  dim3 grid;
  if (p.kind == GemmKind::kWgrad) {
    grid = dim3(unsigned((p.in + kTileN - 1) / kTileN), unsigned((p.out + kTileM - 1) / kTileM),
                unsigned(p.num_groups));
  } else {
    // Sized from (T, G) only: the same launch serves every split of T rows (CUDA graphs).
    const int64_t n = p.kind == GemmKind::kFprop ? p.out : p.in;
    const int64_t tiles = max_row_tiles(p.num_rows, p.num_groups, kTileM);
    if (tiles > 65535) ST_FAIL("grouped GEMM: ", p.num_rows, " rows need more than 65535 row tiles");
    grid = dim3(unsigned((n + kTileN - 1) / kTileN), unsigned(tiles), 1);
  }
  if (grid.x == 0 || grid.y == 0 || grid.z == 0) return false;
  with_group_cap(p.num_groups, [&](auto cap) {
    constexpr int kCap = decltype(cap)::value;
    grouped_gemm_simt_kernel<E, kCap><<<grid, kThreads, 0, static_cast<cudaStream_t>(stream)>>>(capped_params<kCap>(p));
  });
  ST_CUDA_CHECK(cudaGetLastError(), "grouped_gemm_simt_kernel launch");
  return true;
}

template <typename E>
void launch_bias_grad(const int64_t* offsets, int64_t num_groups, int64_t out, const void* dy, int64_t dy_ld,
                      void* db, void* stream) {
  const dim3 grid(unsigned((out + 255) / 256), unsigned(num_groups));
  bias_grad_kernel<E><<<grid, 256, 0, static_cast<cudaStream_t>(stream)>>>(
      offsets, out, static_cast<const E*>(dy), dy_ld, static_cast<E*>(db));
  ST_CUDA_CHECK(cudaGetLastError(), "bias_grad_kernel launch");
}

template <typename E>
void launch_zero_tail(const int64_t* offsets, int64_t num_groups, void* c, int64_t rows, int64_t cols, void* stream) {
  if (rows * cols == 0) return;
  // At most 512 blocks (one wave on an H100): the tail is known only on the device and usually
  // empty, and 4096 blocks that read offsets[G] and leave took 3.7 us a call (torch.profiler).
  const int64_t blocks = (rows * cols + 255) / 256;
  zero_tail_kernel<E><<<unsigned(blocks < 512 ? blocks : 512), 256, 0, static_cast<cudaStream_t>(stream)>>>(
      offsets, num_groups, static_cast<E*>(c), rows, cols);
  ST_CUDA_CHECK(cudaGetLastError(), "zero_tail_kernel launch");
}

}  // namespace sparsetrain::cuda

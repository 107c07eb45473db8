// build_block_mask on a CUDA device: the same per-row / per-column functions as the host builder
// (common/block_mask_rows.h), one thread each, so the device mask equals the host one bit for
// bit. Three launches on the caller's stream (rows, transposed columns, write-order rows), no
// host synchronisation; padding past the counts is zeroed like the host builder's.
#include <cuda_runtime.h>

#include "common/block_mask_rows.h"
#include "cuda/runtime_cuda.h"
#include "ops/block_mask_internal.h"
#include "sparsetrain/error.h"

namespace sparsetrain {
namespace {

constexpr int kThreads = 128;

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) ST_FAIL(what, " failed: ", cudaGetErrorString(e));
}

// Slice b of a [B, 1, R] counts / [B, 1, R, W] indices pair (contiguous, full width).
__host__ __device__ IndexRows rows_of(const int32_t* counts, const int32_t* indices, int64_t b, int64_t R,
                                      int64_t W) {
  IndexRows r;
  if (counts == nullptr) return r;
  r.counts = counts + b * R;
  r.count_stride = 1;
  r.indices = indices + b * R * W;
  r.row_stride = W;
  r.elem_stride = 1;
  return r;
}

__global__ void rows_kernel(const DeviceMaskBuild p, int32_t* kv_num, int32_t* kv_idx, int32_t* full_num,
                            int32_t* full_idx, int64_t Mq, int64_t Nk) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= p.batch * Mq) return;
  const int64_t b = i / Mq, m = i % Mq;
  MaskRowParams row{p.kind, p.window_left, p.window_right, p.prefix_length, p.seq_q, p.seq_kv, nullptr, nullptr};
  if (p.doc_q != nullptr) {
    row.doc_q = p.doc_q + (p.doc_q_batch == 1 ? 0 : b) * p.doc_q_stride;
    row.doc_kv = p.doc_kv + (p.doc_kv_batch == 1 ? 0 : b) * p.doc_kv_stride;
  }
  int32_t* partial = kv_idx + i * Nk;
  int32_t* full = full_idx + i * Nk;
  for (int64_t n = 0; n < Nk; ++n) partial[n] = full[n] = 0;
  build_block_row(row, p.block_q, p.block_kv, m, Nk, partial, kv_num + i, full, full_num + i);
}

__global__ void transpose_kernel(int64_t batch, const int32_t* kv_num, const int32_t* kv_idx, const int32_t* full_num,
                                 const int32_t* full_idx, int32_t* q_num, int32_t* q_idx, int32_t* fq_num,
                                 int32_t* fq_idx, int64_t Mq, int64_t Nk) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= batch * Nk) return;
  const int64_t b = i / Nk, n = i % Nk;
  int32_t* q = q_idx + i * Mq;
  int32_t* fq = fq_idx + i * Mq;
  for (int64_t m = 0; m < Mq; ++m) q[m] = fq[m] = 0;
  q_num[i] = transpose_column(rows_of(kv_num, kv_idx, b, Mq, Nk), Mq, int32_t(n), q);
  fq_num[i] = transpose_column(rows_of(full_num, full_idx, b, Mq, Nk), Mq, int32_t(n), fq);
}

// One thread per (b, q block m); rank_scratch: [B * Mq, Nk], zero on entry (and on return).
__global__ void write_order_kernel(const DeviceMaskBuild p, const int32_t* kv_num, const int32_t* kv_idx,
                                   const int32_t* full_num, const int32_t* full_idx, const int32_t* q_num,
                                   const int32_t* q_idx, const int32_t* fq_num, const int32_t* fq_idx,
                                   int32_t* order, int32_t* full_order, int32_t* rank_scratch, int64_t Mq,
                                   int64_t Nk) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= p.batch * Mq) return;
  const int64_t b = i / Mq, m = i % Mq;
  WriteOrderOut wo{order + b * Nk * Mq, Mq, 1}, fwo{full_order + b * Nk * Mq, Mq, 1};
  write_order_row(rows_of(kv_num, kv_idx, b, Mq, Nk), rows_of(full_num, full_idx, b, Mq, Nk), m,
                  rows_of(q_num, q_idx, b, Nk, Mq), rows_of(fq_num, fq_idx, b, Nk, Mq), wo, fwo, p.schedule, p.inverse,
                  Nk, p.sub_tiles, rank_scratch + i * Nk);
}

unsigned blocks_for(int64_t n) { return unsigned((n + kThreads - 1) / kThreads); }
int32_t* ptr(const Tensor& t) { return t.view().data_as<int32_t>(); }

}  // namespace

void build_block_mask_cuda(const DeviceMaskBuild& p, BlockMaskTensors& t, Stream stream) {
  const cudaStream_t s = static_cast<cudaStream_t>(stream.handle);
  const int64_t Mq = t.mask.num_q_blocks(), Nk = t.mask.num_kv_blocks(), B = p.batch;
  cuda::DeviceGuard guard(t.kv_indices.view().device().index);
  if (p.schedule == ScheduleKind::kPermutation)  // from pageable memory: staged before this returns
    check(cudaMemcpyAsync(p.inverse, p.inverse_host, size_t(Nk) * sizeof(int32_t), cudaMemcpyHostToDevice, s),
          "cudaMemcpyAsync (schedule)");
  rows_kernel<<<blocks_for(B * Mq), kThreads, 0, s>>>(p, ptr(t.kv_num_blocks), ptr(t.kv_indices),
                                                      ptr(t.full_kv_num_blocks), ptr(t.full_kv_indices), Mq, Nk);
  check(cudaGetLastError(), "block mask rows_kernel launch");
  transpose_kernel<<<blocks_for(B * Nk), kThreads, 0, s>>>(
      B, ptr(t.kv_num_blocks), ptr(t.kv_indices), ptr(t.full_kv_num_blocks), ptr(t.full_kv_indices),
      ptr(t.q_num_blocks), ptr(t.q_indices), ptr(t.full_q_num_blocks), ptr(t.full_q_indices), Mq, Nk);
  check(cudaGetLastError(), "block mask transpose_kernel launch");
  const size_t order_bytes = size_t(B * Nk * Mq) * sizeof(int32_t);
  check(cudaMemsetAsync(ptr(t.dq_write_order), 0, order_bytes, s), "cudaMemsetAsync (write order)");
  check(cudaMemsetAsync(ptr(t.dq_write_order_full), 0, order_bytes, s), "cudaMemsetAsync (write order)");
  check(cudaMemsetAsync(p.rank_scratch, 0, size_t(B * Mq * Nk) * sizeof(int32_t), s), "cudaMemsetAsync (rank scratch)");
  write_order_kernel<<<blocks_for(B * Mq), kThreads, 0, s>>>(
      p, ptr(t.kv_num_blocks), ptr(t.kv_indices), ptr(t.full_kv_num_blocks), ptr(t.full_kv_indices),
      ptr(t.q_num_blocks), ptr(t.q_indices), ptr(t.full_q_num_blocks), ptr(t.full_q_indices), ptr(t.dq_write_order),
      ptr(t.dq_write_order_full), p.rank_scratch, Mq, Nk);
  check(cudaGetLastError(), "block mask write_order_kernel launch");
}

}  // namespace sparsetrain

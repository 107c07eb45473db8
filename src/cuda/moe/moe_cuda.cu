// The MoE router and the rows' moves on a CUDA device (ops/moe_backend.h): the rules of
// common/moe_routing.h, one thread per token, so the device chooses what the host chooses; the
// expert-major layout without atomics in what it writes (per-chunk counts, a scan over chunks per
// expert, then each chunk's tokens placed in order by one thread per expert), so it is a function
// of the choice alone, as on the host; score sums reduced in a fixed tree order per expert. Every
// launch on the caller's stream; nothing is read by the host, so all of it is graph-capturable.
#include <cuda_runtime.h>

#include "common/moe_routing.h"
#include "cuda/cuda_check.h"
#include "cuda/cuda_stream.h"
#include "cuda/element.cuh"
#include "cuda/runtime_cuda.h"
#include "ops/moe_backend.h"

namespace sparsetrain {
namespace {

constexpr int kThreads = 256;
constexpr int kChunk = 256;  // tokens per chunk of the layout

unsigned blocks_for(int64_t n, int threads = kThreads) {
  const int64_t b = (n + threads - 1) / threads;
  return unsigned(b < 65535 ? (b > 0 ? b : 1) : 65535);
}

// Each token: its experts and probs (the shared rule), and its softmax row (max, 1 / sum) for the
// score sums; a token whose experts are NaN-chosen still gets k distinct ids (the rule's).
__global__ void route_tokens_kernel(RouterRule r, const float* __restrict__ logits, int64_t stride,
                                    const float* __restrict__ bias, int64_t N, int32_t* __restrict__ experts,
                                    float* __restrict__ probs, SoftmaxRow* __restrict__ rows) {
  for (int64_t n = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; n < N; n += int64_t(gridDim.x) * blockDim.x) {
    const float* l = logits + n * stride;
    route_token(r, l, bias, experts + n * r.top_k, probs + n * r.top_k);
    rows[n] = r.score == RouterScore::kSoftmax ? router_softmax_row(l, r.num_experts) : SoftmaxRow{};
  }
}

// chunk_counts[c * E + e]: the (token, slot) pairs of chunk c that chose e (integer sums: any order
// gives the same counts).
__global__ void chunk_counts_kernel(const int32_t* __restrict__ experts, int64_t N, int32_t K, int32_t E,
                                    int32_t* __restrict__ chunk_counts) {
  extern __shared__ int32_t counts[];
  for (int32_t e = threadIdx.x; e < E; e += blockDim.x) counts[e] = 0;
  __syncthreads();
  const int64_t begin = int64_t(blockIdx.x) * kChunk, end = begin + kChunk < N ? begin + kChunk : N;
  for (int64_t n = begin + threadIdx.x; n < end; n += blockDim.x)
    for (int32_t i = 0; i < K; ++i) atomicAdd(&counts[experts[n * K + i]], 1);
  __syncthreads();
  for (int32_t e = threadIdx.x; e < E; e += blockDim.x) chunk_counts[int64_t(blockIdx.x) * E + e] = counts[e];
}

// Per expert, the chunks' counts become their starts inside the expert (an exclusive scan over the
// chunks, in place) and the expert's total; then the experts' starts (an exclusive scan over the
// experts, by one thread: E is small).
__global__ void scan_counts_kernel(int32_t* __restrict__ chunk_counts, int64_t chunks, int32_t E,
                                   int64_t* __restrict__ counts, int64_t* __restrict__ expert_start) {
  for (int32_t e = threadIdx.x; e < E; e += blockDim.x) {
    int64_t run = 0;
    for (int64_t c = 0; c < chunks; ++c) {
      const int32_t v = chunk_counts[c * E + e];
      chunk_counts[c * E + e] = int32_t(run);
      run += v;
    }
    counts[e] = run;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    int64_t run = 0;
    for (int32_t e = 0; e < E; ++e) expert_start[e] = run, run += counts[e];
  }
}

// One thread per expert places the chunk's tokens that chose it, in token order: the row of each
// (token, slot) and the token of each row.
__global__ void place_rows_kernel(const int32_t* __restrict__ experts, int64_t N, int32_t K, int32_t E,
                                  const int32_t* __restrict__ chunk_start, const int64_t* __restrict__ expert_start,
                                  int32_t* __restrict__ row_of, int32_t* __restrict__ token_of_row) {
  const int64_t begin = int64_t(blockIdx.x) * kChunk, end = begin + kChunk < N ? begin + kChunk : N;
  for (int32_t e = threadIdx.x; e < E; e += blockDim.x) {
    int64_t row = expert_start[e] + chunk_start[int64_t(blockIdx.x) * E + e];
    for (int64_t n = begin; n < end; ++n)
      for (int32_t i = 0; i < K; ++i)
        if (experts[n * K + i] == e) {
          row_of[n * K + i] = int32_t(row);
          token_of_row[row] = int32_t(n);
          ++row;
        }
  }
}

// score_sum[e]: expert e's scores summed over the tokens, one block per expert, each thread's
// strided partial then a fixed tree: the same bits on every run.
__global__ void score_sum_kernel(RouterRule r, const float* __restrict__ logits, int64_t stride, int64_t N,
                                 const SoftmaxRow* __restrict__ rows, float* __restrict__ score_sum) {
  __shared__ float part[kThreads];
  const int32_t e = int32_t(blockIdx.x);
  float s = 0.f;
  for (int64_t n = threadIdx.x; n < N; n += blockDim.x) s += router_score(r, logits[n * stride + e], rows[n]);
  part[threadIdx.x] = s;
  __syncthreads();
  for (int w = kThreads / 2; w > 0; w /= 2) {
    if (int(threadIdx.x) < w) part[threadIdx.x] += part[threadIdx.x + w];
    __syncthreads();
  }
  if (threadIdx.x == 0) score_sum[e] = part[0];
}

// Each token's logits gradient (the shared rule). Expert ids out of range or repeated (not
// route()'s output: the host cannot check device ids without a synchronisation) make that token's
// gradient NaN instead of reading out of bounds.
__global__ void route_backward_kernel(RouterRule r, const float* __restrict__ logits, int64_t stride,
                                      const int32_t* __restrict__ experts, int64_t experts_stride,
                                      const float* __restrict__ dprobs, int64_t dprobs_stride,
                                      const float* __restrict__ dscore_sum, int64_t N, float* __restrict__ dlogits) {
  for (int64_t n = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; n < N; n += int64_t(gridDim.x) * blockDim.x) {
    const int32_t* ex = experts + n * experts_stride;
    bool valid = true;
    for (int32_t i = 0; i < r.top_k; ++i) {
      valid = valid && ex[i] >= 0 && ex[i] < r.num_experts;
      for (int32_t j = 0; j < i; ++j) valid = valid && ex[j] != ex[i];
    }
    float* dl = dlogits + n * r.num_experts;
    if (!valid) {
      for (int32_t e = 0; e < r.num_experts; ++e) dl[e] = NAN;
      continue;
    }
    route_token_backward(r, logits + n * stride, ex, dprobs + n * dprobs_stride, dscore_sum, dl);
  }
}

// The row kernels: a warp a row (kRowWarps rows a CTA, grid-stride over the rows), its lanes over
// the row in 16-byte units where the rows' bases and strides allow it (vec16), else element by
// element: no division per element, one index load per row, so the row moves at the memory's speed.
constexpr int kRowWarps = kThreads / 32;

bool vec16(const void* p, int64_t stride_bytes, int64_t row_bytes) {
  return reinterpret_cast<uintptr_t>(p) % 16 == 0 && stride_bytes % 16 == 0 && row_bytes % 16 == 0;
}
unsigned row_blocks(int64_t rows) { return blocks_for(rows, kRowWarps); }

// rows[r] = x[index[r]], in units U (uint4, or the element's bits): W units a row, x_stride in units.
template <typename U>
__global__ void gather_rows_kernel(const U* __restrict__ x, int64_t x_stride, const int32_t* __restrict__ index,
                                   int64_t R, int64_t W, U* __restrict__ rows) {
  for (int64_t r = int64_t(blockIdx.x) * kRowWarps + threadIdx.x / 32; r < R; r += int64_t(gridDim.x) * kRowWarps) {
    const U* src = x + int64_t(index[r]) * x_stride;
    U* dst = rows + r * W;
    for (int64_t w = threadIdx.x % 32; w < W; w += 32) dst[w] = src[w];
  }
}

// out[n] = the sum over slots i of rows[row_of[n, i]], V elements a lane at a time (V = 16 bytes'
// worth, or 1): each element summed in fp32 from 0 in slot order, rounded once.
template <typename E, int V>
__global__ void combine_rows_kernel(const E* __restrict__ rows, int64_t rows_stride, const int32_t* __restrict__ row_of,
                                    int64_t N, int32_t K, int64_t H, E* __restrict__ out) {
  for (int64_t n = int64_t(blockIdx.x) * kRowWarps + threadIdx.x / 32; n < N; n += int64_t(gridDim.x) * kRowWarps) {
    const int32_t* slots = row_of + n * K;
    for (int64_t h = int64_t(threadIdx.x % 32) * V; h < H; h += 32 * V) {
      cuda::Pack<E, V> sum{};
      for (int32_t i = 0; i < K; ++i) {
        cuda::Pack<E, V> p;
        p.load(rows + int64_t(slots[i]) * rows_stride + h);
#pragma unroll
        for (int j = 0; j < V; ++j) sum.v[j] += p.v[j];
      }
      sum.store(out + n * H + h);
    }
  }
}

template <typename E>
void combine_rows_launch(const void* rows, int64_t rows_stride, const int32_t* row_of, int64_t N, int32_t K, int64_t H,
                         void* out, cudaStream_t s) {
  constexpr int V = 16 / sizeof(E);
  const auto* in = static_cast<const E*>(rows);
  auto* o = static_cast<E*>(out);
  const int64_t es = sizeof(E);
  if (vec16(rows, rows_stride * es, H * es) && vec16(out, H * es, H * es))
    combine_rows_kernel<E, V><<<row_blocks(N), kThreads, 0, s>>>(in, rows_stride, row_of, N, K, H, o);
  else
    combine_rows_kernel<E, 1><<<row_blocks(N), kThreads, 0, s>>>(in, rows_stride, row_of, N, K, H, o);
}

__global__ void permute_f32_kernel(const float* __restrict__ src, const int32_t* __restrict__ index, int64_t n,
                                   float* __restrict__ dst, bool scatter) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    if (scatter) {
      dst[index[i]] = src[i];
    } else {
      dst[i] = src[index[i]];
    }
  }
}

using cuda::as_cuda;

class MoECuda final : public backend::MoEBackend {
 public:
  size_t route_scratch_bytes(int64_t N, int32_t E) const override;
  void route(const RouterRule& r, const float* logits, int64_t stride, const float* bias, int64_t N,
             const backend::RouteOutputs& out, void* scratch, Device device, Stream stream) override;
  void route_backward(const RouterRule& r, const float* logits, int64_t stride, const int32_t* experts,
                      int64_t experts_stride, const float* dprobs, int64_t dprobs_stride, const float* dscore_sum,
                      int64_t N, float* dlogits, Device device, Stream stream) override;
  void gather_rows(DType dtype, const void* x, int64_t x_stride, const int32_t* index, int64_t R, int64_t H,
                   void* rows, Device device, Stream stream) override;
  void combine_rows(DType dtype, const void* rows, int64_t rows_stride, const int32_t* row_of, int64_t N, int32_t K,
                    int64_t H, void* out, Device device, Stream stream) override;
  void permute_f32(const float* src, const int32_t* index, int64_t n, float* dst, bool scatter, Device device,
                   Stream stream) override;
};

}  // namespace

size_t MoECuda::route_scratch_bytes(int64_t N, int32_t E) const {
  const int64_t chunks = (N + kChunk - 1) / kChunk;
  return size_t(N * int64_t(sizeof(SoftmaxRow)) + chunks * E * 4 + E * 8 + 256);
}

void MoECuda::route(const RouterRule& r, const float* logits, int64_t stride, const float* bias, int64_t N,
                    const backend::RouteOutputs& out, void* scratch, Device device, Stream stream) {
  cuda::DeviceGuard guard(device.index);
  const cudaStream_t s = as_cuda(stream);
  const int32_t E = r.num_experts, K = r.top_k;
  const int64_t chunks = (N + kChunk - 1) / kChunk;
  auto* rows = static_cast<SoftmaxRow*>(scratch);
  auto* chunk_counts = reinterpret_cast<int32_t*>(rows + N);
  auto* expert_start = reinterpret_cast<int64_t*>(
      (reinterpret_cast<uintptr_t>(chunk_counts + chunks * E) + 7) & ~uintptr_t(7));
  if (N > 0) {
    route_tokens_kernel<<<blocks_for(N), kThreads, 0, s>>>(r, logits, stride, bias, N, out.experts, out.probs, rows);
    ST_CUDA_CHECK(cudaGetLastError(), "route_tokens_kernel launch");
    chunk_counts_kernel<<<unsigned(chunks), kThreads, size_t(E) * 4, s>>>(out.experts, N, K, E, chunk_counts);
    ST_CUDA_CHECK(cudaGetLastError(), "chunk_counts_kernel launch");
  }
  scan_counts_kernel<<<1, kThreads, 0, s>>>(chunk_counts, chunks, E, out.counts, expert_start);
  ST_CUDA_CHECK(cudaGetLastError(), "scan_counts_kernel launch");
  if (N > 0) {
    place_rows_kernel<<<unsigned(chunks), kThreads, 0, s>>>(out.experts, N, K, E, chunk_counts, expert_start,
                                                            out.row_of, out.token_of_row);
    ST_CUDA_CHECK(cudaGetLastError(), "place_rows_kernel launch");
  }
  score_sum_kernel<<<unsigned(E), kThreads, 0, s>>>(r, logits, stride, N, rows, out.score_sum);
  ST_CUDA_CHECK(cudaGetLastError(), "score_sum_kernel launch");
}

void MoECuda::route_backward(const RouterRule& r, const float* logits, int64_t stride, const int32_t* experts,
                             int64_t experts_stride, const float* dprobs, int64_t dprobs_stride,
                             const float* dscore_sum, int64_t N, float* dlogits, Device device, Stream stream) {
  if (N <= 0) return;
  cuda::DeviceGuard guard(device.index);
  route_backward_kernel<<<blocks_for(N), kThreads, 0, as_cuda(stream)>>>(
      r, logits, stride, experts, experts_stride, dprobs, dprobs_stride, dscore_sum, N, dlogits);
  ST_CUDA_CHECK(cudaGetLastError(), "route_backward_kernel launch");
}

void MoECuda::gather_rows(DType dtype, const void* x, int64_t x_stride, const int32_t* index, int64_t R, int64_t H,
                          void* rows, Device device, Stream stream) {
  if (R * H <= 0) return;
  cuda::DeviceGuard guard(device.index);
  const unsigned grid = row_blocks(R);
  const cudaStream_t s = as_cuda(stream);
  const int64_t es = dtype_size(dtype), row_bytes = H * es;
  // Rows are moved, not converted: their bits travel as 16-byte units, or as 16- or 32-bit words.
  if (vec16(x, x_stride * es, row_bytes) && vec16(rows, row_bytes, row_bytes)) {
    gather_rows_kernel<<<grid, kThreads, 0, s>>>(static_cast<const uint4*>(x), x_stride * es / 16, index, R,
                                                 row_bytes / 16, static_cast<uint4*>(rows));
  } else if (es == 2) {
    gather_rows_kernel<<<grid, kThreads, 0, s>>>(static_cast<const uint16_t*>(x), x_stride, index, R, H,
                                                 static_cast<uint16_t*>(rows));
  } else {
    gather_rows_kernel<<<grid, kThreads, 0, s>>>(static_cast<const uint32_t*>(x), x_stride, index, R, H,
                                                 static_cast<uint32_t*>(rows));
  }
  ST_CUDA_CHECK(cudaGetLastError(), "gather_rows_kernel launch");
}

void MoECuda::combine_rows(DType dtype, const void* rows, int64_t rows_stride, const int32_t* row_of, int64_t N,
                           int32_t K, int64_t H, void* out, Device device, Stream stream) {
  if (N * H <= 0) return;
  cuda::DeviceGuard guard(device.index);
  const cudaStream_t s = as_cuda(stream);
  if (dtype == DType::kBF16) {
    combine_rows_launch<bf16_t>(rows, rows_stride, row_of, N, K, H, out, s);
  } else if (dtype == DType::kFP16) {
    combine_rows_launch<fp16_t>(rows, rows_stride, row_of, N, K, H, out, s);
  } else {
    combine_rows_launch<float>(rows, rows_stride, row_of, N, K, H, out, s);
  }
  ST_CUDA_CHECK(cudaGetLastError(), "combine_rows_kernel launch");
}

void MoECuda::permute_f32(const float* src, const int32_t* index, int64_t n, float* dst, bool scatter,
                          Device device, Stream stream) {
  if (n <= 0) return;
  cuda::DeviceGuard guard(device.index);
  permute_f32_kernel<<<blocks_for(n), kThreads, 0, as_cuda(stream)>>>(src, index, n, dst, scatter);
  ST_CUDA_CHECK(cudaGetLastError(), "permute_f32_kernel launch");
}

backend::MoEBackend& backend::moe_cuda_backend() {
  static MoECuda backend;
  return backend;
}

}  // namespace sparsetrain

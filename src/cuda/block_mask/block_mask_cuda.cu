// build_block_mask on a CUDA device. Every block's class comes from classify_block
// (common/attention/block_mask_rows.h), the host builder's own function, so the device mask equals the host
// one bit for bit; the lists, transposes and write orders are order-preserving compactions of the
// [B, Mq, Nk] class matrix, each row / column by one CTA with its threads side by side:
//   spans_kernel (document kinds only): doc_id_span of every q block and kv block, one warp each
//     (min, max, "never decreases" and "min or max" are reductions over the block's ids), so that classifying a
//     block no longer scans its ids.
//   rows_kernel: one CTA per (b, q block m), one thread per kv block n (in chunks of blockDim): the
//     class, then a CTA-wide exclusive prefix count of the partial / full blocks before n gives n's
//     slot in the ascending lists (exactly build_block_row's lists; padding zeroed). Then the
//     columns are walked in hand-out order (schedule_column) and a second prefix count gives every
//     column touching m (partial or full) its dQ rank at m: the number of touching columns handed
//     out before it, i.e. write_order_row's rank - 1. Class and rank go to the row's records.
//   cols_kernel: one CTA per (b, kv block n), one thread per q block m: the same compaction down
//     column n of the records gives the transposes (the rows m whose list holds n, ascending:
//     transpose_block_mask's) and, next to each entry, its write order: the rank (write_order_row's);
//     padding zeroed.
// Two launches (three for documents) on the caller's stream, no memsets, no host synchronisation.
#include <cuda_runtime.h>

#include <climits>
#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>

#include "common/attention/block_mask_rows.h"
#include "common/attention/doc_padding.h"
#include "cuda/block_mask/block_mask_cuda.h"
#include "cuda/cuda_check.h"
#include "cuda/runtime_cuda.h"
#include "sparsetrain/error.h"

namespace sparsetrain {
namespace {

constexpr int kMaxThreads = 256;  // per row / column CTA (longer rows loop over chunks)
constexpr int kSpanThreads = 256;  // spans_kernel: 8 warps, one span each

// Two counters in one scan value: partial blocks in the low 32 bits, full blocks in the high 32
// (each count <= the row / column length < 2^31, so the low half never carries).
using Counts = unsigned long long;
constexpr Counts kOnePartial = 1ull, kOneFull = 1ull << 32;
__device__ __forceinline__ int32_t partial_count(Counts c) { return int32_t(c & 0xffffffffull); }
__device__ __forceinline__ int32_t full_count(Counts c) { return int32_t(c >> 32); }
__device__ __forceinline__ Counts count_of(int32_t cls) {
  return cls == kBlockPartial ? kOnePartial : cls == kBlockFull ? kOneFull : 0ull;
}

// A block's record: its class (2 bits) and its dQ rank in its q block's row (the bits above).
__device__ __forceinline__ int32_t make_record(int32_t cls, int32_t rank) {
  return int32_t((uint32_t(rank) << 2) | uint32_t(cls));
}
__device__ __forceinline__ int32_t record_class(int32_t r) { return r & 3; }
__device__ __forceinline__ int32_t record_rank(int32_t r) { return int32_t(uint32_t(r) >> 2); }

// Exclusive prefix sum over the CTA, in thread order, of one value per thread; *total: the CTA's
// sum. blockDim.x a multiple of 32 (<= 1024); every thread of the CTA calls it (uniform control
// flow). warp_sums: __shared__ [32], free again on return (ends with a barrier).
__device__ Counts cta_exclusive_sum(Counts v, Counts* total, Counts* warp_sums) {
  const unsigned lane = threadIdx.x & 31u, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  Counts inclusive = v;
#pragma unroll
  for (unsigned d = 1; d < 32; d <<= 1) {
    const Counts up = __shfl_up_sync(0xffffffffu, inclusive, d);
    if (lane >= d) inclusive += up;
  }
  if (lane == 31) warp_sums[warp] = inclusive;  // the warp's total
  __syncthreads();
  if (warp == 0) {
    Counts w = lane < warps ? warp_sums[lane] : 0ull;
#pragma unroll
    for (unsigned d = 1; d < 32; d <<= 1) {
      const Counts up = __shfl_up_sync(0xffffffffu, w, d);
      if (lane >= d) w += up;
    }
    warp_sums[lane] = w;  // inclusive over the warps: warp_sums[k] = totals of warps 0..k
  }
  __syncthreads();
  const Counts before_warp = warp == 0 ? 0ull : warp_sums[warp - 1];
  *total = warp_sums[warps - 1];
  __syncthreads();
  return before_warp + inclusive - v;
}

// One warp per span: warps [0, doc_q_batch * Mq) the q blocks, then doc_kv_batch * Nk kv blocks.
// Equal to doc_id_span(ids, begin, end): min / max over [begin, end) and, for every begin < k < end,
// ids[k] >= ids[k - 1]; the lanes take k = begin + lane, + 32, ... and the warp reduces.
__global__ void spans_kernel(const DeviceMaskBuild p, int64_t Mq, int64_t Nk) {
  const int64_t s = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  const unsigned lane = threadIdx.x & 31u;
  const int64_t q_spans = p.doc_q_batch * Mq;
  if (s >= q_spans + p.doc_kv_batch * Nk) return;  // the whole warp
  const int32_t* ids;
  int64_t begin, end;
  if (s < q_spans) {
    ids = p.doc_q + (s / Mq) * p.doc_q_stride;
    begin = (s % Mq) * p.block_q;
    end = begin + p.block_q < p.seq_q ? begin + p.block_q : p.seq_q;
  } else {
    ids = p.doc_kv + ((s - q_spans) / Nk) * p.doc_kv_stride;
    begin = ((s - q_spans) % Nk) * p.block_kv;
    end = begin + p.block_kv < p.seq_kv ? begin + p.block_kv : p.seq_kv;
  }
  int32_t lo = INT_MAX, hi = INT_MIN, sorted = 1;
  for (int64_t k = begin + lane; k < end; k += 32) {
    const int32_t d = ids[k];
    lo = d < lo ? d : lo;
    hi = d > hi ? d : hi;
    if (k > begin && d < ids[k - 1]) sorted = 0;
  }
  lo = __reduce_min_sync(0xffffffffu, lo);
  hi = __reduce_max_sync(0xffffffffu, hi);
  sorted = __all_sync(0xffffffffu, sorted) ? 1 : 0;
  int32_t two = 1;
  for (int64_t k = begin + lane; k < end; k += 32) two = two && (ids[k] == lo || ids[k] == hi);
  two = __all_sync(0xffffffffu, two) ? 1 : 0;
  if (lane == 0) p.doc_spans[s] = DocIdSpan{lo, hi, sorted, two};
}

// One CTA per (b, q block m): the forward lists of row m and the row's records.
__global__ void rows_kernel(const DeviceMaskBuild p, int32_t* kv_num, int32_t* kv_idx, int32_t* full_num,
                            int32_t* full_idx, int64_t Mq, int64_t Nk) {
  __shared__ Counts warp_sums[32];
  const int64_t i = blockIdx.x, b = i / Mq, m = i % Mq;
  MaskRowParams row{p.kind, p.window_left, p.window_right, p.prefix_length, p.seq_q, p.seq_kv, nullptr, nullptr};
  const DocIdSpan* q_span = nullptr;
  const DocIdSpan* kv_spans = nullptr;
  if (p.doc_q != nullptr) {
    const int64_t bq = p.doc_q_batch == 1 ? 0 : b, bk = p.doc_kv_batch == 1 ? 0 : b;
    row.doc_q = p.doc_q + bq * p.doc_q_stride;
    row.doc_kv = p.doc_kv + bk * p.doc_kv_stride;
    q_span = p.doc_spans + bq * Mq + m;
    kv_spans = p.doc_spans + p.doc_q_batch * Mq + bk * Nk;
  }
  int32_t* partial = kv_idx + i * Nk;
  int32_t* full = full_idx + i * Nk;
  int32_t* records = p.records + i * Nk;

  // The lists: block n goes to slot (partial / full blocks before n) of its list.
  Counts listed = 0;
  for (int64_t base = 0; base < Nk; base += blockDim.x) {
    const int64_t n = base + threadIdx.x;
    int32_t cls = kBlockSkipped;
    if (n < Nk)
      cls = classify_block(row, p.block_q, p.block_kv, m, n, q_span, kv_spans != nullptr ? kv_spans + n : nullptr);
    Counts chunk;
    const Counts before = listed + cta_exclusive_sum(count_of(cls), &chunk, warp_sums);
    if (cls == kBlockPartial) partial[partial_count(before)] = int32_t(n);
    else if (cls == kBlockFull) full[full_count(before)] = int32_t(n);
    if (n < Nk) records[n] = make_record(cls, 0);
    listed += chunk;
  }
  const int32_t np = partial_count(listed), nf = full_count(listed);
  for (int64_t k = np + threadIdx.x; k < Nk; k += blockDim.x) partial[k] = 0;
  for (int64_t k = nf + threadIdx.x; k < Nk; k += blockDim.x) full[k] = 0;
  if (threadIdx.x == 0) {
    kv_num[i] = np;
    full_num[i] = nf;
  }
  __syncthreads();  // the classes in `records` are visible to the whole CTA

  // The dQ ranks: hand-out position pos holds column schedule_column(pos) (each column once); a
  // touching column's rank is the number of touching columns at earlier positions.
  Counts ranked = 0;
  for (int64_t base = 0; base < Nk; base += blockDim.x) {
    const int64_t pos = base + threadIdx.x;
    int64_t n = 0;
    int32_t cls = kBlockSkipped;
    if (pos < Nk) {
      n = schedule_column(p.schedule, p.permutation, pos, Nk);
      cls = record_class(records[n]);
    }
    Counts chunk;
    const Counts before = ranked + cta_exclusive_sum(cls != kBlockSkipped ? 1ull : 0ull, &chunk, warp_sums);
    if (pos < Nk) records[n] = make_record(cls, int32_t(before));
    ranked += chunk;
  }
}

// One CTA per (b, kv block n): the transposes of column n and their write orders.
__global__ void cols_kernel(const DeviceMaskBuild p, int32_t* q_num, int32_t* q_idx, int32_t* fq_num,
                            int32_t* fq_idx, int32_t* order, int32_t* full_order, int64_t Mq, int64_t Nk) {
  __shared__ Counts warp_sums[32];
  const int64_t i = blockIdx.x, b = i / Nk, n = i % Nk;
  const int32_t* records = p.records + b * Mq * Nk + n;  // row m's record of column n: records[m * Nk]
  int32_t* q = q_idx + i * Mq;
  int32_t* fq = fq_idx + i * Mq;
  int32_t* wo = order + i * Mq;
  int32_t* fwo = full_order + i * Mq;
  Counts listed = 0;
  for (int64_t base = 0; base < Mq; base += blockDim.x) {
    const int64_t m = base + threadIdx.x;
    const int32_t r = m < Mq ? records[m * Nk] : make_record(kBlockSkipped, 0);
    const int32_t cls = record_class(r);
    const int32_t turn = record_rank(r);
    Counts chunk;
    const Counts before = listed + cta_exclusive_sum(count_of(cls), &chunk, warp_sums);
    if (cls == kBlockPartial) {
      q[partial_count(before)] = int32_t(m);
      wo[partial_count(before)] = turn;
    } else if (cls == kBlockFull) {
      fq[full_count(before)] = int32_t(m);
      fwo[full_count(before)] = turn;
    }
    listed += chunk;
  }
  const int32_t np = partial_count(listed), nf = full_count(listed);
  for (int64_t k = np + threadIdx.x; k < Mq; k += blockDim.x) q[k] = wo[k] = 0;
  for (int64_t k = nf + threadIdx.x; k < Mq; k += blockDim.x) fq[k] = fwo[k] = 0;
  if (threadIdx.x == 0) {
    q_num[i] = np;
    fq_num[i] = nf;
  }
}

// build_doc_padded_mask on a device: the padded layout (common/attention/doc_padding.h) of every batch row,
// in chunks of kDocPadChunk tokens (kPadItems consecutive tokens a thread), one CTA a (row, chunk) in
// each of four launches, so a long row is spread over the GPU (one CTA a row serialised a
// 128k-token row: ten times this form's time). Long documents are found from `starts`, the document starts at or
// before each token (doc_token_starts_long: no search, no length walk). Then the layout is the
// exclusive scan of the tokens' steps (doc_pad_token_step), carried across chunks as in a
// reduce-then-scan:
//   pad_chunk_stats_kernel: each chunk's count of document starts and largest id of either side;
//   pad_starts_kernel:      `starts` (the chunk's local scan plus the counts of the chunks before);
//   pad_chunk_steps_kernel: each chunk's composed step (the long flags from `starts`);
//   pad_layout_kernel:      the steps of the chunks before, composed in order, then the chunk's own
//     scan; a chunk owns the padded positions [x_c, x_(c+1)) between the next free position before
//     it and after it (the last chunk to `padded`), so it writes the padding there, then its tokens'
//     ids and real rows; no two CTAs write one position.
// Padding positions get the row's largest id + 1 as a query and + 2 as a key, as doc_padded_ids.
constexpr int kPadThreads = 256, kPadItems = 8;
static_assert(kPadThreads * kPadItems == kDocPadChunk, "a chunk is a CTA's tokens");
struct DocPadThen {
  __device__ DocPadStep operator()(const DocPadStep& f, const DocPadStep& g) const { return doc_pad_then(f, g); }
};
struct Max {
  __device__ int32_t operator()(int32_t x, int32_t y) const { return max(x, y); }
};
// A scan's running prefix over the rounds so far (cub's block prefix callback: the first warp
// passes each round's aggregate and gets the prefix of the rounds before).
template <class T, class Op>
struct RoundCarry {
  T running;
  __device__ T operator()(const T& round) {
    const T before = running;
    running = Op{}(running, round);
    return before;
  }
};

struct Sum {
  __device__ int32_t operator()(int32_t x, int32_t y) const { return x + y; }
};
using PadReduce = cub::BlockReduce<int32_t, kPadThreads>;
// v[0, n) reduced by op, returned to every thread of the CTA (a chunk's summary over the chunks
// before it, or over the whole row).
template <class Op>
__device__ int32_t reduce_to_all(const int32_t* v, int64_t n, int32_t init, Op op, PadReduce::TempStorage& tmp) {
  __shared__ int32_t all;
  int32_t x = init;
  for (int64_t k = threadIdx.x; k < n; k += kPadThreads) x = op(x, v[k]);
  x = PadReduce(tmp).Reduce(x, op);
  if (threadIdx.x == 0) all = x;
  __syncthreads();
  return all;
}

// The four kernels' view of one (row, chunk): its ids and its parts of the scratch (doc_pad_layout_scratch).
struct PadRow {
  const int32_t *ids, *kv_ids;  // the layout's (query side's) and the key side's
  int64_t seq, chunks, b, c;     // row b, chunk c of `chunks`
  int32_t* starts;               // [seq] of the row
  int32_t *chunk_starts, *chunk_max;  // [chunks] of the row
  DocPadStep* chunk_step;             // [chunks] of the row
  __device__ PadRow(const DocPadLayoutArgs& a)
      : ids(a.ids_q + int64_t(blockIdx.x / a.chunks) * a.ids_q_stride_b),
        kv_ids(a.ids_kv + int64_t(blockIdx.x / a.chunks) * a.ids_kv_stride_b), seq(a.seq), chunks(a.chunks),
        b(blockIdx.x / a.chunks), c(blockIdx.x % a.chunks), starts(a.starts + b * a.seq),
        chunk_starts(a.chunk_starts + b * a.chunks), chunk_max(a.chunk_max + b * a.chunks),
        chunk_step(a.chunk_step + b * a.chunks) {}
  __device__ int64_t t0() const { return c * kDocPadChunk + int64_t(threadIdx.x) * kPadItems; }  // this thread's first
  __device__ bool first_of_doc(int64_t t) const { return doc_first_token(ids, t); }
  __device__ bool starts_long(int64_t t, int64_t min_length) const {  // t < seq; needs `starts`
    return doc_token_starts_long(ids, starts, seq, t, min_length);
  }
  __device__ bool ends_long(int64_t t, int64_t min_length) const {
    return doc_token_ends_long(ids, starts, seq, t, min_length);
  }
  __device__ DocPadStep step(int64_t t, int64_t min_length) const {
    return t < seq ? doc_pad_token_step(starts_long(t, min_length), ends_long(t, min_length)) : DocPadStep{};
  }
};

__global__ void __launch_bounds__(kPadThreads) pad_chunk_stats_kernel(DocPadLayoutArgs a) {
  const PadRow r(a);
  __shared__ PadReduce::TempStorage tmp;
  int32_t n = 0, m = INT_MIN;
  for (int64_t t = r.t0(); t < min(r.t0() + kPadItems, r.seq); ++t) {
    n += r.first_of_doc(t);
    m = max(m, max(r.ids[t], r.kv_ids[t]));
  }
  n = PadReduce(tmp).Sum(n);
  __syncthreads();
  m = PadReduce(tmp).Reduce(m, Max{});
  if (threadIdx.x == 0) r.chunk_starts[r.c] = n, r.chunk_max[r.c] = m;
}

__global__ void __launch_bounds__(kPadThreads) pad_starts_kernel(DocPadLayoutArgs a) {
  const PadRow r(a);
  using Scan = cub::BlockScan<int32_t, kPadThreads>;
  __shared__ union {
    PadReduce::TempStorage reduce;
    typename Scan::TempStorage scan;
  } tmp;
  const int32_t before = reduce_to_all(r.chunk_starts, r.c, 0, Sum{}, tmp.reduce);
  int32_t v[kPadItems];
#pragma unroll
  for (int i = 0; i < kPadItems; ++i) v[i] = r.t0() + i < r.seq && r.first_of_doc(r.t0() + i);
  Scan(tmp.scan).InclusiveSum(v, v);
#pragma unroll
  for (int i = 0; i < kPadItems; ++i)
    if (r.t0() + i < r.seq) r.starts[r.t0() + i] = before + v[i];
}

__global__ void __launch_bounds__(kPadThreads) pad_chunk_steps_kernel(DocPadLayoutArgs a) {
  const PadRow r(a);
  using Scan = cub::BlockScan<DocPadStep, kPadThreads>;
  __shared__ typename Scan::TempStorage tmp;
  // One thread's tokens composed in order, then the threads' in order (a scan's aggregate: the
  // composition is associative, not commutative).
  DocPadStep mine{};
  for (int64_t t = r.t0(); t < min(r.t0() + kPadItems, r.seq); ++t) mine = doc_pad_then(mine, r.step(t, a.min_length));
  DocPadStep chunk;
  Scan(tmp).InclusiveScan(mine, mine, DocPadThen{}, chunk);
  if (threadIdx.x == 0) r.chunk_step[r.c] = chunk;
}

__global__ void __launch_bounds__(kPadThreads) pad_layout_kernel(DocPadLayoutArgs a) {
  const PadRow r(a);
  using Scan = cub::BlockScan<DocPadStep, kPadThreads>;
  __shared__ union {
    PadReduce::TempStorage reduce;
    typename Scan::TempStorage scan;
  } tmp;
  __shared__ DocPadStep before;
  // The row's largest id, and the chunks before this one composed in order (in rounds of a thread each).
  const int32_t max_id = reduce_to_all(r.chunk_max, r.chunks, INT_MIN, Max{}, tmp.reduce);
  RoundCarry<DocPadStep, DocPadThen> carry{};
  for (int64_t k0 = 0; k0 < r.c; k0 += kPadThreads) {
    const DocPadStep s = k0 + threadIdx.x < r.c ? r.chunk_step[k0 + threadIdx.x] : DocPadStep{};
    DocPadStep ignored;
    Scan(tmp.scan).ExclusiveScan(s, ignored, DocPadThen{}, carry);
    __syncthreads();  // tmp is reused by the next round
  }
  if (threadIdx.x == 0) before = carry.running;  // the first warp's copy is the one the scans updated
  __syncthreads();
  // Ids below INT32_MAX - 1 (the host builder checks it; here the pads saturate instead of wrapping).
  const int32_t pad_q = max_id < INT_MAX ? max_id + 1 : INT_MAX, pad_kv = max_id < INT_MAX - 1 ? max_id + 2 : INT_MAX;
  const int64_t x_begin = doc_pad_apply(before, 0);
  const int64_t x_end = r.c + 1 == r.chunks ? a.padded : doc_pad_apply(doc_pad_then(before, r.chunk_step[r.c]), 0);
  int32_t* q = a.doc_q + r.b * a.padded;
  int32_t* kv = a.doc_kv + r.b * a.padded;
  int32_t* rows = a.real_rows + r.b * a.padded;
  for (int64_t p = x_begin + threadIdx.x; p < min(x_end, a.padded); p += kPadThreads)
    q[p] = pad_q, kv[p] = pad_kv, rows[p] = -1;
  __syncthreads();  // this chunk's tokens overwrite some of that padding
  DocPadStep step[kPadItems];
  bool starts_long[kPadItems];
#pragma unroll
  for (int i = 0; i < kPadItems; ++i) {
    const int64_t t = r.t0() + i;
    starts_long[i] = t < r.seq && r.starts_long(t, a.min_length);
    step[i] = r.step(t, a.min_length);
  }
  RoundCarry<DocPadStep, DocPadThen> chunk_carry{before};
  Scan(tmp.scan).ExclusiveScan(step, step, DocPadThen{}, chunk_carry);
#pragma unroll
  for (int i = 0; i < kPadItems; ++i) {
    const int64_t t = r.t0() + i;
    if (t >= r.seq) continue;
    const int64_t p = doc_pad_token_position(doc_pad_apply(step[i], 0), starts_long[i]);
    if (p < a.padded)  // by the bound; checked anyway
      q[p] = r.ids[t], kv[p] = r.kv_ids[t], rows[p] = int32_t(t);
  }
}

// Threads for a CTA over `len` entries: a multiple of 32, at most kMaxThreads.
unsigned threads_for(int64_t len) {
  const int64_t t = (len + 31) / 32 * 32;
  return unsigned(t < kMaxThreads ? t : kMaxThreads);
}
int32_t* ptr(const Tensor& t) { return t.view().data_as<int32_t>(); }

}  // namespace

void doc_padded_layout_cuda(DocPadLayoutArgs a, int device, Stream stream) {
  if (a.seq > INT_MAX) ST_FAIL("build_doc_padded_mask on a CUDA device: seq ", a.seq, " above 2^31 - 1");
  if (a.batch * a.chunks > INT_MAX)
    ST_FAIL("build_doc_padded_mask on a CUDA device: batch x chunks of ", kDocPadChunk, " tokens = ",
            a.batch * a.chunks, " above 2^31 - 1");
  cuda::DeviceGuard guard(device);
  const cudaStream_t s = static_cast<cudaStream_t>(stream.handle);
  const unsigned grid = unsigned(a.batch * a.chunks);
  pad_chunk_stats_kernel<<<grid, kPadThreads, 0, s>>>(a);
  pad_starts_kernel<<<grid, kPadThreads, 0, s>>>(a);
  pad_chunk_steps_kernel<<<grid, kPadThreads, 0, s>>>(a);
  pad_layout_kernel<<<grid, kPadThreads, 0, s>>>(a);
  ST_CUDA_CHECK(cudaGetLastError(), "build_doc_padded_mask's layout kernels launch");
}

void build_block_mask_cuda(const DeviceMaskBuild& p, BlockMaskTensors& t, Stream stream) {
  const cudaStream_t s = static_cast<cudaStream_t>(stream.handle);
  const int64_t Mq = t.mask.num_q_blocks(), Nk = t.mask.num_kv_blocks(), B = p.batch;
  if (B * Mq > INT_MAX || B * Nk > INT_MAX)
    ST_FAIL("build_block_mask on a CUDA device: too many blocks (B * Mq = ", B * Mq, ", B * Nk = ", B * Nk, ")");
  cuda::DeviceGuard guard(t.kv_indices.view().device().index);
  if (p.schedule == ScheduleKind::kPermutation)  // from pageable memory: staged before this returns
    ST_CUDA_CHECK(
        cudaMemcpyAsync(p.permutation, p.permutation_host, size_t(Nk) * sizeof(int32_t), cudaMemcpyHostToDevice, s),
        "cudaMemcpyAsync (schedule)");
  if (p.doc_q != nullptr) {
    const int64_t spans = p.doc_q_batch * Mq + p.doc_kv_batch * Nk, per_cta = kSpanThreads / 32;
    spans_kernel<<<unsigned((spans + per_cta - 1) / per_cta), kSpanThreads, 0, s>>>(p, Mq, Nk);
    ST_CUDA_CHECK(cudaGetLastError(), "block mask spans_kernel launch");
  }
  rows_kernel<<<unsigned(B * Mq), threads_for(Nk), 0, s>>>(p, ptr(t.kv_num_blocks), ptr(t.kv_indices),
                                                           ptr(t.full_kv_num_blocks), ptr(t.full_kv_indices), Mq, Nk);
  ST_CUDA_CHECK(cudaGetLastError(), "block mask rows_kernel launch");
  cols_kernel<<<unsigned(B * Nk), threads_for(Mq), 0, s>>>(p, ptr(t.q_num_blocks), ptr(t.q_indices),
                                                           ptr(t.full_q_num_blocks), ptr(t.full_q_indices),
                                                           ptr(t.dq_write_order), ptr(t.dq_write_order_full), Mq, Nk);
  ST_CUDA_CHECK(cudaGetLastError(), "block mask cols_kernel launch");
}

}  // namespace sparsetrain

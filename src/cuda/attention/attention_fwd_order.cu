// The attention forward's work order (attention_fwd_order.h): L2 sections of heads, items by
// decreasing cost inside each (common/attention/attention_fwd_walk.h says why). One CTA per
// section, a counting sort over its items; block 0 also zeroes the dynamic hand-out's counter, so
// every launch (and graph replay) starts it at zero on the stream, with no memset of its own.
#include "cuda/attention/attention_fwd_order.h"

#include <cuda_runtime.h>

#include <cub/block/block_scan.cuh>

#include "common/attention/attention_fwd_walk.h"
#include "cuda/cuda_check.h"
#include "cuda/device_cache.h"
#include "cuda/pdl.cuh"
#include "cuda/tuning.h"
#include "sparsetrain/dtype.h"

namespace sparsetrain::cuda::attn {
namespace {

constexpr int kSortThreads = 1024, kBinsPerThread = 2, kBins = kSortThreads * kBinsPerThread;

__global__ void __launch_bounds__(kSortThreads) sort_items_kernel(const MaskWalkLists lists, int32_t heads_q,
                                                                  int32_t q_tiles, int32_t num_items,
                                                                  int32_t heads_per_section, FwdWorkRecord* records,
                                                                  int32_t* ticket, bool natural) {
  cuda::pdl_launch_dependents();  // the forward kernel may set up while this runs (cuda/pdl.cuh)
  if (blockIdx.x == 0 && threadIdx.x == 0) *ticket = 0;
  const auto [first, last] = fwd_section(int32_t(blockIdx.x), num_items, q_tiles, heads_per_section);
  if (natural) {  // a sweep switch: items in numbered order (the q tiles of one head together)
    for (int32_t item = first + threadIdx.x; item < last; item += kSortThreads)
      records[item] = fwd_work_record(lists, item, heads_q, q_tiles, kTileQ);
    return;
  }
  using Scan = cub::BlockScan<int32_t, kSortThreads>;
  __shared__ typename Scan::TempStorage scan;
  __shared__ int32_t bins[kBins];  // counts, then each bin's next free slot
  for (int i = threadIdx.x; i < kBins; i += kSortThreads) bins[i] = 0;
  __syncthreads();
  // Bin c holds the items of cost kBins - 1 - c (longest first); longer ones share the first bin.
  auto bin_of = [&](int32_t cost) { return kBins - 1 - (cost < kBins - 1 ? cost : kBins - 1); };
  for (int32_t item = first + threadIdx.x; item < last; item += kSortThreads)
    atomicAdd(&bins[bin_of(fwd_work_record(lists, item, heads_q, q_tiles, kTileQ).cost)], 1);
  __syncthreads();
  int32_t counts[kBinsPerThread];
  for (int i = 0; i < kBinsPerThread; ++i) counts[i] = bins[threadIdx.x * kBinsPerThread + i];
  Scan(scan).ExclusiveSum(counts, counts);
  __syncthreads();
  for (int i = 0; i < kBinsPerThread; ++i) bins[threadIdx.x * kBinsPerThread + i] = first + counts[i];
  __syncthreads();
  // Within a bin the order is whatever the atomics give: every item is computed by one CTA on
  // its own, so the results do not depend on it.
  for (int32_t item = first + threadIdx.x; item < last; item += kSortThreads) {
    const FwdWorkRecord r = fwd_work_record(lists, item, heads_q, q_tiles, kTileQ);
    records[atomicAdd(&bins[bin_of(r.cost)], 1)] = r;
  }
}

}  // namespace

size_t fwd_order_scratch_bytes(int64_t num_items) {
  return size_t(num_items) * sizeof(FwdWorkRecord) + sizeof(FwdWorkRecord);
}

void order_fwd_work(const backend::AttentionProblem& p, FwdArgs& a, void* scratch, int device, void* stream) {
  const tuning::AttentionFwdOrder order = tuning::attention_fwd_order();
  FwdWorkRecord* records = static_cast<FwdWorkRecord*>(scratch);
  a.records = records;
  int32_t* ticket = reinterpret_cast<int32_t*>(records + a.num_items);
  a.ticket = order.dynamic ? ticket : nullptr;
  // Sections of heads whose K and V fill the L2 budget (a sweep of the section size: 32 MB
  // sections at 4 and 8 MB a head ran best); "lpt" (a sweep switch) makes the whole
  // problem one section.
  const int64_t heads = p.batch * p.heads_q;
  const int64_t kv_head_bytes = 2 * p.seq_kv * p.head_dim * int64_t(dtype_size(p.dtype));
  const int64_t l2_budget = tuning::attention_l2_budget(int64_t(device_info(device).l2_bytes));
  const int32_t per_section =
      order.sections ? fwd_heads_per_section(kv_head_bytes, l2_budget, int32_t(p.heads_q / p.heads_kv), heads)
                     : int32_t(heads);
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  sort_items_kernel<<<fwd_sections(a.num_items, a.q_tiles, per_section), kSortThreads, 0, s>>>(
      a.lists, a.heads_q, a.q_tiles, a.num_items, per_section, records, ticket, order.natural);
  ST_CUDA_CHECK(cudaGetLastError(), "CUDA attention: sort_items_kernel launch");
}

}  // namespace sparsetrain::cuda::attn

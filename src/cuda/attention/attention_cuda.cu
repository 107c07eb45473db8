// The CUDA attention backend: what the sm90 kernels support (checked before anything is
// allocated), the longest-first work order (one small kernel, no host synchronisation), and the
// dispatch to the forward instantiation for (dtype, head dim). The backward arrives with the
// deterministic kernel (issue 8); until then it is refused with a clear error.
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdlib>
#include <cub/block/block_scan.cuh>
#include <string>

#include "common/attention_fwd_walk.h"
#include "cuda/attention/attention_fwd_params.h"
#include "ops/attention_backend.h"
#include "ops/checks.h"
#include "sparsetrain/error.h"

namespace sparsetrain {
namespace {

using backend::AttentionProblem;
using cuda::attn::FwdArgs;
using cuda::attn::FwdElement;
using cuda::attn::kTileKv;
using cuda::attn::kTileQ;

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) ST_FAIL("CUDA attention: ", what, " failed: ", cudaGetErrorString(e));
}

// ---- work order: items by decreasing cost (a counting sort in one CTA) --------------------------

constexpr int kSortThreads = 1024, kBinsPerThread = 2, kBins = kSortThreads * kBinsPerThread;

__global__ void __launch_bounds__(kSortThreads) sort_items_kernel(const MaskWalkLists lists, int32_t heads_q,
                                                                  int32_t q_tiles, int32_t num_items, int32_t* order,
                                                                  bool natural) {
  if (natural) {  // a tuning switch: item order as numbered (the q tiles of one head together)
    for (int32_t item = threadIdx.x; item < num_items; item += kSortThreads) order[item] = item;
    return;
  }
  using Scan = cub::BlockScan<int32_t, kSortThreads>;
  __shared__ typename Scan::TempStorage scan;
  __shared__ int32_t bins[kBins];  // counts, then each bin's next free slot
  for (int i = threadIdx.x; i < kBins; i += kSortThreads) bins[i] = 0;
  __syncthreads();
  // Bin c holds the items of cost kBins - 1 - c (longest first); longer ones share the first bin.
  auto bin_of = [&](int32_t item) {
    const int32_t cost = fwd_item_cost(lists, item, heads_q, q_tiles, kTileQ);
    return kBins - 1 - (cost < kBins - 1 ? cost : kBins - 1);
  };
  for (int32_t item = threadIdx.x; item < num_items; item += kSortThreads) atomicAdd(&bins[bin_of(item)], 1);
  __syncthreads();
  int32_t counts[kBinsPerThread];
  for (int i = 0; i < kBinsPerThread; ++i) counts[i] = bins[threadIdx.x * kBinsPerThread + i];
  Scan(scan).ExclusiveSum(counts, counts);
  __syncthreads();
  for (int i = 0; i < kBinsPerThread; ++i) bins[threadIdx.x * kBinsPerThread + i] = counts[i];
  __syncthreads();
  // Within a bin the order is whatever the atomics give: every item is computed by one CTA on
  // its own, so the results do not depend on it.
  for (int32_t item = threadIdx.x; item < num_items; item += kSortThreads)
    order[atomicAdd(&bins[bin_of(item)], 1)] = item;
}

// ---- arguments ----------------------------------------------------------------------------------

int64_t lead_stride(const TensorView& t, int d) { return t.size(d) == 1 ? 0 : t.stride(d); }

MaskIndexView index_view(const TensorView& t) {
  MaskIndexView v;
  if (!t.defined()) return v;
  v.data = static_cast<const int32_t*>(t.data());
  v.stride_b = lead_stride(t, 0);
  v.stride_h = lead_stride(t, 1);
  v.stride_r = t.stride(2);
  v.stride_w = t.dim() > 3 ? t.stride(3) : 0;
  v.width = t.dim() > 3 ? int32_t(t.size(3)) : 0;
  return v;
}

// Tuning switches for sweeps: unset or anything but "0" is on.
bool env_flag(const char* name) {
  const char* v = std::getenv(name);
  return v == nullptr || std::string(v) != "0";
}

int64_t q_tiles_of(const AttentionProblem& p) { return (p.seq_q + kTileQ - 1) / kTileQ; }

int sm_count(int device) {
  static int counts[64] = {};
  if (device < 0 || device >= 64) return 132;
  if (counts[device] == 0) check(cudaDeviceGetAttribute(&counts[device], cudaDevAttrMultiProcessorCount, device),
                                 "cudaDeviceGetAttribute(multiProcessorCount)");
  return counts[device];
}

// The head dims and dtypes with an instantiation in this build (SPARSETRAIN_SM90_KERNELS).
bool have_kernel(DType dtype, int64_t head_dim) {
  if (!SPARSETRAIN_WITH_CUTLASS) return false;
  if (dtype == DType::kBF16 && head_dim == 128) return true;
  const bool dims = head_dim == 64 || head_dim == 96 || head_dim == 128;
  return SPARSETRAIN_SM90_ALL && (dtype == DType::kBF16 || dtype == DType::kFP16) && dims;
}

void dispatch(DType dtype, int64_t head_dim, const FwdArgs& a, void* stream) {
#if SPARSETRAIN_WITH_CUTLASS
  if (dtype == DType::kBF16 && head_dim == 128) return cuda::attn::run_fwd_sm90<FwdElement::kBF16, 128>(a, stream);
#if SPARSETRAIN_SM90_ALL
  if (dtype == DType::kBF16 && head_dim == 64) return cuda::attn::run_fwd_sm90<FwdElement::kBF16, 64>(a, stream);
  if (dtype == DType::kFP16 && head_dim == 128) return cuda::attn::run_fwd_sm90<FwdElement::kFP16, 128>(a, stream);
  if (dtype == DType::kFP16 && head_dim == 64) return cuda::attn::run_fwd_sm90<FwdElement::kFP16, 64>(a, stream);
  if (dtype == DType::kBF16 && head_dim == 96) return cuda::attn::run_fwd_sm90<FwdElement::kBF16, 96>(a, stream);
  if (dtype == DType::kFP16 && head_dim == 96) return cuda::attn::run_fwd_sm90<FwdElement::kFP16, 96>(a, stream);
#endif
#endif
  (void)a;
  (void)stream;
  ST_FAIL("CUDA attention: no forward kernel for ", dtype_name(dtype), ", D = ", head_dim);
}

class AttentionCuda final : public backend::AttentionBackend {
 public:
  void check_supported(const AttentionProblem& p, const TensorView& q, const TensorView& k, const TensorView& v,
                       const BlockMask& mask, bool backward) const override {
    ST_CHECK_ARG(!backward, "q", "CPU tensors for the backward (the CUDA backward is not implemented yet)",
                 q.device().str());
    ST_CHECK_ARG(p.dtype == DType::kBF16 || p.dtype == DType::kFP16, "q", "dtype bf16 or fp16 on CUDA",
                 dtype_name(p.dtype));
    for (const auto& [t, name] : {std::pair<const TensorView&, const char*>{q, "q"}, {k, "k"}, {v, "v"}}) {
      // TMA: a 16-byte aligned base and 16-byte multiples for every stride.
      const int64_t e = int64_t(dtype_size(p.dtype));
      const bool aligned = reinterpret_cast<uintptr_t>(t.data()) % 16 == 0 && (t.stride(0) * e) % 16 == 0 &&
                           (t.stride(1) * e) % 16 == 0 && (t.stride(2) * e) % 16 == 0;
      ST_CHECK_ARG(aligned, name, "a 16-byte aligned base and strides that are multiples of 16 bytes (TMA)",
                   "strides [", t.stride(0), ", ", t.stride(1), ", ", t.stride(2), ", 1] at ", t.data());
    }
    ST_CHECK_ARG(mask.block_q % kTileQ == 0, "mask.block_q",
                 "a multiple of the CUDA kernel's q tile (" + std::to_string(kTileQ) + ")", mask.block_q);
    ST_CHECK_ARG(mask.block_kv % kTileKv == 0, "mask.block_kv",
                 "a multiple of the CUDA kernel's kv tile (" + std::to_string(kTileKv) + ")", mask.block_kv);
    if (mask.spec.kind == MaskKind::kBitmask) {
      // The kernel reads a row's bits as 32-bit words.
      const TensorView& bits = mask.partial_bitmasks;
      const bool words = reinterpret_cast<uintptr_t>(bits.data()) % 4 == 0 && bits.stride(0) % 4 == 0 &&
                         bits.stride(1) % 4 == 0 && bits.stride(2) % 4 == 0 && bits.stride(3) % 4 == 0;
      ST_CHECK_ARG(bits.stride(4) == 1 && words, "mask.partial_bitmasks",
                   "a contiguous last dim, a 4-byte aligned base and strides that are multiples of 4 bytes",
                   "strides [", bits.stride(0), ", ", bits.stride(1), ", ", bits.stride(2), ", ", bits.stride(3), ", ",
                   bits.stride(4), "] at ", bits.data());
    }
    const char* built = !SPARSETRAIN_WITH_CUTLASS ? "none: built without CUTLASS"
                        : SPARSETRAIN_SM90_ALL    ? "64, 96 or 128"
                                                  : "128 with bf16: a MINIMAL build";
    ST_CHECK_ARG(have_kernel(p.dtype, p.head_dim), "q",
                 std::string("a head dim with a CUDA kernel in this build (") + built + ")", "D = ", p.head_dim, " (",
                 dtype_name(p.dtype), ")");
    const int64_t limit = int64_t(1) << 30;
    const int64_t items = p.batch * p.heads_q * q_tiles_of(p);
    ST_CHECK_ARG(p.seq_q < limit && p.seq_kv < limit && items < limit, "q",
                 "Sq, Skv and B * Hq * ceil(Sq / 128) below 2^30 (32-bit indexing)", "Sq = ", p.seq_q,
                 ", Skv = ", p.seq_kv, ", ", items, " q tiles");
  }

  size_t forward_scratch_bytes(const AttentionProblem& p) const override {
    return size_t(p.batch * p.heads_q * q_tiles_of(p)) * sizeof(int32_t);
  }
  size_t backward_scratch_bytes(const AttentionProblem&) const override { return 0; }

  void forward(const backend::AttentionForwardParams& fp, void* scratch, Stream stream) override {
    const AttentionProblem& p = fp.problem;
    const BlockMask& m = *fp.mask;
    FwdArgs a{};
    a.q = fp.q.data();
    a.k = fp.k.data();
    a.v = fp.v.data();
    a.q_stride_b = fp.q.stride(0), a.q_stride_s = fp.q.stride(1), a.q_stride_h = fp.q.stride(2);
    a.k_stride_b = fp.k.stride(0), a.k_stride_s = fp.k.stride(1), a.k_stride_h = fp.k.stride(2);
    a.v_stride_b = fp.v.stride(0), a.v_stride_s = fp.v.stride(1), a.v_stride_h = fp.v.stride(2);
    a.o = fp.o.data();
    a.lse = static_cast<float*>(fp.lse.data());
    a.batch = int32_t(p.batch), a.seq_q = int32_t(p.seq_q), a.seq_kv = int32_t(p.seq_kv);
    a.heads_q = int32_t(p.heads_q), a.heads_kv = int32_t(p.heads_kv);
    a.scale = p.scale;
    a.lists.partial_count = index_view(m.kv_num_blocks);
    a.lists.partial_index = index_view(m.kv_indices);
    a.lists.full_count = index_view(m.full_kv_num_blocks);
    a.lists.full_index = index_view(m.full_kv_indices);
    a.lists.num_kv_blocks = int32_t(m.num_kv_blocks());
    a.lists.block_q = int32_t(m.block_q);
    a.lists.sub_tiles = int32_t(m.block_kv / kTileKv);
    a.spec.kind = m.spec.kind;
    a.spec.window_left = m.spec.window_left, a.spec.window_right = m.spec.window_right;
    a.spec.prefix_length = m.spec.prefix_length;
    a.spec.block_kv = int32_t(m.block_kv);
    if (m.spec.kind == MaskKind::kDocument || m.spec.kind == MaskKind::kDocumentCausal) {
      a.spec.doc_q = static_cast<const int32_t*>(m.spec.doc_q.data());
      a.spec.doc_kv = static_cast<const int32_t*>(m.spec.doc_kv.data());
      a.spec.doc_q_stride_b = lead_stride(m.spec.doc_q, 0);
      a.spec.doc_kv_stride_b = lead_stride(m.spec.doc_kv, 0);
    }
    if (m.spec.kind == MaskKind::kBitmask) {
      const TensorView& bits = m.partial_bitmasks;
      a.spec.bits = static_cast<const uint8_t*>(bits.data());
      a.spec.bits_stride_b = lead_stride(bits, 0), a.spec.bits_stride_h = lead_stride(bits, 1);
      a.spec.bits_stride_m = bits.stride(2), a.spec.bits_stride_w = bits.stride(3);
    }
    a.q_tiles = int32_t(q_tiles_of(p));
    a.num_items = int32_t(p.batch * p.heads_q * a.q_tiles);
    a.order = static_cast<const int32_t*>(scratch);
    a.grid = int32_t(std::min<int64_t>(a.num_items, sm_count(fp.q.device().index)));
    static const bool pingpong = env_flag("SPARSETRAIN_ATTN_PINGPONG"), lpt = env_flag("SPARSETRAIN_ATTN_LPT");
    a.pingpong = pingpong;

    cudaStream_t s = static_cast<cudaStream_t>(stream.handle);
    sort_items_kernel<<<1, kSortThreads, 0, s>>>(a.lists, a.heads_q, a.q_tiles, a.num_items,
                                                 static_cast<int32_t*>(scratch), !lpt);
    check(cudaGetLastError(), "sort_items_kernel launch");
    dispatch(p.dtype, p.head_dim, a, stream.handle);
  }

  void backward(const backend::AttentionBackwardParams&, void*, Stream) override {
    ST_FAIL("CUDA attention: the backward is not implemented yet");  // check_supported refuses first
  }
};

}  // namespace

backend::AttentionBackend& backend::attention_cuda_backend() {
  static AttentionCuda be;
  return be;
}

}  // namespace sparsetrain

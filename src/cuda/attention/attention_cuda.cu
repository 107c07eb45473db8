// The CUDA attention backend: what the sm90 kernels support (checked before anything is
// allocated), the kernels' arguments, the backward's preprocessing (delta = rowsum(dout * o), lse
// in base 2, the fp32 dQ accumulator zeroed for the non-deterministic mode's atomic adds), and the
// dispatch to the instantiations for (dtype, head dim), read from the build's generated instance
// list (sm90/sm90_instances.h). The forward's work order is attention_fwd_order.cu's, the
// backward's scratch and sections attention_bwd_plan.cpp's. Both passes run on the device of q.
// Nothing here synchronises the host: a backward can be captured in a CUDA graph.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "common/attention/attention_fwd_walk.h"
#include "common/attention/bwd_sections.h"
#include "common/attention/mask_predicate.h"
#include "common/dispatch_dtype.h"
#include "cuda/attention/attention_bwd_params.h"
#include "cuda/attention/attention_bwd_plan.h"
#include "cuda/attention/attention_fwd_order.h"
#include "cuda/attention/attention_fwd_params.h"
#include "cuda/attention/bwd_preprocess.cuh"
#include "cuda/attention/tile_scheduler.h"
#include "cuda/cuda_check.h"
#include "cuda/device_cache.h"
#include "cuda/element.cuh"
#include "cuda/pdl.cuh"
#include "cuda/runtime_cuda.h"
#include "cuda/tuning.h"
#include "ops/attention_backend.h"
#include "ops/block_mask_internal.h"  // mask_walk_shape
#include "sm90/sm90_instances.h"
#include "sparsetrain/error.h"

namespace sparsetrain {
namespace {

using backend::AttentionProblem;
using cuda::attn::BwdArgs;
using cuda::attn::bwd_mask;
using cuda::attn::bwd_preprocess_kernel;
using cuda::attn::bwd_q_tiles;
using cuda::attn::bwd_tile_rows;
using cuda::attn::BwdScratch;
using cuda::attn::FwdArgs;
using cuda::attn::FwdElement;
using cuda::attn::kBwdTileKv;
using cuda::attn::kTileKv;
using cuda::attn::kTileQ;

// ---- arguments ----------------------------------------------------------------------------------

// The mask inside partial blocks, as both kernels evaluate it.
cuda::attn::KernelMaskSpec mask_spec_args(const BlockMask& m) {
  cuda::attn::KernelMaskSpec spec;
  spec.kind = m.spec.kind;
  spec.window_left = m.spec.window_left, spec.window_right = m.spec.window_right;
  spec.prefix_length = m.spec.prefix_length;
  spec.block_kv = int32_t(m.block_kv);
  if (mask_has_documents(m.spec.kind)) {
    spec.doc_q = static_cast<const int32_t*>(m.spec.doc_q.data());
    spec.doc_kv = static_cast<const int32_t*>(m.spec.doc_kv.data());
    spec.doc_q_stride_b = m.spec.doc_q.broadcast_stride(0);
    spec.doc_kv_stride_b = m.spec.doc_kv.broadcast_stride(0);
  }
  if (m.spec.kind == MaskKind::kBitmask) {
    const TensorView& bits = m.partial_bitmasks;
    spec.bits = static_cast<const uint8_t*>(bits.data());
    spec.bits_stride_b = bits.broadcast_stride(0), spec.bits_stride_h = bits.broadcast_stride(1);
    spec.bits_stride_m = bits.stride(2), spec.bits_stride_w = bits.stride(3);
    spec.bits_width = int32_t(bits.size(3));
  }
  return spec;
}

int64_t q_tiles_of(const AttentionProblem& p) { return (p.seq_q + kTileQ - 1) / kTileQ; }

// The dispatch: one case per entry of the build's instance list (SPARSETRAIN_ATTN_INSTANCES).
void dispatch([[maybe_unused]] DType dtype, [[maybe_unused]] int64_t head_dim, [[maybe_unused]] const FwdArgs& a,
              [[maybe_unused]] void* stream) {
#define ST_ATTN_FWD_CASE(E, D) \
  if (dtype == DType::E && head_dim == D) return cuda::attn::run_fwd_sm90<FwdElement::E, D>(a, stream);
  SPARSETRAIN_ATTN_INSTANCES(ST_ATTN_FWD_CASE)
#undef ST_ATTN_FWD_CASE
  ST_FAIL("CUDA attention: no forward kernel for ", dtype_name(dtype), ", D = ", head_dim);
}

void dispatch_bwd([[maybe_unused]] DType dtype, [[maybe_unused]] int64_t head_dim, [[maybe_unused]] const BwdArgs& a,
                  [[maybe_unused]] void* dq, [[maybe_unused]] void* stream) {
#define ST_ATTN_BWD_CASE(E, D) \
  if (dtype == DType::E && head_dim == D) return cuda::attn::run_bwd_sm90<FwdElement::E, D>(a, dq, stream);
  SPARSETRAIN_ATTN_INSTANCES(ST_ATTN_BWD_CASE)
#undef ST_ATTN_BWD_CASE
  ST_FAIL("CUDA attention: no backward kernel for ", dtype_name(dtype), ", D = ", head_dim);
}

// TMA: a 16-byte aligned base and 16-byte multiples for every stride.
void check_tma_operand(const TensorView& t, const char* name, DType dtype) {
  const int64_t e = int64_t(dtype_size(dtype));
  const bool aligned = reinterpret_cast<uintptr_t>(t.data()) % 16 == 0 && (t.stride(0) * e) % 16 == 0 &&
                       (t.stride(1) * e) % 16 == 0 && (t.stride(2) * e) % 16 == 0;
  ST_CHECK_ARG(aligned, name, "a 16-byte aligned base and strides that are multiples of 16 bytes (TMA)",
               "strides [", t.stride(0), ", ", t.stride(1), ", ", t.stride(2), ", 1] at ", t.data());
}

// The mask's blocks against the kernels' tiles, and a bitmask's words (`name`: the mask's name in
// the message).
void check_mask_kernels(const BlockMask& mask, const std::string& name) {
  ST_CHECK_ARG(mask.block_q % kTileQ == 0, (name + "block_q").c_str(),
               "a multiple of the CUDA kernel's q tile (" + std::to_string(kTileQ) + ")", mask.block_q);
  static_assert(kBwdTileKv == kTileKv, "the block_kv check below covers both kernels' kv tiles: if they differ, check each");
  ST_CHECK_ARG(mask.block_kv % kTileKv == 0, (name + "block_kv").c_str(),
               "a multiple of the CUDA kernel's kv tile (" + std::to_string(kTileKv) + ")", mask.block_kv);
  if (mask.spec.kind == MaskKind::kBitmask) {
    // The kernel reads a row's bits as 32-bit words.
    const TensorView& bits = mask.partial_bitmasks;
    const bool words = reinterpret_cast<uintptr_t>(bits.data()) % 4 == 0 && bits.stride(0) % 4 == 0 &&
                       bits.stride(1) % 4 == 0 && bits.stride(2) % 4 == 0 && bits.stride(3) % 4 == 0;
    ST_CHECK_ARG(bits.stride(4) == 1 && words, (name + "partial_bitmasks").c_str(),
                 "a contiguous last dim, a 4-byte aligned base and strides that are multiples of 4 bytes",
                 "strides [", bits.stride(0), ", ", bits.stride(1), ", ", bits.stride(2), ", ", bits.stride(3), ", ",
                 bits.stride(4), "] at ", bits.data());
  }
}

class AttentionCuda final : public backend::AttentionBackend {
 public:
  void check_supported(const AttentionProblem& p, const TensorView& q, const TensorView& k, const TensorView& v,
                       const BlockMask& mask, const BackwardInputs* backward) const override {
    ST_CHECK_ARG(p.dtype == DType::kBF16 || p.dtype == DType::kFP16, "q", "dtype bf16 or fp16 on CUDA",
                 dtype_name(p.dtype));
    check_tma_operand(q, "q", p.dtype);
    check_tma_operand(k, "k", p.dtype);
    check_tma_operand(v, "v", p.dtype);
    if (backward != nullptr) check_tma_operand(backward->dout, "dout", p.dtype);
    // The backward's own checks read the mask it runs on (its padded form, if any: bwd_mask),
    // under that mask's name.
    if (backward != nullptr && mask.backward_padded != nullptr) {
      check_mask_kernels(*mask.backward_padded, "mask.backward_padded.");
      const TensorView& rr = mask.backward_padded->real_rows;
      ST_CHECK_ARG(offsets_fit_int32(rr), "mask.backward_padded.real_rows",
                   "every element offset below 2^31 (the backward indexes it in int32)", "the largest offset ",
                   max_element_offset(rr));
    }
    check_mask_kernels(mask, "mask.");
    const BlockMask& bm = backward != nullptr ? bwd_mask(mask) : mask;
    const std::string bname = backward != nullptr && mask.backward_padded != nullptr ? "mask.backward_padded." : "mask.";
    if (backward != nullptr && backward->deterministic) {
      // Turns are stored in block units; the kernel expands them to its kv tiles (dq_visit_turn).
      ST_CHECK_ARG(bm.dq_write_order.defined() && (!bm.full_q_indices.defined() || bm.dq_write_order_full.defined()),
                   (bname + "dq_write_order").c_str(), "the dQ write orders for the deterministic backward (compute_dq_write_order)",
                   "none");
    }
    if (backward != nullptr && bm.schedule.kind == ScheduleKind::kPermutation)
      ST_CHECK_ARG(int64_t(bm.schedule.permutation.size()) == bm.num_kv_blocks(), (bname + "schedule").c_str(),
                   "a permutation of the " + std::to_string(bm.num_kv_blocks()) + " kv block columns",
                   bm.schedule.permutation.size(), " entries");
    ST_CHECK_ARG(backend::attention_cuda_has_kernel(p.dtype, p.head_dim), "q",
                 "a head dim with a CUDA kernel in this build (" + backend::attention_cuda_kernels() + ")",
                 "D = ", p.head_dim, " (", dtype_name(p.dtype), ")");
    const int64_t limit = int64_t(1) << 30;
    const int64_t items = p.batch * p.heads_q * std::max(q_tiles_of(p), backward != nullptr ? bwd_q_tiles(p, bm) : 0);
    // The kernels index the mask's lists their walks read, and the document ids, in int32.
    auto check_int32_offsets = [](const TensorView* t, const std::string& name, const char* reader) {
      if (t != nullptr)
        ST_CHECK_ARG(offsets_fit_int32(*t), name.c_str(),
                     std::string("every element offset below 2^31 (the ") + reader +
                         " indexes it in int32; broadcast the mask over batch or heads)",
                     "the largest offset ", max_element_offset(*t));
    };
    if (backward == nullptr) {  // common/attention/attention_fwd_walk.h
      for (const auto& [t, name] : {std::pair<const TensorView*, const char*>{&mask.kv_num_blocks, "mask.kv_num_blocks"},
                                    {&mask.kv_indices, "mask.kv_indices"},
                                    {&mask.full_kv_num_blocks, "mask.full_kv_num_blocks"},
                                    {&mask.full_kv_indices, "mask.full_kv_indices"}})
        check_int32_offsets(t, name, "forward");
    } else {
      // The backward's tickets are int32 (BwdTicketScheduler, its index math 32-bit).
      const int64_t tickets = p.batch * p.heads_kv * bm.num_kv_blocks() * dq_sub_tiles(bm.block_kv);
      ST_CHECK_ARG(tickets < (int64_t(1) << 31), "k", "B * Hkv * ceil(Skv / 128) below 2^31 (the backward's work items)",
                   tickets, " items");
      // The backward indexes in int32 the mask's lists its walk reads (common/attention/attention_bwd_walk.h:
      // write orders in the deterministic mode, the forward lists for bitmasks) and the document ids.
      const bool det = backward->deterministic, bits = bm.spec.kind == MaskKind::kBitmask;
      const bool docs = mask_has_documents(bm.spec.kind);
      const std::pair<const TensorView*, const char*> lists[] = {
          {&bm.q_num_blocks, "q_num_blocks"},
          {&bm.q_indices, "q_indices"},
          {&bm.full_q_num_blocks, "full_q_num_blocks"},
          {&bm.full_q_indices, "full_q_indices"},
          {det ? &bm.dq_write_order : nullptr, "dq_write_order"},
          {det ? &bm.dq_write_order_full : nullptr, "dq_write_order_full"},
          {bits ? &bm.kv_num_blocks : nullptr, "kv_num_blocks"},
          {bits ? &bm.kv_indices : nullptr, "kv_indices"},
          {docs ? &bm.spec.doc_q : nullptr, "spec.doc_q"},
          {docs ? &bm.spec.doc_kv : nullptr, "spec.doc_kv"}};
      for (const auto& [t, name] : lists) check_int32_offsets(t, (bname + name).c_str(), "backward");
    }
    ST_CHECK_ARG(p.seq_q < limit && p.seq_kv < limit && items < limit, "q",
                 "Sq, Skv and B * Hq * ceil(Sq / 128) below 2^30 (32-bit indexing)", "Sq = ", p.seq_q,
                 ", Skv = ", p.seq_kv, ", ", items, " q tiles");
  }

  // The work records, then the dynamic hand-out's counter.
  size_t forward_scratch_bytes(const AttentionProblem& p) const override {
    return cuda::attn::fwd_order_scratch_bytes(p.batch * p.heads_q * q_tiles_of(p));
  }
  size_t backward_scratch_bytes(const AttentionProblem& p, const BlockMask& mask) const override {
    return BwdScratch(p, bwd_mask(mask), nullptr, nullptr).bytes;
  }

  void forward(const backend::AttentionForwardParams& fp, void* scratch, Stream stream) override {
    const cuda::DeviceGuard guard(fp.q.device().index);
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
    a.lists.partial_count = mask_index_view(m.kv_num_blocks);
    a.lists.partial_index = mask_index_view(m.kv_indices);
    a.lists.full_count = mask_index_view(m.full_kv_num_blocks);
    a.lists.full_index = mask_index_view(m.full_kv_indices);
    a.lists.num_kv_blocks = int32_t(m.num_kv_blocks());
    a.lists.block_q = int32_t(m.block_q);
    a.lists.sub_tiles = int32_t(m.block_kv / kTileKv);
    a.spec = mask_spec_args(m);
    a.q_tiles = int32_t(q_tiles_of(p));
    a.num_items = int32_t(p.batch * p.heads_q * a.q_tiles);
    a.grid = cuda::attn::FwdTicketScheduler::grid_shape(a.num_items, cuda::sm_count(fp.q.device().index), fp.sm_limit);
    cuda::attn::order_fwd_work(p, a, scratch, fp.q.device().index, stream.handle);
    dispatch(p.dtype, p.head_dim, a, stream.handle);
  }

  void backward(const backend::AttentionBackwardParams& bp, void* scratch, Stream stream) override {
    const cuda::DeviceGuard guard(bp.q.device().index);
    const AttentionProblem& p = bp.problem;
    const BlockMask& m = bwd_mask(*bp.mask);
    const BwdScratch ws(p, m, scratch, bp.dq.data());  // dq's bytes hold the kernel-only regions (in_dq)
    const int32_t q_tiles = int32_t(bwd_q_tiles(p, m)), rows = q_tiles * bwd_tile_rows(p);
    cudaStream_t s = static_cast<cudaStream_t>(stream.handle);

    // 16-byte loads where every row of o and dout starts on a 16-byte boundary (8 elements).
    auto rows_aligned = [](const TensorView& t) {
      return reinterpret_cast<uintptr_t>(t.data()) % 16 == 0 && t.stride(0) % 8 == 0 && t.stride(1) % 8 == 0 &&
             t.stride(2) % 8 == 0;
    };
    const bool vector = p.head_dim % 8 == 0 && p.head_dim <= 128 && rows_aligned(bp.o) && rows_aligned(bp.dout);
    // Document masks: the preprocessing also copies each q row's document id into a padded row
    // array, which the kernel loads with lse and delta.
    const cuda::attn::KernelMaskSpec spec = mask_spec_args(m);
    const bool docs = mask_has_documents(spec.kind);
    BwdArgs a{};
    a.q = bp.q.data(), a.k = bp.k.data(), a.v = bp.v.data(), a.dout = bp.dout.data();
    a.q_stride_b = bp.q.stride(0), a.q_stride_s = bp.q.stride(1), a.q_stride_h = bp.q.stride(2);
    a.k_stride_b = bp.k.stride(0), a.k_stride_s = bp.k.stride(1), a.k_stride_h = bp.k.stride(2);
    a.v_stride_b = bp.v.stride(0), a.v_stride_s = bp.v.stride(1), a.v_stride_h = bp.v.stride(2);
    a.do_stride_b = bp.dout.stride(0), a.do_stride_s = bp.dout.stride(1), a.do_stride_h = bp.dout.stride(2);
    a.dk = bp.dk.data(), a.dv = bp.dv.data();
    a.lse_log2 = ws.lse_log2, a.delta = ws.delta, a.dq_accum = ws.dq_accum;
    a.doc_q_rows = ws.doc_q_rows;  // null unless a document mask
    a.semaphores = ws.semaphores, a.sched.ticket = ws.counters, a.abandoned = ws.counters + 1;
    a.batch = int32_t(p.batch), a.seq_q = int32_t(p.seq_q), a.seq_kv = int32_t(p.seq_kv);
    a.heads_q = int32_t(p.heads_q), a.heads_kv = int32_t(p.heads_kv);
    a.group = a.heads_q / a.heads_kv;
    a.mask_seq_q = int32_t(m.seq_q), a.mask_seq_kv = int32_t(m.seq_kv);
    if (m.real_rows.defined()) {
      a.real_rows = static_cast<const int32_t*>(m.real_rows.data());
      a.real_rows_stride_b = int32_t(m.real_rows.broadcast_stride(0));
    }
    a.scale = p.scale;
    a.lists.partial_count = mask_index_view(m.q_num_blocks);
    a.lists.partial_index = mask_index_view(m.q_indices);
    a.lists.full_count = mask_index_view(m.full_q_num_blocks);
    a.lists.full_index = mask_index_view(m.full_q_indices);
    if (bp.deterministic) {
      a.lists.partial_turn = mask_index_view(m.dq_write_order);
      a.lists.full_turn = mask_index_view(m.dq_write_order_full);
    }
    a.lists.kv_count = mask_index_view(m.kv_num_blocks);
    a.lists.kv_index = mask_index_view(m.kv_indices);
    a.lists.find_bit_entry = m.spec.kind == MaskKind::kBitmask;
    a.lists.num_q_blocks = int32_t(m.num_q_blocks());
    a.lists.q_tiles_per_block = int32_t(m.block_q / bwd_tile_rows(p));
    a.lists.num_q_tiles = q_tiles;
    a.lists.walk = mask_walk_shape(m, m.schedule.walk);  // in both modes: dK / dV bits follow it
    a.spec = spec;
    a.block_q = int32_t(m.block_q), a.block_kv = int32_t(m.block_kv);
    // Bitmask masks: a kernel before the preprocessing copies the partial blocks transposed, and
    // the backward reads the copy (common/attention/bitmask_transpose.h).
    cuda::attn::BwdBitsCopy bits;
    if (ws.bits_t != nullptr) {
      bits.in = spec;
      bits.blocks = cuda::attn::bwd_bitmask_blocks(m);
      bits.seq_q = a.mask_seq_q;
      bits.out = ws.bits_t;
      a.spec.bits = reinterpret_cast<const uint8_t*>(ws.bits_t);
      a.spec.bits_stride_b = bits.blocks.stride_b(), a.spec.bits_stride_h = bits.blocks.stride_h();
      a.spec.bits_stride_m = bits.blocks.stride_m(), a.spec.bits_stride_w = bits.blocks.stride_w();
    }
    DqColumnHandout& handout = a.sched.handout;
    handout.batch = p.batch;
    handout.kv_heads = p.heads_kv;
    handout.num_columns = m.num_kv_blocks();
    handout.sub_tiles = dq_sub_tiles(m.block_kv);  // block_kv / kBwdTileKv: a multiple (checked)
    handout.kind = m.schedule.kind;
    const int device = bp.q.device().index;
    a.grid = cuda::attn::BwdTicketScheduler::grid_shape(handout.num_items(), cuda::sm_count(device), bp.sm_limit);
    // The hand-out's L2 sections (attention_bwd_plan.h): decided here, or by the preprocessing.
    const cuda::attn::BwdSectionsOnDevice on_device =
        cuda::attn::plan_bwd_sections(p, m, bp.deterministic, device, ws.sections, a);
    if (bits.out != nullptr) {  // a warp a tile, at most 8 blocks an SM
      constexpr int64_t kWarps = cuda::attn::kBitsCopyThreads / 32;
      const int64_t blocks = std::min((bits.blocks.tiles() + kWarps - 1) / kWarps, int64_t(cuda::sm_count(device)) * 8);
      cuda::attn::bwd_bits_copy_kernel<<<unsigned(blocks), cuda::attn::kBitsCopyThreads, 0, s>>>(bits);
      ST_CUDA_CHECK(cudaGetLastError(), "CUDA attention: backward bitmask copy launch");
    }
    // The preprocessing: a block per tile of heads x q rows (BwdPreprocessTiling). It also zeroes
    // the semaphores, the ticket counter and the abandoned flag, so that they start at zero in
    // every run (and in every replay of a captured graph).
    auto preprocess = [&](auto element) {
      using E = decltype(element);
      auto launch = [&](auto tiling) {
        using Tiling = decltype(tiling);
        const int heads_log2 = Tiling::heads_log2_for(p.heads_q);
        int64_t g[3];
        Tiling::grid(rows, p.heads_q, p.batch, heads_log2, g);
        bwd_preprocess_kernel<E, Tiling><<<dim3(unsigned(g[0]), unsigned(g[1]), unsigned(g[2])), Tiling::kThreads, 0, s>>>(
            static_cast<const E*>(bp.o.data()), bp.o.stride(0), bp.o.stride(1), bp.o.stride(2),
            static_cast<const E*>(bp.dout.data()), bp.dout.stride(0), bp.dout.stride(1), bp.dout.stride(2),
            static_cast<const float*>(bp.lse.data()), bp.lse.stride(0), bp.lse.stride(1), bp.lse.stride(2),
            int32_t(p.batch), int32_t(p.heads_q), int32_t(p.seq_q), a.mask_seq_q, a.real_rows, a.real_rows_stride_b, rows,
            int32_t(p.head_dim), heads_log2, ws.lse_log2, ws.delta,
            bp.deterministic ? nullptr : ws.dq_accum, ws.semaphores, int64_t(ws.zeroed_bytes / sizeof(int32_t)),
            docs ? spec.doc_q : nullptr, docs ? spec.doc_q_stride_b : 0, ws.doc_q_rows, on_device);
      };
      if (!vector) launch(BwdPreprocessTiling<32, false>{});
      else if (p.head_dim <= 64) launch(BwdPreprocessTiling<8, true>{});
      else launch(BwdPreprocessTiling<16, true>{});
    };
    dispatch_dtype<bf16_t, fp16_t>(p.dtype, "CUDA attention backward", preprocess);
    ST_CUDA_CHECK(cudaGetLastError(), "CUDA attention: backward preprocessing launch");

    if (m.schedule.kind == ScheduleKind::kPermutation) {
      // From the mask's host vector: a capture must keep the mask alive for the graph's life.
      ST_CUDA_CHECK(cudaMemcpyAsync(ws.permutation, m.schedule.permutation.data(),
                                    m.schedule.permutation.size() * sizeof(int32_t), cudaMemcpyHostToDevice, s),
                    "CUDA attention: cudaMemcpyAsync (schedule permutation)");
      handout.permutation = ws.permutation;
    }
    a.deterministic = bp.deterministic;
    a.spin_limit_ns = cuda::tuning::attention_spin_limit_ns();
    dispatch_bwd(p.dtype, p.head_dim, a, bp.dq.data(), stream.handle);

  }
};

}  // namespace

bool backend::attention_cuda_has_kernel(DType dtype, int64_t head_dim) {
#define ST_ATTN_BUILT(E, D) \
  if (dtype == DType::E && head_dim == D) return true;
  SPARSETRAIN_ATTN_INSTANCES(ST_ATTN_BUILT)
#undef ST_ATTN_BUILT
  (void)dtype;
  (void)head_dim;
  return false;
}

// "bf16 with D = 128: a MINIMAL build", "bf16 with D = 64, 96 or 128, fp16 with D = 64, 96 or
// 128: an ALL build", "none: built without CUTLASS".
std::string backend::attention_cuda_kernels() {
  std::string text;
  for (DType dtype : {DType::kBF16, DType::kFP16}) {
    std::vector<int> dims;
#define ST_ATTN_DIM(E, D) \
  if (dtype == DType::E) dims.push_back(D);
    SPARSETRAIN_ATTN_INSTANCES(ST_ATTN_DIM)
#undef ST_ATTN_DIM
    if (dims.empty()) continue;
    std::sort(dims.begin(), dims.end());
    text += std::string(text.empty() ? "" : ", ") + dtype_name(dtype) + " with D = ";
    for (size_t i = 0; i < dims.size(); ++i)
      text += (i == 0 ? "" : i + 1 == dims.size() ? " or " : ", ") + std::to_string(dims[i]);
  }
  return text.empty() ? std::string(SPARSETRAIN_SM90_KERNEL_SET) : text + ": " + SPARSETRAIN_SM90_KERNEL_SET;
}

backend::AttentionBackend& backend::attention_cuda_backend() {
  static AttentionCuda be;
  return be;
}

}  // namespace sparsetrain

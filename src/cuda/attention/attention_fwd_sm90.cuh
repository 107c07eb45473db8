// Block-sparse attention forward for sm_90a, written on CuTe: a persistent, warp-specialised
// kernel in the shape of FlashAttention-3's.
//
//   scheduler  work items (batch, query head, 128-row q tile) in longest-first order (a counting
//              sort on the device, attention_cuda.cu), handed out round-robin to persistent CTAs
//              (common/attention_fwd_walk.h for the index math)
//   mainloop   a producer warpgroup loads the q tile once (two q buffers: the next item's loads
//              start early) and streams the kv tiles the mask row lists (partial blocks, then
//              full ones) through TMA pipelines (K: 2 stages, V: 3, one producer thread each);
//              two consumer warpgroups (64 query rows each) compute S = Q K^T with wgmma from
//              shared memory, apply the mask inside partial blocks only, update the online softmax
//              in registers and accumulate O += P V with P straight from registers (wgmma RS).
//              The softmax of tile j overlaps the PV GEMM of tile j - 1, and the two warpgroups
//              take turns issuing GEMMs (ping-pong), as in FlashAttention-3
//   epilogue   O / rowsum in the input dtype and the natural-log lse, from registers to global
//
// The mask kind is a runtime switch (one branch per partial tile), so one instantiation serves
// every built-in spec and the per-block bitmasks. Rows past Sq and columns past Skv of the last
// tiles are zero-filled by TMA and masked here; rows with no allowed key give o = 0, lse = -inf.
#pragma once

#include <cuda_runtime.h>

#include <cmath>

#include "common/mask_predicate.h"  // mask_row_interval
#include "cuda/attention/attention_fwd_params.h"
#include "cuda/attention/attention_sm90_common.cuh"

namespace sparsetrain::cuda::attn {

using namespace cute;

template <class Element_, int kHeadDim_>
struct FwdTraits {
  using Element = Element_;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockM = kTileQ, kBlockN = kTileKv;
  // Pipeline depth: V is held longer than K (until the PV GEMM of the next iteration), so it gets
  // one more stage; each has its own producer thread, so K never waits for a V slot.
  static constexpr int kStagesK = 2, kStagesV = 3;
  static constexpr int kConsumerWarpgroups = 2;
  static constexpr int kMmaThreads = 128 * kConsumerWarpgroups;
  static constexpr int kThreads = kMmaThreads + 128;  // + the producer warpgroup
  // setmaxnreg budgets (per thread): the producer needs few, the consumers hold S, P and O.
  static constexpr int kProducerRegs = 24, kConsumerRegs = 240;

  using TileQK = Shape<Int<kBlockM>, Int<kBlockN>, Int<kHeadDim>>;  // S = Q K^T: M x N x K
  using TilePV = Shape<Int<kBlockM>, Int<kHeadDim>, Int<kBlockN>>;  // O += P V: M x D x N
  using WarpgroupsAlongM = Layout<Shape<Int<kConsumerWarpgroups>, _1, _1>>;
  using MmaQK = decltype(make_tiled_mma(GMMA::ss_op_selector<Element, Element, float, TileQK>(), WarpgroupsAlongM{}));
  // V stays [kv, D] in shared memory (D contiguous): as PV's B operand (D x kv) it is MN-major.
  using MmaPV = decltype(make_tiled_mma(
      GMMA::rs_op_selector<Element, Element, float, TilePV, GMMA::Major::K, GMMA::Major::MN>(), WarpgroupsAlongM{}));

  using SmemAtom = decltype(smem_atom_k_major<Element, kHeadDim>());
  using SmemLayoutQ = decltype(tile_to_shape(SmemAtom{}, Shape<Int<kBlockM>, Int<kHeadDim>>{}));
  // Two q tiles: the producer loads the next item's q (and its first kv tiles) while the
  // consumers finish the current one.
  static constexpr int kQBuffers = 2;
  using SmemLayoutQs = decltype(tile_to_shape(SmemAtom{}, Shape<Int<kBlockM>, Int<kHeadDim>, Int<kQBuffers>>{}));
  using SmemLayoutK = decltype(tile_to_shape(SmemAtom{}, Shape<Int<kBlockN>, Int<kHeadDim>, Int<kStagesK>>{}));
  using SmemLayoutV = decltype(tile_to_shape(SmemAtom{}, Shape<Int<kBlockN>, Int<kHeadDim>, Int<kStagesV>>{}));
  using SmemLayoutVt = decltype(composition(
      SmemLayoutV{}, make_ordered_layout(Shape<Int<kHeadDim>, Int<kBlockN>, Int<kStagesV>>{}, Step<_2, _1, _3>{})));

  // Global q / k / v as TMA sees them: (S, D, H, B), D contiguous, any other strides.
  using GmemShape = Shape<int32_t, int32_t, int32_t, int32_t>;
  using GmemStride = Stride<int64_t, _1, int64_t, int64_t>;
  using GmemTensor =
      decltype(make_tensor(make_gmem_ptr(static_cast<Element const*>(nullptr)), GmemShape{}, GmemStride{}));
  using TmaQ = decltype(make_tma_copy(SM90_TMA_LOAD{}, GmemTensor{}, SmemLayoutQ{},
                                      Shape<Int<kBlockM>, Int<kHeadDim>>{}, _1{}));
  using TmaKV = decltype(make_tma_copy(SM90_TMA_LOAD{}, GmemTensor{}, take<0, 2>(SmemLayoutK{}),
                                       Shape<Int<kBlockN>, Int<kHeadDim>>{}, _1{}));
  static constexpr uint32_t kQBytes = kBlockM * kHeadDim * sizeof(Element);
  static constexpr uint32_t kKVBytes = kBlockN * kHeadDim * sizeof(Element);

  using PipelineK = cutlass::PipelineTmaAsync<kStagesK>;
  using PipelineV = cutlass::PipelineTmaAsync<kStagesV>;

  struct SharedStorage {
    array_aligned<Element, cosize_v<SmemLayoutQs>, 1024> q;
    array_aligned<Element, cosize_v<SmemLayoutK>, 1024> k;
    array_aligned<Element, cosize_v<SmemLayoutV>, 1024> v;
    typename PipelineK::SharedStorage pipe_k;
    typename PipelineV::SharedStorage pipe_v;
    uint64_t q_full[kQBuffers];   // the q tile landed (TMA transaction barrier)
    uint64_t q_empty[kQBuffers];  // the consumers are done with it (every consumer thread arrives)
    int32_t doc_kv[kConsumerWarpgroups][kBlockN];  // a partial tile's key document ids, per warpgroup
  };

  static_assert(sizeof(SharedStorage) <= 227 * 1024, "sm90 allows 227 KiB of shared memory per CTA");

  struct Params {
    FwdArgs args;
    TmaQ tma_q;
    TmaKV tma_k, tma_v;
    float scale_log2;  // scale * log2(e): the softmax runs in base 2
  };
};

// ---- masking and softmax -------------------------------------------------------------------

// The Skv bound alone (a full tile that crosses the end of the keys).
template <class TS, class TC>
__device__ __forceinline__ void mask_seq_kv(TS& s, TC const& coord, int kv0, int seq_kv) {
  CUTLASS_PRAGMA_UNROLL
  for (int j = 0; j < size<1>(s); ++j) {
    const bool out = kv0 + get<1>(coord(0, j)) >= seq_kv;  // columns are the same in every row
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < size<0>(s); ++i)
      if (out) s(i, j) = -INFINITY;
  }
}

// The mask inside one partial tile, by kind (a runtime switch). Specs whose rows are intervals
// (causal, bottom-right causal, sliding window, prefix-LM, full) cost two compares per element;
// documents compare ids, bitmasks test the row's bits (read as 32-bit words).
// doc_stage: this warpgroup's kTileKv slots in shared memory (named barrier 2 + wg syncs them).
template <class TS, class TC>
__device__ __forceinline__ void mask_partial_tile(TS& s, TC const& coord, int q0, int kv0, const FwdArgs& a, int b,
                                                  int h, int mask_row, const WalkTile& tile, int32_t* doc_stage,
                                                  int wg) {
  const KernelMaskSpec& m = a.spec;
  const int sq = a.seq_q, skv = a.seq_kv;
  switch (m.kind) {
    case MaskKind::kDocument:
    case MaskKind::kDocumentCausal: {
      // The tile's key ids go through shared memory: one coalesced load per thread instead of
      // 32 scattered ones in the softmax's critical path.
      const int32_t* doc_q = m.doc_q + b * m.doc_q_stride_b;
      const int32_t* doc_kv = m.doc_kv + b * m.doc_kv_stride_b;
      const bool causal = m.kind == MaskKind::kDocumentCausal;
      const int lane = threadIdx.x % 128;
      cutlass::arch::NamedBarrier::sync(128, 2 + wg);  // the previous partial tile's reads are done
      doc_stage[lane] = kv0 + lane < skv ? __ldg(doc_kv + kv0 + lane) : INT32_MIN;
      cutlass::arch::NamedBarrier::sync(128, 2 + wg);
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < size<0>(s); ++i) {
        const int q = q0 + get<0>(coord(i, 0));
        const int32_t dq = q < sq ? __ldg(doc_q + q) : INT32_MAX;  // never a key's id
        CUTLASS_PRAGMA_UNROLL
        for (int j = 0; j < size<1>(s); ++j) {
          const int kv = kv0 + get<1>(coord(i, j));
          const bool ok = q < sq && doc_stage[kv - kv0] == dq && (!causal || kv <= q);
          if (!ok) s(i, j) = -INFINITY;
        }
      }
      break;
    }
    case MaskKind::kBitmask: {
      // Row r of the block is block_kv bits from bit r * block_kv on (block_kv a multiple of 128:
      // the kernel tile's 128 columns are 4 aligned 32-bit words).
      const uint8_t* bits = m.bits + b * m.bits_stride_b + h * m.bits_stride_h + mask_row * m.bits_stride_m +
                            tile.entry * m.bits_stride_w;
      const int row0 = mask_row * a.lists.block_q, col0 = (tile.tile / a.lists.sub_tiles) * m.block_kv;
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < size<0>(s); ++i) {
        const int q = q0 + get<0>(coord(i, 0));
        const uint32_t* words =
            reinterpret_cast<const uint32_t*>(bits + (int64_t(q - row0) * m.block_kv + (kv0 - col0)) / 8);
        static_assert(kTileKv == 128, "the row's bits are 4 words");
        const bool in = q < sq && tile.entry < m.bits_width;  // a corrupt count: nothing allowed
        const uint32_t w0 = in ? __ldg(words) : 0u, w1 = in ? __ldg(words + 1) : 0u;
        const uint32_t w2 = in ? __ldg(words + 2) : 0u, w3 = in ? __ldg(words + 3) : 0u;
        CUTLASS_PRAGMA_UNROLL
        for (int j = 0; j < size<1>(s); ++j) {
          const int c = get<1>(coord(i, j));
          const uint32_t word = c < 64 ? (c < 32 ? w0 : w1) : (c < 96 ? w2 : w3);  // selects, no local array
          const bool ok = kv0 + c < skv && ((word >> (c & 31)) & 1u);
          if (!ok) s(i, j) = -INFINITY;
        }
      }
      break;
    }
    default: {
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < size<0>(s); ++i) {
        const int q = q0 + get<0>(coord(i, 0));
        int64_t lo, hi;
        mask_row_interval(m.kind, m.window_left, m.window_right, m.prefix_length, sq, skv, q, &lo, &hi);
        const int from = int(max(lo, int64_t(0)) - kv0), to = int(min(hi, int64_t(skv)) - kv0);  // tile columns
        CUTLASS_PRAGMA_UNROLL
        for (int j = 0; j < size<1>(s); ++j) {
          const int c = get<1>(coord(i, j));
          if (c < from || c >= to) s(i, j) = -INFINITY;
        }
      }
      break;
    }
  }
}

// After S of a tile is in registers: the mask (partial tiles; the Skv bound of a full tile that
// crosses it), the new row maxima, and P = exp(S - max) in place; `correction` gets each row's
// rescale factor for what was accumulated before. Rows live in 4 adjacent lanes.
template <int kBlockN, class TS, class TC, int kRows>
__device__ __forceinline__ void masked_softmax(TS& S, TC const& coord, const WalkTile& tile, const FwdWorkItem& w,
                                               int mask_row, int q0, const FwdArgs& a, float scale_log2,
                                               float (&row_max)[kRows], float (&row_sum)[kRows],
                                               float (&correction)[kRows], int32_t* doc_stage, int wg) {
  const int kv0 = tile.tile * kBlockN;
  if (tile.partial) {
    mask_partial_tile(S, coord, q0, kv0, a, w.b, w.h, mask_row, tile, doc_stage, wg);
  } else if (kv0 + kBlockN > a.seq_kv) {
    mask_seq_kv(S, coord, kv0, a.seq_kv);
  }
  CUTLASS_PRAGMA_UNROLL
  for (int i = 0; i < kRows; ++i) {
    float mx = row_max[i];
    CUTLASS_PRAGMA_UNROLL
    for (int j = 0; j < size<1>(S); ++j) mx = fmaxf(mx, S(i, j));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, 2));
    correction[i] = row_max[i] == -INFINITY ? 0.f : fast_exp2((row_max[i] - mx) * scale_log2);
    row_max[i] = mx;
    const float offset = mx == -INFINITY ? 0.f : mx * scale_log2;  // all masked so far: p = 0
    float sum = 0.f;
    CUTLASS_PRAGMA_UNROLL
    for (int j = 0; j < size<1>(S); ++j) {
      S(i, j) = fast_exp2(S(i, j) * scale_log2 - offset);
      sum += S(i, j);
    }
    row_sum[i] = row_sum[i] * correction[i] + sum;
  }
}

// ---- the kernel ----------------------------------------------------------------------------------

// One thread of the producer warpgroup per role: loads_v false loads q and K, true loads V.
template <class T>
__device__ __forceinline__ void produce(const typename T::Params& p, typename T::SharedStorage& ss,
                                        typename T::PipelineK& pipe_k, typename T::PipelineV& pipe_v, bool loads_v) {
  const FwdArgs& a = p.args;
  Tensor sQ = make_tensor(make_smem_ptr(ss.q.data()), typename T::SmemLayoutQs{});
  Tensor sK = make_tensor(make_smem_ptr(ss.k.data()), typename T::SmemLayoutK{});
  Tensor sV = make_tensor(make_smem_ptr(ss.v.data()), typename T::SmemLayoutV{});
  Tensor mQ = p.tma_q.get_tma_tensor(make_shape(a.seq_q, int32_t(T::kHeadDim), a.heads_q, a.batch));
  Tensor mK = p.tma_k.get_tma_tensor(make_shape(a.seq_kv, int32_t(T::kHeadDim), a.heads_kv, a.batch));
  Tensor mV = p.tma_v.get_tma_tensor(make_shape(a.seq_kv, int32_t(T::kHeadDim), a.heads_kv, a.batch));
  using QTile = Shape<Int<T::kBlockM>, Int<T::kHeadDim>>;
  using KVTile = Shape<Int<T::kBlockN>, Int<T::kHeadDim>>;

  auto write_k = cutlass::make_producer_start_state<typename T::PipelineK>();
  auto write_v = cutlass::make_producer_start_state<typename T::PipelineV>();
  int q_loads = 0;
  const int group = a.heads_q / a.heads_kv;
  for (int it = blockIdx.x; it < a.num_items; it += gridDim.x) {
    const FwdWorkItem w = fwd_work_item(a.order[it], a.heads_q, a.q_tiles);
    const int row = fwd_mask_row(w.q_tile, T::kBlockM, a.lists.block_q);
    const WalkCounts counts = walk_counts(a.lists, w.b, w.h, row);
    const int length = walk_length(a.lists, counts);
    WalkTile tile{};
    int t = walk_next_valid(a.lists, counts, w.b, w.h, row, 0, &tile);
    if (t == length) continue;  // nothing to load: the consumers write o = 0, lse = -inf
    const int hkv = w.h / group;
    if (loads_v) {
      Tensor gV = local_tile(mV(_, _, hkv, w.b), KVTile{}, make_coord(_, 0));  // (N, D, tiles)
      auto [tVgV, tVsV] = tma_partition(p.tma_v, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sV), group_modes<0, 2>(gV));
      for (; t < length; t = walk_next_valid(a.lists, counts, w.b, w.h, row, t + 1, &tile)) {
        pipe_v.producer_acquire(write_v);
        copy(p.tma_v.with(*pipe_v.producer_get_barrier(write_v), 0), tVgV(_, tile.tile), tVsV(_, write_v.index()));
        ++write_v;
      }
      continue;
    }
    const int buf = q_loads % T::kQBuffers, use = q_loads / T::kQBuffers;  // use: of this buffer
    if (use > 0) cutlass::arch::ClusterBarrier::wait(&ss.q_empty[buf], (use - 1) & 1);
    ++q_loads;
    Tensor gQ = local_tile(mQ(_, _, w.h, w.b), QTile{}, make_coord(w.q_tile, 0));
    auto [tQgQ, tQsQ] =
        tma_partition(p.tma_q, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sQ(_, _, buf)), group_modes<0, 2>(gQ));
    cutlass::arch::ClusterTransactionBarrier::arrive_and_expect_tx(&ss.q_full[buf], T::kQBytes);
    copy(p.tma_q.with(ss.q_full[buf]), tQgQ, tQsQ);

    Tensor gK = local_tile(mK(_, _, hkv, w.b), KVTile{}, make_coord(_, 0));  // (N, D, tiles)
    auto [tKgK, tKsK] = tma_partition(p.tma_k, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sK), group_modes<0, 2>(gK));
    for (; t < length; t = walk_next_valid(a.lists, counts, w.b, w.h, row, t + 1, &tile)) {
      pipe_k.producer_acquire(write_k);
      copy(p.tma_k.with(*pipe_k.producer_get_barrier(write_k), 0), tKgK(_, tile.tile), tKsK(_, write_k.index()));
      ++write_k;
    }
  }
}

template <class T>
__device__ __forceinline__ void consume(const typename T::Params& p, typename T::SharedStorage& ss,
                                        typename T::PipelineK& pipe_k, typename T::PipelineV& pipe_v, int tid) {
  using Element = typename T::Element;
  const FwdArgs& a = p.args;
  Tensor sQ = make_tensor(make_smem_ptr(ss.q.data()), typename T::SmemLayoutQs{});
  Tensor sK = make_tensor(make_smem_ptr(ss.k.data()), typename T::SmemLayoutK{});
  Tensor sVt = make_tensor(make_smem_ptr(ss.v.data()), typename T::SmemLayoutVt{});
  typename T::MmaQK mma_qk;
  typename T::MmaPV mma_pv;
  auto thr_qk = mma_qk.get_thread_slice(tid);
  auto thr_pv = mma_pv.get_thread_slice(tid);
  Tensor tSrQ = thr_qk.partition_fragment_A(sQ);   // descriptors (MMA, M, K, buffer)
  Tensor tSrK = thr_qk.partition_fragment_B(sK);   // (MMA, N, K, stage)
  Tensor tOrV = thr_pv.partition_fragment_B(sVt);  // (MMA, D, N, stage)
  Tensor tSrS = partition_fragment_C(mma_qk, Shape<Int<T::kBlockM>, Int<T::kBlockN>>{});
  Tensor tOrO = partition_fragment_C(mma_pv, Shape<Int<T::kBlockM>, Int<T::kHeadDim>>{});
  Tensor tScS = thr_qk.partition_C(make_identity_tensor(Shape<Int<T::kBlockM>, Int<T::kBlockN>>{}));
  Tensor tOcO = thr_pv.partition_C(make_identity_tensor(Shape<Int<T::kBlockM>, Int<T::kHeadDim>>{}));
  Tensor S = make_tensor(tSrS.data(), acc_rowcol(tSrS.layout()));
  Tensor S_coord = make_tensor(tScS.data(), acc_rowcol(tScS.layout()));
  Tensor O = make_tensor(tOrO.data(), acc_rowcol(tOrO.layout()));
  Tensor O_coord = make_tensor(tOcO.data(), acc_rowcol(tOcO.layout()));
  constexpr int kRows = decltype(size<0>(S))::value;  // 2 rows per thread

  cutlass::PipelineState<T::kStagesK> read;           // the K of the tile whose S comes next
  cutlass::PipelineState<T::kStagesV> read_v, p_read;  // the V of that tile; the V the pending P waits for
  int q_loads = 0;
  const float scale_log2 = p.scale_log2;
  Element* out = static_cast<Element*>(a.o);
  Tensor rP = make_tensor_like<Element>(tSrS);
  Tensor tOrP = make_tensor(rP.data(), acc_as_a_operand(rP.layout()));
  // Ping-pong: the two consumer warpgroups take turns issuing their GEMMs (named barriers 0 and
  // 1, one per warpgroup), so one's softmax runs while the other's GEMMs keep the tensor cores
  // busy. Warpgroup 0 goes first.
  const int wg = tid / 128;
  const bool pingpong = a.pingpong;
  auto wait_turn = [&] {
    if (pingpong) cutlass::arch::NamedBarrier::sync(T::kMmaThreads, wg);
  };
  auto pass_turn = [&] {
    if (pingpong) cutlass::arch::NamedBarrier::arrive(T::kMmaThreads, 1 - wg);
  };
  if (wg == 1) pass_turn();

  float row_max[kRows], row_sum[kRows], correction[kRows];
  for (int it = blockIdx.x; it < a.num_items; it += gridDim.x) {
    const FwdWorkItem w = fwd_work_item(a.order[it], a.heads_q, a.q_tiles);
    const int row = fwd_mask_row(w.q_tile, T::kBlockM, a.lists.block_q);
    const WalkCounts counts = walk_counts(a.lists, w.b, w.h, row);
    const int length = walk_length(a.lists, counts);
    const int q0 = w.q_tile * T::kBlockM;

    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < kRows; ++i) row_max[i] = -INFINITY, row_sum[i] = 0.f;
    clear(tOrO);
    WalkTile tile{};
    int t = walk_next_valid(a.lists, counts, w.b, w.h, row, 0, &tile);
    if (t < length) {
      const int buf = q_loads % T::kQBuffers;
      cutlass::arch::ClusterBarrier::wait(&ss.q_full[buf], (q_loads / T::kQBuffers) & 1);
      Tensor tSrQb = tSrQ(_, _, _, buf);
      // First tile: S only.
      pipe_k.consumer_wait(read);
      wait_turn();
      warpgroup_gemm_issue<true>(mma_qk, tSrQb, tSrK(_, _, _, read.index()), tSrS);
      pass_turn();
      warpgroup_wait<0>();
      warpgroup_fence_operand(tSrS);
      pipe_k.consumer_release(read);
      masked_softmax<T::kBlockN>(S, S_coord, tile, w, row, q0, a, scale_log2, row_max, row_sum, correction,
                                   ss.doc_kv[wg], wg);
      convert_p(tSrS, rP);
      p_read = read_v;
      ++read;
      ++read_v;
      // Steady state (FlashAttention-3's intra-warpgroup overlap): tile j's S = Q K^T is issued
      // together with O += P V of tile j - 1, and tile j's softmax runs while that PV GEMM is in
      // flight. No wgmma sits on a divergent path (ptxas would serialise them all).
      for (t = walk_next_valid(a.lists, counts, w.b, w.h, row, t + 1, &tile); t < length;
           t = walk_next_valid(a.lists, counts, w.b, w.h, row, t + 1, &tile)) {
        pipe_k.consumer_wait(read);
        pipe_v.consumer_wait(p_read);
        wait_turn();
        warpgroup_gemm_issue<true>(mma_qk, tSrQb, tSrK(_, _, _, read.index()), tSrS);
        warpgroup_gemm_issue<false>(mma_pv, tOrP, tOrV(_, _, _, p_read.index()), tOrO);
        pass_turn();
        warpgroup_wait<1>();
        warpgroup_fence_operand(tSrS);
        pipe_k.consumer_release(read);
        masked_softmax<T::kBlockN>(S, S_coord, tile, w, row, q0, a, scale_log2, row_max, row_sum, correction,
                                   ss.doc_kv[wg], wg);
        warpgroup_wait<0>();
        warpgroup_fence_operand(tOrO);
        pipe_v.consumer_release(p_read);
        CUTLASS_PRAGMA_UNROLL
        for (int i = 0; i < kRows; ++i) {
          CUTLASS_PRAGMA_UNROLL
          for (int j = 0; j < size<1>(O); ++j) O(i, j) *= correction[i];
        }
        convert_p(tSrS, rP);
        p_read = read_v;
        ++read;
        ++read_v;
      }
      cutlass::arch::ClusterBarrier::arrive(&ss.q_empty[buf]);  // every S of this q tile is computed
      ++q_loads;
      // The last tile's PV.
      pipe_v.consumer_wait(p_read);
      wait_turn();
      warpgroup_gemm_issue<false>(mma_pv, tOrP, tOrV(_, _, _, p_read.index()), tOrO);
      pass_turn();
      warpgroup_wait<0>();
      warpgroup_fence_operand(tOrO);
      pipe_v.consumer_release(p_read);
    }

    // Epilogue: normalise, write o (pairs of adjacent columns) and lse; rows past Sq are dropped.
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < kRows; ++i) {
      float sum = row_sum[i];
      sum += __shfl_xor_sync(0xffffffff, sum, 1);
      sum += __shfl_xor_sync(0xffffffff, sum, 2);
      const bool any = sum > 0.f;
      const float inv = any ? 1.f / sum : 0.f;
      const int q = q0 + get<0>(O_coord(i, 0));
      if (q >= a.seq_q) continue;
      Element* orow = out + ((int64_t(w.b) * a.seq_q + q) * a.heads_q + w.h) * T::kHeadDim;
      CUTLASS_PRAGMA_UNROLL
      for (int j = 0; j < size<1>(O); j += 2) {
        cutlass::Array<Element, 2> pair;
        pair[0] = Element(O(i, j) * inv);
        pair[1] = Element(O(i, j + 1) * inv);
        *reinterpret_cast<cutlass::Array<Element, 2>*>(orow + get<1>(O_coord(i, j))) = pair;
      }
      if ((tid & 3) == 0)
        a.lse[(int64_t(w.b) * a.heads_q + w.h) * a.seq_q + q] =
            any ? row_max[i] * a.scale + logf(sum) : -INFINITY;
    }
  }
  if (wg == 0) wait_turn();  // takes warpgroup 1's last hand-over: no arrival is left pending
}

template <class T>
__global__ void __launch_bounds__(T::kThreads, 1) fwd_kernel(CUTE_GRID_CONSTANT const typename T::Params p) {
  extern __shared__ __align__(1024) char smem[];
  auto& ss = *reinterpret_cast<typename T::SharedStorage*>(smem);
  const int warp = cutlass::canonical_warp_idx_sync();
  const int warpgroup = warp / 4;
  if (warp == 0 && cute::elect_one_sync()) {
    cute::prefetch_tma_descriptor(p.tma_q.get_tma_descriptor());
    cute::prefetch_tma_descriptor(p.tma_k.get_tma_descriptor());
    cute::prefetch_tma_descriptor(p.tma_v.get_tma_descriptor());
    for (int i = 0; i < T::kQBuffers; ++i) {
      cutlass::arch::ClusterTransactionBarrier::init(&ss.q_full[i], 1);
      cutlass::arch::ClusterBarrier::init(&ss.q_empty[i], T::kMmaThreads);
    }
  }
  // Producer threads: 0 loads q and K, 32 (the next warp) loads V.
  typename T::PipelineK::Params pk;
  pk.transaction_bytes = T::kKVBytes;
  pk.role = warpgroup == 0 ? T::PipelineK::ThreadCategory::Producer : T::PipelineK::ThreadCategory::Consumer;
  pk.is_leader = threadIdx.x == 0;
  pk.num_consumers = T::kMmaThreads;
  typename T::PipelineV::Params pv;
  pv.transaction_bytes = T::kKVBytes;
  pv.role = warpgroup == 0 ? T::PipelineV::ThreadCategory::Producer : T::PipelineV::ThreadCategory::Consumer;
  pv.is_leader = threadIdx.x == 32;
  pv.num_consumers = T::kMmaThreads;
  typename T::PipelineK pipe_k(ss.pipe_k, pk, Shape<_1, _1, _1>{});
  typename T::PipelineV pipe_v(ss.pipe_v, pv, Shape<_1, _1, _1>{});
  cutlass::arch::fence_barrier_init();
  __syncthreads();

  if (warpgroup == 0) {
    cutlass::arch::warpgroup_reg_dealloc<T::kProducerRegs>();
    if (threadIdx.x == 0 || threadIdx.x == 32) produce<T>(p, ss, pipe_k, pipe_v, threadIdx.x == 32);
  } else {
    cutlass::arch::warpgroup_reg_alloc<T::kConsumerRegs>();
    consume<T>(p, ss, pipe_k, pipe_v, int(threadIdx.x) - 128);
  }
}

template <FwdElement E, int HeadDim>
void run_fwd_sm90(const FwdArgs& a, void* stream) {
  using Element = std::conditional_t<E == FwdElement::kBF16, cutlass::bfloat16_t, cutlass::half_t>;
  using T = FwdTraits<Element, HeadDim>;
  auto tma = [&](const void* ptr, int32_t seq, int32_t heads, int64_t sb, int64_t ss, int64_t sh, auto smem_layout,
                 auto tile) {
    Tensor g = make_tensor(make_gmem_ptr(static_cast<Element const*>(ptr)),
                           make_shape(seq, int32_t(HeadDim), heads, a.batch), make_stride(ss, _1{}, sh, sb));
    return make_tma_copy(SM90_TMA_LOAD{}, g, smem_layout, tile, _1{});
  };
  using QTile = Shape<Int<T::kBlockM>, Int<HeadDim>>;
  using KVTile = Shape<Int<T::kBlockN>, Int<HeadDim>>;
  using KVStage = decltype(take<0, 2>(typename T::SmemLayoutK{}));
  typename T::Params p{
      a,
      tma(a.q, a.seq_q, a.heads_q, a.q_stride_b, a.q_stride_s, a.q_stride_h, typename T::SmemLayoutQ{}, QTile{}),
      tma(a.k, a.seq_kv, a.heads_kv, a.k_stride_b, a.k_stride_s, a.k_stride_h, KVStage{}, KVTile{}),
      tma(a.v, a.seq_kv, a.heads_kv, a.v_stride_b, a.v_stride_s, a.v_stride_h, KVStage{}, KVTile{}),
      float(a.scale * M_LOG2E)};
  constexpr int smem_bytes = int(sizeof(typename T::SharedStorage));
  opt_in_smem(fwd_kernel<T>, smem_bytes);
  fwd_kernel<T><<<a.grid, T::kThreads, smem_bytes, static_cast<cudaStream_t>(stream)>>>(p);
  check_cuda(cudaGetLastError(), "attention forward launch");
}

}  // namespace sparsetrain::cuda::attn

// One instantiation per translation unit (attention_fwd_sm90_instance.cu.in).
#define SPARSETRAIN_ATTN_FWD_INSTANTIATE(E, D) \
  template void run_fwd_sm90<E, D>(const FwdArgs& a, void* stream);

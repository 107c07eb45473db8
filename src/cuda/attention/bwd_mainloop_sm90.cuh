// The backward's mainloop: the loader (one producer thread: K and V once per item, then Q, dO, lse
// and delta per visit through the TMA pipeline) and the two consumer warpgroups (S^T, dP^T, P^T,
// dS^T, then dV, dQ and dK), with the in-tile mask of a transposed tile. attention_bwd_sm90.cuh
// describes the whole kernel.
#pragma once

#include <cmath>

#include "common/attention/mask_predicate.h"
#include "cuda/attention/bwd_epilogue_sm90.cuh"
#include "cuda/attention/bwd_traits_sm90.cuh"
#include "cuda/attention/mask_tile_sm90.cuh"
#include "cuda/pdl.cuh"

namespace sparsetrain::cuda::attn {

using namespace cute;

// ---- masking (the tile is transposed: rows are keys, columns q rows; mask_tile_sm90.cuh) ---------

// A bitmask mask on a partial visit of the transposed tile, from the backward's transposed copy of
// the block (BwdArgs::spec): each thread loads, for each of its keys, the key's word of each
// 32-row group of the q tile (4 words at 64-row tiles), the 4 lanes of a key row the same. Rows
// past Sq have no bits in the copy; a corrupt entry (bit_entry outside the width) gets none.
// (Loading the mask's rows instead, a lane a row, and spreading them with 16 ballots a group made
// a dilated-window mask_mod's backward 17 % slower.)
template <int M, class TS, class TC>
__device__ __forceinline__ void bwd_mask_bits(TS& s, TC const& coord, int q0, int kv0, const BwdArgs& a, int b, int h,
                                              int column, const BwdVisit& visit) {
  const KernelMaskSpec& m = a.spec;
  constexpr int kGroups = M / 32, kKeys = decltype(size<0>(s))::value;
  const bool ok = visit.bit_entry >= 0 && visit.bit_entry < m.bits_width;  // else a corrupt mask
  const uint32_t* block = reinterpret_cast<const uint32_t*>(bitmask_block(m, b, h, visit.q_block, visit.bit_entry));
  const int col0 = kv0 - column * a.block_kv, row0 = q0 - visit.q_block * a.block_q;
  uint32_t mine[kKeys][kGroups];
  CUTLASS_PRAGMA_UNROLL
  for (int ki = 0; ki < kKeys; ++ki) {
    const int key = col0 + int(get<0>(coord(ki, 0)));
    CUTLASS_PRAGMA_UNROLL
    for (int g = 0; g < kGroups; ++g)
      mine[ki][g] = ok ? __ldg(block + bitmask_word(key, row0 + 32 * g, a.block_q)) : 0u;
  }
  mask_key_words(s, coord, a.mask_seq_kv - kv0, mine);
}

template <int M, class TS, class TC>
__device__ __forceinline__ void mask_tile_t(TS& s, TC const& coord, int q0, int kv0, const BwdArgs& a, int b, int h,
                                            int column, const BwdVisit& visit, const int32_t* doc_q_tile) {
  const KernelMaskSpec& m = a.spec;
  if (m.kind == MaskKind::kBitmask) {
    bwd_mask_bits<M>(s, coord, q0, kv0, a, b, h, column, visit);
    return;
  }
  const TileMaskCoords t{q0, kv0, a.mask_seq_q, a.mask_seq_kv};  // mask positions
  // Document ids: the thread's keys (rows) in registers, queries from the visit's row of ids in
  // shared memory (doc_q_tile: loaded with lse and delta; read through L1 after the S GEMM, they
  // lengthened every partial visit). Offsets in int32 (the backend checks the id tensors fit): a
  // 64-bit row pointer, hoisted out of the visit loop, was the D = 128 consumers' one spill.
  constexpr int kKeys = decltype(size<0>(s))::value;
  int32_t dkv[kKeys];
  const bool docs = mask_has_documents(m.kind);
  if (docs) {
    const int32_t doc_kv0 = b * int32_t(m.doc_kv_stride_b);
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < kKeys; ++i) {
      const int kv = kv0 + get<0>(coord(i, 0));
      dkv[i] = kv < a.mask_seq_kv ? __ldg(m.doc_kv + (doc_kv0 + kv)) : INT32_MIN;
    }
  }
  mask_partial_tile<false>(
      s, coord, m, t, [&](int, int q) { return doc_q_tile[q - q0]; }, [&](int i, int) { return dkv[i]; });
}

template <class T>
__device__ void bwd_load(const typename T::Params& p, typename T::SharedStorage& ss, typename T::Pipeline& pipe) {
  const BwdArgs& a = p.args;
  Tensor sQ = make_tensor(make_smem_ptr(ss.q.data()), typename T::SmemLayoutQ{});
  Tensor sdO = make_tensor(make_smem_ptr(ss.dout.data()), typename T::SmemLayoutQ{});
  Tensor sK = make_tensor(make_smem_ptr(ss.k.data()), typename T::SmemLayoutK{});
  Tensor sV = make_tensor(make_smem_ptr(ss.v.data()), typename T::SmemLayoutV{});
  constexpr int D = T::kHeadDim;
  Tensor mQ = p.tma_q.get_tma_tensor(make_shape(a.seq_q, int32_t(D), a.heads_q, a.batch));
  Tensor mdO = p.tma_do.get_tma_tensor(make_shape(a.seq_q, int32_t(D), a.heads_q, a.batch));
  Tensor mK = p.tma_k.get_tma_tensor(make_shape(a.seq_kv, int32_t(D), a.heads_kv, a.batch));
  Tensor mV = p.tma_v.get_tma_tensor(make_shape(a.seq_kv, int32_t(D), a.heads_kv, a.batch));
  using QTile = Shape<Int<T::kBlockM>, Int<D>>;
  using KVTile = Shape<Int<T::kBlockN>, Int<D>>;
  const BwdTicketScheduler& sched = a.sched;
  auto write = cutlass::make_producer_start_state<typename T::Pipeline>();
  int32_t ticket = sched.initial_work();
  for (int n_item = 0;; ++n_item, ticket = sched.next_work(ticket)) {
    const int slot = n_item & 1;
    if (n_item >= 2) cutlass::arch::ClusterBarrier::wait(&ss.ticket_empty[slot], ((n_item - 2) >> 1) & 1);
    ss.ticket[slot] = ticket;
    cutlass::arch::ClusterBarrier::arrive(&ss.ticket_full[slot]);
    if (!sched.valid(ticket)) {
      pdl_launch_dependents();  // no more items here: the dQ conversion may be scheduled
      break;
    }
    const DqWorkItem w = sched.item(ticket);
    const int b = int(w.batch), hkv = int(w.kv_head), column = int(w.column);
    const int kv_tile = column * int(a.sched.handout.sub_tiles) + int(w.sub_tile);

    if (n_item >= 1) cutlass::arch::ClusterBarrier::wait(&ss.kv_empty, (n_item - 1) & 1);
    cutlass::arch::ClusterTransactionBarrier::arrive_and_expect_tx(&ss.kv_full, 2 * T::kKVBytes);
    // The boxes start at the tile's first token (padded documents: its first real row; a tile of
    // padding only has no visits and loads from row 0). Rows past the tile's real ones are other
    // tokens, which the padded ids mask.
    const int32_t kv_start = max(bwd_real_key(a, b, kv_tile * T::kBlockN), 0);
    Tensor gK = local_tile(domain_offset(make_coord(kv_start, 0), mK(_, _, hkv, b)), KVTile{}, make_coord(0, 0));
    Tensor gV = local_tile(domain_offset(make_coord(kv_start, 0), mV(_, _, hkv, b)), KVTile{}, make_coord(0, 0));
    auto [tKgK, tKsK] = tma_partition(p.tma_k, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sK), group_modes<0, 2>(gK));
    auto [tVgV, tVsV] = tma_partition(p.tma_v, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sV), group_modes<0, 2>(gV));
    copy(p.tma_k.with(ss.kv_full), tKgK, tKsK);
    copy(p.tma_v.with(ss.kv_full), tVgV, tVsV);

    BwdItemCursor cur = bwd_item_begin(a.lists, b, hkv, a.group, column);
    BwdVisit visit;
    while (bwd_item_next</*kFields=*/0>(a.lists, b, column, cur, &visit)) {
      const int h = visit.q_head;
      const int32_t q_start = max(bwd_real_row(a, b, visit.q_tile * T::kBlockM), 0);
      Tensor gQ = local_tile(domain_offset(make_coord(q_start, 0), mQ(_, _, h, b)), QTile{}, make_coord(0, 0));  // (64, D)
      Tensor gdO = local_tile(domain_offset(make_coord(q_start, 0), mdO(_, _, h, b)), QTile{}, make_coord(0, 0));
      auto [tQgQ, tQsQ] =
          tma_partition(p.tma_q, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sQ), group_modes<0, 2>(gQ));
      auto [tdOgdO, tdOsdO] =
          tma_partition(p.tma_do, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sdO), group_modes<0, 2>(gdO));
      pipe.producer_acquire(write);
      uint64_t* bar = pipe.producer_get_barrier(write);
      const int st = write.index();
      copy(p.tma_q.with(*bar, 0), tQgQ, tQsQ(_, st));
      copy(p.tma_do.with(*bar, 0), tdOgdO, tdOsdO(_, st));
      // Tile indices in int32 (B * Hq * q tiles < 2^31: the backend checks it), rows in int64:
      // 64-bit index math spilled this thread's 24 registers at 128-row q tiles.
      const int32_t tile = int32_t(bwd_q_tile_index(b, h, a.heads_q, a.lists.num_q_tiles, visit.q_tile));
      SM90_BULK_COPY_G2S::copy(a.lse_log2 + int64_t(tile) * T::kBlockM, bar, ss.lse[st], int32_t(T::kRowBytes));
      SM90_BULK_COPY_G2S::copy(a.delta + int64_t(tile) * T::kBlockM, bar, ss.delta[st], int32_t(T::kRowBytes));
      if (a.doc_q_rows != nullptr)
        SM90_BULK_COPY_G2S::copy(a.doc_q_rows + int64_t(b * a.lists.num_q_tiles + visit.q_tile) * T::kBlockM, bar,
                                 ss.doc_q[st], int32_t(T::kRowBytes));
      ++write;
    }
  }
}

template <class T>
__device__ void bwd_compute(const typename T::Params& p, typename T::SharedStorage& ss, typename T::Pipeline& pipe,
                            int tid) {
  using Element = typename T::Element;
  constexpr int M = T::kBlockM, N = T::kBlockN, D = T::kHeadDim;
  const BwdArgs& a = p.args;
  Tensor sQ = make_tensor(make_smem_ptr(ss.q.data()), typename T::SmemLayoutQ{});
  Tensor sdO = make_tensor(make_smem_ptr(ss.dout.data()), typename T::SmemLayoutQ{});
  Tensor sQt = make_tensor(make_smem_ptr(ss.q.data()), typename T::SmemLayoutQt{});
  Tensor sdOt = make_tensor(make_smem_ptr(ss.dout.data()), typename T::SmemLayoutQt{});
  Tensor sK = make_tensor(make_smem_ptr(ss.k.data()), typename T::SmemLayoutK{});
  Tensor sKt = make_tensor(make_smem_ptr(ss.k.data()), typename T::SmemLayoutKt{});
  Tensor sV = make_tensor(make_smem_ptr(ss.v.data()), typename T::SmemLayoutV{});
  Tensor sdS = make_tensor(make_smem_ptr(ss.ds.data()), typename T::SmemLayoutDs{});

  typename T::MmaSdP mma_sdp;
  typename T::MmaDkv mma_dkv;
  typename T::MmaDq mma_dq;
  auto thr_sdp = mma_sdp.get_thread_slice(tid);
  auto thr_dkv = mma_dkv.get_thread_slice(tid);
  auto thr_dq = mma_dq.get_thread_slice(tid);
  // S^T and dP^T.
  Tensor tSrK = thr_sdp.partition_fragment_A(sK);     // (MMA, keys, D)
  Tensor tSrQ = thr_sdp.partition_fragment_B(sQ);     // (MMA, q, D, stage)
  Tensor tPrV = thr_sdp.partition_fragment_A(sV);
  Tensor tPrdO = thr_sdp.partition_fragment_B(sdO);
  Tensor tSrS = partition_fragment_C(mma_sdp, Shape<Int<N>, Int<M>>{});
  Tensor tPrP = partition_fragment_C(mma_sdp, Shape<Int<N>, Int<M>>{});
  Tensor tScS = thr_sdp.partition_C(make_identity_tensor(Shape<Int<N>, Int<M>>{}));
  Tensor S = make_tensor(tSrS.data(), acc_rowcol(tSrS.layout()));  // (keys, q) of this thread
  Tensor dP = make_tensor(tPrP.data(), acc_rowcol(tPrP.layout()));
  Tensor S_coord = make_tensor(tScS.data(), acc_rowcol(tScS.layout()));
  // dV and dK.
  Tensor tdVrdO = thr_dkv.partition_fragment_B(sdOt);  // (MMA, D, q, stage)
  Tensor tdKrQ = thr_dkv.partition_fragment_B(sQt);
  Tensor tdVrdV = partition_fragment_C(mma_dkv, Shape<Int<N>, Int<D>>{});
  Tensor tdKrdK = partition_fragment_C(mma_dkv, Shape<Int<N>, Int<D>>{});
  Tensor rP = make_tensor_like<Element>(tSrS);
  Tensor rdS = make_tensor_like<Element>(tSrS);
  Tensor tdVrP = make_tensor(rP.data(), acc_as_a_operand(rP.layout()));
  Tensor tdKrdS = make_tensor(rdS.data(), acc_as_a_operand(rdS.layout()));
  // dQ.
  Tensor tdQrdS = thr_dq.partition_fragment_A(sdS);  // (MMA, q, keys, buffer)
  Tensor tdQrK = thr_dq.partition_fragment_B(sKt);   // (MMA, D half, keys)
  Tensor tdQrdQ = partition_fragment_C(mma_dq, Shape<Int<M>, Int<D>>{});
  Tensor sdSt = make_tensor(make_smem_ptr(ss.ds.data()), typename T::SmemLayoutDsT{});
  typename T::SmemCopyDs copy_ds;
  auto thr_copy_ds = copy_ds.get_thread_slice(tid);
  Tensor tdSsdS = thr_copy_ds.partition_D(sdSt);
  Tensor tdSrdS = thr_copy_ds.retile_S(rdS);

  const float scale_log2 = p.scale_log2;
  const BwdTicketScheduler& sched = a.sched;
  cutlass::PipelineState<T::kStages> read;
  int n_dq = 0;  // visits so far: each makes one dQ partial (and takes the next dS buffer)
  // A tile's dQ partial, from registers to shared memory for its writer thread, while the tile's
  // dK GEMM runs. (Deferring it past the next tile's first GEMMs runs out of registers: ptxas
  // then serialises.)
  auto write_dq = [&] {
    const int buf = n_dq % T::kDqBuffers;
    if (n_dq >= T::kDqBuffers)  // the writer has read the buffer's previous partial
      cutlass::arch::ClusterBarrier::wait(&ss.dq_empty[buf], (n_dq / T::kDqBuffers - 1) & 1);
    float* out = ss.dq.data() + buf * (M * D);
    static_assert(decltype(size(tdQrdQ))::value % 4 == 0, "dQ fragments go out as float4");
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < size(tdQrdQ); i += 4)
      *reinterpret_cast<float4*>(out + dq_fragment_offset<T>(tid, i)) =
          make_float4(tdQrdQ(i), tdQrdQ(i + 1), tdQrdQ(i + 2), tdQrdQ(i + 3));
    cutlass::arch::fence_view_async_shared();
    cutlass::arch::ClusterBarrier::arrive(&ss.dq_full[buf]);
    ++n_dq;
  };
  for (int n_item = 0;; ++n_item) {
    const int32_t ticket = read_ticket<T>(ss, n_item);
    if (!sched.valid(ticket)) break;
    const DqWorkItem w = sched.item(ticket);
    const int b = int(w.batch), hkv = int(w.kv_head), column = int(w.column);
    const int kv0 = (column * int(a.sched.handout.sub_tiles) + int(w.sub_tile)) * N;
    const bool crosses_end = kv0 + N > a.mask_seq_kv;
    clear(tdVrdV);
    clear(tdKrdK);
    cutlass::arch::ClusterBarrier::wait(&ss.kv_full, n_item & 1);
    // dK and dV sum the visits in walk order: a function of the schedule, never of the grid.
    BwdItemCursor cur = bwd_item_begin(a.lists, b, hkv, a.group, column);
    // The visit copied out of the walk's output, the walk at the loop's end: the plain
    // `while (bwd_item_next(..., &visit))` form spills 144 bytes at 128-row q tiles (ptxas).
    BwdVisit next;
    bool have = bwd_item_next<kVisitBitEntry>(a.lists, b, column, cur, &next);
    while (have) {
      const BwdVisit visit = next;
      const int h = visit.q_head;
      const int st = read.index();
      const int q0 = visit.q_tile * M;
      pipe.consumer_wait(read);
      warpgroup_gemm_issue<true>(mma_sdp, tSrK, tSrQ(_, _, _, st), tSrS);
      warpgroup_gemm_issue<true>(mma_sdp, tPrV, tPrdO(_, _, _, st), tPrP);
      warpgroup_wait<1>();
      warpgroup_fence_operand(tSrS);
      if (visit.partial) {
        mask_tile_t<M>(S, S_coord, q0, kv0, a, b, h, column, visit, ss.doc_q[st]);
      } else if (crosses_end) {
        mask_seq_kv<false>(S, S_coord, kv0, a.seq_kv);
      }
      CUTLASS_PRAGMA_UNROLL
      for (int j = 0; j < size<1>(S); ++j) {
        const float lse = ss.lse[st][get<1>(S_coord(0, j))];
        CUTLASS_PRAGMA_UNROLL
        for (int i = 0; i < size<0>(S); ++i)
          S(i, j) = S(i, j) == -INFINITY ? 0.f : fast_exp2(S(i, j) * scale_log2 - lse);
      }
      warpgroup_wait<0>();
      warpgroup_fence_operand(tPrP);
      CUTLASS_PRAGMA_UNROLL
      for (int j = 0; j < size<1>(dP); ++j) {
        const float delta = ss.delta[st][get<1>(S_coord(0, j))];
        CUTLASS_PRAGMA_UNROLL
        for (int i = 0; i < size<0>(dP); ++i) dP(i, j) = S(i, j) * (dP(i, j) - delta);
      }
      convert_p(tSrS, rP);
      convert_p(tPrP, rdS);
      // dS^T -> dS in shared memory (q contiguous): both warpgroups' halves are needed by each
      // one's dQ GEMM. dV += P^T dO runs while the warpgroups meet at the barrier.
      const int buf = n_dq % T::kDsBuffers;
      // One dS buffer: both warpgroups' dQ GEMMs of the last visit (each waited for its own) are
      // done with it once they meet here.
      if constexpr (T::kDsBuffers == 1) cutlass::arch::NamedBarrier::sync(T::kMmaThreads, 1);
      copy(copy_ds, tdSrdS, tdSsdS(_, _, _, buf));
      warpgroup_gemm_issue<false>(mma_dkv, tdVrP, tdVrdO(_, _, _, st), tdVrdV);
      cutlass::arch::fence_view_async_shared();
      cutlass::arch::NamedBarrier::sync(T::kMmaThreads, 1);
      warpgroup_gemm_issue<true>(mma_dq, tdQrdS(_, _, _, buf), tdQrK, tdQrdQ);
      warpgroup_gemm_issue<false>(mma_dkv, tdKrdS, tdKrQ(_, _, _, st), tdKrdK);
      warpgroup_wait<1>();  // dV and dQ done: dQ goes to shared memory while dK += dS^T Q runs
      warpgroup_fence_operand(tdQrdQ);
      write_dq();
      warpgroup_wait<0>();
      warpgroup_fence_operand(tdVrdV);
      warpgroup_fence_operand(tdKrdK);
      pipe.consumer_release(read);
      ++read;
      // The next visit's walk. (Under this visit's S^T / dP^T GEMMs instead it gained 0.5-1.6 % at
      // D = 64 with 64-row q tiles; no registers for it at 128-row tiles or D = 128.)
      have = bwd_item_next<kVisitBitEntry>(a.lists, b, column, cur, &next);
    }
    // dK and dV leave through K's and V's shared memory, once both warpgroups' last GEMMs are done
    // with them (each dQ GEMM reads every key of K); the loader refills them once stored.
    cutlass::arch::NamedBarrier::sync(T::kMmaThreads, 1);
    bwd_stage_dkdv<T>(a.scale, tid, tdKrdK, tdVrdV, sK, sV);
    cutlass::arch::fence_view_async_shared();  // the matrix stores, visible to the TMA unit
    cutlass::arch::NamedBarrier::sync(T::kMmaThreads, 1);
    // A kv tile's real keys come first. All real: one TMA store at the first; some: padded, row by
    // row (a box would overwrite the next document's rows), unpadded, the box (the TMA unit clips
    // it at seq_kv); none (padding, or a sub-tile past seq_kv): nothing.
    const int32_t first = bwd_real_key(a, b, kv0), last = bwd_real_key(a, b, kv0 + N - 1);
    if (last >= 0 || (a.real_rows == nullptr && first >= 0)) {
      if (tid == 0) {
        bwd_store_dkdv<T>(p, b, hkv, first, sK, sV);
        cutlass::arch::ClusterBarrier::arrive(&ss.kv_empty);
      }
    } else {
      if (first >= 0) bwd_store_dkdv_rows<T>(a, b, hkv, kv0, tid, sK, sV);
      cutlass::arch::NamedBarrier::sync(T::kMmaThreads, 1);  // every row has read shared memory
      if (tid == 0) cutlass::arch::ClusterBarrier::arrive(&ss.kv_empty);
    }
  }
}

}  // namespace sparsetrain::cuda::attn

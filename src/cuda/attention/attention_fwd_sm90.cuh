// Block-sparse attention forward for sm_90a: a persistent, warp-specialised CuTe kernel in the
// shape of FlashAttention-3's, composed of
//
//   scheduler  FwdTicketScheduler (tile_scheduler.h): work items (batch, query head, 128-row q
//              tile) in L2 sections of heads, longest first inside each (ordered on the device);
//              CTA c starts with position c and draws the next from an atomic counter; the q/K
//              producer draws and passes the items to the other roles (item_ring_sm90.cuh)
//   mainloop   fwd_mainloop_sm90.cuh (over fwd_traits_sm90.cuh): TMA producer, two wgmma
//              consumer warpgroups (64 query rows each) with the mask (mask_tile_sm90.cuh) and
//              online softmax (softmax_sm90.cuh)
//   epilogue   fwd_epilogue_sm90.cuh: o through shared memory and a TMA store, lse from registers
//
// The consumers' software pipeline runs across work items, not only across the tiles of one:
// each step issues tile j's S = Q K^T together with tile j - 1's O += P V, and runs tile j's
// softmax while the PV GEMM is in flight. At an item boundary the step issues the *next* item's
// first S with the current item's last PV, so the next item's first softmax overlaps that PV and
// only the epilogue's stores stand between two items' GEMMs: short rows (short documents, narrow
// windows, short sequences: 2-10 kv tiles a row) pay no pipeline fill or drain per item.
// Each item's record (its walk counts) is loaded one item ahead, and the first entry of its walk
// is prefetched into L1, so an item boundary waits on no global memory round trip.
//
// The mask kind is a runtime switch (one branch per partial tile), so one instantiation serves
// every built-in spec and the per-block bitmasks. Rows past Sq and columns past Skv of the last
// tiles are zero-filled by TMA and masked; rows with no allowed key give o = 0, lse = -inf.
#pragma once

#include <cuda_runtime.h>

#include <cmath>

#include "common/attention/mask_predicate.h"
#include "cuda/attention/fwd_epilogue_sm90.cuh"
#include "cuda/attention/fwd_mainloop_sm90.cuh"
#include "cuda/pdl.cuh"

namespace sparsetrain::cuda::attn {

using namespace cute;

__device__ __forceinline__ void prefetch_l1(const void* p) { asm volatile("prefetch.global.L1 [%0];" ::"l"(p)); }

// threadIdx.x read where it is used: a volatile read cannot be hoisted out of the loop, so values
// derived from it (fragment coordinates, the warpgroup) are recomputed instead of held, which
// would cost the consumers registers that ptxas then spills.
__device__ __forceinline__ int thread_index() {
  int t;
  asm volatile("mov.u32 %0, %%tid.x;" : "=r"(t));
  return t;
}

// Named barriers of the consumers (ids past CUTLASS's reserved ones): 0 and 1 the ping-pong turns
// (FwdTraits::kPingPong), 2 + warpgroup a partial tile's key document ids, kOStageBarrier the
// staging of o for its TMA store (both warpgroups).
constexpr uint32_t kOStageBarrier = 4;

// One work item's walk, as the consumers follow it (kept small: it lives in registers beside the
// accumulators).
struct FwdItem {
  int32_t b, h, row, q0;
  WalkCounts counts;
};

__device__ __forceinline__ FwdItem fwd_item(const FwdArgs& a, const FwdWorkRecord& rec, int tile_q) {
  const FwdWorkItem w = fwd_work_item(rec.item, a.heads_q, a.q_tiles);
  return {w.b, w.h, fwd_mask_row(w.q_tile, tile_q, a.lists.block_q), w.q_tile * tile_q, {rec.partial, rec.full}};
}

template <class T>
__device__ __forceinline__ void fwd_consume(const typename T::Params& p, typename T::SharedStorage& ss,
                                            typename T::PipelineK& pipe_k, typename T::PipelineV& pipe_v) {
  using Element = typename T::Element;
  const FwdArgs& a = p.args;
  Tensor sQ = make_tensor(make_smem_ptr(ss.q.data()), typename T::SmemLayoutQs{});
  Tensor sK = make_tensor(make_smem_ptr(ss.k.data()), typename T::SmemLayoutK{});
  Tensor sVt = make_tensor(make_smem_ptr(ss.v.data()), typename T::SmemLayoutVt{});
  typename T::MmaQK mma_qk;
  typename T::MmaPV mma_pv;
  // The shared-memory operands' descriptors depend only on the warpgroup: sliced for its first
  // thread through a shuffle ptxas knows is warp-uniform, they live in uniform registers, so an
  // HGMMA's issue needs no moves from per-thread registers (R2UR).
  const int wg_thread0 = (cutlass::canonical_warp_group_idx() - 1) * 128;
  auto thr_qk = mma_qk.get_thread_slice(wg_thread0);
  auto thr_pv = mma_pv.get_thread_slice(wg_thread0);
  Tensor tSrQ = thr_qk.partition_fragment_A(sQ);   // descriptors (MMA, M, K, buffer)
  Tensor tSrK = thr_qk.partition_fragment_B(sK);   // (MMA, N, K, stage)
  Tensor tOrV = thr_pv.partition_fragment_B(sVt);  // (MMA, D, N, stage)
  Tensor tSrS = partition_fragment_C(mma_qk, Shape<Int<T::kBlockM>, Int<T::kBlockN>>{});
  Tensor tOrO = partition_fragment_C(mma_pv, Shape<Int<T::kBlockM>, Int<T::kHeadDim>>{});
  // The (row, column) each accumulator element stands for, rebuilt where used (thread_index).
  auto s_coord = [&] {
    Tensor c = mma_qk.get_thread_slice(thread_index() - 128)
                   .partition_C(make_identity_tensor(Shape<Int<T::kBlockM>, Int<T::kBlockN>>{}));
    return make_tensor(c.data(), acc_rowcol(c.layout()));
  };
  auto o_coord_of = [&](int thread) {
    Tensor c = mma_pv.get_thread_slice(thread).partition_C(
        make_identity_tensor(Shape<Int<T::kBlockM>, Int<T::kHeadDim>>{}));
    return make_tensor(c.data(), acc_rowcol(c.layout()));
  };
  auto o_coord = [&] { return o_coord_of(thread_index() - 128); };
  const auto o_coord0 = o_coord_of(0);  // compile-time columns (fwd_store_empty)
  auto k_state = [](uint32_t i) {
    return cutlass::PipelineState<T::kStagesK>(i % T::kStagesK, (i / T::kStagesK) & 1, i);
  };
  auto v_state = [](uint32_t i) {
    return cutlass::PipelineState<T::kStagesV>(i % T::kStagesV, (i / T::kStagesV) & 1, i);
  };

  Tensor S = make_tensor(tSrS.data(), acc_rowcol(tSrS.layout()));
  Tensor O = make_tensor(tOrO.data(), acc_rowcol(tOrO.layout()));
  constexpr int kRows = decltype(size<0>(S))::value;  // 2 rows per thread
  Tensor rP = make_tensor_like<Element>(tSrS);
  Tensor tOrP = make_tensor(rP.data(), acc_as_a_operand(rP.layout()));

  // An item's o and lse, once its last PV GEMM (on V tile `v_tile`) has completed in this
  // warpgroup: o is staged in that tile's V stage, which both warpgroups' PV GEMMs read (hence the
  // first barrier), then one TMA store writes the [kBlockM, D] tile (rows past Sq clipped) and the
  // stage goes back to the V producer once the store has read it. Against o stored from the
  // registers in 4-byte pairs: 0.4-2.6 % faster on every bench class.
  Tensor sV = make_tensor(make_smem_ptr(ss.v.data()), typename T::SmemLayoutV{});
  auto store_o = [&](int32_t b, int32_t h, int32_t q0, const OnlineSoftmax<kRows>& done, uint32_t v_tile) {
    const int stage = v_state(v_tile).index();
    cutlass::arch::NamedBarrier::sync(T::kMmaThreads, kOStageBarrier);
    Tensor sO = sV(_, _, stage);
    fwd_stage_o<Element>(a, b, h, q0, mma_pv, thread_index() - 128, tOrO, o_coord(), sO, done.row_max, done.row_sum);
    cutlass::arch::fence_view_async_shared();  // the stores, visible to the TMA unit
    cutlass::arch::NamedBarrier::sync(T::kMmaThreads, kOStageBarrier);
    if (thread_index() == 128) {
      Tensor mO = p.tma_o.get_tma_tensor(make_shape(a.seq_q, int32_t(T::kHeadDim), a.heads_q, a.batch));
      Tensor gO = local_tile(mO(_, _, h, b), Shape<Int<T::kBlockM>, Int<T::kHeadDim>>{}, make_coord(_, 0));
      auto [tOgO, tOsO] = tma_partition(p.tma_o, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sV), group_modes<0, 2>(gO));
      copy(p.tma_o, tOsO(_, stage), tOgO(_, q0 / T::kBlockM));
      tma_store_arrive();
      tma_store_wait<0>();  // the stage has been read
    }
    pipe_v.consumer_release(v_state(v_tile));
  };

  const float scale_log2 = p.scale_log2;
  const bool docs = mask_has_documents(a.spec.kind);
  // Read from threadIdx where used (ptxas spilled them when kept in registers).
  auto wg = [] { return (thread_index() - 128) / 128; };
  auto lane = [] { return int(threadIdx.x) % 128; };
  // Ping-pong (the two consumer warpgroups taking turns to issue their GEMMs through named
  // barriers 0 and 1, FlashAttention-3's inter-warpgroup overlap) is off (FwdTraits::kPingPong):
  // 1-4 % slower even spill-free (docs/PERF.md). Turned on as written here, the consumers spill:
  // the barriers under `wg() == 1` (threadIdx, not provably warp-uniform) move the walk out of the
  // uniform datapath; the spill-free form (ids from canonical_warp_group_idx, 240 / 24 registers)
  // is the patch PERF names. Both warpgroups take the same number of turns when it is on (they
  // walk the same items).
  auto wait_turn = [&] {
    if constexpr (T::kPingPong) cutlass::arch::NamedBarrier::sync(T::kMmaThreads, wg());
  };
  auto pass_turn = [&] {
    if constexpr (T::kPingPong) cutlass::arch::NamedBarrier::arrive(T::kMmaThreads, 1 - wg());
  };
  if (wg() == 1) pass_turn();

  // Document ids of a partial tile, loaded before its GEMMs are issued (the loads overlap them):
  // this thread's query rows, and one key id per thread, staged in shared memory for the whole
  // warpgroup's mask (named barrier 2 + wg). Nothing is held across tiles: registers are scarce
  // beside S, P and O.
  struct TileDocs {
    int32_t q[kRows], kv;
  };
  auto load_docs = [&](const FwdItem& c, const WalkTile& tile) {
    TileDocs d{};
    if (!docs || !tile.partial) return d;
    const int32_t* doc_q = a.spec.doc_q + c.b * a.spec.doc_q_stride_b;
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < kRows; ++i) {
      const int q = c.q0 + get<0>(s_coord()(i, 0));
      d.q[i] = q < a.seq_q ? __ldg(doc_q + q) : 0;
    }
    const int kv = tile.tile * T::kBlockN + lane();
    d.kv = kv < a.seq_kv ? __ldg(a.spec.doc_kv + c.b * a.spec.doc_kv_stride_b + kv) : INT32_MIN;
    return d;
  };
  // After S of a tile is in registers: the mask (partial tiles; the Skv bound of a full tile that
  // crosses it), then the online softmax (P in place of S).
  float correction[kRows];
  auto softmax_tile = [&](const FwdItem& c, const WalkTile& tile, const TileDocs& d, OnlineSoftmax<kRows>& sm) {
    const int kv0 = tile.tile * T::kBlockN;
    if (tile.partial) {
      if (docs) {
        cutlass::arch::NamedBarrier::sync(128, 2 + wg());  // the previous partial tile's reads are done
        ss.doc_kv[wg()][lane()] = d.kv;
        cutlass::arch::NamedBarrier::sync(128, 2 + wg());
      }
      TileMaskCoords tc{c.q0, kv0, a.seq_q, a.seq_kv};
      if (a.spec.kind == MaskKind::kBitmask) {
        const KernelMaskSpec& m = a.spec;
        tc.block_bits = bitmask_block(m, c.b, c.h, c.row, tile.entry);
        tc.block_row0 = c.row * a.lists.block_q;
        tc.block_col = kv0 - sub_tile_block(a.lists, tile.tile) * m.block_kv;
        tc.bits_ok = tile.entry < m.bits_width;
      }
      mask_partial_tile<true>(
          S, s_coord(), a.spec, tc, [&](int i, int) { return d.q[i]; }, [&](int, int col) { return ss.doc_kv[wg()][col]; });
    } else if (kv0 + T::kBlockN > a.seq_kv) {
      mask_seq_kv<true>(S, s_coord(), kv0, a.seq_kv);
    }
    return sm.update(S, scale_log2, correction);
  };

  // The items, one record ahead: `it` indexes rec_next, the next item to start (taken from the
  // ring the q/K producer fills: item_ring_sm90.cuh).
  const FwdTicketScheduler sched{a.records, a.num_items, a.ticket};
  uint32_t taken = 0;
  int it = ss.items.get(taken++);
  FwdWorkRecord rec_next = sched.valid(it) ? a.records[it] : FwdWorkRecord{};
  OnlineSoftmax<kRows> sm, sm_done;
  sm.reset();
  // The next item with a valid tile into c (its first tile in tile / t); items without one get
  // their epilogue (o = 0, lse = -inf) on the way. False when none is left, and c untouched: the
  // caller still stores the item it holds (empty items sort last, so a CTA's walk often ends
  // with some).
  auto next_nonempty = [&](FwdItem& c, WalkTile& tile, int& t) {
    while (sched.valid(it)) {
      const FwdItem n = fwd_item(a, rec_next, T::kBlockM);
      it = ss.items.get(taken++);
      rec_next = sched.valid(it) ? a.records[it] : FwdWorkRecord{};  // in flight while n runs
      t = walk_next_valid(a.lists, n.counts, n.b, n.h, n.row, 0, &tile);
      if (t < walk_length(a.lists, n.counts)) {
        c = n;
        return true;
      }
      fwd_store_empty<Element, T::kHeadDim>(a, n.b, n.h, n.q0, o_coord(), o_coord0);
    }
    return false;
  };
  // The first entry of the next item's walk into L1 (once its record has arrived).
  auto prefetch_next_walk = [&] {
    if (!sched.valid(it)) return;
    const FwdItem n = fwd_item(a, rec_next, T::kBlockM);
    const MaskIndexView& idx = n.counts.partial > 0 ? a.lists.partial_index : a.lists.full_index;
    if (walk_length(a.lists, n.counts) > 0) prefetch_l1(idx.row_in<int32_t>(n.b, n.h, n.row));
  };

  // Pipeline positions from one counter (fewer live registers than three PipelineStates): tile n
  // (counted over the CTA's whole walk) sits in K stage n % 2 and V stage n % 3.
  uint32_t n = 0;  // the tile whose S comes next; n - 1 is the tile whose P is pending
  int q_loads = 0;  // q tiles consumed: the q buffer and its phase
  FwdItem cur;
  WalkTile tile{};
  int t = 0;
  if (next_nonempty(cur, tile, t)) {
    // The first item's first tile: S only.
    auto buf = [&] { return q_loads % T::kQBuffers; };  // the current item's q buffer
    TileDocs docs_now = load_docs(cur, tile);
    cutlass::arch::ClusterBarrier::wait(&ss.q_full[buf()], (q_loads / T::kQBuffers) & 1);
    pipe_k.consumer_wait(k_state(n));
    wait_turn();
    warpgroup_gemm_issue<true>(mma_qk, tSrQ(_, _, _, buf()), tSrK(_, _, _, k_state(n).index()), tSrS);
    pass_turn();
    warpgroup_wait<0>();
    warpgroup_fence_operand(tSrS);
    pipe_k.consumer_release(k_state(n));
    softmax_tile(cur, tile, docs_now, sm);
    prefetch_next_walk();
    convert_p(tSrS, rP);
    ++n;
    bool pv_first = true;  // the pending PV is its item's first: it overwrites O

    // The walk runs one tile ahead of the GEMMs: the next tile's entry (a global load, a
    // division by sub_tiles and the validity test) is looked up while this step's S is computed,
    // not before its GEMMs are issued (ncu: ~15 % of the consumers' stall samples sat there).
    WalkTile tile_next;
    int t_next = walk_next_valid(a.lists, cur.counts, cur.b, cur.h, cur.row, t + 1, &tile_next);

    // Steady state: one step per tile, across items. No wgmma sits on a divergent path (ptxas
    // would serialise them all): the boundary work is outside the issue sequence.
    for (;;) {
      const bool boundary = t_next >= walk_length(a.lists, cur.counts);
      t = t_next;
      tile = tile_next;
      int32_t done_b = cur.b, done_h = cur.h, done_q0 = cur.q0;  // the item an epilogue in this step stores
      if (boundary) {
        cutlass::arch::ClusterBarrier::arrive(&ss.q_empty[buf()]);  // every S of cur is computed and masked
        ++q_loads;
        if (!next_nonempty(cur, tile, t)) break;
      }
      docs_now = load_docs(cur, tile);
      if (boundary) cutlass::arch::ClusterBarrier::wait(&ss.q_full[buf()], (q_loads / T::kQBuffers) & 1);
      pipe_k.consumer_wait(k_state(n));
      pipe_v.consumer_wait(v_state(n - 1));
      wait_turn();
      warpgroup_gemm_issue<true>(mma_qk, tSrQ(_, _, _, buf()), tSrK(_, _, _, k_state(n).index()), tSrS);
      warpgroup_gemm_issue(mma_pv, tOrP, tOrV(_, _, _, v_state(n - 1).index()), tOrO, pv_first);
      pass_turn();
      t_next = walk_next_valid(a.lists, cur.counts, cur.b, cur.h, cur.row, t + 1, &tile_next);
      warpgroup_wait<1>();
      warpgroup_fence_operand(tSrS);
      pipe_k.consumer_release(k_state(n));
      if (boundary) {
        sm_done = sm;
        sm.reset();
      }
      const bool rescale = softmax_tile(cur, tile, docs_now, sm);
      if (boundary) prefetch_next_walk();
      warpgroup_wait<0>();
      warpgroup_fence_operand(tOrO);
      if (!boundary) pipe_v.consumer_release(v_state(n - 1));  // at a boundary: after the epilogue
      convert_p(tSrS, rP);  // before the epilogue / rescale: S's registers are free for them
      if (boundary) {
        sm_done.reduce_sums();
        store_o(done_b, done_h, done_q0, sm_done, n - 1);
        pv_first = true;
      } else {
        if (rescale) {
          CUTLASS_PRAGMA_UNROLL
          for (int i = 0; i < kRows; ++i) {
            CUTLASS_PRAGMA_UNROLL
            for (int j = 0; j < size<1>(O); ++j) O(i, j) *= correction[i];
          }
        }
        pv_first = false;
      }
      ++n;
    }
    // The last item's last PV, then its epilogue.
    pipe_v.consumer_wait(v_state(n - 1));
    wait_turn();
    warpgroup_gemm_issue(mma_pv, tOrP, tOrV(_, _, _, v_state(n - 1).index()), tOrO, pv_first);
    pass_turn();
    warpgroup_wait<0>();
    warpgroup_fence_operand(tOrO);
    sm.reduce_sums();
    store_o(cur.b, cur.h, cur.q0, sm, n - 1);
  }
  if (wg() == 0) wait_turn();  // takes warpgroup 1's last hand-over: no arrival is left pending
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
    ss.items.init(T::kItemReaders);
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
  // Launched as a dependent of the work-order sort (cuda/pdl.cuh): set up so far, now its records
  // and zeroed ticket counter.
  pdl_wait();

  if (warpgroup == 0) {
    cutlass::arch::warpgroup_reg_dealloc<T::kProducerRegs>();
    if (threadIdx.x == 0) {
      fwd_produce<T, false>(p, ss, pipe_k, pipe_v);
    } else if (threadIdx.x == 32) {
      fwd_produce<T, true>(p, ss, pipe_k, pipe_v);
    }
  } else {
    cutlass::arch::warpgroup_reg_alloc<T::kConsumerRegs>();
    fwd_consume<T>(p, ss, pipe_k, pipe_v);
  }
}

template <class T>
void launch_fwd_sm90(const FwdArgs& a, void* stream) {
  using Element = typename T::Element;
  constexpr int HeadDim = T::kHeadDim;
  auto tma = [&](const void* ptr, int32_t seq, int32_t heads, int64_t sb, int64_t ss, int64_t sh, auto smem_layout,
                 auto tile) {
    Tensor g = make_tensor(make_gmem_ptr(static_cast<Element const*>(ptr)),
                           make_shape(seq, int32_t(HeadDim), heads, a.batch), make_stride(ss, _1{}, sh, sb));
    return make_tma_copy(SM90_TMA_LOAD{}, g, smem_layout, tile, _1{});
  };
  using QTile = Shape<Int<T::kBlockM>, Int<HeadDim>>;
  using KVTile = Shape<Int<T::kBlockN>, Int<HeadDim>>;
  using KVStage = decltype(take<0, 2>(typename T::SmemLayoutK{}));
  // o: [B, Sq, Hq, D] contiguous.
  Tensor go = make_tensor(
      make_gmem_ptr(static_cast<Element*>(a.o)), make_shape(a.seq_q, int32_t(HeadDim), a.heads_q, a.batch),
      make_stride(int64_t(a.heads_q) * HeadDim, _1{}, int64_t(HeadDim), int64_t(a.seq_q) * a.heads_q * HeadDim));
  typename T::Params p{
      a,
      tma(a.q, a.seq_q, a.heads_q, a.q_stride_b, a.q_stride_s, a.q_stride_h, typename T::SmemLayoutQ{}, QTile{}),
      tma(a.k, a.seq_kv, a.heads_kv, a.k_stride_b, a.k_stride_s, a.k_stride_h, KVStage{}, KVTile{}),
      tma(a.v, a.seq_kv, a.heads_kv, a.v_stride_b, a.v_stride_s, a.v_stride_h, KVStage{}, KVTile{}),
      make_tma_copy(SM90_TMA_STORE{}, go, typename T::SmemLayoutO{}, QTile{}, _1{}),
      float(a.scale * M_LOG2E)};
  constexpr int smem_bytes = int(sizeof(typename T::SharedStorage));
  opt_in_smem(fwd_kernel<T>, smem_bytes);
  check_cuda(launch_dependent(fwd_kernel<T>, a.grid, T::kThreads, smem_bytes, static_cast<cudaStream_t>(stream), p),
             "attention forward launch");
}

template <FwdElement E, int HeadDim>
void run_fwd_sm90(const FwdArgs& a, void* stream) {
  using Element = std::conditional_t<E == FwdElement::kBF16, cutlass::bfloat16_t, cutlass::half_t>;
  launch_fwd_sm90<FwdTraits<Element, HeadDim>>(a, stream);
}

}  // namespace sparsetrain::cuda::attn

// One instantiation per translation unit (attention_fwd_sm90_instance.cu.in).
#define SPARSETRAIN_ATTN_FWD_INSTANTIATE(E, D) \
  template void run_fwd_sm90<E, D>(const FwdArgs& a, void* stream);

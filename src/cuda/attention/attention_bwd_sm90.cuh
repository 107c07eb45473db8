// Block-sparse attention backward for sm_90a, written on CuTe: a persistent, warp-specialised
// kernel over kv tiles, with dK and dV accumulated on chip and dQ partials reduced into an fp32
// buffer, either by atomic adds in any order or in the mask's dQ write order (deterministic).
//
//   scheduler  work items (batch, kv head, 128-key sub-column), handed out by an atomic ticket
//              counter (zeroed on the stream before every launch, so graphs replay it) in the
//              mask's column schedule (DqColumnHandout, common/dq_schedule_model.h): never by
//              blockIdx, so the earliest unfinished column is always running and never waits
//   mainloop   a producer thread loads the item's K and V once, then the item's visits (q tile,
//              query head of the kv head's group: GQA, dK / dV stay on chip, no cross-CTA
//              reduction) in the schedule's walk order (bwd_item_next, common/attention_bwd_walk.h:
//              by default q tiles bottom-up with the group's heads innermost): Q, dO, lse and delta
//              through a 2-stage TMA pipeline. Two consumer warpgroups (64 keys each) compute
//              S^T = K Q^T and dP^T = V dO^T, P^T and dS^T = P^T (dP^T - delta) in registers;
//              dS^T to shared memory with matrix stores, then (FlashAttention-3's order) dV +=
//              P^T dO (A from registers) runs while the warpgroups meet at a barrier, dQ = dS K
//              (each warpgroup half of D) and dK += dS^T Q, and the dQ partial goes to shared
//              memory while dK's GEMM runs
//   dQ writer  one thread takes each 64 x D fp32 partial from shared memory and adds it to the
//              accumulator with a bulk TMA reduce-add, two adds in flight; in the deterministic
//              mode it first waits until the q tile's semaphore equals the visit's turn, and
//              increments it once the add has landed. The consumers meanwhile go on
//   epilogue   dK * scale and dV in the input dtype, from registers to global; a second kernel
//              converts the fp32 dQ accumulator (times scale) to the input dtype
//
// The mask kind and the deterministic flag are runtime switches. Keys past Skv are masked (their
// K / V rows are TMA zero fill), rows past Sq and rows without any allowed key have lse = +inf in
// the preprocessed lse (P = 0).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdio>

#include "cuda/attention/attention_bwd_params.h"
#include "cuda/attention/attention_sm90_common.cuh"
#include "cuda/attention/mask_tile_sm90.cuh"

namespace sparsetrain::cuda::attn {

using namespace cute;

template <class Element_, int kHeadDim_>
struct BwdTraits {
  using Element = Element_;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockM = kBwdTileQ, kBlockN = kBwdTileKv;
  static constexpr int kStages = 2;  // of Q, dO, lse, delta
  static constexpr int kMmaThreads = 256;
  static constexpr int kThreads = kMmaThreads + 128;
  // setmaxnreg budgets (2 x 128 x 232 + 128 x 40 = 64 K registers): the loader and the dQ writer
  // walk the mask's lists and spill at 24; the consumers hold dK, dV, S, dP and dQ.
  static constexpr int kProducerRegs = 40, kConsumerRegs = 232;

  // S^T = K Q^T and dP^T = V dO^T: M = keys (two warpgroups x 64), N = q rows, K = D.
  using AlongM = Layout<Shape<_2, _1, _1>>;
  using MmaSdP = decltype(make_tiled_mma(
      GMMA::ss_op_selector<Element, Element, float, Shape<Int<kBlockN>, Int<kBlockM>, Int<kHeadDim>>>(), AlongM{}));
  // dV += P^T dO and dK += dS^T Q: M = keys, N = D, K = q rows; A from registers, B = dO / Q
  // stored [q, D] (D contiguous: MN-major).
  using MmaDkv = decltype(make_tiled_mma(
      GMMA::rs_op_selector<Element, Element, float, Shape<Int<kBlockN>, Int<kHeadDim>, Int<kBlockM>>, GMMA::Major::K,
                           GMMA::Major::MN>(),
      AlongM{}));
  // dQ = dS K: M = q rows, N = D (each warpgroup one half), K = keys; dS stored q-contiguous, K
  // stored [keys, D]: both MN-major.
  using MmaDq = decltype(make_tiled_mma(
      GMMA::ss_op_selector<Element, Element, float, Shape<Int<kBlockM>, Int<kHeadDim / 2>, Int<kBlockN>>,
                           GMMA::Major::MN, GMMA::Major::MN>(),
      Layout<Shape<_1, _2, _1>>{}));

  using AtomQ = decltype(smem_atom_k_major<Element, kHeadDim>());
  using SmemLayoutQ = decltype(tile_to_shape(AtomQ{}, Shape<Int<kBlockM>, Int<kHeadDim>, Int<kStages>>{}));  // Q, dO
  using SmemLayoutQt = decltype(composition(
      SmemLayoutQ{}, make_ordered_layout(Shape<Int<kHeadDim>, Int<kBlockM>, Int<kStages>>{}, Step<_2, _1, _3>{})));
  // K is dQ's B operand split along D between the warpgroups: its swizzle atom must not straddle
  // the halves, so it is the widest one that fits D / 2.
  using AtomK = decltype(smem_atom_k_major<Element, kHeadDim / 2>());
  using SmemLayoutK = decltype(tile_to_shape(AtomK{}, Shape<Int<kBlockN>, Int<kHeadDim>>{}));
  using SmemLayoutKt =
      decltype(composition(SmemLayoutK{}, make_ordered_layout(Shape<Int<kHeadDim>, Int<kBlockN>>{}, Step<_2, _1>{})));
  using SmemLayoutV = decltype(tile_to_shape(AtomQ{}, Shape<Int<kBlockN>, Int<kHeadDim>>{}));
  // dS [q, keys], q contiguous, two buffers: a warpgroup writes tile j + 1's while the other may
  // still read tile j's.
  using SmemLayoutDs =
      decltype(tile_to_shape(GMMA::Layout_MN_SW128_Atom<Element>{}, Shape<Int<kBlockM>, Int<kBlockN>, _2>{}));
  // The same buffers as (keys, q, buffer), the accumulator's orientation: rows of 8 q values are
  // 16 contiguous bytes, so dS^T goes in with matrix stores (stmatrix) instead of one 32-bit store
  // (and its swizzled address) per pair.
  using SmemLayoutDsT = decltype(composition(
      SmemLayoutDs{}, make_ordered_layout(Shape<Int<kBlockN>, Int<kBlockM>, _2>{}, Step<_2, _1, _3>{})));
  using SmemCopyDs = decltype(make_tiled_copy_C(Copy_Atom<SM90_U32x4_STSM_N, Element>{}, MmaSdP{}));

  using GmemShape = Shape<int32_t, int32_t, int32_t, int32_t>;  // (S, D, H, B)
  using GmemStride = Stride<int64_t, _1, int64_t, int64_t>;
  using GmemTensor =
      decltype(make_tensor(make_gmem_ptr(static_cast<Element const*>(nullptr)), GmemShape{}, GmemStride{}));
  using TmaQ = decltype(make_tma_copy(SM90_TMA_LOAD{}, GmemTensor{}, take<0, 2>(SmemLayoutQ{}),
                                      Shape<Int<kBlockM>, Int<kHeadDim>>{}, _1{}));
  using TmaK = decltype(make_tma_copy(SM90_TMA_LOAD{}, GmemTensor{}, SmemLayoutK{},
                                      Shape<Int<kBlockN>, Int<kHeadDim>>{}, _1{}));
  using TmaV = decltype(make_tma_copy(SM90_TMA_LOAD{}, GmemTensor{}, SmemLayoutV{},
                                      Shape<Int<kBlockN>, Int<kHeadDim>>{}, _1{}));
  static constexpr uint32_t kQBytes = kBlockM * kHeadDim * sizeof(Element);
  static constexpr uint32_t kKVBytes = kBlockN * kHeadDim * sizeof(Element);
  static constexpr uint32_t kRowBytes = kBlockM * sizeof(float);  // lse or delta of a q tile
  static constexpr uint32_t kDqBytes = kBlockM * kHeadDim * sizeof(float);
  // dQ staging buffers: as many as shared memory holds, up to 4 (2 at D = 128, 4 below). The
  // more there are, the further the writer may fall behind (waiting for deterministic turns)
  // before the consumers stall.
  static constexpr int kSmemBesidesDq = int(2 * kStages * kQBytes + 2 * kKVBytes) +
                                        2 * kBlockM * kBlockN * int(sizeof(Element)) + 2048;
  static constexpr int kDqBuffers = std::max(1, std::min(4, (227 * 1024 - kSmemBesidesDq) / int(kDqBytes)));

  using Pipeline = cutlass::PipelineTmaAsync<kStages>;

  struct SharedStorage {
    array_aligned<Element, cosize_v<SmemLayoutQ>, 1024> q;
    array_aligned<Element, cosize_v<SmemLayoutQ>, 1024> dout;
    array_aligned<Element, cosize_v<SmemLayoutK>, 1024> k;
    array_aligned<Element, cosize_v<SmemLayoutV>, 1024> v;
    array_aligned<Element, cosize_v<SmemLayoutDs>, 1024> ds;
    // dQ partials in fragment order (dq_fragment_offset), the layout of a tile in the accumulator:
    // the consumers go on while the writer waits for a deterministic turn.
    array_aligned<float, kDqBuffers * kBlockM * kHeadDim, 128> dq;
    alignas(16) float lse[kStages][kBlockM];
    alignas(16) float delta[kStages][kBlockM];
    typename Pipeline::SharedStorage pipe;
    uint64_t kv_full, kv_empty;  // the item's K and V landed / every consumer is done with them
    uint64_t dq_full[kDqBuffers], dq_empty[kDqBuffers];  // a dQ partial written / read by the writer
    uint64_t ticket_full[2], ticket_empty[2];
    int32_t ticket[2];
  };
  static_assert(sizeof(SharedStorage) <= 227 * 1024, "sm90 allows 227 KiB of shared memory per CTA");

  struct Params {
    BwdArgs args;
    TmaQ tma_q, tma_do;
    TmaK tma_k;
    TmaV tma_v;
    float scale_log2;
  };
};

// A dQ tile's fp32 values are kept in the dQ GEMM's fragment order, not [q, D]: value i of
// consumer thread t sits at ((i / 4) * kMmaThreads + t) * 4 + i % 4, so that each warp writes
// whole 512-byte runs of shared memory (row-major would cost 8-way bank conflicts), and the
// bulk reduce-add copies the tile as it is. The conversion kernel (bwd_convert_dq_kernel) maps
// it back with the same fragment coordinates.
template <class T>
__host__ __device__ constexpr int dq_fragment_offset(int thread, int i) {
  return ((i / 4) * T::kMmaThreads + thread) * 4 + i % 4;
}

// ---- synchronisation with other CTAs (deterministic dQ) ------------------------------------------

__device__ __forceinline__ int32_t load_acquire(const int32_t* p) {
  int32_t v;
  asm volatile("ld.acquire.gpu.global.s32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void add_release(int32_t* p, int32_t v) {
  asm volatile("red.release.gpu.global.add.s32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

__device__ __forceinline__ uint64_t global_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// Waits until *sem == turn. A turn that never comes can only mean a corrupt write order (the
// scheduler guarantees progress otherwise): after spin_limit_ns the wait records what it waited
// for in abandoned[0..3] (the dQ conversion kernel reports it), marks the run abandoned (later
// waits return at once) and gives up the order, so the kernel cannot hang. (No printf here: the
// writer runs in the producer warpgroup with 24 registers.)
__device__ inline void wait_turn(const int32_t* sem, int32_t turn, const BwdArgs& a) {
  if (load_acquire(sem) == turn) return;
  const uint64_t start = global_ns();
  while (load_acquire(sem) != turn) {
    if (*reinterpret_cast<volatile int32_t*>(a.abandoned) != 0) return;
    if (global_ns() - start > uint64_t(a.spin_limit_ns)) {
      if (atomicExch(a.abandoned, 1) == 0) {
        a.abandoned[1] = int32_t(sem - a.semaphores);
        a.abandoned[2] = turn;
        a.abandoned[3] = load_acquire(sem);
      }
      return;
    }
  }
}

__device__ __forceinline__ void bulk_reduce_add(float* gmem, const float* smem, uint32_t bytes) {
  const uint32_t s = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;" ::"l"(gmem), "r"(s),
               "r"(bytes)
               : "memory");
}

// Waits until at most N bulk groups of this thread are pending (their global writes included).
template <int N>
__device__ __forceinline__ void bulk_wait() {
  asm volatile("cp.async.bulk.wait_group %0;" ::"n"(N) : "memory");
}

// ---- masking (the tile is transposed: rows are keys, columns q rows; mask_tile_sm90.cuh) ---------

template <class TS, class TC>
__device__ __forceinline__ void mask_tile_t(TS& s, TC const& coord, int q0, int kv0, const BwdArgs& a, int b, int h,
                                            int column, const BwdVisit& visit) {
  const KernelMaskSpec& m = a.spec;
  TileMaskCoords t{q0, kv0, a.seq_q, a.seq_kv};
  if (m.kind == MaskKind::kBitmask) {
    t.block_bits = m.bits + b * m.bits_stride_b + h * m.bits_stride_h + visit.q_block * m.bits_stride_m +
                   int64_t(visit.bit_entry) * m.bits_stride_w;
    t.block_row0 = visit.q_block * a.block_q;
    t.block_col = kv0 - column * a.block_kv;
    t.bits_ok = visit.bit_entry >= 0 && visit.bit_entry < m.bits_width;  // else a corrupt mask
  }
  // Document ids: the thread's keys (rows) in registers, queries read through L1.
  constexpr int kKeys = decltype(size<0>(s))::value;
  int32_t dkv[kKeys];
  const bool docs = m.kind == MaskKind::kDocument || m.kind == MaskKind::kDocumentCausal;
  const int32_t* doc_q = docs ? m.doc_q + b * m.doc_q_stride_b : nullptr;
  if (docs) {
    const int32_t* doc_kv = m.doc_kv + b * m.doc_kv_stride_b;
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < kKeys; ++i) {
      const int kv = kv0 + get<0>(coord(i, 0));
      dkv[i] = kv < a.seq_kv ? __ldg(doc_kv + kv) : INT32_MIN;
    }
  }
  mask_partial_tile<false>(
      s, coord, m, t, [&](int, int q) { return __ldg(doc_q + q); }, [&](int i, int) { return dkv[i]; });
}

// ---- the three roles ------------------------------------------------------------------------------

// Every role takes the same tickets in the same order: the loader draws them from the counter and
// passes each on through a two-slot ring in shared memory.
template <class T>
__device__ __forceinline__ int32_t read_ticket(typename T::SharedStorage& ss, int n_item) {
  const int slot = n_item & 1;
  cutlass::arch::ClusterBarrier::wait(&ss.ticket_full[slot], (n_item >> 1) & 1);
  const int32_t t = ss.ticket[slot];
  cutlass::arch::ClusterBarrier::arrive(&ss.ticket_empty[slot]);
  return t;
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
  const int group = a.heads_q / a.heads_kv;
  const int64_t num_items = a.handout.num_items();
  auto write = cutlass::make_producer_start_state<typename T::Pipeline>();
  for (int n_item = 0;; ++n_item) {
    const int32_t ticket = atomicAdd(a.ticket, 1);
    const int slot = n_item & 1;
    if (n_item >= 2) cutlass::arch::ClusterBarrier::wait(&ss.ticket_empty[slot], ((n_item - 2) >> 1) & 1);
    ss.ticket[slot] = ticket;
    cutlass::arch::ClusterBarrier::arrive(&ss.ticket_full[slot]);
    if (ticket >= num_items) break;
    const DqWorkItem w = a.handout.item(ticket);
    const int b = int(w.batch), hkv = int(w.kv_head), column = int(w.column);
    const int kv_tile = column * int(a.handout.sub_tiles) + int(w.sub_tile);

    if (n_item >= 1) cutlass::arch::ClusterBarrier::wait(&ss.kv_empty, (n_item - 1) & 1);
    cutlass::arch::ClusterTransactionBarrier::arrive_and_expect_tx(&ss.kv_full, 2 * T::kKVBytes);
    Tensor gK = local_tile(mK(_, _, hkv, b), KVTile{}, make_coord(kv_tile, 0));
    Tensor gV = local_tile(mV(_, _, hkv, b), KVTile{}, make_coord(kv_tile, 0));
    auto [tKgK, tKsK] = tma_partition(p.tma_k, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sK), group_modes<0, 2>(gK));
    auto [tVgV, tVsV] = tma_partition(p.tma_v, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sV), group_modes<0, 2>(gV));
    copy(p.tma_k.with(ss.kv_full), tKgK, tKsK);
    copy(p.tma_v.with(ss.kv_full), tVgV, tVsV);

    BwdItemCursor cur = bwd_item_begin(a.lists, b, hkv, group, column);
    BwdVisit visit;
    while (bwd_item_next(a.lists, b, column, cur, &visit)) {
      const int h = visit.q_head;
      Tensor gQ = local_tile(mQ(_, _, h, b), QTile{}, make_coord(visit.q_tile, 0));  // (64, D)
      Tensor gdO = local_tile(mdO(_, _, h, b), QTile{}, make_coord(visit.q_tile, 0));
      auto [tQgQ, tQsQ] =
          tma_partition(p.tma_q, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sQ), group_modes<0, 2>(gQ));
      auto [tdOgdO, tdOsdO] =
          tma_partition(p.tma_do, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sdO), group_modes<0, 2>(gdO));
      pipe.producer_acquire(write);
      uint64_t* bar = pipe.producer_get_barrier(write);
      const int st = write.index();
      copy(p.tma_q.with(*bar, 0), tQgQ, tQsQ(_, st));
      copy(p.tma_do.with(*bar, 0), tdOgdO, tdOsdO(_, st));
      const int64_t row0 = bwd_q_tile_index(b, h, a.heads_q, a.lists.num_q_tiles, visit.q_tile) * T::kBlockM;
      SM90_BULK_COPY_G2S::copy(a.lse_log2 + row0, bar, ss.lse[st], int32_t(T::kRowBytes));
      SM90_BULK_COPY_G2S::copy(a.delta + row0, bar, ss.delta[st], int32_t(T::kRowBytes));
      ++write;
    }
  }
}

template <class T>
__device__ void bwd_write_dq(const typename T::Params& p, typename T::SharedStorage& ss) {
  const BwdArgs& a = p.args;
  const int group = a.heads_q / a.heads_kv;
  const int64_t num_items = a.handout.num_items();
  int n_dq = 0;
  // Two reduce-adds in flight: a partial's buffer is handed back to the consumers (and in the
  // deterministic mode the q tile's next writer let go) once the add after it has been issued and
  // its own has read shared memory (deterministic: landed in global memory).
  int pending = -1;  // the buffer of the add not yet retired
  int32_t* pending_sem = nullptr;
  auto retire = [&](bool all) {
    if (a.deterministic) {
      if (all) bulk_wait<0>();
      else bulk_wait<1>();
      __threadfence();
      add_release(pending_sem, 1);
    } else if (all) {
      tma_store_wait<0>();
    } else {
      tma_store_wait<1>();
    }
    cutlass::arch::ClusterBarrier::arrive(&ss.dq_empty[pending]);
    pending = -1;
  };
  for (int n_item = 0;; ++n_item) {
    const int32_t ticket = read_ticket<T>(ss, n_item);
    if (ticket >= num_items) break;
    const DqWorkItem w = a.handout.item(ticket);
    const int b = int(w.batch), column = int(w.column);
    // The same visits in the same order as the loader and the consumers (the walk is the one rule
    // of bwd_item_next); each waits for its own turn, whatever the order (attention_bwd_walk.h).
    BwdItemCursor cur = bwd_item_begin(a.lists, b, int(w.kv_head), group, column);
    BwdVisit visit;
    while (bwd_item_next(a.lists, b, column, cur, &visit)) {
      const int buf = n_dq % T::kDqBuffers;
      cutlass::arch::ClusterBarrier::wait(&ss.dq_full[buf], (n_dq / T::kDqBuffers) & 1);
      const int64_t tile = bwd_q_tile_index(b, visit.q_head, a.heads_q, a.lists.num_q_tiles, visit.q_tile);
      int32_t* sem = a.semaphores + tile;
      if (a.deterministic) {
        const int32_t turn = dq_visit_turn(visit.turn, int32_t(a.handout.sub_tiles), int32_t(w.sub_tile));
        // Never wait for a turn while holding back a release: the writer we wait for may be
        // waiting for it.
        if (pending >= 0 && load_acquire(sem) != turn) retire(true);
        wait_turn(sem, turn, a);
      }
      bulk_reduce_add(a.dq_accum + tile * (T::kBlockM * T::kHeadDim), ss.dq.data() + buf * (T::kBlockM * T::kHeadDim),
                      T::kDqBytes);
      tma_store_arrive();
      if (pending >= 0) retire(false);
      pending = buf;
      pending_sem = sem;
      if constexpr (T::kDqBuffers == 1) retire(true);  // the consumers need this buffer for the next one
      ++n_dq;
    }
  }
  if (pending >= 0) retire(true);
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
  Tensor tdKVcdKV = thr_dkv.partition_C(make_identity_tensor(Shape<Int<N>, Int<D>>{}));
  Tensor tdKVcdKV0 = mma_dkv.get_thread_slice(0).partition_C(make_identity_tensor(Shape<Int<N>, Int<D>>{}));
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
  const int group = a.heads_q / a.heads_kv;
  const int64_t num_items = a.handout.num_items();
  cutlass::PipelineState<T::kStages> read;
  int n_dq = 0, n_tile = 0;
  // A tile's dQ partial, from registers to shared memory for the writer thread, while the tile's
  // dK GEMM runs. (Deferring it past the next tile's first GEMMs runs out of registers: ptxas
  // then serialises. So did walking the mask one visit ahead here, as the forward does: ~130
  // spilled loads and stores per tile.)
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
    if (ticket >= num_items) break;
    const DqWorkItem w = a.handout.item(ticket);
    const int b = int(w.batch), hkv = int(w.kv_head), column = int(w.column);
    const int kv0 = (column * int(a.handout.sub_tiles) + int(w.sub_tile)) * N;
    const bool crosses_end = kv0 + N > a.seq_kv;
    clear(tdVrdV);
    clear(tdKrdK);
    cutlass::arch::ClusterBarrier::wait(&ss.kv_full, n_item & 1);
    // dK and dV sum the visits in walk order: a function of the schedule, never of the grid.
    BwdItemCursor cur = bwd_item_begin(a.lists, b, hkv, group, column);
    BwdVisit visit;
    while (bwd_item_next(a.lists, b, column, cur, &visit)) {
      const int h = visit.q_head;
      const int st = read.index();
      const int q0 = visit.q_tile * M;
      pipe.consumer_wait(read);
      warpgroup_gemm_issue<true>(mma_sdp, tSrK, tSrQ(_, _, _, st), tSrS);
      warpgroup_gemm_issue<true>(mma_sdp, tPrV, tPrdO(_, _, _, st), tPrP);
      warpgroup_wait<1>();
      warpgroup_fence_operand(tSrS);
      if (visit.partial) {
        mask_tile_t(S, S_coord, q0, kv0, a, b, h, column, visit);
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
      const int buf = n_tile & 1;
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
      ++n_tile;
    }
    cutlass::arch::ClusterBarrier::arrive(&ss.kv_empty);  // the last dQ GEMM has read K

    // Epilogue: dK * scale and dV, keys past Skv dropped. Each row through one pointer with
    // immediate offsets: a thread's columns are its first one plus the pattern every thread shares
    // (thread 0's: compile-time constants), as the forward's fwd_store_empty (a 64-bit address per
    // store made this epilogue ~11 % of the samples on short columns, ncu).
    Tensor dK = make_tensor(tdKrdK.data(), acc_rowcol(tdKrdK.layout()));
    Tensor dV = make_tensor(tdVrdV.data(), acc_rowcol(tdVrdV.layout()));
    Tensor dKV_coord = make_tensor(tdKVcdKV.data(), acc_rowcol(tdKVcdKV.layout()));
    Tensor dKV_coord0 = make_tensor(tdKVcdKV0.data(), acc_rowcol(tdKVcdKV0.layout()));
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < size<0>(dK); ++i) {
      const int kv = kv0 + get<0>(dKV_coord(i, 0));
      if (kv >= a.seq_kv) continue;
      const int64_t off = ((int64_t(b) * a.seq_kv + kv) * a.heads_kv + hkv) * D + get<1>(dKV_coord(i, 0));
      Element* dk = static_cast<Element*>(a.dk) + off;
      Element* dv = static_cast<Element*>(a.dv) + off;
      CUTLASS_PRAGMA_UNROLL
      for (int j = 0; j < size<1>(dK); j += 2) {
        const int d = get<1>(dKV_coord0(i, j)) - get<1>(dKV_coord0(i, 0));
        cutlass::Array<Element, 2> k2, v2;
        k2[0] = Element(dK(i, j) * a.scale);
        k2[1] = Element(dK(i, j + 1) * a.scale);
        v2[0] = Element(dV(i, j));
        v2[1] = Element(dV(i, j + 1));
        *reinterpret_cast<cutlass::Array<Element, 2>*>(dk + d) = k2;
        *reinterpret_cast<cutlass::Array<Element, 2>*>(dv + d) = v2;
      }
    }
  }
}

template <class T>
__global__ void __launch_bounds__(T::kThreads, 1) bwd_kernel(CUTE_GRID_CONSTANT const typename T::Params p) {
  extern __shared__ __align__(1024) char smem[];
  auto& ss = *reinterpret_cast<typename T::SharedStorage*>(smem);
  const int warp = cutlass::canonical_warp_idx_sync();
  const int warpgroup = warp / 4;
  if (warp == 0 && cute::elect_one_sync()) {
    cute::prefetch_tma_descriptor(p.tma_q.get_tma_descriptor());
    cute::prefetch_tma_descriptor(p.tma_do.get_tma_descriptor());
    cute::prefetch_tma_descriptor(p.tma_k.get_tma_descriptor());
    cute::prefetch_tma_descriptor(p.tma_v.get_tma_descriptor());
    cutlass::arch::ClusterTransactionBarrier::init(&ss.kv_full, 1);
    cutlass::arch::ClusterBarrier::init(&ss.kv_empty, T::kMmaThreads);
    for (int i = 0; i < T::kDqBuffers; ++i) {
      cutlass::arch::ClusterBarrier::init(&ss.dq_full[i], T::kMmaThreads);
      cutlass::arch::ClusterBarrier::init(&ss.dq_empty[i], 1);
    }
    for (int i = 0; i < 2; ++i) {
      cutlass::arch::ClusterBarrier::init(&ss.ticket_full[i], 1);
      cutlass::arch::ClusterBarrier::init(&ss.ticket_empty[i], T::kMmaThreads + 1);  // + the dQ writer
    }
  }
  typename T::Pipeline::Params pp;
  pp.transaction_bytes = 2 * T::kQBytes + 2 * T::kRowBytes;
  pp.role = warpgroup == 0 ? T::Pipeline::ThreadCategory::Producer : T::Pipeline::ThreadCategory::Consumer;
  pp.is_leader = threadIdx.x == 0;
  pp.num_consumers = T::kMmaThreads;
  typename T::Pipeline pipe(ss.pipe, pp, Shape<_1, _1, _1>{});
  cutlass::arch::fence_barrier_init();
  __syncthreads();

  if (warpgroup == 0) {
    cutlass::arch::warpgroup_reg_dealloc<T::kProducerRegs>();
    if (threadIdx.x == 0) bwd_load<T>(p, ss, pipe);
    else if (threadIdx.x == 32) bwd_write_dq<T>(p, ss);
  } else {
    cutlass::arch::warpgroup_reg_alloc<T::kConsumerRegs>();
    bwd_compute<T>(p, ss, pipe, int(threadIdx.x) - 128);
  }
}

// dq [B, Sq, Hq, D] (contiguous) = scale * the fp32 accumulator, whose q tiles are in fragment
// order (dq_fragment_offset): one CTA of kMmaThreads per q tile, each thread converting the values
// its namesake in the dQ GEMM produced. Also reports a dQ wait the kernel gave up (abandoned).
template <class T>
__global__ void __launch_bounds__(T::kMmaThreads) bwd_convert_dq_kernel(const BwdArgs a, void* dq_out) {
  using Element = typename T::Element;
  constexpr int M = T::kBlockM, D = T::kHeadDim;
  if (blockIdx.x == 0 && threadIdx.x == 0 && a.abandoned[0] != 0)
    printf("sparsetrain attention backward: a dQ wait timed out (q tile semaphore %d held %d, waiting for turn %d): "
           "the mask's dq_write_order does not match its lists; the deterministic dQ order was given up\n",
           a.abandoned[1], a.abandoned[3], a.abandoned[2]);
  typename T::MmaDq mma_dq;
  const int tid = threadIdx.x;
  Tensor coord = mma_dq.get_thread_slice(tid).partition_C(make_identity_tensor(Shape<Int<M>, Int<D>>{}));
  const int tiles = a.lists.num_q_tiles;
  Element* dq = static_cast<Element*>(dq_out);
  for (int64_t tile = blockIdx.x; tile < int64_t(a.batch) * a.heads_q * tiles; tile += gridDim.x) {
    const int q_tile = int(tile % tiles);
    const int64_t bh = tile / tiles;
    const int64_t b = bh / a.heads_q, h = bh % a.heads_q;
    const float* acc = a.dq_accum + tile * (M * D);
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < size(coord); i += 2) {
      const int q = q_tile * M + get<0>(coord(i));
      if (q >= a.seq_q) continue;
      const float2 v = *reinterpret_cast<const float2*>(acc + dq_fragment_offset<T>(tid, i));
      cutlass::Array<Element, 2> pair;  // fragment values i, i + 1: adjacent columns
      pair[0] = Element(v.x * a.scale);
      pair[1] = Element(v.y * a.scale);
      *reinterpret_cast<cutlass::Array<Element, 2>*>(dq + ((b * a.seq_q + q) * a.heads_q + h) * D + get<1>(coord(i))) =
          pair;
    }
  }
}

template <FwdElement E, int HeadDim>
void run_bwd_sm90(const BwdArgs& a, void* dq, void* stream) {
  using Element = std::conditional_t<E == FwdElement::kBF16, cutlass::bfloat16_t, cutlass::half_t>;
  using T = BwdTraits<Element, HeadDim>;
  auto tma = [&](const void* ptr, int32_t seq, int32_t heads, int64_t sb, int64_t ss, int64_t sh, auto smem_layout,
                 auto tile) {
    Tensor g = make_tensor(make_gmem_ptr(static_cast<Element const*>(ptr)),
                           make_shape(seq, int32_t(HeadDim), heads, a.batch), make_stride(ss, _1{}, sh, sb));
    return make_tma_copy(SM90_TMA_LOAD{}, g, smem_layout, tile, _1{});
  };
  using QTile = Shape<Int<T::kBlockM>, Int<HeadDim>>;
  using KVTile = Shape<Int<T::kBlockN>, Int<HeadDim>>;
  using QStage = decltype(take<0, 2>(typename T::SmemLayoutQ{}));
  typename T::Params p{
      a,
      tma(a.q, a.seq_q, a.heads_q, a.q_stride_b, a.q_stride_s, a.q_stride_h, QStage{}, QTile{}),
      tma(a.dout, a.seq_q, a.heads_q, a.do_stride_b, a.do_stride_s, a.do_stride_h, QStage{}, QTile{}),
      tma(a.k, a.seq_kv, a.heads_kv, a.k_stride_b, a.k_stride_s, a.k_stride_h, typename T::SmemLayoutK{}, KVTile{}),
      tma(a.v, a.seq_kv, a.heads_kv, a.v_stride_b, a.v_stride_s, a.v_stride_h, typename T::SmemLayoutV{}, KVTile{}),
      float(a.scale * M_LOG2E)};
  constexpr int smem_bytes = int(sizeof(typename T::SharedStorage));
  opt_in_smem(bwd_kernel<T>, smem_bytes);
  bwd_kernel<T><<<a.grid, T::kThreads, smem_bytes, static_cast<cudaStream_t>(stream)>>>(p);
  check_cuda(cudaGetLastError(), "attention backward launch");
  const int64_t tiles = int64_t(a.batch) * a.heads_q * a.lists.num_q_tiles;
  bwd_convert_dq_kernel<T><<<int(std::min<int64_t>(tiles, 65535)), T::kMmaThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      a, dq);
  check_cuda(cudaGetLastError(), "dQ conversion launch");
}

}  // namespace sparsetrain::cuda::attn

// One instantiation per translation unit (attention_bwd_sm90_instance.cu.in).
#define SPARSETRAIN_ATTN_BWD_INSTANTIATE(E, D) \
  template void run_bwd_sm90<E, D>(const BwdArgs& a, void* dq, void* stream);

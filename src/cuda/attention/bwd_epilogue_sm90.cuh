// The backward's epilogue: an item's dK (times scale) and dV in the input dtype, staged in the
// item's own K and V tiles in shared memory (both consumers' GEMMs are done with them), then one
// TMA store each. Keys past Skv are clipped by the store. 4-byte stores from the registers (8 rows
// a warp instruction) took a tenth of a 17-visit item.
#pragma once

#include <cstdint>

#include "cuda/attention/bwd_traits_sm90.cuh"

namespace sparsetrain::cuda::attn {

using namespace cute;

// dK * scale and dV from consumer thread `tid`'s accumulators into sK and sV with matrix stores
// (stmatrix). The caller has synchronised the consumers before (the last dQ GEMM reads every key
// of K) and fences and synchronises after, before bwd_store_dkdv.
template <class T, class TdK, class TdV, class TsK, class TsV>
__device__ __forceinline__ void bwd_stage_dkdv(float scale, int tid, TdK const& tdKrdK, TdV const& tdVrdV, TsK& sK,
                                               TsV& sV) {
  using Element = typename T::Element;
  Tensor rdK = make_tensor_like<Element>(tdKrdK);
  Tensor rdV = make_tensor_like<Element>(tdVrdV);
  CUTLASS_PRAGMA_UNROLL
  for (int i = 0; i < size(rdK); ++i) {
    rdK(i) = Element(tdKrdK(i) * scale);
    rdV(i) = Element(tdVrdV(i));
  }
  auto copy_c = make_tiled_copy_C(Copy_Atom<SM90_U32x4_STSM_N, Element>{}, typename T::MmaDkv{});
  auto thr = copy_c.get_thread_slice(tid);
  copy(copy_c, thr.retile_S(rdK), thr.partition_D(sK));
  copy(copy_c, thr.retile_S(rdV), thr.partition_D(sV));
}

// One thread: the staged tiles to dk and dv ([B, Skv, Hkv, D]) from key `kv_start` on; returns
// once the stores have read shared memory (the loader may then refill K and V).
template <class T, class TsK, class TsV>
__device__ __forceinline__ void bwd_store_dkdv(const typename T::Params& p, int b, int hkv, int32_t kv_start,
                                               TsK const& sK, TsV const& sV) {
  const BwdArgs& a = p.args;
  using KVTile = Shape<Int<T::kBlockN>, Int<T::kHeadDim>>;
  auto shape = make_shape(a.seq_kv, int32_t(T::kHeadDim), a.heads_kv, a.batch);
  Tensor gdK = local_tile(domain_offset(make_coord(kv_start, 0), p.tma_dk.get_tma_tensor(shape)(_, _, hkv, b)), KVTile{},
                          make_coord(0, 0));
  Tensor gdV = local_tile(domain_offset(make_coord(kv_start, 0), p.tma_dv.get_tma_tensor(shape)(_, _, hkv, b)), KVTile{},
                          make_coord(0, 0));
  auto [tKgK, tKsK] = tma_partition(p.tma_dk, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sK), group_modes<0, 2>(gdK));
  auto [tVgV, tVsV] = tma_partition(p.tma_dv, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sV), group_modes<0, 2>(gdV));
  copy(p.tma_dk, tKsK, tKgK);
  copy(p.tma_dv, tVsV, tVgV);
  tma_store_arrive();
  tma_store_wait<0>();
}

// All consumer threads: the staged rows of a padded document's kv tile that hold tokens
// (bwd_real_key, the tile at mask position kv0), 16 bytes a thread at a time; the caller meets
// the consumers after, before the loader may refill K and V.
template <class T, class TsK, class TsV>
__device__ __forceinline__ void bwd_store_dkdv_rows(const BwdArgs& a, int b, int hkv, int kv0, int tid, TsK const& sK,
                                                    TsV const& sV) {
  using Element = typename T::Element;
  constexpr int kPer = 16 / int(sizeof(Element)), kChunks = T::kHeadDim / kPer;  // 16-byte pieces of a row
  static_assert(T::kHeadDim % kPer == 0, "rows leave in 16-byte stores");
  const int64_t row_elems = int64_t(a.heads_kv) * T::kHeadDim;
  for (int c = tid; c < T::kBlockN * kChunks; c += T::kMmaThreads) {
    const int row = c / kChunks, col = c % kChunks * kPer;
    const int32_t r = bwd_real_key(a, b, kv0 + row);
    if (r < 0 || r >= a.seq_kv) continue;
    const int64_t at = (int64_t(b) * a.seq_kv + r) * row_elems + int64_t(hkv) * T::kHeadDim + col;
    // A 16-byte piece of a row stays whole under the tiles' swizzles (they permute 16-byte units).
    *reinterpret_cast<uint4*>(static_cast<Element*>(a.dk) + at) = *reinterpret_cast<const uint4*>(&sK(row, col));
    *reinterpret_cast<uint4*>(static_cast<Element*>(a.dv) + at) = *reinterpret_cast<const uint4*>(&sV(row, col));
  }
}

}  // namespace sparsetrain::cuda::attn

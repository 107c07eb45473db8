// The mask inside one partial kv tile of 128 keys, the one definition the forward (queries along
// the accumulator's rows: S = Q K^T) and the backward (keys along the rows: S^T = K Q^T) share.
// The kind is a runtime switch outside the element loops, so each kind's loop stays tight:
// interval specs (causal, bottom-right causal, window, prefix-LM, full) cost two compares per
// element (in the backward's transposed tiles the band specs one: mask_band), documents one id
// compare (plus causal), bitmasks one bit test (row words read as 32-bit words). Keys at or past
// Skv are always masked; queries past Sq are masked for bitmasks and the forward's documents
// (their ids and bits are never read) and left to the caller otherwise.
#pragma once

#include <cmath>
#include <cstdint>

#include "common/attention/mask_predicate.h"  // mask_row_interval, mask_band, bitmask_word
#include "cuda/attention/attention_fwd_params.h"  // KernelMaskSpec
#include "cuda/attention/attention_common_sm90.cuh"

namespace sparsetrain::cuda::attn {

// Where the tile sits and where its bits are (the forward's; the backward's: mask_bits_transposed).
struct TileMaskCoords {
  int32_t q0, kv0;      // the first query and key the accumulator's (0, 0) stands for
  int32_t seq_q, seq_kv;
  // kBitmask: the partial block's bits (batch, head, mask row and entry applied), the block's
  // first query row, the tile's first column inside the block, and whether the entry is within
  // the bitmask width (a corrupt device count allows nothing).
  const uint8_t* block_bits = nullptr;
  int32_t block_row0 = 0, block_col = 0;
  bool bits_ok = false;
};

// Applies the mask to accumulator S (coord: its identity tensor in the same (rows, cols) view).
// query_doc(index, q): the document id of query q (index: its position along the query mode, a
// compile-time constant in unrolled loops, so a caller may keep ids in registers); key_doc(index,
// c): the id of tile key c (index: its position along the key mode). Both are read only for
// document masks; key_doc must give a value no query id has (INT32_MIN) for keys past Skv. With
// many queries (the backward) query_doc is read for every query of the tile, past Sq too.
// Bitmasks here are the forward's (few queries, many keys); the backward's transposed tiles take
// theirs from mask_key_words (below), a transposed copy's words.
template <bool kQueriesAlongRows, class TS, class TC, class QueryDoc, class KeyDoc>
__device__ __forceinline__ void mask_partial_tile(TS& s, TC const& coord, const KernelMaskSpec& m,
                                                  const TileMaskCoords& t, QueryDoc query_doc, KeyDoc key_doc) {
  constexpr int kQueries = kQueriesAlongRows ? decltype(size<0>(s))::value : decltype(size<1>(s))::value;
  constexpr int kKeys = kQueriesAlongRows ? decltype(size<1>(s))::value : decltype(size<0>(s))::value;
  auto qpos = [&](int qi) { return kQueriesAlongRows ? get<0>(coord(qi, 0)) : get<1>(coord(0, qi)); };
  auto kpos = [&](int ki) { return kQueriesAlongRows ? get<1>(coord(0, ki)) : get<0>(coord(ki, 0)); };
  auto at = [&](int qi, int ki) -> auto& { return kQueriesAlongRows ? s(qi, ki) : s(ki, qi); };
  const int key_end = t.seq_kv - t.kv0;  // tile keys at or past it lie beyond Skv
  switch (m.kind) {
    case MaskKind::kDocument:
    case MaskKind::kDocumentCausal: {
      // Predicates combine with & (not &&): a short circuit would put a branch around every
      // element's id read.
      const bool causal = m.kind == MaskKind::kDocumentCausal;
      if constexpr (kQueries <= 4) {
        // Few queries, many keys (the forward): each key's id is read once for all queries.
        int32_t dq[kQueries], hi[kQueries];
        CUTLASS_PRAGMA_UNROLL
        for (int qi = 0; qi < kQueries; ++qi) {
          const int q = t.q0 + qpos(qi);
          const bool row_ok = q < t.seq_q;  // a query past Sq has no id to read: allow nothing
          dq[qi] = row_ok ? query_doc(qi, q) : 0;
          hi[qi] = !row_ok ? 0 : causal ? min(q + 1 - t.kv0, key_end) : key_end;
        }
        CUTLASS_PRAGMA_UNROLL
        for (int ki = 0; ki < kKeys; ++ki) {
          const int c = kpos(ki);
          const int32_t dk = key_doc(ki, c);
          CUTLASS_PRAGMA_UNROLL
          for (int qi = 0; qi < kQueries; ++qi)
            if (!((c < hi[qi]) & (dk == dq[qi]))) at(qi, ki) = -INFINITY;
        }
      } else {
        // Many queries, few keys (the backward): the keys' ids are the caller's registers, and its
        // query ids cover the whole tile (rows past Sq: padding the caller's lse masks), so per
        // element one id compare and, causal, one compare of kv - q (mask_band's, as below).
        const int32_t d0 = t.kv0 - t.q0, d_max = causal ? 0 : kMaskBandOpen;
        CUTLASS_PRAGMA_UNROLL
        for (int qi = 0; qi < kQueries; ++qi) {
          const int32_t dq = query_doc(qi, t.q0 + qpos(qi));
          CUTLASS_PRAGMA_UNROLL
          for (int ki = 0; ki < kKeys; ++ki) {
            const int c = kpos(ki);
            if (!((c < key_end) & (key_doc(ki, c) == dq) & (d0 + c - qpos(qi) <= d_max))) at(qi, ki) = -INFINITY;
          }
        }
      }
      break;
    }
    case MaskKind::kBitmask: {
      if constexpr (kQueriesAlongRows) {
        // Row r of the block is block_kv bits from bit r * block_kv on (block_kv a multiple of
        // 128: the tile's 128 keys are 4 aligned 32-bit words), read once per query, then selects
        // (no local array).
        CUTLASS_PRAGMA_UNROLL
        for (int qi = 0; qi < kQueries; ++qi) {
          const int q = t.q0 + qpos(qi);
          const bool in = t.bits_ok && q < t.seq_q;
          const uint32_t* words = reinterpret_cast<const uint32_t*>(t.block_bits) +
                                  bitmask_word(q - t.block_row0, t.block_col, m.block_kv);
          const uint32_t w0 = in ? __ldg(words) : 0u, w1 = in ? __ldg(words + 1) : 0u;
          const uint32_t w2 = in ? __ldg(words + 2) : 0u, w3 = in ? __ldg(words + 3) : 0u;
          CUTLASS_PRAGMA_UNROLL
          for (int ki = 0; ki < kKeys; ++ki) {
            const int c = kpos(ki);
            const uint32_t word = c < 64 ? (c < 32 ? w0 : w1) : (c < 96 ? w2 : w3);
            if (!((c < key_end) & (((word >> (c & 31)) & 1u) != 0))) at(qi, ki) = -INFINITY;
          }
        }
      }
      break;
    }
    default: {
      int32_t band_lo, band_hi;
      if (!kQueriesAlongRows &&
          mask_band(m.kind, m.window_left, m.window_right, t.seq_q, t.seq_kv, &band_lo, &band_hi)) {
        // Few keys, many queries (the backward): kv - q per element against one band.
        const int32_t d0 = t.kv0 - t.q0;
        CUTLASS_PRAGMA_UNROLL
        for (int ki = 0; ki < kKeys; ++ki) {
          const int c = kpos(ki);
          CUTLASS_PRAGMA_UNROLL
          for (int qi = 0; qi < kQueries; ++qi)
            if (!((c < key_end) & in_mask_band(d0 + c - qpos(qi), band_lo, band_hi))) at(qi, ki) = -INFINITY;
        }
        break;
      }
      CUTLASS_PRAGMA_UNROLL
      for (int qi = 0; qi < kQueries; ++qi) {
        const int q = t.q0 + qpos(qi);
        int64_t lo, hi;
        mask_row_interval(m.kind, m.window_left, m.window_right, m.prefix_length, t.seq_q, t.seq_kv, q, &lo, &hi);
        const int from = int(max(lo, int64_t(0)) - t.kv0), to = int(min(hi, int64_t(t.seq_kv)) - t.kv0);
        CUTLASS_PRAGMA_UNROLL
        for (int ki = 0; ki < kKeys; ++ki) {
          const int c = kpos(ki);
          if (c < from || c >= to) at(qi, ki) = -INFINITY;
        }
      }
      break;
    }
  }
}

// The backward's bitmask mask on its transposed tile (rows: keys, columns: queries; S^T of a q
// tile of 32 x kGroups rows): mine[ki][g], bit r, is the thread's key ki allowed for row r of the
// tile's 32-row group g (a word of the backward's transposed copy of the block,
// common/attention/bitmask_transpose.h). A thread's query column j lies in group j / 8
// (tests/cpp/test_bwd_mask_layout.cu checks it against CuTe's partition). Keys at or past key_end
// lie beyond Skv.
template <int kKeys, int kGroups, class TS, class TC>
CUTE_HOST_DEVICE void mask_key_words(TS& s, TC const& coord, int key_end, const uint32_t (&mine)[kKeys][kGroups]) {
  constexpr int kQueries = decltype(size<1>(s))::value;
  static_assert(kKeys == decltype(size<0>(s))::value, "a word for each of the thread's keys");
  static_assert(kQueries == 8 * kGroups, "a thread's query columns: 8 in each 32-row group");
  CUTLASS_PRAGMA_UNROLL
  for (int j = 0; j < kQueries; ++j) {
    const int r = int(get<1>(coord(0, j))) & 31;  // the query's row in its group j / 8
    CUTLASS_PRAGMA_UNROLL
    for (int ki = 0; ki < kKeys; ++ki)
      if (!((int(get<0>(coord(ki, 0))) < key_end) & (((mine[ki][j / 8] >> r) & 1u) != 0))) s(ki, j) = -INFINITY;
  }
}

// Keys past Skv in a tile without a mask inside (a full block at the end of the keys).
template <bool kQueriesAlongRows, class TS, class TC>
__device__ __forceinline__ void mask_seq_kv(TS& s, TC const& coord, int kv0, int seq_kv) {
  constexpr int kKeyMode = kQueriesAlongRows ? 1 : 0;
  CUTLASS_PRAGMA_UNROLL
  for (int i = 0; i < size<0>(s); ++i) {
    CUTLASS_PRAGMA_UNROLL
    for (int j = 0; j < size<1>(s); ++j) {
      if (kv0 + get<kKeyMode>(coord(i, j)) >= seq_kv) s(i, j) = -INFINITY;
    }
  }
}

}  // namespace sparsetrain::cuda::attn

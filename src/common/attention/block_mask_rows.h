// The per-row steps of building a block mask (block_mask.h): classify the blocks of one row of
// q blocks under a built-in spec and give one row's columns their dQ turns. Plain host/device
// code over raw int32 rows: the CPU builders call it once per row, and a CUDA kernel can call it
// once per thread. Nothing here allocates; scratch is sized by shapes.
#pragma once

#include <cstdint>

#include "common/host_device.h"
#include "common/attention/mask_index_view.h"
#include "common/attention/mask_predicate.h"
#include "sparsetrain/block_mask.h"

namespace sparsetrain {

// Block classes, as in the dense block matrix of build_block_mask_from_blocks.
enum : int32_t { kBlockSkipped = 0, kBlockPartial = 1, kBlockFull = 2 };

// A built-in spec for one batch row: doc_q / doc_kv point at that row's document ids (contiguous).
struct MaskRowParams {
  MaskKind kind;
  int64_t window_left, window_right, prefix_length;
  int64_t seq_q, seq_kv;
  const int32_t* doc_q;
  const int32_t* doc_kv;

  ST_HOST_DEVICE bool allows(int64_t q, int64_t kv) const {
    return mask_allows(kind, window_left, window_right, prefix_length, doc_q, doc_kv, seq_q, seq_kv, q, kv);
  }
};

// Exact classification by evaluating every element (stops as soon as the block is known partial).
ST_HOST_DEVICE inline int32_t classify_block_by_elements(const MaskRowParams& p, int64_t q0, int64_t q1,
                                                         int64_t kv0, int64_t kv1) {
  bool any = false, all = true;
  for (int64_t q = q0; q < q1; ++q)
    for (int64_t kv = kv0; kv < kv1; ++kv) {
      if (p.allows(q, kv)) any = true;
      else all = false;
      if (any && !all) return kBlockPartial;
    }
  return any ? kBlockFull : kBlockSkipped;
}

// Masks of the form "kv - q in [lo, hi]" (causal, bottom-right causal, sliding window): over a
// rectangle, kv - q takes every integer in [dmin, dmax], so the test is exact.
ST_HOST_DEVICE inline int32_t classify_diagonal_band(int64_t dmin, int64_t dmax, bool has_lo, int64_t lo,
                                                     bool has_hi, int64_t hi) {
  if ((has_lo && dmax < lo) || (has_hi && dmin > hi)) return kBlockSkipped;
  if ((!has_lo || dmin >= lo) && (!has_hi || dmax <= hi)) return kBlockFull;
  return kBlockPartial;
}

// The document ids of one side of a block, positions [begin, end) (begin < end): their least and
// greatest id, whether they never decrease (ids[i] >= ids[i - 1] for every begin < i < end), and
// whether every id is the least or the greatest (at most two ids: a block across one document
// edge, or a document's end and its padding in the backward's padded form, whose padding ids lie
// above every real id and so widen the range over many documents).
struct DocIdSpan {
  int32_t min, max;
  int32_t sorted;   // 0 or 1
  int32_t two_ids;  // 0 or 1
};
ST_HOST_DEVICE inline DocIdSpan doc_id_span(const int32_t* ids, int64_t begin, int64_t end) {
  DocIdSpan s{ids[begin], ids[begin], 1, 1};
  for (int64_t i = begin + 1; i < end; ++i) {
    const int32_t d = ids[i];
    s.sorted = s.sorted && d >= ids[i - 1];
    s.min = d < s.min ? d : s.min;
    s.max = d > s.max ? d : s.max;
  }
  for (int64_t i = begin; i < end && s.two_ids; ++i) s.two_ids = ids[i] == s.min || ids[i] == s.max;
  return s;
}

// Document ids: full when both sides hold one and the same id, skipped when the id sets are
// disjoint. Ranges decide most blocks, the id sets blocks of at most two ids a side; sorted runs
// (the usual packed documents) are intersected exactly by a merge; anything else falls back to the
// elements. q_span / kv_span: the blocks'
// doc_id_span when the caller has them already (a CUDA build computes them once per block), else
// null.
ST_HOST_DEVICE inline int32_t classify_document_block(const MaskRowParams& p, int64_t q0, int64_t q1, int64_t kv0,
                                                      int64_t kv1, const DocIdSpan* q_span = nullptr,
                                                      const DocIdSpan* kv_span = nullptr) {
  const DocIdSpan qs = q_span != nullptr ? *q_span : doc_id_span(p.doc_q, q0, q1);
  const DocIdSpan ks = kv_span != nullptr ? *kv_span : doc_id_span(p.doc_kv, kv0, kv1);
  if (qs.min == qs.max && ks.min == ks.max && qs.min == ks.min) return kBlockFull;
  if (qs.max < ks.min || ks.max < qs.min) return kBlockSkipped;
  // At most two ids a side (not one shared id): the id sets decide.
  if (qs.two_ids && ks.two_ids)
    return qs.min == ks.min || qs.min == ks.max || qs.max == ks.min || qs.max == ks.max ? kBlockPartial : kBlockSkipped;
  if (!qs.sorted || !ks.sorted) {
    const MaskRowParams doc_only = {MaskKind::kDocument, 0, 0, 0, p.seq_q, p.seq_kv, p.doc_q, p.doc_kv};
    return classify_block_by_elements(doc_only, q0, q1, kv0, kv1);
  }
  // Not one shared id, so any common id makes the block partial.
  int64_t i = q0, j = kv0;
  while (i < q1 && j < kv1) {
    if (p.doc_q[i] == p.doc_kv[j]) return kBlockPartial;
    if (p.doc_q[i] < p.doc_kv[j]) ++i;
    else ++j;
  }
  return kBlockSkipped;
}

// The class of block (m, n) under a built-in spec, judged on the elements inside the sequences
// (the last row / column of blocks may be cut short): exact, and cheap for every kind except
// the diagonal blocks of a document-causal mask at document boundaries (element scan).
// q_span / kv_span (document kinds): as classify_document_block takes them.
ST_HOST_DEVICE inline int32_t classify_block(const MaskRowParams& p, int64_t block_q, int64_t block_kv, int64_t m,
                                             int64_t n, const DocIdSpan* q_span = nullptr,
                                             const DocIdSpan* kv_span = nullptr) {
  const int64_t q0 = m * block_q, kv0 = n * block_kv;
  const int64_t q1 = q0 + block_q < p.seq_q ? q0 + block_q : p.seq_q;
  const int64_t kv1 = kv0 + block_kv < p.seq_kv ? kv0 + block_kv : p.seq_kv;
  if (q0 >= q1 || kv0 >= kv1) return kBlockSkipped;
  const int64_t dmin = kv0 - (q1 - 1), dmax = (kv1 - 1) - q0;  // range of kv - q over the block
  switch (p.kind) {
    case MaskKind::kFull: return kBlockFull;
    case MaskKind::kCausal: return classify_diagonal_band(dmin, dmax, false, 0, true, 0);
    case MaskKind::kCausalBottomRight:
      return classify_diagonal_band(dmin, dmax, false, 0, true, p.seq_kv - p.seq_q);
    case MaskKind::kSlidingWindow:
      return classify_diagonal_band(dmin, dmax, p.window_left >= 0, -p.window_left, p.window_right >= 0,
                                    p.window_right);
    case MaskKind::kPrefixLM: {
      // Allowed iff kv < max(q + 1, prefix): row q0 allows the fewest keys, row q1 - 1 the most.
      const int64_t fewest = q0 + 1 > p.prefix_length ? q0 + 1 : p.prefix_length;
      const int64_t most = q1 > p.prefix_length ? q1 : p.prefix_length;
      if (kv0 >= most) return kBlockSkipped;
      return kv1 <= fewest ? kBlockFull : kBlockPartial;
    }
    case MaskKind::kDocument: return classify_document_block(p, q0, q1, kv0, kv1, q_span, kv_span);
    case MaskKind::kDocumentCausal: {
      const int32_t c = classify_diagonal_band(dmin, dmax, false, 0, true, 0);
      if (c == kBlockSkipped) return kBlockSkipped;
      const int32_t d = classify_document_block(p, q0, q1, kv0, kv1, q_span, kv_span);
      if (d == kBlockSkipped) return kBlockSkipped;
      if (c == kBlockFull) return d;
      if (d == kBlockFull) return c;
      return classify_block_by_elements(p, q0, q1, kv0, kv1);
    }
    case MaskKind::kBitmask: return kBlockPartial;  // not a built-in spec: builders reject it
  }
  return kBlockPartial;
}

// Row m of a built-in spec's block mask: the partial and full kv blocks in ascending order (each
// list has room for num_kv_blocks entries), and their counts. q_span / kv_spans (document kinds,
// optional): row m's doc_id_span and every kv block's, computed once for all rows.
ST_HOST_DEVICE inline void build_block_row(const MaskRowParams& p, int64_t block_q, int64_t block_kv, int64_t m,
                                           int64_t num_kv_blocks, int32_t* partial, int32_t* num_partial,
                                           int32_t* full, int32_t* num_full, const DocIdSpan* q_span = nullptr,
                                           const DocIdSpan* kv_spans = nullptr) {
  int32_t np = 0, nf = 0;
  for (int64_t n = 0; n < num_kv_blocks; ++n) {
    const int32_t c = classify_block(p, block_q, block_kv, m, n, q_span, kv_spans != nullptr ? kv_spans + n : nullptr);
    if (c == kBlockPartial) partial[np++] = int32_t(n);
    else if (c == kBlockFull) full[nf++] = int32_t(n);
  }
  *num_partial = np;
  *num_full = nf;
}

// One (b, h) slice of a mask list: its [rows] counts and [rows, width] sorted indices, both
// mask_index_view slices (MaskIndexView::slice). Counts are read as stored (the validator checks
// them); an absent list (either tensor undefined) has count 0 everywhere.
struct IndexRows {
  MaskIndexView counts, indices;

  ST_HOST_DEVICE bool present() const { return counts.data != nullptr; }
  ST_HOST_DEVICE int32_t count(int64_t r) const { return counts.data != nullptr ? counts.at(0, 0, r) : 0; }
  ST_HOST_DEVICE int32_t at(int64_t r, int64_t i) const { return indices.at(0, 0, r, i); }
  // Where `value` sits in row r's sorted list, or -1.
  ST_HOST_DEVICE int64_t find(int64_t r, int32_t value) const { return find_sorted(indices, 0, 0, r, count(r), value); }
};

// The position of column n in a schedule's hand-out order, and the column at position p.
// inverse / permutation: kPermutation only (inverse[n] = position of n).
ST_HOST_DEVICE inline int64_t schedule_position(ScheduleKind kind, const int32_t* inverse, int64_t n,
                                                int64_t num_columns) {
  switch (kind) {
    case ScheduleKind::kLeftToRight: return n;
    case ScheduleKind::kShortestFirst: return num_columns - 1 - n;
    case ScheduleKind::kPermutation: return inverse[n];
  }
  return n;
}
ST_HOST_DEVICE inline int64_t schedule_column(ScheduleKind kind, const int32_t* permutation, int64_t p,
                                              int64_t num_columns) {
  switch (kind) {
    case ScheduleKind::kLeftToRight: return p;
    case ScheduleKind::kShortestFirst: return num_columns - 1 - p;
    case ScheduleKind::kPermutation: return permutation[p];
  }
  return p;
}

// The dQ turns at q block m (common/attention/dq_turn.h): the columns touching m (row m's partial and full
// lists) ranked in schedule order; the stored entry of (column n, q block m) is n's rank (from 0),
// written through out / full_out: the (b, h) slices of the write orders, parallel to q_rows /
// full_q_rows.
// `rank_scratch` has num_columns entries, all zero on entry and on return.
ST_HOST_DEVICE inline void write_order_row(const IndexRows& kv_rows, const IndexRows& full_kv_rows, int64_t m,
                                           const IndexRows& q_rows, const IndexRows& full_q_rows,
                                           const MaskIndexOut& out, const MaskIndexOut& full_out,
                                           ScheduleKind kind, const int32_t* inverse, int64_t num_columns,
                                           int32_t* rank_scratch) {
  const int32_t np = kv_rows.count(m), nf = full_kv_rows.count(m);
  // Ranks by position: mark the positions taken, then an exclusive prefix count over them.
  for (int32_t i = 0; i < np; ++i) rank_scratch[schedule_position(kind, inverse, kv_rows.at(m, i), num_columns)] = 1;
  for (int32_t i = 0; i < nf; ++i)
    rank_scratch[schedule_position(kind, inverse, full_kv_rows.at(m, i), num_columns)] = 1;
  int32_t rank = 0;
  for (int64_t p = 0; p < num_columns; ++p) {
    if (rank_scratch[p] != 0) rank_scratch[p] = ++rank;  // rank + 1, so that 0 still means "absent"
  }
  for (int32_t i = 0; i < np; ++i) {
    const int32_t n = kv_rows.at(m, i);
    int32_t& r = rank_scratch[schedule_position(kind, inverse, n, num_columns)];
    const int64_t j = q_rows.find(n, int32_t(m));
    if (j >= 0) out.at(0, 0, n, j) = r - 1;
  }
  for (int32_t i = 0; i < nf; ++i) {
    const int32_t n = full_kv_rows.at(m, i);
    int32_t& r = rank_scratch[schedule_position(kind, inverse, n, num_columns)];
    const int64_t j = full_q_rows.find(n, int32_t(m));
    if (j >= 0) full_out.at(0, 0, n, j) = r - 1;
  }
  for (int32_t i = 0; i < np; ++i) rank_scratch[schedule_position(kind, inverse, kv_rows.at(m, i), num_columns)] = 0;
  for (int32_t i = 0; i < nf; ++i)
    rank_scratch[schedule_position(kind, inverse, full_kv_rows.at(m, i), num_columns)] = 0;
}

}  // namespace sparsetrain

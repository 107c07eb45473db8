// The device builders of block masks and document ids (block_mask_cuda.cu, cu_seqlens_cuda.cu),
// called by ops/block_mask.cpp and ops/cu_seqlens.cpp after every check: raw device pointers and
// the caller's stream; the rules are common/attention/'s, the host builders' own functions.
#pragma once

#include <cstdint>

#include "common/attention/block_mask_rows.h"
#include "common/attention/doc_padding.h"
#include "sparsetrain/allocator.h"
#include "sparsetrain/block_mask.h"

namespace sparsetrain {

// build_block_mask's device path (block_mask_cuda.cu): fills t's forward lists,
// transposes and write orders, all allocated full width on the device; doc_q / doc_kv: [B or 1, S]
// rows (row strides in elements) or null.
struct DeviceMaskBuild {
  MaskKind kind;
  int64_t window_left, window_right, prefix_length;
  const int32_t* doc_q;
  const int32_t* doc_kv;
  int64_t doc_q_batch, doc_q_stride, doc_kv_batch, doc_kv_stride;
  int64_t batch, seq_q, seq_kv, block_q, block_kv;
  ScheduleKind schedule;
  const int32_t* permutation_host;  // kPermutation: [Nk] column ids in hand-out order (copied to
                                    // `permutation` on the stream)
  int32_t* permutation;             // [Nk] on the device
  int32_t* records;                 // [batch * Mq * Nk] on the device (per-block class and dQ rank)
  DocIdSpan* doc_spans;             // document kinds: [doc_q_batch * Mq + doc_kv_batch * Nk] on the
                                    // device (the q blocks' spans, then the kv blocks'), else null
};
// Device scratch (int32 elements) that a build needs for DeviceMaskBuild's permutation, records and
// doc_spans, in that order.
inline int64_t device_mask_build_scratch(int64_t batch, int64_t Mq, int64_t Nk, int64_t doc_q_batch,
                                         int64_t doc_kv_batch, bool document) {
  static_assert(sizeof(DocIdSpan) % sizeof(int32_t) == 0 && alignof(DocIdSpan) <= alignof(int32_t), "DocIdSpan");
  const int64_t spans = document ? (doc_q_batch * Mq + doc_kv_batch * Nk) * int64_t(sizeof(DocIdSpan) / 4) : 0;
  return Nk + batch * Mq * Nk + spans;
}
void build_block_mask_cuda(const DeviceMaskBuild& b, BlockMaskTensors& t, Stream stream);
// build_doc_padded_mask's device path (block_mask_cuda.cu): per batch row of
// the two sides' ids ([B, seq], batch strides ids_*_stride_b, 0 to broadcast; the layout from
// the query side's), the padded layout's ids and real rows ([B, padded] each, padded >= every
// row's padded length: doc_padded_length_bound), in chunks of kDocPadChunk tokens, on `stream` of
// `device`. The scratch arrays come from the caller (doc_pad_layout_scratch_words: one int64
// tensor, split by doc_pad_layout_scratch).
inline constexpr int64_t kDocPadChunk = 2048;
struct DocPadLayoutArgs {
  const int32_t *ids_q, *ids_kv;
  int64_t ids_q_stride_b, ids_kv_stride_b, batch, seq, chunks, min_length, padded;
  int32_t *doc_q, *doc_kv, *real_rows;           // [batch, padded] outputs
  DocPadStep* chunk_step;                          // scratch [batch, chunks]
  int32_t *starts, *chunk_starts, *chunk_max;     // scratch [batch, seq], [batch, chunks] x 2
};
inline int64_t doc_pad_chunks(int64_t seq) { return (seq + kDocPadChunk - 1) / kDocPadChunk; }
inline int64_t doc_pad_layout_scratch_words(int64_t batch, int64_t seq) {
  static_assert(sizeof(DocPadStep) % 8 == 0 && alignof(DocPadStep) <= 8, "DocPadStep in int64 words");
  const int64_t n = batch * doc_pad_chunks(seq);
  return n * int64_t(sizeof(DocPadStep) / 8) + (batch * seq + 2 * n + 1) / 2;
}
// The scratch's arrays in `scratch` (doc_pad_layout_scratch_words int64 words), chunks set.
inline void doc_pad_layout_scratch(int64_t* scratch, DocPadLayoutArgs* a) {
  a->chunks = doc_pad_chunks(a->seq);
  const int64_t n = a->batch * a->chunks;
  a->chunk_step = reinterpret_cast<DocPadStep*>(scratch);
  a->starts = reinterpret_cast<int32_t*>(scratch + n * int64_t(sizeof(DocPadStep) / 8));
  a->chunk_starts = a->starts + a->batch * a->seq;
  a->chunk_max = a->chunk_starts + n;
}
void doc_padded_layout_cuda(DocPadLayoutArgs a, int device, Stream stream);
// document_ids_from_cu_seqlens's device path (cu_seqlens_cuda.cu): ids[p] =
// document_of_position(cu, num_docs, p, padding_id) for p in [0, seq), one thread per position,
// on `stream` of `device`.
void document_ids_from_cu_seqlens_cuda(const int32_t* cu, int64_t num_docs, int32_t padding_id, int32_t* ids,
                                       int64_t seq, int device, Stream stream);

}  // namespace sparsetrain

// Documents in FlashAttention's packed form (flash_attn_varlen_func's cu_seqlens_q / cu_seqlens_k)
// turned into the document ids that MaskSpec's document kinds take, on the offsets' own device
// (a small kernel on CUDA, no host synchronisation; plain loops on the CPU). Everything after the
// conversion is the document-id path: build_block_mask, the attention forward and backward.
//
// cu_seqlens_q, cu_seqlens_k: int32 [n + 1] for n documents, cumulative (FlashAttention's
// convention: cu[0] = 0, non-decreasing); document i holds query positions [cu_seqlens_q[i],
// cu_seqlens_q[i + 1]) and key positions [cu_seqlens_k[i], cu_seqlens_k[i + 1]) of one packed batch
// row (q [1, seq_q, H, D], k and v [1, seq_kv, H, D]; seq_q >= cu_seqlens_q[n] usually equal).
// Document i gets id i; a position past the last offset (padding up to a static seq_q / seq_kv)
// gets id n on the query side and n + 1 on the key side, so it matches nothing: such a query row
// has no allowed key (o = 0, lse = -inf) and such a key is seen by no query.
//
// Causal documents: MaskKind::kDocumentCausal is "same document and kv <= q" in packed (global)
// positions. FlashAttention's varlen causal aligns each document's causal mask bottom-right
// (local key j <= local query i + len_k - len_q). The two agree when cu_seqlens_q ==
// cu_seqlens_k (self-attention packing, the common case). With different query and key
// documents, kDocument (no causal part) means the same as FlashAttention's non-causal varlen for
// any lengths; kDocumentCausal then is the global-position rule above, not FlashAttention's.
// The max lengths (max_seqlen_q / max_seqlen_k) that FlashAttention also takes are not needed.
#pragma once

#include <cstdint>

#include "sparsetrain/allocator.h"
#include "sparsetrain/mask_spec.h"
#include "sparsetrain/tensor.h"

namespace sparsetrain {

// Owning document ids made from cu_seqlens: int32 [1, seq_q] and [1, seq_kv] on the offsets'
// device (they broadcast over the attention's batch, normally 1 for packed sequences).
struct DocumentIds {
  Tensor doc_q, doc_kv;
  // A document spec (kind kDocument or kDocumentCausal) viewing these ids; keep *this alive.
  MaskSpec spec(MaskKind kind) const;
};

// Checks without reading the offsets' values (no synchronisation): both defined, int32, 1-D with
// a unit stride, the same length (>= 1: the same number of documents on both sides), the same
// device; seq_q, seq_kv >= 1. Offsets in host memory are also checked by value (cu[0] == 0,
// non-decreasing, cu[n] <= seq); device offsets are not (invalid ones give some document ids, never
// an out-of-bounds access). Memory from `allocator` (default_allocator() if null), on `stream`.
DocumentIds document_ids_from_cu_seqlens(const TensorView& cu_seqlens_q, const TensorView& cu_seqlens_k,
                                         int64_t seq_q, int64_t seq_kv, Allocator* allocator = nullptr,
                                         Stream stream = {});

}  // namespace sparsetrain

// The mask of a block-sparse attention at element level: a built-in spec (fast paths in the
// kernels) or, for anything else, per-partial-block bitmasks (see block_mask.h). Positions are
// absolute: query row q in [0, Sq), key column kv in [0, Skv).
#pragma once

#include <cstdint>
#include <string>

#include "sparsetrain/tensor.h"

namespace sparsetrain {

enum class MaskKind : int32_t {
  kFull,               // every pair
  kCausal,             // kv <= q (top-left aligned: FlexAttention's convention)
  kCausalBottomRight,  // kv <= q + (Skv - Sq) (FlashAttention's convention for Sq != Skv)
  kSlidingWindow,      // q - window_left <= kv <= q + window_right (a negative bound: unbounded)
  kDocument,           // doc_q[b, q] == doc_kv[b, kv]
  kDocumentCausal,     // same document and kv <= q
  kPrefixLM,           // kv <= q or kv < prefix_length
  kBitmask,            // per-partial-block bitmasks (BlockMask::partial_bitmasks)
};

struct MaskSpec {
  MaskKind kind = MaskKind::kFull;
  int64_t window_left = -1, window_right = -1;  // kSlidingWindow; window_right = 0 is causal
  int64_t prefix_length = 0;                    // kPrefixLM
  // kDocument / kDocumentCausal: int32 document id per position, [B or 1, Sq] and [B or 1, Skv]
  // (host memory for the CPU backend and the builders).
  TensorView doc_q, doc_kv;

  std::string str() const;  // e.g. "sliding_window(left=2048, right=0)"
};

// The kinds' names ("full", "causal", "causal_bottom_right", "sliding_window", "document",
// "document_causal", "prefix_lm", "bitmask"), as the Python and torch fronts spell them, and the
// inverse (an invalid-argument error naming `kind` for any other string).
const char* mask_kind_name(MaskKind kind);
MaskKind parse_mask_kind(const std::string& name);

}  // namespace sparsetrain

// Whether query q may attend to key kv under a built-in MaskSpec: plain host/device code, the one
// definition the builders, the CPU reference and the kernels share (tested on the CPU).
// doc_q / doc_kv: the rows of batch b of the document ids (nullptr unless a document mask).
#pragma once

#include <cstdint>

#include "common/host_device.h"
#include "sparsetrain/mask_spec.h"

namespace sparsetrain {

// The kinds that read document ids (MaskSpec::doc_q / doc_kv): kDocument and kDocumentCausal.
ST_HOST_DEVICE constexpr bool mask_has_documents(MaskKind kind) {
  return kind == MaskKind::kDocument || kind == MaskKind::kDocumentCausal;
}

ST_HOST_DEVICE inline bool mask_allows(MaskKind kind, int64_t window_left, int64_t window_right,
                                       int64_t prefix_length, const int32_t* doc_q, const int32_t* doc_kv,
                                       int64_t seq_q, int64_t seq_kv, int64_t q, int64_t kv) {
  switch (kind) {
    case MaskKind::kFull: return true;
    case MaskKind::kCausal: return kv <= q;
    case MaskKind::kCausalBottomRight: return kv <= q + (seq_kv - seq_q);
    case MaskKind::kSlidingWindow:
      return (window_left < 0 || kv >= q - window_left) && (window_right < 0 || kv <= q + window_right);
    case MaskKind::kDocument: return doc_q[q] == doc_kv[kv];
    case MaskKind::kDocumentCausal: return doc_q[q] == doc_kv[kv] && kv <= q;
    case MaskKind::kPrefixLM: return kv <= q || kv < prefix_length;
    case MaskKind::kBitmask: return false;  // not a built-in spec: read the block's bitmask
  }
  return false;
}

// The specs whose allowed keys for query q are a band along the diagonal, lo <= kv - q < hi
// (causal, bottom-right causal, sliding windows), or false for the others. The backward's
// transposed tiles hold 16 queries a thread and few keys: there one bound pair for the tile and one
// add and compare per element replace an interval per query (int64, a switch on the kind). In
// int32: kernels bound Sq and Skv below 2^30, so kv - q lies in (-2^30, 2^30), and an open or wider
// side is clamped to +-2^30, which no kv - q reaches. Intersect with kv < seq_kv for the bound.
inline constexpr int32_t kMaskBandOpen = int32_t(1) << 30;
ST_HOST_DEVICE inline bool mask_band(MaskKind kind, int64_t window_left, int64_t window_right, int64_t seq_q,
                                     int64_t seq_kv, int32_t* lo, int32_t* hi) {
  auto clamp = [](int64_t v) {
    return int32_t(v < -kMaskBandOpen ? -kMaskBandOpen : v > kMaskBandOpen ? kMaskBandOpen : v);
  };
  *lo = -kMaskBandOpen;
  *hi = kMaskBandOpen;
  switch (kind) {
    case MaskKind::kCausal: *hi = 1; return true;
    case MaskKind::kCausalBottomRight: *hi = clamp(seq_kv - seq_q + 1); return true;
    case MaskKind::kSlidingWindow:
      if (window_left >= 0) *lo = clamp(-window_left);
      if (window_right >= 0) *hi = clamp(window_right + 1);
      return true;
    default: return false;
  }
}

// Whether kv - q = d lies in the band [lo, hi), with one unsigned compare (hi - lo <= 2^31 and
// d - lo wraps to a large value below lo).
ST_HOST_DEVICE constexpr bool in_mask_band(int32_t d, int32_t lo, int32_t hi) {
  return uint32_t(d) - uint32_t(lo) < uint32_t(hi) - uint32_t(lo);
}

// The specs whose allowed keys for a query form one interval: [lo, hi) for query q, or false
// for the others (documents, bitmasks). The kernels mask a partial tile with two compares per
// element instead of evaluating the spec per element. Intersect with [0, seq_kv) for the bound.
// The band specs' interval is their band moved to q (an open side then lies outside [0, seq_kv);
// so, as mask_band, for Sq and Skv below 2^30: the kernels' bound, checked by the backend).
ST_HOST_DEVICE inline bool mask_row_interval(MaskKind kind, int64_t window_left, int64_t window_right,
                                             int64_t prefix_length, int64_t seq_q, int64_t seq_kv, int64_t q,
                                             int64_t* lo, int64_t* hi) {
  int32_t band_lo, band_hi;
  if (mask_band(kind, window_left, window_right, seq_q, seq_kv, &band_lo, &band_hi)) {
    *lo = q + band_lo;
    *hi = q + band_hi;
    return true;
  }
  *lo = 0;
  *hi = seq_kv;
  switch (kind) {
    case MaskKind::kFull: return true;
    case MaskKind::kPrefixLM: *hi = q + 1 > prefix_length ? q + 1 : prefix_length; return true;
    default: return false;  // documents, bitmasks
  }
}

// A partial block's bitmask (BlockMask::partial_bitmasks: bit row * block_kv + col of the block,
// bytes LSB first) read as 32-bit words, as the kernels read it: the word holding (row, col) in a
// block block_kv wide (a multiple of 32, so a row starts on a word), in int32 (a block's bits are
// few; a 64-bit address per query spilled the backward's consumers); the bit is col & 31.
ST_HOST_DEVICE constexpr int32_t bitmask_word(int32_t row, int32_t col, int32_t block_kv) {
  return row * (block_kv >> 5) + (col >> 5);
}

}  // namespace sparsetrain

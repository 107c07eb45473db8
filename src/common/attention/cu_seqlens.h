// FlashAttention's packed documents (cu_seqlens, include/sparsetrain/cu_seqlens.h) -> the document id
// of one position: plain host/device code, run by the host conversion and, one thread per position,
// by the CUDA one (src/cuda/block_mask/cu_seqlens_cuda.cu), so both give the same ids.
// Document i holds positions [cu[i], cu[i + 1]); positions in no document (past cu[n], or before
// cu[0] when cu[0] != 0) get the side's padding id, which matches no id of the other side.
#pragma once

#include <cstdint>

#include "common/host_device.h"

namespace sparsetrain {

// Padding ids: n and n + 1 for n documents. Both sides' ids stay non-decreasing (the cheap,
// sorted case of the block classifier) and a padded query meets no key at all.
enum class CuSeqlensSide : int32_t { kQuery = 0, kKey = 1 };
ST_HOST_DEVICE inline int32_t cu_seqlens_padding_id(int64_t num_docs, CuSeqlensSide side) {
  return int32_t(num_docs) + int32_t(side);
}

// The document of `pos` given cu[0..num_docs] (cumulative offsets, non-decreasing): the largest i
// with cu[i] <= pos, by binary search, when i < num_docs; otherwise `padding_id`. Empty documents
// (cu[i] == cu[i + 1]) hold no position. Offsets that decrease (invalid; a device tensor is not
// checked) still give an id in [0, num_docs) or the padding id, never an out-of-range read.
ST_HOST_DEVICE inline int32_t document_of_position(const int32_t* cu, int64_t num_docs, int64_t pos,
                                                   int32_t padding_id) {
  if (num_docs <= 0 || pos < int64_t(cu[0]) || pos >= int64_t(cu[num_docs])) return padding_id;
  // Invariant: cu[lo] <= pos < cu[hi].
  int64_t lo = 0, hi = num_docs;
  while (hi - lo > 1) {
    const int64_t mid = lo + (hi - lo) / 2;
    if (int64_t(cu[mid]) <= pos) lo = mid;
    else hi = mid;
  }
  return int32_t(lo);
}

}  // namespace sparsetrain

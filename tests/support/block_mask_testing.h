// Test support for block masks: the brute-force block classes of a built-in spec (an element
// predicate of its own, written from the spec's definitions in docs/DESIGN.md section 6 and not from
// the library's mask_allows, so that a wrong rule there is not mirrored here) and the dense class
// matrix [Mq, Nk] read back from a mask's forward or transposed lists.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

#include "ops/block_mask_internal.h"
#include "sparsetrain/block_mask.h"

namespace sparsetrain::testing {

// Whether query q may attend key kv under a built-in spec, stated as each convention reads:
// FlexAttention's causal keeps keys at or before the query (top-left aligned); FlashAttention's
// bottom-right causal aligns the last query with the last key; a window bound < 0 is unbounded.
inline bool spec_allows(const MaskSpec& s, const int32_t* doc_q, const int32_t* doc_kv, int64_t seq_q,
                        int64_t seq_kv, int64_t q, int64_t kv) {
  const bool same_doc = (doc_q != nullptr && doc_kv != nullptr) && doc_q[q] == doc_kv[kv];
  const int64_t ahead = kv - q;  // > 0: the key lies after the query
  switch (s.kind) {
    case MaskKind::kFull: return true;
    case MaskKind::kCausal: return ahead <= 0;
    case MaskKind::kCausalBottomRight: return (seq_kv - 1 - kv) >= (seq_q - 1 - q);  // key no nearer the end
    case MaskKind::kSlidingWindow:
      return !(s.window_left >= 0 && -ahead > s.window_left) && !(s.window_right >= 0 && ahead > s.window_right);
    case MaskKind::kDocument: return same_doc;
    case MaskKind::kDocumentCausal: return same_doc && ahead <= 0;
    case MaskKind::kPrefixLM: return ahead <= 0 || kv < s.prefix_length;  // the prefix is seen by all
    case MaskKind::kBitmask: break;
  }
  ADD_FAILURE() << "spec_allows: no element rule for a bitmask spec";
  return false;
}

// 0 skipped, 1 partial, 2 full, over the elements inside the sequences.
inline std::vector<uint8_t> brute_force_classes(const MaskSpec& s, const int32_t* doc_q, const int32_t* doc_kv,
                                                int64_t seq_q, int64_t seq_kv, int64_t bq, int64_t bk) {
  const int64_t Mq = (seq_q + bq - 1) / bq, Nk = (seq_kv + bk - 1) / bk;
  std::vector<int64_t> allowed(size_t(Mq * Nk), 0), total(size_t(Mq * Nk), 0);
  for (int64_t q = 0; q < seq_q; ++q)
    for (int64_t kv = 0; kv < seq_kv; ++kv) {
      const size_t i = size_t((q / bq) * Nk + kv / bk);
      ++total[i];
      if (spec_allows(s, doc_q, doc_kv, seq_q, seq_kv, q, kv))
        ++allowed[i];
    }
  std::vector<uint8_t> c(size_t(Mq * Nk));
  for (size_t i = 0; i < c.size(); ++i) c[i] = allowed[i] == 0 ? 0 : allowed[i] == total[i] ? 2 : 1;
  return c;
}

// Classes from the forward lists (kv side) or the transposes (q side) of slice (b, h).
inline std::vector<uint8_t> classes_of(const BlockMask& m, int64_t b, int64_t h, bool q_side) {
  const int64_t Mq = m.num_q_blocks(), Nk = m.num_kv_blocks();
  std::vector<uint8_t> c(size_t(Mq * Nk), 0);
  const IndexRows p = q_side ? mask_rows(m.q_num_blocks, m.q_indices, b, h) : mask_rows(m.kv_num_blocks, m.kv_indices, b, h);
  const IndexRows f = q_side ? mask_rows(m.full_q_num_blocks, m.full_q_indices, b, h)
                             : mask_rows(m.full_kv_num_blocks, m.full_kv_indices, b, h);
  const int64_t rows = q_side ? Nk : Mq;
  for (int64_t r = 0; r < rows; ++r) {
    for (int32_t i = 0; i < p.count(r); ++i)
      c[size_t(q_side ? p.at(r, i) * Nk + r : r * Nk + p.at(r, i))] = 1;
    for (int32_t i = 0; i < f.count(r); ++i)
      c[size_t(q_side ? f.at(r, i) * Nk + r : r * Nk + f.at(r, i))] = 2;
  }
  return c;
}

}  // namespace sparsetrain::testing

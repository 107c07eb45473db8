// Test support for block masks: the brute-force block classes of a built-in spec (mask_allows per
// element) and the dense class matrix [Mq, Nk] read back from a mask's forward or transposed lists.
#pragma once

#include <cstdint>
#include <vector>

#include "common/mask_predicate.h"
#include "ops/block_mask_internal.h"
#include "sparsetrain/block_mask.h"

namespace sparsetrain::testing {

// 0 skipped, 1 partial, 2 full, over the elements inside the sequences.
inline std::vector<uint8_t> brute_force_classes(const MaskSpec& s, const int32_t* doc_q, const int32_t* doc_kv,
                                                int64_t seq_q, int64_t seq_kv, int64_t bq, int64_t bk) {
  const int64_t Mq = (seq_q + bq - 1) / bq, Nk = (seq_kv + bk - 1) / bk;
  std::vector<int64_t> allowed(size_t(Mq * Nk), 0), total(size_t(Mq * Nk), 0);
  for (int64_t q = 0; q < seq_q; ++q)
    for (int64_t kv = 0; kv < seq_kv; ++kv) {
      const size_t i = size_t((q / bq) * Nk + kv / bk);
      ++total[i];
      if (mask_allows(s.kind, s.window_left, s.window_right, s.prefix_length, doc_q, doc_kv, seq_q, seq_kv, q, kv))
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

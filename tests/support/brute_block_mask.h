// A test-side block mask built by brute force from an element predicate, with no library code:
// every (q block, kv block) pair is classified by looking at each of its elements (positions
// past Sq / Skv in the last blocks do not count): none allowed -> skipped, all -> full (or
// partial when full blocks are off), else partial with a bitmask. Lists are ascending; index
// tensors are full-width (FlexAttention's) or compact (width = the largest count, or more).
// Padding entries past a count are 0 so that reading one would count block 0 twice and show.
#pragma once

#include <algorithm>
#include <cstdint>
#include <functional>
#include <vector>

#include "host_tensor.h"
#include "sparsetrain/block_mask.h"

namespace sparsetrain::testing {

// allowed(b, h, q, kv) over mask batch / head indices (the mask's own leading dims).
using ElementPredicate = std::function<bool(int64_t b, int64_t h, int64_t q, int64_t kv)>;

struct BruteMaskOptions {
  int64_t block_q = 128, block_kv = 128;
  bool use_full = true;    // all-allowed blocks go to full_kv_* (else they stay partial)
  bool compact = false;    // index width = the largest count (+ extra_width) instead of Mq / Nk
  int64_t extra_width = 0;
  bool bitmasks = false;   // store per-partial-block bitmasks (MaskKind::kBitmask)
  bool transposes = true;  // q_* lists for backward
};

class BruteBlockMask {
 public:
  BruteBlockMask(const ElementPredicate& allowed, const MaskSpec& spec, int64_t batch, int64_t heads, int64_t seq_q,
                 int64_t seq_kv, const BruteMaskOptions& o)
      : B_(batch), H_(heads) {
    mask.seq_q = seq_q;
    mask.seq_kv = seq_kv;
    mask.block_q = o.block_q;
    mask.block_kv = o.block_kv;
    mask.spec = spec;
    if (o.bitmasks) mask.spec.kind = MaskKind::kBitmask;
    Mq_ = mask.num_q_blocks();
    Nk_ = mask.num_kv_blocks();
    kind_.assign(size_t(B_ * H_ * Mq_ * Nk_), 0);
    for (int64_t b = 0; b < B_; ++b)
      for (int64_t h = 0; h < H_; ++h)
        for (int64_t m = 0; m < Mq_; ++m)
          for (int64_t n = 0; n < Nk_; ++n) {
            int64_t yes = 0, all = 0;
            for (int64_t i = m * o.block_q; i < std::min((m + 1) * o.block_q, seq_q); ++i)
              for (int64_t j = n * o.block_kv; j < std::min((n + 1) * o.block_kv, seq_kv); ++j, ++all)
                yes += allowed(b, h, i, j) ? 1 : 0;
            kind_[size_t(((b * H_ + h) * Mq_ + m) * Nk_ + n)] = yes == 0 ? 0 : (yes == all && o.use_full ? 2 : 1);
          }
    // Forward lists (per q block), then the transposes (per kv column).
    build_lists(1, false, o, kv_num, kv_idx);
    if (o.use_full) build_lists(2, false, o, full_kv_num, full_kv_idx);
    if (o.transposes) {
      build_lists(1, true, o, q_num, q_idx);
      if (o.use_full) build_lists(2, true, o, full_q_num, full_q_idx);
    }
    mask.kv_num_blocks = kv_num.view();
    mask.kv_indices = kv_idx.view();
    if (o.use_full) {
      mask.full_kv_num_blocks = full_kv_num.view();
      mask.full_kv_indices = full_kv_idx.view();
    }
    if (o.transposes) {
      mask.q_num_blocks = q_num.view();
      mask.q_indices = q_idx.view();
      if (o.use_full) {
        mask.full_q_num_blocks = full_q_num.view();
        mask.full_q_indices = full_q_idx.view();
      }
    }
    if (o.bitmasks) {
      const int64_t W = kv_idx.view().size(3), bytes = (o.block_q * o.block_kv + 7) / 8;
      bitmasks = HostTensor(DType::kUInt8, {B_, H_, Mq_, W, bytes});
      auto* bits = static_cast<uint8_t*>(bitmasks.data());
      for (int64_t b = 0; b < B_; ++b)
        for (int64_t h = 0; h < H_; ++h)
          for (int64_t m = 0; m < Mq_; ++m)
            for (int64_t w = 0; w < int64_t(kv_num.get((b * H_ + h) * Mq_ + m)); ++w) {
              const int64_t n = int64_t(kv_idx.get(((b * H_ + h) * Mq_ + m) * W + w));
              uint8_t* blk = bits + (((b * H_ + h) * Mq_ + m) * W + w) * bytes;
              for (int64_t i = m * o.block_q; i < std::min((m + 1) * o.block_q, seq_q); ++i)
                for (int64_t j = n * o.block_kv; j < std::min((n + 1) * o.block_kv, seq_kv); ++j)
                  if (allowed(b, h, i, j)) {
                    const int64_t bit = (i - m * o.block_q) * o.block_kv + (j - n * o.block_kv);
                    blk[bit / 8] = uint8_t(blk[bit / 8] | (1u << (bit % 8)));
                  }
            }
      mask.partial_bitmasks = bitmasks.view();
    }
  }

  // 0 skipped, 1 partial, 2 full.
  int block_kind(int64_t b, int64_t h, int64_t m, int64_t n) const {
    return kind_[size_t(((b * H_ + h) * Mq_ + m) * Nk_ + n)];
  }

  BlockMask mask;
  HostTensor kv_num, kv_idx, full_kv_num, full_kv_idx, q_num, q_idx, full_q_num, full_q_idx, bitmasks;

 private:
  void build_lists(int kind, bool transposed, const BruteMaskOptions& o, HostTensor& num, HostTensor& idx) const {
    const int64_t rows = transposed ? Nk_ : Mq_, cols = transposed ? Mq_ : Nk_;
    std::vector<std::vector<int32_t>> lists(size_t(B_ * H_ * rows));
    int64_t widest = 0;
    for (int64_t b = 0; b < B_; ++b)
      for (int64_t h = 0; h < H_; ++h)
        for (int64_t r = 0; r < rows; ++r) {
          auto& l = lists[size_t((b * H_ + h) * rows + r)];
          for (int64_t c = 0; c < cols; ++c)
            if (block_kind(b, h, transposed ? c : r, transposed ? r : c) == kind) l.push_back(int32_t(c));
          widest = std::max<int64_t>(widest, int64_t(l.size()));
        }
    const int64_t W = o.compact ? widest + o.extra_width : cols;
    num = HostTensor(DType::kInt32, {B_, H_, rows});
    idx = HostTensor(DType::kInt32, {B_, H_, rows, W});
    for (size_t r = 0; r < lists.size(); ++r) {
      num.set(int64_t(r), double(lists[r].size()));
      for (size_t w = 0; w < lists[r].size(); ++w) idx.set(int64_t(r) * W + int64_t(w), lists[r][w]);
    }
  }

  int64_t B_, H_, Mq_ = 0, Nk_ = 0;
  std::vector<int> kind_;
};

}  // namespace sparsetrain::testing

// A BlockMask as both Python bindings receive it: `sparsetrain._block_mask.wire(mask)` lays it out
// once, the numpy/DLPack module `_C` and the C++ torch library read it here. Flat rather than a
// dict so that torch's operators can take it (a schema holds tensors, ints and strings, and
// torch.compile must see every tensor an operator reads):
//   tensors (kTensors, absent ones empty; absent ones at the end may be left off, as
//     sparsetrain.torch does: each costs a call from Python a conversion): the 11 index tensors (kBlockMaskTensors order),
//     doc_q, doc_kv, real_rows, the schedule permutation (a host int32 / int64 array of column
//     ids), then the padded backward form's 10 list tensors (a document kind: no bitmasks), its
//     doc_q, doc_kv and real_rows;
//   sizes (kWireSizes): seq_q, seq_kv, block_q, block_kv, window_left, window_right,
//     prefix_length, and the padded form's length (0: none);
//   kinds: "kind,schedule,walk" (the padded form has the mask's kind, schedule and walk).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "sparsetrain/block_mask.h"
#include "sparsetrain/error.h"

namespace sparsetrain::wire {

constexpr int kTensors = kBlockMaskTensors + 4 + 13;
constexpr int kSizes = 8;
constexpr int kPaddedLists = 10;  // the padded form's tensors: the lists, no partial bitmasks
constexpr int kPermutation = kBlockMaskTensors + 3;

// A mask and its padded backward form: mask.backward_padded points into `padded`, which a move
// keeps where it is.
struct Mask {
  BlockMask mask;
  std::unique_ptr<BlockMask> padded;
};

inline std::vector<int32_t> permutation_of(const TensorView& p) {
  ST_CHECK_ARG(p.defined() && p.device().is_cpu() && p.dim() == 1 &&
                   (p.dtype() == DType::kInt32 || p.dtype() == DType::kInt64),
               "schedule_permutation", "a 1-d host int32 or int64 array of column ids",
               p.defined() ? p.str() : std::string("none"));
  std::vector<int32_t> v(size_t(p.size(0)));
  for (int64_t i = 0; i < p.size(0); ++i)
    v[size_t(i)] = p.dtype() == DType::kInt32 ? p.data_as<const int32_t>()[i * p.stride(0)]
                                              : int32_t(p.data_as<const int64_t>()[i * p.stride(0)]);
  return v;
}

// The mask of a wire: `view_of(i, name)` is tensor i (< num_tensors) as a view, empty where
// absent; `sizes` the kSizes sizes.
template <class ViewOf, class Sizes>
Mask parse(ViewOf&& view_of, int64_t num_tensors, const Sizes& sizes, std::string_view kinds) {
  ST_CHECK_ARG(num_tensors <= kTensors, "mask tensors",
               "at most 28 (the index tensors, doc_q, doc_kv, real_rows, the permutation; the padded form's lists, "
               "ids and real_rows)",
               num_tensors);
  ST_CHECK_ARG(sizes.size() == size_t(kSizes), "mask sizes", "8", sizes.size());
  auto view = [&](int i, const char* name) { return i < num_tensors ? view_of(i, name) : TensorView(); };
  const size_t c1 = kinds.find(','), c2 = c1 == kinds.npos ? kinds.npos : kinds.find(',', c1 + 1);
  ST_CHECK_ARG(c2 != kinds.npos, "mask kinds", "\"kind,schedule,walk\"", std::string(kinds));
  Mask parsed;
  BlockMask& m = parsed.mask;
  m.seq_q = sizes[0], m.seq_kv = sizes[1], m.block_q = sizes[2], m.block_kv = sizes[3];
  for (int i = 0; i < kBlockMaskTensors; ++i) block_mask_tensor(m, i) = view(i, block_mask_tensor_name(i));
  m.spec.kind = parse_mask_kind(std::string(kinds.substr(0, c1)));
  m.spec.window_left = sizes[4], m.spec.window_right = sizes[5], m.spec.prefix_length = sizes[6];
  m.spec.doc_q = view(kBlockMaskTensors, "doc_q");
  m.spec.doc_kv = view(kBlockMaskTensors + 1, "doc_kv");
  m.real_rows = view(kBlockMaskTensors + 2, "real_rows");
  m.schedule.kind = parse_schedule_kind(std::string(kinds.substr(c1 + 1, c2 - c1 - 1)));
  m.schedule.walk = parse_walk_order(std::string(kinds.substr(c2 + 1)));
  if (m.schedule.kind == ScheduleKind::kPermutation)
    m.schedule.permutation = permutation_of(view(kPermutation, "schedule_permutation"));
  if (sizes[7] > 0) {
    ST_CHECK_ARG(m.schedule.kind != ScheduleKind::kPermutation, "mask schedule",
                 "left_to_right or shortest_first with a padded backward form (a permutation names the mask's columns)",
                 "permutation");
    parsed.padded = std::make_unique<BlockMask>();
    BlockMask& pm = *parsed.padded;
    pm.seq_q = pm.seq_kv = sizes[7];
    pm.block_q = m.block_q, pm.block_kv = m.block_kv;
    constexpr int first = kPermutation + 1;
    for (int i = 0; i < kPaddedLists; ++i) block_mask_tensor(pm, i) = view(first + i, block_mask_tensor_name(i));
    pm.spec = m.spec;
    pm.spec.doc_q = view(first + kPaddedLists, "backward_padded doc_q");
    pm.spec.doc_kv = view(first + kPaddedLists + 1, "backward_padded doc_kv");
    pm.real_rows = view(first + kPaddedLists + 2, "backward_padded real_rows");
    pm.schedule.kind = m.schedule.kind;
    pm.schedule.walk = m.schedule.walk;
    m.backward_padded = &pm;
  }
  return parsed;
}

}  // namespace sparsetrain::wire

// One int32 tensor of a block mask (counts [B, H, R], lists [B, H, R, W], the write orders
// parallel to the lists) as every reader sees it: the one spelling of broadcast, clamp and find
// for the builders, the validator, the CPU reference, the scheduler model and the kernels.
// Leading dims of size 1 broadcast over the attention's batch and heads (stride 0), so callers
// index with the attention's (b, h); a device mask is never trusted, hence counts clamped to the
// list width before they index it. A view owns nothing; a null `data` is an absent tensor.
#pragma once

#include <cstdint>

#include "common/group_offsets.h"  // ST_HOST_DEVICE
#include "sparsetrain/tensor.h"

namespace sparsetrain {

// T: const int32_t for readers, int32_t for the builders writing write orders.
template <typename T>
struct MaskIndexViewOf {
  T* data = nullptr;
  int64_t stride_b = 0, stride_h = 0, stride_r = 0, stride_w = 0;
  int32_t width = 0;  // of the last dim (lists); counts are clamped to it

  ST_HOST_DEVICE T* row(int64_t b, int64_t h, int64_t r) const {
    return data + b * stride_b + h * stride_h + r * stride_r;
  }
  // Entry i of row r (i = 0 for a count tensor, whose stride_w is 0).
  ST_HOST_DEVICE T& at(int64_t b, int64_t h, int64_t r, int64_t i = 0) const { return row(b, h, r)[i * stride_w]; }
  // The (b, h) slice, read with b = h = 0 (a host loop over one slice's rows).
  ST_HOST_DEVICE MaskIndexViewOf slice(int64_t b, int64_t h) const {
    return {data != nullptr ? row(b, h, 0) : nullptr, 0, 0, stride_r, stride_w, width};
  }
};
using MaskIndexView = MaskIndexViewOf<const int32_t>;
using MaskIndexOut = MaskIndexViewOf<int32_t>;

// The view of a mask's int32 tensor [B, H, R(, W)] (host side: kernel arguments, builders,
// validator, reference): a leading dim of size 1 broadcasts; an undefined tensor gives the absent
// view.
template <typename T = const int32_t>
inline MaskIndexViewOf<T> mask_index_view(const TensorView& t) {
  MaskIndexViewOf<T> v;
  if (!t.defined()) return v;
  v.data = static_cast<T*>(t.data());
  v.stride_b = t.broadcast_stride(0);
  v.stride_h = t.broadcast_stride(1);
  v.stride_r = t.stride(2);
  v.stride_w = t.dim() > 3 ? t.stride(3) : 0;
  v.width = t.dim() > 3 ? int32_t(t.size(3)) : 0;
  return v;
}

// Row m's count, clamped to [0, the list's width] (0 when either tensor is absent).
ST_HOST_DEVICE inline int32_t clamp_count(const MaskIndexView& counts, const MaskIndexView& index, int64_t b, int64_t h,
                                          int64_t m) {
  if (counts.data == nullptr || index.data == nullptr) return 0;
  const int32_t c = *counts.row(b, h, m);
  return c < 0 ? 0 : (c > index.width ? index.width : c);
}

// Where `value` sits among the first `count` entries of row r (ascending), or -1.
ST_HOST_DEVICE inline int32_t find_sorted(const MaskIndexView& index, int64_t b, int64_t h, int64_t r, int32_t count,
                                          int32_t value) {
  int32_t lo = 0, hi = count - 1;
  const int32_t* row = index.data != nullptr ? index.row(b, h, r) : nullptr;
  while (lo <= hi) {
    const int32_t mid = (lo + hi) / 2;
    const int32_t v = row[int64_t(mid) * index.stride_w];
    if (v == value) return mid;
    if (v < value) lo = mid + 1;
    else hi = mid - 1;
  }
  return -1;
}

// The entry of value n in row m of a sorted list, its count clamped (a device mask), or -1.
ST_HOST_DEVICE inline int32_t find_in_row(const MaskIndexView& count, const MaskIndexView& index, int64_t b, int64_t h,
                                          int64_t m, int32_t n) {
  return find_sorted(index, b, h, m, clamp_count(count, index, b, h, m), n);
}

}  // namespace sparsetrain

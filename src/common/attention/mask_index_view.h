// One int32 tensor of a block mask (counts [B, H, R], lists [B, H, R, W], the write orders
// parallel to the lists) as every reader sees it: the one spelling of broadcast, clamp and find
// for the builders, the validator, the CPU reference, the scheduler model and the kernels.
// Leading dims of size 1 broadcast over the attention's batch and heads (stride 0), so callers
// index with the attention's (b, h); a device mask is never trusted, hence counts clamped to the
// list width before they index it. A view owns nothing; a null `data` is an absent tensor.
#pragma once

#include <cstdint>
#include <limits>

#include "common/host_device.h"
#include "sparsetrain/tensor.h"

namespace sparsetrain {

// T: const int32_t for readers, int32_t for the builders writing write orders.
template <typename T>
struct MaskIndexViewOf {
  T* data = nullptr;
  int64_t stride_b = 0, stride_h = 0, stride_r = 0, stride_w = 0;
  int32_t width = 0;  // of the last dim (lists); counts are clamped to it

  ST_HOST_DEVICE T* row(int64_t b, int64_t h, int64_t r) const { return row_in<int64_t>(b, h, r); }
  // row() with the offset computed in Index: int32_t for a reader whose tensors are known to have
  // every element offset below 2^31 (offsets_fit_int32; the backward kernel's walk, where the
  // int64 products spilled its 40-register producer threads).
  template <typename Index>
  ST_HOST_DEVICE T* row_in(int64_t b, int64_t h, int64_t r) const {
    return data + (Index(b) * Index(stride_b) + Index(h) * Index(stride_h) + Index(r) * Index(stride_r));
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

// The largest element offset of t (0 for an absent or empty tensor), and whether every offset is
// below 2^31, so that a reader may index it in int32 (MaskIndexViewOf::row_in<int32_t>). Host side.
// (Saturates at INT64_MAX instead of wrapping.)
inline int64_t max_element_offset(const TensorView& t) {
  if (!t.defined() || t.numel() == 0) return 0;
  constexpr int64_t kMax = std::numeric_limits<int64_t>::max();
  int64_t last = 0;
  for (int d = 0; d < t.dim(); ++d) {
    if (t.stride(d) == std::numeric_limits<int64_t>::min()) return kMax;
    const int64_t stride = t.stride(d) < 0 ? -t.stride(d) : t.stride(d), steps = t.size(d) - 1;
    if (stride != 0 && steps > (kMax - last) / stride) return kMax;
    last += steps * stride;
  }
  return last;
}
inline bool offsets_fit_int32(const TensorView& t) { return max_element_offset(t) < (int64_t(1) << 31); }

// Row m's count, clamped to [0, the list's width] (0 when either tensor is absent). Index: the
// offsets' type (row_in).
template <typename Index = int64_t>
ST_HOST_DEVICE inline int32_t clamp_count(const MaskIndexView& counts, const MaskIndexView& index, int64_t b, int64_t h,
                                          int64_t m) {
  if (counts.data == nullptr || index.data == nullptr) return 0;
  const int32_t c = *counts.row_in<Index>(b, h, m);
  return c < 0 ? 0 : (c > index.width ? index.width : c);
}

// Where `value` sits among the first `count` entries of row r (ascending), or -1.
template <typename Index = int64_t>
ST_HOST_DEVICE inline int32_t find_sorted(const MaskIndexView& index, int64_t b, int64_t h, int64_t r, int32_t count,
                                          int32_t value) {
  int32_t lo = 0, hi = count - 1;
  const int32_t* row = index.data != nullptr ? index.row_in<Index>(b, h, r) : nullptr;
  while (lo <= hi) {
    const int32_t mid = (lo + hi) / 2;
    const int32_t v = row[Index(mid) * Index(index.stride_w)];
    if (v == value) return mid;
    if (v < value) lo = mid + 1;
    else hi = mid - 1;
  }
  return -1;
}

// The entry of value n in row m of a sorted list, its count clamped (a device mask), or -1.
template <typename Index = int64_t>
ST_HOST_DEVICE inline int32_t find_in_row(const MaskIndexView& count, const MaskIndexView& index, int64_t b, int64_t h,
                                          int64_t m, int32_t n) {
  return find_sorted<Index>(index, b, h, m, clamp_count<Index>(count, index, b, h, m), n);
}

}  // namespace sparsetrain

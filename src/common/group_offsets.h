// Splits -> group row offsets, the set-up step of every grouped GEMM. Plain host/device code: the
// CPU backend calls it directly, the CUDA set-up kernel runs the same function on the device, and
// the CPU tests pin its behaviour. Invalid splits (a negative entry, or a sum above the row count)
// turn every group empty and OR the matching SplitsStatus bits into *status: nothing is computed
// from them, and the caller learns about it without a host synchronisation.
#pragma once

#include <cstdint>

#include "common/host_device.h"
#include "sparsetrain/splits.h"

namespace sparsetrain {

// offsets[0..G]: group g owns rows [offsets[g], offsets[g+1]); offsets[G] = S. Returns the status
// bits found in this call (also ORed into *status when status is non-null).
ST_HOST_DEVICE inline int32_t compute_group_offsets(const int64_t* splits, int64_t num_groups,
                                                     int64_t num_rows, int64_t* offsets,
                                                     int32_t* status) {
  int32_t bits = kSplitsOk;
  int64_t sum = 0;
  offsets[0] = 0;
  for (int64_t g = 0; g < num_groups; ++g) {
    const int64_t s = splits[g];
    if (s < 0) bits |= kSplitsNegative;
    // Clamp before adding so that huge entries cannot overflow the running sum.
    else if (s > num_rows - sum) bits |= kSplitsSumExceedsRows;
    if (bits == kSplitsOk) sum += s;
    offsets[g + 1] = sum;
  }
  if (bits != kSplitsOk) {
    for (int64_t g = 0; g <= num_groups; ++g) offsets[g] = 0;
    if (status != nullptr) *status |= bits;
  }
  return bits;
}

// Splits are valid (compute_group_offsets returns kSplitsOk, its offsets the prefix sums) exactly
// when every entry is in [0, num_rows] and their sum is at most num_rows: with no negative entry
// the running sum only grows, so its last value bounds all the others. A parallel set-up kernel
// checks this with a scan and leaves every invalid case to compute_group_offsets (which alone
// decides the status bits); the per-entry bound also keeps that scan's sum from overflowing.
ST_HOST_DEVICE inline bool split_in_range(int64_t split, int64_t num_rows) {
  return split >= 0 && split <= num_rows;
}
ST_HOST_DEVICE inline bool splits_valid(const int64_t* splits, int64_t num_groups, int64_t num_rows) {
  int64_t sum = 0;
  for (int64_t g = 0; g < num_groups; ++g) {
    if (!split_in_range(splits[g], num_rows)) return false;
    sum += splits[g];  // at most num_groups x num_rows: no overflow for any real row count
  }
  return sum <= num_rows;
}

// The group owning row t < offsets[G]: the last g with offsets[g] <= t (empty groups, whose
// offsets equal the next one's, are skipped over). O(log G) by bisection.
ST_HOST_DEVICE inline int64_t group_of_row(const int64_t* offsets, int64_t num_groups, int64_t t) {
  int64_t lo = 0, hi = num_groups - 1;  // invariant: offsets[lo] <= t, and the answer is in [lo, hi]
  while (lo < hi) {
    const int64_t mid = (lo + hi + 1) / 2;
    if (offsets[mid] <= t) lo = mid;
    else hi = mid - 1;
  }
  return lo;
}

}  // namespace sparsetrain

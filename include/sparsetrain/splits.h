// Splits: how many rows of a grouped input belong to each group (expert), rows grouped
// contiguously. Host splits are read and validated on the host at once (every entry >= 0, sum <= T).
// Device splits stay on the compute device and are never read by the host: CUDA graphs can capture
// the operations that use them and replay them with new split values. Invalid device splits make
// every problem empty and OR an error bit into a caller-owned status word instead of raising.
#pragma once

#include <cstdint>
#include <vector>

#include "sparsetrain/tensor.h"

namespace sparsetrain {

// Sticky bits of the device-splits status word (int32). Never cleared by the library.
enum SplitsStatus : int32_t {
  kSplitsOk = 0,
  kSplitsNegative = 1,        // some entry < 0
  kSplitsSumExceedsRows = 2,  // sum of entries > T (rows of the input)
};

class Splits {
 public:
  Splits() = default;
  // Host splits from values (copied).
  static Splits host(std::vector<int64_t> values);
  // Host splits from a host tensor of shape [G], int64 or int32 (copied now).
  static Splits host(const TensorView& values);
  // Device splits: an int64 tensor of shape [G] on the compute device, read when the work runs.
  // `status`: optional int32 tensor of one element on the same device that receives SplitsStatus
  // bits. With the CPU backend the "device" is the host, but these splits keep the device rules.
  static Splits device(const TensorView& values, const TensorView& status = {});

  bool on_device() const { return on_device_; }
  bool defined() const { return on_device_ ? device_values_.defined() : has_host_; }
  const std::vector<int64_t>& host_values() const { return host_values_; }
  const TensorView& device_values() const { return device_values_; }
  const TensorView& status() const { return status_; }

 private:
  bool on_device_ = false;
  bool has_host_ = false;
  std::vector<int64_t> host_values_;
  TensorView device_values_;
  TensorView status_;
};

}  // namespace sparsetrain

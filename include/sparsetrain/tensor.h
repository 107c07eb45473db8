// TensorView: a non-owning, strided view of someone else's memory (data pointer, dtype, device,
// shape and strides in elements). The library never owns user tensors; the only memory it owns
// comes from a caller-supplied Allocator (see allocator.h) and is handed back as a Tensor.
#pragma once

#include <array>
#include <cstdint>
#include <initializer_list>
#include <string>

#include "sparsetrain/dtype.h"

namespace sparsetrain {

enum class DeviceType : uint8_t { kCPU, kCUDA };

struct Device {
  DeviceType type = DeviceType::kCPU;
  int index = 0;

  static Device cpu() { return {DeviceType::kCPU, 0}; }
  static Device cuda(int i = 0) { return {DeviceType::kCUDA, i}; }
  bool is_cpu() const { return type == DeviceType::kCPU; }
  bool is_cuda() const { return type == DeviceType::kCUDA; }
  bool operator==(const Device& o) const { return type == o.type && (is_cpu() || index == o.index); }
  bool operator!=(const Device& o) const { return !(*this == o); }
  std::string str() const;  // "cpu", "cuda:0"
};

class TensorView {
 public:
  static constexpr int kMaxDims = 5;

  TensorView() = default;
  // Contiguous (row-major) view.
  TensorView(void* data, DType dtype, std::initializer_list<int64_t> shape, Device device = Device::cpu());
  // Explicit strides, in elements.
  TensorView(void* data, DType dtype, const int64_t* shape, const int64_t* strides, int dim,
             Device device = Device::cpu());
  static TensorView contiguous(void* data, DType dtype, const int64_t* shape, int dim,
                               Device device = Device::cpu());

  void* data() const { return data_; }
  template <typename T> T* data_as() const { return static_cast<T*>(data_); }
  DType dtype() const { return dtype_; }
  Device device() const { return device_; }
  int dim() const { return dim_; }
  int64_t size(int d) const { return shape_[d < 0 ? d + dim_ : d]; }
  int64_t stride(int d) const { return strides_[d < 0 ? d + dim_ : d]; }
  // The stride that broadcasts: 0 where dimension d has size 1 (every index reads the one
  // element: masks' leading [B, H] dims, document ids' batch), else stride(d).
  int64_t broadcast_stride(int d) const { return size(d) == 1 ? 0 : stride(d); }
  const int64_t* shape() const { return shape_.data(); }
  const int64_t* strides() const { return strides_.data(); }
  int64_t numel() const;
  bool defined() const { return dim_ > 0 || data_ != nullptr; }
  bool is_contiguous() const;
  size_t element_size() const { return dtype_size(dtype_); }

  // View of index i along dimension 0 (drops that dimension).
  TensorView select(int64_t i) const;
  // View of rows [begin, end) along dimension 0.
  TensorView rows(int64_t begin, int64_t end) const;
  // Byte address of element with the given multi-index along the first dims.
  char* byte_ptr(int64_t offset_elems) const { return static_cast<char*>(data_) + offset_elems * int64_t(element_size()); }

  std::string shape_str() const;  // "[8, 16]"
  std::string str() const;        // "bf16[8, 16] on cpu"

 private:
  void* data_ = nullptr;
  DType dtype_ = DType::kFP32;
  Device device_{};
  int dim_ = 0;
  std::array<int64_t, kMaxDims> shape_{};
  std::array<int64_t, kMaxDims> strides_{};
};

}  // namespace sparsetrain

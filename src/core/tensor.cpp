// TensorView construction and the small queries the validation code needs.
#include "sparsetrain/tensor.h"

#include <sstream>

#include "sparsetrain/error.h"

namespace sparsetrain {

std::string Device::str() const { return is_cpu() ? "cpu" : "cuda:" + std::to_string(index); }

TensorView::TensorView(void* data, DType dtype, std::initializer_list<int64_t> shape, Device device)
    : data_(data), dtype_(dtype), device_(device), dim_(int(shape.size())) {
  ST_CHECK_ARG(dim_ >= 1 && dim_ <= kMaxDims, "TensorView shape", "1 to 5 dimensions", dim_);
  int d = 0;
  for (int64_t s : shape) shape_[size_t(d++)] = s;
  int64_t stride = 1;
  for (int i = dim_ - 1; i >= 0; --i) {
    strides_[size_t(i)] = stride;
    stride *= shape_[size_t(i)];
  }
}

TensorView::TensorView(void* data, DType dtype, const int64_t* shape, const int64_t* strides, int dim,
                       Device device)
    : data_(data), dtype_(dtype), device_(device), dim_(dim) {
  ST_CHECK_ARG(dim >= 1 && dim <= kMaxDims, "TensorView shape", "1 to 5 dimensions", dim);
  for (int i = 0; i < dim; ++i) {
    shape_[size_t(i)] = shape[i];
    strides_[size_t(i)] = strides[i];
  }
}

TensorView TensorView::contiguous(void* data, DType dtype, const int64_t* shape, int dim, Device device) {
  ST_CHECK_ARG(dim >= 1 && dim <= kMaxDims, "TensorView shape", "1 to 5 dimensions", dim);
  int64_t strides[kMaxDims];
  int64_t stride = 1;
  for (int i = dim - 1; i >= 0; --i) {
    strides[i] = stride;
    stride *= shape[i];
  }
  return TensorView(data, dtype, shape, strides, dim, device);
}

int64_t TensorView::numel() const {
  int64_t n = 1;
  for (int i = 0; i < dim_; ++i) n *= shape_[size_t(i)];
  return dim_ == 0 ? 0 : n;
}

bool TensorView::is_contiguous() const {
  if (numel() == 0) return true;  // no element to lay out (numpy gives empty arrays zero strides)
  int64_t expected = 1;
  for (int i = dim_ - 1; i >= 0; --i) {
    if (shape_[size_t(i)] != 1 && strides_[size_t(i)] != expected) return false;
    expected *= shape_[size_t(i)];
  }
  return true;
}

TensorView TensorView::select(int64_t i) const {
  ST_CHECK_ARG(dim_ >= 2, "select", "a tensor of 2+ dimensions", dim_, " dimensions");
  ST_CHECK_ARG(i >= 0 && i < shape_[0], "select index", "0 <= index < " + std::to_string(shape_[0]), i);
  return TensorView(byte_ptr(i * strides_[0]), dtype_, shape_.data() + 1, strides_.data() + 1, dim_ - 1,
                    device_);
}

TensorView TensorView::rows(int64_t begin, int64_t end) const {
  ST_CHECK_ARG(dim_ >= 1 && begin >= 0 && begin <= end && end <= shape_[0], "rows",
               "0 <= begin <= end <= " + std::to_string(shape_[0]), begin, "..", end);
  TensorView v = *this;
  v.data_ = byte_ptr(begin * strides_[0]);
  v.shape_[0] = end - begin;
  return v;
}

std::string TensorView::shape_str() const {
  std::ostringstream os;
  os << "[";
  for (int i = 0; i < dim_; ++i) os << (i ? ", " : "") << shape_[size_t(i)];
  os << "]";
  return os.str();
}

std::string TensorView::str() const {
  if (!defined()) return "no tensor";
  return std::string(dtype_name(dtype_)) + shape_str() + " on " + device_.str();
}

}  // namespace sparsetrain

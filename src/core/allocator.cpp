// Tensor: storage obtained from a caller's Allocator, released on the stream it was made on.
#include "sparsetrain/allocator.h"

#include <cstdint>

#include "sparsetrain/error.h"

namespace sparsetrain {

Tensor Tensor::empty(DType dtype, const int64_t* shape, int dim, Device device, Allocator& alloc,
                     Stream stream) {
  int64_t numel = 1;
  for (int i = 0; i < dim; ++i) {
    ST_CHECK_ARG(shape[i] >= 0, "tensor shape", "sizes >= 0", shape[i]);
    numel *= shape[i];
  }
  const size_t bytes = size_t(numel) * dtype_size(dtype);
  void* p = alloc.allocate(bytes, device, stream);
  if (p == nullptr) ST_FAIL("allocator returned null for ", bytes, " bytes on ", device.str());
  if (reinterpret_cast<uintptr_t>(p) % kAllocAlignment != 0) {
    alloc.deallocate(p, bytes, device, stream);
    ST_FAIL("allocator: expected ", kAllocAlignment, "-byte aligned memory, got address ", p);
  }
  Tensor t;
  Allocator* a = &alloc;
  t.storage_ = std::shared_ptr<void>(p, [a, bytes, device, stream](void* q) { a->deallocate(q, bytes, device, stream); });
  t.view_ = TensorView::contiguous(p, dtype, shape, dim, device);
  return t;
}

Tensor Tensor::empty(DType dtype, std::initializer_list<int64_t> shape, Device device, Allocator& alloc,
                     Stream stream) {
  return empty(dtype, shape.begin(), int(shape.size()), device, alloc, stream);
}

Tensor Tensor::borrowed(const TensorView& view) {
  Tensor t;
  t.view_ = view;
  return t;
}

Tensor Tensor::with_view(const TensorView& view) const {
  Tensor t = *this;
  t.view_ = view;
  return t;
}

}  // namespace sparsetrain

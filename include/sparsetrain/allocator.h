// Streams, caller-supplied allocators and workspace, and Tensor (memory the library allocated
// for the caller). The library allocates only through the Allocator it is given, on the caller's
// stream: that is what keeps it safe across streams and capturable in CUDA graphs. The default
// allocator uses aligned host memory on the CPU and stream-ordered cudaMallocAsync on CUDA.
#pragma once

#include <cstddef>
#include <memory>

#include "sparsetrain/tensor.h"

namespace sparsetrain {

// An opaque cudaStream_t (nullptr: the default stream). The CPU backend runs synchronously and
// ignores it.
struct Stream {
  void* handle = nullptr;
};

// Every allocation the library makes starts on a 256-byte boundary; an allocator that returns
// less is rejected with an Error.
constexpr size_t kAllocAlignment = 256;

class Allocator {
 public:
  virtual ~Allocator() = default;
  virtual void* allocate(size_t bytes, Device device, Stream stream) = 0;
  virtual void deallocate(void* ptr, size_t bytes, Device device, Stream stream) = 0;
};

// Host: aligned operator new. CUDA: cudaMallocAsync / cudaFreeAsync on the given stream.
Allocator& default_allocator();

// Caller-provided scratch memory on the compute device. Operations report the bytes they need
// (a function of shapes and dtype only) and use `data` when it is large enough; with no workspace
// they take one from the allocator for the duration of the call.
struct Workspace {
  void* data = nullptr;
  size_t bytes = 0;
};

// Memory the library allocated (through an Allocator) and handed to the caller, or a borrowed
// caller buffer. Copies share the storage; the last one returns it to its allocator on the stream
// it was allocated on.
class Tensor {
 public:
  Tensor() = default;
  // Allocate a contiguous tensor (uninitialised).
  static Tensor empty(DType dtype, const int64_t* shape, int dim, Device device, Allocator& alloc,
                      Stream stream);
  static Tensor empty(DType dtype, std::initializer_list<int64_t> shape, Device device,
                      Allocator& alloc, Stream stream);
  // Wrap a caller buffer without taking ownership.
  static Tensor borrowed(const TensorView& view);
  // Share this tensor's storage under a different view (e.g. one group of a packed buffer).
  Tensor with_view(const TensorView& view) const;

  const TensorView& view() const { return view_; }
  bool defined() const { return view_.defined(); }
  bool owns_storage() const { return storage_ != nullptr; }

 private:
  TensorView view_;
  std::shared_ptr<void> storage_;
};

}  // namespace sparsetrain

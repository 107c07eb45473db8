// Build and device information, and the default allocator.
#include "sparsetrain/runtime.h"

#include <new>

#include "sm90/sm90_instances.h"
#include "sparsetrain/allocator.h"
#include "sparsetrain/error.h"
#if SPARSETRAIN_WITH_CUDA
#include "cuda/runtime_cuda.h"
#endif

namespace sparsetrain {

const char* version() { return "0.1.0"; }

bool built_with_cuda() { return SPARSETRAIN_WITH_CUDA != 0; }
const char* sm90_kernel_set() { return SPARSETRAIN_SM90_KERNEL_SET; }
const char* cuda_archs() { return SPARSETRAIN_WITH_CUDA ? SPARSETRAIN_CUDA_ARCHS : ""; }

int cuda_device_count() {
#if SPARSETRAIN_WITH_CUDA
  return cuda::device_count();
#else
  return 0;
#endif
}

std::string best_backend_description() {
#if SPARSETRAIN_WITH_CUDA
  if (cuda::device_count() > 0) return "cuda:0 " + cuda::device_name(0);
#endif
  return "cpu reference";
}

namespace {

class DefaultAllocator final : public Allocator {
 public:
  void* allocate(size_t bytes, Device device, Stream stream) override {
    if (bytes == 0) bytes = 1;  // a valid, unique pointer even for empty tensors
    if (device.is_cpu()) return ::operator new(bytes, std::align_val_t(kAllocAlignment));
#if SPARSETRAIN_WITH_CUDA
    return cuda::malloc_async(bytes, device.index, stream.handle);
#else
    (void)stream;
    ST_FAIL("default allocator: this build of sparsetrain has no CUDA support, cannot allocate on ",
            device.str());
#endif
  }
  void deallocate(void* ptr, size_t bytes, Device device, Stream stream) override {
    (void)bytes;
    if (device.is_cpu()) {
      ::operator delete(ptr, std::align_val_t(kAllocAlignment));
      return;
    }
#if SPARSETRAIN_WITH_CUDA
    cuda::free_async(ptr, device.index, stream.handle);
#else
    (void)stream;
#endif
  }
};

}  // namespace

Allocator& default_allocator() {
  static DefaultAllocator allocator;
  return allocator;
}

}  // namespace sparsetrain

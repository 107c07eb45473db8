// What the parts of the C++ torch library sparsetrain._torch_ops (torch_ops.cpp: attention's
// operators, torch_grouped.cpp: the grouped layers, torch_moe.cpp: the MoE router's and combine's
// operators) share: at::Tensor arguments as the library's views, memory from torch's caching
// allocator on the current stream handed back as tensors over that memory, the call's stream, and
// the library's errors as torch's (ValueError for an invalid argument).
#pragma once

#include <ATen/ATen.h>

#ifdef SPARSETRAIN_TORCH_CUDA
#include <c10/cuda/CUDAGraphsC10Utils.h>
#include <c10/cuda/CUDAStream.h>
#endif

#include <array>
#include <iterator>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "sparsetrain/allocator.h"
#include "sparsetrain/error.h"
#include "sparsetrain/tensor.h"

namespace pybind11 {
class module_;
}

namespace sparsetrain::torch_ops {

// Adds attention's eager entry (torch_ops.cpp) to the Python module sparsetrain._torch_ops.
void register_attention(pybind11::module_& m);

// Adds the MoE layer's C++ layer class and eager entry (torch_moe.cpp) to the same module.
void register_moe_layer(pybind11::module_& m);

// Adds BlockMask.build's torch route (torch_block_mask.cpp) to the same module.
void register_block_mask(pybind11::module_& m);

// The library's DType of a torch type, through the one table of element types
// (dtype_of_element): fp64, bool, int8 ... too, so that the op's own check refuses them with its
// rule and the library's names. False for a type no DType describes (fp8, complex32, quantized).
inline bool dtype_of_scalar_type(at::ScalarType s, DType& d) {
  ElementKind kind;
  if (s == at::kBFloat16) kind = ElementKind::kBFloat;
  else if (s == at::kBool) kind = ElementKind::kBool;
  else if (c10::isComplexType(s)) kind = ElementKind::kComplex;
  else if (c10::isFloatingType(s)) kind = ElementKind::kFloat;
  else if (c10::isIntegralType(s, /*includeBool=*/false))
    kind = c10::isSignedType(s) ? ElementKind::kInt : ElementKind::kUInt;
  else return false;  // quantized and bit types
  return dtype_of_element(kind, int(c10::elementSize(s)) * 8, d);
}

// dtype_of_scalar_type of a tensor's type, or an error naming `arg` and torch's name of the type.
// Every tensor argument of every call passes here: one load from a table made at first use.
inline DType dtype_of(const at::Tensor& t, const char* arg) {
  constexpr int kTypes = int(at::ScalarType::NumOptions);
  static const std::array<int, kTypes> table = [] {
    std::array<int, kTypes> m{};
    for (int i = 0; i < kTypes; ++i) {
      DType d;
      m[size_t(i)] = dtype_of_scalar_type(at::ScalarType(i), d) ? int(d) : -1;
    }
    return m;
  }();
  const int i = int(t.scalar_type());
  if (i >= 0 && i < kTypes && table[size_t(i)] >= 0) return DType(table[size_t(i)]);
  detail::throw_arg_error(arg, "a dtype the library can view (bf16, fp16, fp32, int32, int64, uint8, ...)",
                          std::string(at::toString(t.scalar_type())));
}

// The torch type of a DType (results: fp32, int32, ...): dtype_of_scalar_type's table read backwards.
inline at::ScalarType scalar_type_of(DType d) {
  static const std::array<at::ScalarType, std::size(kAllDTypes)> table = [] {
    std::array<at::ScalarType, std::size(kAllDTypes)> m;
    m.fill(at::ScalarType::Undefined);
    for (int i = 0; i < int(at::ScalarType::NumOptions); ++i) {
      DType t;
      if (dtype_of_scalar_type(at::ScalarType(i), t)) m[size_t(t)] = at::ScalarType(i);
    }
    return m;
  }();
  return table[size_t(d)];
}

inline Device device_of(const at::Tensor& t, const char* arg) {
  if (t.is_cpu()) return Device::cpu();
  if (t.is_cuda()) return Device::cuda(t.get_device());
  detail::throw_arg_error(arg, "a tensor on the CPU or a CUDA device", t.device().str());
}

// The library's view of `t` (none for an undefined tensor).
inline TensorView view_of(const at::Tensor& t, const char* arg) {
  if (!t.defined()) return {};
  ST_CHECK_ARG(t.dim() >= 1 && t.dim() <= TensorView::kMaxDims, arg,
               "1 to " + std::to_string(TensorView::kMaxDims) + " dims", t.dim());
  return TensorView(t.data_ptr(), dtype_of(t, arg), t.sizes().data(), t.strides().data(), int(t.dim()),
                    device_of(t, arg));
}

inline TensorView view_of(const std::optional<at::Tensor>& t, const char* arg) {
  return t.has_value() ? view_of(*t, arg) : TensorView();
}

// The stream a call on `t`'s device runs on: torch's current stream there (none on the CPU).
inline Stream stream_of(const at::Tensor& t) {
  Stream s;
#ifdef SPARSETRAIN_TORCH_CUDA
  if (t.is_cuda()) s.handle = c10::cuda::getCurrentCUDAStream(t.get_device()).stream();
#else
  (void)t;
#endif
  return s;
}

// Memory from torch's caching allocator: at::empty on the call's device (on CUDA the current
// stream, which is the stream the call's kernels run on). Results leave as tensors holding the
// allocation they live in. One allocator may serve many calls (a layer's: its cached dummy wgrad
// and the intermediates a delayed wgrad keeps live in it between calls); memory freed while
// another stream is current (a delayed wgrad computed on a side stream) is recorded on that
// stream, so the caching allocator hands it out again only after that stream's kernels ran.
class TorchAllocator final : public Allocator {
 public:
  void* allocate(size_t bytes, Device device, Stream) override {
    const at::Device dev = device.is_cpu() ? at::Device(at::kCPU) : at::Device(at::kCUDA, c10::DeviceIndex(device.index));
    at::Tensor owner = at::empty({int64_t(bytes) + kAlign}, at::TensorOptions().dtype(at::kByte).device(dev));
    const auto addr = reinterpret_cast<uintptr_t>(owner.data_ptr());
    void* p = reinterpret_cast<void*>(addr + (kAlign - addr % kAlign) % kAlign);
    live_.emplace(p, Allocation{std::move(owner), stream_of_owner(dev)});
    return p;
  }
  void deallocate(void* p, size_t, Device, Stream) override {
    auto it = live_.find(p);
    if (it == live_.end()) return;
#ifdef SPARSETRAIN_TORCH_CUDA
    const at::Tensor& owner = it->second.owner;
    if (owner.is_cuda()) {
      const c10::Stream now = c10::cuda::getCurrentCUDAStream(owner.get_device());
      if (now != it->second.stream) owner.record_stream(now);
    }
#endif
    live_.erase(it);
  }

  // A result as a torch tensor over its allocation's storage (not a from_blob wrapper: torch's
  // record_stream and the caching allocator's stream tracking must see the real allocation).
  // swap_1_2: dims 1 and 2 exchanged, as `.transpose(1, 2)` would, without its dispatcher call (the
  // core's [B, S, H, D] attention results in FlexAttention's [B, H, S, D] order).
  at::Tensor take(const Tensor& t, bool swap_1_2 = false) const {
    const TensorView& v = t.view();
    auto it = live_.upper_bound(v.data());
    if (it == live_.begin()) ST_FAIL("internal: no allocation holds address ", v.data());
    --it;
    const at::Tensor& owner = it->second.owner;
    const int64_t offset = static_cast<const char*>(v.data()) - static_cast<const char*>(owner.data_ptr());
    // A tensor over the same storage built directly (as from_blob builds its own): two dispatcher
    // calls less per result than at::empty({0}).set_(storage, ...).
    at::Tensor r = at::detail::make_tensor<c10::TensorImpl>(c10::Storage(owner.storage()), owner.key_set(),
                                                            c10::scalarTypeToTypeMeta(scalar_type_of(v.dtype())));
    std::vector<int64_t> sizes(v.shape(), v.shape() + v.dim()), strides(v.strides(), v.strides() + v.dim());
    if (swap_1_2) {
      if (v.dim() < 3) ST_FAIL("internal: take(swap_1_2) of a ", v.dim(), "-d result");
      std::swap(sizes[1], sizes[2]);
      std::swap(strides[1], strides[2]);
    }
    r.unsafeGetTensorImpl()->set_sizes_and_strides(sizes, strides, offset / int64_t(v.element_size()));
    return r;
  }

  // A result that may be a caller buffer the library wrote in place (`caller`, handed back as it
  // is), or memory it allocated.
  at::Tensor take(const Tensor& t, const std::optional<at::Tensor>& caller) const {
    return t.owns_storage() || !caller.has_value() ? take(t) : *caller;
  }

 private:
  static c10::Stream stream_of_owner(const at::Device& dev) {
#ifdef SPARSETRAIN_TORCH_CUDA
    if (dev.is_cuda()) return c10::cuda::getCurrentCUDAStream(dev.index());
#endif
    return c10::Stream(c10::Stream::DEFAULT, dev);
  }

  struct Allocation {
    at::Tensor owner;
    c10::Stream stream;  // the stream current when it was allocated (the caching allocator's)
  };
  static constexpr int64_t kAlign = 256;
  std::map<void*, Allocation> live_;
};

// The library's errors as torch's: an invalid argument is a ValueError in Python, as from `_C`.
template <class F>
auto translated(F&& f) -> decltype(f()) {
  try {
    return f();
  } catch (const Error& e) {
    if (e.kind() == Error::Kind::kInvalidArgument) TORCH_CHECK_VALUE(false, e.what());
    TORCH_CHECK(false, e.what());
  }
}

}  // namespace sparsetrain::torch_ops

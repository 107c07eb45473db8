// Test support: owning host tensors with random contents, a poisoning/counting allocator and
// tolerance-based comparison against a double-precision oracle. Shared by the GoogleTest suites
// and the `sparsetrain demo` self-check.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "sparsetrain/allocator.h"
#include "sparsetrain/splits.h"
#include "sparsetrain/tensor.h"

namespace sparsetrain::testing {

// A contiguous host tensor that owns its bytes (256-byte aligned, like the library's allocations).
class HostTensor {
 public:
  HostTensor() = default;
  HostTensor(DType dtype, std::vector<int64_t> shape) : dtype_(dtype), shape_(std::move(shape)) {
    int64_t n = 1;
    for (int64_t s : shape_) n *= s;
    numel_ = n;
    bytes_.assign(size_t(n) * dtype_size(dtype) + 256, 0);
  }
  // data() is aligned inside bytes_, so a copy re-aligns rather than copying bytes_ as they are
  // (the copied vector's base can sit at a different offset from a 256-byte boundary).
  HostTensor(const HostTensor& o)
      : dtype_(o.dtype_), shape_(o.shape_), numel_(o.numel_), bytes_(o.bytes_.size(), 0) {
    if (!bytes_.empty()) std::memcpy(data(), o.data(), size_t(numel_) * dtype_size(dtype_));
  }
  HostTensor& operator=(const HostTensor& o) {
    if (this != &o) *this = HostTensor(o);
    return *this;
  }
  HostTensor(HostTensor&&) noexcept = default;  // a moved vector keeps its buffer: data() stays put
  HostTensor& operator=(HostTensor&&) noexcept = default;

  TensorView view() const {
    return TensorView::contiguous(data(), dtype_, shape_.data(), int(shape_.size()));
  }
  void* data() const {
    auto p = reinterpret_cast<uintptr_t>(bytes_.data());
    return reinterpret_cast<void*>((p + 255) / 256 * 256);
  }
  int64_t numel() const { return numel_; }
  DType dtype() const { return dtype_; }
  double get(int64_t i) const {
    switch (dtype_) {
      case DType::kInt64: return double(static_cast<const int64_t*>(data())[i]);
      case DType::kInt32: return double(static_cast<const int32_t*>(data())[i]);
      case DType::kUInt8: return double(static_cast<const uint8_t*>(data())[i]);
      default: return double(load_float(data(), dtype_, i));
    }
  }
  void set(int64_t i, double v) {
    switch (dtype_) {
      case DType::kInt64: static_cast<int64_t*>(data())[i] = int64_t(v); break;
      case DType::kInt32: static_cast<int32_t*>(data())[i] = int32_t(v); break;
      case DType::kUInt8: static_cast<uint8_t*>(data())[i] = uint8_t(v); break;
      default: store_float(data(), dtype_, i, float(v)); break;
    }
  }
  std::vector<double> to_double() const {
    std::vector<double> v(static_cast<size_t>(numel_));
    for (int64_t i = 0; i < numel_; ++i) v[size_t(i)] = get(i);
    return v;
  }
  // Uniform in [-scale, scale), rounded to the dtype: the oracle sees exactly what the kernel sees.
  void fill_random(std::mt19937_64& rng, double scale = 1.0) {
    std::uniform_real_distribution<double> u(-scale, scale);
    for (int64_t i = 0; i < numel_; ++i) set(i, u(rng));
  }
  // All bytes 0xFF: NaN in bf16, fp16 and fp32, so any element left unwritten shows.
  void poison() { std::memset(data(), 0xff, size_t(numel_) * dtype_size(dtype_)); }
  // Copy of any strided host view (any rank) into a new contiguous tensor, in row-major order.
  static HostTensor copy_of(const TensorView& v) {
    std::vector<int64_t> shape(v.shape(), v.shape() + v.dim());
    HostTensor h(v.dtype(), shape);
    const size_t es = dtype_size(v.dtype());
    std::vector<int64_t> idx(shape.size(), 0);
    for (int64_t i = 0; i < h.numel(); ++i) {
      int64_t off = 0;
      for (int d = 0; d < v.dim(); ++d) off += idx[size_t(d)] * v.stride(d);
      std::memcpy(static_cast<char*>(h.data()) + size_t(i) * es, v.byte_ptr(off), es);
      for (int d = v.dim() - 1; d >= 0 && ++idx[size_t(d)] == shape[size_t(d)]; --d) idx[size_t(d)] = 0;
    }
    return h;
  }
  bool bytes_equal(const HostTensor& o) const {
    return numel_ == o.numel_ && std::memcmp(data(), o.data(), size_t(numel_) * dtype_size(dtype_)) == 0;
  }

 private:
  DType dtype_ = DType::kFP32;
  std::vector<int64_t> shape_;
  int64_t numel_ = 0;
  std::vector<uint8_t> bytes_;
};

inline bool bytes_equal(const TensorView& a, const TensorView& b) {
  if (a.numel() != b.numel() || a.dtype() != b.dtype() || !a.is_contiguous() || !b.is_contiguous()) return false;
  return std::memcmp(a.data(), b.data(), size_t(a.numel()) * a.element_size()) == 0;
}

// Host allocator that poisons every allocation (0xFF bytes: NaN) and counts what it hands out.
class PoisonAllocator final : public Allocator {
 public:
  void* allocate(size_t bytes, Device device, Stream stream) override {
    void* p = default_allocator().allocate(bytes, device, stream);
    std::memset(p, 0xff, bytes);
    ++allocations;
    live += 1;
    return p;
  }
  void deallocate(void* p, size_t bytes, Device device, Stream stream) override {
    live -= 1;
    default_allocator().deallocate(p, bytes, device, stream);
  }
  int allocations = 0;
  int live = 0;
};

// Unit roundoff of a dtype (half an ulp at 1.0): the relative error of one rounding.
inline double unit_roundoff(DType t) {
  switch (t) {
    case DType::kBF16: return std::ldexp(1.0, -8);
    case DType::kFP16: return std::ldexp(1.0, -11);
    default: return std::ldexp(1.0, -24);
  }
}

// Exact value and sum of |terms| of each output element, computed in double.
struct OracleValues {
  std::vector<double> value;
  std::vector<double> abs_sum;
  std::vector<int64_t> terms;  // number of products summed for the element
};

// Host splits, or device splits: an int64 tensor in host memory that the CPU backend must treat
// as device memory (never read for shapes), with its status word.
struct SplitsHolder {
  HostTensor values{DType::kInt64, {1}}, status{DType::kInt32, {1}};
  Splits splits;
  SplitsHolder(const std::vector<int64_t>& v, bool device) {
    if (!device) {
      splits = Splits::host(v);
      return;
    }
    values = HostTensor(DType::kInt64, {int64_t(v.size())});
    for (size_t i = 0; i < v.size(); ++i) values.set(int64_t(i), double(v[i]));
    status.set(0, 0);
    splits = Splits::device(values.view(), status.view());
  }
};

struct CompareResult {
  bool ok = true;
  double max_rel_error = 0;  // normwise: max |got - ref| / max |ref|
  double worst_tol_ratio = 0;  // max |got - ref| / tolerance (<= 1 passes)
  std::string first_failure;

  // Element i: `got` against `expected` within `tol` (NaN never passes). finish() after the last.
  void check(const std::string& name, size_t i, double got, double expected, double tol) {
    const double err = std::fabs(got - expected);
    if (!(err <= tol)) {
      if (ok) {
        std::ostringstream os;
        os << name << "[" << i << "]: got " << got << ", expected " << expected << " +- " << tol;
        first_failure = os.str();
      }
      ok = false;
    }
    max_err_ = std::isfinite(err) ? std::max(max_err_, err) : INFINITY;
    max_ref_ = std::max(max_ref_, std::fabs(expected));
    worst_tol_ratio = std::isfinite(err) ? std::max(worst_tol_ratio, err / tol) : INFINITY;
  }
  CompareResult& finish() {
    max_rel_error = max_ref_ > 0 ? max_err_ / max_ref_ : max_err_;
    return *this;
  }

 private:
  double max_err_ = 0, max_ref_ = 0;
};

// Every element must be finite and within the error bound of an fp32 accumulation of `terms`
// products (each product and partial sum rounded once: about terms * 2^-24 * sum|terms|, with
// slack for `extra_fp32_ops` further fp32 roundings such as a bias or main_grad add), followed by
// one rounding to the output dtype (its unit roundoff times |value|).
inline CompareResult compare_with_oracle(const HostTensor& got, const OracleValues& ref, DType out_dtype,
                                         int extra_fp32_ops = 1, const std::string& name = "") {
  CompareResult r;
  const double u32 = std::ldexp(1.0, -24), u = unit_roundoff(out_dtype);
  const double tiny = out_dtype == DType::kFP16 ? std::ldexp(1.0, -24) : 1e-30;  // fp16 subnormal step
  for (size_t i = 0; i < ref.value.size(); ++i) {
    const double e = ref.value[i];
    const double acc_err = (double(ref.terms[i]) + 2 + extra_fp32_ops) * u32 * (ref.abs_sum[i] + std::fabs(e));
    r.check(name, i, got.get(int64_t(i)), e, 1.0001 * (acc_err + u * (std::fabs(e) + acc_err)) + tiny);
  }
  return r.finish();
}

}  // namespace sparsetrain::testing

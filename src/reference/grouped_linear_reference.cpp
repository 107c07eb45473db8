// The CPU reference backend of GroupedLinear: plain loops, fp32 accumulation, one fixed summation
// order per output element (k ascending in fprop, output column ascending in dgrad, row ascending
// in wgrad and bias grad), so results are bitwise reproducible. This is the definition of correct
// the CUDA backend is tested against; clarity beats speed here, but the loops run along
// contiguous rows so that the demo and tests stay quick.
#include <cstdint>
#include <cstring>

#include "common/dispatch_dtype.h"
#include "common/group_offsets.h"
#include "ops/grouped_linear_backend.h"
#include "sparsetrain/error.h"

namespace sparsetrain::backend {
namespace {

inline float to_f32(float v) { return v; }
inline float to_f32(bf16_t v) { return to_float(v); }
inline float to_f32(fp16_t v) { return to_float(v); }
template <typename E> E from_f32(float v);
template <> inline float from_f32<float>(float v) { return v; }
template <> inline bf16_t from_f32<bf16_t>(float v) { return to_bf16(v); }
template <> inline fp16_t from_f32<fp16_t>(float v) { return to_fp16(v); }

template <typename E> const E* row_ptr(const TensorView& t, int64_t r) {
  return static_cast<const E*>(t.data()) + r * t.stride(0);
}
template <typename E> E* row_ptr_mut(const TensorView& t, int64_t r) {
  return static_cast<E*>(t.data()) + r * t.stride(0);
}

void zero_rows(const TensorView& t, int64_t begin) {
  for (int64_t r = begin; r < t.size(0); ++r)
    std::memset(t.byte_ptr(r * t.stride(0)), 0, size_t(t.size(1)) * t.element_size());
}

template <typename E>
void fprop_impl(const FpropParams& p, float* xrow) {
  const GroupedProblem& pr = p.problem;
  for (int64_t g = 0; g < pr.num_groups; ++g) {
    const TensorView& w = p.weight[size_t(g)];
    const E* bias = p.bias.empty() ? nullptr : static_cast<const E*>(p.bias[size_t(g)].data());
    for (int64_t t = pr.offsets[g]; t < pr.offsets[g + 1]; ++t) {
      const E* x = row_ptr<E>(p.x, t);
      for (int64_t k = 0; k < pr.in; ++k) xrow[k] = to_f32(x[k]);
      E* y = row_ptr_mut<E>(p.y, t);
      for (int64_t o = 0; o < pr.out; ++o) {
        const E* wr = row_ptr<E>(w, o);
        float acc = 0.f;
        for (int64_t k = 0; k < pr.in; ++k) acc += xrow[k] * to_f32(wr[k]);
        if (bias) acc += to_f32(bias[o]);  // the epilogue adds the bias to the fp32 accumulator
        y[o] = from_f32<E>(acc);
      }
    }
  }
  if (p.zero_tail) zero_rows(p.y, pr.offsets[pr.num_groups]);
}

template <typename E>
void dgrad_impl(const DgradParams& p, float* acc) {
  const GroupedProblem& pr = p.problem;
  for (int64_t g = 0; g < pr.num_groups; ++g) {
    const TensorView& w = p.weight[size_t(g)];
    for (int64_t t = pr.offsets[g]; t < pr.offsets[g + 1]; ++t) {
      const E* dy = row_ptr<E>(p.dy, t);
      for (int64_t k = 0; k < pr.in; ++k) acc[k] = 0.f;
      for (int64_t o = 0; o < pr.out; ++o) {
        const float d = to_f32(dy[o]);
        const E* wr = row_ptr<E>(w, o);
        for (int64_t k = 0; k < pr.in; ++k) acc[k] += d * to_f32(wr[k]);
      }
      E* dx = row_ptr_mut<E>(p.dx, t);
      for (int64_t k = 0; k < pr.in; ++k) dx[k] = from_f32<E>(acc[k]);
    }
  }
  if (p.zero_tail) zero_rows(p.dx, pr.offsets[pr.num_groups]);
}

template <typename E>
void wgrad_impl(const WgradParams& p, float* acc) {
  const GroupedProblem& pr = p.problem;
  for (int64_t g = 0; g < pr.num_groups; ++g) {
    const int64_t begin = pr.offsets[g], end = pr.offsets[g + 1];
    const TensorView& dw = p.dw[size_t(g)];
    E* db = p.db.empty() ? nullptr : static_cast<E*>(p.db[size_t(g)].data());
    if (begin == end && p.target == WgradTarget::kMainGradAccumulate) {
      // Adding an empty sum would still turn -0.0 into +0.0: leave main_grad bit-for-bit alone.
      if (db) for (int64_t o = 0; o < pr.out; ++o) db[o] = from_f32<E>(0.f);
      continue;
    }
    for (int64_t o = 0; o < pr.out; ++o) {
      for (int64_t k = 0; k < pr.in; ++k) acc[k] = 0.f;
      float bias_acc = 0.f;
      for (int64_t t = begin; t < end; ++t) {
        const float d = to_f32(row_ptr<E>(p.dy, t)[o]);
        const E* x = row_ptr<E>(p.x, t);
        for (int64_t k = 0; k < pr.in; ++k) acc[k] += d * to_f32(x[k]);
        bias_acc += d;
      }
      if (db) db[o] = from_f32<E>(bias_acc);
      switch (p.target) {
        case WgradTarget::kWeightGrad: {
          E* out = row_ptr_mut<E>(dw, o);
          for (int64_t k = 0; k < pr.in; ++k) out[k] = from_f32<E>(acc[k]);
          break;
        }
        case WgradTarget::kMainGradAccumulate: {  // beta = 1: main_grad + wgrad in fp32
          float* out = row_ptr_mut<float>(dw, o);
          for (int64_t k = 0; k < pr.in; ++k) out[k] = out[k] + acc[k];
          break;
        }
        case WgradTarget::kMainGradOverwrite: {  // beta = 0
          float* out = row_ptr_mut<float>(dw, o);
          for (int64_t k = 0; k < pr.in; ++k) out[k] = acc[k];
          break;
        }
      }
    }
  }
}

template <template <typename> class Fn, typename Params>
void dispatch(DType dtype, const Params& p, float* scratch) {
  dispatch_dtype(dtype, "reference GroupedLinear", [&](auto e) { Fn<decltype(e)>::run(p, scratch); });
}
template <typename E> struct Fprop { static void run(const FpropParams& p, float* s) { fprop_impl<E>(p, s); } };
template <typename E> struct Dgrad { static void run(const DgradParams& p, float* s) { dgrad_impl<E>(p, s); } };
template <typename E> struct Wgrad { static void run(const WgradParams& p, float* s) { wgrad_impl<E>(p, s); } };

class ReferenceBackend final : public GroupedLinearBackend {
 public:
  int64_t max_groups() const override { return INT64_MAX; }
  size_t scratch_bytes(DType, int64_t, int64_t, int64_t in, int64_t) const override {
    return size_t(in) * sizeof(float);  // one fp32 row: the input row (fprop) or the accumulators
  }
  void setup_device_splits(const TensorView& splits, int64_t num_rows, int64_t* offsets,
                           int32_t* status, Stream) override {
    compute_group_offsets(splits.data_as<const int64_t>(), splits.size(0), num_rows, offsets, status);
  }
  void write_host_offsets(int64_t* dst, const int64_t* values, int64_t count, Device, Stream) override {
    if (count) std::memcpy(dst, values, size_t(count) * sizeof(int64_t));
  }
  std::vector<int64_t> read_int64(const TensorView& t, Stream) override {
    std::vector<int64_t> v(static_cast<size_t>(t.numel()));
    for (size_t i = 0; i < v.size(); ++i) v[i] = t.data_as<const int64_t>()[int64_t(i) * t.stride(0)];
    return v;
  }
  void fill_zero(const TensorView& t, Stream) override {
    if (t.is_contiguous()) {
      std::memset(t.data(), 0, size_t(t.numel()) * t.element_size());
      return;
    }
    ST_CHECK_ARG(t.dim() >= 2, "fill_zero", "a contiguous tensor or one of 2+ dimensions", t.str());
    for (int64_t i = 0; i < t.size(0); ++i) fill_zero(t.select(i), Stream{});
  }
  void fprop(const FpropParams& p, void* scratch, Stream) override {
    dispatch<Fprop>(p.problem.dtype, p, static_cast<float*>(scratch));
  }
  void dgrad(const DgradParams& p, void* scratch, Stream) override {
    dispatch<Dgrad>(p.problem.dtype, p, static_cast<float*>(scratch));
  }
  void wgrad(const WgradParams& p, void* scratch, Stream) override {
    dispatch<Wgrad>(p.problem.dtype, p, static_cast<float*>(scratch));
  }
};

}  // namespace

GroupedLinearBackend& reference_backend() {
  static ReferenceBackend backend;
  return backend;
}

}  // namespace sparsetrain::backend

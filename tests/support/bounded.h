// Expected values that carry a first-order bound on the error the library may make before the
// final rounding to the output type (the GroupedMLP and attention oracles build them), and the
// comparison against them.
#pragma once

#include <cmath>
#include <string>
#include <vector>

#include "host_tensor.h"

namespace sparsetrain::testing {

// Exact values and a bound on the error before the final rounding to the output type.
struct Bounded {
  std::vector<double> value, err;
  explicit Bounded(size_t n = 0) : value(n, 0.0), err(n, 0.0) {}
};

// Rounding of a value to `t`: relative unit roundoff, plus half the subnormal step for fp16 (whose
// subnormals start at 6e-5; bf16 and fp32 share fp32's range).
inline double rounding_error(DType t, double v) {
  return unit_roundoff(t) * std::fabs(v) + (t == DType::kFP16 ? std::ldexp(1.0, -25) : 0.0);
}

// `got` (the library's output, as many elements as `ref`) must be finite and within twice the
// bound (first-order analysis: the factor absorbs second-order terms). `base`: main_grad before an
// accumulating wgrad, added to the expected value in fp32.
inline CompareResult compare_bounded(const HostTensor& got, const Bounded& ref, DType out_type,
                                     const std::string& name, const std::vector<double>* base = nullptr) {
  CompareResult r;
  const double u32 = std::ldexp(1.0, -24);
  for (size_t i = 0; i < ref.value.size(); ++i) {
    const double b = base ? (*base)[i] : 0.0;
    const double e = ref.value[i] + b;
    const double bound = ref.err[i] + (base ? u32 * (std::fabs(b) + std::fabs(e)) : 0.0) + rounding_error(out_type, e);
    r.check(name, i, got.get(int64_t(i)), e, 2.0 * bound + 1e-300);
  }
  return r.finish();
}

}  // namespace sparsetrain::testing

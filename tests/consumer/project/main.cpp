// A C++ program built only against the installed package: one fp32 GroupedLinear forward on the
// CPU (2 experts, rows 3 + 1 and a padded row), checked against sums written out by hand.
#include <cmath>
#include <cstdio>
#include <vector>

#include "sparsetrain/grouped_linear.h"
#include "sparsetrain/runtime.h"

int main() {
  namespace st = sparsetrain;
  const int64_t G = 2, T = 5, in = 3, out = 2;
  std::vector<float> x = {1, 2, 3, 0, 1, 0, 2, 0, 1, 1, 1, 1, 9, 9, 9};  // rows 0-2 expert 0, row 3 expert 1
  std::vector<float> w = {1, 0, 0, 0, 1, 1,                               // expert 0: [out, in]
                          1, 1, 1, 2, 0, -1};                             // expert 1
  st::GroupedLinearOptions o;
  o.num_groups = G;
  o.in_features = in;
  o.out_features = out;
  o.dtype = st::DType::kFP32;
  st::GroupedLinearParams p;
  p.weight = st::GroupedParam::packed(st::TensorView(w.data(), st::DType::kFP32, {G, out, in}));
  st::GroupedLinear layer(o, p);
  const st::Tensor y = layer.forward(st::TensorView(x.data(), st::DType::kFP32, {T, in}), st::Splits::host({3, 1}));
  const float* yv = y.view().data_as<const float>();
  const float expected[T * out] = {1, 5, 0, 1, 2, 1, 3, 1, 0, 0};  // the padded row is zero
  for (int i = 0; i < T * out; ++i)
    if (!(std::fabs(yv[i] - expected[i]) <= 1e-6f)) {
      std::printf("consumer: y[%d] = %g, expected %g\n", i, double(yv[i]), double(expected[i]));
      return 1;
    }
  std::printf("sparsetrain %s (CUDA backend %s)\nconsumer: ok\n", st::version(), st::built_with_cuda() ? "built" : "not built");
  return 0;
}

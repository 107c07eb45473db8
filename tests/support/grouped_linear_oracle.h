// Double-precision oracle for GroupedLinear: an independent, deliberately naive implementation
// (per element, in double, from the exact input values) that the reference backend is checked
// against. It also returns each element's sum of |terms| for the fp32 error bound.
#pragma once

#include <cmath>
#include <cstdint>
#include <vector>

#include "host_tensor.h"

namespace sparsetrain::testing {

struct GroupedLinearOracle {
  int64_t G, T, in, out;
  std::vector<int64_t> splits;
  std::vector<double> x, dy;                 // [T, in], [T, out]
  std::vector<std::vector<double>> w, bias;  // G x [out, in], G x [out] (bias empty if none)

  int64_t group_begin(int64_t g) const {
    int64_t b = 0;
    for (int64_t i = 0; i < g; ++i) b += splits[size_t(i)];
    return b;
  }
  int64_t rows_used() const { return group_begin(G); }

  // y[t, o] for t < S.
  OracleValues forward() const {
    const int64_t S = rows_used();
    OracleValues r{std::vector<double>(size_t(S * out)), std::vector<double>(size_t(S * out)),
                   std::vector<int64_t>(size_t(S * out), in)};
    for (int64_t g = 0; g < G; ++g)
      for (int64_t t = group_begin(g); t < group_begin(g + 1); ++t)
        for (int64_t o = 0; o < out; ++o) {
          double s = 0, a = 0;
          for (int64_t k = 0; k < in; ++k) {
            const double p = x[size_t(t * in + k)] * w[size_t(g)][size_t(o * in + k)];
            s += p;
            a += std::fabs(p);
          }
          if (!bias.empty()) {
            s += bias[size_t(g)][size_t(o)];
            a += std::fabs(bias[size_t(g)][size_t(o)]);
          }
          r.value[size_t(t * out + o)] = s;
          r.abs_sum[size_t(t * out + o)] = a;
        }
    return r;
  }

  // dx[t, k] for t < S.
  OracleValues dgrad() const {
    const int64_t S = rows_used();
    OracleValues r{std::vector<double>(size_t(S * in)), std::vector<double>(size_t(S * in)),
                   std::vector<int64_t>(size_t(S * in), out)};
    for (int64_t g = 0; g < G; ++g)
      for (int64_t t = group_begin(g); t < group_begin(g + 1); ++t)
        for (int64_t k = 0; k < in; ++k) {
          double s = 0, a = 0;
          for (int64_t o = 0; o < out; ++o) {
            const double p = dy[size_t(t * out + o)] * w[size_t(g)][size_t(o * in + k)];
            s += p;
            a += std::fabs(p);
          }
          r.value[size_t(t * in + k)] = s;
          r.abs_sum[size_t(t * in + k)] = a;
        }
    return r;
  }

  // dW of group g, [out, in] (all zero for a group with no rows), plus `base` (main_grad) if given.
  OracleValues wgrad(int64_t g, const std::vector<double>* base = nullptr) const {
    OracleValues r{std::vector<double>(size_t(out * in)), std::vector<double>(size_t(out * in)),
                   std::vector<int64_t>(size_t(out * in), splits[size_t(g)])};
    for (int64_t o = 0; o < out; ++o)
      for (int64_t k = 0; k < in; ++k) {
        double s = base ? (*base)[size_t(o * in + k)] : 0.0, a = std::fabs(s);
        for (int64_t t = group_begin(g); t < group_begin(g + 1); ++t) {
          const double p = dy[size_t(t * out + o)] * x[size_t(t * in + k)];
          s += p;
          a += std::fabs(p);
        }
        r.value[size_t(o * in + k)] = s;
        r.abs_sum[size_t(o * in + k)] = a;
      }
    return r;
  }

  // db of group g, [out].
  OracleValues bias_grad(int64_t g) const {
    OracleValues r{std::vector<double>(size_t(out)), std::vector<double>(size_t(out)),
                   std::vector<int64_t>(size_t(out), splits[size_t(g)])};
    for (int64_t o = 0; o < out; ++o)
      for (int64_t t = group_begin(g); t < group_begin(g + 1); ++t) {
        r.value[size_t(o)] += dy[size_t(t * out + o)];
        r.abs_sum[size_t(o)] += std::fabs(dy[size_t(t * out + o)]);
      }
    return r;
  }
};

}  // namespace sparsetrain::testing

// A GroupedLinear test case: random inputs of given shapes, the layer's options and parameter
// views (per-group or packed), and the matching double-precision oracle.
#pragma once

#include <random>
#include <string>
#include <vector>

#include "grouped_linear_oracle.h"
#include "host_tensor.h"
#include "sparsetrain/grouped_linear.h"

namespace sparsetrain::testing {

struct GroupedLinearCase {
  DType dtype = DType::kBF16;
  int64_t G = 4, T = 16, in = 8, out = 8;
  std::vector<int64_t> splits;  // sum <= T
  bool packed_weight = false, bias = false;
  bool fuse = false, overwrite = false, delay = false, has_attr = false;
  bool packed_main_grad = false;
  uint64_t seed = 0;

  HostTensor x, dy, w, b, main_grad;  // w [G, out, in], b [G, out], main_grad [G, out, in] fp32

  void make() {
    std::mt19937_64 rng(seed * 7919 + uint64_t(G * 131 + T * 17 + in * 3 + out));
    x = HostTensor(dtype, {T, in});
    dy = HostTensor(dtype, {T, out});
    w = HostTensor(dtype, {G, out, in});
    b = HostTensor(dtype, {G, out});
    main_grad = HostTensor(DType::kFP32, {G, out, in});
    x.fill_random(rng);
    dy.fill_random(rng);
    w.fill_random(rng, 1.0 / std::sqrt(double(in)));
    b.fill_random(rng);
    main_grad.fill_random(rng, 4.0);
  }

  GroupedLinearOptions options() const {
    GroupedLinearOptions o;
    o.num_groups = G;
    o.in_features = in;
    o.out_features = out;
    o.dtype = dtype;
    o.fuse_wgrad_accumulation = fuse;
    o.overwrite_main_grad = overwrite;
    o.delay_wgrad_compute = delay;
    return o;
  }

  static GroupedParam grouped(const HostTensor& t, bool packed, int64_t G) {
    if (packed) return GroupedParam::packed(t.view());
    std::vector<TensorView> v;
    for (int64_t g = 0; g < G; ++g) v.push_back(t.view().select(g));
    return GroupedParam::per_group(v);
  }

  GroupedLinearParams params() const {
    GroupedLinearParams p;
    p.weight = grouped(w, packed_weight, G);
    if (bias) p.bias = grouped(b, packed_weight, G);
    if (fuse) p.main_grad = grouped(main_grad, packed_main_grad, G);
    p.has_grad_added_to_main_grad = has_attr;
    return p;
  }

  GroupedLinearOracle oracle() const {
    GroupedLinearOracle o{G, T, in, out, splits, x.to_double(), dy.to_double(), {}, {}};
    for (int64_t g = 0; g < G; ++g) {
      o.w.push_back(HostTensor::copy_of(w.view().select(g)).to_double());
      if (bias) o.bias.push_back(HostTensor::copy_of(b.view().select(g)).to_double());
    }
    return o;
  }

  std::string name() const {
    std::string n = std::string(dtype_name(dtype)) + "_G" + std::to_string(G) + "_T" + std::to_string(T) +
                    "_in" + std::to_string(in) + "_out" + std::to_string(out);
    int64_t S = 0;
    for (int64_t s : splits) S += s;
    if (S < T) n += "_S" + std::to_string(S);
    if (packed_weight) n += "_packed";
    if (bias) n += "_bias";
    return n;
  }
};

// Row counts summing to S over G groups, with the given groups forced empty.
inline std::vector<int64_t> random_splits(int64_t G, int64_t S, std::vector<int64_t> empty, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<double> w(static_cast<size_t>(G));
  std::exponential_distribution<double> e(1.0);
  double total = 0;
  for (int64_t g = 0; g < G; ++g) {
    bool is_empty = false;
    for (int64_t z : empty) is_empty = is_empty || z == g;
    w[size_t(g)] = is_empty ? 0.0 : e(rng) + 0.05;
    total += w[size_t(g)];
  }
  std::vector<int64_t> s(static_cast<size_t>(G));
  int64_t used = 0;
  int64_t last_nonempty = 0;
  for (int64_t g = 0; g < G; ++g) {
    s[size_t(g)] = total > 0 ? int64_t(double(S) * w[size_t(g)] / total) : 0;
    used += s[size_t(g)];
    if (w[size_t(g)] > 0) last_nonempty = g;
  }
  s[size_t(last_nonempty)] += S - used;
  return s;
}

// A case of the given shape with S routed rows (the listed groups empty), fresh random data.
inline GroupedLinearCase random_case(DType dtype, int64_t G, int64_t T, int64_t S, int64_t in, int64_t out,
                                     const std::vector<int64_t>& empty, bool packed, bool bias, uint64_t seed) {
  GroupedLinearCase c;
  c.dtype = dtype;
  c.G = G;
  c.T = T;
  c.in = in;
  c.out = out;
  c.packed_weight = packed;
  c.bias = bias;
  c.splits = random_splits(G, S, empty, seed * 1000 + uint64_t(G * 7 + T));
  c.seed = seed;
  c.make();
  return c;
}

}  // namespace sparsetrain::testing

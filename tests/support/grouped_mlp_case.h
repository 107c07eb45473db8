// A GroupedMLP test case: fresh random inputs of given shapes, the layer's options and parameter
// views (per-group or packed), and the matching double-precision oracle.
#pragma once

#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "grouped_linear_case.h"
#include "grouped_mlp_oracle.h"
#include "host_tensor.h"
#include "sparsetrain/grouped_mlp.h"

namespace sparsetrain::testing {

struct GroupedMLPCase {
  DType dtype = DType::kBF16;
  int64_t G = 4, T = 16, in = 8, F = 8, out = 8, k = 0;
  std::vector<int64_t> splits;  // sum <= T
  bool packed = false, bias1 = false, bias2 = false;
  bool fuse = false, overwrite = false, delay = false, attr1 = false, attr2 = false;
  bool packed_main_grad = false;
  uint64_t seed = 0;

  // w1 [G, 2F, in], b1 [G, 2F], w2 [G, out, F], b2 [G, out], main_grads fp32 of the weights' shapes.
  HostTensor x, probs, dy, w1, b1, w2, b2, mg1, mg2;

  void make() {
    std::mt19937_64 rng(seed * 7919 + uint64_t(G * 131 + T * 17 + in * 3 + F * 5 + out + k * 11));
    x = HostTensor(dtype, {T, in});
    probs = HostTensor(DType::kFP32, {T});
    dy = HostTensor(dtype, {T, out});
    w1 = HostTensor(dtype, {G, 2 * F, in});
    b1 = HostTensor(dtype, {G, 2 * F});
    w2 = HostTensor(dtype, {G, out, F});
    b2 = HostTensor(dtype, {G, out});
    mg1 = HostTensor(DType::kFP32, {G, 2 * F, in});
    mg2 = HostTensor(DType::kFP32, {G, out, F});
    x.fill_random(rng);
    dy.fill_random(rng);
    // fc1's outputs spread over about [-2, 2]: silu's curved part, not just its linear tail.
    w1.fill_random(rng, 2.0 / std::sqrt(double(in)));
    b1.fill_random(rng, 0.5);
    w2.fill_random(rng, 1.0 / std::sqrt(double(F)));
    b2.fill_random(rng);
    std::uniform_real_distribution<double> u(0.0, 1.0);
    for (int64_t t = 0; t < T; ++t) probs.set(t, u(rng));
    mg1.fill_random(rng, 4.0);
    mg2.fill_random(rng, 4.0);
  }

  GroupedMLPOptions options() const {
    GroupedMLPOptions o;
    o.num_groups = G;
    o.in_features = in;
    o.ffn_features = F;
    o.out_features = out;
    o.dtype = dtype;
    o.glu_interleave_size = k;
    o.fuse_wgrad_accumulation = fuse;
    o.overwrite_main_grad = overwrite;
    o.delay_wgrad_compute = delay;
    return o;
  }

  GroupedMLPParams params() const {
    GroupedMLPParams p;
    p.fc1.weight = GroupedLinearCase::grouped(w1, packed, G);
    p.fc2.weight = GroupedLinearCase::grouped(w2, packed, G);
    if (bias1) p.fc1.bias = GroupedLinearCase::grouped(b1, packed, G);
    if (bias2) p.fc2.bias = GroupedLinearCase::grouped(b2, packed, G);
    if (fuse) {
      p.fc1.main_grad = GroupedLinearCase::grouped(mg1, packed_main_grad, G);
      p.fc2.main_grad = GroupedLinearCase::grouped(mg2, packed_main_grad, G);
    }
    p.fc1.has_grad_added_to_main_grad = attr1;
    p.fc2.has_grad_added_to_main_grad = attr2;
    return p;
  }

  GroupedMLPOracle oracle() const {
    GroupedMLPOracle o{dtype, G, T, in, F, out, k, splits, x.to_double(), probs.to_double(), dy.to_double(),
                       {}, {}, {}, {}};
    for (int64_t g = 0; g < G; ++g) {
      o.w1.push_back(HostTensor::copy_of(w1.view().select(g)).to_double());
      o.w2.push_back(HostTensor::copy_of(w2.view().select(g)).to_double());
      if (bias1) o.b1.push_back(HostTensor::copy_of(b1.view().select(g)).to_double());
      if (bias2) o.b2.push_back(HostTensor::copy_of(b2.view().select(g)).to_double());
    }
    return o;
  }

  int64_t rows_used() const {
    int64_t S = 0;
    for (int64_t s : splits) S += s;
    return S;
  }
};

// A case of the given shape with S routed rows (the listed groups empty), fresh random data.
inline GroupedMLPCase random_mlp_case(DType dtype, int64_t G, int64_t T, int64_t S, int64_t in, int64_t F,
                                      int64_t out, int64_t k, const std::vector<int64_t>& empty, bool packed,
                                      bool bias1, bool bias2, uint64_t seed) {
  GroupedMLPCase c;
  c.dtype = dtype;
  c.G = G;
  c.T = T;
  c.in = in;
  c.F = F;
  c.out = out;
  c.k = k;
  c.packed = packed;
  c.bias1 = bias1;
  c.bias2 = bias2;
  c.splits = random_splits(G, S, empty, seed * 1000 + uint64_t(G * 7 + T));
  c.seed = seed;
  c.make();
  return c;
}

}  // namespace sparsetrain::testing

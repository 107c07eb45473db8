// Double-precision oracle for GroupedMLP, written straight from the formula of docs/DESIGN.md section 5
// (y = probs * (silu(a) * b) W2^T + probs * b2) and its derivative, with no library code. Next to
// each value it carries a first-order bound on the error the library may make: fp32 accumulation
// (n + 2 roundings of the sum of |terms|), a few fp32 roundings per elementwise step, and one
// rounding to the dtype for every intermediate the library stores in it (fc1_out, h', dh',
// d fc1_out), propagated through what follows. compare_bounded() adds the final rounding.
#pragma once

#include <cmath>
#include <cstdint>
#include <sstream>
#include <string>
#include <vector>

#include "bounded.h"
#include "host_tensor.h"

namespace sparsetrain::testing {

struct GroupedMLPOracle {
  DType dtype;
  int64_t G, T, in, F, out, k;  // k: glu_interleave_size
  std::vector<int64_t> splits;
  std::vector<double> x, probs, dy;                  // [T, in], [T], [T, out]
  std::vector<std::vector<double>> w1, b1, w2, b2;   // G x [2F, in], [2F], [out, F], [out]; biases may be empty

  struct Forward {
    Bounded fc1_out;  // [S, 2F]
    Bounded out;      // [S, out]
  };
  struct Backward {
    Bounded dx;      // [S, in]
    Bounded dprobs;  // [S], fp32
    std::vector<Bounded> dw1, db1, dw2, db2;  // per group; db1 / db2 only with the bias
  };

  int64_t group_begin(int64_t g) const {
    int64_t b = 0;
    for (int64_t i = 0; i < g; ++i) b += splits[size_t(i)];
    return b;
  }
  int64_t rows_used() const { return group_begin(G); }
  int64_t group_of_row(int64_t t) const {
    int64_t g = 0;
    while (t >= group_begin(g + 1)) ++g;
    return g;
  }

  // Column c of fc1's output is a_j (is_a) or b_j. Halves: [a | b]. Interleaved: column c sits in
  // block c / k; even blocks are a's, odd blocks b's, block pair i holding a, b for j in [ik, ik+k).
  void column_role(int64_t c, bool* is_a, int64_t* j) const {
    if (k == 0) {
      *is_a = c < F;
      *j = c < F ? c : c - F;
      return;
    }
    const int64_t block = c / k;
    *is_a = block % 2 == 0;
    *j = (block / 2) * k + c % k;
  }
  // The inverse, from the same definition: the column of a_j or b_j.
  int64_t column_of(bool a, int64_t j) const {
    for (int64_t c = 0; c < 2 * F; ++c) {
      bool is_a;
      int64_t jj;
      column_role(c, &is_a, &jj);
      if (is_a == a && jj == j) return c;
    }
    return -1;
  }

  static double sigmoid(double v) { return 1.0 / (1.0 + std::exp(-v)); }
  static double silu(double v) { return v * sigmoid(v); }
  static double dsilu(double v) { return sigmoid(v) * (1.0 + v * (1.0 - sigmoid(v))); }

  double u() const { return unit_roundoff(dtype); }
  static double u32() { return std::ldexp(1.0, -24); }
  double round_err(double v) const { return rounding_error(dtype, v); }

  Forward forward() const {
    const int64_t S = rows_used();
    Forward f{Bounded(size_t(S * 2 * F)), Bounded(size_t(S * out))};
    for (int64_t t = 0; t < S; ++t) {
      const int64_t g = group_of_row(t);
      const double p = probs[size_t(t)];
      std::vector<double> z(size_t(2 * F)), ez(size_t(2 * F));
      for (int64_t c = 0; c < 2 * F; ++c) {
        double s = 0, a = 0;
        for (int64_t i = 0; i < in; ++i) {
          const double prod = x[size_t(t * in + i)] * w1[size_t(g)][size_t(c * in + i)];
          s += prod;
          a += std::fabs(prod);
        }
        if (!b1.empty()) s += b1[size_t(g)][size_t(c)], a += std::fabs(b1[size_t(g)][size_t(c)]);
        z[size_t(c)] = s;
        f.fc1_out.value[size_t(t * 2 * F + c)] = s;
        f.fc1_out.err[size_t(t * 2 * F + c)] = double(in + 2) * u32() * a;
        ez[size_t(c)] = double(in + 2) * u32() * a + round_err(s);  // as stored in the dtype
      }
      std::vector<double> hp(static_cast<size_t>(F)), ehp(static_cast<size_t>(F));
      for (int64_t j = 0; j < F; ++j) {
        const int64_t ca = column_of(true, j), cb = column_of(false, j);
        const double a = z[size_t(ca)], b = z[size_t(cb)], ea = ez[size_t(ca)], eb = ez[size_t(cb)];
        const double h = silu(a) * b;
        // silu' is bounded by 1.1 and silu'' by 0.5: first order with the slope's drift over ea.
        const double eh = (std::fabs(dsilu(a)) + 0.5 * ea) * ea * std::fabs(b) + (std::fabs(silu(a)) + 1.1 * ea) * eb +
                          16 * u32() * std::fabs(h);
        hp[size_t(j)] = p * h;
        ehp[size_t(j)] = std::fabs(p) * eh + 2 * u32() * std::fabs(p * h) + round_err(p * h);
      }
      for (int64_t o = 0; o < out; ++o) {
        double s = 0, a = 0, e = 0;
        for (int64_t j = 0; j < F; ++j) {
          const double w = w2[size_t(g)][size_t(o * F + j)];
          s += hp[size_t(j)] * w;
          a += std::fabs(hp[size_t(j)] * w);
          e += ehp[size_t(j)] * std::fabs(w);
        }
        e += double(F + 2) * u32() * a;
        if (!b2.empty()) {
          // fc2's output is rounded to the dtype before probs * b2 is added in fp32.
          const double pb = p * b2[size_t(g)][size_t(o)];
          e += round_err(s) + 4 * u32() * (std::fabs(s) + std::fabs(pb));
          s += pb;
        }
        f.out.value[size_t(t * out + o)] = s;
        f.out.err[size_t(t * out + o)] = e;
      }
    }
    return f;
  }

  // From the saved pre-activation `fc1_out` [T, 2F] exactly as the library got it (its values,
  // not the exact x W1^T + b1: backward is a function of what it is given).
  Backward backward(const std::vector<double>& fc1_out) const {
    const int64_t S = rows_used();
    Backward r{Bounded(size_t(S * in)), Bounded(size_t(S)), {}, {}, {}, {}};
    // Per row: h' (the fc2 input, recomputed) and d fc1_out, with their error bounds.
    std::vector<double> hp(size_t(S * F)), ehp(size_t(S * F)), dz(size_t(S * 2 * F)), edz(size_t(S * 2 * F));
    for (int64_t t = 0; t < S; ++t) {
      const int64_t g = group_of_row(t);
      const double p = probs[size_t(t)];
      double dp = 0, dp_abs = 0, dp_err = 0;
      for (int64_t j = 0; j < F; ++j) {
        const int64_t ca = column_of(true, j), cb = column_of(false, j);
        const double a = fc1_out[size_t(t * 2 * F + ca)], b = fc1_out[size_t(t * 2 * F + cb)];
        const double h = silu(a) * b, eh = 16 * u32() * std::fabs(h);
        hp[size_t(t * F + j)] = p * h;
        ehp[size_t(t * F + j)] = std::fabs(p) * eh + 2 * u32() * std::fabs(p * h) + round_err(p * h);
        // dh'_j = sum_o dy_o W2[o, j] (fc2's dgrad), stored in the dtype.
        double dhp = 0, dhp_abs = 0;
        for (int64_t o = 0; o < out; ++o) {
          const double prod = dy[size_t(t * out + o)] * w2[size_t(g)][size_t(o * F + j)];
          dhp += prod;
          dhp_abs += std::fabs(prod);
        }
        const double edhp = double(out + 2) * u32() * dhp_abs + round_err(dhp);
        dp += h * dhp;
        dp_abs += std::fabs(h * dhp);
        dp_err += std::fabs(h) * edhp + eh * std::fabs(dhp);
        // h' = p * silu(a) * b:  d/da = p b silu'(a),  d/db = p silu(a).
        const double da = p * dhp * b * dsilu(a), db = p * dhp * silu(a);
        dz[size_t(t * 2 * F + ca)] = da;
        dz[size_t(t * 2 * F + cb)] = db;
        edz[size_t(t * 2 * F + ca)] = std::fabs(p * b * dsilu(a)) * edhp + 16 * u32() * std::fabs(da) + round_err(da);
        edz[size_t(t * 2 * F + cb)] = std::fabs(p * silu(a)) * edhp + 16 * u32() * std::fabs(db) + round_err(db);
      }
      int64_t terms = F;
      if (!b2.empty()) {
        for (int64_t o = 0; o < out; ++o) {
          const double prod = dy[size_t(t * out + o)] * b2[size_t(g)][size_t(o)];
          dp += prod;
          dp_abs += std::fabs(prod);
        }
        terms += out;
      }
      r.dprobs.value[size_t(t)] = dp;
      r.dprobs.err[size_t(t)] = dp_err + double(terms + 2) * u32() * dp_abs;
    }
    // fc1's dgrad: dx = dz W1.
    for (int64_t t = 0; t < S; ++t) {
      const int64_t g = group_of_row(t);
      for (int64_t i = 0; i < in; ++i) {
        double s = 0, a = 0, e = 0;
        for (int64_t c = 0; c < 2 * F; ++c) {
          const double w = w1[size_t(g)][size_t(c * in + i)], d = dz[size_t(t * 2 * F + c)];
          s += d * w;
          a += std::fabs(d * w);
          e += edz[size_t(t * 2 * F + c)] * std::fabs(w);
        }
        r.dx.value[size_t(t * in + i)] = s;
        r.dx.err[size_t(t * in + i)] = e + double(2 * F + 2) * u32() * a;
      }
    }
    // Weight and bias grads, per group: sums over the group's rows.
    for (int64_t g = 0; g < G; ++g) {
      const int64_t begin = group_begin(g), end = group_begin(g + 1), n = end - begin;
      Bounded dw1(static_cast<size_t>(2 * F * in)), db1v(static_cast<size_t>(2 * F)), dw2(static_cast<size_t>(out * F)),
          db2v(static_cast<size_t>(out));
      for (int64_t c = 0; c < 2 * F; ++c) {
        double bs = 0, ba = 0, be = 0;
        for (int64_t i = 0; i < in; ++i) {
          double s = 0, a = 0, e = 0;
          for (int64_t t = begin; t < end; ++t) {
            const double d = dz[size_t(t * 2 * F + c)], xv = x[size_t(t * in + i)];
            s += d * xv;
            a += std::fabs(d * xv);
            e += edz[size_t(t * 2 * F + c)] * std::fabs(xv);
          }
          dw1.value[size_t(c * in + i)] = s;
          dw1.err[size_t(c * in + i)] = e + double(n + 2) * u32() * a;
        }
        for (int64_t t = begin; t < end; ++t) {
          bs += dz[size_t(t * 2 * F + c)];
          ba += std::fabs(dz[size_t(t * 2 * F + c)]);
          be += edz[size_t(t * 2 * F + c)];
        }
        db1v.value[size_t(c)] = bs;
        db1v.err[size_t(c)] = be + double(n + 2) * u32() * ba;
      }
      for (int64_t o = 0; o < out; ++o) {
        for (int64_t j = 0; j < F; ++j) {
          double s = 0, a = 0, e = 0;
          for (int64_t t = begin; t < end; ++t) {
            const double d = dy[size_t(t * out + o)];
            s += d * hp[size_t(t * F + j)];
            a += std::fabs(d * hp[size_t(t * F + j)]);
            e += std::fabs(d) * ehp[size_t(t * F + j)];
          }
          dw2.value[size_t(o * F + j)] = s;
          dw2.err[size_t(o * F + j)] = e + double(n + 2) * u32() * a;
        }
        double s = 0, a = 0;
        for (int64_t t = begin; t < end; ++t) {
          s += probs[size_t(t)] * dy[size_t(t * out + o)];
          a += std::fabs(probs[size_t(t)] * dy[size_t(t * out + o)]);
        }
        db2v.value[size_t(o)] = s;
        db2v.err[size_t(o)] = double(n + 3) * u32() * a;
      }
      r.dw1.push_back(dw1);
      r.dw2.push_back(dw2);
      if (!b1.empty()) r.db1.push_back(db1v);
      if (!b2.empty()) r.db2.push_back(db2v);
    }
    return r;
  }

  // sum over rows < S of dy . y: the loss whose gradient backward computes (finite-difference
  // checks of the oracle itself).
  double loss() const {
    const Forward f = forward();
    double l = 0;
    for (int64_t t = 0; t < rows_used(); ++t)
      for (int64_t o = 0; o < out; ++o) l += dy[size_t(t * out + o)] * f.out.value[size_t(t * out + o)];
    return l;
  }
};

}  // namespace sparsetrain::testing

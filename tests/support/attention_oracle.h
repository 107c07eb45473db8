// Double-precision dense oracle for masked attention, written from the formula (attention.h) with
// no library code: the element mask comes straight from the spec's definition (mask_spec.h's
// comments, re-implemented here) or from the predicate a bitmask mask was made from; softmax over
// the allowed keys; the analytic backward. Next to each value it carries a first-order bound on
// the error an fp32 implementation may make: the fp32 dot products of the scores, exp / log and
// the softmax sums, fp32 accumulation of the outputs, and the rounding of o to the dtype that the
// backward reads back (delta = rowsum(dO * o)). compare_bounded() adds the final rounding.
#pragma once

#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <vector>

#include "bounded.h"
#include "host_tensor.h"
#include "sparsetrain/mask_spec.h"

namespace sparsetrain::testing {

// The definition of each built-in spec (mask_spec.h), over attention batch b; positions absolute.
inline bool spec_allows(const MaskSpec& s, int64_t b, int64_t seq_q, int64_t seq_kv, int64_t q, int64_t kv) {
  auto doc = [b](const TensorView& t, int64_t pos) {
    const int64_t row = t.size(0) == 1 ? 0 : b;
    return t.data_as<const int32_t>()[row * t.stride(0) + pos * t.stride(1)];
  };
  switch (s.kind) {
    case MaskKind::kFull: return true;
    case MaskKind::kCausal: return kv <= q;
    case MaskKind::kCausalBottomRight: return kv - (seq_kv - seq_q) <= q;
    case MaskKind::kSlidingWindow: {
      const bool left_ok = s.window_left < 0 || q - kv <= s.window_left;
      const bool right_ok = s.window_right < 0 || kv - q <= s.window_right;
      return left_ok && right_ok;
    }
    case MaskKind::kDocument: return doc(s.doc_q, q) == doc(s.doc_kv, kv);
    case MaskKind::kDocumentCausal: return doc(s.doc_q, q) == doc(s.doc_kv, kv) && kv <= q;
    case MaskKind::kPrefixLM: return kv <= q || kv < s.prefix_length;
    case MaskKind::kBitmask: break;
  }
  return false;
}

// Element (b, s, h, d) of a [B, S, H, D] view of any strides, as double.
inline double element(const TensorView& t, int64_t b, int64_t s, int64_t h, int64_t d) {
  const int64_t off = b * t.stride(0) + s * t.stride(1) + h * t.stride(2) + d * t.stride(3);
  return double(load_float(t.byte_ptr(off), t.dtype(), 0));
}

struct AttentionOracle {
  int64_t B = 0, Sq = 0, Skv = 0, Hq = 0, Hkv = 0, D = 0;
  double scale = 0;
  DType dtype = DType::kFP32;
  // The type P (and, in the backward, dS) is rounded to before it meets the next GEMM: the GPU
  // kernels feed o = P V, dV = P^T dO, dK = dS^T Q and dQ = dS K 16-bit operands (the CPU
  // reference keeps fp32); each such term then carries that rounding too.
  DType p_operand = DType::kFP32;
  TensorView q, k, v, dout;  // [B, S, H, D] views (any strides) of what the library sees
  // allowed(b, hq, i, j) over the attention's batch and query heads.
  std::function<bool(int64_t, int64_t, int64_t, int64_t)> allowed;

  struct Result {
    Bounded o, dq, dk, dv;                  // [B, Sq, Hq, D], [B, Skv, Hkv, D]
    std::vector<double> lse, lse_err;       // [B, Hq, Sq]; -inf for a row with no allowed key
    int64_t empty_rows = 0, allowed_pairs = 0;
  };

  // A [B, S, H, D] view as a contiguous double array.
  std::vector<double> dense(const TensorView& t, int64_t S, int64_t H) const {
    std::vector<double> out(size_t(B * S * H * D));
    size_t x = 0;
    for (int64_t b = 0; b < B; ++b)
      for (int64_t s = 0; s < S; ++s)
        for (int64_t h = 0; h < H; ++h)
          for (int64_t d = 0; d < D; ++d) out[x++] = element(t, b, s, h, d);
    return out;
  }

  Result run() const {
    const double u32 = std::ldexp(1.0, -24);
    const double u_operand = p_operand == DType::kFP32 ? 0.0 : unit_roundoff(p_operand);
    Result r;
    const size_t nq = size_t(B * Sq * Hq * D), nk = size_t(B * Skv * Hkv * D);
    r.o = Bounded(nq);
    r.dq = Bounded(nq);
    r.dk = Bounded(nk);
    r.dv = Bounded(nk);
    r.lse.assign(size_t(B * Hq * Sq), 0.0);
    r.lse_err.assign(size_t(B * Hq * Sq), 0.0);
    // dk / dv: sums of |terms| and term counts, for the accumulation part of their bounds.
    std::vector<double> dk_abs(nk, 0.0), dv_abs(nk, 0.0), kv_terms(nk, 0.0);
    const int64_t group = Hq / Hkv;
    const std::vector<double> K = dense(k, Skv, Hkv), V = dense(v, Skv, Hkv);
    const auto kval = [&](int64_t b, int64_t j, int64_t hk, int64_t d) { return K[size_t(((b * Skv + j) * Hkv + hk) * D + d)]; };
    const auto vval = [&](int64_t b, int64_t j, int64_t hk, int64_t d) { return V[size_t(((b * Skv + j) * Hkv + hk) * D + d)]; };
    std::vector<int64_t> keys;
    std::vector<double> s, es, p, dp, ds, dds;
    const size_t nd = static_cast<size_t>(D);
    std::vector<double> qi(nd), doi(nd), oi(nd), oerr(nd);
    for (int64_t b = 0; b < B; ++b)
      for (int64_t h = 0; h < Hq; ++h) {
        const int64_t hk = h / group;
        for (int64_t i = 0; i < Sq; ++i) {
          keys.clear();
          for (int64_t j = 0; j < Skv; ++j)
            if (allowed(b, h, i, j)) keys.push_back(j);
          const size_t n = keys.size();
          const size_t lrow = size_t((b * Hq + h) * Sq + i);
          const auto qidx = [&](int64_t d) { return size_t(((b * Sq + i) * Hq + h) * D + d); };
          const auto kidx = [&](int64_t j, int64_t d) { return size_t(((b * Skv + j) * Hkv + hk) * D + d); };
          if (n == 0) {  // o = 0, lse = -inf, no gradient (all stay 0 with a 0 bound)
            r.lse[lrow] = -std::numeric_limits<double>::infinity();
            ++r.empty_rows;
            continue;
          }
          r.allowed_pairs += int64_t(n);
          for (int64_t d = 0; d < D; ++d) {
            qi[size_t(d)] = element(q, b, i, h, d);
            doi[size_t(d)] = element(dout, b, i, h, d);
          }
          s.assign(n, 0.0);
          es.assign(n, 0.0);
          double mx = -std::numeric_limits<double>::infinity(), Es = 0;
          for (size_t t = 0; t < n; ++t) {
            double dotv = 0, abs_dot = 0;
            for (int64_t d = 0; d < D; ++d) {
              const double kd = kval(b, keys[t], hk, d);
              dotv += qi[size_t(d)] * kd;
              abs_dot += std::fabs(qi[size_t(d)] * kd);
            }
            s[t] = scale * dotv;
            es[t] = std::fabs(scale) * double(D + 1) * u32 * abs_dot;  // fp32 dot and the scale
            Es = std::max(Es, es[t]);
            mx = std::max(mx, s[t]);
          }
          double sum = 0;
          for (size_t t = 0; t < n; ++t) sum += std::exp(s[t] - mx);
          const double lse = mx + std::log(sum);
          r.lse[lrow] = lse;
          r.lse_err[lrow] = Es + double(n + 3) * u32 + 2 * u32 * std::fabs(lse);
          p.assign(n, 0.0);
          for (size_t t = 0; t < n; ++t) p[t] = std::exp(s[t] - lse);
          // Forward: p's relative error (scores, exp, the sum, the division), then o's accumulation.
          const double ep_f = 2 * Es + double(n + 4) * u32 + u_operand;
          for (int64_t d = 0; d < D; ++d) {
            double o = 0, a = 0;
            for (size_t t = 0; t < n; ++t) {
              const double vd = vval(b, keys[t], hk, d);
              o += p[t] * vd;
              a += p[t] * std::fabs(vd);
            }
            oi[size_t(d)] = o;
            oerr[size_t(d)] = (ep_f + double(n + 3) * u32) * a;
            r.o.value[qidx(d)] = o;
            r.o.err[qidx(d)] = oerr[size_t(d)];
          }
          // Backward: P recomputed from the stored lse; delta from the stored (rounded) o.
          double delta = 0, ddelta = 0, abs_delta = 0;
          for (int64_t d = 0; d < D; ++d) {
            const size_t dd = size_t(d);
            delta += doi[dd] * oi[dd];
            abs_delta += std::fabs(doi[dd] * oi[dd]);
            ddelta += std::fabs(doi[dd]) * (oerr[dd] + rounding_error(dtype, oi[dd]));
          }
          ddelta += double(D + 1) * u32 * abs_delta;
          dp.assign(n, 0.0);
          ds.assign(n, 0.0);
          dds.assign(n, 0.0);
          for (size_t t = 0; t < n; ++t) {
            double dpv = 0, abs_dp = 0;
            for (int64_t d = 0; d < D; ++d) {
              const double vd = vval(b, keys[t], hk, d);
              dpv += doi[size_t(d)] * vd;
              abs_dp += std::fabs(doi[size_t(d)] * vd);
            }
            const double ep_b = es[t] + r.lse_err[lrow] + 2 * u32;
            const double diff = dpv - delta;
            ds[t] = scale * p[t] * diff;
            dds[t] = std::fabs(scale) * p[t] *
                         ((ep_b + 3 * u32) * std::fabs(diff) + double(D + 1) * u32 * abs_dp + ddelta) +
                     u_operand * std::fabs(ds[t]);
          }
          for (int64_t d = 0; d < D; ++d) {
            double dq = 0, err = 0, abs_sum = 0;
            for (size_t t = 0; t < n; ++t) {
              const double kd = kval(b, keys[t], hk, d);
              dq += ds[t] * kd;
              err += dds[t] * std::fabs(kd);
              abs_sum += std::fabs(ds[t] * kd);
            }
            r.dq.value[qidx(d)] = dq;
            r.dq.err[qidx(d)] = err + double(n + 2) * u32 * abs_sum;
          }
          for (size_t t = 0; t < n; ++t) {
            const double ep_b = es[t] + r.lse_err[lrow] + 2 * u32;
            for (int64_t d = 0; d < D; ++d) {
              const size_t kk = kidx(keys[t], d);
              r.dk.value[kk] += ds[t] * qi[size_t(d)];
              r.dk.err[kk] += dds[t] * std::fabs(qi[size_t(d)]);
              dk_abs[kk] += std::fabs(ds[t] * qi[size_t(d)]);
              r.dv.value[kk] += p[t] * doi[size_t(d)];
              r.dv.err[kk] += (ep_b + u_operand) * p[t] * std::fabs(doi[size_t(d)]);
              dv_abs[kk] += p[t] * std::fabs(doi[size_t(d)]);
              kv_terms[kk] += 1;
            }
          }
        }
      }
    for (size_t x = 0; x < nk; ++x) {
      r.dk.err[x] += (kv_terms[x] + 2) * u32 * dk_abs[x];
      r.dv.err[x] += (kv_terms[x] + 2) * u32 * dv_abs[x];
    }
    return r;
  }
};

}  // namespace sparsetrain::testing

// The CPU reference of GroupedMLP's elementwise stages: plain loops in fp32 math, reading and
// writing the layer's dtype with load_float / store_float, every reduction (dprobs, the scaled
// bias grad) in one fixed order, so results are bitwise reproducible. It defines what the CUDA
// stages must match.
#include <cmath>
#include <cstring>
#include <vector>

#include "ops/grouped_mlp_backend.h"
#include "sparsetrain/error.h"

namespace sparsetrain::backend {
namespace {

float sigmoid(float v) { return 1.f / (1.f + std::exp(-v)); }

const void* row(const TensorView& t, int64_t r) { return t.byte_ptr(r * t.stride(0)); }
void* row_mut(const TensorView& t, int64_t r) { return t.byte_ptr(r * t.stride(0)); }
float prob(const TensorView& probs, int64_t t) { return probs.data_as<const float>()[t * probs.stride(0)]; }

void zero_rows(const TensorView& t, int64_t begin) {
  for (int64_t r = begin; r < t.size(0); ++r) std::memset(row_mut(t, r), 0, size_t(t.size(1)) * t.element_size());
}

// h'[t] = probs[t] * silu(a) * b into h (the layer's dtype) for rows < S; rows >= S zero.
void swiglu_rows(const SwigluForwardParams& p, const TensorView& h_out) {
  const DType dt = p.rows.dtype;
  const int64_t S = p.rows.offsets[p.rows.num_groups];
  const int64_t b_off = glu_b_offset(p.ffn, p.interleave);
  for (int64_t t = 0; t < S; ++t) {
    const void* z = row(p.fc1_out, t);
    void* h = row_mut(h_out, t);
    const float pr = prob(p.probs, t);
    for (int64_t j = 0; j < p.ffn; ++j) {
      const int64_t ca = glu_a_column(j, p.interleave);
      const float a = load_float(z, dt, ca), b = load_float(z, dt, ca + b_off);
      store_float(h, dt, j, pr * (a * sigmoid(a) * b));
    }
  }
  zero_rows(h_out, S);
}

// d fc1_out into dz (the layer's dtype) and dprobs for rows < S; rows >= S zero.
void swiglu_backward_rows(const SwigluBackwardParams& p, const TensorView& dz_out) {
  const DType dt = p.rows.dtype;
  const int64_t G = p.rows.num_groups, S = p.rows.offsets[G];
  const int64_t b_off = glu_b_offset(p.ffn, p.interleave);
  float* dprobs = p.dprobs.data_as<float>();
  for (int64_t g = 0; g < G; ++g) {
    const void* bias = p.bias.empty() ? nullptr : p.bias[size_t(g)].data();
    for (int64_t t = p.rows.offsets[g]; t < p.rows.offsets[g + 1]; ++t) {
      const void* z = row(p.fc1_out, t);
      const void* dh = row(p.dh, t);
      void* dz = row_mut(dz_out, t);
      const float pr = prob(p.probs, t);
      float dp = 0.f;  // j ascending, then the bias dot o ascending
      for (int64_t j = 0; j < p.ffn; ++j) {
        const int64_t ca = glu_a_column(j, p.interleave);
        const float a = load_float(z, dt, ca), b = load_float(z, dt, ca + b_off);
        const float sig = sigmoid(a), silu = a * sig;
        const float dhp = load_float(dh, dt, j);  // d loss / d h'
        dp += silu * b * dhp;
        const float dhv = pr * dhp;               // d loss / d h, h' = probs * h
        store_float(dz, dt, ca, dhv * b * sig * (1.f + a * (1.f - sig)));
        store_float(dz, dt, ca + b_off, dhv * silu);
      }
      if (bias) {
        const void* dy = row(p.dy, t);
        for (int64_t o = 0; o < p.out; ++o) dp += load_float(dy, dt, o) * load_float(bias, dt, o);
      }
      dprobs[t] = dp;
    }
  }
  zero_rows(dz_out, S);
  for (int64_t t = S; t < p.rows.num_rows; ++t) dprobs[t] = 0.f;
}

class ReferenceMLPBackend final : public GroupedMLPBackend {
 public:
  size_t scratch_bytes(DType, int64_t, int64_t, int64_t, int64_t out) const override {
    return size_t(out) * sizeof(float);  // the bias grad's fp32 accumulators
  }

  void swiglu_forward(const SwigluForwardParams& p, void*, Stream stream) override {
    if (!p.h_fp8.data.defined()) return swiglu_rows(p, p.h);
    // FP8: the definition, h' in the layer's dtype then the rowwise quantizer (host memory here;
    // the CUDA kernel keeps h' in registers).
    const int64_t T = p.rows.num_rows;
    std::vector<unsigned char> h(size_t(T * p.ffn) * dtype_size(p.rows.dtype));
    const int64_t shape[2] = {T, p.ffn}, strides[2] = {p.ffn, 1};
    const TensorView hv(h.data(), p.rows.dtype, shape, strides, 2, p.fc1_out.device());
    swiglu_rows(p, hv);
    fp8_blockwise_reference_backend().quantize_rowwise({{p.rows.num_groups, p.rows.offsets}, hv, p.h_fp8}, stream);
  }

  void swiglu_backward(const SwigluBackwardParams& p, void*, Stream stream) override {
    if (!p.dz_rowwise.data.defined()) return swiglu_backward_rows(p, p.fc1_out_grad);
    if (p.fc1_out_codes.data.defined()) {  // fc1_out restored from its codes, then as below
      const int64_t T = p.rows.num_rows, K = 2 * p.ffn;
      std::vector<unsigned char> z(size_t(T * K) * dtype_size(p.rows.dtype));
      const int64_t shape[2] = {T, K}, strides[2] = {K, 1};
      const TensorView zv(z.data(), p.rows.dtype, shape, strides, 2, p.dz_rowwise.data.device());
      fp8_blockwise_reference_backend().dequantize_rowwise({{p.rows.num_groups, p.rows.offsets}, p.fc1_out_codes, zv},
                                                           stream);
      SwigluBackwardParams q = p;
      q.fc1_out = zv;
      q.fc1_out_codes = {};
      return swiglu_backward(q, nullptr, stream);
    }
    // FP8: the definition, d fc1_out and h' in the layer's dtype, then the quantizers from them
    // (host memory here; the CUDA kernel keeps both in registers).
    const int64_t T = p.rows.num_rows;
    std::vector<unsigned char> dz(size_t(T * 2 * p.ffn) * dtype_size(p.rows.dtype));
    const int64_t shape[2] = {T, 2 * p.ffn}, strides[2] = {2 * p.ffn, 1};
    const TensorView dzv(dz.data(), p.rows.dtype, shape, strides, 2, p.fc1_out.device());
    swiglu_backward_rows(p, dzv);
    const Fp8Groups groups{p.rows.num_groups, p.rows.offsets};
    fp8_blockwise_reference_backend().quantize_both({groups, dzv, p.dz_rowwise, p.dz_columnwise}, stream);
    std::vector<unsigned char> h(size_t(T * p.ffn) * dtype_size(p.rows.dtype));
    const int64_t h_shape[2] = {T, p.ffn}, h_strides[2] = {p.ffn, 1};
    const TensorView hv(h.data(), p.rows.dtype, h_shape, h_strides, 2, p.fc1_out.device());
    swiglu_rows({p.rows, p.ffn, p.interleave, p.fc1_out, p.probs, hv, {}}, hv);
    fp8_blockwise_reference_backend().quantize_columnwise({groups, hv, p.h_columnwise}, stream);
  }

  void scaled_bias_add(const ScaledBiasAddParams& p, void*, Stream) override {
    const DType dt = p.rows.dtype;
    for (int64_t g = 0; g < p.rows.num_groups; ++g) {
      const void* bias = p.bias[size_t(g)].data();
      for (int64_t t = p.rows.offsets[g]; t < p.rows.offsets[g + 1]; ++t) {
        void* y = row_mut(p.y, t);
        const float pr = prob(p.probs, t);
        for (int64_t o = 0; o < p.out; ++o) store_float(y, dt, o, load_float(y, dt, o) + pr * load_float(bias, dt, o));
      }
    }
  }

  void scaled_bias_grad(const ScaledBiasGradParams& p, void* scratch, Stream) override {
    const DType dt = p.rows.dtype;
    float* acc = static_cast<float*>(scratch);
    for (int64_t g = 0; g < p.rows.num_groups; ++g) {
      for (int64_t o = 0; o < p.out; ++o) acc[o] = 0.f;
      for (int64_t t = p.rows.offsets[g]; t < p.rows.offsets[g + 1]; ++t) {
        const void* dy = row(p.dy, t);
        const float pr = prob(p.probs, t);
        for (int64_t o = 0; o < p.out; ++o) acc[o] += pr * load_float(dy, dt, o);
      }
      void* db = p.db[size_t(g)].data();
      for (int64_t o = 0; o < p.out; ++o) store_float(db, dt, o, acc[o]);
    }
  }
};

}  // namespace

GroupedMLPBackend& grouped_mlp_reference_backend() {
  static ReferenceMLPBackend backend;
  return backend;
}

}  // namespace sparsetrain::backend

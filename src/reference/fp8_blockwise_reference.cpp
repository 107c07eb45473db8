// The CPU reference of the FP8 recipe (docs/DESIGN.md section 12): quantizers and dequantizers as
// plain loops over the tiles of common/fp8_blockwise.h, and the three GEMMs as GroupedLinear's
// fp32 reference GEMMs run on the dequantized operands (exact fp32 values), so the summation order
// and the empty-group rules are that backend's, rounded once to the output dtype.
#include <algorithm>
#include <cstdint>

#include "common/fp8_blockwise.h"
#include "ops/fp8_blockwise_backend.h"

namespace sparsetrain::backend {
namespace {

float load(const TensorView& t, int64_t r, int64_t c) { return load_float(t.byte_ptr(r * t.stride(0)), t.dtype(), c); }
float& at(const TensorView& t, int64_t r, int64_t c) { return t.data_as<float>()[r * t.stride(0) + c * t.stride(1)]; }
uint8_t* codes(const Fp8Tensor& t) { return t.data.data_as<uint8_t>(); }
float* scales(const Fp8Tensor& t) { return t.scale.data_as<float>(); }

// The rows a quantizer reads (Fp8QuantizeParams::src_rows): operand row r is src's row rows[r],
// or src's row r without them.
struct Source {
  const TensorView& src;
  const int32_t* rows;
  float value(int64_t r, int64_t c) const { return load(src, rows ? rows[r] : r, c); }
};
Source source_of(const Fp8QuantizeParams& p) {
  return {p.src, p.src_rows.defined() ? p.src_rows.data_as<const int32_t>() : nullptr};
}

// Quantizes the operand's tile [r0, r1) x [c0, c1): store(r, c, code) for each element; returns
// the scale.
template <class Store>
float quantize_tile(const Source& src, int64_t r0, int64_t r1, int64_t c0, int64_t c1, Store store) {
  float amax = 0.f;
  for (int64_t r = r0; r < r1; ++r)
    for (int64_t c = c0; c < c1; ++c) amax = fp8_amax(amax, src.value(r, c));
  const float scale = fp8_scale(amax);
  for (int64_t r = r0; r < r1; ++r)
    for (int64_t c = c0; c < c1; ++c) store(r, c, fp8_quantize(src.value(r, c), scale));
  return scale;
}

// The rows of group g.
struct GroupRows {
  int64_t begin, rows;
};
GroupRows group_rows(const Fp8Groups& gr, int64_t g) {
  return {gr.offsets[g], gr.offsets[g + 1] - gr.offsets[g]};
}

TensorView f32_view(float* p, int64_t rows, int64_t cols) { return TensorView(p, DType::kFP32, {rows, cols}); }

// dst (rows x cols, dst's dtype) = src (fp32, row-major with `cols` per row), one rounding each.
void round_rows(const float* src, const TensorView& dst, int64_t rows) {
  const int64_t cols = dst.size(1);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) store_float(dst.byte_ptr(r * dst.stride(0)), dst.dtype(), c, src[r * cols + c]);
}

class ReferenceFp8Backend final : public Fp8BlockwiseBackend {
 public:
  void quantize_rowwise(const Fp8QuantizeParams& p, Stream) override {
    const int64_t K = p.src.size(1), KB = fp8_tiles(K);
    const Source src = source_of(p);
    uint8_t* q = codes(p.dst);
    for (int64_t g = 0; g < p.groups.num_groups; ++g) {
      const GroupRows gr = group_rows(p.groups, g);
      for (int64_t r = gr.begin; r < gr.begin + gr.rows; ++r)
        for (int64_t kb = 0; kb < KB; ++kb)
          scales(p.dst)[fp8_rowwise_scale_index(gr.begin, gr.rows, KB, r, kb)] =
              quantize_tile(src, r, r + 1, kb * kFp8Tile, std::min(K, (kb + 1) * kFp8Tile),
                            [&](int64_t i, int64_t c, uint8_t v) { q[i * K + c] = v; });
    }
  }

  void quantize_columnwise(const Fp8QuantizeParams& p, Stream) override {
    const int64_t C = p.src.size(1), columns = p.dst.data.size(1);
    const Source src = source_of(p);
    uint8_t* q = codes(p.dst);
    for (int64_t g = 0; g < p.groups.num_groups; ++g) {
      const GroupRows gr = group_rows(p.groups, g);
      const int64_t base = fp8_columnwise_tile_base(p.groups.offsets, g);
      auto index = [&](int64_t r, int64_t c) { return fp8_columnwise_data_index(columns, base, gr.begin, r, c); };
      const int64_t tiles = fp8_tiles(gr.rows);
      for (int64_t t = 0; t < tiles; ++t) {
        const int64_t r0 = gr.begin + t * kFp8Tile, r1 = std::min(gr.begin + gr.rows, r0 + kFp8Tile);
        for (int64_t c = 0; c < C; ++c)
          scales(p.dst)[fp8_columnwise_scale_index(base, t, C, c)] =
              quantize_tile(src, r0, r1, c, c + 1, [&](int64_t r, int64_t j, uint8_t v) { q[index(r, j)] = v; });
      }
      for (int64_t r = gr.begin + gr.rows; r < gr.begin + tiles * kFp8Tile; ++r)
        for (int64_t c = 0; c < C; ++c) q[index(r, c)] = 0;
    }
  }

  // One pass per block writes both copies: a block's scale does not depend on its orientation.
  // The definition: the two quantizers one after the other (the GPU's reads src once).
  void quantize_both(const Fp8QuantizeBothParams& p, Stream stream) override {
    quantize_rowwise({p.groups, p.src, p.rowwise, p.src_rows}, stream);
    quantize_columnwise({p.groups, p.src, p.columnwise, p.src_rows}, stream);
  }
  void quantize_weights(const Fp8WeightQuantizeParams& p, Stream) override {
    for (size_t g = 0; g < p.w.size(); ++g) {
      const TensorView& w = p.w[g];
      const int64_t out = w.size(0), in = w.size(1);
      uint8_t *q = codes(p.wq[g]), *qt = codes(p.wtq[g]);
      for (int64_t i0 = 0; i0 < out; i0 += kFp8Tile)
        for (int64_t j0 = 0; j0 < in; j0 += kFp8Tile) {
          const float scale = quantize_tile({w, nullptr}, i0, std::min(out, i0 + kFp8Tile), j0,
                                            std::min(in, j0 + kFp8Tile), [&](int64_t i, int64_t j, uint8_t v) {
                                              q[i * in + j] = v;
                                              qt[j * out + i] = v;
                                            });
          scales(p.wq[g])[fp8_block_scale_index(in, i0, j0)] = scale;
          scales(p.wtq[g])[fp8_block_scale_index(out, j0, i0)] = scale;
        }
    }
  }

  void dequantize_rowwise(const Fp8DequantizeParams& p, Stream) override {
    const int64_t K = p.dst.size(1), KB = fp8_tiles(K);
    for (int64_t g = 0; g < p.groups.num_groups; ++g) {
      const GroupRows gr = group_rows(p.groups, g);
      for (int64_t r = gr.begin; r < gr.begin + gr.rows; ++r)
        for (int64_t k = 0; k < K; ++k) {
          const float scale = scales(p.src)[fp8_rowwise_scale_index(gr.begin, gr.rows, KB, r, k / kFp8Tile)];
          store_float(p.dst.byte_ptr(r * p.dst.stride(0) + k * p.dst.stride(1)), p.dst.dtype(), 0,
                      fp8_dequantize(codes(p.src)[r * K + k], scale));
        }
    }
  }

  void dequantize_columnwise(const Fp8DequantizeParams& p, Stream) override {
    const int64_t C = p.dst.size(1), columns = p.src.data.size(1);
    for (int64_t g = 0; g < p.groups.num_groups; ++g) {
      const GroupRows gr = group_rows(p.groups, g);
      const int64_t base = fp8_columnwise_tile_base(p.groups.offsets, g);
      for (int64_t r = gr.begin; r < gr.begin + gr.rows; ++r)
        for (int64_t c = 0; c < C; ++c) {
          const float scale = scales(p.src)[fp8_columnwise_scale_index(base, (r - gr.begin) / kFp8Tile, C, c)];
          at(p.dst, r, c) =
              fp8_dequantize(codes(p.src)[fp8_columnwise_data_index(columns, base, gr.begin, r, c)], scale);
        }
    }
  }

  void dequantize_blocks(const Fp8Tensor& src, const TensorView& dst, Stream) override {
    const int64_t R = dst.size(0), C = dst.size(1);
    for (int64_t i = 0; i < R; ++i)
      for (int64_t j = 0; j < C; ++j)
        at(dst, i, j) = fp8_dequantize(codes(src)[i * C + j], scales(src)[fp8_block_scale_index(C, i, j)]);
  }

  // fp32 copies of both activations and of every weight, the GEMM's own scratch after them.
  size_t gemm_scratch_bytes(DType, int64_t num_groups, int64_t num_rows, int64_t in, int64_t out) const override {
    return size_t(num_rows * (in + out) + num_groups * out * in) * sizeof(float) +
           reference_backend().scratch_bytes(DType::kFP32, num_groups, num_rows, in, out);
  }

  void fprop(const Fp8FpropParams& p, void* scratch, Stream stream) override {
    const GroupedProblem& pr = p.problem;
    const Operands s(pr, scratch);
    FpropParams f{fp32(pr), f32_view(s.rows_in, pr.num_rows, pr.in), {}, {}, p.y, p.zero_tail};
    dequantize_rowwise({groups(pr), p.x, f.x}, stream);
    for (int64_t g = 0; g < pr.num_groups; ++g) {
      f.weight.push_back(f32_view(s.weight(g), pr.out, pr.in));
      dequantize_blocks(p.weight[size_t(g)], f.weight.back(), stream);
    }
    run_gemm(&GroupedLinearBackend::fprop, f, &FpropParams::y, s.rows_out, s.gemm, stream);
  }

  void dgrad(const Fp8DgradParams& p, void* scratch, Stream stream) override {
    const GroupedProblem& pr = p.problem;
    const Operands s(pr, scratch);
    DgradParams d{fp32(pr), f32_view(s.rows_out, pr.num_rows, pr.out), {}, p.dx, p.zero_tail};
    dequantize_rowwise({groups(pr), p.dy, d.dy}, stream);
    for (int64_t g = 0; g < pr.num_groups; ++g) {
      d.weight.push_back(f32_view(s.weight(g), pr.out, pr.in));
      // W_g^T's copy [in, out] read into W_g's [out, in] buffer through transposed strides.
      const int64_t shape[2] = {pr.in, pr.out}, strides[2] = {1, pr.in};
      dequantize_blocks(p.weight_t[size_t(g)], TensorView(s.weight(g), DType::kFP32, shape, strides, 2), stream);
    }
    run_gemm(&GroupedLinearBackend::dgrad, d, &DgradParams::dx, s.rows_in, s.gemm, stream);
  }

  void wgrad(const Fp8WgradParams& p, void* scratch, Stream stream) override {
    const GroupedProblem& pr = p.problem;
    const Operands s(pr, scratch);
    WgradParams w{fp32(pr), f32_view(s.rows_in, pr.num_rows, pr.in), f32_view(s.rows_out, pr.num_rows, pr.out),
                  p.target, p.dw, {}};
    dequantize_columnwise({groups(pr), p.x, w.x}, stream);
    dequantize_columnwise({groups(pr), p.dy, w.dy}, stream);
    const bool round = p.target == WgradTarget::kWeightGrad && pr.dtype != DType::kFP32;
    if (round)
      for (int64_t g = 0; g < pr.num_groups; ++g) w.dw[size_t(g)] = f32_view(s.weight(g), pr.out, pr.in);
    reference_backend().wgrad(w, s.gemm, stream);
    if (round)
      for (int64_t g = 0; g < pr.num_groups; ++g) round_rows(s.weight(g), p.dw[size_t(g)], pr.out);
  }

 private:
  // The scratch of gemm_scratch_bytes: [T, in] and [T, out] fp32 rows, G fp32 [out, in] weights.
  struct Operands {
    float *rows_in, *rows_out, *weights;
    void* gemm;
    int64_t weight_elems;
    Operands(const GroupedProblem& pr, void* scratch)
        : rows_in(static_cast<float*>(scratch)),
          rows_out(rows_in + pr.num_rows * pr.in),
          weights(rows_out + pr.num_rows * pr.out),
          gemm(weights + pr.num_groups * pr.out * pr.in),
          weight_elems(pr.out * pr.in) {}
    float* weight(int64_t g) const { return weights + g * weight_elems; }
  };

  static Fp8Groups groups(const GroupedProblem& pr) { return {pr.num_groups, pr.offsets}; }
  static GroupedProblem fp32(GroupedProblem pr) {
    pr.dtype = DType::kFP32;
    return pr;
  }
  // Runs one of GroupedLinear's fp32 reference GEMMs (fprop, dgrad) whose output f.*out is in the
  // layer's dtype: directly for fp32, else into `rows` (fp32 [T, cols]) and then rounded once, rows
  // below S, with the later rows zeroed if asked.
  template <class Params>
  static void run_gemm(void (GroupedLinearBackend::*gemm)(const Params&, void*, Stream), Params f,
                       TensorView Params::*out, float* rows, void* gemm_scratch, Stream stream) {
    const TensorView dst = f.*out;
    if (dst.dtype() == DType::kFP32) return (reference_backend().*gemm)(f, gemm_scratch, stream);
    f.*out = f32_view(rows, f.problem.num_rows, dst.size(1));
    (reference_backend().*gemm)(f, gemm_scratch, stream);
    const int64_t S = f.problem.offsets[f.problem.num_groups];
    round_rows(rows, dst, S);
    if (f.zero_tail && S < dst.size(0)) reference_backend().fill_zero(dst.rows(S, dst.size(0)), stream);
  }
};

}  // namespace

Fp8BlockwiseBackend& fp8_blockwise_reference_backend() {
  static ReferenceFp8Backend backend;
  return backend;
}

}  // namespace sparsetrain::backend

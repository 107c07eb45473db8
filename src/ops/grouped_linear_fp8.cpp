#include "ops/grouped_linear_fp8.h"

#include <algorithm>
#include <string>

#include "common/fp8_blockwise.h"
#include "ops/grouped_args.h"
#include "ops/pick_backend.h"
#include "sparsetrain/error.h"

namespace sparsetrain::ops {

namespace {

backend::Fp8BlockwiseBackend& fp8_backend(Device device) {
  return pick_backend(device, "x", backend::fp8_blockwise_reference_backend,
                      ST_CUDA_BACKEND(backend::fp8_blockwise_cuda_backend));
}

Fp8Operand quantized(Allocator& alloc, Device device, std::initializer_list<int64_t> data_shape, int64_t scales,
                     Stream stream) {
  return {Tensor::empty(DType::kUInt8, data_shape, device, alloc, stream),
          Tensor::empty(DType::kFP32, {std::max<int64_t>(scales, 1)}, device, alloc, stream)};
}
Fp8Operand quantized(const Fp8Layer& l, std::initializer_list<int64_t> data_shape, int64_t scales, Stream stream) {
  return quantized(l.alloc, l.device, data_shape, scales, stream);
}

backend::Fp8Groups groups(const Fp8Layer& l, const int64_t* offsets) { return {l.options.num_groups, offsets}; }

Fp8Operand rowwise_buffers(const Fp8Layer& l, const TensorView& src, Stream stream, const TensorView& src_rows = {}) {
  return fp8_rowwise_buffers(l.alloc, l.device, backend::fp8_operand_rows(src, src_rows), src.size(1), stream);
}

Fp8Operand rowwise(const Fp8Layer& l, const TensorView& src, const int64_t* offsets, Stream stream,
                   const TensorView& src_rows = {}) {
  Fp8Operand q = rowwise_buffers(l, src, stream, src_rows);
  fp8_backend(l.device).quantize_rowwise({groups(l, offsets), src, q.view(), src_rows}, stream);
  return q;
}

Fp8Operand columnwise_buffers(const Fp8Layer& l, const TensorView& src, Stream stream,
                              const TensorView& src_rows = {}) {
  return fp8_columnwise_buffers(l.alloc, l.device, backend::fp8_operand_rows(src, src_rows), src.size(1),
                                l.options.num_groups, stream);
}

Fp8Operand columnwise(const Fp8Layer& l, const TensorView& src, const int64_t* offsets, Stream stream,
                      const TensorView& src_rows = {}) {
  Fp8Operand q = columnwise_buffers(l, src, stream, src_rows);
  fp8_backend(l.device).quantize_columnwise({groups(l, offsets), src, q.view(), src_rows}, stream);
  return q;
}

}  // namespace

Fp8Operand fp8_save_rowwise(Allocator& alloc, const TensorView& src, backend::Fp8Groups groups, Stream stream) {
  Fp8Operand q = fp8_rowwise_buffers(alloc, src.device(), src.size(0), src.size(1), stream);
  fp8_backend(src.device()).quantize_rowwise({groups, src, q.view()}, stream);
  return q;
}

void fp8_restore_rowwise(const backend::Fp8Tensor& saved, backend::Fp8Groups groups, const TensorView& dst,
                         Stream stream) {
  fp8_backend(dst.device()).dequantize_rowwise({groups, saved, dst}, stream);
}

// Every expert's weight and its transposed copy, packed ([G, out, in] and [G, in, out] codes,
// [G, blocks] grids): four allocations whatever G.
struct QuantizedWeights {
  Fp8Operand w, wt;
  std::vector<backend::Fp8Tensor> per_group(bool transposed, const GroupedLinearOptions& o) const {
    const Fp8Operand& q = transposed ? wt : w;
    const int64_t rows = transposed ? o.in_features : o.out_features, cols = transposed ? o.out_features : o.in_features;
    const int64_t blocks = fp8_block_scale_count(rows, cols);
    std::vector<backend::Fp8Tensor> v;
    for (int64_t g = 0; g < o.num_groups; ++g) {
      const TensorView d = q.data.view().select(g);
      const TensorView s(q.scale.view().data_as<float>() + g * blocks, DType::kFP32, {blocks}, d.device());
      v.push_back({d, s});
    }
    return v;
  }
};

namespace {

// The weights at the call's version: the cached ones when the version matches, else quantized now
// (and cached when the version is not 0).
std::shared_ptr<const QuantizedWeights> weights(const Fp8Layer& l, Stream stream) {
  if (l.version != 0 && l.cache.version == l.version && l.cache.weights) return l.cache.weights;
  const GroupedLinearOptions& o = l.options;
  const int64_t G = o.num_groups, out = o.out_features, in = o.in_features, blocks = fp8_block_scale_count(out, in);
  auto q = std::make_shared<QuantizedWeights>(
      QuantizedWeights{quantized(l, {G, out, in}, G * blocks, stream), quantized(l, {G, in, out}, G * blocks, stream)});
  backend::Fp8WeightQuantizeParams p;
  p.w = group_views(l.weight, G);
  p.wq = q->per_group(false, o);
  p.wtq = q->per_group(true, o);
  fp8_backend(l.device).quantize_weights(p, stream);
  l.cache = l.version != 0 ? Fp8WeightCache{l.version, q} : Fp8WeightCache{};
  return q;
}

backend::GroupedProblem problem(const Fp8Layer& l, int64_t T, const int64_t* offsets) {
  const GroupedLinearOptions& o = l.options;
  return {o.dtype, o.num_groups, T, o.in_features, o.out_features, offsets, nullptr};
}

}  // namespace

void check_fp8_layer(const GroupedLinearOptions& o, bool has_bias) {
  if (o.fp8 == Fp8Recipe::kOff) return;
  ST_CHECK_ARG(o.dtype == DType::kBF16, "dtype", "bf16 with fp8 (the recipe's layer dtype)", dtype_name(o.dtype));
  // Rows of e4m3 codes on 16-byte boundaries: what the FP8 GEMMs' TMA loads need.
  ST_CHECK_ARG(o.in_features % 16 == 0, "in_features", "a multiple of 16 with fp8", o.in_features);
  ST_CHECK_ARG(o.out_features % 16 == 0, "out_features", "a multiple of 16 with fp8", o.out_features);
  ST_CHECK_ARG(!has_bias, "bias", "none with fp8 (the FP8 GEMMs have no bias epilogue)", "a bias");
}

size_t fp8_scratch_bytes(const GroupedLinearOptions& o, int64_t T, Device device) {
  if (o.fp8 == Fp8Recipe::kOff) return 0;
  return fp8_backend(device).gemm_scratch_bytes(o.dtype, o.num_groups, T, o.in_features, o.out_features);
}

Fp8Operand fp8_rowwise_buffers(Allocator& alloc, Device device, int64_t T, int64_t K, Stream stream) {
  return quantized(alloc, device, {T, K}, fp8_rowwise_scale_count(T, K), stream);
}

Fp8Operand fp8_columnwise_buffers(Allocator& alloc, Device device, int64_t T, int64_t C, int64_t G, Stream stream) {
  return quantized(alloc, device, {C, fp8_columnwise_columns(T, G)}, fp8_columnwise_scale_count(T, C, G), stream);
}

void fp8_fprop(const Fp8Layer& l, const TensorView& x, const TensorView& x_rows, const int64_t* offsets,
               const TensorView& y, bool zero_tail, void* scratch, Stream stream) {
  fp8_fprop_quantized(l, rowwise(l, x, offsets, stream, x_rows), offsets, y, zero_tail, scratch, stream);
}

void fp8_fprop_quantized(const Fp8Layer& l, const Fp8Operand& xq, const int64_t* offsets, const TensorView& y,
                         bool zero_tail, void* scratch, Stream stream) {
  const auto w = weights(l, stream);
  fp8_backend(l.device).fprop(
      {problem(l, xq.data.view().size(0), offsets), xq.view(), w->per_group(false, l.options), y, zero_tail}, scratch,
      stream);
}

void fp8_dgrad(const Fp8Layer& l, const TensorView& dy, const TensorView& dy_rows, const int64_t* offsets,
               const TensorView& dx, bool zero_tail, void* scratch, Stream stream, Fp8Operand* dy_columnwise) {
  Fp8Operand dyq;
  if (dy_columnwise) {
    dyq = rowwise_buffers(l, dy, stream, dy_rows);
    *dy_columnwise = columnwise_buffers(l, dy, stream, dy_rows);
    fp8_backend(l.device).quantize_both({groups(l, offsets), dy, dyq.view(), dy_columnwise->view(), dy_rows},
                                        stream);
  } else {
    dyq = rowwise(l, dy, offsets, stream, dy_rows);
  }
  fp8_dgrad_quantized(l, dyq, offsets, dx, zero_tail, scratch, stream);
}

void fp8_dgrad_quantized(const Fp8Layer& l, const Fp8Operand& dyq, const int64_t* offsets, const TensorView& dx,
                         bool zero_tail, void* scratch, Stream stream) {
  const auto w = weights(l, stream);
  fp8_backend(l.device).dgrad(
      {problem(l, dyq.data.view().size(0), offsets), dyq.view(), w->per_group(true, l.options), dx, zero_tail},
      scratch, stream);
}

void fp8_wgrad(const Fp8Layer& l, const TensorView& x, const TensorView& x_rows, const TensorView& dy, int64_t T,
               const int64_t* offsets, backend::WgradTarget target, const std::vector<TensorView>& dw, void* scratch,
               Stream stream, const Fp8Operand* dy_columnwise, const Fp8Operand* x_columnwise) {
  const Fp8Operand xc = x_columnwise ? Fp8Operand{} : columnwise(l, x, offsets, stream, x_rows);
  const Fp8Operand dyc = dy_columnwise ? Fp8Operand{} : columnwise(l, dy, offsets, stream);
  fp8_backend(l.device).wgrad({problem(l, T, offsets), (x_columnwise ? *x_columnwise : xc).view(),
                               (dy_columnwise ? *dy_columnwise : dyc).view(), target, dw},
                              scratch, stream);
}

}  // namespace sparsetrain::ops

// The internal interface of the FP8 recipe with blockwise scales (docs/DESIGN.md section 12): the
// quantizers of GroupedLinear's operands, their exact inverses, and the three grouped GEMMs on
// quantized operands. Codes are uint8 views (e4m3), scales fp32 views, in the layouts of
// common/fp8_blockwise.h. As for every backend, arguments arrive validated: shapes as stated
// below, codes and scales contiguous, sources with a unit last stride.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "ops/grouped_linear_backend.h"  // GroupedProblem, WgradTarget

namespace sparsetrain::backend {

// A quantized operand: e4m3 codes (uint8) and their tiles' fp32 scales.
struct Fp8Tensor {
  TensorView data, scale;
};

// Group g owns rows [offsets[g], offsets[g+1]) (on the compute device); rows from offsets[G] on
// are a padded tail, neither quantized nor written.
struct Fp8Groups {
  int64_t num_groups;
  const int64_t* offsets;  // [G + 1]
};

// Rowwise: src [T, K] -> data uint8 [T, K], scale fp32 [fp8_rowwise_scale_count(T, K)].
// Columnwise: src [T, C] -> data uint8 [C, fp8_columnwise_columns(T, G)] (the rest of each expert's
// last tile: zero codes), scale fp32 [fp8_columnwise_scale_count(T, C, G)].
// src is bf16, fp16 or fp32. Slots of no tile are not written.
// src_rows (optional): int32 [T] on the compute device, entries in [0, src rows): the operand's
// row r is src's row src_rows[r] (rows may repeat), so the quantizer gathers as it reads (the MoE
// layer's expert-major rows straight from its tokens, never written in the dtype). The codes and
// scales are bitwise those of the gathered matrix; T is src_rows' length, src's rows any number.
struct Fp8QuantizeParams {
  Fp8Groups groups;
  TensorView src;
  Fp8Tensor dst;
  TensorView src_rows = {};
};

// Both layouts of src [T, K] from one read of it (a gradient that dgrad reads rowwise and wgrad
// columnwise): bitwise what quantize_rowwise into `rowwise` and quantize_columnwise into
// `columnwise` write. src_rows as above.
struct Fp8QuantizeBothParams {
  Fp8Groups groups;
  TensorView src;
  Fp8Tensor rowwise, columnwise;
  TensorView src_rows = {};
};

// The operand's rows T: src_rows' length when given, else src's rows.
inline int64_t fp8_operand_rows(const TensorView& src, const TensorView& src_rows) {
  return src_rows.defined() ? src_rows.size(0) : src.size(0);
}

// The inverse: dst [T, K] (any strides) gets rows below S, exactly; fp32, or for the rowwise
// inverse also bf16 (exact too: a code times a power of two) or fp16.
struct Fp8DequantizeParams {
  Fp8Groups groups;
  Fp8Tensor src;
  TensorView dst;
};

// Per expert g: w[g] [out, in] (bf16, fp16 or fp32) -> wq[g] (data [out, in], scale
// [fp8_block_scale_count(out, in)]) and wtq[g], the transposed copy (data [in, out], scale
// [fp8_block_scale_count(in, out)]).
struct Fp8WeightQuantizeParams {
  std::vector<TensorView> w;
  std::vector<Fp8Tensor> wq, wtq;
};

// y = x W^T per group; y [>= S rows, out] in problem.dtype (bf16, fp16 or fp32), contiguous.
struct Fp8FpropParams {
  GroupedProblem problem;
  Fp8Tensor x;                    // rowwise [T, in]
  std::vector<Fp8Tensor> weight;  // G x blockwise [out, in]
  TensorView y;
  bool zero_tail;  // also zero y's rows [S, y rows)
};

// dx = dy W per group, read as dy (W^T)^T from the transposed copies; dx [>= S rows, in].
struct Fp8DgradParams {
  GroupedProblem problem;
  Fp8Tensor dy;                     // rowwise [T, out]
  std::vector<Fp8Tensor> weight_t;  // G x blockwise [in, out]
  TensorView dx;
  bool zero_tail;
};

// dW = dy^T x per group, from the columnwise copies; dw as GroupedLinear's wgrad writes it.
struct Fp8WgradParams {
  GroupedProblem problem;
  Fp8Tensor x, dy;  // columnwise [in, T], [out, T]
  WgradTarget target;
  std::vector<TensorView> dw;  // G x [out, in]
};

class Fp8BlockwiseBackend {
 public:
  virtual ~Fp8BlockwiseBackend() = default;

  virtual void quantize_rowwise(const Fp8QuantizeParams& p, Stream stream) = 0;
  virtual void quantize_columnwise(const Fp8QuantizeParams& p, Stream stream) = 0;
  virtual void quantize_both(const Fp8QuantizeBothParams& p, Stream stream) = 0;
  virtual void quantize_weights(const Fp8WeightQuantizeParams& p, Stream stream) = 0;
  virtual void dequantize_rowwise(const Fp8DequantizeParams& p, Stream stream) = 0;
  virtual void dequantize_columnwise(const Fp8DequantizeParams& p, Stream stream) = 0;
  // One blockwise matrix, either orientation: src.data [R, C] -> dst fp32 [R, C] (any strides).
  virtual void dequantize_blocks(const Fp8Tensor& src, const TensorView& dst, Stream stream) = 0;

  // Scratch the three GEMMs need; a function of the shapes only.
  virtual size_t gemm_scratch_bytes(DType dtype, int64_t num_groups, int64_t num_rows, int64_t in,
                                    int64_t out) const = 0;
  virtual void fprop(const Fp8FpropParams& p, void* scratch, Stream stream) = 0;
  virtual void dgrad(const Fp8DgradParams& p, void* scratch, Stream stream) = 0;
  virtual void wgrad(const Fp8WgradParams& p, void* scratch, Stream stream) = 0;
};

Fp8BlockwiseBackend& fp8_blockwise_reference_backend();
#if SPARSETRAIN_WITH_CUDA
Fp8BlockwiseBackend& fp8_blockwise_cuda_backend();
#endif

}  // namespace sparsetrain::backend

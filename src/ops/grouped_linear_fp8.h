// GroupedLinear's three GEMMs under the FP8 recipe (docs/DESIGN.md section 12): each operand is
// quantized as its GEMM reads it (x and dy rowwise for fprop and dgrad, columnwise for wgrad; the
// weights with their transposed copies, in one pass), into memory from the layer's allocator,
// then the FP8 backend's GEMM runs. Arguments arrive validated by ops/grouped_linear.cpp.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "ops/fp8_blockwise_backend.h"
#include "sparsetrain/grouped_linear.h"

namespace sparsetrain::ops {

struct QuantizedWeights;

// The weights quantized at one version (CallArgs::weight_version), both copies.
struct Fp8WeightCache {
  uint64_t version = 0;
  std::shared_ptr<const QuantizedWeights> weights;
};

// What the FP8 GEMMs read of the layer.
struct Fp8Layer {
  const GroupedLinearOptions& options;
  const GroupedParam& weight;
  Allocator& alloc;
  Device device;
  Fp8WeightCache& cache;
  uint64_t version;  // the call's CallArgs::weight_version
};

// The recipe's conditions on the layer, checked by the constructor: an Error naming the option.
void check_fp8_layer(const GroupedLinearOptions& o, bool has_bias);

// Scratch of the FP8 GEMMs for T rows (the quantized operands are allocated apart).
size_t fp8_scratch_bytes(const GroupedLinearOptions& o, int64_t T, Device device);

// A quantized operand that owns its codes and scales (from the layer's allocator).
struct Fp8Operand {
  Tensor data, scale;
  backend::Fp8Tensor view() const { return {data.view(), scale.view()}; }
};

// Codes [T, K] and scales for a rowwise operand of T rows, from `alloc` (unwritten).
Fp8Operand fp8_rowwise_buffers(Allocator& alloc, Device device, int64_t T, int64_t K, Stream stream);
// Codes [C, fp8_columnwise_columns(T, G)] and scales for a columnwise operand of T rows and C
// channels in G groups, from `alloc` (unwritten).
Fp8Operand fp8_columnwise_buffers(Allocator& alloc, Device device, int64_t T, int64_t C, int64_t G, Stream stream);

// An activation kept for backward in the recipe's rowwise form (the MoE layer's fc1 output under
// MoELayerOptions::fp8_saved_activations): src [T, K] quantized rowwise in `groups`, and the exact
// inverse of such an operand (quantized in the same groups) into dst [T, K] (fp32 or bf16: a code
// times a power of two is exact in both; fp16 rounds at its range's ends).
Fp8Operand fp8_save_rowwise(Allocator& alloc, const TensorView& src, backend::Fp8Groups groups, Stream stream);
void fp8_restore_rowwise(const backend::Fp8Tensor& saved, backend::Fp8Groups groups, const TensorView& dst,
                         Stream stream);

// y = x W^T, dx = dy W, dW = dy^T x per group, as the backend's fprop / dgrad / wgrad. offsets:
// the call's device-resident group offsets [G + 1]. dy_columnwise (dgrad): where given, dy's wgrad
// layout is written there from the same read of dy (quantize_both); wgrad then takes it instead
// of quantizing dy again.
// x_rows (optional, int32 [T]): fprop of x's rows gathered in that order (x then has any number
// of rows), the gather done by the quantizer (Fp8QuantizeParams::src_rows).
void fp8_fprop(const Fp8Layer& l, const TensorView& x, const TensorView& x_rows, const int64_t* offsets,
               const TensorView& y, bool zero_tail, void* scratch, Stream stream);
// fprop on x already quantized rowwise (a producer that wrote the codes, e.g. GroupedMLP's SwiGLU).
void fp8_fprop_quantized(const Fp8Layer& l, const Fp8Operand& xq, const int64_t* offsets, const TensorView& y,
                         bool zero_tail, void* scratch, Stream stream);
// dy_rows (optional, int32 [T]): dy's rows gathered by the quantizers, as fp8_fprop's x_rows.
void fp8_dgrad(const Fp8Layer& l, const TensorView& dy, const TensorView& dy_rows, const int64_t* offsets,
               const TensorView& dx, bool zero_tail, void* scratch, Stream stream,
               Fp8Operand* dy_columnwise = nullptr);
// dgrad on dy already quantized rowwise (a producer that wrote the codes, e.g. GroupedMLP's SwiGLU
// backward, with the wgrad layout beside them).
void fp8_dgrad_quantized(const Fp8Layer& l, const Fp8Operand& dyq, const int64_t* offsets, const TensorView& dx,
                         bool zero_tail, void* scratch, Stream stream);
// wgrad of T rows. x_rows (optional, int32 [T]): x's rows gathered by the columnwise quantizer, as
// fp8_fprop's; dy (without dy_columnwise) has T rows. dy_columnwise / x_columnwise: that operand
// already in its wgrad layout (dy / x then unused).
void fp8_wgrad(const Fp8Layer& l, const TensorView& x, const TensorView& x_rows, const TensorView& dy, int64_t T,
               const int64_t* offsets, backend::WgradTarget target, const std::vector<TensorView>& dw, void* scratch,
               Stream stream, const Fp8Operand* dy_columnwise = nullptr, const Fp8Operand* x_columnwise = nullptr);

}  // namespace sparsetrain::ops

// The internal interface of GroupedMLP's elementwise stages (the GEMMs are GroupedLinear's): the
// SwiGLU x probs activation, its backward, and fc2's probs-scaled bias and bias grad. A backend
// runs them on validated arguments; ops/grouped_mlp.cpp owns every rule. Row-wise stages read the
// group offsets from the compute device (S = offsets[G]) and never need host split values.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "common/fp8_blockwise.h"  // kFp8Tile
#include "common/host_device.h"
#include "ops/fp8_blockwise_backend.h"  // Fp8Tensor
#include "sparsetrain/allocator.h"
#include "sparsetrain/tensor.h"

namespace sparsetrain::backend {

// Column of fc1's output holding a_j (b_j: + glu_block_size). Halves (k = 0): a_j at j, b_j at
// F + j. Interleaved (k > 0): blocks of k columns alternate a, b, so a_j sits in block pair j / k.
ST_HOST_DEVICE inline int64_t glu_a_column(int64_t j, int64_t interleave) {
  return interleave == 0 ? j : (j / interleave) * 2 * interleave + j % interleave;
}
ST_HOST_DEVICE inline int64_t glu_b_offset(int64_t ffn, int64_t interleave) {
  return interleave == 0 ? ffn : interleave;
}
// Whether every 128-column FP8 tile of fc1's output (or its gradient) holds a's only or b's only,
// and the a's of 128 consecutive j pair with one tile of their b's: what SwiGLU's FP8 backward
// needs to make both tiles of a pair from one read (SwigluBackwardParams::dz_rowwise). The
// layer's options make interleave a divisor of ffn.
ST_HOST_DEVICE inline bool glu_tiles_pair(int64_t ffn, int64_t interleave) {
  return (interleave == 0 ? ffn : interleave) % kFp8Tile == 0;
}

struct MLPRows {
  DType dtype;
  int64_t num_groups;
  int64_t num_rows;  // T
  const int64_t* offsets;  // [G + 1] on the compute device; S = offsets[G]
};

// h'[t] = probs[t] * silu(a[t]) * b[t] in the layer's dtype for rows < S; rows >= S of h' zero.
struct SwigluForwardParams {
  MLPRows rows;
  int64_t ffn, interleave;
  TensorView fc1_out;  // [T, 2F], rows contiguous
  TensorView probs;    // fp32 [T]
  TensorView h;        // [T, F] contiguous
  // FP8 (h_fp8.data defined, h then unused): h' in the layer's dtype quantized rowwise, codes [T, F]
  // and scales as Fp8BlockwiseBackend::quantize_rowwise writes them from h' (rows below S), with
  // no h' in memory (fc2's forward reads nothing else of it).
  Fp8Tensor h_fp8;
};

// From h = silu(a) * b (recomputed) and dh' (the fc2 input's gradient), for rows < S:
//   dprobs = sum_j h_j dh'_j + dy . b2_g   (fp32, fixed order; the dot only with a bias)
//   da = probs dh' b silu'(a),  db = probs dh' silu(a)   -> d fc1_out in fc1_out's layout.
// Rows >= S of d fc1_out and dprobs are zero.
struct SwigluBackwardParams {
  MLPRows rows;
  int64_t ffn, interleave, out;
  TensorView fc1_out;            // [T, 2F]
  TensorView probs;              // fp32 [T]
  TensorView dh;                 // dh' [T, F]
  TensorView dy;                 // [T, out]; read only with a bias
  std::vector<TensorView> bias;  // fc2's bias, G x [out], or empty
  TensorView fc1_out_grad;       // [T, 2F] contiguous; may be fc1_out itself (each element is read
                                 // before its gradient is written, by the same thread)
  TensorView dprobs;             // fp32 [T] contiguous
  // FP8 (dz_rowwise.data defined, fc1_out_grad then unused): d fc1_out in the layer's dtype
  // quantized in both layouts, codes and scales as Fp8BlockwiseBackend::quantize_both writes them
  // from it (rows below S), with no d fc1_out in memory (fc1's dgrad and wgrad read nothing else
  // of it); and from the same read h' (SwigluForwardParams' h', fc2's input) in the dtype as
  // columnwise codes [F, fp8_columnwise_columns(T, G)], as quantize_columnwise writes them (fc2's
  // wgrad). Needs glu_tiles_pair(ffn, interleave) and no bias.
  Fp8Tensor dz_rowwise = {}, dz_columnwise = {}, h_columnwise = {};
  // With dz_rowwise, optional: fc1_out as its rowwise codes and scales in the groups (fc1_out then
  // unused), each value decoded and rounded to the dtype: fc1_out's values had it been restored
  // from them (Fp8BlockwiseBackend::dequantize_rowwise).
  Fp8Tensor fc1_out_codes = {};
};

// y[t] += probs[t] * b2_g for rows t < S of group g (fp32 add, one rounding to the dtype).
struct ScaledBiasAddParams {
  MLPRows rows;
  int64_t out;
  TensorView y;                  // [>= S, out]
  TensorView probs;              // fp32 [T]
  std::vector<TensorView> bias;  // G x [out]
};

// db2_g = sum over the rows of group g of probs[t] * dy[t] (fp32, rows ascending); 0 if empty.
struct ScaledBiasGradParams {
  MLPRows rows;
  int64_t out;
  TensorView dy;                 // [T, out]
  TensorView probs;              // fp32 [T]
  std::vector<TensorView> db;    // G x [out]
};

class GroupedMLPBackend {
 public:
  virtual ~GroupedMLPBackend() = default;
  // Scratch the stages need; a function of the shapes only.
  virtual size_t scratch_bytes(DType dtype, int64_t num_groups, int64_t num_rows, int64_t ffn,
                               int64_t out) const = 0;
  virtual void swiglu_forward(const SwigluForwardParams& p, void* scratch, Stream stream) = 0;
  virtual void swiglu_backward(const SwigluBackwardParams& p, void* scratch, Stream stream) = 0;
  virtual void scaled_bias_add(const ScaledBiasAddParams& p, void* scratch, Stream stream) = 0;
  virtual void scaled_bias_grad(const ScaledBiasGradParams& p, void* scratch, Stream stream) = 0;
};

GroupedMLPBackend& grouped_mlp_reference_backend();
#if SPARSETRAIN_WITH_CUDA
GroupedMLPBackend& grouped_mlp_cuda_backend();
#endif
// The backend that runs on `device`; an Error naming `arg` where this build has none.
GroupedMLPBackend& grouped_mlp_backend_for(Device device, const char* arg);

}  // namespace sparsetrain::backend

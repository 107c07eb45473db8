// Block-sparse attention (docs/DESIGN.md section 6): for each batch b, query head h and query row i,
//   o[b, i, h] = sum_j softmax_j(scale * q[b, i, h] . k[b, j, h / G]) v[b, j, h / G]
// over the keys j the BlockMask allows (G = Hq / Hkv query heads share a kv head: GQA / MQA), and
// lse[b, h, i] = the natural-log log-sum-exp of the allowed scores. A query row with no allowed
// key gives o = 0, lse = -inf, and zero gradients. Accumulation is fp32; results are bitwise
// deterministic (the CPU reference reduces in a fixed order).
#pragma once

#include "sparsetrain/allocator.h"
#include "sparsetrain/block_mask.h"
#include "sparsetrain/tensor.h"

namespace sparsetrain {

struct AttentionOptions {
  float scale = 0.f;           // 0: 1 / sqrt(D); >= 0 (a negative scale is refused)
  bool deterministic = true;   // the backward's dQ reduction order (the CPU reference always is)
  // CUDA: at most this many SMs' worth of persistent CTAs (0: every SM), e.g. to leave SMs to
  // communication kernels. Results never depend on it (the deterministic backward is bitwise
  // the same for any value).
  int sm_limit = 0;
};

struct AttentionCall {
  Stream stream;
  Allocator* allocator = nullptr;  // outputs come from here (default_allocator() if null)
};

struct AttentionForward {
  Tensor o;    // [B, Sq, Hq, D] in q's dtype, contiguous
  Tensor lse;  // [B, Hq, Sq] fp32
};

struct AttentionGrads {
  Tensor dq;  // [B, Sq, Hq, D]
  Tensor dk;  // [B, Skv, Hkv, D]
  Tensor dv;  // [B, Skv, Hkv, D]
};

// q [B, Sq, Hq, D], k and v [B, Skv, Hkv, D]: any strides with the last dim contiguous (BSHD or a
// BHSD tensor's transposed view), one dtype (fp32, bf16, fp16), Hq a multiple of Hkv. The mask's
// seq_q / seq_kv must match and its leading dims broadcast to [B, Hq]. Bad input throws
// sparsetrain::Error naming the argument; nothing is allocated or written first.
AttentionForward block_sparse_attention_forward(const TensorView& q, const TensorView& k, const TensorView& v,
                                                const BlockMask& mask, const AttentionOptions& options = {},
                                                const AttentionCall& call = {});

// From the forward's o and lse and the output gradient dout [B, Sq, Hq, D].
AttentionGrads block_sparse_attention_backward(const TensorView& q, const TensorView& k, const TensorView& v,
                                               const TensorView& o, const TensorView& lse, const TensorView& dout,
                                               const BlockMask& mask, const AttentionOptions& options = {},
                                               const AttentionCall& call = {});

}  // namespace sparsetrain

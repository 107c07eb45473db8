// The internal interface every block-sparse attention backend implements (CPU reference now, CUDA
// later). ops/attention.cpp owns every rule (validation of the tensors and the mask, the default
// scale, output allocation); a backend runs forward and backward on validated arguments and
// writes every element of its outputs. Params are framework-free views in the style of FA3's
// params structs.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "sparsetrain/allocator.h"
#include "sparsetrain/block_mask.h"
#include "sparsetrain/tensor.h"

namespace sparsetrain::backend {

struct AttentionProblem {
  DType dtype;  // of q, k, v, o, dout, dq, dk, dv
  int64_t batch, seq_q, seq_kv, heads_q, heads_kv, head_dim;
  float scale;  // resolved: never 0
};

// q [B, Sq, Hq, D], k / v [B, Skv, Hkv, D]: last dim contiguous, any other strides.
// o [B, Sq, Hq, D] and lse fp32 [B, Hq, Sq]: contiguous, written in full (o = 0, lse = -inf for a
// query row with no allowed key).
struct AttentionForwardParams {
  AttentionProblem problem;
  TensorView q, k, v;
  const BlockMask* mask;  // validated against the problem; leading dims broadcast to [B, Hq]
  TensorView o, lse;
  int sm_limit;  // CUDA: at most this many SMs' worth of CTAs (0: all)
};

// o and dout [B, Sq, Hq, D] (last dim contiguous), lse fp32 [B, Hq, Sq] (any strides).
// dq [B, Sq, Hq, D], dk / dv [B, Skv, Hkv, D]: contiguous, written in full (zero where nothing
// contributes); the library's own, so a backend may use their bytes as scratch before it writes
// them (the CUDA backend: dq's, BwdScratch).
struct AttentionBackwardParams {
  AttentionProblem problem;
  TensorView q, k, v, o, lse, dout;
  const BlockMask* mask;  // with its transposes (q_num_blocks / q_indices, full_q_*)
  bool deterministic;
  TensorView dq, dk, dv;
  int sm_limit;  // CUDA: at most this many SMs' worth of CTAs (0: all); results never depend on it
};

class AttentionBackend {
 public:
  virtual ~AttentionBackend() = default;
  // What this backend cannot run (a dtype, a head dim, an alignment, a mask it cannot walk) throws
  // an Error naming the argument, before anything is allocated. q, k, v and the mask have passed
  // the backend-independent checks; `backward` is null for the forward, else the backward's
  // other inputs (o, lse, dout checked against q already) and options.
  struct BackwardInputs {
    const TensorView& o;
    const TensorView& lse;
    const TensorView& dout;
    bool deterministic;
  };
  virtual void check_supported(const AttentionProblem& /*p*/, const TensorView& /*q*/, const TensorView& /*k*/,
                               const TensorView& /*v*/, const BlockMask& /*mask*/,
                               const BackwardInputs* /*backward*/) const {}
  // Scratch each pass needs; a function of the shapes (and the backward's of the mask's length:
  // a padded mask's, BlockMask::backward_padded) only.
  virtual size_t forward_scratch_bytes(const AttentionProblem& p) const = 0;
  virtual size_t backward_scratch_bytes(const AttentionProblem& p, const BlockMask& mask) const = 0;
  virtual void forward(const AttentionForwardParams& p, void* scratch, Stream stream) = 0;
  virtual void backward(const AttentionBackwardParams& p, void* scratch, Stream stream) = 0;
};

AttentionBackend& attention_reference_backend();
#if SPARSETRAIN_WITH_CUDA
// The sm90 kernels (src/cuda/attention/attention_cuda.cu).
AttentionBackend& attention_cuda_backend();
// Whether this build compiled the sm90 kernels for (dtype, head dim), and those kernels in words
// (check_supported's message): both read the generated instance list (sm90/sm90_instances.h).
bool attention_cuda_has_kernel(DType dtype, int64_t head_dim);
std::string attention_cuda_kernels();
#endif
// The backend that runs on `device`; an Error naming `arg` where this build has none.
AttentionBackend& attention_backend_for(Device device, const char* arg);

}  // namespace sparsetrain::backend

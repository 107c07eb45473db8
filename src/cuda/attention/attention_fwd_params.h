// The sm90 attention forward's arguments, framework-free (no CuTe, no CUDA types), filled by the
// backend (attention_cuda.cu) and read by every instantiation (attention_fwd_sm90.cuh).
#pragma once

#include <cstdint>

#include "common/attention/attention_fwd_walk.h"
#include "common/host_device.h"
#include "sparsetrain/mask_spec.h"

namespace sparsetrain::cuda::attn {

// The mask inside partial blocks, as the kernels (forward and backward) evaluate it per element.
struct KernelMaskSpec {
  MaskKind kind = MaskKind::kFull;
  int64_t window_left = -1, window_right = -1, prefix_length = 0;
  const int32_t* doc_q = nullptr;  // [B or 1, Sq] rows (doc_*_stride_b = 0 broadcasts)
  const int32_t* doc_kv = nullptr;
  int64_t doc_q_stride_b = 0, doc_kv_stride_b = 0;
  // kBitmask: uint8 [B, H, Mq, W, bytes] parallel to kv_indices (leading dims broadcast).
  const uint8_t* bits = nullptr;
  int64_t bits_stride_b = 0, bits_stride_h = 0, bits_stride_m = 0, bits_stride_w = 0;
  int32_t bits_width = 0;  // W: a partial entry at or past it (a corrupt device count) allows nothing
  int32_t block_kv = 128;  // mask block columns (bit index = row_in_block * block_kv + col_in_block)
};

// A partial block's bits: uint8 [block_q rows, block_kv / 8] of batch b, head h, mask row `row` and
// entry `entry` of its kv list (KernelMaskSpec::bits; leading dims broadcast by zero strides).
ST_HOST_DEVICE inline const uint8_t* bitmask_block(const KernelMaskSpec& m, int64_t b, int64_t h, int64_t row,
                                                   int64_t entry) {
  return m.bits + b * m.bits_stride_b + h * m.bits_stride_h + row * m.bits_stride_m + entry * m.bits_stride_w;
}

struct FwdArgs {
  const void* q;  // [B, Sq, Hq, D], strides in elements (last dim 1)
  const void* k;  // [B, Skv, Hkv, D]
  const void* v;
  int64_t q_stride_b, q_stride_s, q_stride_h;
  int64_t k_stride_b, k_stride_s, k_stride_h;
  int64_t v_stride_b, v_stride_s, v_stride_h;
  void* o;     // [B, Sq, Hq, D] contiguous
  float* lse;  // [B, Hq, Sq] contiguous
  int32_t batch, seq_q, seq_kv, heads_q, heads_kv;
  float scale;
  MaskWalkLists lists;  // sub_tiles in units of the kernel's kv tile
  KernelMaskSpec spec;
  const FwdWorkRecord* records;  // work items with their walk counts in the work order ([num_items])
  int32_t* ticket;               // the dynamic hand-out's counter (zeroed by the work-order kernel); null: static
  int32_t num_items, q_tiles;
  int32_t grid;  // persistent CTAs
};

// The kernel's tile sizes (every instantiation uses them; the mask block must be a multiple).
constexpr int kTileQ = 128;
constexpr int kTileKv = 128;

// One explicit instantiation per translation unit (attention_fwd_sm90_instance.cu.in).
enum class FwdElement { kBF16, kFP16 };
template <FwdElement E, int HeadDim>
void run_fwd_sm90(const FwdArgs& args, void* stream);

}  // namespace sparsetrain::cuda::attn

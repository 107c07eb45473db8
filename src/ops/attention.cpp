// Block-sparse attention's rules, held once for every backend: validation of q, k, v (and o, lse,
// dout for backward) and of the mask against them, the default softmax scale, and output
// allocation from the call's allocator. Nothing is allocated or written before every check has
// passed; a backend then runs on validated arguments (ops/attention_backend.h).
#include "common/attention/mask_predicate.h"
#include "sparsetrain/attention.h"

#include <cmath>
#include <string>

#include "ops/attention_backend.h"
#include "ops/block_mask_internal.h"
#include "ops/checks.h"
#include "ops/grouped_args.h"
#include "ops/pick_backend.h"

namespace sparsetrain {

backend::AttentionBackend& backend::attention_backend_for(Device device, const char* arg) {
  return ops::pick_backend<AttentionBackend>(device, arg, attention_reference_backend,
                                             ST_CUDA_BACKEND(attention_cuda_backend));
}

namespace {

using backend::AttentionProblem;

std::string num(int64_t v) { return std::to_string(v); }

// Checks every tensor of shape [B, S, H, D] shares: rank, dtype, device, a contiguous last dim.
void check_bshd(const TensorView& t, const char* name, const char* layout, DType dtype, Device device,
                const char* dtype_rule) {
  checks::defined(t, name, std::string("a 4-d tensor ") + layout);
  ST_CHECK_ARG(t.dim() == 4, name, std::string("a 4-d tensor ") + layout, t.shape_str());
  ST_CHECK_ARG(t.dtype() == dtype, name, std::string("dtype ") + dtype_name(dtype) + dtype_rule, dtype_name(t.dtype()));
  ST_CHECK_ARG(t.device() == device, name, "a tensor on " + device.str() + " (q's device)", t.device().str());
  if (t.numel() == 0) return;  // no layout, no data: every caller's size or shape check next names it
  checks::unit_last_stride(t, name, " (D)");
  checks::non_null(t, name);
}

std::string shape4(int64_t a, const char* an, int64_t b, const char* bn, int64_t c, const char* cn, int64_t d,
                   const char* dn) {
  return "shape [" + num(a) + " (" + an + "), " + num(b) + " (" + bn + "), " + num(c) + " (" + cn + "), " + num(d) +
         " (" + dn + ")]";
}

bool same_shape(const TensorView& t, int64_t a, int64_t b, int64_t c, int64_t d) {
  return t.size(0) == a && t.size(1) == b && t.size(2) == c && t.size(3) == d;
}

// q, k, v and the scale; returns the problem they describe.
AttentionProblem check_inputs(const TensorView& q, const TensorView& k, const TensorView& v,
                              const AttentionOptions& options) {
  checks::defined(q, "q", "a 4-d tensor [B, Sq, Hq, D]");
  ST_CHECK_ARG(is_floating(q.dtype()), "q", "dtype fp32, bf16 or fp16", dtype_name(q.dtype()));
  check_bshd(q, "q", "[B, Sq, Hq, D]", q.dtype(), q.device(), "");
  backend::attention_backend_for(q.device(), "q");  // before k, v: their device is checked against q's
  AttentionProblem p{};
  p.dtype = q.dtype();
  p.batch = q.size(0);
  p.seq_q = q.size(1);
  p.heads_q = q.size(2);
  p.head_dim = q.size(3);
  ST_CHECK_ARG(p.batch >= 1 && p.seq_q >= 1 && p.heads_q >= 1 && p.head_dim >= 1, "q",
               "sizes >= 1 in [B, Sq, Hq, D]", q.shape_str());
  check_bshd(k, "k", "[B, Skv, Hkv, D]", p.dtype, q.device(), " (q's dtype)");
  ST_CHECK_ARG(k.size(0) == p.batch && k.size(3) == p.head_dim, "k",
               "shape [" + num(p.batch) + " (q's B), Skv, Hkv, " + num(p.head_dim) + " (q's D)]", k.shape_str());
  p.seq_kv = k.size(1);
  p.heads_kv = k.size(2);
  ST_CHECK_ARG(p.seq_kv >= 1 && p.heads_kv >= 1, "k", "sizes >= 1 in [B, Skv, Hkv, D]", k.shape_str());
  ST_CHECK_ARG(p.heads_q % p.heads_kv == 0, "k",
               "a head count Hkv that divides q's Hq = " + num(p.heads_q) + " (GQA / MQA)", p.heads_kv);
  check_bshd(v, "v", "[B, Skv, Hkv, D]", p.dtype, q.device(), " (q's dtype)");
  ST_CHECK_ARG(same_shape(v, p.batch, p.seq_kv, p.heads_kv, p.head_dim), "v", "shape " + k.shape_str() + " (k's shape)",
               v.shape_str());
  // A negative scale is refused on every backend: the CUDA kernels' online softmax takes each row's
  // maximum of the unscaled scores and masks with -inf, both of which assume scale > 0.
  ST_CHECK_ARG(std::isfinite(options.scale) && options.scale >= 0.f, "options.scale",
               "a finite number >= 0 (0: 1 / sqrt(D))", options.scale);
  p.scale = options.scale != 0.f ? options.scale : 1.f / std::sqrt(float(p.head_dim));
  ST_CHECK_ARG(options.sm_limit >= 0, "options.sm_limit", "a count >= 0 (0: every SM)", options.sm_limit);
  return p;
}

// The mask against the problem: its sizes, the transposes for backward, and its structure
// (validate_block_mask, with leading dims broadcastable to [B, Hq]); errors are named "mask.*".
// A mask on the device gets the structural checks only (shapes, dtypes, its tensors on q's
// device): reading its contents would synchronise the host, and the kernels clamp what they read.
void check_mask_structure(const BlockMask& mask, const AttentionProblem& p, Device device, const char* prefix) {
  try {
    if (device.is_cpu())
      validate_block_mask(mask, p.batch, p.heads_q);
    else
      check_block_mask_structure(mask, p.batch, p.heads_q, device);
  } catch (const Error& e) {
    throw Error(e.kind(), std::string(prefix) + e.what());
  }
}

// The backward's padded document mask (BlockMask::backward_padded): the mask's kind over a padded
// length (a multiple of 128, at least S) with its transposes, and real_rows [B or 1, P] whose
// tokens (host masks: checked) each appear once, in order, every value in [-1, S).
void check_padded_mask(const BlockMask& mask, const AttentionProblem& p, Device device) {
  const BlockMask& pm = *mask.backward_padded;
  const bool docs = mask_has_documents(mask.spec.kind);
  ST_CHECK_ARG(docs && pm.spec.kind == mask.spec.kind, "mask.backward_padded",
               "the padded form of a document mask (build_doc_padded_mask), of the mask's kind",
               mask_kind_name(pm.spec.kind), " for a ", mask_kind_name(mask.spec.kind), " mask");
  ST_CHECK_ARG(p.seq_q == p.seq_kv, "mask.backward_padded", "self-attention (Sq == Skv: one layout for both sides)",
               "Sq = ", p.seq_q, ", Skv = ", p.seq_kv);
  const int64_t P = pm.seq_q;
  ST_CHECK_ARG(P == pm.seq_kv && P % 128 == 0 && P >= p.seq_q && P < (int64_t(1) << 30), "mask.backward_padded.seq_q",
               "a multiple of 128, at least Sq = " + num(p.seq_q) + " and below 2^30, equal to its seq_kv",
               "seq_q = ", P, ", seq_kv = ", pm.seq_kv);
  ST_CHECK_ARG(pm.backward_padded == nullptr && !mask.real_rows.defined(), "mask.backward_padded",
               "one level of padding (a mask with real_rows, itself without backward_padded)", "nested padding");
  ST_CHECK_ARG(pm.q_num_blocks.defined() && pm.q_indices.defined(), "mask.backward_padded.q_indices",
               "the transposes q_num_blocks / q_indices for backward (transpose_block_mask)", "none");
  const TensorView& rr = pm.real_rows;
  checks::defined(rr, "mask.backward_padded.real_rows", "int32 [B or 1, " + num(P) + "]");
  checks::dtype(rr, "mask.backward_padded.real_rows", DType::kInt32);
  ST_CHECK_ARG(rr.device() == device, "mask.backward_padded.real_rows", "a tensor on " + device.str() + " (q's device)",
               rr.device().str());
  ST_CHECK_ARG(rr.dim() == 2 && (rr.size(0) == 1 || rr.size(0) == p.batch) && rr.size(1) == P && rr.stride(1) == 1,
               "mask.backward_padded.real_rows", "shape [1 or " + num(p.batch) + ", " + num(P) + "], unit last stride",
               rr.shape_str());
  checks::non_null(rr, "mask.backward_padded.real_rows");
  check_mask_structure(pm, p, device, "mask.backward_padded.");
  if (!device.is_cpu()) return;
  for (int64_t b = 0; b < rr.size(0); ++b) {
    const int32_t* row = reinterpret_cast<const int32_t*>(rr.byte_ptr(b * rr.stride(0)));
    int64_t next = 0;  // the next token: every one, once, in order
    for (int64_t i = 0; i < P; ++i) {
      if (row[i] == -1) continue;
      ST_CHECK_ARG(row[i] == next, "mask.backward_padded.real_rows",
                   "the tokens 0.." + num(p.seq_q - 1) + " in order, -1 between them", "batch ", b, " position ", i,
                   ": ", row[i], " where ", next, " comes next");
      ++next;
    }
    ST_CHECK_ARG(next == p.seq_q, "mask.backward_padded.real_rows", "every token of " + num(p.seq_q),
                 "batch ", b, ": ", next, " tokens");
  }
}

void check_mask(const BlockMask& mask, const AttentionProblem& p, bool backward, Device device) {
  ST_CHECK_ARG(mask.seq_q == p.seq_q, "mask.seq_q", num(p.seq_q) + " (q's Sq)", mask.seq_q);
  ST_CHECK_ARG(mask.seq_kv == p.seq_kv, "mask.seq_kv", num(p.seq_kv) + " (k's Skv)", mask.seq_kv);
  ST_CHECK_ARG(!mask.real_rows.defined(), "mask.real_rows",
               "none (a padded mask is passed as another mask's backward_padded)", "a tensor");
  if (backward)
    ST_CHECK_ARG(mask.q_num_blocks.defined() && mask.q_indices.defined(), "mask.q_indices",
                 "the transposes q_num_blocks / q_indices for backward (transpose_block_mask)", "none");
  check_mask_structure(mask, p, device, "mask.");
  if (backward && mask.backward_padded != nullptr) check_padded_mask(mask, p, device);
}

// o and dout: q's shape, dtype and device, last dim contiguous; lse: fp32 [B, Hq, Sq].
void check_backward_inputs(const TensorView& o, const TensorView& lse, const TensorView& dout,
                           const AttentionProblem& p, Device device) {
  const std::string qshape = shape4(p.batch, "B", p.seq_q, "Sq", p.heads_q, "Hq", p.head_dim, "D");
  for (const auto& [t, name] : {std::pair<const TensorView&, const char*>{o, "o"}, {dout, "dout"}}) {
    check_bshd(t, name, "[B, Sq, Hq, D]", p.dtype, device, " (q's dtype)");
    ST_CHECK_ARG(same_shape(t, p.batch, p.seq_q, p.heads_q, p.head_dim), name, qshape + " (q's shape)", t.shape_str());
  }
  const std::string lse_shape = "[" + num(p.batch) + " (B), " + num(p.heads_q) + " (Hq), " + num(p.seq_q) + " (Sq)]";
  checks::defined(lse, "lse", "an fp32 tensor " + lse_shape);
  checks::dtype(lse, "lse", DType::kFP32, " (the forward's log-sum-exp)");
  ST_CHECK_ARG(lse.device() == device, "lse", "a tensor on " + device.str() + " (q's device)", lse.device().str());
  ST_CHECK_ARG(lse.dim() == 3 && lse.size(0) == p.batch && lse.size(1) == p.heads_q && lse.size(2) == p.seq_q, "lse",
               "shape " + lse_shape, lse.shape_str());
  checks::non_null(lse, "lse");
}

}  // namespace

AttentionForward block_sparse_attention_forward(const TensorView& q, const TensorView& k, const TensorView& v,
                                                const BlockMask& mask, const AttentionOptions& options,
                                                const AttentionCall& call) {
  const AttentionProblem p = check_inputs(q, k, v, options);
  const Device dev = q.device();
  backend::AttentionBackend& be = backend::attention_backend_for(dev, "q");
  check_mask(mask, p, /*backward=*/false, dev);
  be.check_supported(p, q, k, v, mask, nullptr);
  checks::device_runs(dev, checks::Kernels::kSm90a, "q");

  // Everything is valid: from here on memory may be allocated and written.
  Allocator& alloc = call.allocator ? *call.allocator : default_allocator();
  AttentionForward out;
  out.o = Tensor::empty(p.dtype, {p.batch, p.seq_q, p.heads_q, p.head_dim}, dev, alloc, call.stream);
  out.lse = Tensor::empty(DType::kFP32, {p.batch, p.heads_q, p.seq_q}, dev, alloc, call.stream);
  ops::WorkspaceMemory scratch(be.forward_scratch_bytes(p), {}, dev, alloc, call.stream);
  be.forward({p, q, k, v, &mask, out.o.view(), out.lse.view(), options.sm_limit}, scratch.at(0), call.stream);
  return out;
}

AttentionGrads block_sparse_attention_backward(const TensorView& q, const TensorView& k, const TensorView& v,
                                               const TensorView& o, const TensorView& lse, const TensorView& dout,
                                               const BlockMask& mask, const AttentionOptions& options,
                                               const AttentionCall& call) {
  const AttentionProblem p = check_inputs(q, k, v, options);
  const Device dev = q.device();
  backend::AttentionBackend& be = backend::attention_backend_for(dev, "q");
  check_backward_inputs(o, lse, dout, p, dev);
  check_mask(mask, p, /*backward=*/true, dev);
  const backend::AttentionBackend::BackwardInputs inputs{o, lse, dout, options.deterministic};
  be.check_supported(p, q, k, v, mask, &inputs);
  checks::device_runs(dev, checks::Kernels::kSm90a, "q");

  Allocator& alloc = call.allocator ? *call.allocator : default_allocator();
  AttentionGrads g;
  g.dq = Tensor::empty(p.dtype, {p.batch, p.seq_q, p.heads_q, p.head_dim}, dev, alloc, call.stream);
  g.dk = Tensor::empty(p.dtype, {p.batch, p.seq_kv, p.heads_kv, p.head_dim}, dev, alloc, call.stream);
  g.dv = Tensor::empty(p.dtype, {p.batch, p.seq_kv, p.heads_kv, p.head_dim}, dev, alloc, call.stream);
  ops::WorkspaceMemory scratch(be.backward_scratch_bytes(p, mask), {}, dev, alloc, call.stream);
  be.backward({p, q, k, v, o, lse, dout, &mask, options.deterministic, g.dq.view(), g.dk.view(), g.dv.view(),
               options.sm_limit},
              scratch.at(0), call.stream);
  return g;
}

}  // namespace sparsetrain

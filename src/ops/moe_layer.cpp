// MoELayer (moe_layer.h): route, gather x's rows into the expert-major layout, GroupedMLP with the
// counts as device splits (never read by the host), combine in slot order, on the tensors'
// backend (ops/moe_backend.h). Every argument is checked before anything is written.
#include <memory>
#include <string>
#include <tuple>

#include "common/fp8_blockwise.h"
#include "ops/checks.h"
#include "ops/grouped_args.h"
#include "ops/grouped_linear_fp8.h"
#include "ops/moe_backend.h"
#include "ops/moe_router_internal.h"
#include "sparsetrain/error.h"
#include "sparsetrain/moe_layer.h"

namespace sparsetrain {
namespace {

const MoELayerOptions& checked(const MoELayerOptions& o) {
  ST_CHECK_ARG(o.mlp.num_groups == o.router.num_experts, "mlp.num_groups",
               "router.num_experts = " + std::to_string(o.router.num_experts) + " (one group per expert)",
               o.mlp.num_groups);
  ST_CHECK_ARG(o.mlp.in_features == o.mlp.out_features, "mlp.out_features",
               "in_features = " + std::to_string(o.mlp.in_features) +
                   " (the hidden size: out is summed into x's shape)",
               o.mlp.out_features);
  ST_CHECK_ARG(!o.fp8_saved_activations || o.mlp.fp8 != Fp8Recipe::kOff, "fp8_saved_activations",
               "false without the FP8 recipe (mlp.fp8)", "true");
  return o;
}

// [N, hidden] activations of the layer's dtype on its device, rows contiguous.
void check_tokens(const TensorView& t, const char* name, const GroupedMLPOptions& o, int64_t N, Device device) {
  checks::defined(t, name, std::string(dtype_name(o.dtype)) + " [N, hidden]");
  checks::dtype(t, name, o.dtype, " (the layer's dtype)");
  ST_CHECK_ARG(t.dim() == 2 && (N < 0 || t.size(0) == N) && t.size(1) == o.in_features, name,
               "shape [" + (N < 0 ? std::string("N") : std::to_string(N)) + ", hidden = " +
                   std::to_string(o.in_features) + "]",
               t.shape_str());
  checks::rows_contiguous(t, name);
  checks::non_null(t, name);
  checks::device(t, name, device);
}

// rows[r] = x[token_of_row[r]].
Tensor gather_rows(const TensorView& x, const Tensor& token_of_row, Allocator& alloc, Stream stream) {
  const int64_t R = token_of_row.view().size(0), H = x.size(1);
  backend::MoEBackend& be = backend::moe_backend_for(x.device(), "x");
  Tensor rows = Tensor::empty(x.dtype(), {R, H}, x.device(), alloc, stream);
  be.gather_rows(x.dtype(), x.data(), x.stride(0), token_of_row.view().data_as<const int32_t>(), R, H,
                 rows.view().data(), x.device(), stream);
  return rows;
}

// fp32 values between the (token, slot) order and the layout's rows: dst[row_of[i]] = src[i]
// (to_rows: [N * K]) or dst[i] = src[row_of[i]] ([N, K], row_of's shape).
Tensor permute_probs(const TensorView& src, const Tensor& row_of, bool to_rows, Allocator& alloc, Stream stream) {
  backend::MoEBackend& be = backend::moe_backend_for(src.device(), "probs");
  const int64_t n = row_of.view().numel();
  Tensor dst = to_rows ? Tensor::empty(DType::kFP32, {n}, src.device(), alloc, stream)
                       : Tensor::empty(DType::kFP32, {row_of.view().size(0), row_of.view().size(1)}, src.device(),
                                       alloc, stream);
  be.permute_f32(src.data_as<const float>(), row_of.view().data_as<const int32_t>(), n, dst.view().data_as<float>(),
                 to_rows, src.device(), stream);
  return dst;
}

// fc1's saved codes (fp8_saved_activations): uint8 [R, 2F] contiguous and their scales, fp32 and
// as many as the rowwise recipe gives R rows of 2F, on the layer's device.
void check_saved_codes(const MoEForward& saved, int64_t R, int64_t F2, Device device) {
  const TensorView q = saved.fc1_out.view(), s = saved.fc1_out_scales.view();
  const std::string codes = "uint8 [" + std::to_string(R) + ", " + std::to_string(F2) + "] (fc1's e4m3 codes)";
  checks::defined(q, "saved.fc1_out", codes);
  ST_CHECK_ARG(q.dtype() == DType::kUInt8 && q.dim() == 2 && q.size(0) == R && q.size(1) == F2 && q.is_contiguous(),
               "saved.fc1_out", codes + ", contiguous (fp8_saved_activations)",
               std::string(dtype_name(q.dtype())) + " " + q.shape_str());
  checks::device(q, "saved.fc1_out", device);
  const int64_t n = fp8_rowwise_scale_count(R, F2);
  checks::defined(s, "saved.fc1_out_scales", "fp32 [" + std::to_string(n) + "]");
  ST_CHECK_ARG(s.dtype() == DType::kFP32 && s.numel() >= n && s.is_contiguous() && s.device() == q.device(),
               "saved.fc1_out_scales", "fp32, contiguous, >= " + std::to_string(n) + " scales on fc1_out's device",
               std::string(dtype_name(s.dtype())) + " " + s.shape_str());
}

// The experts' row offsets [E + 1] on the counts' device, as GroupedMLP computes them from the
// routing's counts (device splits: the host never reads them): the groups in which fc1's saved
// codes are quantized and restored (fp8_saved_activations).
Tensor expert_offsets(const Tensor& counts, int64_t R, Allocator& alloc, Stream stream) {
  const TensorView c = counts.view();
  Tensor offsets = Tensor::empty(DType::kInt64, {c.size(0) + 1}, c.device(), alloc, stream);
  const Tensor status = Tensor::empty(DType::kInt32, {1}, c.device(), alloc, stream);
  ops::prepare_offsets(Splits::device(c), R, offsets.view().data_as<int64_t>(), status.view().data_as<int32_t>(),
                       backend::backend_for(c.device(), "counts"), c.device(), stream);
  return offsets;
}

}  // namespace

Tensor combine_rows(const TensorView& rows, const TensorView& row_of, Allocator* allocator, Stream stream) {
  checks::defined(rows, "rows", "bf16, fp16 or fp32 [R, H]");
  ST_CHECK_ARG(rows.dtype() == DType::kBF16 || rows.dtype() == DType::kFP16 || rows.dtype() == DType::kFP32, "rows",
               "bf16, fp16 or fp32", dtype_name(rows.dtype()));
  checks::shape(rows, "rows", {-1, -1}, "[R, H]");
  checks::rows_contiguous(rows, "rows");
  checks::non_null(rows, "rows");
  checks::defined(row_of, "row_of", "int32 [N, K]");
  checks::dtype(row_of, "row_of", DType::kInt32);
  checks::shape(row_of, "row_of", {-1, -1}, "[N, K]");
  checks::contiguous(row_of, "row_of");
  checks::non_null(row_of, "row_of");
  checks::device(row_of, "row_of", rows.device());
  const Device dev = rows.device();
  checks::device_runs(dev, checks::Kernels::kGeneric, "rows");
  const int64_t N = row_of.size(0), K = row_of.size(1), R = rows.size(0), H = rows.size(1);
  ST_CHECK_ARG(K <= INT32_MAX, "row_of", "at most 2^31 - 1 slots a token", K);
  const int32_t* row = row_of.data_as<const int32_t>();
  if (dev.is_cpu())
    for (int64_t i = 0; i < N * K; ++i)
      ST_CHECK_ARG(row[i] >= 0 && row[i] < R, "row_of", "entries in [0, R = " + std::to_string(R) + ")",
                   row[i], " at flat index ", i);
  backend::MoEBackend& be = backend::moe_backend_for(dev, "rows");
  Allocator& alloc = allocator != nullptr ? *allocator : default_allocator();
  Tensor out = Tensor::empty(rows.dtype(), {N, H}, dev, alloc, stream);
  be.combine_rows(rows.dtype(), rows.data(), rows.stride(0), row, N, int32_t(K), H, out.view().data(), dev, stream);
  return out;
}

MoELayer::MoELayer(const MoELayerOptions& options, const GroupedMLPParams& params, Allocator* allocator)
    : options_(checked(options)),
      allocator_(allocator != nullptr ? allocator : &default_allocator()),
      mlp_(options.mlp, params, allocator_) {}

MoEForward MoELayer::forward(const TensorView& x, const TensorView& logits, const TensorView& expert_bias,
                             const CallArgs& args) {
  check_tokens(x, "x", options_.mlp, -1, mlp_.device());
  // (Not 2-D or undefined: route() names what is wrong.)
  ST_CHECK_ARG(logits.dim() != 2 || logits.size(0) == x.size(0), "logits",
               "N = " + std::to_string(x.size(0)) + " rows (x's tokens)", logits.shape_str());
  MoEForward f;
  f.route = route(options_.router, logits, expert_bias, allocator_, args.stream);  // checks logits, bias
  f.row_probs = permute_probs(f.route.probs.view(), f.route.row_of, true, *allocator_, args.stream);
  const Splits splits = Splits::device(f.route.counts.view());
  // FP8 with the rows not kept for backward: fc1's quantizer reads x's tokens in the layout's
  // order, the rows never written in the dtype (bitwise the codes of the gathered rows).
  GroupedMLPForward m;
  if (options_.mlp.fp8 != Fp8Recipe::kOff && options_.recompute_expert_input) {
    m = mlp_.forward_rows(x, f.route.token_of_row.view(), splits, f.row_probs.view(), {}, args);
  } else {
    f.rows = gather_rows(x, f.route.token_of_row, *allocator_, args.stream);
    m = mlp_.forward(f.rows.view(), splits, f.row_probs.view(), {}, args);
    if (options_.recompute_expert_input) f.rows = Tensor();  // gathered again by backward
  }
  f.fc1_out = std::move(m.fc1_out);
  if (options_.fp8_saved_activations) {  // the dtype's copy is freed here, its codes kept instead
    const Tensor offsets = expert_offsets(f.route.counts, f.fc1_out.view().size(0), *allocator_, args.stream);
    ops::Fp8Operand q = ops::fp8_save_rowwise(
        *allocator_, f.fc1_out.view(), {options_.mlp.num_groups, offsets.view().data_as<int64_t>()}, args.stream);
    f.fc1_out = std::move(q.data);
    f.fc1_out_scales = std::move(q.scale);
  }
  f.out = combine_rows(m.out.view(), f.route.row_of.view(), allocator_, args.stream);
  return f;
}

MoEGrads MoELayer::backward(const TensorView& x, const TensorView& logits, const MoEForward& saved,
                            const TensorView& dout, const TensorView& dscore_sum, const CallArgs& args) {
  check_tokens(x, "x", options_.mlp, -1, mlp_.device());
  const int64_t N = x.size(0);
  check_tokens(dout, "dout", options_.mlp, N, mlp_.device());
  ST_CHECK_ARG(saved.route.row_of.defined() && saved.route.row_of.view().size(0) == N &&
                   saved.route.token_of_row.defined() && (saved.rows.defined() || options_.recompute_expert_input),
               "saved", "forward()'s result for these " + std::to_string(N) + " tokens",
               saved.route.row_of.defined() ? saved.route.row_of.view().shape_str() : std::string("no routing"));
  ops::check_route_backward_inputs(options_.router, logits, dscore_sum);
  ST_CHECK_ARG(logits.size(0) == N, "logits", "N = " + std::to_string(N) + " rows (x's tokens)", logits.shape_str());
  const int64_t R = saved.route.token_of_row.view().size(0), F2 = 2 * options_.mlp.ffn_features;
  if (options_.fp8_saved_activations) check_saved_codes(saved, R, F2, mlp_.device());
  // Everything is valid: from here on outputs may be written.
  // dout's rows in the layout (row row_of[n, i] gets dout[n], each row exactly once), and x's
  // again if forward dropped them. With FP8 and the wgrad now the quantizers read the tokens in
  // the layout's order instead: dout's for fc2's dgrad and wgrad (not with an fc2 bias, whose
  // gradient terms read its rows) and x's for fc1's wgrad. A delayed wgrad runs after backward has
  // returned, when x and dout may have changed: it gets the rows gathered now.
  const bool fp8_now = options_.mlp.fp8 != Fp8Recipe::kOff && !options_.mlp.delay_wgrad_compute;
  const TensorView token_of_row = saved.route.token_of_row.view();
  const Tensor drows = fp8_now && !mlp_.fc2_bias_.present()
                           ? Tensor()
                           : gather_rows(dout, saved.route.token_of_row, *allocator_, args.stream);
  const Tensor rows = saved.rows.defined() || fp8_now
                          ? saved.rows
                          : gather_rows(x, saved.route.token_of_row, *allocator_, args.stream);
  // fc1's output from its saved codes: read as codes by the MLP's SwiGLU backward where its FP8
  // backward runs on codes (nothing restored), else restored into a buffer of our own, which the
  // MLP's backward then overwrites with its gradient (Fc1OutUse::kReuse).
  const bool read_codes = options_.fp8_saved_activations && mlp_.backward_reads_codes();
  const ops::Fp8Operand saved_codes{saved.fc1_out, saved.fc1_out_scales};
  Tensor restored;
  if (options_.fp8_saved_activations && !read_codes) {
    restored = Tensor::empty(options_.mlp.dtype, {R, F2}, mlp_.device(), *allocator_, args.stream);
    const Tensor offsets = expert_offsets(saved.route.counts, R, *allocator_, args.stream);
    ops::fp8_restore_rowwise(saved_codes.view(), {options_.mlp.num_groups, offsets.view().data_as<int64_t>()},
                             restored.view(), args.stream);
  }
  // The MLP's delayed wgrad keeps references to its inputs and splits (and fc1's output gradient,
  // written over `restored`): they stay alive with the pending entry.
  CallArgs mlp_args = args;
  mlp_args.keep_alive =
      std::make_shared<std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, std::shared_ptr<const void>>>(
          rows, saved.row_probs, saved.route.counts, drows, restored, args.keep_alive);
  GroupedMLPGrads m = mlp_.backward_rows(
      rows.defined() ? rows.view() : x, rows.defined() ? TensorView() : token_of_row,
      read_codes ? TensorView() : restored.defined() ? restored.view() : saved.fc1_out.view(), saved.row_probs.view(),
      drows.defined() ? drows.view() : dout, drows.defined() ? TensorView() : token_of_row,
      Splits::device(saved.route.counts.view()), {}, mlp_args,
      restored.defined() ? Fc1OutUse::kReuse : Fc1OutUse::kKeep, read_codes ? &saved_codes : nullptr);
  MoEGrads g;
  g.grad_input = combine_rows(m.grad_input.view(), saved.route.row_of.view(), allocator_, args.stream);
  const Tensor dprobs = permute_probs(m.dprobs.view(), saved.route.row_of, false, *allocator_, args.stream);
  g.dlogits = route_backward(options_.router, logits, saved.route.experts.view(), dprobs.view(), dscore_sum,
                             allocator_, args.stream);
  g.fc1 = std::move(m.fc1);
  g.fc2 = std::move(m.fc2);
  return g;
}

}  // namespace sparsetrain

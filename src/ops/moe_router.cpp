// route / route_backward (moe_router.h): every check before anything is allocated, then the rules
// of common/moe_routing.h token by token on the tensors' backend (ops/moe_backend.h: loops on the
// CPU, the reference; kernels on a CUDA device).
#include <string>

#include "common/moe_routing.h"
#include "ops/checks.h"
#include "ops/moe_backend.h"
#include "ops/moe_router_internal.h"
#include "ops/pick_backend.h"
#include "sparsetrain/error.h"
#include "sparsetrain/moe_router.h"

namespace sparsetrain {

backend::MoEBackend& backend::moe_backend_for(Device device, const char* arg) {
  return ops::pick_backend<MoEBackend>(device, arg, moe_reference_backend, ST_CUDA_BACKEND(moe_cuda_backend));
}

namespace {

RouterRule rule_of(const RouterOptions& o) {
  ST_CHECK_ARG(o.num_experts >= 1 && o.num_experts <= INT32_MAX, "num_experts", "1 <= num_experts <= 2^31 - 1",
               o.num_experts);
  ST_CHECK_ARG(o.top_k >= 1 && o.top_k <= o.num_experts, "top_k",
               "1 <= top_k <= num_experts = " + std::to_string(o.num_experts), o.top_k);
  ST_CHECK_ARG(o.score == RouterScore::kSoftmax || o.score == RouterScore::kSigmoid, "score",
               "RouterScore::kSoftmax or kSigmoid", int(o.score));
  return {int32_t(o.num_experts), int32_t(o.top_k), o.score, o.normalize};
}

// fp32 [N, E] logits with contiguous rows, on the CPU or a CUDA device that runs the kernels.
void check_logits(const TensorView& logits, const RouterRule& r) {
  checks::defined(logits, "logits", "fp32 router logits [N, E]");
  checks::dtype(logits, "logits", DType::kFP32, " (router logits)");
  ST_CHECK_ARG(logits.dim() == 2 && logits.size(1) == r.num_experts, "logits",
               "shape [N, E = " + std::to_string(r.num_experts) + "]", logits.shape_str());
  ST_CHECK_ARG(logits.size(0) * r.top_k <= INT32_MAX, "logits",
               "N * top_k rows that int32 indices hold (<= 2^31 - 1)", logits.shape_str());
  checks::rows_contiguous(logits, "logits");
  checks::non_null(logits, "logits");
}

void check_vector(const TensorView& t, const char* name, DType dtype, int64_t n, const char* what, Device device) {
  checks::dtype(t, name, dtype);
  ST_CHECK_ARG(t.dim() == 1 && t.size(0) == n, name, "shape [" + std::to_string(n) + "] (" + what + ")",
               t.shape_str());
  ST_CHECK_ARG(t.stride(0) == 1 || n <= 1, name, "a unit stride", t.stride(0));
  checks::non_null(t, name);
  ST_CHECK_ARG(t.device() == device, name, "a tensor on " + device.str() + " (logits' device)", t.device().str());
}

void check_matrix(const TensorView& t, const char* name, DType dtype, int64_t rows, int64_t cols, Device device) {
  checks::defined(t, name, std::string(dtype_name(dtype)) + " [N, top_k]");
  checks::dtype(t, name, dtype);
  checks::shape(t, name, {rows, cols}, "[N = " + std::to_string(rows) + ", top_k = " + std::to_string(cols) + "]");
  checks::rows_contiguous(t, name);
  checks::non_null(t, name);
  ST_CHECK_ARG(t.device() == device, name, "a tensor on " + device.str() + " (logits' device)", t.device().str());
}

}  // namespace

RouterOutput route(const RouterOptions& options, const TensorView& logits, const TensorView& expert_bias,
                   Allocator* allocator, Stream stream) {
  const RouterRule r = rule_of(options);
  check_logits(logits, r);
  const Device dev = logits.device();
  if (expert_bias.defined())
    check_vector(expert_bias, "expert_bias", DType::kFP32, r.num_experts, "one per expert", dev);
  ST_CHECK_ARG(dev.is_cpu() || r.num_experts <= backend::kMaxExpertsCuda, "num_experts",
               "<= " + std::to_string(backend::kMaxExpertsCuda) + " on a CUDA device", r.num_experts);
  checks::device_runs(dev, checks::Kernels::kGeneric, "logits");
  backend::MoEBackend& be = backend::moe_backend_for(dev, "logits");
  Allocator& alloc = allocator != nullptr ? *allocator : default_allocator();
  const int64_t N = logits.size(0), E = r.num_experts, K = r.top_k;
  RouterOutput out{Tensor::empty(DType::kInt32, {N, K}, dev, alloc, stream),
                   Tensor::empty(DType::kFP32, {N, K}, dev, alloc, stream),
                   Tensor::empty(DType::kInt64, {E}, dev, alloc, stream),
                   Tensor::empty(DType::kInt32, {N, K}, dev, alloc, stream),
                   Tensor::empty(DType::kInt32, {N * K}, dev, alloc, stream),
                   Tensor::empty(DType::kFP32, {E}, dev, alloc, stream)};
  const float* bias = expert_bias.defined() ? expert_bias.data_as<const float>() : nullptr;
  const size_t scratch_bytes = be.route_scratch_bytes(N, r.num_experts);
  const Tensor scratch =
      scratch_bytes > 0 ? Tensor::empty(DType::kUInt8, {int64_t(scratch_bytes)}, dev, alloc, stream) : Tensor();
  be.route(r, logits.data_as<const float>(), logits.stride(0), bias, N,
           {out.experts.view().data_as<int32_t>(), out.probs.view().data_as<float>(),
            out.counts.view().data_as<int64_t>(), out.row_of.view().data_as<int32_t>(),
            out.token_of_row.view().data_as<int32_t>(), out.score_sum.view().data_as<float>()},
           scratch.defined() ? scratch.view().data() : nullptr, dev, stream);
  return out;
}

void ops::check_route_backward_inputs(const RouterOptions& options, const TensorView& logits,
                                      const TensorView& dscore_sum) {
  const RouterRule r = rule_of(options);
  check_logits(logits, r);
  if (dscore_sum.defined())
    check_vector(dscore_sum, "dscore_sum", DType::kFP32, r.num_experts, "one per expert", logits.device());
}

Tensor route_backward(const RouterOptions& options, const TensorView& logits, const TensorView& experts,
                      const TensorView& dprobs, const TensorView& dscore_sum, Allocator* allocator, Stream stream) {
  ops::check_route_backward_inputs(options, logits, dscore_sum);
  const RouterRule r = rule_of(options);
  const int64_t N = logits.size(0), K = r.top_k;
  const Device dev = logits.device();
  check_matrix(experts, "experts", DType::kInt32, N, K, dev);
  check_matrix(dprobs, "dprobs", DType::kFP32, N, K, dev);
  checks::device_runs(dev, checks::Kernels::kGeneric, "logits");
  backend::MoEBackend& be = backend::moe_backend_for(dev, "logits");
  // Host expert ids are checked as indices: each in range and, per token, distinct (route()'s
  // output is). Device ids are not read by the host: the kernel turns a token with invalid ids
  // into NaN gradients instead of reading out of bounds.
  if (dev.is_cpu())
    for (int64_t n = 0; n < N; ++n) {
      const int32_t* ex = experts.data_as<const int32_t>() + n * experts.stride(0);
      for (int64_t i = 0; i < K; ++i) {
        ST_CHECK_ARG(ex[i] >= 0 && ex[i] < r.num_experts, "experts",
                     "expert ids in [0, " + std::to_string(r.num_experts) + ") (route()'s output)",
                     ex[i], " at token ", n, ", slot ", i);
        for (int64_t j = 0; j < i; ++j)
          ST_CHECK_ARG(ex[j] != ex[i], "experts", "distinct experts per token (route()'s output)", "expert ",
                       ex[i], " twice at token ", n);
      }
    }
  Allocator& alloc = allocator != nullptr ? *allocator : default_allocator();
  Tensor dlogits = Tensor::empty(DType::kFP32, {N, int64_t(r.num_experts)}, dev, alloc, stream);
  const float* ds = dscore_sum.defined() ? dscore_sum.data_as<const float>() : nullptr;
  be.route_backward(r, logits.data_as<const float>(), logits.stride(0), experts.data_as<const int32_t>(),
                    experts.stride(0), dprobs.data_as<const float>(), dprobs.stride(0), ds, N,
                    dlogits.view().data_as<float>(), dev, stream);
  return dlogits;
}

}  // namespace sparsetrain

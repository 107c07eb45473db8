// The CPU reference backend of the MoE router and layer: the rules of common/moe_routing.h token by
// token, the expert-major layout from the counts (expert e's rows after those of the experts
// before it, its tokens in order), and the rows' moves as plain loops; the combine sums each
// token's slots in slot order in fp32 and rounds once. The CUDA backend is tested against it.
#include <cstring>
#include <vector>

#include "common/moe_routing.h"
#include "ops/moe_backend.h"
#include "sparsetrain/dtype.h"

namespace sparsetrain::backend {
namespace {

class ReferenceMoEBackend final : public MoEBackend {
 public:
  size_t route_scratch_bytes(int64_t, int32_t) const override { return 0; }

  void route(const RouterRule& r, const float* logits, int64_t stride, const float* bias, int64_t N,
             const RouteOutputs& out, void*, Device, Stream) override {
    const int64_t E = r.num_experts, K = r.top_k;
    for (int64_t e = 0; e < E; ++e) out.counts[e] = 0, out.score_sum[e] = 0.f;
    for (int64_t n = 0; n < N; ++n) {
      const float* l = logits + n * stride;
      route_token(r, l, bias, out.experts + n * K, out.probs + n * K);
      for (int64_t i = 0; i < K; ++i) ++out.counts[out.experts[n * K + i]];
      SoftmaxRow row;
      if (r.score == RouterScore::kSoftmax) row = router_softmax_row(l, r.num_experts);
      for (int32_t e = 0; e < r.num_experts; ++e) out.score_sum[e] += router_score(r, l[e], row);
    }
    // The layout: expert e's rows from the counts of the experts before it, its tokens in order.
    std::vector<int64_t> next(size_t(E), 0);
    for (int64_t e = 1; e < E; ++e) next[size_t(e)] = next[size_t(e - 1)] + out.counts[e - 1];
    for (int64_t n = 0; n < N; ++n)
      for (int64_t i = 0; i < K; ++i) {
        const int64_t row = next[size_t(out.experts[n * K + i])]++;
        out.row_of[n * K + i] = int32_t(row);
        out.token_of_row[row] = int32_t(n);
      }
  }

  void route_backward(const RouterRule& r, const float* logits, int64_t stride, const int32_t* experts,
                      int64_t experts_stride, const float* dprobs, int64_t dprobs_stride, const float* dscore_sum,
                      int64_t N, float* dlogits, Device, Stream) override {
    for (int64_t n = 0; n < N; ++n)
      route_token_backward(r, logits + n * stride, experts + n * experts_stride, dprobs + n * dprobs_stride,
                           dscore_sum, dlogits + n * r.num_experts);
  }

  void gather_rows(DType dtype, const void* x, int64_t x_stride, const int32_t* index, int64_t R, int64_t H,
                   void* rows, Device, Stream) override {
    const int64_t es = int64_t(dtype_size(dtype)), bytes = H * es;
    for (int64_t r = 0; r < R; ++r)
      std::memcpy(static_cast<char*>(rows) + r * bytes, static_cast<const char*>(x) + index[r] * x_stride * es,
                  size_t(bytes));
  }

  void combine_rows(DType dtype, const void* rows, int64_t rows_stride, const int32_t* row_of, int64_t N, int32_t K,
                    int64_t H, void* out, Device, Stream) override {
    for (int64_t n = 0; n < N; ++n)
      for (int64_t h = 0; h < H; ++h) {
        float acc = 0.f;
        for (int64_t i = 0; i < K; ++i) acc += load_float(rows, dtype, row_of[n * K + i] * rows_stride + h);
        store_float(out, dtype, n * H + h, acc);
      }
  }

  void permute_f32(const float* src, const int32_t* index, int64_t n, float* dst, bool scatter, Device,
                   Stream) override {
    for (int64_t i = 0; i < n; ++i) {
      if (scatter) {
        dst[index[i]] = src[i];
      } else {
        dst[i] = src[index[i]];
      }
    }
  }
};

}  // namespace

MoEBackend& moe_reference_backend() {
  static ReferenceMoEBackend backend;
  return backend;
}

}  // namespace sparsetrain::backend

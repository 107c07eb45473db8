// Documents as ranges in the backward, measured: the attention backward on a
// document-causal mask alone against the same mask with its padded form attached
// (BlockMask::backward_padded: documents of >= 128 or >= 1024 tokens on 128-token boundaries), deterministic
// and not, on bench_attention.py's two long packed-document cases (this bench's own lengths:
// uniform in [1, 3000] and [1, 8192], seed 0). Back to back (20 calls between two CUDA events),
// plain and padded alternating over 7 rounds, medians; plus the bitwise repeatability of each
// deterministic backward and the largest difference between the two (a different summation
// order). A benchmark, not a test; masks built on the host and copied over. Without a GPU it says
// so and exits 0.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include "cuda/cuda_check.h"
#include "sparsetrain/attention.h"
#include "sparsetrain/block_mask.h"
#include "sparsetrain/error.h"
#include "sparsetrain/runtime.h"

namespace st = sparsetrain;

namespace {

struct DeviceBuffer {
  void* p = nullptr;
  size_t bytes = 0;
  explicit DeviceBuffer(size_t n) : bytes(n) { ST_CUDA_CHECK(cudaMalloc(&p, n), "cudaMalloc"); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  ~DeviceBuffer() { cudaFree(p); }
};

// Every tensor of a host mask copied to the device (the views re-pointed), owning the copies.
struct DeviceMaskCopy {
  std::vector<std::unique_ptr<DeviceBuffer>> storage;
  st::BlockMask mask;
  explicit DeviceMaskCopy(const st::BlockMask& host) : mask(host) {
    for (st::TensorView* v : {&mask.kv_num_blocks, &mask.kv_indices, &mask.full_kv_num_blocks, &mask.full_kv_indices,
                              &mask.q_num_blocks, &mask.q_indices, &mask.full_q_num_blocks, &mask.full_q_indices,
                              &mask.dq_write_order, &mask.dq_write_order_full, &mask.spec.doc_q, &mask.spec.doc_kv,
                              &mask.real_rows}) {
      if (!v->defined()) continue;
      const size_t bytes = size_t(v->numel()) * v->element_size();  // the builders' tensors are contiguous
      storage.push_back(std::make_unique<DeviceBuffer>(bytes));
      ST_CUDA_CHECK(cudaMemcpy(storage.back()->p, v->data(), bytes, cudaMemcpyHostToDevice), "cudaMemcpy");
      *v = st::TensorView(storage.back()->p, v->dtype(), v->shape(), v->strides(), v->dim(), st::Device::cuda(0));
    }
  }
};

// A [B, S, H, D] bf16 tensor of random values on the device.
struct Input {
  std::unique_ptr<DeviceBuffer> buf;
  st::TensorView view;
  Input(int64_t B, int64_t S, int64_t H, int64_t D, std::mt19937_64& rng) {
    std::vector<uint16_t> h(size_t(B * S * H * D));
    std::normal_distribution<float> n(0.f, 1.f);
    for (uint16_t& x : h) {
      const float f = n(rng);
      uint32_t u;
      std::memcpy(&u, &f, 4);
      x = uint16_t(u >> 16);  // bf16: the top half
    }
    buf = std::make_unique<DeviceBuffer>(h.size() * 2);
    ST_CUDA_CHECK(cudaMemcpy(buf->p, h.data(), h.size() * 2, cudaMemcpyHostToDevice), "cudaMemcpy");
    view = st::TensorView(buf->p, st::DType::kBF16, {B, S, H, D}, st::Device::cuda(0));
  }
};

std::vector<uint16_t> to_host(const st::Tensor& t) {
  std::vector<uint16_t> h(size_t(t.view().numel()));
  ST_CUDA_CHECK(cudaMemcpy(h.data(), t.view().data(), h.size() * 2, cudaMemcpyDeviceToHost), "cudaMemcpy");
  return h;
}

float bf16(uint16_t x) {
  const uint32_t u = uint32_t(x) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

void run_case(const char* name, int64_t B, int64_t S, int64_t Hq, int64_t Hkv, int64_t hi, int64_t min_length) {
  const int64_t D = 128;
  std::mt19937_64 rng(0);
  std::vector<int32_t> ids(size_t(B * S));
  for (int64_t b = 0; b < B; ++b)
    for (int64_t s = 0, doc = 0; s < S; ++doc)
      for (int64_t n = 1 + int64_t(rng() % uint64_t(hi)); n > 0 && s < S; --n) ids[size_t(b * S + s++)] = int32_t(doc);
  st::MaskSpec spec;
  spec.kind = st::MaskKind::kDocumentCausal;
  spec.doc_q = spec.doc_kv = st::TensorView(ids.data(), st::DType::kInt32, {B, S});
  st::BlockMaskOptions opts;
  opts.problem = {B, Hq, Hkv, 0};
  const st::BlockMaskTensors host = st::build_block_mask(spec, S, S, opts);
  const st::BlockMaskTensors host_padded = st::build_doc_padded_mask(spec, S, min_length, opts);
  DeviceMaskCopy plain(host.mask), padded(host_padded.mask);
  st::BlockMask with = plain.mask;
  with.backward_padded = &padded.mask;

  Input q(B, S, Hq, D, rng), k(B, S, Hkv, D, rng), v(B, S, Hkv, D, rng), dout(B, S, Hq, D, rng);
  const st::AttentionForward f = st::block_sparse_attention_forward(q.view, k.view, v.view, plain.mask);
  auto backward = [&](const st::BlockMask& m, bool det) {
    st::AttentionOptions o;
    o.deterministic = det;
    return st::block_sparse_attention_backward(q.view, k.view, v.view, f.o.view(), f.lse.view(), dout.view, m, o);
  };
  cudaEvent_t e0, e1;
  ST_CUDA_CHECK(cudaEventCreate(&e0), "cudaEventCreate");
  ST_CUDA_CHECK(cudaEventCreate(&e1), "cudaEventCreate");
  auto time_ms = [&](const st::BlockMask& m, bool det) {
    for (int i = 0; i < 3; ++i) backward(m, det);
    ST_CUDA_CHECK(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
    const int reps = 20;
    ST_CUDA_CHECK(cudaEventRecord(e0), "cudaEventRecord");
    for (int i = 0; i < reps; ++i) backward(m, det);
    ST_CUDA_CHECK(cudaEventRecord(e1), "cudaEventRecord");
    ST_CUDA_CHECK(cudaEventSynchronize(e1), "cudaEventSynchronize");
    float ms = 0.f;
    ST_CUDA_CHECK(cudaEventElapsedTime(&ms, e0, e1), "cudaEventElapsedTime");
    return double(ms) / reps;
  };
  for (const bool det : {true, false}) {
    std::vector<double> a, b;
    for (int r = 0; r < 7; ++r) {
      a.push_back(time_ms(plain.mask, det));
      b.push_back(time_ms(with, det));
    }
    std::sort(a.begin(), a.end());
    std::sort(b.begin(), b.end());
    std::printf("%s B=%lld S=%lld Hq=%lld Hkv=%lld min_length=%lld P=%lld %s: plain %.3f ms, padded %.3f ms, "
                "padded / plain %.3f\n",
                name, (long long)B, (long long)S, (long long)Hq, (long long)Hkv, (long long)min_length,
                (long long)padded.mask.seq_q, det ? "det" : "nondet", a[3], b[3], b[3] / a[3]);
  }
  // Repeatability and agreement (dq, dk, dv of the deterministic backwards).
  const st::AttentionGrads g1 = backward(with, true), g2 = backward(with, true), g0 = backward(plain.mask, true);
  bool same = true;
  double diff = 0, mag = 0;
  for (const auto& [x, y, z] : {std::tuple{&g1.dq, &g2.dq, &g0.dq}, {&g1.dk, &g2.dk, &g0.dk}, {&g1.dv, &g2.dv, &g0.dv}}) {
    const std::vector<uint16_t> hx = to_host(*x), hy = to_host(*y), hz = to_host(*z);
    same = same && hx == hy;
    for (size_t i = 0; i < hx.size(); ++i) {
      const double d = std::fabs(double(bf16(hx[i])) - bf16(hz[i]));
      diff = std::isnan(d) ? INFINITY : std::max(diff, d);
      mag = std::max(mag, std::fabs(double(bf16(hz[i]))));
    }
  }
  std::printf("%s: padded det bitwise repeatable %s; max |padded - plain| %.3g (largest |grad| %.3g)\n", name,
              same ? "yes" : "NO", diff, mag);
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
}

}  // namespace

int main() {
  try {
    if (st::cuda_device_count() == 0) {
      std::printf("bench_bwd_doc_padded: no CUDA device; nothing measured\n");
      return 0;
    }
    std::printf("%s\n", st::best_backend_description().c_str());
    for (const int64_t min_length : {128, 1024}) {
      run_case("document_causal_1to3000", 2, 16384, 16, 16, 3000, min_length);
      run_case("document_causal_128k_gqa4", 1, 131072, 8, 2, 8192, min_length);
    }
  } catch (const st::Error& e) {
    std::fprintf(stderr, "bench_bwd_doc_padded: %s\n", e.what());
    return 1;
  }
  return 0;
}

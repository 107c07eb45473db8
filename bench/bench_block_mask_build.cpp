// The device block-mask build timed from C++ (lists, transposes and dQ write orders of an
// S = 8192 mask, launches included): the mean over 20 builds after 3 warm-ups, per mask kind.
// A benchmark, not a test (it asserts nothing); scripts/gpu-check runs it with the attention
// benches. Built with the CUDA backend only; without a GPU it says so and exits 0.
#include <cuda_runtime.h>

#include <chrono>
#include <cstdio>
#include <random>
#include <vector>

#include "cuda/cuda_check.h"
#include "sparsetrain/block_mask.h"
#include "sparsetrain/error.h"
#include "sparsetrain/runtime.h"

namespace st = sparsetrain;

namespace {

// Random document ids [batch, seq]: runs of 1 .. seq / 3 positions (seed 3, as the test it replaces).
std::vector<int32_t> documents(int64_t batch, int64_t seq) {
  std::mt19937 rng(3);
  std::uniform_int_distribution<int64_t> len(1, seq / 3);
  std::vector<int32_t> d(size_t(batch * seq));
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t s = 0, id = 0; s < seq; ++id)
      for (int64_t n = len(rng); n > 0 && s < seq; --n) d[size_t(b * seq + s++)] = int32_t(id);
  return d;
}

void run() {
  if (st::cuda_device_count() == 0) {
    std::printf("bench_block_mask_build: no CUDA device; nothing measured\n");
    return;
  }
  const int64_t B = 2, S = 8192;
  const std::vector<int32_t> doc = documents(B, S);
  void* ddoc = nullptr;
  ST_CUDA_CHECK(cudaMalloc(&ddoc, doc.size() * sizeof(int32_t)), "cudaMalloc");
  ST_CUDA_CHECK(cudaMemcpy(ddoc, doc.data(), doc.size() * sizeof(int32_t), cudaMemcpyHostToDevice), "cudaMemcpy");
  const st::TensorView doc_view(ddoc, st::DType::kInt32, {B, S}, st::Device::cuda(0));
  std::printf("%s\n", st::best_backend_description().c_str());
  for (st::MaskKind kind : {st::MaskKind::kCausal, st::MaskKind::kSlidingWindow, st::MaskKind::kDocumentCausal}) {
    st::MaskSpec spec;
    spec.kind = kind;
    spec.window_left = 2048;
    spec.window_right = 0;
    spec.doc_q = spec.doc_kv = doc_view;
    st::BlockMaskOptions o;
    o.auto_schedule = false;
    o.schedule.kind = st::ScheduleKind::kShortestFirst;
    o.device = st::Device::cuda(0);
    for (int i = 0; i < 3; ++i) st::build_block_mask(spec, S, S, o);  // warm-up
    ST_CUDA_CHECK(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
    const int reps = 20;
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < reps; ++i) st::build_block_mask(spec, S, S, o);
    ST_CUDA_CHECK(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
    const double us = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count() / reps;
    std::printf("device build_block_mask %s, B=%lld, S=%lld (lists, transposes, write orders): %.1f us\n",
                spec.str().c_str(), (long long)B, (long long)S, us);
  }
  ST_CUDA_CHECK(cudaFree(ddoc), "cudaFree");
}

}  // namespace

int main() {
  try {
    run();
  } catch (const st::Error& e) {
    std::fprintf(stderr, "bench_block_mask_build: %s\n", e.what());
    return 1;
  }
  return 0;
}

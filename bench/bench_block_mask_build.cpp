// The device block-mask build timed from C++ (lists, transposes and dQ write orders of an
// S = 8192 mask, launches included): the mean over 20 builds after 3 warm-ups, per mask kind;
// then a document mask's padded backward form (build_doc_padded_mask, min length 1024) against
// the mask itself, at S = 8192 and at a 128k-token row of documents up to 8k (the cost of
// doc_padding). A benchmark, not a test (it asserts nothing); scripts/gpu-check runs it with the
// attention benches. Built with the CUDA backend only; without a GPU it says so and exits 0.
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

// Random document ids [batch, seq]: runs of 1 .. max_length positions (seed 3, as the test it
// replaces, with max_length seq / 3).
std::vector<int32_t> documents(int64_t batch, int64_t seq, int64_t max_length) {
  std::mt19937 rng(3);
  std::uniform_int_distribution<int64_t> len(1, max_length);
  std::vector<int32_t> d(size_t(batch * seq));
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t s = 0, id = 0; s < seq; ++id)
      for (int64_t n = len(rng); n > 0 && s < seq; --n) d[size_t(b * seq + s++)] = int32_t(id);
  return d;
}

// Mean microseconds of `build` (launches included, through its last kernel) over 20 calls after
// 3 warm-ups.
template <class Build>
double time_us(Build build) {
  for (int i = 0; i < 3; ++i) build();
  ST_CUDA_CHECK(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  const int reps = 20;
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < reps; ++i) build();
  ST_CUDA_CHECK(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count() / reps;
}

// Document ids on the device, freed with the object.
struct DeviceIds {
  void* data = nullptr;
  st::TensorView view;
  DeviceIds(int64_t batch, int64_t seq, int64_t max_length) {
    const std::vector<int32_t> doc = documents(batch, seq, max_length);
    ST_CUDA_CHECK(cudaMalloc(&data, doc.size() * sizeof(int32_t)), "cudaMalloc");
    ST_CUDA_CHECK(cudaMemcpy(data, doc.data(), doc.size() * sizeof(int32_t), cudaMemcpyHostToDevice), "cudaMemcpy");
    view = st::TensorView(data, st::DType::kInt32, {batch, seq}, st::Device::cuda(0));
  }
  ~DeviceIds() { cudaFree(data); }
};

st::BlockMaskOptions device_options() {
  st::BlockMaskOptions o;
  o.auto_schedule = false;
  o.schedule.kind = st::ScheduleKind::kShortestFirst;
  o.device = st::Device::cuda(0);
  return o;
}

void run() {
  if (st::cuda_device_count() == 0) {
    std::printf("bench_block_mask_build: no CUDA device; nothing measured\n");
    return;
  }
  const int64_t B = 2, S = 8192;
  const DeviceIds doc(B, S, S / 3);
  const st::BlockMaskOptions o = device_options();
  std::printf("%s\n", st::best_backend_description().c_str());
  for (st::MaskKind kind : {st::MaskKind::kCausal, st::MaskKind::kSlidingWindow, st::MaskKind::kDocumentCausal}) {
    st::MaskSpec spec;
    spec.kind = kind;
    spec.window_left = 2048;
    spec.window_right = 0;
    spec.doc_q = spec.doc_kv = doc.view;
    const double us = time_us([&] { st::build_block_mask(spec, S, S, o); });
    std::printf("device build_block_mask %s, B=%lld, S=%lld (lists, transposes, write orders): %.1f us\n",
                spec.str().c_str(), (long long)B, (long long)S, us);
  }
  // What doc_padding adds: the padded form is a second build (its layout kernel, then the lists).
  const DeviceIds long_row(1, 131072, 8192);
  for (const DeviceIds* ids : {&doc, &long_row}) {
    st::MaskSpec spec;
    spec.kind = st::MaskKind::kDocumentCausal;
    spec.doc_q = spec.doc_kv = ids->view;
    const int64_t b = ids->view.size(0), s = ids->view.size(1);
    const double plain = time_us([&] { st::build_block_mask(spec, s, s, o); });
    const double padded = time_us([&] { st::build_doc_padded_mask(spec, s, 1024, o); });
    std::printf("device document_causal B=%lld, S=%lld: build_block_mask %.1f us, build_doc_padded_mask (min "
                "length 1024) %.1f us\n", (long long)b, (long long)s, plain, padded);
  }
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

// `sparsetrain demo`: an MoE-shaped GroupedLinear training step (forward, dgrad, wgrad) with
// uneven Dirichlet routing, one empty expert and a padded tail, then a GroupedMLP step (fc1 ->
// SwiGLU x probs -> fc2, main_grad accumulation) and a document-causal block-sparse attention
// (forward on the best available backend, forward and backward on the CPU reference), checked
// element by element against the double-precision oracles, and on a GPU the CUDA attention
// backward against the CPU reference's. Last, the main job: one MoE transformer block training
// step (document-causal block-sparse attention -> the MoE layer: router, experts, combine;
// forward + backward, deterministic) run twice with every output and gradient compared bit for
// bit, and the TFLOP/s of each part.
// On a GPU also the TFLOP/s of large MoE and attention shapes; without one the block step runs
// on the CPU reference at a small size and the report says the GPU part was skipped.
#include <algorithm>
#include <charconv>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <deque>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "attention_oracle.h"
#include "grouped_linear_oracle.h"
#include "grouped_mlp_case.h"
#include "host_tensor.h"
#include "sparsetrain/attention.h"
#include "sparsetrain/block_mask.h"
#include "sparsetrain/error.h"
#include "sparsetrain/grouped_linear.h"
#include "sparsetrain/grouped_mlp.h"
#include "sparsetrain/moe_layer.h"
#include "sparsetrain/runtime.h"
#include "tools/commands.h"
#if SPARSETRAIN_WITH_CUDA
#include <cuda_runtime.h>

#include "src/cuda/cuda_check.h"
#endif

namespace sparsetrain::tools {
namespace {

struct DemoOptions {
  int64_t groups = 8, tokens = 2048, in = 512, out = 1024, padding = 37;
  DType dtype = DType::kBF16;
  uint64_t seed = 0;
  bool cpu = false;
};

const char* kDemoHelp =
    "usage: sparsetrain demo [options]\n"
    "\n"
    "Runs one MoE-shaped GroupedLinear forward + backward (dgrad and wgrad) with uneven routing\n"
    "(Dirichlet alpha=2 expert loads, expert 5 forced empty, a padded tail of rows), then one\n"
    "GroupedMLP step (fc1 -> SwiGLU x router probs -> fc2, fp32 main_grad accumulation for both\n"
    "layers) and a small document-causal block-sparse attention (forward and backward), on the\n"
    "best available backend (the first GPU when there is one), checks every output against a\n"
    "double-precision oracle (on a GPU also the CUDA attention backward against the CPU reference's)\n"
    "and prints a report. On a GPU it also reports the TFLOP/s of large MoE shapes (G=8, T=32768,\n"
    "7168 -> 4096 and 7168 -> 2 x 2048 -> 7168, bf16) and of a causal attention forward.\n"
    "\n"
    "Then the main job: one MoE transformer block training step, deterministic: document-causal\n"
    "block-sparse attention (bf16; on a GPU B=2, S=4096, Hq=16, Hkv=4, D=128, the mask built on the\n"
    "device) -> the MoE layer on its output (router: top-2 of softmax scores, normalised, from\n"
    "random logits skewed per expert by a Dirichlet draw; experts: GroupedMLP G=8, 2048 -> 2 x 1536\n"
    "-> 2048, fp32 main_grads; each token's two rows combined in slot order), forward + backward,\n"
    "run twice on the same inputs: every output and gradient (o, lse, the routing, out, dx, dlogits,\n"
    "both main_grads, dq, dk, dv) must agree bit for bit; then the time and TFLOP/s of each part\n"
    "(attention FLOPs over the allowed pairs only). Without a GPU it runs on the CPU reference at a\n"
    "small size (S=512, Hq=4, Hkv=2, D=64, hidden 256 -> 2 x 256 -> 256) and says the GPU part was\n"
    "skipped.\n"
    "Exit status: 0 when every check passes, 1 otherwise, 2 for a usage error.\n"
    "\n"
    "options (a value as --opt value or --opt=value):\n"
    "  --groups G       experts (default 8)\n"
    "  --tokens T       input rows, routed tokens + padding (default 2048)\n"
    "  --padding P      rows at the end that belong to no expert (default 37)\n"
    "  --in N           in_features (default 512)\n"
    "  --out N          out_features (default 1024); the GroupedMLP step's hidden size is\n"
    "                   N / 8, at least 1\n"
    "  --dtype D        bf16, fp16 or fp32 (default bf16)\n"
    "  --seed S         random seed (default 0)\n"
    "  --cpu            use the CPU reference backend even where a GPU is present\n"
    "\n"
    "The shape options apply to the GroupedLinear and GroupedMLP checks; the attention and block\n"
    "step shapes are fixed (--seed applies to all).\n";

// Expert loads from a Dirichlet(alpha = 2) draw, one expert forced empty, summing to `rows`.
std::vector<int64_t> dirichlet_splits(int64_t groups, int64_t rows, std::mt19937_64& rng) {
  std::gamma_distribution<double> gamma(2.0, 1.0);
  std::vector<double> w(static_cast<size_t>(groups));
  double total = 0;
  for (int64_t g = 0; g < groups; ++g) total += (w[size_t(g)] = gamma(rng));
  const int64_t empty = groups > 5 ? 5 : groups - 1;
  if (groups > 1) total -= w[size_t(empty)], w[size_t(empty)] = 0;
  std::vector<int64_t> s(static_cast<size_t>(groups));
  int64_t used = 0;
  for (int64_t g = 0; g < groups; ++g) used += (s[size_t(g)] = int64_t(double(rows) * w[size_t(g)] / total));
  s[0] += rows - used;  // rounding remainder
  return s;
}

// A whole decimal integer in [lo, hi] (std::stoll would read "12abc" as 12).
bool parse_int(const std::string& v, int64_t lo, int64_t hi, int64_t& out) {
  int64_t x = 0;
  const char* end = v.data() + v.size();
  const auto r = std::from_chars(v.data(), end, x);
  if (r.ec != std::errc() || r.ptr != end || x < lo || x > hi) return false;
  out = x;
  return true;
}

// The demo keeps its arrays several times over (inputs, outputs, a double-precision oracle), so
// shapes are capped well below what would exhaust host memory.
constexpr int64_t kMaxElements = int64_t(1) << 28;

bool parse(int argc, char** argv, DemoOptions& o, int& exit_code) {
  exit_code = 2;
  auto usage_error = [](const std::string& what) {
    std::fprintf(stderr, "sparsetrain demo: %s (try --help)\n", what.c_str());
    return false;
  };
  struct IntOption {
    const char* name;
    int64_t* value;
    int64_t lo, hi;
  };
  int64_t seed = 0;
  const IntOption ints[] = {{"--groups", &o.groups, 1, 512},  // the CUDA backend's group limit
                            {"--tokens", &o.tokens, 1, kMaxElements},
                            {"--padding", &o.padding, 0, kMaxElements},
                            {"--in", &o.in, 1, 65536},
                            {"--out", &o.out, 1, 65536},
                            {"--seed", &seed, 0, INT64_MAX}};
  for (int i = 2; i < argc; ++i) {
    std::string a = argv[i];
    // --opt=value, as well as --opt value: the value is what follows the first '='.
    const size_t eq = a.rfind("--", 0) == 0 ? a.find('=') : std::string::npos;
    const bool inline_value = eq != std::string::npos;
    const std::string given = inline_value ? a.substr(eq + 1) : std::string();
    if (inline_value) a.resize(eq);
    if (a == "--help" || a == "-h" || a == "--cpu") {
      if (inline_value) return usage_error("option '" + a + "' takes no value");
      if (a == "--cpu") {
        o.cpu = true;
        continue;
      }
      std::fputs(kDemoHelp, stdout);
      exit_code = 0;
      return false;
    }
    const IntOption* io = nullptr;
    for (const IntOption& c : ints)
      if (a == c.name) io = &c;
    if (io == nullptr && a != "--dtype") return usage_error("unknown option '" + a + "'");
    if (!inline_value && i + 1 >= argc) return usage_error("option '" + a + "' needs a value");
    const std::string v = inline_value ? given : argv[++i];
    if (io != nullptr) {
      if (!parse_int(v, io->lo, io->hi, *io->value))
        return usage_error("bad value '" + v + "' for " + a + ": expected a whole number in [" +
                           std::to_string(io->lo) + ", " + std::to_string(io->hi) + "]");
    } else if (v == "bf16" || v == "fp16" || v == "fp32") {
      o.dtype = v == "bf16" ? DType::kBF16 : v == "fp16" ? DType::kFP16 : DType::kFP32;
    } else {
      return usage_error("bad value '" + v + "' for --dtype: expected bf16, fp16 or fp32");
    }
  }
  o.seed = uint64_t(seed);
  if (o.padding > o.tokens)
    return usage_error("--padding " + std::to_string(o.padding) + " exceeds --tokens " + std::to_string(o.tokens));
  // Each factor is capped above, so these products fit in 64 bits.
  const int64_t weights = o.groups * o.in * o.out, rows = o.tokens * std::max(o.in, o.out);
  if (weights > kMaxElements || rows > kMaxElements)
    return usage_error("groups x in x out = " + std::to_string(weights) + " and tokens x max(in, out) = " +
                       std::to_string(rows) + " must each be at most " + std::to_string(kMaxElements) +
                       " elements (the demo holds its arrays several times over)");
  exit_code = 0;
  return true;
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// Where the demo computes: the first GPU when there is one (copies in and out), else the host.
struct Place {
  Device device = Device::cpu();
  bool gpu() const { return device.is_cuda(); }

  // A copy of a host tensor on the device (or the host tensor's own view on the CPU).
  TensorView put(const testing::HostTensor& h, std::vector<Tensor>& keep) const {
    (void)keep;  // unused without CUDA
    if (!gpu()) return h.view();
#if SPARSETRAIN_WITH_CUDA
    const TensorView v = h.view();
    keep.push_back(Tensor::empty(v.dtype(), v.shape(), v.dim(), device, default_allocator(), {}));
    check(cudaMemcpy(keep.back().view().data(), h.data(), size_t(v.numel()) * v.element_size(), cudaMemcpyHostToDevice));
    return keep.back().view();
#else
    return h.view();
#endif
  }
  testing::HostTensor get(const TensorView& v) const {
    if (!gpu()) return testing::HostTensor::copy_of(v);
#if SPARSETRAIN_WITH_CUDA
    check(cudaDeviceSynchronize());
    if (v.is_contiguous()) {  // one copy (the block step's main_grads are hundreds of MB)
      testing::HostTensor h(v.dtype(), std::vector<int64_t>(v.shape(), v.shape() + v.dim()));
      check(cudaMemcpy(h.data(), v.data(), size_t(v.numel()) * v.element_size(), cudaMemcpyDeviceToHost));
      return h;
    }
    // Strided views (per-group wgrads): copy the whole extent, then gather on the host.
    int64_t extent = 1;
    for (int i = 0; i < v.dim(); ++i) extent += (v.size(i) - 1) * v.stride(i);
    testing::HostTensor stage(v.dtype(), {extent});
    check(cudaMemcpy(stage.data(), v.data(), size_t(extent) * v.element_size(), cudaMemcpyDeviceToHost));
    return testing::HostTensor::copy_of(TensorView(stage.data(), v.dtype(), v.shape(), v.strides(), v.dim()));
#else
    return testing::HostTensor::copy_of(v);
#endif
  }
  // A [rows, cols] tensor of random values in [-scale, scale) (a 1 Mi-element random block
  // repeated: for timing, where a host-side fill of hundreds of MB would dominate the demo's run
  // time).
  TensorView random(DType dtype, int64_t rows, int64_t cols, std::mt19937_64& rng, std::vector<Tensor>& keep,
                    double scale = 1.0) const {
    const int64_t shape[2] = {rows, cols};
    keep.push_back(Tensor::empty(dtype, shape, 2, device, default_allocator(), {}));
    testing::HostTensor block(dtype, {int64_t(1) << 20});
    block.fill_random(rng, scale);
    const size_t total = size_t(rows * cols) * dtype_size(dtype), chunk = size_t(block.numel()) * dtype_size(dtype);
    char* dst = static_cast<char*>(keep.back().view().data());
    for (size_t done = 0; done < total; done += chunk) copy_in(dst + done, block.data(), std::min(chunk, total - done));
    return keep.back().view();
  }
  // Zeroes a contiguous view.
  void zero(const TensorView& v) const {
    const size_t bytes = size_t(v.numel()) * v.element_size();
#if SPARSETRAIN_WITH_CUDA
    if (gpu()) return check(cudaMemset(v.data(), 0, bytes));
#endif
    std::memset(v.data(), 0, bytes);
  }
  // Host bytes to where the demo computes.
  void copy_in(void* dst, const void* src, size_t bytes) const {
#if SPARSETRAIN_WITH_CUDA
    if (gpu()) return check(cudaMemcpy(dst, src, bytes, cudaMemcpyHostToDevice));
#endif
    std::memcpy(dst, src, bytes);
  }
  void sync() const {
#if SPARSETRAIN_WITH_CUDA
    if (gpu()) check(cudaDeviceSynchronize());
#endif
  }
#if SPARSETRAIN_WITH_CUDA
  static void check(cudaError_t e) { ST_CUDA_CHECK(e, "demo: CUDA call"); }
#endif
};

// Seconds per call of fn, averaged over `reps` (after a warm-up call on the GPU).
template <typename Fn>
double time_call(const Place& place, int reps, Fn&& fn) {
  if (place.gpu()) fn();
  place.sync();
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < reps; ++i) fn();
  place.sync();
  return seconds_since(t0) / reps;
}

// GPU throughput on one of docs/DESIGN.md section 9's MoE shapes (DeepSeek-like fc1: G = 8, T = 32768,
// 7168 -> 4096, bf16, Dirichlet routing with device splits), timed after a warm-up. Not checked
// against the oracle (the CPU would take minutes); the tests cover these kernels.
void report_gpu_throughput(const Place& place, std::mt19937_64& rng) {
  const int64_t G = 8, T = 32768, in = 7168, out = 4096;
  std::vector<Tensor> keep;
  const TensorView x = place.random(DType::kBF16, T, in, rng, keep), dy = place.random(DType::kBF16, T, out, rng, keep);
  const TensorView w = place.random(DType::kBF16, G * out, in, rng, keep);
  GroupedLinearOptions opts;
  opts.num_groups = G;
  opts.in_features = in;
  opts.out_features = out;
  opts.dtype = DType::kBF16;
  GroupedLinearParams params;
  params.weight = GroupedParam::packed(TensorView(w.data(), DType::kBF16, {G, out, in}, w.device()));
  GroupedLinear layer(opts, params);
  const Splits sp = Splits::host(dirichlet_splits(G, T, rng));
  Tensor y;
  GroupedLinearGrads grads;
  const double t_fwd = time_call(place, 10, [&] { y = layer.forward(x, sp); });
  const double t_bwd = time_call(place, 10, [&] { grads = layer.backward(x, dy, sp); });
  const double flops = 2.0 * double(T) * double(in) * double(out);
  std::printf("  large     G=%lld, x [%lld, %lld], W [%lld, %lld, %lld] bf16: forward %.3f ms (%.0f TFLOP/s), backward "
              "%.3f ms (%.0f TFLOP/s)\n",
              (long long)G, (long long)T, (long long)in, (long long)G, (long long)out, (long long)in, t_fwd * 1e3,
              flops / t_fwd * 1e-12, t_bwd * 1e3, 2 * flops / t_bwd * 1e-12);
}

// One MoE expert-MLP training step (GroupedMLP: fc1 -> SwiGLU x router probs -> fc2) with both
// layers' wgrads accumulated into fp32 main_grad, checked against the double-precision oracle;
// on a GPU also the TFLOP/s of a DeepSeek-like step (G = 8, T = 32768, 7168 -> 2 x 2048 -> 7168).
bool run_mlp_step(const Place& place, const DemoOptions& o, std::mt19937_64& rng) {
  using testing::HostTensor;
  // F from --out, at least 1: every --out the options take runs (--out 7 would make F = 0).
  const int64_t G = o.groups, T = o.tokens, S = T - o.padding, F = std::max<int64_t>(1, o.out / 8);
  testing::GroupedMLPCase c = testing::random_mlp_case(o.dtype, G, T, S, o.in, F, o.in, 0, {}, true, false, false,
                                                       o.seed);
  c.splits = dirichlet_splits(G, S, rng);
  c.fuse = true;
  const HostTensor mg1_before = c.mg1, mg2_before = c.mg2;  // on the CPU the layer accumulates into c's
  std::vector<Tensor> keep;
  const TensorView x = place.put(c.x, keep), probs = place.put(c.probs, keep), dy = place.put(c.dy, keep);
  const TensorView w1 = place.put(c.w1, keep), w2 = place.put(c.w2, keep);
  const TensorView mg1 = place.put(c.mg1, keep), mg2 = place.put(c.mg2, keep);
  GroupedMLPParams params;
  params.fc1.weight = GroupedParam::packed(w1);
  params.fc2.weight = GroupedParam::packed(w2);
  params.fc1.main_grad = GroupedParam::packed(mg1);
  params.fc2.main_grad = GroupedParam::packed(mg2);
  GroupedMLP mlp(c.options(), params);
  const Splits sp = Splits::host(c.splits);
  const auto t0 = std::chrono::steady_clock::now();
  const GroupedMLPForward fwd = mlp.forward(x, sp, probs);
  const GroupedMLPGrads g = mlp.backward(x, fwd.fc1_out.view(), probs, dy, sp);
  place.sync();
  const double t = seconds_since(t0);
  const auto oracle = c.oracle();
  const auto b = oracle.backward(place.get(fwd.fc1_out.view()).to_double());
  bool pass = true;
  auto report = [&](const char* name, const testing::CompareResult& r) {
    pass = pass && r.ok;
    if (!r.ok) std::printf("            %s: %s\n", name, r.first_failure.c_str());
  };
  auto head = [&](const Tensor& v) { return place.get(v.view().rows(0, S)); };
  report("out", testing::compare_bounded(head(fwd.out), oracle.forward().out, o.dtype, "out"));
  report("dx", testing::compare_bounded(head(g.grad_input), b.dx, o.dtype, "dx"));
  report("dprobs", testing::compare_bounded(head(g.dprobs), b.dprobs, DType::kFP32, "dprobs"));
  const HostTensor m1 = place.get(mg1), m2 = place.get(mg2);
  for (int64_t e = 0; e < G; ++e) {
    const std::vector<double> base1 = HostTensor::copy_of(mg1_before.view().select(e)).to_double();
    const std::vector<double> base2 = HostTensor::copy_of(mg2_before.view().select(e)).to_double();
    report("main_grad1", testing::compare_bounded(HostTensor::copy_of(m1.view().select(e)), b.dw1[size_t(e)],
                                                  DType::kFP32, "fc1 main_grad", &base1));
    report("main_grad2", testing::compare_bounded(HostTensor::copy_of(m2.view().select(e)), b.dw2[size_t(e)],
                                                  DType::kFP32, "fc2 main_grad", &base2));
  }
  std::printf("  mlp       GroupedMLP x [%lld, %lld] -> 2 x %lld -> %lld, fwd + bwd + main_grad += in %.3f ms "
              "(first call); out, dx, dprobs, both main_grads vs oracle: %s\n",
              (long long)T, (long long)o.in, (long long)F, (long long)o.in, t * 1e3, pass ? "ok" : "MISMATCH");
  if (!place.gpu()) return pass;

  const int64_t LG = 8, LT = 32768, hidden = 7168, ffn = 2048;
  std::vector<Tensor> big;
  const TensorView bx = place.random(DType::kBF16, LT, hidden, rng, big);
  const TensorView bdy = place.random(DType::kBF16, LT, hidden, rng, big);
  const TensorView bw1 = place.random(DType::kBF16, LG * 2 * ffn, hidden, rng, big);
  const TensorView bw2 = place.random(DType::kBF16, LG * hidden, ffn, rng, big);
  const TensorView bm1 = place.random(DType::kFP32, LG * 2 * ffn, hidden, rng, big);
  const TensorView bm2 = place.random(DType::kFP32, LG * hidden, ffn, rng, big);
  testing::HostTensor hp(DType::kFP32, {LT});
  for (int64_t i = 0; i < LT; ++i) hp.set(i, 0.5);
  const TensorView bp = place.put(hp, big);
  GroupedMLPOptions lo;
  lo.num_groups = LG;
  lo.in_features = lo.out_features = hidden;
  lo.ffn_features = ffn;
  lo.dtype = DType::kBF16;
  lo.fuse_wgrad_accumulation = true;
  GroupedMLPParams lp;
  lp.fc1.weight = GroupedParam::packed(TensorView(bw1.data(), DType::kBF16, {LG, 2 * ffn, hidden}, bw1.device()));
  lp.fc2.weight = GroupedParam::packed(TensorView(bw2.data(), DType::kBF16, {LG, hidden, ffn}, bw2.device()));
  lp.fc1.main_grad = GroupedParam::packed(TensorView(bm1.data(), DType::kFP32, {LG, 2 * ffn, hidden}, bm1.device()));
  lp.fc2.main_grad = GroupedParam::packed(TensorView(bm2.data(), DType::kFP32, {LG, hidden, ffn}, bm2.device()));
  GroupedMLP large(lo, lp);
  const Splits lsp = Splits::host(dirichlet_splits(LG, LT, rng));
  const double ts = time_call(place, 5, [&] {
    const GroupedMLPForward f = large.forward(bx, lsp, bp);
    large.backward(bx, f.fc1_out.view(), bp, bdy, lsp);
  });
  const double flops = 3 * 2.0 * double(LT) * double(hidden) * double(3 * ffn);
  std::printf("  mlp large G=%lld, x [%lld, %lld] -> 2 x %lld -> %lld bf16, fused main_grad: fwd + bwd %.3f ms "
              "(%.0f TFLOP/s)\n",
              (long long)LG, (long long)LT, (long long)hidden, (long long)ffn, (long long)hidden, ts * 1e3,
              flops / ts * 1e-12);
  return pass;
}

// Attention forward throughput on docs/DESIGN.md section 9's shape (B = 2, H = 16, S = 8192, D = 128,
// bf16, causal; FLOPs over the allowed pairs), timed after a warm-up. The tests check the kernel.
void report_attention_throughput(const Place& place, std::mt19937_64& rng) {
  const int64_t B = 2, S = 8192, H = 16, D = 128;
  std::vector<Tensor> keep;
  const TensorView q = place.random(DType::kBF16, B * S, H * D, rng, keep);
  const TensorView k = place.random(DType::kBF16, B * S, H * D, rng, keep);
  const TensorView v = place.random(DType::kBF16, B * S, H * D, rng, keep);
  auto bshd = [&](const TensorView& t) { return TensorView(t.data(), DType::kBF16, {B, S, H, D}, t.device()); };
  MaskSpec spec;
  spec.kind = MaskKind::kCausal;
  BlockMaskOptions mo;
  mo.device = place.device;
  mo.auto_schedule = false;
  const BlockMaskTensors mask = build_block_mask(spec, S, S, mo);
  AttentionForward f;
  const double t = time_call(place, 20, [&] { f = block_sparse_attention_forward(bshd(q), bshd(k), bshd(v), mask.mask); });
  const double flops = 4.0 * double(D) * double(B * H) * double(S) * double(S + 1) / 2;
  std::printf("  large     causal attention forward B=%lld, H=%lld, S=%lld, D=%lld bf16: %.3f ms (%.0f TFLOP/s)\n",
              (long long)B, (long long)H, (long long)S, (long long)D, t * 1e3, flops / t * 1e-12);
}

// Documents of uniform random lengths in [lo, hi], the last one of each row cut at S: int32 ids
// [B, S]. `causal_pairs`: the exact number of document-causal (q, kv) pairs of one head, the sum
// over documents of L (L + 1) / 2; `documents`: how many there are.
testing::HostTensor random_documents(int64_t B, int64_t S, int64_t lo, int64_t hi, std::mt19937_64& rng,
                                     int64_t* causal_pairs = nullptr, int64_t* documents = nullptr) {
  testing::HostTensor doc(DType::kInt32, {B, S});
  int64_t pairs = 0, count = 0;
  for (int64_t b = 0; b < B; ++b) {
    std::uniform_int_distribution<int64_t> len(lo, hi);
    for (int64_t s = 0, id = 0; s < S; ++id, ++count) {
      int64_t n = 0;
      for (const int64_t want = len(rng); n < want && s < S; ++n) doc.set(b * S + s++, double(id));
      pairs += n * (n + 1) / 2;
    }
  }
  if (causal_pairs) *causal_pairs = pairs;
  if (documents) *documents = count;
  return doc;
}

// |got - ref| <= tol * max |ref| for every element (NaN and inf never pass): for two fp32
// implementations with different accumulation orders and 16-bit GEMM operands, where the oracle's
// elementwise bounds do not apply. `error`: max |got - ref| / max |ref|.
struct MaxRelative {
  bool ok = false;
  double error = 0;
  std::string detail;
};
MaxRelative compare_max_relative(const testing::HostTensor& got, const testing::HostTensor& ref, double tol) {
  MaxRelative r;
  if (got.numel() != ref.numel()) {
    r.detail = "sizes differ";
    return r;
  }
  double max_ref = 0, max_err = 0;
  int64_t worst = 0, nonfinite = 0;
  for (int64_t i = 0; i < ref.numel(); ++i) {
    const double g = got.get(i), e = ref.get(i), err = std::fabs(g - e);
    max_ref = std::max(max_ref, std::fabs(e));
    if (!std::isfinite(g)) ++nonfinite;
    else if (err > max_err) max_err = err, worst = i;
  }
  r.error = max_ref > 0 ? max_err / max_ref : max_err;
  r.ok = nonfinite == 0 && r.error <= tol;
  char buf[160];
  if (nonfinite)
    std::snprintf(buf, sizeof buf, "%lld non-finite elements", (long long)nonfinite);
  else
    std::snprintf(buf, sizeof buf, "max error / max |ref| %.2e (limit %.2e, worst at %lld: %g vs %g)", r.error, tol,
                  (long long)worst, got.get(worst), ref.get(worst));
  r.detail = buf;
  return r;
}

// Block-sparse attention with a document-causal mask (documents of random lengths), GQA 4:1, S
// not a multiple of the 128 block, bf16: the forward on the demo's backend (the mask built there
// too) and the CPU reference's forward and backward, each checked against the dense
// double-precision oracle; on a GPU the CUDA backward (deterministic) against the CPU reference's
// from the same q, k, v, o, lse and dout, and the forward's TFLOP/s at a large shape.
bool run_attention_step(const Place& place, std::mt19937_64& rng) {
  using testing::HostTensor;
  const int64_t B = 2, S = 700, Hq = 4, Hkv = 1, D = 128;
  const HostTensor doc = random_documents(B, S, 60, 300, rng);
  MaskSpec spec;
  spec.kind = MaskKind::kDocumentCausal;
  spec.doc_q = spec.doc_kv = doc.view();
  const BlockMaskTensors mask = build_block_mask(spec, S, S);
  HostTensor q(DType::kBF16, {B, S, Hq, D}), k(DType::kBF16, {B, S, Hkv, D}), v(DType::kBF16, {B, S, Hkv, D});
  HostTensor dout(DType::kBF16, {B, S, Hq, D});
  for (HostTensor* t : {&q, &k, &v, &dout}) t->fill_random(rng);

  // Forward where the demo computes, with the mask built there (no host sync on a GPU).
  std::vector<Tensor> keep;
  MaskSpec place_spec = spec;
  place_spec.doc_q = place_spec.doc_kv = place.put(doc, keep);
  BlockMaskOptions mo;
  mo.device = place.device;
  mo.auto_schedule = !place.gpu();
  const BlockMaskTensors place_mask = build_block_mask(place_spec, S, S, mo);
  const TensorView qp = place.put(q, keep), kp = place.put(k, keep), vp = place.put(v, keep);
  const auto t0 = std::chrono::steady_clock::now();
  const AttentionForward fp = block_sparse_attention_forward(qp, kp, vp, place_mask.mask);
  place.sync();
  const double t_fwd = seconds_since(t0);
  const HostTensor o_placed = place.get(fp.o.view());

  const auto t1 = std::chrono::steady_clock::now();
  const AttentionForward f = block_sparse_attention_forward(q.view(), k.view(), v.view(), mask.mask);
  const AttentionGrads g =
      block_sparse_attention_backward(q.view(), k.view(), v.view(), f.o.view(), f.lse.view(), dout.view(), mask.mask);
  const double t_cpu = seconds_since(t1);
  testing::AttentionOracle oracle;
  oracle.B = B, oracle.Sq = oracle.Skv = S, oracle.Hq = Hq, oracle.Hkv = Hkv, oracle.D = D;
  oracle.scale = 1.0 / std::sqrt(double(D));
  oracle.dtype = DType::kBF16;
  oracle.p_operand = DType::kBF16;  // the CUDA forward rounds P to bf16 (a looser bound covers the CPU too)
  oracle.q = q.view(), oracle.k = k.view(), oracle.v = v.view(), oracle.dout = dout.view();
  oracle.allowed = [&](int64_t b, int64_t, int64_t i, int64_t j) { return testing::spec_allows(spec, b, S, S, i, j); };
  const auto r = oracle.run();
  bool pass = true;
  const HostTensor dq = HostTensor::copy_of(g.dq.view()), dk = HostTensor::copy_of(g.dk.view()),
                   dv = HostTensor::copy_of(g.dv.view());
  for (const auto& [name, got, ref] : {std::tuple{"o", &o_placed, &r.o}, std::tuple{"dq", &dq, &r.dq},
                                       std::tuple{"dk", &dk, &r.dk}, std::tuple{"dv", &dv, &r.dv}}) {
    const testing::CompareResult c = testing::compare_bounded(*got, *ref, DType::kBF16, name);
    if (!c.ok) std::printf("            %s\n", c.first_failure.c_str());
    pass = pass && c.ok;
  }
  const std::string order = check_write_order(mask.mask);
  pass = pass && order.empty();
  const double density = double(r.allowed_pairs) / double(B * Hq * S * S);
  std::printf("  attention document-causal block-sparse attention, B=%lld, S=%lld, Hq=%lld, Hkv=%lld, D=%lld, bf16, "
              "%.1f %% of pairs allowed, dQ schedule %s%s: forward %.1f ms on %s, fwd + bwd %.1f ms on the CPU "
              "reference; o, dq, dk, dv vs oracle: %s\n",
              (long long)B, (long long)S, (long long)Hq, (long long)Hkv, (long long)D, 100 * density,
              mask.mask.schedule.str().c_str(), order.empty() ? " (write order checked)" : " (WRITE ORDER INVALID)",
              t_fwd * 1e3, place.device.str().c_str(), t_cpu * 1e3, pass ? "ok" : "MISMATCH");

  if (!place.gpu()) {
    std::printf("  attention CUDA backward vs CPU reference: SKIPPED (%s)\n",
                cuda_device_count() > 0 ? "--cpu" : "no GPU on this machine");
    return pass;
  }
  // The CUDA backward (deterministic, device-built mask, its write order) from the CPU
  // reference's o and lse, against the CPU reference's backward: a bf16 tolerance of 2^-6 of each
  // gradient's largest magnitude (4 bf16 ulps there; P and dS enter the GEMMs as bf16).
  const double tol = std::ldexp(1.0, -6);
  const HostTensor o_ref = HostTensor::copy_of(f.o.view()), lse_ref = HostTensor::copy_of(f.lse.view());
  const TensorView op = place.put(o_ref, keep), lsep = place.put(lse_ref, keep), doutp = place.put(dout, keep);
  AttentionOptions ao;
  ao.deterministic = true;
  bool cuda_pass = false;
  std::string detail;
  try {
    const auto t2 = std::chrono::steady_clock::now();
    const AttentionGrads gc = block_sparse_attention_backward(qp, kp, vp, op, lsep, doutp, place_mask.mask, ao);
    place.sync();
    const double t_bwd = seconds_since(t2);
    cuda_pass = true;
    char buf[64];
    std::snprintf(buf, sizeof buf, "%.1f ms (first call); ", t_bwd * 1e3);
    detail = buf;
    for (const auto& [name, got, ref] : {std::tuple{"dq", &gc.dq, &dq}, std::tuple{"dk", &gc.dk, &dk},
                                         std::tuple{"dv", &gc.dv, &dv}}) {
      const MaxRelative c = compare_max_relative(place.get(got->view()), *ref, tol);
      detail += std::string(name) + " " + (c.ok ? "ok" : "MISMATCH") + " (" + c.detail + ")" + (name[1] == 'v' ? "" : ", ");
      cuda_pass = cuda_pass && c.ok;
    }
  } catch (const std::exception& e) {
    detail = std::string("the backward failed: ") + e.what();
  }
  std::printf("  attention CUDA backward (deterministic) vs CPU reference backward, same inputs: %s\n            %s\n",
              cuda_pass ? "PASS" : "FAIL", detail.c_str());
  report_attention_throughput(place, rng);
  return pass && cuda_pass;
}

// Points on the compute device's timeline: CUDA events on the default stream on a GPU, the host
// clock on the CPU (where every call returns when its work is done).
class Timeline {
 public:
  // `marks`: how many mark() calls will come (their events are created up front).
  Timeline(const Place& place, size_t marks) : gpu_(place.gpu()) {
#if SPARSETRAIN_WITH_CUDA
    for (size_t i = 0; gpu_ && i < marks; ++i) {
      cudaEvent_t e = nullptr;
      Place::check(cudaEventCreate(&e));
      events_.push_back(e);
    }
#endif
    host_.reserve(marks);
  }
  Timeline(const Timeline&) = delete;
  Timeline& operator=(const Timeline&) = delete;
  ~Timeline() {
#if SPARSETRAIN_WITH_CUDA
    for (cudaEvent_t e : events_) cudaEventDestroy(e);
#endif
  }
  void mark() {
#if SPARSETRAIN_WITH_CUDA
    if (gpu_) return Place::check(cudaEventRecord(events_.at(recorded_++), nullptr));
#endif
    host_.push_back(std::chrono::steady_clock::now());
  }
  // Milliseconds from mark a to mark b (waits for b on a GPU).
  double ms(size_t a, size_t b) const {
#if SPARSETRAIN_WITH_CUDA
    if (gpu_) {
      float t = 0;
      Place::check(cudaEventSynchronize(events_.at(b)));
      Place::check(cudaEventElapsedTime(&t, events_.at(a), events_.at(b)));
      return double(t);
    }
#endif
    return std::chrono::duration<double, std::milli>(host_.at(b) - host_.at(a)).count();
  }

 private:
  bool gpu_;
  std::vector<std::chrono::steady_clock::time_point> host_;
#if SPARSETRAIN_WITH_CUDA
  std::vector<cudaEvent_t> events_;
  size_t recorded_ = 0;
#endif
};

// A host copy of a mask's tensors (the mask itself on the CPU), with the host document ids of
// `spec`, for validate_block_mask.
BlockMask host_copy(const Place& place, const BlockMask& m, const MaskSpec& spec, std::deque<testing::HostTensor>& store) {
  BlockMask h = m;
  h.spec = spec;
  if (!place.gpu()) return h;
  for (TensorView BlockMask::*t :
       {&BlockMask::kv_num_blocks, &BlockMask::kv_indices, &BlockMask::full_kv_num_blocks, &BlockMask::full_kv_indices,
        &BlockMask::q_num_blocks, &BlockMask::q_indices, &BlockMask::full_q_num_blocks, &BlockMask::full_q_indices,
        &BlockMask::dq_write_order, &BlockMask::dq_write_order_full, &BlockMask::partial_bitmasks}) {
    if (!(m.*t).defined()) continue;
    store.push_back(place.get(m.*t));
    h.*t = store.back().view();
  }
  return h;
}

// The shape of the block step: attention q [B, S, Hq, D], k and v [B, S, Hkv, D], documents of
// doc_min..doc_max tokens; the MoE layer G experts, hidden Hq * D -> 2 x F -> Hq * D, each of the
// B * S tokens routed to top_k of them.
struct BlockShape {
  int64_t B, S, Hq, Hkv, D, doc_min, doc_max, G, F, top_k;
  int timed_steps;  // after the two checked steps (0: the second checked step is timed)
};

// One MoE transformer block training step, deterministic, run twice on the same inputs:
//   attention: o = block_sparse_attention(q, k, v) under a document-causal mask (bf16, GQA);
//   MoE:       out = MoELayer(o viewed as [B * S, Hq * D], logits): the router's top_k of softmax
//              scores, the tokens' rows gathered by expert, the experts' GroupedMLP (fp32
//              main_grad accumulation for both layers), each token's rows summed in slot order;
//   backward:  dout -> the layer's dx, dlogits and main_grads -> dx is the attention's dout -> dq,
//              dk, dv.
// (No projections, norms or residuals, and the router's own linear is left out: the logits are an
// input, random with a per-expert skew so that the experts' loads are uneven. The two sparse parts
// of a block, chained.) Checks: the mask
// (validated where it was built, write order included), the exact pair count, every output and
// gradient finite and not all zero, and run 1 == run 2 bit for bit for every one of them. Then the
// time and TFLOP/s of each part: on a GPU the median of `timed_steps` steps (CUDA events) after the
// two checked ones; on the CPU the second checked step (the reference backend: no performance claim).
bool run_block_step(const Place& place, const DemoOptions& opt) {
  using testing::HostTensor;
  const bool gpu = place.gpu();
  const BlockShape sh = gpu ? BlockShape{2, 4096, 16, 4, 128, 256, 2048, 8, 1536, 2, 50}
                            : BlockShape{2, 512, 4, 2, 64, 32, 256, 8, 256, 2, 0};
  const int64_t B = sh.B, S = sh.S, Hq = sh.Hq, Hkv = sh.Hkv, D = sh.D, G = sh.G, F = sh.F, K = sh.top_k;
  const int64_t T = B * S, hidden = Hq * D;
  std::mt19937_64 rng(opt.seed * 1000003 + 4);  // its own stream: the other steps' inputs stay as they were
  bool pass = true;
  auto verdict = [&](bool ok, const std::string& what) {
    std::printf("            [%s] %s\n", ok ? "PASS" : "FAIL", what.c_str());
    pass = pass && ok;
  };

  std::printf("  block     one MoE transformer block training step (deterministic), forward + backward twice on %s\n",
              place.device.str().c_str());
  if (!gpu)
    std::printf("            GPU part SKIPPED: %s; the step runs on the CPU reference at a small size\n",
                cuda_device_count() > 0 ? "--cpu given"
                : built_with_cuda()     ? "no GPU on this machine (CUDA backend compiled in)"
                                        : "no GPU (this build has no CUDA backend)");
  try {
    int64_t head_pairs = 0, documents = 0;
    const HostTensor doc = random_documents(B, S, sh.doc_min, sh.doc_max, rng, &head_pairs, &documents);
    const int64_t pairs = head_pairs * Hq;
    MaskSpec spec;
    spec.kind = MaskKind::kDocumentCausal;
    spec.doc_q = spec.doc_kv = doc.view();

    // The mask: "auto" schedule chosen on the host (the scheduler model), then on a GPU built on
    // the device with that schedule.
    BlockMaskOptions host_options;
    const BlockMaskTensors host_mask = build_block_mask(spec, S, S, host_options);
    std::vector<Tensor> keep;
    std::deque<HostTensor> host;
    BlockMaskTensors device_mask;
    const BlockMask* mask = &host_mask.mask;
    if (gpu) {
      MaskSpec device_spec = spec;
      device_spec.doc_q = device_spec.doc_kv = place.put(doc, keep);
      BlockMaskOptions mo = host_options;
      mo.device = place.device;
      mo.auto_schedule = false;
      mo.schedule = host_mask.mask.schedule;
      device_mask = build_block_mask(device_spec, S, S, mo);
      mask = &device_mask.mask;
    }
    std::printf("            attention: document-causal block-sparse, B=%lld, S=%lld, Hq=%lld, Hkv=%lld, D=%lld, bf16, "
                "%lld documents of %lld..%lld tokens, %.1f %% of (q, kv) pairs allowed; mask built on %s, dQ schedule "
                "%s (\"auto\" on the host)\n",
                (long long)B, (long long)S, (long long)Hq, (long long)Hkv, (long long)D, (long long)documents,
                (long long)sh.doc_min, (long long)sh.doc_max, 100.0 * double(pairs) / double(B * Hq * S * S),
                place.device.str().c_str(), mask->schedule.str().c_str());
    std::printf("            MoE layer on the attention output (%lld tokens): router top-%lld of softmax "
                "scores, normalised; experts GroupedMLP G=%lld, %lld -> 2 x %lld -> %lld, bf16, fp32 "
                "main_grad accumulation; combine in slot order\n",
                (long long)T, (long long)K, (long long)G, (long long)hidden, (long long)F, (long long)hidden);
    {
      std::deque<HostTensor> copies;
      std::string error;
      try {
        validate_block_mask(host_copy(place, *mask, spec, copies), B, Hq);
      } catch (const std::exception& e) {
        error = e.what();
      }
      verdict(error.empty(), "block mask valid where it was built (transposes, dQ write order: " +
                                 (error.empty() ? std::string("deadlock-free invariant holds)") : error + ")"));
      int64_t counted = 0;  // the pair count, from the mask's definition
      for (int64_t b = 0; b < B; ++b)
        for (int64_t i = 0; i < S; ++i)
          for (int64_t j = 0; j < S; ++j) counted += testing::spec_allows(spec, b, S, S, i, j) ? 1 : 0;
      verdict(counted * Hq == pairs, "allowed pairs from the document lengths (" + std::to_string(pairs) +
                                         ") = pairs counted element by element (" + std::to_string(counted * Hq) + ")");
    }

    // Inputs. On a GPU the weights repeat a 1 Mi-element random block (a host fill of them would
    // dominate the run time); activations are random throughout.
    auto activation = [&](DType dtype, std::vector<int64_t> shape, double lo, double hi) {
      host.emplace_back(dtype, std::move(shape));
      std::uniform_real_distribution<double> u(lo, hi);
      for (int64_t i = 0; i < host.back().numel(); ++i) host.back().set(i, u(rng));
      return place.put(host.back(), keep);
    };
    auto weight = [&](DType dtype, std::vector<int64_t> shape, double scale) {
      if (!gpu) return activation(dtype, std::move(shape), -scale, scale);
      const TensorView w = place.random(dtype, shape[0] * shape[1], shape[2], rng, keep, scale);
      return TensorView(w.data(), dtype, {shape[0], shape[1], shape[2]}, w.device());
    };
    const TensorView q = activation(DType::kBF16, {B, S, Hq, D}, -1, 1);
    const TensorView k = activation(DType::kBF16, {B, S, Hkv, D}, -1, 1);
    const TensorView v = activation(DType::kBF16, {B, S, Hkv, D}, -1, 1);
    const TensorView dy = activation(DType::kBF16, {T, hidden}, -1, 1);
    // Router logits: uniform in [-1, 1) plus log of each expert's share of a Dirichlet draw (one
    // expert's share zero: -inf is not a logit, so its floor is log(1 / T)).
    const std::vector<int64_t> shares = dirichlet_splits(G, T, rng);
    host.emplace_back(DType::kFP32, std::vector<int64_t>{T, G});
    {
      std::uniform_real_distribution<double> u(-1, 1);
      for (int64_t n = 0; n < T; ++n)
        for (int64_t e = 0; e < G; ++e)
          host.back().set(n * G + e, u(rng) + std::log(double(std::max<int64_t>(shares[size_t(e)], 1)) / double(T)));
    }
    const TensorView logits = place.put(host.back(), keep);
    const TensorView w1 = weight(DType::kBF16, {G, 2 * F, hidden}, 2.0 / std::sqrt(double(hidden)));
    const TensorView w2 = weight(DType::kBF16, {G, hidden, F}, 1.0 / std::sqrt(double(F)));
    keep.push_back(Tensor::empty(DType::kFP32, {G, 2 * F, hidden}, place.device, default_allocator(), {}));
    const TensorView mg1 = keep.back().view();
    keep.push_back(Tensor::empty(DType::kFP32, {G, hidden, F}, place.device, default_allocator(), {}));
    const TensorView mg2 = keep.back().view();

    MoELayerOptions mo;
    mo.router.num_experts = G;
    mo.router.top_k = K;
    mo.router.score = RouterScore::kSoftmax;
    mo.router.normalize = true;
    mo.mlp.num_groups = G;
    mo.mlp.in_features = mo.mlp.out_features = hidden;
    mo.mlp.ffn_features = F;
    mo.mlp.dtype = DType::kBF16;
    mo.mlp.fuse_wgrad_accumulation = true;
    GroupedMLPParams mp;
    mp.fc1.weight = GroupedParam::packed(w1);
    mp.fc2.weight = GroupedParam::packed(w2);
    mp.fc1.main_grad = GroupedParam::packed(mg1);
    mp.fc2.main_grad = GroupedParam::packed(mg2);
    MoELayer moe(mo, mp);
    AttentionOptions ao;
    ao.deterministic = true;

    struct StepOut {
      Tensor o, lse, experts, probs, counts, score_sum, fc1_out, y, dx, dlogits, dq, dk, dv;
      std::string backward_error;  // the attention backward's Error (dq, dk, dv undefined)
    };
    // One step; 5 marks on `tl`: before and after attention fwd, MoE fwd, MoE bwd, attention bwd.
    auto step = [&](Timeline& tl) {
      StepOut r;
      tl.mark();
      AttentionForward af = block_sparse_attention_forward(q, k, v, *mask, ao);
      r.o = af.o, r.lse = af.lse;
      tl.mark();
      const TensorView x(r.o.view().data(), DType::kBF16, {T, hidden}, place.device);
      MoEForward mf = moe.forward(x, logits);
      r.y = mf.out, r.fc1_out = mf.fc1_out;
      r.experts = mf.route.experts, r.probs = mf.route.probs, r.counts = mf.route.counts;
      r.score_sum = mf.route.score_sum;
      tl.mark();
      MoEGrads mg = moe.backward(x, logits, mf, dy);
      r.dx = mg.grad_input, r.dlogits = mg.dlogits;
      tl.mark();
      const TensorView dout(r.dx.view().data(), DType::kBF16, {B, S, Hq, D}, place.device);
      try {
        AttentionGrads ag = block_sparse_attention_backward(q, k, v, r.o.view(), r.lse.view(), dout, *mask, ao);
        r.dq = ag.dq, r.dk = ag.dk, r.dv = ag.dv;
      } catch (const std::exception& e) {
        r.backward_error = e.what();
      }
      tl.mark();
      return r;
    };

    // The two checked steps (main_grads zeroed before each), everything copied back.
    using Snapshot = std::vector<std::pair<std::string, HostTensor>>;
    Snapshot runs[2];
    std::string backward_error;
    double part_ms[4] = {0, 0, 0, 0};
    for (int run = 0; run < 2; ++run) {
      place.zero(mg1);
      place.zero(mg2);
      Timeline tl(place, 5);
      const StepOut r = step(tl);
      place.sync();
      for (size_t p = 0; p < 4; ++p) part_ms[p] = tl.ms(p, p + 1);
      Snapshot& s = runs[run];
      for (const auto& [name, t] :
           {std::pair{"o", &r.o}, std::pair{"lse", &r.lse}, std::pair{"experts", &r.experts},
            std::pair{"probs", &r.probs}, std::pair{"counts", &r.counts}, std::pair{"score_sum", &r.score_sum},
            std::pair{"fc1_out", &r.fc1_out}, std::pair{"out", &r.y}, std::pair{"moe dx", &r.dx},
            std::pair{"dlogits", &r.dlogits}})
        s.emplace_back(name, place.get(t->view()));
      s.emplace_back("fc1 main_grad", place.get(mg1));
      s.emplace_back("fc2 main_grad", place.get(mg2));
      if (r.backward_error.empty())
        for (const auto& [name, t] : {std::pair{"dq", &r.dq}, std::pair{"dk", &r.dk}, std::pair{"dv", &r.dv}})
          s.emplace_back(name, place.get(t->view()));
      else if (backward_error.empty())
        backward_error = r.backward_error;
    }
    verdict(backward_error.empty(), "attention backward ran (deterministic)" +
                                        (backward_error.empty() ? std::string() : ": " + backward_error));
    for (const auto& [name, t] : runs[0]) {
      if (name != "counts") continue;
      std::string loads;
      for (int64_t e = 0; e < t.numel(); ++e) loads += (e ? " " : "") + std::to_string(int64_t(t.get(e)));
      std::printf("            routed rows per expert: %s (%lld tokens x top-%lld)\n", loads.c_str(), (long long)T,
                  (long long)K);
    }

    // Every output and gradient finite and not all zero (two runs of NaN would agree bit for bit).
    std::string unhealthy;
    for (const auto& [name, t] : runs[0]) {
      int64_t nonfinite = 0, nonzero = 0;
      for (int64_t i = 0; i < t.numel(); ++i) {
        const double x = name == "lse" ? std::exp(std::min(t.get(i), 0.0)) : t.get(i);  // lse may be -inf
        nonfinite += std::isfinite(x) ? 0 : 1;
        nonzero += x != 0 ? 1 : 0;
      }
      if (nonfinite || !nonzero)
        unhealthy += " " + name + (nonfinite ? " (" + std::to_string(nonfinite) + " non-finite)" : " (all zero)");
    }
    verdict(unhealthy.empty(), std::to_string(runs[0].size()) + " outputs and gradients finite and not all zero" +
                                   (unhealthy.empty() ? std::string() : ": NOT" + unhealthy));

    // Run 1 == run 2, bit for bit.
    std::string names, differ;
    const bool same = runs[0].size() == runs[1].size();
    for (size_t i = 0; same && i < runs[0].size(); ++i) {
      const HostTensor &a = runs[0][i].second, &b = runs[1][i].second;
      names += (i ? ", " : "") + runs[0][i].first;
      if (a.bytes_equal(b)) continue;
      int64_t n = 0;
      const size_t es = dtype_size(a.dtype());
      for (int64_t e = 0; e < a.numel() && a.numel() == b.numel(); ++e)
        n += std::memcmp(static_cast<const char*>(a.data()) + size_t(e) * es,
                         static_cast<const char*>(b.data()) + size_t(e) * es, es) != 0;
      differ += " " + runs[0][i].first + " (" + std::to_string(n) + " of " + std::to_string(a.numel()) + " elements)";
    }
    verdict(same && differ.empty() && backward_error.empty(),
            "run 1 == run 2 bit for bit: " + names +
                (backward_error.empty() ? std::string() : "; dq, dk, dv NOT CHECKED (the attention backward failed)") +
                (differ.empty() ? std::string() : "; DIFFER:" + differ));

    // Time and TFLOP/s of each part.
    std::vector<double> med(4);
    if (gpu && sh.timed_steps > 0) {
      Timeline tl(place, 5 * size_t(sh.timed_steps));
      for (int i = 0; i < sh.timed_steps; ++i) step(tl);
      place.sync();
      for (size_t p = 0; p < 4; ++p) {
        std::vector<double> t;
        for (size_t i = 0; i < size_t(sh.timed_steps); ++i) t.push_back(tl.ms(5 * i + p, 5 * i + p + 1));
        std::nth_element(t.begin(), t.begin() + std::ptrdiff_t(t.size() / 2), t.end());
        med[p] = t[t.size() / 2];
      }
    } else {
      med.assign(part_ms, part_ms + 4);
    }
    const double mlp_fwd = 2.0 * double(T * K) * (double(hidden) * double(2 * F) + double(F) * double(hidden));
    const double flops[4] = {4.0 * double(D) * double(pairs), mlp_fwd, 2 * mlp_fwd, 10.0 * double(D) * double(pairs)};
    const char* part_names[4] = {"attention fwd", "MoE fwd", "MoE bwd", "attention bwd"};
    const std::string how = gpu ? "median of " + std::to_string(sh.timed_steps) +
                                      " steps after the 2 checked ones (CUDA events)"
                                : std::string("the second checked step, host clock (the CPU reference: not a "
                                              "performance number)");
    std::printf("            time: %s; attention FLOPs over the allowed pairs only (fwd 4*D*pairs, bwd "
                "10*D*pairs), MoE over the experts' GEMMs on the T x top_k routed rows (bwd: dgrad + wgrad)\n",
                how.c_str());
    std::printf("            %-14s %12s %12s %10s\n", "part", "GFLOP", "time (ms)", "TFLOP/s");
    double total_ms = 0, total_flops = 0;
    for (size_t p = 0; p < 4; ++p) {
      const bool failed = p == 3 && !backward_error.empty();
      if (failed) {
        std::printf("            %-14s %12.2f %12s %10s\n", part_names[p], flops[p] * 1e-9, "failed", "-");
        continue;
      }
      total_ms += med[p], total_flops += flops[p];
      std::printf("            %-14s %12.2f %12.3f %10.*f\n", part_names[p], flops[p] * 1e-9, med[p], gpu ? 1 : 4,
                  flops[p] / (med[p] * 1e-3) * 1e-12);
    }
    std::printf("            %-14s %12.2f %12.3f %10.*f%s\n", "step", total_flops * 1e-9, total_ms, gpu ? 1 : 4,
                total_flops / (total_ms * 1e-3) * 1e-12, backward_error.empty() ? "" : " (without attention bwd)");
  } catch (const std::exception& e) {
    verdict(false, std::string("the block step failed: ") + e.what());
  }
  std::printf("  block     %s\n", pass ? "PASS" : "FAIL");
  return pass;
}

}  // namespace

int run_demo(int argc, char** argv) {
  // Line-buffered stdout: through a pipe (a log, tee, CI) C's stdout is fully buffered by default,
  // and the report, which takes seconds to minutes on the CPU reference, would arrive all at once
  // at exit; a reader should see each line as it is printed. Set before anything is written.
  std::setvbuf(stdout, nullptr, _IOLBF, BUFSIZ);
  DemoOptions o;
  int exit_code = 0;
  if (!parse(argc, argv, o, exit_code)) return exit_code;
  using testing::HostTensor;
  std::mt19937_64 rng(o.seed);
  const int64_t G = o.groups, T = o.tokens, S = T - o.padding;
  const std::vector<int64_t> splits = dirichlet_splits(G, S, rng);

  HostTensor x(o.dtype, {T, o.in}), w(o.dtype, {G, o.out, o.in}), dy(o.dtype, {T, o.out});
  x.fill_random(rng);
  w.fill_random(rng, 1.0 / std::sqrt(double(o.in)));
  dy.fill_random(rng);

  GroupedLinearOptions opts;
  opts.num_groups = G;
  opts.in_features = o.in;
  opts.out_features = o.out;
  opts.dtype = o.dtype;
  Place place;
  if (cuda_device_count() > 0 && !o.cpu) place.device = Device::cuda(0);
  std::vector<Tensor> keep;
  const TensorView xv = place.put(x, keep), wv = place.put(w, keep), dyv = place.put(dy, keep);
  GroupedLinearParams params;
  params.weight = GroupedParam::packed(wv);
  GroupedLinear layer(opts, params);

  std::printf("sparsetrain demo: MoE GroupedLinear and GroupedMLP training steps, block-sparse attention, and one "
              "MoE transformer block training step\n");
  std::printf("  backend   %s (%s)\n", layer.device().str().c_str(),
              place.gpu() ? best_backend_description().c_str() : "CPU reference backend");
  std::printf("  shapes    G=%lld experts, x [%lld, %lld] (%lld routed rows + %lld padding), W [%lld, %lld, %lld], %s\n",
              (long long)G, (long long)T, (long long)o.in, (long long)S, (long long)o.padding, (long long)G,
              (long long)o.out, (long long)o.in, dtype_name(o.dtype));
  std::printf("  splits    [");
  for (int64_t g = 0; g < G && g < 16; ++g) std::printf("%s%lld", g ? ", " : "", (long long)splits[size_t(g)]);
  std::printf("%s]\n", G > 16 ? ", ..." : "");

  const Splits sp = Splits::host(splits);
  const int reps = place.gpu() ? 20 : 1;
  Tensor y;
  GroupedLinearGrads grads;
  const double t_fwd = time_call(place, reps, [&] { y = layer.forward(xv, sp); });
  const double t_bwd = time_call(place, reps, [&] { grads = layer.backward(xv, dyv, sp); });

  testing::GroupedLinearOracle oracle{G, T, o.in, o.out, splits, x.to_double(), dy.to_double(), {}, {}};
  for (int64_t g = 0; g < G; ++g) {
    const HostTensor wg = HostTensor::copy_of(w.view().select(g));
    oracle.w.push_back(wg.to_double());
  }
  bool pass = true;
  auto report = [&](const char* name, const testing::CompareResult& r) {
    std::printf("  %-6s    normwise relative error %.2e, worst error / tolerance %.3f  %s\n", name,
                r.max_rel_error, r.worst_tol_ratio, r.ok ? "ok" : "MISMATCH");
    if (!r.ok) std::printf("            %s\n", r.first_failure.c_str());
    pass = pass && r.ok;
  };
  const double flops = 2.0 * double(S) * double(o.in) * double(o.out);
  std::printf("  time      forward %.3f ms (%.1f GFLOP/s), backward %.3f ms (%.1f GFLOP/s)%s\n", t_fwd * 1e3,
              flops / t_fwd * 1e-9, t_bwd * 1e3, 2 * flops / t_bwd * 1e-9,
              place.gpu() ? " (mean of 20 after a warm-up; this small shape does not fill the GPU)" : "");
  const HostTensor yh = place.get(y.view());
  report("y", testing::compare_with_oracle(yh, oracle.forward(), o.dtype, 1, "y"));
  report("dx", testing::compare_with_oracle(place.get(grads.grad_input.view()), oracle.dgrad(), o.dtype, 1, "dx"));
  testing::CompareResult dw_all;
  for (int64_t g = 0; g < G; ++g) {
    testing::CompareResult r = testing::compare_with_oracle(place.get(grads.weight.per_group[size_t(g)].view()),
                                                            oracle.wgrad(g), o.dtype, 1, "dW[" + std::to_string(g) + "]");
    dw_all.max_rel_error = std::max(dw_all.max_rel_error, r.max_rel_error);
    dw_all.worst_tol_ratio = std::max(dw_all.worst_tol_ratio, r.worst_tol_ratio);
    if (!r.ok && dw_all.ok) dw_all.first_failure = r.first_failure;
    dw_all.ok = dw_all.ok && r.ok;
  }
  report("dW", dw_all);
  // The padded tail of library-allocated outputs is zero.
  bool tail_zero = true;
  for (int64_t i = S * o.out; i < T * o.out; ++i) tail_zero = tail_zero && yh.get(i) == 0.0;
  std::printf("  tail      rows >= %lld of y are %s\n", (long long)S, tail_zero ? "zero" : "NOT zero");
  pass = pass && tail_zero;
  // Each further part reports a failure (an Error included) as FAIL and the demo goes on.
  auto guarded = [](const char* what, auto&& fn) {
    try {
      return fn();
    } catch (const std::exception& e) {
      std::printf("  %-9s FAIL: %s\n", what, e.what());
      return false;
    }
  };
  const bool linear_pass = pass && guarded("large", [&] {
                             if (place.gpu()) report_gpu_throughput(place, rng);
                             return true;
                           });
  const bool mlp_pass = guarded("mlp", [&] { return run_mlp_step(place, o, rng); });
  const bool attention_pass = guarded("attention", [&] { return run_attention_step(place, rng); });
  const bool block_pass = guarded("block", [&] { return run_block_step(place, o); });
  pass = linear_pass && mlp_pass && attention_pass && block_pass;
  std::printf("summary   GroupedLinear %s, GroupedMLP %s, attention %s, MoE block step %s%s\n",
              linear_pass ? "PASS" : "FAIL", mlp_pass ? "PASS" : "FAIL", attention_pass ? "PASS" : "FAIL",
              block_pass ? "PASS" : "FAIL",
              place.gpu()                ? ""
              : cuda_device_count() > 0 ? " (GPU part skipped: --cpu)"
                                        : " (GPU part skipped: no GPU)");
  std::printf("%s\n", pass ? "PASS" : "FAIL");
  return pass ? 0 : 1;
}

}  // namespace sparsetrain::tools

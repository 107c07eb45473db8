// `sparsetrain demo`: an MoE-shaped GroupedLinear training step (forward, dgrad, wgrad) with
// uneven Dirichlet routing, one empty expert and a padded tail, then a GroupedMLP step (fc1 ->
// SwiGLU x probs -> fc2, main_grad accumulation) and a document-causal block-sparse attention
// (forward on the best available backend, backward on the CPU reference until the CUDA one lands),
// checked element by element against the double-precision oracles; on a GPU also the TFLOP/s of
// large MoE and attention shapes.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
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
#include "sparsetrain/runtime.h"
#include "tools/commands.h"
#if SPARSETRAIN_WITH_CUDA
#include <cuda_runtime.h>
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
    "layers), on the best available backend (the first GPU when there is one), checks every output\n"
    "against a double-precision oracle and prints a report. On a GPU it also reports the TFLOP/s\n"
    "of large MoE shapes (G=8, T=32768, 7168 -> 4096 and 7168 -> 2 x 2048 -> 7168, bf16).\n"
    "\n"
    "options:\n"
    "  --groups G       experts (default 8)\n"
    "  --tokens T       input rows, routed tokens + padding (default 2048)\n"
    "  --padding P      rows at the end that belong to no expert (default 37)\n"
    "  --in N           in_features (default 512)\n"
    "  --out N          out_features (default 1024)\n"
    "  --dtype D        bf16, fp16 or fp32 (default bf16)\n"
    "  --seed S         random seed (default 0)\n"
    "  --cpu            use the CPU reference backend even where a GPU is present\n";

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

bool parse(int argc, char** argv, DemoOptions& o, int& exit_code) {
  for (int i = 2; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--help" || a == "-h") {
      std::fputs(kDemoHelp, stdout);
      exit_code = 0;
      return false;
    }
    if (a == "--cpu") {
      o.cpu = true;
      continue;
    }
    if (i + 1 >= argc) {
      std::fprintf(stderr, "sparsetrain demo: option '%s' needs a value (try --help)\n", a.c_str());
      exit_code = 2;
      return false;
    }
    const std::string v = argv[++i];
    try {
      if (a == "--groups") o.groups = std::stoll(v);
      else if (a == "--tokens") o.tokens = std::stoll(v);
      else if (a == "--padding") o.padding = std::stoll(v);
      else if (a == "--in") o.in = std::stoll(v);
      else if (a == "--out") o.out = std::stoll(v);
      else if (a == "--seed") o.seed = std::stoull(v);
      else if (a == "--dtype") {
        if (v == "bf16") o.dtype = DType::kBF16;
        else if (v == "fp16") o.dtype = DType::kFP16;
        else if (v == "fp32") o.dtype = DType::kFP32;
        else throw std::invalid_argument(v);
      } else {
        std::fprintf(stderr, "sparsetrain demo: unknown option '%s' (try --help)\n", a.c_str());
        exit_code = 2;
        return false;
      }
    } catch (const std::exception&) {
      std::fprintf(stderr, "sparsetrain demo: bad value '%s' for %s\n", v.c_str(), a.c_str());
      exit_code = 2;
      return false;
    }
  }
  if (o.groups < 1 || o.tokens < 1 || o.in < 1 || o.out < 1 || o.padding < 0 || o.padding > o.tokens) {
    std::fprintf(stderr, "sparsetrain demo: need groups, tokens, in, out >= 1 and 0 <= padding <= tokens\n");
    exit_code = 2;
    return false;
  }
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
  // A [rows, cols] device tensor of random values (a 1 Mi-element random block repeated: for
  // timing, where a host-side fill of hundreds of MB would dominate the demo's run time).
  TensorView random(DType dtype, int64_t rows, int64_t cols, std::mt19937_64& rng, std::vector<Tensor>& keep) const {
    const int64_t shape[2] = {rows, cols};
    keep.push_back(Tensor::empty(dtype, shape, 2, device, default_allocator(), {}));
#if SPARSETRAIN_WITH_CUDA
    testing::HostTensor block(dtype, {int64_t(1) << 20});
    block.fill_random(rng);
    const size_t total = size_t(rows * cols) * dtype_size(dtype), chunk = size_t(block.numel()) * dtype_size(dtype);
    char* dst = static_cast<char*>(keep.back().view().data());
    for (size_t done = 0; done < total; done += chunk)
      check(cudaMemcpy(dst + done, block.data(), std::min(chunk, total - done), cudaMemcpyHostToDevice));
#else
    (void)rng;
#endif
    return keep.back().view();
  }
  void sync() const {
#if SPARSETRAIN_WITH_CUDA
    if (gpu()) check(cudaDeviceSynchronize());
#endif
  }
#if SPARSETRAIN_WITH_CUDA
  static void check(cudaError_t e) {
    if (e != cudaSuccess) ST_FAIL("demo: CUDA call failed: ", cudaGetErrorString(e));
  }
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

// GPU throughput on one of DESIGN.md section 9's MoE shapes (DeepSeek-like fc1: G = 8, T = 32768,
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
  const int64_t G = o.groups, T = o.tokens, S = T - o.padding, F = o.out / 8;
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

// Attention forward throughput on DESIGN.md section 9's shape (B = 2, H = 16, S = 8192, D = 128,
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

// Block-sparse attention with a document-causal mask (documents of random lengths), GQA 4:1, S
// not a multiple of the 128 block, bf16: the forward on the demo's backend (the mask built there
// too), the backward on the CPU reference (the CUDA backward comes later), each checked against
// the dense double-precision oracle; on a GPU also the forward's TFLOP/s at a large shape.
bool run_attention_step(const Place& place, std::mt19937_64& rng) {
  using testing::HostTensor;
  const int64_t B = 2, S = 700, Hq = 4, Hkv = 1, D = 128;
  HostTensor doc(DType::kInt32, {B, S});
  for (int64_t b = 0; b < B; ++b) {
    std::uniform_int_distribution<int64_t> len(60, 300);
    for (int64_t s = 0, id = 0; s < S; ++id)
      for (int64_t n = len(rng); n > 0 && s < S; --n) doc.set(b * S + s++, double(id));
  }
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
  if (place.gpu()) report_attention_throughput(place, rng);
  return pass;
}

}  // namespace

int run_demo(int argc, char** argv) {
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

  std::printf("sparsetrain demo: MoE GroupedLinear and GroupedMLP training steps\n");
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
  if (place.gpu()) report_gpu_throughput(place, rng);
  pass = run_mlp_step(place, o, rng) && pass;
  pass = run_attention_step(place, rng) && pass;
  std::printf("%s\n", pass ? "PASS" : "FAIL");
  return pass ? 0 : 1;
}

}  // namespace sparsetrain::tools

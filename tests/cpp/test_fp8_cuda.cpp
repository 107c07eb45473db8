// GPU tests of the FP8 recipe's CUDA backend (skipped, visibly, without a GPU): the quantizers'
// codes and scales (rowwise, columnwise, and both layouts from one read; plain and gathering as
// they read) bitwise the CPU reference's (the same rules run on both sides) on fresh random
// data with NaN / inf, empty and tiny experts, padded tails and odd widths, outputs poisoned
// alike; the rowwise dequantizer's values the reference's in each dtype and layout; the three
// GEMMs (where this build has them) against the reference GEMMs on the same quantized operands,
// within fp32 accumulation order and one bf16 rounding, and bitwise repeatable.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "device_tensor.h"
#include "fp8_testing.h"
#include "ops/grouped_mlp_backend.h"

namespace st = sparsetrain;
namespace be = sparsetrain::backend;
using st::testing::DeviceTensor;
using st::testing::Fp8Operand;
using st::testing::HostTensor;
using st::testing::to_host;

namespace {

be::Fp8BlockwiseBackend& cuda_fp8() { return be::fp8_blockwise_cuda_backend(); }

// A quantized operand on the GPU, poisoned as the host one (0xFF bytes) until written.
struct DeviceFp8 {
  DeviceTensor data, scale;
  explicit DeviceFp8(const Fp8Operand& like) : data(like.data), scale(like.scale) {}
  be::Fp8Tensor view() const { return {data.view(), scale.view()}; }
};

void expect_same_bytes(const HostTensor& got, const HostTensor& want, const std::string& what) {
  ASSERT_EQ(got.numel(), want.numel()) << what;
  const auto* a = static_cast<const uint8_t*>(got.data());
  const auto* b = static_cast<const uint8_t*>(want.data());
  const size_t n = size_t(got.numel()) * got.view().element_size();
  for (size_t i = 0; i < n; ++i) ASSERT_EQ(unsigned(a[i]), unsigned(b[i])) << what << ": byte " << i;
}

void expect_same(const DeviceFp8& got, const Fp8Operand& want, const std::string& what) {
  expect_same_bytes(to_host(got.data.view()), want.data, what + " codes");
  expect_same_bytes(to_host(got.scale.view()), want.scale, what + " scales");
}

struct QuantCase {
  st::DType dtype;
  std::vector<int64_t> splits;
  int64_t T, K;
};

const QuantCase kQuantCases[] = {
    {st::DType::kBF16, {3, 0, 129, 128, 1, 0, 300}, 600, 200},
    {st::DType::kFP16, {127, 0, 2}, 140, 8},
    {st::DType::kFP32, {257, 0}, 257, 1000},
    {st::DType::kBF16, {0, 0}, 9, 129},  // only a padded tail
    {st::DType::kBF16, {5, 130, 1}, 136, 40},
    {st::DType::kBF16, {1000, 0, 1, 777}, 1800, 384},  // several 128-channel tiles and many token tiles
};

HostTensor random_with_nonfinite(const QuantCase& c, uint64_t seed) {
  std::mt19937_64 rng(seed);
  HostTensor x(c.dtype, {c.T, c.K});
  x.fill_random(rng, 3.0);
  if (c.T > 4 && c.K > 3) {
    x.set(1 * c.K + 2, INFINITY);
    x.set(4 * c.K + c.K - 1, NAN);
    x.set(0, 1e30);  // a huge tile (fp32; bf16 / fp16 round it to their own inf or max)
  }
  return x;
}

TEST(Fp8Cuda, QuantizersMatchTheReferenceBitwise) {
  REQUIRE_GPU();
  for (const QuantCase& c : kQuantCases) {
    SCOPED_TRACE(std::string(st::dtype_name(c.dtype)) + " T " + std::to_string(c.T) + " K " + std::to_string(c.K));
    const HostTensor x = random_with_nonfinite(c, uint64_t(c.T * 7 + c.K));
    const std::vector<int64_t> off = st::testing::offsets_of(c.splits, c.T);
    const int64_t G = int64_t(c.splits.size());
    HostTensor off_h(st::DType::kInt64, {G + 1});
    for (int64_t g = 0; g <= G; ++g) off_h.set(g, double(off[size_t(g)]));
    const DeviceTensor xd(x), offd(off_h);
    const be::Fp8Groups groups{G, offd.view().data_as<const int64_t>()};

    const Fp8Operand row = st::testing::quantize_rowwise(x, off);
    DeviceFp8 row_d(Fp8Operand({c.T, c.K}, row.scale.numel()));
    cuda_fp8().quantize_rowwise({groups, xd.view(), row_d.view()}, st::Stream{});
    expect_same(row_d, row, "rowwise");

    const Fp8Operand col = st::testing::quantize_columnwise(x, off);
    DeviceFp8 col_d(Fp8Operand({c.K, col.data.view().size(1)}, col.scale.numel()));
    cuda_fp8().quantize_columnwise({groups, xd.view(), col_d.view()}, st::Stream{});
    expect_same(col_d, col, "columnwise");

    // Both layouts from one read (bf16 / fp16: one kernel; fp32: the two passes): the same bytes.
    DeviceFp8 both_row(Fp8Operand({c.T, c.K}, row.scale.numel()));
    DeviceFp8 both_col(Fp8Operand({c.K, col.data.view().size(1)}, col.scale.numel()));
    cuda_fp8().quantize_both({groups, xd.view(), both_row.view(), both_col.view()}, st::Stream{});
    expect_same(both_row, row, "both, rowwise");
    expect_same(both_col, col, "both, columnwise");
    if (HasFatalFailure()) return;
  }
}

// The quantizers gathering as they read (src_rows: the MoE layer's rows from its tokens), every
// kernel path (bf16 16-byte loads, fp16 and fp32 element loads, both layouts from one read):
// bitwise the reference's codes of the gathered matrix, from a source of fewer rows than the
// operand and of more, rows repeated and in any order.
TEST(Fp8Cuda, QuantizersGatherAsTheReferenceOfTheGatheredMatrix) {
  REQUIRE_GPU();
  for (const QuantCase& c : kQuantCases)
    for (const int64_t n : {c.T / 2 + 1, c.T + 5}) {
      SCOPED_TRACE(std::string(st::dtype_name(c.dtype)) + " T " + std::to_string(c.T) + " K " + std::to_string(c.K) +
                   " source rows " + std::to_string(n));
      const HostTensor x = random_with_nonfinite({c.dtype, c.splits, n, c.K}, uint64_t(n * 11 + c.K));
      std::mt19937_64 rng(uint64_t(c.T * 13 + n));
      const st::testing::GatheredRows g = st::testing::gather_random_rows(x, c.T, rng);
      const std::vector<int64_t> off = st::testing::offsets_of(c.splits, c.T);
      const int64_t G = int64_t(c.splits.size());
      HostTensor off_h(st::DType::kInt64, {G + 1});
      for (int64_t i = 0; i <= G; ++i) off_h.set(i, double(off[size_t(i)]));
      const DeviceTensor xd(x), offd(off_h), rowsd(g.rows);
      const be::Fp8Groups groups{G, offd.view().data_as<const int64_t>()};
      const Fp8Operand row = st::testing::quantize_rowwise(g.gathered, off);
      const Fp8Operand col = st::testing::quantize_columnwise(g.gathered, off);

      DeviceFp8 row_d(st::testing::rowwise_operand(x.view(), &g.rows));
      cuda_fp8().quantize_rowwise({groups, xd.view(), row_d.view(), rowsd.view()}, st::Stream{});
      expect_same(row_d, row, "rowwise");
      DeviceFp8 col_d(st::testing::columnwise_operand(x.view(), G, &g.rows));
      cuda_fp8().quantize_columnwise({groups, xd.view(), col_d.view(), rowsd.view()}, st::Stream{});
      expect_same(col_d, col, "columnwise");
      DeviceFp8 both_row(st::testing::rowwise_operand(x.view(), &g.rows));
      DeviceFp8 both_col(st::testing::columnwise_operand(x.view(), G, &g.rows));
      cuda_fp8().quantize_both({groups, xd.view(), both_row.view(), both_col.view(), rowsd.view()}, st::Stream{});
      expect_same(both_row, row, "both, rowwise");
      expect_same(both_col, col, "both, columnwise");
      if (HasFatalFailure()) return;
    }
}

// The rowwise dequantizer (fp8_saved_activations' restore) against the reference's, into fp32,
// bf16 and fp16, contiguous (bf16 / fp16: the 16-byte path where K is a multiple of 8), with a
// wider row stride and at an odd element offset with an odd stride (the element path): the same
// values, NaN where the codes are NaN, and every element it must not write (rows past the experts',
// the gaps between rows) still the poison.
TEST(Fp8Cuda, RowwiseDequantizerWritesTheReferenceValuesInEachDtypeAndLayout) {
  REQUIRE_GPU();
  for (const QuantCase& c : kQuantCases)
    for (const st::DType dt : {st::DType::kFP32, st::DType::kBF16, st::DType::kFP16})
      for (const auto& [gap, offset] : std::vector<std::pair<int64_t, int64_t>>{{0, 0}, {8, 0}, {3, 1}}) {
        SCOPED_TRACE(std::string("T ") + std::to_string(c.T) + " K " + std::to_string(c.K) + " into " +
                     st::dtype_name(dt) + ", row stride K + " + std::to_string(gap) + ", offset " +
                     std::to_string(offset));
        const HostTensor x = random_with_nonfinite({st::DType::kBF16, c.splits, c.T, c.K}, uint64_t(c.T * 5 + c.K));
        const std::vector<int64_t> off = st::testing::offsets_of(c.splits, c.T);
        const int64_t G = int64_t(c.splits.size()), ld = c.K + gap;
        const Fp8Operand q = st::testing::quantize_rowwise(x, off);
        HostTensor off_h(st::DType::kInt64, {G + 1});
        for (int64_t g = 0; g <= G; ++g) off_h.set(g, double(off[size_t(g)]));
        HostTensor want(dt, {c.T * ld + offset});
        want.poison();
        const DeviceTensor offd(off_h), qd(q.data), sd(q.scale), got_d(want);
        auto window = [&](const st::TensorView& buffer) {  // [T, K] at `offset`, rows ld apart
          const int64_t shape[2] = {c.T, c.K}, strides[2] = {ld, 1};
          return st::TensorView(buffer.byte_ptr(offset), dt, shape, strides, 2, buffer.device());
        };
        st::testing::fp8_ref().dequantize_rowwise({{G, off.data()}, q.view(), window(want.view())}, st::Stream{});
        cuda_fp8().dequantize_rowwise(
            {{G, offd.view().data_as<const int64_t>()}, {qd.view(), sd.view()}, window(got_d.view())}, st::Stream{});
        // Equal bytes, or NaN on both sides where neither is the poison (NaN's bits may differ).
        const HostTensor got = to_host(got_d.view());
        const size_t es = st::dtype_size(dt);
        auto poisoned = [&](const HostTensor& t, int64_t i) {
          const auto* b = static_cast<const uint8_t*>(t.data()) + size_t(i) * es;
          return std::all_of(b, b + es, [](uint8_t v) { return v == 0xff; });
        };
        for (int64_t i = 0; i < want.numel(); ++i) {
          if (std::memcmp(static_cast<const char*>(got.data()) + size_t(i) * es,
                          static_cast<const char*>(want.data()) + size_t(i) * es, es) == 0)
            continue;
          ASSERT_TRUE(std::isnan(got.get(i)) && std::isnan(want.get(i)) && !poisoned(got, i) && !poisoned(want, i))
              << "element " << i << " (row " << (i - offset) / ld << "): " << got.get(i) << ", want " << want.get(i);
        }
      }
}

TEST(Fp8Cuda, WeightQuantizerWritesBothCopiesAsTheReference) {
  REQUIRE_GPU();
  std::mt19937_64 rng(20261129);
  for (const st::DType dtype : {st::DType::kBF16, st::DType::kFP32})
    for (const auto& [out, in] :
         std::vector<std::pair<int64_t, int64_t>>{{128, 128}, {130, 200}, {8, 1000}, {136, 131}}) {
      SCOPED_TRACE(std::string(st::dtype_name(dtype)) + " " + std::to_string(out) + " x " + std::to_string(in));
      const int64_t G = 3;
      HostTensor w(dtype, {G, out, in});
      w.fill_random(rng, 0.05);
      w.set(1 * out * in + 5, NAN);  // expert 1, block (0, 0)
      const DeviceTensor wd(w);
      std::vector<st::testing::Fp8WeightPair> want;
      std::vector<DeviceFp8> q, qt;
      for (int64_t g = 0; g < G; ++g) {
        want.push_back(st::testing::quantize_weight(w.view().select(g)));
        q.emplace_back(want.back().w);  // poisoned copies of the host buffers' shapes
        qt.emplace_back(want.back().wt);
      }
      for (int64_t g = 0; g < G; ++g) {  // the device buffers start poisoned, not as the results
        ASSERT_EQ(cudaMemset(q[size_t(g)].data.view().data(), 0xff, size_t(out * in)), cudaSuccess);
        ASSERT_EQ(cudaMemset(qt[size_t(g)].data.view().data(), 0xff, size_t(out * in)), cudaSuccess);
        ASSERT_EQ(cudaMemset(q[size_t(g)].scale.view().data(), 0xff, size_t(want[size_t(g)].w.scale.numel()) * 4),
                  cudaSuccess);
        ASSERT_EQ(cudaMemset(qt[size_t(g)].scale.view().data(), 0xff, size_t(want[size_t(g)].wt.scale.numel()) * 4),
                  cudaSuccess);
      }
      be::Fp8WeightQuantizeParams p;
      for (int64_t g = 0; g < G; ++g) {
        p.w.push_back(wd.view().select(g));
        p.wq.push_back(q[size_t(g)].view());
        p.wtq.push_back(qt[size_t(g)].view());
      }
      cuda_fp8().quantize_weights(p, st::Stream{});
      for (int64_t g = 0; g < G; ++g) {
        expect_same(q[size_t(g)], want[size_t(g)].w, "W[" + std::to_string(g) + "]");
        expect_same(qt[size_t(g)], want[size_t(g)].wt, "W^T[" + std::to_string(g) + "]");
      }
    }
}

// GroupedMLP's FP8 forward: the SwiGLU kernel that writes fc2's rowwise codes (h' never in memory)
// against the bf16 SwiGLU kernel followed by the rowwise quantizer, bitwise; halves and
// interleaved gate / up columns (16-byte packs), an interleave of 4 (element loads), an empty
// expert and a padded tail.
TEST(Fp8Cuda, SwigluWritesFc2sCodesAsTheQuantizerWould) {
  REQUIRE_GPU();
  for (const int64_t k : {int64_t(0), int64_t(32), int64_t(4)}) {
    SCOPED_TRACE("interleave " + std::to_string(k));
    const int64_t T = 300, F = 160, G = 4;
    const std::vector<int64_t> splits = {100, 0, 1, 189};
    std::mt19937_64 rng(uint64_t(77 + k));
    HostTensor z(st::DType::kBF16, {T, 2 * F}), probs(st::DType::kFP32, {T});
    z.fill_random(rng, 2.0);
    probs.fill_random(rng, 1.0);
    const std::vector<int64_t> off = st::testing::offsets_of(splits, T);
    HostTensor off_h(st::DType::kInt64, {G + 1});
    for (int64_t g = 0; g <= G; ++g) off_h.set(g, double(off[size_t(g)]));
    const DeviceTensor zd(z), pd(probs), offd(off_h);
    const be::MLPRows rows{st::DType::kBF16, G, T, offd.view().data_as<const int64_t>()};
    be::GroupedMLPBackend& mlp = be::grouped_mlp_backend_for(st::Device::cuda(), "x");

    const DeviceTensor h(HostTensor(st::DType::kBF16, {T, F}), false);
    mlp.swiglu_forward({rows, F, k, zd.view(), pd.view(), h.view(), {}}, nullptr, st::Stream{});
    DeviceFp8 want(Fp8Operand({T, F}, st::fp8_rowwise_scale_count(T, F)));
    cuda_fp8().quantize_rowwise({{G, rows.offsets}, h.view(), want.view()}, st::Stream{});

    DeviceFp8 got(Fp8Operand({T, F}, st::fp8_rowwise_scale_count(T, F)));
    mlp.swiglu_forward({rows, F, k, zd.view(), pd.view(), {}, got.view()}, nullptr, st::Stream{});
    const int64_t S = off.back();
    const HostTensor gd = to_host(got.data.view()), wd = to_host(want.data.view());
    const auto* a = static_cast<const uint8_t*>(gd.data());
    const auto* b = static_cast<const uint8_t*>(wd.data());
    for (int64_t i = 0; i < S * F; ++i) ASSERT_EQ(unsigned(a[i]), unsigned(b[i])) << "code " << i;  // rows < S
    expect_same_bytes(to_host(got.scale.view()), to_host(want.scale.view()), "scales");
  }
}

// ---- the GEMMs -----------------------------------------------------------------------------

struct GemmCase {
  std::vector<int64_t> splits;
  int64_t T, in, out;
};

// |got - want| within bf16's rounding of the result plus the tensor cores' accumulation error:
// Hopper's FP8 MMA sums a 128-deep K block with about 14 fraction bits before the fp32 promotion
// (DeepSeek-V3's report), so an element that cancels to near zero can be off by ~2^-14 of the
// terms' magnitude (seen: 3.8e-5 on |y| <= ~3), which a bound relative to the element misses.
void expect_close(const HostTensor& got, const HostTensor& want, int64_t rows, int64_t cols, const std::string& what) {
  double scale = 0;
  for (int64_t i = 0; i < rows * cols; ++i)
    if (!std::isnan(want.get(i))) scale = std::max(scale, std::fabs(want.get(i)));
  for (int64_t i = 0; i < rows * cols; ++i) {
    const double a = got.get(i), b = want.get(i);
    ASSERT_FALSE(std::isnan(a) != std::isnan(b)) << what << ": element " << i << " got " << a << " want " << b;
    if (std::isnan(b)) continue;
    ASSERT_LE(std::fabs(a - b), std::ldexp(std::fabs(b), -7) + std::ldexp(scale, -12)) << what << ": element " << i;
  }
}

TEST(Fp8Cuda, GemmsMatchTheReferenceOnTheSameOperands) {
  REQUIRE_HOPPER();
  if (cuda_fp8().gemm_scratch_bytes(st::DType::kBF16, 1, 1, 16, 16) == 0)
    GTEST_SKIP() << "this build has no CUDA FP8 GEMMs (SPARSETRAIN_SM90_KERNELS=ALL builds them)";
  const GemmCase cases[] = {{{129, 0, 1, 150}, 300, 256, 144}, {{0, 64, 0}, 64, 16, 1024}, {{257}, 257, 128, 128}};
  for (const GemmCase& c : cases) {
    SCOPED_TRACE("T " + std::to_string(c.T) + " in " + std::to_string(c.in) + " out " + std::to_string(c.out));
    const int64_t G = int64_t(c.splits.size());
    const std::vector<int64_t> off = st::testing::offsets_of(c.splits, c.T);
    const int64_t S = off.back();
    std::mt19937_64 rng(uint64_t(c.T + c.in));
    HostTensor x(st::DType::kBF16, {c.T, c.in}), dy(st::DType::kBF16, {c.T, c.out}),
        w(st::DType::kBF16, {G, c.out, c.in});
    x.fill_random(rng, 1.0);
    dy.fill_random(rng, 1e-2);
    w.fill_random(rng, 0.05);
    HostTensor off_h(st::DType::kInt64, {G + 1});
    for (int64_t g = 0; g <= G; ++g) off_h.set(g, double(off[size_t(g)]));
    const DeviceTensor offd(off_h);
    // The operands, quantized on the host (the quantizers' equality is the test above).
    const Fp8Operand xq = st::testing::quantize_rowwise(x, off), dyq = st::testing::quantize_rowwise(dy, off);
    const Fp8Operand xc = st::testing::quantize_columnwise(x, off), dyc = st::testing::quantize_columnwise(dy, off);
    std::vector<st::testing::Fp8WeightPair> wq;
    for (int64_t g = 0; g < G; ++g) wq.push_back(st::testing::quantize_weight(w.view().select(g)));
    const DeviceFp8 xq_d(xq), dyq_d(dyq), xc_d(xc), dyc_d(dyc);
    std::vector<DeviceFp8> w_d, wt_d;
    std::vector<be::Fp8Tensor> w_host, wt_host, w_dev, wt_dev;
    for (const auto& p : wq) {
      w_d.emplace_back(p.w);
      wt_d.emplace_back(p.wt);
      w_host.push_back(p.w.view());
      wt_host.push_back(p.wt.view());
    }
    for (int64_t g = 0; g < G; ++g) w_dev.push_back(w_d[size_t(g)].view()), wt_dev.push_back(wt_d[size_t(g)].view());
    const be::GroupedProblem host_problem{st::DType::kBF16, G, c.T, c.in, c.out, off.data(), nullptr};
    const be::GroupedProblem dev_problem{st::DType::kBF16, G, c.T, c.in, c.out, offd.view().data_as<const int64_t>(),
                                         nullptr};
    HostTensor ref_scratch(st::DType::kUInt8,
                           {int64_t(st::testing::fp8_ref().gemm_scratch_bytes(st::DType::kBF16, G, c.T, c.in, c.out))});
    HostTensor dev_scratch_h(st::DType::kUInt8,
                             {int64_t(cuda_fp8().gemm_scratch_bytes(st::DType::kBF16, G, c.T, c.in, c.out))});
    const DeviceTensor dev_scratch(dev_scratch_h, false);

    auto run_rowwise = [&](bool dgrad, int64_t cols) {
      HostTensor want(st::DType::kBF16, {c.T, cols});
      want.poison();
      const HostTensor poison = want;
      if (dgrad) st::testing::fp8_ref().dgrad({host_problem, dyq.view(), wt_host, want.view(), true},
                                              ref_scratch.data(), st::Stream{});
      else st::testing::fp8_ref().fprop({host_problem, xq.view(), w_host, want.view(), true}, ref_scratch.data(),
                                        st::Stream{});
      HostTensor runs[2] = {poison, poison};
      for (HostTensor& got : runs) {
        const DeviceTensor out(poison);
        if (dgrad) cuda_fp8().dgrad({dev_problem, dyq_d.view(), wt_dev, out.view(), true}, dev_scratch.view().data(),
                                    st::Stream{});
        else cuda_fp8().fprop({dev_problem, xq_d.view(), w_dev, out.view(), true}, dev_scratch.view().data(),
                              st::Stream{});
        got = to_host(out.view());
      }
      expect_close(runs[0], want, S, cols, dgrad ? "dx" : "y");
      for (int64_t i = S * cols; i < c.T * cols; ++i) ASSERT_EQ(runs[0].get(i), 0.0) << "zero tail " << i;
      EXPECT_TRUE(runs[0].bytes_equal(runs[1])) << "bitwise repeatable";
    };
    run_rowwise(false, c.out);
    run_rowwise(true, c.in);

    for (const be::WgradTarget target : {be::WgradTarget::kWeightGrad, be::WgradTarget::kMainGradAccumulate}) {
      const bool main = target != be::WgradTarget::kWeightGrad;
      HostTensor want(main ? st::DType::kFP32 : st::DType::kBF16, {G, c.out, c.in});
      want.fill_random(rng, 1.0);
      const HostTensor before = want;
      std::vector<st::TensorView> dws;
      for (int64_t g = 0; g < G; ++g) dws.push_back(want.view().select(g));
      st::testing::fp8_ref().wgrad({host_problem, xc.view(), dyc.view(), target, dws}, ref_scratch.data(),
                                   st::Stream{});
      const DeviceTensor got_d(before);
      std::vector<st::TensorView> dws_d;
      for (int64_t g = 0; g < G; ++g) dws_d.push_back(got_d.view().select(g));
      cuda_fp8().wgrad({dev_problem, xc_d.view(), dyc_d.view(), target, dws_d}, dev_scratch.view().data(),
                       st::Stream{});
      const HostTensor got = to_host(got_d.view());
      expect_close(got, want, G * c.out, c.in, main ? "main_grad" : "dw");
    }
  }
}

}  // namespace

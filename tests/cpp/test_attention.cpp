// Block-sparse attention on the CPU reference vs the dense double-precision oracle, on odd sizes
// (S not a multiple of the block, Sq != Skv, GQA 8:1 and MQA, D = 64 and 128, B = 2), fp32 / bf16
// / fp16, strided views (BHSD tensors transposed to BSHD), every built-in mask kind and a bitmask
// mask, rows with no allowed key, compact and full-width index tensors, with and without full
// blocks; outputs come from a poisoning allocator so unwritten elements show. Masks come from a
// test-side brute-force builder (tests/support/brute_block_mask.h) and, separately, from the
// library's builders. Plus bitwise determinism and a finite-difference check of the oracle's own
// backward.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <random>

#include "attention_oracle.h"
#include "brute_block_mask.h"
#include "sparsetrain/attention.h"
#include "sparsetrain/block_mask.h"

namespace st = sparsetrain;
using st::DType;
using st::MaskKind;
using st::testing::AttentionOracle;
using st::testing::BruteBlockMask;
using st::testing::BruteMaskOptions;
using st::testing::HostTensor;

namespace {

struct Shape {
  DType dtype;
  int64_t B, Sq, Skv, Hq, Hkv, D, block_q, block_kv;
  MaskKind kind;  // kBitmask: a random predicate stored as per-partial-block bitmasks
  bool strided, compact, use_full;
  bool expect_empty_rows;
};

const char* kind_name(MaskKind k) {
  switch (k) {
    case MaskKind::kFull: return "full";
    case MaskKind::kCausal: return "causal";
    case MaskKind::kCausalBottomRight: return "causalbr";
    case MaskKind::kSlidingWindow: return "window";
    case MaskKind::kDocument: return "document";
    case MaskKind::kDocumentCausal: return "doccausal";
    case MaskKind::kPrefixLM: return "prefixlm";
    case MaskKind::kBitmask: return "bitmask";
  }
  return "?";
}

std::string shape_name(const Shape& s) {
  return std::string(kind_name(s.kind)) + "_" + st::dtype_name(s.dtype) + "_B" + std::to_string(s.B) + "_Sq" +
         std::to_string(s.Sq) + "_Skv" + std::to_string(s.Skv) + "_Hq" + std::to_string(s.Hq) + "_Hkv" +
         std::to_string(s.Hkv) + "_D" + std::to_string(s.D) + "_blk" + std::to_string(s.block_q) + "x" +
         std::to_string(s.block_kv) + (s.strided ? "_bhsd" : "_bshd") + (s.compact ? "_compact" : "_fullwidth") +
         (s.use_full ? "" : "_nofullblocks");
}

const Shape kShapes[] = {
    // dtype         B   Sq  Skv Hq Hkv  D  bq  bkv kind                          strided compact full empty
    {DType::kFP32, 2, 97, 97, 4, 4, 64, 32, 16, MaskKind::kCausal, false, true, true, false},
    {DType::kBF16, 2, 75, 131, 8, 1, 64, 32, 32, MaskKind::kCausal, true, false, true, false},  // MQA, Sq < Skv
    {DType::kFP16, 2, 131, 75, 8, 1, 64, 16, 32, MaskKind::kCausalBottomRight, false, true, true, true},
    {DType::kBF16, 2, 67, 67, 16, 2, 128, 16, 16, MaskKind::kSlidingWindow, true, true, true, false},  // GQA 8:1
    {DType::kFP32, 2, 90, 113, 6, 3, 128, 32, 16, MaskKind::kDocument, false, false, true, false},
    {DType::kFP16, 2, 101, 101, 4, 2, 64, 16, 16, MaskKind::kDocumentCausal, true, true, false, false},
    {DType::kBF16, 2, 83, 83, 4, 1, 64, 32, 16, MaskKind::kPrefixLM, false, true, true, false},
    {DType::kFP32, 2, 45, 61, 2, 1, 64, 16, 32, MaskKind::kFull, true, false, true, false},
    {DType::kBF16, 2, 70, 89, 8, 1, 64, 16, 16, MaskKind::kBitmask, true, true, true, true},  // per-head mask
    {DType::kFP32, 2, 59, 77, 4, 2, 128, 16, 32, MaskKind::kBitmask, false, false, false, true},
    {DType::kFP16, 2, 140, 50, 4, 4, 64, 16, 32, MaskKind::kSlidingWindow, false, false, true, true},
};

// A [B, S, H, D] input: contiguous, or stored as [B, H, S, D] and viewed transposed.
struct Input {
  HostTensor storage;
  st::TensorView view;
  Input(DType dt, int64_t B, int64_t S, int64_t H, int64_t D, bool strided, std::mt19937_64& rng, double scale) {
    if (!strided) {
      storage = HostTensor(dt, {B, S, H, D});
      view = storage.view();
    } else {
      storage = HostTensor(dt, {B, H, S, D});
      const int64_t shape[4] = {B, S, H, D}, strides[4] = {H * S * D, D, S * D, 1};
      view = st::TensorView(storage.data(), dt, shape, strides, 4);
    }
    storage.fill_random(rng, scale);
  }
};

// A contiguous library output as a HostTensor (any rank).
HostTensor to_host(const st::TensorView& v) {
  HostTensor h(v.dtype(), std::vector<int64_t>(v.shape(), v.shape() + v.dim()));
  std::memcpy(h.data(), v.data(), size_t(v.numel()) * v.element_size());
  return h;
}

// Cheap deterministic hash for the random bitmask predicate.
uint64_t mix(uint64_t x) {
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdULL;
  x ^= x >> 33;
  x *= 0xc4ceb9fe1a85ec53ULL;
  return x ^ (x >> 33);
}

// Random document ids: runs of 5..40 positions, per batch row.
HostTensor doc_ids(int64_t rows, int64_t S, std::mt19937_64& rng) {
  HostTensor t(DType::kInt32, {rows, S});
  for (int64_t r = 0; r < rows; ++r) {
    int64_t doc = 0, left = 0;
    for (int64_t s = 0; s < S; ++s) {
      if (left == 0) {
        left = 5 + int64_t(rng() % 36);
        ++doc;
      }
      t.set(r * S + s, double(doc));
      --left;
    }
  }
  return t;
}

// The mask of a case: its spec, the predicate over the mask's own [Bm, Hm], and the brute mask.
struct CaseMask {
  st::MaskSpec spec;
  HostTensor doc_q, doc_kv;
  int64_t Bm = 1, Hm = 1;
  st::testing::ElementPredicate pred;
  std::unique_ptr<BruteBlockMask> brute;
  std::unique_ptr<st::BlockMaskTensors> library;  // the library's builders (block_mask.h), when asked

  const st::BlockMask& mask() const { return library ? library->mask : brute->mask; }

  static bool call_predicate(void* context, int64_t b, int64_t h, int64_t q, int64_t kv) {
    return (*static_cast<const st::testing::ElementPredicate*>(context))(b, h, q, kv);
  }

  CaseMask(const Shape& s, std::mt19937_64& rng, bool use_library = false) {
    spec.kind = s.kind;
    switch (s.kind) {
      case MaskKind::kSlidingWindow:
        spec.window_left = 20;
        spec.window_right = 5;
        if (s.expect_empty_rows) {  // Sq > Skv: rows q > Skv - 1 + 7 have no key in their window
          spec.window_left = 7;
          spec.window_right = 0;
        }
        break;
      case MaskKind::kDocument:
      case MaskKind::kDocumentCausal:
        Bm = s.kind == MaskKind::kDocument ? s.B : 1;  // per-batch ids, or [1, S] broadcast
        doc_q = doc_ids(Bm, s.Sq, rng);
        doc_kv = s.Sq == s.Skv ? doc_q : doc_ids(Bm, s.Skv, rng);
        spec.doc_q = doc_q.view();
        spec.doc_kv = doc_kv.view();
        break;
      case MaskKind::kPrefixLM: spec.prefix_length = 23; break;
      default: break;
    }
    const int64_t Sq = s.Sq, Skv = s.Skv;
    if (s.kind == MaskKind::kBitmask) {
      Bm = s.B;
      Hm = s.Hq;
      const int64_t bq = s.block_q, bkv = s.block_kv;
      pred = [bq, bkv](int64_t b, int64_t h, int64_t i, int64_t j) {
        if (i % 11 == 3) return false;                                  // rows with no key
        if ((i / bq + j / bkv + b + h) % 5 == 0) return true;          // some full blocks
        if ((i / bq + 2 * (j / bkv) + h) % 4 == 1) return false;       // some skipped blocks
        return mix(uint64_t((((b * 64 + h) * 4096 + i) * 4096) + j)) % 3 != 0;
      };
    } else {
      const st::MaskSpec sp = spec;
      pred = [sp, Sq, Skv](int64_t b, int64_t, int64_t i, int64_t j) {
        return st::testing::spec_allows(sp, b, Sq, Skv, i, j);
      };
    }
    BruteMaskOptions o;
    o.block_q = s.block_q;
    o.block_kv = s.block_kv;
    o.use_full = s.use_full;
    o.compact = s.compact;
    o.extra_width = s.compact ? 1 : 0;
    o.bitmasks = s.kind == MaskKind::kBitmask;
    brute = std::make_unique<BruteBlockMask>(pred, spec, Bm, Hm, Sq, Skv, o);
    if (use_library) {
      st::BlockMaskOptions lo;
      lo.block_q = s.block_q;
      lo.block_kv = s.block_kv;
      library = std::make_unique<st::BlockMaskTensors>(
          s.kind == MaskKind::kBitmask
              ? st::build_block_mask_from_function(&CaseMask::call_predicate, &pred, Bm, Hm, Sq, Skv, lo)
              : st::build_block_mask(spec, Sq, Skv, lo));
    }
  }
  // The predicate over the attention's (b, hq).
  std::function<bool(int64_t, int64_t, int64_t, int64_t)> attention_predicate() const {
    const auto p = pred;
    const int64_t bm = Bm, hm = Hm;
    return [p, bm, hm](int64_t b, int64_t h, int64_t i, int64_t j) { return p(bm == 1 ? 0 : b, hm == 1 ? 0 : h, i, j); };
  }
};

// lse: -inf exactly where the oracle's row is empty, else within twice its bound.
st::testing::CompareResult compare_lse(const HostTensor& got, const AttentionOracle::Result& ref) {
  st::testing::CompareResult r;
  for (size_t x = 0; x < ref.lse.size(); ++x) {
    const double g = got.get(int64_t(x)), e = ref.lse[x];
    const bool ok = std::isinf(e) ? (std::isinf(g) && g < 0) : std::fabs(g - e) <= 2 * ref.lse_err[x];
    if (!ok && r.ok) r.first_failure = "lse[" + std::to_string(x) + "]: got " + std::to_string(g) + ", expected " +
                                       std::to_string(e) + " +- " + std::to_string(2 * ref.lse_err[x]);
    r.ok = r.ok && ok;
    if (std::isfinite(e)) r.worst_tol_ratio = std::max(r.worst_tol_ratio, std::fabs(g - e) / (2 * ref.lse_err[x]));
  }
  return r;
}


// Masks from the test's brute-force builder, or from the library's builders.
struct Param {
  Shape shape;
  bool library_mask;
};
std::string param_name(const Param& p) { return shape_name(p.shape) + (p.library_mask ? "_librarymask" : "_brutemask"); }
void PrintTo(const Param& p, std::ostream* os) { *os << param_name(p); }

std::vector<Param> all_params() {
  std::vector<Param> v;
  for (const Shape& s : kShapes)
    for (bool lib : {false, true}) v.push_back({s, lib});
  return v;
}

class AttentionVsOracle : public ::testing::TestWithParam<Param> {};

TEST_P(AttentionVsOracle, ForwardAndBackward) {
  const Shape s = GetParam().shape;
  std::mt19937_64 rng(std::hash<std::string>{}(shape_name(s)));
  Input q(s.dtype, s.B, s.Sq, s.Hq, s.D, s.strided, rng, 2.0);
  Input k(s.dtype, s.B, s.Skv, s.Hkv, s.D, s.strided, rng, 1.0);
  Input v(s.dtype, s.B, s.Skv, s.Hkv, s.D, s.strided, rng, 1.0);
  Input dout(s.dtype, s.B, s.Sq, s.Hq, s.D, s.strided, rng, 1.0);
  CaseMask cm(s, rng, GetParam().library_mask);
  const st::BlockMask& mask = cm.mask();

  st::testing::PoisonAllocator alloc;
  st::AttentionCall call;
  call.allocator = &alloc;
  const st::AttentionForward fwd = st::block_sparse_attention_forward(q.view, k.view, v.view, mask, {}, call);
  const st::AttentionGrads grads = st::block_sparse_attention_backward(
      q.view, k.view, v.view, fwd.o.view(), fwd.lse.view(), dout.view, mask, {}, call);
  EXPECT_GE(alloc.allocations, 5);  // o, lse, dq, dk, dv came from the call's (poisoning) allocator

  AttentionOracle oracle;
  oracle.B = s.B;
  oracle.Sq = s.Sq;
  oracle.Skv = s.Skv;
  oracle.Hq = s.Hq;
  oracle.Hkv = s.Hkv;
  oracle.D = s.D;
  oracle.scale = 1.0 / std::sqrt(double(s.D));
  oracle.dtype = s.dtype;
  oracle.q = q.view;
  oracle.k = k.view;
  oracle.v = v.view;
  oracle.dout = dout.view;
  oracle.allowed = cm.attention_predicate();
  const AttentionOracle::Result ref = oracle.run();
  ASSERT_GT(ref.allowed_pairs, 0);
  if (s.expect_empty_rows) {
    EXPECT_GT(ref.empty_rows, 0) << "the case should have query rows with no allowed key";
  } else {
    EXPECT_EQ(ref.empty_rows, 0);
  }

  const auto check = [&](const st::Tensor& t, const st::testing::Bounded& b, const char* name) {
    const auto r = st::testing::compare_bounded(to_host(t.view()), b, s.dtype, name);
    EXPECT_TRUE(r.ok) << r.first_failure << " (worst error / tolerance " << r.worst_tol_ratio << ")";
  };
  check(fwd.o, ref.o, "o");
  const auto rl = compare_lse(to_host(fwd.lse.view()), ref);
  EXPECT_TRUE(rl.ok) << rl.first_failure;
  check(grads.dq, ref.dq, "dq");
  check(grads.dk, ref.dk, "dk");
  check(grads.dv, ref.dv, "dv");

  // Bitwise determinism: a second run gives the same bytes.
  const st::AttentionForward fwd2 = st::block_sparse_attention_forward(q.view, k.view, v.view, mask);
  const st::AttentionGrads grads2 = st::block_sparse_attention_backward(
      q.view, k.view, v.view, fwd2.o.view(), fwd2.lse.view(), dout.view, mask);
  EXPECT_TRUE(st::testing::bytes_equal(fwd.o.view(), fwd2.o.view()));
  EXPECT_TRUE(st::testing::bytes_equal(fwd.lse.view(), fwd2.lse.view()));
  EXPECT_TRUE(st::testing::bytes_equal(grads.dq.view(), grads2.dq.view()));
  EXPECT_TRUE(st::testing::bytes_equal(grads.dk.view(), grads2.dk.view()));
  EXPECT_TRUE(st::testing::bytes_equal(grads.dv.view(), grads2.dv.view()));
}

INSTANTIATE_TEST_SUITE_P(Reference, AttentionVsOracle, ::testing::ValuesIn(all_params()),
                         [](const ::testing::TestParamInfo<Param>& p) { return param_name(p.param); });

// The brute-force mask describes its predicate exactly: element (i, j) is allowed by the block
// lists (+ bitmask inside partial blocks) iff the predicate says so.
TEST(BruteBlockMask, MatchesItsPredicate) {
  for (const Shape& s : kShapes) {
    std::mt19937_64 rng(7);
    CaseMask cm(s, rng);
    const BruteBlockMask& bm = *cm.brute;
    const int64_t Nk = bm.mask.num_kv_blocks(), Mq = bm.mask.num_q_blocks();
    for (int64_t b = 0; b < cm.Bm; ++b)
      for (int64_t h = 0; h < cm.Hm; ++h)
        for (int64_t m = 0; m < Mq; ++m)
          for (int64_t n = 0; n < Nk; ++n) {
            const int kind = bm.block_kind(b, h, m, n);
            for (int64_t i = m * s.block_q; i < std::min((m + 1) * s.block_q, s.Sq); ++i)
              for (int64_t j = n * s.block_kv; j < std::min((n + 1) * s.block_kv, s.Skv); ++j) {
                const bool want = cm.pred(b, h, i, j);
                if (kind == 0) {
                  ASSERT_FALSE(want) << shape_name(s);
                } else if (kind == 2) {
                  ASSERT_TRUE(want) << shape_name(s);
                }
              }
          }
  }
}

// The oracle's backward is the gradient of sum(dout * o): central differences in double.
TEST(AttentionOracle, BackwardMatchesFiniteDifferences) {
  std::mt19937_64 rng(3);
  const int64_t B = 1, Sq = 5, Skv = 7, Hq = 2, Hkv = 1, D = 3;
  HostTensor q(DType::kFP32, {B, Sq, Hq, D}), k(DType::kFP32, {B, Skv, Hkv, D}), v(DType::kFP32, {B, Skv, Hkv, D}),
      dout(DType::kFP32, {B, Sq, Hq, D});
  q.fill_random(rng);
  k.fill_random(rng);
  v.fill_random(rng);
  dout.fill_random(rng);
  AttentionOracle o;
  o.B = B;
  o.Sq = Sq;
  o.Skv = Skv;
  o.Hq = Hq;
  o.Hkv = Hkv;
  o.D = D;
  o.scale = 0.7;
  o.q = q.view();
  o.k = k.view();
  o.v = v.view();
  o.dout = dout.view();
  o.allowed = [](int64_t, int64_t h, int64_t i, int64_t j) { return i != 2 && (j <= i + 2 || h == 1); };
  const auto loss = [&]() {
    const auto r = o.run();
    double l = 0;
    for (size_t x = 0; x < r.o.value.size(); ++x) l += r.o.value[x] * dout.get(int64_t(x));
    return l;
  };
  const auto ref = o.run();
  // fp32 storage: perturb by an exactly representable step and difference in double.
  const auto check = [&](HostTensor& t, const std::vector<double>& grad, const char* name) {
    for (int64_t x = 0; x < t.numel(); ++x) {
      const double x0 = t.get(x), h = 1.0 / 1024;
      t.set(x, x0 + h);
      const double lp = loss();
      t.set(x, x0 - h);
      const double lm = loss();
      t.set(x, x0);
      EXPECT_NEAR((lp - lm) / (2 * h), grad[size_t(x)], 1e-4) << name << "[" << x << "]";
    }
  };
  check(q, ref.dq.value, "dq");
  check(k, ref.dk.value, "dk");
  check(v, ref.dv.value, "dv");
  EXPECT_EQ(ref.empty_rows, 2);  // row 2 of both heads
}

}  // namespace

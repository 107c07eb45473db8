// Bad input to block-sparse attention: each case raises sparsetrain::Error whose message names the
// argument, what was expected and what came, before anything is allocated (the outputs are the
// only thing the calls write, and they come from the call's allocator, which sees no request).
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <limits>

#include "attention_oracle.h"
#include "brute_block_mask.h"
#include "sparsetrain/attention.h"
#include "sparsetrain/error.h"

namespace st = sparsetrain;
using st::DType;
using st::testing::HostTensor;

namespace {

// B = 2, Sq = 10, Skv = 12, Hq = 4, Hkv = 2, D = 16, bf16, causal, 4 x 4 blocks (Mq = 3, Nk = 3).
struct Env {
  static constexpr int64_t B = 2, Sq = 10, Skv = 12, Hq = 4, Hkv = 2, D = 16;
  HostTensor q{DType::kBF16, {B, Sq, Hq, D}}, k{DType::kBF16, {B, Skv, Hkv, D}}, v{DType::kBF16, {B, Skv, Hkv, D}};
  HostTensor o{DType::kBF16, {B, Sq, Hq, D}}, dout{DType::kBF16, {B, Sq, Hq, D}}, lse{DType::kFP32, {B, Hq, Sq}};
  HostTensor scratch{DType::kFP32, {4096}};
  std::unique_ptr<st::testing::BruteBlockMask> brute;
  st::BlockMask mask;
  st::AttentionOptions options;
  st::testing::PoisonAllocator alloc;

  Env() {
    std::mt19937_64 rng(1);
    for (HostTensor* t : {&q, &k, &v, &o, &dout, &lse}) t->fill_random(rng);
    st::MaskSpec spec;
    spec.kind = st::MaskKind::kCausal;
    st::testing::BruteMaskOptions bo;
    bo.block_q = 4;
    bo.block_kv = 4;
    brute = std::make_unique<st::testing::BruteBlockMask>(
        [](int64_t, int64_t, int64_t i, int64_t j) { return j <= i; }, spec, 1, 1, Sq, Skv, bo);
    mask = brute->mask;
  }
  // A view of `t`'s memory with another shape / strides / dtype.
  static st::TensorView as(const HostTensor& t, std::initializer_list<int64_t> shape,
                           std::initializer_list<int64_t> strides, DType dtype) {
    return st::TensorView(t.data(), dtype, shape.begin(), strides.begin(), int(shape.size()));
  }
  st::AttentionCall call() { return {st::Stream{}, &alloc}; }
  void forward() { st::block_sparse_attention_forward(q_view, k_view, v_view, mask, options, call()); }
  void backward() {
    st::block_sparse_attention_backward(q_view, k_view, v_view, o_view, lse_view, dout_view, mask, options, call());
  }
  st::TensorView q_view = q.view(), k_view = k.view(), v_view = v.view(), o_view = o.view(),
                 lse_view = lse.view(), dout_view = dout.view();
};

struct ErrorCase {
  const char* name;
  std::function<void(Env&)> call;
  const char* message;
};

const ErrorCase kCases[] = {
    {"QRank3", [](Env& e) { e.q_view = Env::as(e.q, {2, 10, 64}, {640, 64, 1}, DType::kBF16); e.forward(); },
     "q: expected a 4-d tensor [B, Sq, Hq, D], got [2, 10, 64]"},
    {"QInt32", [](Env& e) { e.q_view = Env::as(e.q, {2, 5, 4, 16}, {320, 64, 16, 1}, DType::kInt32); e.forward(); },
     "q: expected dtype fp32, bf16 or fp16, got int32"},
    {"QLastDimStrided", [](Env& e) { e.q_view = Env::as(e.q, {2, 10, 4, 8}, {640, 64, 16, 2}, DType::kBF16); e.forward(); },
     "q: expected a unit stride in the last dimension (D) "
     "(taken: any strides with the last dimension contiguous, as in a contiguous tensor or a slice of one; a transposed tensor is not, pass q.contiguous()), got 2"},
    {"QOnCuda",
     [](Env& e) {
       const int64_t shape[4] = {2, 10, 4, 16}, strides[4] = {640, 64, 16, 1};
       e.q_view = st::TensorView(e.q.data(), DType::kBF16, shape, strides, 4, st::Device::cuda(0));
       e.forward();
     },
     // A CUDA build takes q's device and refuses the host k; a CPU-only build refuses q itself.
     SPARSETRAIN_WITH_CUDA ? "k: expected a tensor on cuda:0 (q's device), got cpu"
                           : "q: expected a tensor on cpu (this build has no CUDA backend), got cuda:0"},
    {"KDtype", [](Env& e) { e.k_view = Env::as(e.k, {2, 12, 2, 16}, {384, 32, 16, 1}, DType::kFP16); e.forward(); },
     "k: expected dtype bf16 (q's dtype), got fp16"},
    {"KHeadDim", [](Env& e) { e.k_view = Env::as(e.k, {2, 12, 2, 8}, {384, 32, 16, 1}, DType::kBF16); e.forward(); },
     "k: expected shape [2 (q's B), Skv, Hkv, 16 (q's D)], got [2, 12, 2, 8]"},
    {"KBatch", [](Env& e) { e.k_view = Env::as(e.k, {1, 12, 2, 16}, {384, 32, 16, 1}, DType::kBF16); e.forward(); },
     "k: expected shape [2 (q's B), Skv, Hkv, 16 (q's D)], got [1, 12, 2, 16]"},
    {"KNoHeads", [](Env& e) { e.k_view = Env::as(e.k, {2, 12, 0, 16}, {0, 0, 16, 0}, DType::kBF16); e.forward(); },
     "k: expected sizes >= 1 in [B, Skv, Hkv, D], got [2, 12, 0, 16]"},
    {"QNoRows", [](Env& e) { e.q_view = Env::as(e.q, {2, 0, 4, 16}, {0, 64, 16, 0}, DType::kBF16); e.forward(); },
     "q: expected sizes >= 1 in [B, Sq, Hq, D], got [2, 0, 4, 16]"},
    {"HeadsNotMultiple", [](Env& e) { e.k_view = Env::as(e.k, {2, 8, 3, 16}, {384, 48, 16, 1}, DType::kBF16); e.forward(); },
     "k: expected a head count Hkv that divides q's Hq = 4 (GQA / MQA), got 3"},
    {"VShape", [](Env& e) { e.v_view = Env::as(e.v, {2, 11, 2, 16}, {384, 32, 16, 1}, DType::kBF16); e.forward(); },
     "v: expected shape [2, 12, 2, 16] (k's shape), got [2, 11, 2, 16]"},
    {"ScaleNaN", [](Env& e) { e.options.scale = std::numeric_limits<float>::quiet_NaN(); e.forward(); },
     "options.scale: expected a finite number >= 0 (0: 1 / sqrt(D)), got nan"},
    {"ScaleNegative", [](Env& e) { e.options.scale = -0.125f; e.forward(); },
     "options.scale: expected a finite number >= 0 (0: 1 / sqrt(D)), got -0.125"},
    {"ScaleNegativeBackward", [](Env& e) { e.options.scale = -0.125f; e.backward(); },
     "options.scale: expected a finite number >= 0 (0: 1 / sqrt(D)), got -0.125"},
    {"SmLimitNegative", [](Env& e) { e.options.sm_limit = -1; e.backward(); },
     "options.sm_limit: expected a count >= 0 (0: every SM), got -1"},
    {"MaskSeqQ", [](Env& e) { e.mask.seq_q = 9; e.forward(); }, "mask.seq_q: expected 10 (q's Sq), got 9"},
    {"MaskSeqKv", [](Env& e) { e.mask.seq_kv = 16; e.forward(); }, "mask.seq_kv: expected 12 (k's Skv), got 16"},
    {"MaskMissing", [](Env& e) { e.mask.kv_num_blocks = st::TensorView(); e.forward(); },
     "mask.kv_num_blocks: expected int32 [B, H, Mq], got no tensor"},
    {"MaskNotBroadcastable",
     [](Env& e) {
       e.mask.kv_num_blocks = Env::as(e.brute->kv_num, {3, 1, 3}, {0, 3, 1}, DType::kInt32);
       e.forward();
     },
     "mask.kv_num_blocks: expected leading dims broadcastable to [B=2, H=4], got [3, 1, 3]"},
    {"MaskWrongMq", [](Env& e) { e.mask.block_q = 5; e.forward(); },
     "mask.kv_num_blocks: expected size 2 (Mq = 2) in dim 2, got 3 (shape [1, 1, 3])"},
    {"MaskIndexOutOfRange",
     [](Env& e) {
       e.brute->kv_idx.set(1 * 3 + 0, 5);  // q block 1, slot 0
       e.forward();
     },
     "mask.kv_indices[b=0, h=0, q block 1] entry 0: expected a kv block in [0, 3), got 5"},
    {"MaskCountAboveWidth",
     [](Env& e) {
       e.brute->kv_num.set(2, 4);
       e.forward();
     },
     "mask.kv_num_blocks[b=0, h=0, q block 2]: expected a count <= the width of kv_indices (3), got 4"},
    {"MaskHalfFull", [](Env& e) { e.mask.full_kv_indices = st::TensorView(); e.forward(); },
     "mask.full_kv_indices: expected a tensor (full_kv_num_blocks and full_kv_indices come together), got "
     "none"},
    {"BitmaskMissing", [](Env& e) { e.mask.spec.kind = st::MaskKind::kBitmask; e.forward(); },
     "mask.partial_bitmasks: expected uint8 bitmasks (spec.kind is bitmask), got no tensor"},
    {"DocumentIdsMissing", [](Env& e) { e.mask.spec.kind = st::MaskKind::kDocument; e.forward(); },
     "mask.spec.doc_q: expected int32 document ids [B or 1, S], got no tensor"},
    {"MaskBlockBothPartialAndFull",
     [](Env& e) {
       // q block 2 lists kv block 0 as full; make its first partial entry kv block 0 too.
       e.brute->kv_idx.set(2 * 3 + 0, 0);
       e.brute->kv_idx.set(2 * 3 + 1, 1);
       e.brute->kv_num.set(2, 2);
       e.forward();
     },
     "mask.full_kv_indices[b=0, h=0, q block 2]: expected kv blocks that are not also partial (in kv_indices), got kv "
     "block 0 in both"},
    {"BackwardNoTransposes",
     [](Env& e) {
       e.mask.q_num_blocks = st::TensorView();
       e.mask.q_indices = st::TensorView();
       e.backward();
     },
     "mask.q_indices: expected the transposes q_num_blocks / q_indices for backward (transpose_block_mask), got none"},
    {"LseDtype", [](Env& e) { e.lse_view = Env::as(e.lse, {2, 4, 10}, {40, 10, 1}, DType::kBF16); e.backward(); },
     "lse: expected dtype fp32 (the forward's log-sum-exp), got bf16"},
    {"LseShape", [](Env& e) { e.lse_view = Env::as(e.lse, {2, 10, 4}, {40, 4, 1}, DType::kFP32); e.backward(); },
     "lse: expected shape [2 (B), 4 (Hq), 10 (Sq)], got [2, 10, 4]"},
    {"DoutShape", [](Env& e) { e.dout_view = Env::as(e.dout, {2, 10, 2, 16}, {640, 64, 16, 1}, DType::kBF16); e.backward(); },
     "dout: expected shape [2 (B), 10 (Sq), 4 (Hq), 16 (D)] (q's shape), got [2, 10, 2, 16]"},
    {"ODtype", [](Env& e) { e.o_view = Env::as(e.o, {2, 10, 4, 16}, {640, 64, 16, 1}, DType::kFP16); e.backward(); },
     "o: expected dtype bf16 (q's dtype), got fp16"},
};

void PrintTo(const ErrorCase& c, std::ostream* os) { *os << c.name; }

class AttentionErrors : public ::testing::TestWithParam<ErrorCase> {};

TEST_P(AttentionErrors, RaisesAndAllocatesNothing) {
  Env e;
  std::string message;
  try {
    GetParam().call(e);
  } catch (const st::Error& err) {
    message = err.what();
    EXPECT_EQ(err.kind(), st::Error::Kind::kInvalidArgument);
  }
  EXPECT_EQ(message, GetParam().message);
  EXPECT_EQ(e.alloc.allocations, 0) << "nothing may be allocated before validation passes";
}

INSTANTIATE_TEST_SUITE_P(Reference, AttentionErrors, ::testing::ValuesIn(kCases),
                         [](const ::testing::TestParamInfo<ErrorCase>& p) { return std::string(p.param.name); });

// The same environment without a fault runs (the cases above fail for their one reason).
TEST(AttentionErrors, ValidEnvironmentRuns) {
  Env e;
  e.forward();
  e.backward();
  EXPECT_EQ(e.alloc.allocations, 7);  // forward: o, lse, scratch; backward: dq, dk, dv, scratch
}

#if SPARSETRAIN_WITH_CUDA
// What the CUDA backend refuses is decided on the host before any device work, so views tagged
// cuda:0 over host memory reach every rule without a GPU (the checks never touch the memory).
TEST(AttentionErrors, CudaBackendRulesNeedNoDevice) {
  const st::Device gpu = st::Device::cuda(0);
  const int64_t S = 256, H = 2;
  std::vector<HostTensor> keep;
  auto tensor = [&](DType dt, int64_t D) {
    keep.emplace_back(dt, std::vector<int64_t>{1, S, H, D});
    const int64_t shape[4] = {1, S, H, D}, strides[4] = {S * H * D, H * D, D, 1};
    return st::TensorView(keep.back().data(), dt, shape, strides, 4, gpu);
  };
  keep.reserve(16);
  // A mask whose tensors are tagged cuda:0 too (structure checks only on a device mask).
  auto device_mask = [&](const st::BlockMask& host) {
    st::BlockMask m = host;
    for (st::TensorView* t : {&m.kv_num_blocks, &m.kv_indices, &m.full_kv_num_blocks, &m.full_kv_indices,
                              &m.q_num_blocks, &m.q_indices, &m.full_q_num_blocks, &m.full_q_indices,
                              &m.dq_write_order, &m.dq_write_order_full, &m.partial_bitmasks})
      if (t->defined()) *t = st::TensorView(t->data(), t->dtype(), t->shape(), t->strides(), t->dim(), gpu);
    return m;
  };
  st::MaskSpec causal;
  causal.kind = st::MaskKind::kCausal;
  const st::BlockMaskTensors m128 = st::build_block_mask(causal, S, S);
  st::BlockMaskOptions small;
  small.block_q = small.block_kv = 64;
  const st::BlockMaskTensors m64 = st::build_block_mask(causal, S, S, small);
  auto every = [](void*, int64_t, int64_t, int64_t q, int64_t kv) { return (q + kv) % 3 != 0; };
  const st::BlockMaskTensors bits = st::build_block_mask_from_function(every, nullptr, 1, 1, S, S);
  st::BlockMask odd_bits = device_mask(bits.mask);
  // A bitmask view one byte in: the kernel reads 32-bit words.
  const st::TensorView& b = odd_bits.partial_bitmasks;
  odd_bits.partial_bitmasks = st::TensorView(static_cast<uint8_t*>(b.data()) + 1, b.dtype(), b.shape(), b.strides(),
                                             b.dim(), gpu);
  const st::TensorView q = tensor(DType::kBF16, 128), k = tensor(DType::kBF16, 128);
  const st::TensorView q32 = tensor(DType::kFP32, 128), q80 = tensor(DType::kBF16, 80), k80 = tensor(DType::kBF16, 80);
  struct Case {
    const char* what;
    std::function<void(st::AttentionCall&)> run;
    const char* message;
  };
  const Case cases[] = {
      {"fp32", [&](auto& c) { st::block_sparse_attention_forward(q32, q32, q32, device_mask(m128.mask), {}, c); },
       "q: expected dtype bf16 or fp16 on CUDA, got fp32"},
      {"D=80", [&](auto& c) { st::block_sparse_attention_forward(q80, k80, k80, device_mask(m128.mask), {}, c); },
       "q: expected a head dim with a CUDA kernel in this build"},
      {"host mask", [&](auto& c) { st::block_sparse_attention_forward(q, k, k, m128.mask, {}, c); },
       "mask.kv_num_blocks: expected a tensor on cuda:0 (q's device), got cpu"},
      {"64x64 blocks", [&](auto& c) { st::block_sparse_attention_forward(q, k, k, device_mask(m64.mask), {}, c); },
       "mask.block_q: expected a multiple of the CUDA kernel's q tile (128), got 64"},
      {"unaligned bitmasks", [&](auto& c) { st::block_sparse_attention_forward(q, k, k, odd_bits, {}, c); },
       "mask.partial_bitmasks: expected a contiguous last dim, a 4-byte aligned base"},
      {"backward without a write order", [&](auto& c) {
         HostTensor lse(DType::kFP32, {1, H, S});
         const int64_t ls[3] = {1, H, S}, lst[3] = {H * S, S, 1};
         const st::TensorView lv(lse.data(), DType::kFP32, ls, lst, 3, gpu);
         st::BlockMask m = device_mask(m128.mask);
         m.dq_write_order = m.dq_write_order_full = st::TensorView();
         st::block_sparse_attention_backward(q, k, k, q, lv, q, m, {}, c);
       },
       "mask.dq_write_order: expected the dQ write orders for the deterministic backward"},
  };
  for (const Case& c : cases) {
    st::testing::PoisonAllocator alloc;
    st::AttentionCall call;
    call.allocator = &alloc;
    try {
      c.run(call);
      ADD_FAILURE() << c.what << ": no error";
    } catch (const st::Error& e) {
      EXPECT_EQ(std::string(e.what()).rfind(c.message, 0), 0u) << c.what << ": " << e.what();
    }
    EXPECT_EQ(alloc.allocations, 0) << c.what;
  }
}
#endif

}  // namespace

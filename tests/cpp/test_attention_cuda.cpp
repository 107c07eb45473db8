// GPU tests of the sm90 attention forward and backward (skipped, visibly, without a GPU): CUDA vs
// the double-precision oracle on fresh random inputs, for every built-in mask kind and a bitmask mask,
// S not a multiple of the tile, Sq != Skv, GQA and MQA, D = 64 and 128, bf16 and fp16, BHSD views,
// mask blocks larger than the kernel tile, rows with no allowed key, masks built on the host and
// copied over as well as built on the device, empty kv columns and compact index tensors,
// documents of lengths 1, 2, 63, 64, 65, 127, 128, 129 and 3000 mixed differently per batch row
// and Sq != Skv documents, documents given as FlashAttention's cu_seqlens (converted on the device);
// outputs are NaN-poisoned first. The forward is bitwise repeatable; the deterministic backward is
// bitwise the same over 20 runs and for any number of workers, and replays from a CUDA graph.
// Then everything the CUDA path refuses, each with its error and no allocation, and a corrupt
// device write order that must not hang the GPU.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <cstdlib>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "attention_oracle.h"
#include "device_tensor.h"
#include "ops/attention_backend.h"
#include "sparsetrain/attention.h"
#include "sparsetrain/block_mask.h"
#include "sparsetrain/cu_seqlens.h"
#include "sparsetrain/error.h"

namespace st = sparsetrain;
using st::DType;
using st::MaskKind;
using st::testing::AttentionOracle;
using st::testing::DeviceTensor;
using st::testing::HostTensor;
using st::testing::to_host;

namespace {

// Device memory from cudaMalloc, filled with 0xFF (NaN in every float type) so that an element
// the kernel does not write shows; counts what it hands out.
class DevicePoisonAllocator final : public st::Allocator {
 public:
  int allocations = 0;
  void* allocate(size_t bytes, st::Device device, st::Stream stream) override {
    void* p = st::default_allocator().allocate(bytes, device, stream);
    // On the stream the library then writes it on (a legacy-stream memset could land after).
    EXPECT_EQ(cudaMemsetAsync(p, 0xff, bytes, static_cast<cudaStream_t>(stream.handle)), cudaSuccess);
    ++allocations;
    return p;
  }
  void deallocate(void* p, size_t bytes, st::Device device, st::Stream stream) override {
    st::default_allocator().deallocate(p, bytes, device, stream);
  }
};

// A [B, S, H, D] input on the device: contiguous, or stored [B, H, S, D] and viewed transposed;
// the host copy is what the oracle reads.
struct Input {
  HostTensor host;
  DeviceTensor dev;
  st::TensorView host_view, dev_view;
  Input(DType dt, int64_t B, int64_t S, int64_t H, int64_t D, bool bhsd, std::mt19937_64& rng, double scale) {
    const int64_t shape[4] = {B, S, H, D};
    host = bhsd ? HostTensor(dt, {B, H, S, D}) : HostTensor(dt, {B, S, H, D});
    host.fill_random(rng, scale);
    dev = DeviceTensor(host);
    const int64_t bshd[4] = {S * H * D, H * D, D, 1}, transposed[4] = {H * S * D, D, S * D, 1};
    const int64_t* strides = bhsd ? transposed : bshd;
    host_view = st::TensorView(host.data(), dt, shape, strides, 4);
    dev_view = st::TensorView(dev.view().data(), dt, shape, strides, 4, st::Device::cuda(0));
  }
};

// Every tensor of a host-built mask copied to the device, and the mask viewing them.
struct DeviceMask {
  std::vector<DeviceTensor> storage;
  st::BlockMask mask;
  explicit DeviceMask(const st::BlockMask& host) : mask(host) {
    storage.reserve(16);
    auto move = [&](st::TensorView& v) {
      if (!v.defined()) return;
      storage.emplace_back(HostTensor::copy_of(v));
      v = storage.back().view();
    };
    for (st::TensorView* v : {&mask.kv_num_blocks, &mask.kv_indices, &mask.full_kv_num_blocks, &mask.full_kv_indices,
                              &mask.q_num_blocks, &mask.q_indices, &mask.full_q_num_blocks, &mask.full_q_indices,
                              &mask.dq_write_order, &mask.dq_write_order_full, &mask.partial_bitmasks,
                              &mask.spec.doc_q, &mask.spec.doc_kv, &mask.real_rows})
      move(*v);
  }
};

// The mask's index tensors (and the tensors parallel to them) cut to the largest count: compact
// views of the builders' full-width storage, which DeviceMask then copies as they are.
void narrow_to_counts(st::BlockMask& m) {
  auto largest = [](const st::TensorView& counts) {
    int64_t mx = 1;
    const HostTensor c = HostTensor::copy_of(counts);
    for (int64_t x = 0; x < c.numel(); ++x) mx = std::max<int64_t>(mx, int64_t(c.get(x)));
    return mx;
  };
  auto narrow = [](st::TensorView& t, int64_t width) {
    if (!t.defined()) return;
    std::vector<int64_t> shape(t.shape(), t.shape() + t.dim());
    shape[3] = std::min(shape[3], width);
    t = st::TensorView(t.data(), t.dtype(), shape.data(), t.strides(), t.dim(), t.device());
  };
  const int64_t wkv = largest(m.kv_num_blocks), wq = largest(m.q_num_blocks);
  narrow(m.kv_indices, wkv);
  narrow(m.partial_bitmasks, wkv);
  narrow(m.q_indices, wq);
  narrow(m.dq_write_order, wq);
  if (m.full_kv_num_blocks.defined()) narrow(m.full_kv_indices, largest(m.full_kv_num_blocks));
  if (m.full_q_num_blocks.defined()) {
    const int64_t wf = largest(m.full_q_num_blocks);
    narrow(m.full_q_indices, wf);
    narrow(m.dq_write_order_full, wf);
  }
}

struct Case {
  std::string name;
  DType dtype;
  int64_t B, Sq, Skv, Hq, Hkv, D, block_q, block_kv;
  MaskKind kind;
  bool bhsd = false, device_build = false, expect_empty_rows = false;
  int64_t left = -1, right = -1, prefix = 0;
  bool empty_column = false, compact = false;
  // Document kinds: lengths of the documents of batch row 0, cycled to fill the sequence; row b
  // takes them rotated by b (different per row). Empty: random lengths 2..301. doc_kv_lengths
  // (Sq != Skv, or other key documents): the key side's, else the query side's.
  std::vector<int64_t> doc_q_lengths = {}, doc_kv_lengths = {};
  // Document kinds: the last positions of both sides in no document (query and key padding with
  // ids that match nothing): whole q tiles without a key, which the forward's scheduler sorts last.
  int64_t padded_tail = 0;
  // Document kinds with lengths: one row of ids ([1, S]) broadcast over the batch.
  bool broadcast_docs = false;
};

void PrintTo(const Case& c, std::ostream* os) { *os << c.name; }

// A document case with given document lengths (1, 2, 63, 64, 65, 127, 128, 129,
// 3000 mixed, different per batch row; Sq != Skv documents).
Case documents_case(std::string name, DType dtype, int64_t B, int64_t Sq, int64_t Skv, int64_t Hq, int64_t Hkv,
                    int64_t D, MaskKind kind, std::vector<int64_t> q_lengths, std::vector<int64_t> kv_lengths = {},
                    bool device_build = false, bool bhsd = false) {
  Case c{std::move(name), dtype, B, Sq, Skv, Hq, Hkv, D, 128, 128, kind, bhsd, device_build};
  c.doc_q_lengths = std::move(q_lengths);
  c.doc_kv_lengths = std::move(kv_lengths);
  return c;
}

std::vector<Case> cases() {
  using K = MaskKind;
  std::vector<Case> v = {
      {"causal_bf16_S1000_D128", DType::kBF16, 1, 1000, 1000, 2, 2, 128, 128, 128, K::kCausal},
      {"causal_fp16_S1000_D64_mqa_bhsd", DType::kFP16, 1, 1000, 1000, 4, 1, 64, 128, 128, K::kCausal, true},
      {"causalbr_bf16_Sq300_Skv517", DType::kBF16, 2, 300, 517, 2, 1, 128, 128, 128, K::kCausalBottomRight},
      {"causal_bf16_Sq517_Skv300_emptyfree", DType::kBF16, 1, 517, 300, 2, 2, 64, 128, 128, K::kCausal},
      {"window_bf16_S777_gqa_blk256", DType::kBF16, 1, 777, 777, 8, 2, 128, 256, 256, K::kSlidingWindow, false, false,
       false, 200, 0},
      {"window_fp16_bothsides_D64_device", DType::kFP16, 2, 650, 650, 2, 2, 64, 128, 128, K::kSlidingWindow, false,
       true, false, 100, 60},
      {"doccausal_bf16_S1031_B2", DType::kBF16, 2, 1031, 1031, 2, 1, 128, 128, 128, K::kDocumentCausal},
      {"doccausal_bf16_S1031_B2_device_bhsd", DType::kBF16, 2, 1031, 1031, 2, 2, 128, 128, 128, K::kDocumentCausal,
       true, true},
      {"document_fp16_Sq611", DType::kFP16, 2, 611, 611, 2, 2, 64, 128, 256, K::kDocument},
      {"prefixlm_bf16_S800", DType::kBF16, 1, 800, 800, 2, 2, 128, 128, 128, K::kPrefixLM, false, false, false, -1,
       -1, 300},
      {"full_bf16_Sq45_Skv300", DType::kBF16, 1, 45, 300, 2, 1, 128, 128, 128, K::kFull},
      {"causal_bf16_S700_D96_gqa", DType::kBF16, 1, 700, 700, 4, 2, 96, 128, 128, K::kCausal},
      {"doccausal_fp16_S611_D96_bhsd", DType::kFP16, 2, 611, 611, 2, 1, 96, 128, 128, K::kDocumentCausal, true},
      {"bitmask_bf16_S700_emptyrows", DType::kBF16, 1, 700, 533, 4, 2, 128, 128, 128, K::kBitmask, true, false, true},
      {"bitmask_fp16_D64_blk256x128", DType::kFP16, 2, 389, 389, 2, 1, 64, 256, 128, K::kBitmask, false, false, true},
      {"bitmask_bf16_S641_emptycol_compact", DType::kBF16, 1, 641, 641, 4, 1, 128, 128, 128, K::kBitmask, false,
       false, true, -1, -1, 0, true, true},
      {"causal_bf16_S1000_blk128x256_compact", DType::kBF16, 2, 1000, 1000, 2, 2, 128, 128, 256, K::kCausal, false,
       false, false, -1, -1, 0, false, true},
  };
  // Documents around the tile size and one of 3000 (most of a row: its diagonal tiles and long
  // columns), mixed and rotated per batch row; the oracle's cost grows with the allowed pairs, so
  // the 3000 is in the causal case only.
  const std::vector<int64_t> around_tiles = {1, 2, 63, 64, 65, 127, 128, 129};
  std::vector<int64_t> with_3000 = around_tiles;
  with_3000.insert(with_3000.begin() + 4, 3000);
  v.push_back(documents_case("doccausal_bf16_lens1to3000_B2_S3700", DType::kBF16, 2, 3700, 3700, 2, 1, 128,
                             K::kDocumentCausal, with_3000));
  // A padded tail of 300 positions: 2 whole q tiles with no key per (batch, head), so a CTA's
  // walk ends with empty items after real ones (their o = 0, lse = -inf must not take the place
  // of the last real item's epilogue).
  Case padded = documents_case("doccausal_bf16_lens_padded300_B2_S1700_h8", DType::kBF16, 2, 1700, 1700, 8, 2, 128,
                               K::kDocumentCausal, around_tiles);
  padded.padded_tail = 300;
  padded.expect_empty_rows = true;
  v.push_back(padded);
  v.push_back(documents_case("doccausal_fp16_lens1to129_B3_S1500_D64_device_bhsd", DType::kFP16, 3, 1500, 1500, 4, 2,
                             64, K::kDocumentCausal, around_tiles, {}, true, true));
  // Sq != Skv documents: other key lengths, so the k-th query document meets the k-th key one.
  const std::vector<int64_t> keys = {129, 65, 1, 128, 2, 127, 63, 64};
  v.push_back(documents_case("document_bf16_Sq1000_Skv1300_lens", DType::kBF16, 2, 1000, 1300, 2, 2, 128,
                             K::kDocument, around_tiles, keys));
  v.push_back(documents_case("doccausal_bf16_Sq1300_Skv1000_lens_gqa_device", DType::kBF16, 2, 1300, 1000, 4, 2, 128,
                             K::kDocumentCausal, around_tiles, keys, true));
  return v;
}

HostTensor document_ids(int64_t B, int64_t S, std::mt19937_64& rng) {
  HostTensor t(DType::kInt32, {B, S});
  for (int64_t b = 0; b < B; ++b)
    for (int64_t s = 0, doc = 0, left = 0; s < S; ++s) {
      if (left-- == 0) left = 1 + int64_t(rng() % 300), ++doc;  // documents of 2..301 positions
      t.set(b * S + s, double(doc));
    }
  return t;
}

// Document ids [B, S] from lengths cycled to fill each row, row b starting at length b (mod the
// count): every row a different mix.
// pad: the id of the last `padded` positions (distinct per side, so padding meets nothing).
HostTensor document_ids(int64_t B, int64_t S, const std::vector<int64_t>& lengths, int64_t padded = 0,
                        int32_t pad = -1) {
  HostTensor t(DType::kInt32, {B, S});
  const size_t n = lengths.size();
  for (int64_t b = 0; b < B; ++b)
    for (int64_t s = 0, doc = 0, k = b, left = lengths[size_t(b) % n]; s < S; ++s) {
      while (left == 0) left = lengths[size_t(++k) % n], ++doc;
      t.set(b * S + s, s < S - padded ? double(doc) : double(pad));
      --left;
    }
  return t;
}

uint64_t mix(uint64_t x) {
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdULL;
  x ^= x >> 33;
  return x ^ (x >> 29);
}

// The bitmask cases' predicate: random pairs (one in three allowed), per (b, h); query rows
// 0 mod 7 allow nothing (empty rows); kv rows past a diagonal band are cut so whole blocks skip.
struct RandomMask {
  uint64_t seed;
  bool empty_column = false;  // keys 256..383 allowed to nobody: a kv column with no q block
  bool operator()(int64_t b, int64_t h, int64_t q, int64_t kv) const {
    if (q % 7 == 0) return false;
    if (empty_column && kv >= 256 && kv < 384) return false;
    if (kv > q + 200) return false;
    return mix(seed ^ uint64_t(b) << 48 ^ uint64_t(h) << 40 ^ uint64_t(q) << 20 ^ uint64_t(kv)) % 3 == 0;
  }
  static bool call(void* ctx, int64_t b, int64_t h, int64_t q, int64_t kv) {
    return (*static_cast<RandomMask*>(ctx))(b, h, q, kv);
  }
};

// A case's inputs and mask: q, k, v (and dout) on the device, the mask built on the host and
// copied over or built on the device, and the element predicate the oracle reads.
struct Prepared {
  std::mt19937_64 rng;
  std::unique_ptr<Input> q, k, v, dout;
  HostTensor doc, doc_kv;
  DeviceTensor ddoc, ddoc_kv;
  RandomMask random{};
  std::function<bool(int64_t, int64_t, int64_t, int64_t)> allowed;
  std::unique_ptr<st::BlockMaskTensors> host_mask;
  std::unique_ptr<DeviceMask> copied;
  st::BlockMaskTensors device_built;
  st::BlockMask mask;

  explicit Prepared(const Case& c) : rng(std::hash<std::string>{}(c.name)) {
    q = std::make_unique<Input>(c.dtype, c.B, c.Sq, c.Hq, c.D, c.bhsd, rng, 2.0);
    k = std::make_unique<Input>(c.dtype, c.B, c.Skv, c.Hkv, c.D, c.bhsd, rng, 1.0);
    v = std::make_unique<Input>(c.dtype, c.B, c.Skv, c.Hkv, c.D, c.bhsd, rng, 1.0);
    dout = std::make_unique<Input>(c.dtype, c.B, c.Sq, c.Hq, c.D, c.bhsd, rng, 1.0);
    st::MaskSpec spec;
    spec.kind = c.kind;
    spec.window_left = c.left;
    spec.window_right = c.right;
    spec.prefix_length = c.prefix;
    const bool is_doc = c.kind == MaskKind::kDocument || c.kind == MaskKind::kDocumentCausal;
    if (c.doc_q_lengths.empty()) {
      doc = document_ids(c.B, std::max(c.Sq, c.Skv), rng);
      doc_kv = doc;
    } else {
      const int64_t rows = c.broadcast_docs ? 1 : c.B;
      doc = document_ids(rows, c.Sq, c.doc_q_lengths, c.padded_tail, -1);
      doc_kv = document_ids(rows, c.Skv, c.doc_kv_lengths.empty() ? c.doc_q_lengths : c.doc_kv_lengths,
                            c.padded_tail, -2);
    }
    if (is_doc) spec.doc_q = doc.view(), spec.doc_kv = doc_kv.view();
    st::BlockMaskOptions opts;
    opts.block_q = c.block_q;
    opts.block_kv = c.block_kv;
    random = RandomMask{rng(), c.empty_column};
    if (c.kind == MaskKind::kBitmask) {
      host_mask = std::make_unique<st::BlockMaskTensors>(
          st::build_block_mask_from_function(&RandomMask::call, &random, c.B, c.Hq, c.Sq, c.Skv, opts));
      allowed = random;
    } else {
      host_mask = std::make_unique<st::BlockMaskTensors>(st::build_block_mask(spec, c.Sq, c.Skv, opts));
      allowed = [spec, c](int64_t b, int64_t, int64_t i, int64_t j) {
        return st::testing::spec_allows(spec, b, c.Sq, c.Skv, i, j);
      };
    }
    st::validate_block_mask(host_mask->mask, c.B, c.Hq);
    if (c.device_build) {
      st::MaskSpec dspec = spec;
      if (is_doc) {
        ddoc = DeviceTensor(doc);
        ddoc_kv = DeviceTensor(doc_kv);
        dspec.doc_q = ddoc.view();
        dspec.doc_kv = ddoc_kv.view();
      }
      opts.device = st::Device::cuda(0);
      opts.auto_schedule = false;
      opts.schedule.kind = st::ScheduleKind::kShortestFirst;
      device_built = st::build_block_mask(dspec, c.Sq, c.Skv, opts);
      mask = device_built.mask;
    } else {
      st::BlockMask m = host_mask->mask;
      if (c.compact) narrow_to_counts(m);
      copied = std::make_unique<DeviceMask>(m);
      mask = copied->mask;
    }
  }

  AttentionOracle oracle(const Case& c) const {
    AttentionOracle o;
    o.B = c.B, o.Sq = c.Sq, o.Skv = c.Skv, o.Hq = c.Hq, o.Hkv = c.Hkv, o.D = c.D;
    o.scale = 1.0 / std::sqrt(double(c.D));
    o.dtype = c.dtype;
    o.p_operand = c.dtype;
    o.q = q->host_view, o.k = k->host_view, o.v = v->host_view, o.dout = dout->host_view;
    o.allowed = allowed;
    return o;
  }
};

class AttentionCuda : public ::testing::TestWithParam<Case> {};

// A case whose (dtype, D) this build has no kernel for (a MINIMAL build: bf16 D = 128 only) is
// skipped, visibly; the refusal itself is tested in AttentionCudaErrors.
#define REQUIRE_KERNEL(c)                                                                             \
  if (st::backend::attention_cuda_has_kernel((c).dtype, (c).D)) {                                    \
  } else                                                                                           \
    GTEST_SKIP() << st::dtype_name((c).dtype) << " D = " << (c).D << " has no CUDA kernel in this build"

TEST_P(AttentionCuda, ForwardMatchesTheOracle) {
  REQUIRE_HOPPER();
  const Case c = GetParam();
  REQUIRE_KERNEL(c);
  Prepared su(c);
  const st::BlockMask& mask = su.mask;
  const Input &q = *su.q, &k = *su.k, &v = *su.v;
  DevicePoisonAllocator alloc;
  st::AttentionCall call;
  call.allocator = &alloc;
  const st::AttentionForward fwd =
      st::block_sparse_attention_forward(q.dev_view, k.dev_view, v.dev_view, mask, {}, call);
  EXPECT_EQ(alloc.allocations, 3);  // o, lse and the work order, from the call's allocator

  const AttentionOracle::Result ref = su.oracle(c).run();
  ASSERT_GT(ref.allowed_pairs, 0);
  if (c.expect_empty_rows) {
    EXPECT_GT(ref.empty_rows, 0);
  }

  const HostTensor o = to_host(fwd.o.view()), lse = to_host(fwd.lse.view());
  const auto ro = st::testing::compare_bounded(o, ref.o, c.dtype, "o");
  EXPECT_TRUE(ro.ok) << ro.first_failure << " (worst error / tolerance " << ro.worst_tol_ratio << ")";
  st::testing::CompareResult rl;
  for (size_t x = 0; x < ref.lse.size(); ++x) {
    const double e = ref.lse[x];
    if (std::isinf(e)) {
      const double g = lse.get(int64_t(x));
      if (!(std::isinf(g) && g < 0)) rl.check("lse (empty row)", x, g, -1e30, 0.0);
    } else {
      rl.check("lse", x, lse.get(int64_t(x)), e, 2 * ref.lse_err[x] + 1e-6 * std::fabs(e));
    }
  }
  rl = rl.finish();
  EXPECT_TRUE(rl.ok) << rl.first_failure;

  // Bitwise determinism: a second run gives the same bytes, and so do runs on 1 and 3 persistent
  // CTAs (each walks many items back to back through the consumers' cross-item pipeline, with
  // the empty items last: an item's result must not depend on its neighbours).
  for (int sm_limit : {0, 1, 3}) {
    SCOPED_TRACE("sm_limit " + std::to_string(sm_limit));
    st::AttentionOptions opts;
    opts.sm_limit = sm_limit;
    const st::AttentionForward again =
        st::block_sparse_attention_forward(q.dev_view, k.dev_view, v.dev_view, mask, opts);
    EXPECT_TRUE(st::testing::bytes_equal(o.view(), to_host(again.o.view()).view()));
    EXPECT_TRUE(st::testing::bytes_equal(lse.view(), to_host(again.lse.view()).view()));
  }
}

struct Grads {
  HostTensor dq, dk, dv;
  explicit Grads(const st::AttentionGrads& g)
      : dq(to_host(g.dq.view())), dk(to_host(g.dk.view())), dv(to_host(g.dv.view())) {}
  bool same_bytes(const Grads& o) const {
    return st::testing::bytes_equal(dq.view(), o.dq.view()) && st::testing::bytes_equal(dk.view(), o.dk.view()) &&
           st::testing::bytes_equal(dv.view(), o.dv.view());
  }
};

// The backward in both modes against the oracle (outputs poisoned first); the deterministic mode
// bitwise equal over 20 runs and whatever the number of workers (every SM, 61, 7, 1); the atomic
// mode within the same rounding bounds on every run. `mask`: the case's mask, or it with a padded
// backward mask attached (BlockMask::backward_padded).
void expect_backward_matches(const Case& c, const Prepared& su, const st::BlockMask& mask) {
  const st::AttentionForward fwd =
      st::block_sparse_attention_forward(su.q->dev_view, su.k->dev_view, su.v->dev_view, mask);
  const AttentionOracle::Result ref = su.oracle(c).run();
  ASSERT_GT(ref.allowed_pairs, 0);
  auto backward = [&](bool deterministic, int sm_limit, st::Allocator* alloc) {
    st::AttentionOptions options;
    options.deterministic = deterministic;
    options.sm_limit = sm_limit;
    st::AttentionCall call;
    call.allocator = alloc;
    return Grads(st::block_sparse_attention_backward(su.q->dev_view, su.k->dev_view, su.v->dev_view, fwd.o.view(),
                                                     fwd.lse.view(), su.dout->dev_view, mask, options, call));
  };
  for (const bool deterministic : {true, false}) {
    for (int run = 0; run < 2; ++run) {
      DevicePoisonAllocator alloc;
      const Grads g = backward(deterministic, 0, &alloc);
      EXPECT_EQ(alloc.allocations, 4);  // dq, dk, dv and the scratch, from the call's allocator
      const char* mode = deterministic ? " (deterministic)" : " (atomic dQ)";
      for (const auto& [got, want, name] : {std::tuple<const HostTensor&, const st::testing::Bounded&, std::string>{
                                                g.dq, ref.dq, std::string("dq") + mode},
                                            {g.dk, ref.dk, std::string("dk") + mode},
                                            {g.dv, ref.dv, std::string("dv") + mode}}) {
        const auto r = st::testing::compare_bounded(got, want, c.dtype, name.c_str());
        EXPECT_TRUE(r.ok) << r.first_failure << " (worst error / tolerance " << r.worst_tol_ratio << ")";
      }
    }
  }
  const Grads first = backward(true, 0, nullptr);
  for (int run = 0; run < 20; ++run) EXPECT_TRUE(first.same_bytes(backward(true, 0, nullptr))) << "run " << run;
  for (const int workers : {61, 7, 1})
    EXPECT_TRUE(first.same_bytes(backward(true, workers, nullptr))) << workers << " SMs' worth of workers";
}

TEST_P(AttentionCuda, BackwardMatchesTheOracle) {
  REQUIRE_HOPPER();
  const Case c = GetParam();
  REQUIRE_KERNEL(c);
  Prepared su(c);
  expect_backward_matches(c, su, su.mask);
}

// Documents as ranges: the backward on the padded mask (documents of 128 tokens
// or more on 128-token boundaries; host-built, copied over) against the same oracle, both modes,
// D = 128 and 64, GQA, random and listed lengths (1 to 3000), blocks of 128 x 256, ids broadcast
// over the batch, a tail in no document (each side's own id, as cu_seqlens past the last
// document); the cases named first and last in padded_cases() also with their padded masks built
// on the device.
std::vector<Case> padded_cases() {
  using K = MaskKind;
  Case broadcast = documents_case("doccausal_bf16_lens_B2_S900_broadcast_ids", DType::kBF16, 2, 900, 900, 2, 1, 128,
                                  K::kDocumentCausal, {129, 1, 300, 64, 128, 65, 213});
  broadcast.broadcast_docs = true;  // ids [1, S]: the padded form's lists and real_rows broadcast too
  Case tail = documents_case("doccausal_bf16_lens_B2_S1300_tail250", DType::kBF16, 2, 1300, 1300, 4, 2, 128,
                             K::kDocumentCausal, {129, 300, 1, 64, 200});
  tail.padded_tail = 250;  // query ids -1, key ids -2 there
  return {broadcast,
      {"doccausal_bf16_S1031_B2", DType::kBF16, 2, 1031, 1031, 2, 1, 128, 128, 128, K::kDocumentCausal},
      {"document_fp16_S611_D64_blk128x256", DType::kFP16, 2, 611, 611, 2, 2, 64, 128, 256, K::kDocument},
      documents_case("doccausal_bf16_lens1to3000_B2_S3700", DType::kBF16, 2, 3700, 3700, 2, 1, 128, K::kDocumentCausal,
                     {1, 2, 63, 64, 3000, 65, 127, 128, 129}),
      documents_case("doccausal_bf16_lens_B2_S1700_h8_gqa", DType::kBF16, 2, 1700, 1700, 8, 2, 128, K::kDocumentCausal,
                     {129, 1, 300, 64, 128, 65, 700}),
      documents_case("doccausal_fp16_lens_B3_S1500_D64_bhsd", DType::kFP16, 3, 1500, 1500, 4, 2, 64,
                     K::kDocumentCausal, {129, 1, 300, 64, 128, 65}, {}, false, true),
      tail,
  };
}

class AttentionCudaPadded : public ::testing::TestWithParam<Case> {};

TEST_P(AttentionCudaPadded, BackwardMatchesTheOracle) {
  REQUIRE_HOPPER();
  const Case c = GetParam();
  REQUIRE_KERNEL(c);
  Prepared su(c);
  st::MaskSpec spec;
  spec.kind = c.kind;
  spec.doc_q = su.doc.view();
  spec.doc_kv = su.doc_kv.view();
  st::BlockMaskOptions opts;
  opts.block_q = c.block_q;
  opts.block_kv = c.block_kv;
  const st::BlockMaskTensors padded = st::build_doc_padded_mask(spec, c.Sq, 128, opts);
  const HostTensor rows = HostTensor::copy_of(padded.mask.real_rows);
  bool moved = false;  // the layout differs from the tokens' (else the case tests nothing new)
  for (int64_t p = 0; p < rows.numel() && !moved; ++p)
    moved = rows.get(p) >= 0 && rows.get(p) != double(p % padded.mask.seq_q);
  ASSERT_TRUE(moved);
  DeviceMask dpad(padded.mask);
  st::BlockMask m = su.mask;
  m.backward_padded = &dpad.mask;
  expect_backward_matches(c, su, m);
  const std::vector<Case> all = padded_cases();
  if (c.name == all.front().name || c.name == all.back().name) {  // the padded mask built on the device
    const DeviceTensor dids(su.doc), dkv_ids(su.doc_kv);
    st::MaskSpec dspec = spec;
    dspec.doc_q = dids.view();
    dspec.doc_kv = dkv_ids.view();
    opts.device = st::Device::cuda(0);
    const st::BlockMaskTensors built = st::build_doc_padded_mask(dspec, c.Sq, 128, opts);
    m.backward_padded = &built.mask;
    expect_backward_matches(c, su, m);
  }
}

INSTANTIATE_TEST_SUITE_P(Padded, AttentionCudaPadded, ::testing::ValuesIn(padded_cases()),
                         [](const ::testing::TestParamInfo<Case>& p) { return p.param.name; });

INSTANTIATE_TEST_SUITE_P(Cuda, AttentionCuda, ::testing::ValuesIn(cases()),
                         [](const ::testing::TestParamInfo<Case>& p) { return p.param.name; });

// o with its rows 4 bytes off a 16-byte boundary: the preprocessing's element-wise form (every
// aligned o above takes its 16-byte form), both modes against the oracle as above.
TEST(AttentionCudaBackward, UnalignedOTakesTheElementwisePreprocessing) {
  REQUIRE_HOPPER();
  const Case c{"unaligned_o", DType::kBF16, 2, 300, 300, 2, 2, 128, 128, 128, MaskKind::kCausal};
  REQUIRE_KERNEL(c);
  Prepared su(c);
  const st::AttentionForward fwd =
      st::block_sparse_attention_forward(su.q->dev_view, su.k->dev_view, su.v->dev_view, su.mask);
  const AttentionOracle::Result ref = su.oracle(c).run();
  const int64_t B = c.B, S = c.Sq, H = c.Hq, D = c.D, row = H * D, pitch = row + 2;
  const size_t e = st::dtype_size(c.dtype);
  DeviceTensor padded(HostTensor(c.dtype, {B * S * pitch}));
  ASSERT_EQ(cudaMemcpy2D(padded.view().data(), pitch * e, fwd.o.view().data(), row * e, row * e, B * S,
                         cudaMemcpyDeviceToDevice),
            cudaSuccess);
  const int64_t shape[4] = {B, S, H, D}, strides[4] = {S * pitch, pitch, D, 1};
  const st::TensorView o(padded.view().data(), c.dtype, shape, strides, 4, st::Device::cuda(0));
  for (const bool deterministic : {true, false}) {
    st::AttentionOptions options;
    options.deterministic = deterministic;
    const Grads g(st::block_sparse_attention_backward(su.q->dev_view, su.k->dev_view, su.v->dev_view, o,
                                                      fwd.lse.view(), su.dout->dev_view, su.mask, options));
    for (const auto& [got, want, name] :
         {std::tuple<const HostTensor&, const st::testing::Bounded&, const char*>{g.dq, ref.dq, "dq"},
          {g.dk, ref.dk, "dk"},
          {g.dv, ref.dv, "dv"}}) {
      const auto r = st::testing::compare_bounded(got, want, c.dtype, name);
      EXPECT_TRUE(r.ok) << r.first_failure << (deterministic ? " (deterministic)" : " (atomic dQ)");
    }
  }
}

// FlashAttention's packed documents: document ids converted from cu_seqlens on the device (no host
// sync), a mask built there from them, and the attention through it give bitwise the forward (o,
// lse) and deterministic backward (dq, dk, dv) of the same documents given as ids in another
// labelling (7 i + 3, padding -1 / -2); padded query rows past the last offset give o = 0 and
// lse = -inf, the others a finite lse. Self-attention packing (document_causal) with documents of
// 1 .. 3000 and an empty one, and cross packing (Sq != Skv, document).
TEST(AttentionCudaCuSeqlens, ForwardAndBackwardEqualTheDocumentIdForm) {
  REQUIRE_HOPPER();
  struct Packing {
    const char* name;
    MaskKind kind;
    std::vector<int32_t> q_lengths, k_lengths;
    int64_t seq_q, seq_kv;
  };
  const std::vector<int32_t> self = {1, 2, 63, 64, 0, 65, 127, 128, 129, 3000};
  const Packing packings[] = {
      {"document_causal_self_padded", MaskKind::kDocumentCausal, self, self, 3700, 3700},
      {"document_cross_Sq3300_Skv1100", MaskKind::kDocument, {129, 1, 3000, 2, 65}, {64, 700, 1, 127, 128}, 3300,
       1100},
  };
  for (const Packing& p : packings) {
    SCOPED_TRACE(p.name);
    std::vector<int32_t> cu_q(1, 0), cu_k(1, 0);
    for (int32_t l : p.q_lengths) cu_q.push_back(cu_q.back() + l);
    for (int32_t l : p.k_lengths) cu_k.push_back(cu_k.back() + l);
    auto offsets = [](const std::vector<int32_t>& cu) {
      HostTensor t(DType::kInt32, {int64_t(cu.size())});
      for (size_t i = 0; i < cu.size(); ++i) t.set(int64_t(i), cu[i]);
      return t;
    };
    auto relabelled = [](const std::vector<int32_t>& cu, int64_t seq, int32_t pad) {
      HostTensor t(DType::kInt32, {1, seq});
      for (int64_t pos = 0; pos < seq; ++pos) t.set(pos, pad);
      for (size_t i = 0; i + 1 < cu.size(); ++i)
        for (int32_t pos = cu[i]; pos < cu[i + 1]; ++pos) t.set(pos, 7.0 * double(i) + 3);
      return t;
    };
    const DeviceTensor dcu_q(offsets(cu_q)), dcu_k(offsets(cu_k));
    const DeviceTensor ids_q(relabelled(cu_q, p.seq_q, -1)), ids_k(relabelled(cu_k, p.seq_kv, -2));
    st::BlockMaskOptions o;
    o.device = st::Device::cuda(0);
    o.auto_schedule = false;
    o.schedule.kind = st::ScheduleKind::kShortestFirst;
    const st::DocumentIds converted = st::document_ids_from_cu_seqlens(dcu_q.view(), dcu_k.view(), p.seq_q, p.seq_kv);
    const st::BlockMaskTensors packed = st::build_block_mask(converted.spec(p.kind), p.seq_q, p.seq_kv, o);
    st::MaskSpec by_ids;
    by_ids.kind = p.kind;
    by_ids.doc_q = ids_q.view();
    by_ids.doc_kv = ids_k.view();
    const st::BlockMaskTensors reference = st::build_block_mask(by_ids, p.seq_q, p.seq_kv, o);

    std::mt19937_64 rng(std::hash<std::string>{}(p.name));
    const int64_t Hq = 4, Hkv = 2, D = 128;
    Input q(DType::kBF16, 1, p.seq_q, Hq, D, false, rng, 2.0), k(DType::kBF16, 1, p.seq_kv, Hkv, D, false, rng, 1.0);
    Input v(DType::kBF16, 1, p.seq_kv, Hkv, D, false, rng, 1.0), dout(DType::kBF16, 1, p.seq_q, Hq, D, false, rng, 1.0);
    DevicePoisonAllocator alloc;
    st::AttentionCall call;
    call.allocator = &alloc;
    const st::AttentionForward fa =
        st::block_sparse_attention_forward(q.dev_view, k.dev_view, v.dev_view, packed.mask, {}, call);
    const st::AttentionForward fb =
        st::block_sparse_attention_forward(q.dev_view, k.dev_view, v.dev_view, reference.mask, {}, call);
    const HostTensor o_a = to_host(fa.o.view()), lse_a = to_host(fa.lse.view());
    EXPECT_TRUE(st::testing::bytes_equal(o_a.view(), to_host(fb.o.view()).view()));
    EXPECT_TRUE(st::testing::bytes_equal(lse_a.view(), to_host(fb.lse.view()).view()));
    for (int64_t h = 0; h < Hq; ++h)
      for (int64_t i = 0; i < p.seq_q; ++i) {
        const double l = lse_a.get(h * p.seq_q + i);
        if (i < cu_q.back()) {  // every query document here meets a non-empty key document
          ASSERT_TRUE(std::isfinite(l)) << "row " << i << ": lse " << l;
        } else {
          ASSERT_TRUE(std::isinf(l) && l < 0) << "padded row " << i << ": lse " << l;
          for (int64_t d = 0; d < D; ++d) ASSERT_EQ(o_a.get((i * Hq + h) * D + d), 0.0) << "padded row " << i;
        }
      }
    const Grads ga(st::block_sparse_attention_backward(q.dev_view, k.dev_view, v.dev_view, fa.o.view(),
                                                       fa.lse.view(), dout.dev_view, packed.mask));
    const Grads gb(st::block_sparse_attention_backward(q.dev_view, k.dev_view, v.dev_view, fb.o.view(),
                                                       fb.lse.view(), dout.dev_view, reference.mask));
    EXPECT_TRUE(ga.same_bytes(gb));
  }
}

// Each call must throw an Error containing `message` and allocate nothing.
struct Bad {
  const char* what;
  std::function<void(st::AttentionCall&)> run;
  const char* message;
};

template <size_t N>
void expect_refused(const Bad (&bad)[N]) {
  for (const Bad& b : bad) {
    DevicePoisonAllocator alloc;
    st::AttentionCall call;
    call.allocator = &alloc;
    try {
      b.run(call);
      ADD_FAILURE() << b.what << ": no error";
    } catch (const st::Error& e) {
      EXPECT_NE(std::string(e.what()).find(b.message), std::string::npos) << b.what << ": " << e.what();
    }
    EXPECT_EQ(alloc.allocations, 0) << b.what;
  }
}

// What the CUDA path refuses: each error names its argument, and nothing is allocated.
TEST(AttentionCudaErrors, RefusedInputsAllocateNothing) {
  REQUIRE_HOPPER();
  std::mt19937_64 rng(3);
  const int64_t S = 256;
  Input q(DType::kBF16, 1, S, 2, 128, false, rng, 1.0), k(DType::kBF16, 1, S, 2, 128, false, rng, 1.0);
  Input q80(DType::kBF16, 1, S, 2, 80, false, rng, 1.0), k80(DType::kBF16, 1, S, 2, 80, false, rng, 1.0);
  Input q32(DType::kFP32, 1, S, 2, 128, false, rng, 1.0), k32(DType::kFP32, 1, S, 2, 128, false, rng, 1.0);
  st::MaskSpec causal;
  causal.kind = MaskKind::kCausal;
  const st::BlockMaskTensors host = st::build_block_mask(causal, S, S);
  DeviceMask dev(host.mask);
  st::BlockMaskOptions small;
  small.block_q = small.block_kv = 64;
  const st::BlockMaskTensors host64 = st::build_block_mask(causal, S, S, small);
  DeviceMask dev64(host64.mask);
  // An unaligned view: rows 8 bytes apart do not meet TMA's 16-byte stride rule.
  const int64_t shape[4] = {1, S / 2, 2, 128}, odd[4] = {S * 2 * 128, 2 * 128 + 4, 128, 1};
  const st::TensorView unaligned(q.dev.view().data(), DType::kBF16, shape, odd, 4, st::Device::cuda(0));

  auto forward = [](const Input& qi, const Input& ki, const st::BlockMask& m, st::AttentionCall& call) {
    st::block_sparse_attention_forward(qi.dev_view, ki.dev_view, ki.dev_view, m, {}, call);
  };
  const Bad bad[] = {
      {"fp32", [&](auto& call) { forward(q32, k32, dev.mask, call); }, "q: expected dtype bf16 or fp16 on CUDA"},
      {"D=80", [&](auto& call) { forward(q80, k80, dev.mask, call); }, "q: expected a head dim with a CUDA kernel"},
      {"host mask", [&](auto& call) { forward(q, k, host.mask, call); },
       "mask.kv_num_blocks: expected a tensor on cuda"},
      {"64x64 blocks", [&](auto& call) { forward(q, k, dev64.mask, call); },
       "mask.block_q: expected a multiple of the CUDA kernel's q tile (128)"},
      {"unaligned", [&](auto& call) {
         st::BlockMaskTensors m = st::build_block_mask(causal, S / 2, S / 2);
         DeviceMask dm(m.mask);
         st::block_sparse_attention_forward(unaligned, unaligned, unaligned, dm.mask, {}, call);
       },
       "q: expected a 16-byte aligned base and strides that are multiples of 16 bytes"},
      {"int32 offsets", [&](auto& call) {
         // The forward's walk indexes the lists in int32: a view whose rows lie 2^31 elements apart
         // (over no real memory: it must be refused before anything reads it).
         st::BlockMask m = dev.mask;
         const st::TensorView& t = m.kv_indices;
         const int64_t shape4[4] = {t.size(0), t.size(1), t.size(2), t.size(3)};
         const int64_t far[4] = {t.stride(0), t.stride(1), int64_t(1) << 31, t.stride(3)};
         m.kv_indices = st::TensorView(t.data(), t.dtype(), shape4, far, 4, t.device());
         forward(q, k, m, call);
       },
       "mask.kv_indices: expected every element offset below 2^31 (the forward indexes it in int32"},
  };
  expect_refused(bad);
}

// On a GPU other than a Hopper the forward and the backward are refused before anything is
// allocated, naming q, the rule and the GPU (the rule itself is tested on the CPU with made-up
// capabilities: test_gpu_arch.cpp). Runs where the lent GPU is not a Hopper.
TEST(AttentionCudaErrors, NonHopperGpuIsRefusedNamingIt) {
  REQUIRE_GPU();
  if (sparsetrain::testing::have_hopper())
    GTEST_SKIP() << "GPU 0 is a Hopper: the refusal of other GPUs cannot be seen here";
  std::mt19937_64 rng(5);
  const int64_t S = 256;
  Input q(DType::kBF16, 1, S, 2, 128, false, rng, 1.0);
  st::MaskSpec causal;
  causal.kind = MaskKind::kCausal;
  DeviceMask dev(st::build_block_mask(causal, S, S).mask);
  const Bad bad[] = {
      {"forward", [&](auto& call) { st::block_sparse_attention_forward(q.dev_view, q.dev_view, q.dev_view, dev.mask, {}, call); },
       "q: expected a tensor on a Hopper GPU (compute capability 9.0"},
  };
  expect_refused(bad);
}

// What the CUDA backward refuses on top of the forward's rules: a deterministic run without the
// mask's write order or with one built for another kv tile, and a dout TMA cannot load.
TEST(AttentionCudaErrors, BackwardRefusalsAllocateNothing) {
  REQUIRE_HOPPER();
  std::mt19937_64 rng(5);
  const int64_t S = 256;
  Input q(DType::kBF16, 1, S, 2, 128, false, rng, 1.0), k(DType::kBF16, 1, S, 2, 128, false, rng, 1.0);
  st::MaskSpec causal;
  causal.kind = MaskKind::kCausal;
  const st::BlockMaskTensors host = st::build_block_mask(causal, S, S);
  DeviceMask dev(host.mask);
  st::BlockMask no_order = dev.mask;
  no_order.dq_write_order = st::TensorView();
  no_order.dq_write_order_full = st::TensorView();
  const st::AttentionForward f = st::block_sparse_attention_forward(q.dev_view, k.dev_view, k.dev_view, dev.mask);
  const int64_t shape[4] = {1, S / 2, 2, 128}, odd[4] = {S * 2 * 128, 2 * 128 + 4, 128, 1};
  const st::TensorView odd_dout(q.dev.view().data(), DType::kBF16, shape, odd, 4, st::Device::cuda(0));
  auto backward = [&](const st::BlockMask& m, st::AttentionCall& call) {
    st::block_sparse_attention_backward(q.dev_view, k.dev_view, k.dev_view, f.o.view(), f.lse.view(), q.dev_view, m,
                                        {}, call);
  };
  const Bad bad[] = {
      {"no write order", [&](auto& call) { backward(no_order, call); },
       "mask.dq_write_order: expected the dQ write orders for the deterministic backward"},
      {"unaligned dout", [&](auto& call) {
         st::BlockMaskTensors m = st::build_block_mask(causal, S / 2, S / 2);
         DeviceMask dm(m.mask);
         Input qh(DType::kBF16, 1, S / 2, 2, 128, false, rng, 1.0);
         const st::AttentionForward fh =
             st::block_sparse_attention_forward(qh.dev_view, qh.dev_view, qh.dev_view, dm.mask);
         st::block_sparse_attention_backward(qh.dev_view, qh.dev_view, qh.dev_view, fh.o.view(), fh.lse.view(),
                                             odd_dout, dm.mask, {}, call);
       },
       "dout: expected a 16-byte aligned base and strides that are multiples of 16 bytes"},
  };
  expect_refused(bad);
  // The atomic mode needs no write order.
  st::AttentionOptions atomic;
  atomic.deterministic = false;
  EXPECT_NO_THROW(st::block_sparse_attention_backward(q.dev_view, k.dev_view, k.dev_view, f.o.view(), f.lse.view(),
                                                      q.dev_view, no_order, atomic));
}

// Device memory handed out from one cudaMalloc'd block, never freed until the end: what a
// framework's caching allocator does, and what a captured graph needs (no allocation on replay).
class ArenaAllocator final : public st::Allocator {
 public:
  explicit ArenaAllocator(size_t bytes) : size_(bytes) { EXPECT_EQ(cudaMalloc(&base_, bytes), cudaSuccess); }
  ~ArenaAllocator() override { cudaFree(base_); }
  void* allocate(size_t bytes, st::Device, st::Stream) override {
    used_ = (used_ + 255) / 256 * 256;
    EXPECT_LE(used_ + bytes, size_) << "arena too small";
    void* p = static_cast<char*>(base_) + used_;
    used_ += bytes;
    return p;
  }
  void deallocate(void*, size_t, st::Device, st::Stream) override {}

 private:
  void* base_ = nullptr;
  size_t size_, used_ = 0;
};

// The backward captured in a CUDA graph (the preprocessing, which zeroes the kernel's ticket
// counter and semaphores, the kernel, the dQ conversion) replays with the eager run's bytes.
TEST(AttentionCudaGraph, DeterministicBackwardReplaysBitwise) {
  REQUIRE_HOPPER();
  const Case c{"graph_doccausal", DType::kBF16, 2, 1500, 1500, 4, 2, 128, 128, 128, MaskKind::kDocumentCausal};
  Prepared su(c);
  const st::AttentionForward f =
      st::block_sparse_attention_forward(su.q->dev_view, su.k->dev_view, su.v->dev_view, su.mask);
  const Grads eager(st::block_sparse_attention_backward(su.q->dev_view, su.k->dev_view, su.v->dev_view, f.o.view(),
                                                        f.lse.view(), su.dout->dev_view, su.mask));
  ArenaAllocator arena(size_t(256) << 20);
  cudaStream_t stream;
  CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  st::AttentionCall call;
  call.allocator = &arena;
  call.stream.handle = stream;
  cudaGraph_t graph;
  CUDA_OK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  const st::AttentionGrads g = st::block_sparse_attention_backward(
      su.q->dev_view, su.k->dev_view, su.v->dev_view, f.o.view(), f.lse.view(), su.dout->dev_view, su.mask, {}, call);
  CUDA_OK(cudaStreamEndCapture(stream, &graph));
  cudaGraphExec_t exec;
  CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
  for (int replay = 0; replay < 3; ++replay) {
    // Poison between replays, on the replay's stream (a non-blocking stream does not wait for a
    // cudaMemset on the legacy stream).
    CUDA_OK(cudaMemsetAsync(g.dq.view().data(), 0xff, size_t(g.dq.view().numel()) * 2, stream));
    CUDA_OK(cudaGraphLaunch(exec, stream));
    CUDA_OK(cudaStreamSynchronize(stream));
    EXPECT_TRUE(eager.same_bytes(Grads(g))) << "replay " << replay;
  }
  CUDA_OK(cudaGraphExecDestroy(exec));
  CUDA_OK(cudaGraphDestroy(graph));
  CUDA_OK(cudaStreamDestroy(stream));
}

// A device mask whose write order is corrupt (every writer claims turn 0): waits that can never
// be served time out, report once and give up the order; the backward finishes (no hang: ctest's
// timeout is the watchdog) and its results are still finite.
TEST(AttentionCudaErrors, CorruptWriteOrderCannotHang) {
  REQUIRE_HOPPER();
  const Case c{"corrupt_order", DType::kBF16, 1, 512, 512, 2, 2, 128, 128, 128, MaskKind::kCausal};
  Prepared su(c);
  st::BlockMask host = su.host_mask->mask;
  HostTensor zeros = HostTensor::copy_of(host.dq_write_order), zeros_full = HostTensor::copy_of(host.dq_write_order_full);
  for (int64_t x = 0; x < zeros.numel(); ++x) zeros.set(x, 0.0);
  for (int64_t x = 0; x < zeros_full.numel(); ++x) zeros_full.set(x, 0.0);
  host.dq_write_order = zeros.view();
  host.dq_write_order_full = zeros_full.view();
  DeviceMask dev(host);
  const st::AttentionForward f =
      st::block_sparse_attention_forward(su.q->dev_view, su.k->dev_view, su.v->dev_view, dev.mask);
  ASSERT_EQ(setenv("SPARSETRAIN_ATTN_SPIN_LIMIT_MS", "100", 1), 0);
  const auto start = std::chrono::steady_clock::now();
  const Grads g(st::block_sparse_attention_backward(su.q->dev_view, su.k->dev_view, su.v->dev_view, f.o.view(),
                                                    f.lse.view(), su.dout->dev_view, dev.mask));
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  unsetenv("SPARSETRAIN_ATTN_SPIN_LIMIT_MS");
  EXPECT_LT(seconds, 20.0);
  for (const HostTensor* t : {&g.dq, &g.dk, &g.dv})
    for (int64_t x = 0; x < t->numel(); ++x) ASSERT_TRUE(std::isfinite(t->get(x))) << x;
}

}  // namespace

namespace {

// A corrupted device mask (not validated: that would synchronise) gives wrong numbers at worst:
// counts are clamped to the width, out-of-range block ids skipped, and a q tile left with nothing
// valid writes o = 0, lse = -inf; no hang, no out-of-bounds access (memcheck runs this one).
TEST(AttentionCudaErrors, CorruptDeviceMaskNeverReadsOutOfBounds) {
  REQUIRE_HOPPER();
  std::mt19937_64 rng(11);
  const int64_t S = 256, H = 2, D = 128;
  Input q(DType::kBF16, 1, S, H, D, false, rng, 1.0), k(DType::kBF16, 1, S, H, D, false, rng, 1.0);
  st::MaskSpec causal;
  causal.kind = MaskKind::kCausal;
  const st::BlockMaskTensors host = st::build_block_mask(causal, S, S);
  // Row 0: a count far above the width (2); row 1: its partial id out of range, full count < 0.
  HostTensor kv_num = HostTensor::copy_of(host.mask.kv_num_blocks), kv_idx = HostTensor::copy_of(host.mask.kv_indices);
  HostTensor full_num = HostTensor::copy_of(host.mask.full_kv_num_blocks);
  kv_num.set(0, 1000);
  kv_idx.set(1 * kv_idx.view().size(3), 99);
  full_num.set(1, -5);
  st::BlockMask bad = host.mask;
  bad.kv_num_blocks = kv_num.view();
  bad.kv_indices = kv_idx.view();
  bad.full_kv_num_blocks = full_num.view();
  DeviceMask dev(bad);
  const st::AttentionForward f = st::block_sparse_attention_forward(q.dev_view, k.dev_view, k.dev_view, dev.mask);
  const HostTensor o = to_host(f.o.view()), lse = to_host(f.lse.view());
  for (int64_t h = 0; h < H; ++h)
    for (int64_t i = 0; i < S; ++i) {
      const double l = lse.get(h * S + i);
      if (i >= 128) {
        EXPECT_TRUE(std::isinf(l) && l < 0) << "row " << i << " has no valid tile: lse " << l;
      } else {
        EXPECT_TRUE(std::isfinite(l)) << "row " << i;
      }
    }
  for (int64_t x = 0; x < o.numel(); ++x) {
    const int64_t row = x / (H * D);
    ASSERT_TRUE(std::isfinite(o.get(x))) << x;
    if (row >= 128) {
      ASSERT_EQ(o.get(x), 0.0) << x;
    }
  }
}

}  // namespace

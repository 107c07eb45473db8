// Block masks: every builder against brute force (a test-side element rule per spec) on odd sizes, the
// transposes, the function builder's bitmasks bit for bit, compact index and write-order tensors,
// and each kind of bad input rejected with a message naming the tensor and the entry.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "block_mask_testing.h"
#include "common/attention/block_mask_rows.h"
#include "common/attention/mask_predicate.h"  // bitmask_word
#include "host_tensor.h"
#include "sparsetrain/block_mask.h"
#include "sparsetrain/error.h"

namespace st = sparsetrain;
using st::testing::HostTensor;

namespace {

// Runs fn and checks it throws sparsetrain::Error whose message contains every fragment.
void expect_error(const std::function<void()>& fn, std::initializer_list<std::string> fragments) {
  try {
    fn();
    ADD_FAILURE() << "no error raised (expected " << *fragments.begin() << ")";
  } catch (const st::Error& e) {
    const std::string msg = e.what();
    for (const auto& f : fragments) EXPECT_NE(msg.find(f), std::string::npos) << "message: " << msg << "\nmissing: " << f;
  }
}

int32_t* i32(const st::Tensor& t) { return t.view().data_as<int32_t>(); }

// Documents of the given lengths, packed: position -> document index.
HostTensor packed_docs(int64_t batch, int64_t len, std::mt19937& rng, int64_t min_doc, int64_t max_doc) {
  HostTensor t(st::DType::kInt32, {batch, len});
  auto* p = static_cast<int32_t*>(t.data());
  for (int64_t b = 0; b < batch; ++b) {
    int32_t doc = 0;
    int64_t left = min_doc + int64_t(rng() % uint32_t(max_doc - min_doc + 1));
    for (int64_t i = 0; i < len; ++i) {
      if (left == 0) {
        ++doc;
        left = min_doc + int64_t(rng() % uint32_t(max_doc - min_doc + 1));
      }
      p[b * len + i] = doc;
      --left;
    }
  }
  return t;
}

void expect_matches_brute_force(const st::MaskSpec& spec, const st::BlockMaskTensors& t, int64_t batch) {
  const st::BlockMask& m = t.mask;
  for (int64_t b = 0; b < batch; ++b) {
    const int32_t* dq = spec.doc_q.defined() ? spec.doc_q.data_as<int32_t>() + (spec.doc_q.size(0) == 1 ? 0 : b) * m.seq_q : nullptr;
    const int32_t* dk = spec.doc_kv.defined() ? spec.doc_kv.data_as<int32_t>() + (spec.doc_kv.size(0) == 1 ? 0 : b) * m.seq_kv : nullptr;
    const auto want = st::testing::brute_force_classes(spec, dq, dk, m.seq_q, m.seq_kv, m.block_q, m.block_kv);
    ASSERT_EQ(st::testing::classes_of(m, b, 0, false), want) << spec.str() << " b=" << b;
    ASSERT_EQ(st::testing::classes_of(m, b, 0, true), want) << spec.str() << " b=" << b << " (transposes)";
  }
  EXPECT_NO_THROW(st::validate_block_mask(m));
  EXPECT_EQ(st::check_write_order(m), "");
}

struct Geometry {
  int64_t seq_q, seq_kv, block_q, block_kv;
};
std::string name_of(const Geometry& g) {
  return "Sq" + std::to_string(g.seq_q) + "_Skv" + std::to_string(g.seq_kv) + "_bq" + std::to_string(g.block_q) +
         "_bkv" + std::to_string(g.block_kv);
}

class BuiltinSpecs : public ::testing::TestWithParam<Geometry> {};

TEST_P(BuiltinSpecs, MatchBruteForce) {
  const Geometry g = GetParam();
  st::BlockMaskOptions o;
  o.block_q = g.block_q;
  o.block_kv = g.block_kv;
  std::vector<st::MaskSpec> specs;
  for (st::MaskKind k : {st::MaskKind::kFull, st::MaskKind::kCausal, st::MaskKind::kCausalBottomRight}) {
    st::MaskSpec s;
    s.kind = k;
    specs.push_back(s);
  }
  for (auto [l, r] : std::vector<std::pair<int64_t, int64_t>>{{100, 0}, {0, 0}, {0, 50}, {-1, 30}, {64, -1}, {300, 300},
                                                              {127, 129}, {-1, -1}}) {
    st::MaskSpec s;
    s.kind = st::MaskKind::kSlidingWindow;
    s.window_left = l;
    s.window_right = r;
    specs.push_back(s);
  }
  for (int64_t p : {int64_t(0), int64_t(1), int64_t(100), int64_t(129), int64_t(5000)}) {
    st::MaskSpec s;
    s.kind = st::MaskKind::kPrefixLM;
    s.prefix_length = p;
    specs.push_back(s);
  }
  for (const auto& s : specs) {
    SCOPED_TRACE(s.str());
    const st::BlockMaskTensors t = st::build_block_mask(s, g.seq_q, g.seq_kv, o);
    ASSERT_EQ(t.mask.kv_indices.size(0), 1);
    expect_matches_brute_force(s, t, 1);
  }
  // Documents of odd lengths (a few shorter than a block, some longer), per batch row.
  std::mt19937 rng(uint32_t(g.seq_q * 31 + g.seq_kv));
  for (st::MaskKind k : {st::MaskKind::kDocument, st::MaskKind::kDocumentCausal}) {
    for (auto [lo, hi] : std::vector<std::pair<int64_t, int64_t>>{{1, 7}, {13, 200}, {90, 700}}) {
      const HostTensor dq = packed_docs(3, g.seq_q, rng, lo, hi), dk = packed_docs(3, g.seq_kv, rng, lo, hi);
      st::MaskSpec s;
      s.kind = k;
      s.doc_q = dq.view();
      s.doc_kv = dk.view();
      SCOPED_TRACE(s.str() + " docs " + std::to_string(lo) + ".." + std::to_string(hi));
      const st::BlockMaskTensors t = st::build_block_mask(s, g.seq_q, g.seq_kv, o);
      ASSERT_EQ(t.mask.kv_indices.size(0), 3);
      expect_matches_brute_force(s, t, 3);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Odd, BuiltinSpecs,
                         ::testing::Values(Geometry{1000, 1000, 128, 128}, Geometry{777, 1300, 64, 128},
                                           Geometry{1300, 777, 128, 64}, Geometry{200, 200, 64, 64},
                                           Geometry{513, 257, 128, 128}, Geometry{1, 1, 64, 64},
                                           Geometry{129, 700, 128, 128}, Geometry{640, 384, 128, 64}),
                         [](const ::testing::TestParamInfo<Geometry>& p) { return name_of(p.param); });

TEST(BlockMaskBuilders, DocumentsUnsortedAndBroadcastIdsMatchBruteForce) {
  // Ids need not be sorted or contiguous: random small ids per position (element fallback).
  std::mt19937 rng(5);
  const int64_t Sq = 300, Skv = 333;
  HostTensor dq(st::DType::kInt32, {2, Sq}), dk(st::DType::kInt32, {1, Skv});
  for (int64_t i = 0; i < dq.numel(); ++i) dq.set(i, double(rng() % 3));
  for (int64_t i = 0; i < dk.numel(); ++i) dk.set(i, double(rng() % 4));
  for (st::MaskKind k : {st::MaskKind::kDocument, st::MaskKind::kDocumentCausal}) {
    st::MaskSpec s;
    s.kind = k;
    s.doc_q = dq.view();
    s.doc_kv = dk.view();
    st::BlockMaskOptions o;
    o.block_q = 64;
    o.block_kv = 64;
    const auto t = st::build_block_mask(s, Sq, Skv, o);
    EXPECT_EQ(t.mask.kv_indices.size(0), 2);
    expect_matches_brute_force(s, t, 2);
  }
}

TEST(BlockMaskBuilders, CausalBlocksAreTheExpectedLists) {
  st::MaskSpec s;
  s.kind = st::MaskKind::kCausal;
  const auto t = st::build_block_mask(s, 300, 300);  // 128 x 128: 3 x 3 blocks, the last cut short
  const st::BlockMask& m = t.mask;
  ASSERT_EQ(m.num_q_blocks(), 3);
  for (int64_t r = 0; r < 3; ++r) {
    EXPECT_EQ(i32(t.kv_num_blocks)[r], 1) << "the diagonal block is partial";
    EXPECT_EQ(i32(t.kv_indices)[r * 3], r);
    EXPECT_EQ(i32(t.full_kv_num_blocks)[r], r);
    for (int64_t i = 0; i < r; ++i) EXPECT_EQ(i32(t.full_kv_indices)[r * 3 + i], i);
  }
  // Column 0 walks q blocks 0 (partial), 1, 2 (full).
  EXPECT_EQ(i32(t.q_num_blocks)[0], 1);
  EXPECT_EQ(i32(t.full_q_num_blocks)[0], 2);
  // auto runs the dQ model over its candidates (block_mask.h: choose_schedule); on a causal mask
  // the descending walk keeps every column's turns in step, so left to right wins.
  EXPECT_EQ(m.schedule.kind, st::ScheduleKind::kLeftToRight) << "auto on a causal mask";
  EXPECT_EQ(m.schedule.walk, st::WalkOrder::kDescendingHeadsInner) << "auto on a causal mask";
}

TEST(BlockMaskBuilders, FromBlocksRoundTripsRandomMatrices) {
  std::mt19937 rng(11);
  for (int trial = 0; trial < 50; ++trial) {
    const int64_t B = 1 + rng() % 2, H = 1 + rng() % 3, bq = (rng() % 2) ? 64 : 128, bk = (rng() % 2) ? 64 : 128;
    const int64_t Sq = 1 + rng() % 1500, Skv = 1 + rng() % 1500;
    const int64_t Mq = (Sq + bq - 1) / bq, Nk = (Skv + bk - 1) / bk;
    const double density = (rng() % 100) / 100.0;
    HostTensor blocks(st::DType::kUInt8, {B, H, Mq, Nk});
    std::uniform_real_distribution<double> u(0, 1);
    for (int64_t i = 0; i < blocks.numel(); ++i) blocks.set(i, u(rng) < density ? double(1 + rng() % 2) : 0.0);
    st::BlockMaskOptions o;
    o.block_q = bq;
    o.block_kv = bk;
    const auto t = st::build_block_mask_from_blocks(blocks.view(), Sq, Skv, o);
    ASSERT_NO_THROW(st::validate_block_mask(t.mask, B, H));
    for (int64_t b = 0; b < B; ++b)
      for (int64_t h = 0; h < H; ++h) {
        const auto* src = static_cast<const uint8_t*>(blocks.data()) + (b * H + h) * Mq * Nk;
        const std::vector<uint8_t> want(src, src + Mq * Nk);
        ASSERT_EQ(st::testing::classes_of(t.mask, b, h, false), want);
        ASSERT_EQ(st::testing::classes_of(t.mask, b, h, true), want);
      }
  }
}

// FlexAttention's lists of random block matrices (ids shuffled within a row, garbage past the
// counts, int32 and int64, the full lists present or not, leading dims broadcast) give the matrix
// back; the partial blocks' places are the built mask's lists, in order.
TEST(BlockMaskBuilders, FlexListsGiveTheirMatrixAndPlaces) {
  std::mt19937 rng(11);
  for (int trial = 0; trial < 24; ++trial) {
    const int64_t B = 1 + rng() % 3, H = 1 + rng() % 3, Mq = 1 + rng() % 6, Nk = 1 + rng() % 9;
    const bool full_lists = trial % 3 != 0, wide = trial % 2 == 0, broadcast_h = trial % 4 == 1;
    const int64_t Hl = broadcast_h ? 1 : H;  // the lists' own head dim
    const st::DType dt = trial % 5 == 0 ? st::DType::kInt64 : st::DType::kInt32;
    HostTensor want(st::DType::kUInt8, {B, H, Mq, Nk});
    auto* w = static_cast<uint8_t*>(want.data());
    for (int64_t b = 0; b < B; ++b)
      for (int64_t h = 0; h < Hl; ++h)
        for (int64_t i = 0; i < Mq * Nk; ++i) {
          const uint8_t v = uint8_t(rng() % 3 == 0 ? 0 : (full_lists ? 1 + rng() % 2 : 1));
          for (int64_t hh = broadcast_h ? 0 : h; hh < (broadcast_h ? H : h + 1); ++hh) w[((b * H + hh) * Mq) * Nk + i] = v;
        }
    const int64_t W = wide ? Nk + 2 : Nk;
    HostTensor counts[2] = {HostTensor(dt, {B, Hl, Mq}), HostTensor(dt, {B, Hl, Mq})};
    HostTensor ids[2] = {HostTensor(dt, {B, Hl, Mq, W}), HostTensor(dt, {B, Hl, Mq, W})};
    for (int cls = 1; cls <= 2; ++cls)
      for (int64_t r = 0; r < B * Hl * Mq; ++r) {
        const int64_t b = r / (Hl * Mq), h = r / Mq % Hl, m = r % Mq;
        std::vector<int64_t> row;
        for (int64_t n = 0; n < Nk; ++n)
          if (w[((b * H + h) * Mq + m) * Nk + n] == cls) row.push_back(n);
        std::shuffle(row.begin(), row.end(), rng);
        counts[cls - 1].set(r, double(row.size()));
        for (int64_t k = 0; k < W; ++k)
          ids[cls - 1].set(r * W + k, k < int64_t(row.size()) ? double(row[size_t(k)]) : double(rng() % 50));
      }
    st::FlexBlockLists l{counts[0].view(), ids[0].view(), {}, {}};
    if (full_lists) l.full_kv_num_blocks = counts[1].view(), l.full_kv_indices = ids[1].view();
    const st::Tensor got = st::block_matrix_from_flex(l, B, H, Nk);
    ASSERT_EQ(got.view().dim(), 4);
    ASSERT_EQ(std::memcmp(got.view().data(), want.data(), size_t(B * H * Mq * Nk)), 0) << "trial " << trial;

    const int64_t bq = 1 + rng() % 64, bk = 1 + rng() % 64;
    int64_t width = 0;
    const st::Tensor places = st::partial_block_places(got.view(), bq, bk, &width);
    st::BlockMaskOptions o;
    o.block_q = bq, o.block_kv = bk;
    const auto t = st::build_block_mask_from_blocks(want.view(), Mq * bq, Nk * bk, o);
    const int32_t* num = i32(t.kv_num_blocks);
    const int64_t P = places.view().size(1);
    int64_t longest = 1, total = 0;
    for (int64_t r = 0; r < B * H * Mq; ++r) longest = std::max<int64_t>(longest, num[r]), total += num[r];
    ASSERT_EQ(width, longest);
    ASSERT_EQ(P, total);
    const int64_t* p = places.view().data_as<int64_t>();
    for (int64_t r = 0, i = 0; r < B * H * Mq; ++r)
      for (int32_t k = 0; k < num[r]; ++k, ++i) {
        const int64_t b = r / (H * Mq), h = r / Mq % H, m = r % Mq;
        ASSERT_EQ(p[i], r * width + k);
        ASSERT_EQ(p[P + i], b);
        ASSERT_EQ(p[2 * P + i], h);
        ASSERT_EQ(p[3 * P + i], m * bq);
        ASSERT_EQ(p[4 * P + i], int64_t(i32(t.kv_indices)[r * Nk + k]) * bk);
      }
  }
}

TEST(BlockMaskErrors, FlexListsAreCheckedEntryByEntry) {
  HostTensor c(st::DType::kInt32, {1, 1, 2}), ids(st::DType::kInt32, {1, 1, 2, 2});
  HostTensor fc(st::DType::kInt32, {1, 1, 2}), fids(st::DType::kInt32, {1, 1, 2, 2});
  const auto lists = [&](bool full) {
    return st::FlexBlockLists{c.view(), ids.view(), full ? fc.view() : st::TensorView(),
                              full ? fids.view() : st::TensorView()};
  };
  const auto run = [&](bool full) { st::block_matrix_from_flex(lists(full), 1, 1, 3); };
  c.set(0, 1), c.set(1, 3);
  expect_error([&] { run(false); }, {"kv_num_blocks[b=0, h=0, q block 1]", "a count in [0, 2] (the width of kv_indices)", "got 3"});
  c.set(1, -1);
  expect_error([&] { run(false); }, {"kv_num_blocks[b=0, h=0, q block 1]", "got -1"});
  c.set(1, 2), ids.set(2, 1), ids.set(3, 3);
  expect_error([&] { run(false); }, {"kv_indices[b=0, h=0, q block 1] entry 1", "a kv block in [0, 3)", "got 3"});
  ids.set(3, 1);
  expect_error([&] { run(false); }, {"kv_indices[b=0, h=0, q block 1] entry 1", "no duplicate kv blocks in a row", "kv block 1 twice"});
  ids.set(3, 0), fc.set(0, 1), fids.set(0, 0);
  expect_error([&] { run(true); }, {"full_kv_indices[b=0, h=0, q block 0] entry 0", "not also partial (in kv_indices)", "kv block 0 in both"});
  fids.set(0, 2);
  EXPECT_NO_THROW(run(true));
  expect_error([&] { st::block_matrix_from_flex({c.view(), ids.view(), fc.view(), {}}, 1, 1, 3); }, {"full_kv_indices", "with full_kv_num_blocks"});
  EXPECT_NO_THROW(st::block_matrix_from_flex(lists(false), 2, 1, 3));  // B' = 1 broadcasts
  HostTensor c2(st::DType::kInt32, {2, 1, 2});
  expect_error([&] { st::block_matrix_from_flex({c2.view(), ids.view(), {}, {}}, 3, 1, 3); }, {"kv_num_blocks", "broadcastable to [B=3, H=1]", "[2, 1, 2]"});
  HostTensor c3(st::DType::kInt32, {1, 1, 3});
  expect_error([&] { st::block_matrix_from_flex({c.view(), ids.view(), c3.view(), fids.view()}, 1, 1, 3); }, {"full_kv_num_blocks", "as many rows of q blocks as kv_num_blocks (2)", "got 3"});
  HostTensor f32(st::DType::kFP32, {1, 1, 2});
  expect_error([&] { st::block_matrix_from_flex({f32.view(), ids.view(), {}, {}}, 1, 1, 3); }, {"kv_num_blocks", "int32 or int64", "fp32"});
  HostTensor blocks(st::DType::kUInt8, {1, 1, 1});
  int64_t width = 0;
  expect_error([&] { st::partial_block_places(blocks.view(), 16, 16, &width); }, {"blocks", "4 dimensions"});
}

// A mask function with full, skipped and ragged partial blocks: a banded pattern that differs
// per (b, h), plus a hole.
struct Pattern {
  int64_t seq_q, seq_kv;
  static bool allowed(void* ctx, int64_t b, int64_t h, int64_t q, int64_t kv) {
    (void)ctx;
    if (q >= 40 && q < 45 && kv == 7) return false;
    const int64_t d = kv - q + 3 * b - 2 * h;
    return (d >= -90 && d <= 20) || (kv % 97 == 3 && q % 5 == (b + h) % 5);
  }
};

TEST(BlockMaskBuilders, FromFunctionBitmasksAreExact) {
  for (auto g : {Geometry{250, 333, 64, 128}, Geometry{130, 70, 32, 16}, Geometry{17, 23, 8, 8}}) {
    SCOPED_TRACE(name_of(g));
    const int64_t B = 2, H = 3;
    st::BlockMaskOptions o;
    o.block_q = g.block_q;
    o.block_kv = g.block_kv;
    const auto t = st::build_block_mask_from_function(&Pattern::allowed, nullptr, B, H, g.seq_q, g.seq_kv, o);
    const st::BlockMask& m = t.mask;
    ASSERT_EQ(m.spec.kind, st::MaskKind::kBitmask);
    ASSERT_NO_THROW(st::validate_block_mask(m, B, H));
    const int64_t Mq = m.num_q_blocks(), Nk = m.num_kv_blocks(), bytes = g.block_q * g.block_kv / 8;
    const int64_t W = m.partial_bitmasks.size(3);
    ASSERT_EQ(m.partial_bitmasks.size(4), bytes);
    int64_t partial_blocks = 0;
    for (int64_t b = 0; b < B; ++b)
      for (int64_t h = 0; h < H; ++h) {
        const auto cls = st::testing::classes_of(m, b, h, false);
        for (int64_t r = 0; r < Mq; ++r)
          for (int64_t n = 0; n < Nk; ++n) {
            int64_t yes = 0, all = 0;
            for (int64_t q = r * g.block_q; q < std::min((r + 1) * g.block_q, g.seq_q); ++q)
              for (int64_t kv = n * g.block_kv; kv < std::min((n + 1) * g.block_kv, g.seq_kv); ++kv, ++all)
                yes += Pattern::allowed(nullptr, b, h, q, kv);
            ASSERT_EQ(cls[size_t(r * Nk + n)], yes == 0 ? 0 : yes == all ? 2 : 1) << "block " << r << "," << n;
          }
        const int32_t* cnt = m.kv_num_blocks.data_as<int32_t>() + (b * H + h) * Mq;
        for (int64_t r = 0; r < Mq; ++r)
          for (int32_t i = 0; i < cnt[r]; ++i) {
            ++partial_blocks;
            const int32_t n = m.kv_indices.data_as<int32_t>()[((b * H + h) * Mq + r) * Nk + i];
            const uint8_t* bits = m.partial_bitmasks.data_as<uint8_t>() + (((b * H + h) * Mq + r) * W + i) * bytes;
            for (int64_t qi = 0; qi < g.block_q; ++qi)
              for (int64_t kj = 0; kj < g.block_kv; ++kj) {
                const int64_t q = r * g.block_q + qi, kv = n * g.block_kv + kj;
                const bool want = q < g.seq_q && kv < g.seq_kv && Pattern::allowed(nullptr, b, h, q, kv);
                const int64_t bit = qi * g.block_kv + kj;  // LSB first
                ASSERT_EQ(bool((bits[bit / 8] >> (bit % 8)) & 1), want) << "row " << qi << " col " << kj;
              }
          }
      }
    EXPECT_GT(partial_blocks, 0);
  }
}

TEST(BlockMaskBuilders, BitmaskBitOrderIsLsbFirst) {
  // One 8 x 8 block, only (row 0, col 1) and (row 1, col 0) allowed: byte 0 = 0b10, byte 1 = 0b1.
  auto f = [](void*, int64_t, int64_t, int64_t q, int64_t kv) { return (q == 0 && kv == 1) || (q == 1 && kv == 0); };
  st::BlockMaskOptions o;
  o.block_q = o.block_kv = 8;
  const auto t = st::build_block_mask_from_function(+f, nullptr, 1, 1, 8, 8, o);
  const uint8_t* bits = t.mask.partial_bitmasks.data_as<uint8_t>();
  EXPECT_EQ(bits[0], 0x02);
  EXPECT_EQ(bits[1], 0x01);
  for (int i = 2; i < 8; ++i) EXPECT_EQ(bits[i], 0);
}

// The kernels read a partial block's bits as little-endian 32-bit words (bitmask_word): every
// element of every partial block of a random function's mask, read that way, is the function.
TEST(BlockMaskBuilders, BitmaskWordsReadAsTheKernelsReadThemAreTheFunction) {
  const int64_t Sq = 300, Skv = 700, bq = 128, bkv = 256;
  std::mt19937 rng(29);
  std::vector<uint8_t> allowed(size_t(Sq * Skv));
  for (auto& a : allowed) a = uint8_t(rng() % 2);
  struct Ctx { const std::vector<uint8_t>* a; int64_t skv; } ctx{&allowed, Skv};
  auto f = [](void* c, int64_t, int64_t, int64_t q, int64_t kv) {
    const auto* x = static_cast<Ctx*>(c);
    return (*x->a)[size_t(q * x->skv + kv)] != 0;
  };
  st::BlockMaskOptions o;
  o.block_q = bq, o.block_kv = bkv;
  const auto t = st::build_block_mask_from_function(+f, &ctx, 1, 1, Sq, Skv, o);
  const st::BlockMask& m = t.mask;
  const int64_t width = m.kv_indices.size(3), bytes = m.partial_bitmasks.size(4);
  int64_t checked = 0;
  for (int64_t mq = 0; mq < m.num_q_blocks(); ++mq) {
    for (int64_t w = 0; w < m.kv_num_blocks.data_as<int32_t>()[mq]; ++w) {
      const int64_t n = m.kv_indices.data_as<int32_t>()[mq * width + w];
      const uint8_t* block = m.partial_bitmasks.data_as<uint8_t>() + (mq * width + w) * bytes;
      for (int32_t i = 0; i < bq && mq * bq + i < Sq; ++i) {
        for (int32_t j = 0; j < bkv && n * bkv + j < Skv; ++j) {
          uint32_t word;
          std::memcpy(&word, block + 4 * st::bitmask_word(i, j, int32_t(bkv)), 4);  // little-endian, as the GPU
          ASSERT_EQ(((word >> (j & 31)) & 1u) != 0, f(&ctx, 0, 0, mq * bq + i, n * bkv + j))
              << "q block " << mq << " kv block " << n << " row " << i << " col " << j;
          ++checked;
        }
      }
    }
  }
  EXPECT_GT(checked, Sq * Skv / 2);  // nearly every block is partial at p = 1/2
}

TEST(BlockMaskBuilders, TransposeMatchesAndDropsStaleWriteOrders) {
  st::MaskSpec s;
  s.kind = st::MaskKind::kSlidingWindow;
  s.window_left = 200;
  s.window_right = 0;
  auto t = st::build_block_mask(s, 1000, 900);
  ASSERT_TRUE(t.mask.dq_write_order.defined());
  st::transpose_block_mask(t);
  EXPECT_FALSE(t.mask.dq_write_order.defined());
  EXPECT_EQ(st::testing::classes_of(t.mask, 0, 0, true), st::testing::classes_of(t.mask, 0, 0, false));
  st::compute_dq_write_order(t, st::ColumnSchedule{});
  EXPECT_NO_THROW(st::validate_block_mask(t.mask));
}

// The device builder (src/cuda/block_mask/block_mask_cuda.cu) computes every block's document-id
// spans once, as a reduction over the lanes of a warp (lane l takes positions begin + l, + 32, ...),
// and hands them to classify_block: the same spans, the same classes as computing them in place.
// Id patterns: random small ids (unsorted: the element fallback), packed documents (sorted: the
// merge), two ids at random (unsorted, at most two a block: the id sets), and packed documents with
// padding as the backward's padded form has it (a long document's end, then the largest id + 1 as a
// query, + 2 as a key, up to a boundary: two ids a block over a range of many documents). Every
// class also against the elements themselves.
TEST(BlockMaskBuilders, DocumentSpansGivenOrComputedClassifyAlike) {
  std::mt19937 rng(13);
  const int64_t Sq = 777, Skv = 901, bq = 64, bkv = 128;
  for (int pattern = 0; pattern < 4; ++pattern) {
    const bool packed = pattern == 1 || pattern == 3;
    HostTensor dq = packed ? packed_docs(1, Sq, rng, 1, 300) : HostTensor(st::DType::kInt32, {1, Sq});
    HostTensor dk = packed ? packed_docs(1, Skv, rng, 1, 300) : HostTensor(st::DType::kInt32, {1, Skv});
    auto* q = static_cast<int32_t*>(dq.data());
    auto* kv = static_cast<int32_t*>(dk.data());
    if (pattern == 0) {
      for (int64_t i = 0; i < Sq; ++i) q[i] = int32_t(rng() % 5);
      for (int64_t i = 0; i < Skv; ++i) kv[i] = int32_t(rng() % 5);
    } else if (pattern == 2) {
      for (int64_t i = 0; i < Sq; ++i) q[i] = rng() % 2 ? 3 : 7;
      for (int64_t i = 0; i < Skv; ++i) kv[i] = rng() % 3 ? 3 : 9;
    } else if (pattern == 3) {  // the last 1..40 positions of every 128 padded, as after a long document
      const int32_t top = std::max(*std::max_element(q, q + Sq), *std::max_element(kv, kv + Skv));
      const auto pad_ends = [&](int32_t* ids, int64_t seq, int32_t pad) {
        for (int64_t b0 = 0; b0 < seq; b0 += 128) {
          const int64_t end = std::min(seq, b0 + 128);
          for (int64_t i = end - 1 - int64_t(rng() % 40); i < end; ++i) ids[i] = pad;
        }
      };
      pad_ends(q, Sq, top + 1);
      pad_ends(kv, Skv, top + 2);
    }
    const auto lane_reduced = [](const int32_t* ids, int64_t begin, int64_t end) {
      st::DocIdSpan s{INT32_MAX, INT32_MIN, 1, 1};
      for (int64_t lane = 0; lane < 32; ++lane)
        for (int64_t k = begin + lane; k < end; k += 32) {
          s.min = std::min(s.min, ids[k]);
          s.max = std::max(s.max, ids[k]);
          if (k > begin && ids[k] < ids[k - 1]) s.sorted = 0;
        }
      for (int64_t lane = 0; lane < 32; ++lane)
        for (int64_t k = begin + lane; k < end; k += 32) s.two_ids = s.two_ids && (ids[k] == s.min || ids[k] == s.max);
      return s;
    };
    int64_t two_id_pairs = 0;
    for (st::MaskKind kind : {st::MaskKind::kDocument, st::MaskKind::kDocumentCausal}) {
      const st::MaskRowParams p{kind, 0, 0, 0, Sq, Skv, q, kv};
      for (int64_t m = 0; m * bq < Sq; ++m)
        for (int64_t n = 0; n * bkv < Skv; ++n) {
          const int64_t q0 = m * bq, q1 = std::min(Sq, (m + 1) * bq), kv0 = n * bkv, kv1 = std::min(Skv, (n + 1) * bkv);
          const st::DocIdSpan qs = st::doc_id_span(q, q0, q1), ks = st::doc_id_span(kv, kv0, kv1);
          const st::DocIdSpan lq = lane_reduced(q, q0, q1), lk = lane_reduced(kv, kv0, kv1);
          ASSERT_TRUE(qs.min == lq.min && qs.max == lq.max && qs.sorted == lq.sorted && qs.two_ids == lq.two_ids)
              << "q block " << m;
          ASSERT_TRUE(ks.min == lk.min && ks.max == lk.max && ks.sorted == lk.sorted && ks.two_ids == lk.two_ids)
              << "kv block " << n;
          two_id_pairs += qs.two_ids && ks.two_ids && qs.min != qs.max;
          const int32_t c = st::classify_block(p, bq, bkv, m, n);
          ASSERT_EQ(st::classify_block(p, bq, bkv, m, n, &lq, &lk), c)
              << "block (" << m << ", " << n << ") pattern " << pattern;
          ASSERT_EQ(c, st::classify_block_by_elements(p, q0, q1, kv0, kv1))
              << "block (" << m << ", " << n << ") pattern " << pattern;
        }
    }
    if (pattern >= 2) {
      EXPECT_GT(two_id_pairs, 20) << "pattern " << pattern << " reaches the id sets";
    }
  }
}

// What the device builder computes, per (b, kv block n), from the dense class matrix: the
// transposes are the q blocks m whose class at n is partial / full, ascending, zero-padded, and
// the write order next to each is the number of columns touching m (partial or full) handed out
// before n (walking schedule_column): block units, whatever a kernel's kv tile. The host builder's tensors (write_order_row over
// the lists) satisfy exactly that, for every schedule kind.
TEST(BlockMaskBuilders, WriteOrdersAreScheduleOrderCountsOfTheClassMatrix) {
  std::mt19937 rng(17);
  const HostTensor docs = packed_docs(2, 1500, rng, 50, 700);
  std::vector<st::MaskSpec> specs(4);
  specs[0].kind = st::MaskKind::kCausal;
  specs[1].kind = st::MaskKind::kSlidingWindow;
  specs[1].window_left = 300;
  specs[1].window_right = 100;
  specs[2].kind = st::MaskKind::kDocumentCausal;
  specs[2].doc_q = specs[2].doc_kv = docs.view();
  specs[3].kind = st::MaskKind::kPrefixLM;
  specs[3].prefix_length = 200;
  for (const st::MaskSpec& spec : specs)
    for (int kind = 0; kind < 3; ++kind)
      {
        st::BlockMaskOptions o;
        o.block_q = 64;
        o.block_kv = 128;
        o.auto_schedule = false;
        const int64_t Mq = (1500 + 63) / 64, Nk = (1500 + 127) / 128;
        o.schedule.kind = kind == 0 ? st::ScheduleKind::kLeftToRight
                          : kind == 1 ? st::ScheduleKind::kShortestFirst
                                      : st::ScheduleKind::kPermutation;
        if (kind == 2) {
          for (int64_t n = 0; n < Nk; ++n) o.schedule.permutation.push_back(int32_t(n));
          std::shuffle(o.schedule.permutation.begin(), o.schedule.permutation.end(), rng);
        }
        SCOPED_TRACE(spec.str() + " " + o.schedule.str());
        const st::BlockMaskTensors t = st::build_block_mask(spec, 1500, 1500, o);
        const int64_t B = t.kv_num_blocks.view().size(0);
        for (int64_t b = 0; b < B; ++b) {
          const std::vector<uint8_t> cls = st::testing::classes_of(t.mask, b, 0, false);  // [Mq, Nk]
          std::vector<int32_t> rank(size_t(Mq * Nk), -1);                               // turns before n at m
          for (int64_t m = 0; m < Mq; ++m) {
            int32_t before = 0;
            for (int64_t pos = 0; pos < Nk; ++pos) {
              const int64_t n = st::schedule_column(o.schedule.kind, o.schedule.permutation.data(), pos, Nk);
              rank[size_t(m * Nk + n)] = before;
              before += cls[size_t(m * Nk + n)] != 0 ? 1 : 0;
            }
          }
          for (int64_t n = 0; n < Nk; ++n)
            for (int full = 0; full < 2; ++full) {
              const int32_t* count = i32(full ? t.full_q_num_blocks : t.q_num_blocks) + b * Nk + n;
              const int32_t* idx = i32(full ? t.full_q_indices : t.q_indices) + (b * Nk + n) * Mq;
              const int32_t* order = i32(full ? t.dq_write_order_full : t.dq_write_order) + (b * Nk + n) * Mq;
              int32_t k = 0;
              for (int64_t m = 0; m < Mq; ++m) {
                if (cls[size_t(m * Nk + n)] != (full ? 2 : 1)) continue;
                ASSERT_LT(k, *count);
                EXPECT_EQ(idx[k], m);
                EXPECT_EQ(order[k], rank[size_t(m * Nk + n)]) << "column " << n << " row " << m;
                ++k;
              }
              ASSERT_EQ(k, *count) << "column " << n;
              for (int64_t j = k; j < Mq; ++j) EXPECT_TRUE(idx[j] == 0 && order[j] == 0) << "padding " << j;
            }
        }
      }
}

TEST(BlockMaskSchedule, PositionAndStr) {
  st::ColumnSchedule s;
  EXPECT_EQ(s.position(3, 5), 3);
  EXPECT_EQ(s.str(), "left-to-right");
  s.kind = st::ScheduleKind::kShortestFirst;
  EXPECT_EQ(s.position(3, 5), 1);
  EXPECT_EQ(s.str(), "shortest-first");
  s.kind = st::ScheduleKind::kPermutation;
  s.permutation = {2, 0, 1};
  EXPECT_EQ(s.position(1, 3), 2);
  EXPECT_EQ(s.str(), "permutation[2, 0, 1]");
  expect_error([&] { s.position(3, 3); }, {"column", "got 3"});
  st::MaskSpec m;
  m.kind = st::MaskKind::kSlidingWindow;
  m.window_left = 2048;
  m.window_right = 0;
  EXPECT_EQ(m.str(), "sliding_window(left=2048, right=0)");
  m.kind = st::MaskKind::kPrefixLM;
  m.prefix_length = 7;
  EXPECT_EQ(m.str(), "prefix_lm(prefix_length=7)");
}

// ---- compact tensors -----------------------------------------------------------------------

// A contiguous copy of a [B, H, R, W] int32 tensor cut to width w.
HostTensor narrowed(const st::TensorView& v, int64_t w) {
  HostTensor h(st::DType::kInt32, {v.size(0), v.size(1), v.size(2), w});
  auto* dst = static_cast<int32_t*>(h.data());
  for (int64_t r = 0; r < v.size(0) * v.size(1) * v.size(2); ++r)
    for (int64_t i = 0; i < w; ++i) dst[r * w + i] = v.data_as<int32_t>()[r * v.size(3) + i];
  return h;
}
int64_t max_count(const st::TensorView& counts) {
  int64_t m = 0;
  for (int64_t i = 0; i < counts.numel(); ++i) m = std::max<int64_t>(m, counts.data_as<int32_t>()[i]);
  return m;
}

TEST(BlockMaskCompact, CompactIndexAndWriteOrderTensorsAreAccepted) {
  st::MaskSpec s;
  s.kind = st::MaskKind::kSlidingWindow;
  s.window_left = 300;
  s.window_right = 0;
  st::BlockMaskOptions o;
  o.block_q = o.block_kv = 64;
  const auto t = st::build_block_mask(s, 2000, 2000, o);  // 32 x 32 blocks, rows of <= 6
  st::BlockMask m = t.mask;
  const int64_t wkv = max_count(m.kv_num_blocks), wfkv = max_count(m.full_kv_num_blocks);
  const int64_t wq = max_count(m.q_num_blocks), wfq = max_count(m.full_q_num_blocks);
  ASSERT_LT(wq, m.q_indices.size(3));
  // Contiguous compact copies (FlexAttention's compact layout).
  const HostTensor kv = narrowed(m.kv_indices, wkv), fkv = narrowed(m.full_kv_indices, wfkv);
  const HostTensor q = narrowed(m.q_indices, wq), fq = narrowed(m.full_q_indices, wfq);
  const HostTensor wo = narrowed(m.dq_write_order, wq), fwo = narrowed(m.dq_write_order_full, wfq);
  m.kv_indices = kv.view();
  m.full_kv_indices = fkv.view();
  m.q_indices = q.view();
  m.full_q_indices = fq.view();
  m.dq_write_order = wo.view();
  m.dq_write_order_full = fwo.view();
  EXPECT_NO_THROW(st::validate_block_mask(m));
  EXPECT_EQ(st::check_write_order(m), "");
  // The scheduler model reads them the same way.
  const auto res = st::simulate_dq_backward(st::dq_model_problem(m, 2, 1, 1, 1),
                                            st::dq_handout(m.schedule, 1, 1, m.num_kv_blocks(), 2), 7);
  EXPECT_TRUE(res.ok) << res.str();
  // A write order narrower than the largest count is not.
  const HostTensor short_wo = narrowed(t.mask.dq_write_order, wq - 1);
  m.dq_write_order = short_wo.view();
  expect_error([&] { st::validate_block_mask(m); }, {"dq_write_order", "a width >= the q_num_blocks count " + std::to_string(wq), "got " + std::to_string(wq - 1)});
  // Compact strided views (a wider buffer, narrower shape) work as well.
  st::BlockMask v = t.mask;
  auto narrow_view = [](const st::TensorView& x, int64_t w) {
    const int64_t shape[4] = {x.size(0), x.size(1), x.size(2), w};
    return st::TensorView(x.data(), x.dtype(), shape, x.strides(), 4);
  };
  v.q_indices = narrow_view(v.q_indices, wq);
  v.dq_write_order = narrow_view(v.dq_write_order, wq);
  EXPECT_NO_THROW(st::validate_block_mask(v));
}

TEST(BlockMaskCompact, CompactTransposeInputAndWriteOrderFromIt) {
  // Write orders computed for compact q lists come out compact too (parallel shapes).
  st::MaskSpec s;
  s.kind = st::MaskKind::kCausal;
  auto t = st::build_block_mask(s, 700, 700);
  const int64_t wq = max_count(t.mask.q_num_blocks);
  HostTensor q = narrowed(t.mask.q_indices, wq);
  t.mask.q_indices = q.view();
  st::compute_dq_write_order(t, st::ColumnSchedule{});
  EXPECT_EQ(t.mask.dq_write_order.size(3), wq);
  EXPECT_NO_THROW(st::validate_block_mask(t.mask));
}

// ---- bad input -----------------------------------------------------------------------------

st::BlockMaskTensors doc_causal_mask() {
  // 3 x 3 blocks of 64 with full, partial and skipped blocks.
  st::MaskSpec s;
  s.kind = st::MaskKind::kSlidingWindow;
  s.window_left = 100;
  s.window_right = 0;
  st::BlockMaskOptions o;
  o.block_q = o.block_kv = 64;
  return st::build_block_mask(s, 192, 192, o);
}

TEST(BlockMaskErrors, EachKindOfBadInputIsRejectedWithItsMessage) {
  using T = st::BlockMaskTensors;
  auto expect_bad = [](const std::function<void(T&)>& mutate, std::initializer_list<std::string> msg) {
    T t = doc_causal_mask();
    ASSERT_NO_THROW(st::validate_block_mask(t.mask));
    mutate(t);
    expect_error([&] { st::validate_block_mask(t.mask); }, msg);
  };
  // Row 1 (q block 1) of the window mask: partial {0, 1}? Print-free: use what the builder made.
  {
    T t = doc_causal_mask();
    ASSERT_EQ(i32(t.kv_num_blocks)[1], 2);  // kv blocks 0 and 1 partial
    ASSERT_EQ(i32(t.full_kv_num_blocks)[1], 0);
  }
  expect_bad([](T& t) { t.mask.kv_indices = st::TensorView(); }, {"kv_indices", "expected", "no tensor"});
  expect_bad([](T& t) { t.mask.full_kv_indices = st::TensorView(); }, {"full_kv_indices", "come together"});
  expect_bad([](T& t) { t.mask.q_num_blocks = st::TensorView(); }, {"q_num_blocks", "come together"});
  expect_bad([](T& t) {
    const auto& v = t.mask.kv_indices;
    t.mask.kv_indices = st::TensorView(v.data(), st::DType::kInt64, {1, 1, 3, 1});
  }, {"kv_indices: expected dtype int32, got int64"});
  expect_bad([](T& t) {
    t.mask.kv_num_blocks = st::TensorView(t.mask.kv_num_blocks.data(), st::DType::kInt32, {1, 1, 2});
  }, {"kv_num_blocks: expected size 3 (Mq = 3) in dim 2, got 2"});
  expect_bad([](T& t) { t.mask.seq_q = 400; }, {"kv_num_blocks", "Mq = 7"});
  expect_bad([](T& t) {
    t.mask.kv_indices = st::TensorView(t.mask.kv_indices.data(), st::DType::kInt32, {1, 3, 1});
  }, {"kv_indices: expected 4 dimensions, got 3"});
  expect_bad([](T& t) {
    const int64_t shape[4] = {2, 1, 3, 3}, strides[4] = {0, 9, 3, 1};
    t.mask.kv_indices = st::TensorView(t.mask.kv_indices.data(), st::DType::kInt32, shape, strides, 4);
    const int64_t s3[3] = {3, 1, 3}, st3[3] = {0, 3, 1};
    t.mask.kv_num_blocks = st::TensorView(t.mask.kv_num_blocks.data(), st::DType::kInt32, s3, st3, 3);
  }, {"kv_indices: expected leading dims broadcastable to [B=3, H=1], got [2, 1, 3, 3]"});
  expect_bad([](T& t) { i32(t.kv_num_blocks)[1] = 4; }, {"kv_num_blocks[b=0, h=0, q block 1]", "width of kv_indices (3)", "got 4"});
  expect_bad([](T& t) { i32(t.kv_num_blocks)[1] = -1; }, {"kv_num_blocks[b=0, h=0, q block 1]", "count >= 0", "got -1"});
  expect_bad([](T& t) { i32(t.kv_indices)[3 + 1] = 3; }, {"kv_indices[b=0, h=0, q block 1] entry 1", "kv block in [0, 3)", "got 3"});
  expect_bad([](T& t) { i32(t.kv_indices)[3 + 1] = 0; }, {"kv_indices[b=0, h=0, q block 1] entry 1", "no duplicate", "0 twice"});
  expect_bad([](T& t) { std::swap(i32(t.kv_indices)[3], i32(t.kv_indices)[4]); }, {"kv_indices[b=0, h=0, q block 1] entry 1", "ascending"});
  expect_bad([](T& t) {  // kv block 0 of q block 1 also listed as full
    i32(t.full_kv_num_blocks)[1] = 1;
    i32(t.full_kv_indices)[3] = 0;
  }, {"full_kv_indices[b=0, h=0, q block 1]", "not also partial", "kv block 0 in both"});
  expect_bad([](T& t) {  // q side disagrees: column 2 lists q block 0
    i32(t.q_indices)[2 * 3] = 0;
  }, {"q_indices[b=0, h=0, kv block 2]", "transpose of kv_indices", "q block 0"});
  expect_bad([](T& t) { i32(t.q_num_blocks)[0] -= 1; }, {"q_num_blocks", "transpose of kv_indices"});
  expect_bad([](T& t) {  // swap the turns of columns 0 and 1 at q block 1
    int32_t* wo = i32(t.dq_write_order);
    const int32_t* q = i32(t.q_indices);
    int64_t a = -1, b = -1;
    for (int64_t i = 0; i < i32(t.q_num_blocks)[0]; ++i) if (q[i] == 1) a = i;
    for (int64_t i = 0; i < i32(t.q_num_blocks)[1]; ++i) if (q[3 + i] == 1) b = 3 + i;
    std::swap(wo[a], wo[b]);
  }, {"dq_write_order[b=0, h=0, column", "q block 1]: expected turn"});
  expect_bad([](T& t) { t.mask.dq_write_order_full = st::TensorView(); }, {"dq_write_order_full", "exactly when"});
  expect_bad([](T& t) {
    t.mask.schedule.kind = st::ScheduleKind::kPermutation;
    t.mask.schedule.permutation = {0, 1, 1};
  }, {"schedule.permutation", "a permutation of the 3 kv block columns", "permutation[0, 1, 1]"});
  expect_bad([](T& t) { t.mask.spec.kind = st::MaskKind::kBitmask; }, {"partial_bitmasks", "no tensor"});
  expect_bad([](T& t) { t.mask.spec.kind = st::MaskKind::kDocumentCausal; }, {"spec.doc_q", "no tensor"});
  expect_bad([](T& t) { t.mask.block_q = 0; }, {"block_q: expected >= 1, got 0"});
  // Leading dims against the attention's batch / heads.
  {
    T t = doc_causal_mask();
    EXPECT_NO_THROW(st::validate_block_mask(t.mask, 4, 16)) << "B = H = 1 broadcasts";
  }
  {
    HostTensor blocks(st::DType::kUInt8, {2, 1, 1, 1});
    for (int64_t i = 0; i < blocks.numel(); ++i) blocks.set(i, 1);
    const auto t = st::build_block_mask_from_blocks(blocks.view(), 100, 100);
    expect_error([&] { st::validate_block_mask(t.mask, 3, 1); }, {"kv_num_blocks", "broadcastable to [B=3, H=1]", "[2, 1, 1]"});
  }
}

TEST(BlockMaskErrors, BuilderArgumentsAreChecked) {
  st::MaskSpec s;
  expect_error([&] { st::build_block_mask(s, 0, 10); }, {"seq_q: expected >= 1, got 0"});
  s.kind = st::MaskKind::kBitmask;
  expect_error([&] { st::build_block_mask(s, 10, 10); }, {"spec.kind", "built-in", "bitmask"});
  s.kind = st::MaskKind::kDocument;
  expect_error([&] { st::build_block_mask(s, 10, 10); }, {"spec.doc_q", "no tensor"});
  HostTensor dq(st::DType::kInt32, {1, 10}), dk(st::DType::kInt32, {1, 9});
  s.doc_q = dq.view();
  s.doc_kv = dk.view();
  expect_error([&] { st::build_block_mask(s, 10, 10); }, {"spec.doc_kv", "[B or 1, 10]", "[1, 9]"});
  HostTensor blocks(st::DType::kUInt8, {1, 1, 1, 1});
  blocks.set(0, 3);
  expect_error([&] { st::build_block_mask_from_blocks(blocks.view(), 10, 10); }, {"blocks[0, 0, 0, 0]", "0 (skipped), 1 (partial) or 2 (full)", "got 3"});
  expect_error([&] { st::build_block_mask_from_blocks(blocks.view(), 10, 300); }, {"blocks", "Nk=3", "[1, 1, 1, 1]"});
  HostTensor wrong(st::DType::kInt32, {1, 1, 1, 1});
  expect_error([&] { st::build_block_mask_from_blocks(wrong.view(), 10, 10); }, {"blocks: expected dtype uint8, got int32"});
  auto t = st::build_block_mask(st::MaskSpec{}, 300, 300);
  st::ColumnSchedule bad;
  bad.kind = st::ScheduleKind::kPermutation;
  bad.permutation = {0, 1};
  expect_error([&] { st::compute_dq_write_order(t, bad); }, {"schedule.permutation", "3 kv block columns"});
}

}  // namespace

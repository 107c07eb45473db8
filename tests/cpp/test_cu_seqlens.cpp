// FlashAttention's packed documents (cu_seqlens.h, src/common/attention/cu_seqlens.h) on the CPU:
// document_of_position against a linear scan (empty documents, padding, invalid offsets never read
// out of range); document_ids_from_cu_seqlens gives the ids of the documented rule, and the block
// mask and the attention (forward and backward, CPU reference) from them equal those of the same
// documents given as ids in another labelling, bit for bit; document-causal equals
// FlashAttention's per-document bottom-right causal when cu_seqlens_q == cu_seqlens_k, document
// equals its non-causal varlen for any lengths; each bad argument gets its error.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "common/attention/cu_seqlens.h"
#include "host_tensor.h"
#include "sparsetrain/attention.h"
#include "sparsetrain/block_mask.h"
#include "sparsetrain/cu_seqlens.h"
#include "sparsetrain/error.h"

namespace st = sparsetrain;
using st::DType;
using st::MaskKind;
using st::testing::HostTensor;

namespace {

HostTensor offsets(const std::vector<int32_t>& cu) {
  HostTensor t(DType::kInt32, {int64_t(cu.size())});
  for (size_t i = 0; i < cu.size(); ++i) t.set(int64_t(i), cu[i]);
  return t;
}

std::vector<int32_t> cumulative(const std::vector<int32_t>& lengths) {
  std::vector<int32_t> cu(1, 0);
  for (int32_t l : lengths) cu.push_back(cu.back() + l);
  return cu;
}

// The document of pos by a linear scan of the definition: i with cu[i] <= pos < cu[i + 1].
int32_t scan(const std::vector<int32_t>& cu, int64_t pos, int32_t pad) {
  for (size_t i = 0; i + 1 < cu.size(); ++i)
    if (cu[i] <= pos && pos < cu[i + 1]) return int32_t(i);
  return pad;
}

TEST(DocumentOfPosition, MatchesALinearScan) {
  std::mt19937 rng(7);
  const std::vector<std::vector<int32_t>> fixed = {
      {0},                         // no document: everything is padding
      {0, 1},                      // one document of length 1
      {0, 0, 0, 5, 5, 9},          // empty documents first and in the middle
      {0, 3, 3, 3},                // empty documents last
      {0, 64, 128, 191, 192, 320}, // lengths around a block
  };
  std::vector<std::vector<int32_t>> all = fixed;
  for (int trial = 0; trial < 200; ++trial) {
    std::vector<int32_t> lengths(1 + rng() % 12);
    for (int32_t& l : lengths) l = int32_t(rng() % 4 == 0 ? 0 : rng() % 70);
    all.push_back(cumulative(lengths));
  }
  for (const auto& cu : all) {
    const int64_t n = int64_t(cu.size()) - 1, last = cu.back();
    for (int64_t pos = 0; pos < last + 5; ++pos) {
      const int32_t want = scan(cu, pos, 1000);
      ASSERT_EQ(st::document_of_position(cu.data(), n, pos, 1000), want) << "pos " << pos << ", n " << n;
    }
  }
}

TEST(DocumentOfPosition, PaddingIdsAndInvalidOffsets) {
  EXPECT_EQ(st::cu_seqlens_padding_id(5, st::CuSeqlensSide::kQuery), 5);
  EXPECT_EQ(st::cu_seqlens_padding_id(5, st::CuSeqlensSide::kKey), 6);
  // Positions before cu[0] (cu[0] != 0: invalid, never checked on a device) are padding.
  const std::vector<int32_t> shifted = {4, 6, 9};
  for (int64_t pos = 0; pos < 4; ++pos) EXPECT_EQ(st::document_of_position(shifted.data(), 2, pos, -1), -1);
  EXPECT_EQ(st::document_of_position(shifted.data(), 2, 4, -1), 0);
  EXPECT_EQ(st::document_of_position(shifted.data(), 2, 8, -1), 1);
  EXPECT_EQ(st::document_of_position(shifted.data(), 2, 9, -1), -1);
  // Decreasing offsets: an id in range or the padding id, whatever the position.
  const std::vector<int32_t> bad = {0, 50, 10, 30, 5, 40};
  for (int64_t pos = -3; pos < 60; ++pos) {
    const int32_t d = st::document_of_position(bad.data(), 5, pos, 99);
    EXPECT_TRUE((d >= 0 && d < 5) || d == 99) << pos << " -> " << d;
  }
}

// The ids of the documented rule, by hand: document i gets `label(i)`, padding `pad`.
template <typename Label>
HostTensor ids_by_hand(const std::vector<int32_t>& cu, int64_t seq, Label label, int32_t pad) {
  HostTensor t(DType::kInt32, {1, seq});
  for (int64_t p = 0; p < seq; ++p) {
    const int32_t d = scan(cu, p, -1);
    t.set(p, d < 0 ? pad : label(d));
  }
  return t;
}

struct Packed {
  std::vector<int32_t> cu_q, cu_k;
  int64_t seq_q, seq_kv;
};

// Documents of lengths 1, 2, 63, 64, 65, 127, 128, 129 and an empty one, with padding after the
// last; and a cross-attention packing with other key lengths (Sq != Skv).
std::vector<Packed> packings() {
  const std::vector<int32_t> self = cumulative({1, 2, 63, 64, 0, 65, 127, 128, 129, 300});
  const std::vector<int32_t> keys = cumulative({5, 129, 1, 64, 3, 128, 2, 63, 65, 100});
  return {{self, self, 879 + 40, 879 + 40},  // padded to a static length
          {self, self, 879, 879},            // exactly the documents
          {self, keys, 900, 600}};            // different key documents, Sq != Skv
}

void expect_same_tensors(const st::BlockMask& a, const st::BlockMask& b) {
  const st::TensorView* x[] = {&a.kv_num_blocks, &a.kv_indices, &a.full_kv_num_blocks, &a.full_kv_indices,
                               &a.q_num_blocks, &a.q_indices, &a.full_q_num_blocks, &a.full_q_indices,
                               &a.dq_write_order, &a.dq_write_order_full};
  const st::TensorView* y[] = {&b.kv_num_blocks, &b.kv_indices, &b.full_kv_num_blocks, &b.full_kv_indices,
                               &b.q_num_blocks, &b.q_indices, &b.full_q_num_blocks, &b.full_q_indices,
                               &b.dq_write_order, &b.dq_write_order_full};
  for (size_t i = 0; i < sizeof(x) / sizeof(x[0]); ++i)
    EXPECT_TRUE(st::testing::bytes_equal(*x[i], *y[i])) << "mask tensor " << i;
  EXPECT_EQ(a.schedule.str(), b.schedule.str());
}

TEST(CuSeqlens, IdsFollowTheRule) {
  for (const Packed& p : packings()) {
    const HostTensor cq = offsets(p.cu_q), ck = offsets(p.cu_k);
    const st::DocumentIds ids = st::document_ids_from_cu_seqlens(cq.view(), ck.view(), p.seq_q, p.seq_kv);
    const int32_t n = int32_t(p.cu_q.size()) - 1;
    const auto same = [](int32_t d) { return d; };
    ASSERT_EQ(ids.doc_q.view().shape_str(), "[1, " + std::to_string(p.seq_q) + "]");
    ASSERT_EQ(ids.doc_kv.view().shape_str(), "[1, " + std::to_string(p.seq_kv) + "]");
    EXPECT_TRUE(st::testing::bytes_equal(ids.doc_q.view(), ids_by_hand(p.cu_q, p.seq_q, same, n).view()));
    EXPECT_TRUE(st::testing::bytes_equal(ids.doc_kv.view(), ids_by_hand(p.cu_k, p.seq_kv, same, n + 1).view()));
    const st::MaskSpec spec = ids.spec(MaskKind::kDocumentCausal);
    EXPECT_EQ(spec.kind, MaskKind::kDocumentCausal);
    EXPECT_EQ(spec.doc_q.data(), ids.doc_q.view().data());
  }
}

// The same documents given as ids labelled 7 i + 3 with padding -1 / -2 (another labelling, so the
// equality is of masks, not of the id tensors): the block masks are bitwise equal, and so are the
// CPU attention's outputs and gradients.
TEST(CuSeqlens, MaskAndAttentionEqualTheDocumentIdForm) {
  std::mt19937_64 rng(11);
  for (const Packed& p : packings())
    for (const MaskKind kind : {MaskKind::kDocument, MaskKind::kDocumentCausal}) {
      SCOPED_TRACE(std::string(kind == MaskKind::kDocument ? "document" : "document_causal") + " Sq " +
                   std::to_string(p.seq_q) + " Skv " + std::to_string(p.seq_kv));
      const HostTensor cq = offsets(p.cu_q), ck = offsets(p.cu_k);
      const st::DocumentIds ids = st::document_ids_from_cu_seqlens(cq.view(), ck.view(), p.seq_q, p.seq_kv);
      const auto relabel = [](int32_t d) { return 7 * d + 3; };
      const HostTensor hq = ids_by_hand(p.cu_q, p.seq_q, relabel, -1), hk = ids_by_hand(p.cu_k, p.seq_kv, relabel, -2);
      st::MaskSpec by_ids;
      by_ids.kind = kind;
      by_ids.doc_q = hq.view();
      by_ids.doc_kv = hk.view();
      st::BlockMaskOptions o;
      o.block_q = 128;
      o.block_kv = 64;
      const st::BlockMaskTensors a = st::build_block_mask(ids.spec(kind), p.seq_q, p.seq_kv, o);
      const st::BlockMaskTensors b = st::build_block_mask(by_ids, p.seq_q, p.seq_kv, o);
      expect_same_tensors(a.mask, b.mask);
      EXPECT_NO_THROW(st::validate_block_mask(a.mask));

      const int64_t H = 2, D = 16;
      HostTensor q(DType::kBF16, {1, p.seq_q, H, D}), k(DType::kBF16, {1, p.seq_kv, H, D}),
          v(DType::kBF16, {1, p.seq_kv, H, D}), dout(DType::kBF16, {1, p.seq_q, H, D});
      for (HostTensor* t : {&q, &k, &v, &dout}) t->fill_random(rng, 1.0);
      const st::AttentionForward fa = st::block_sparse_attention_forward(q.view(), k.view(), v.view(), a.mask);
      const st::AttentionForward fb = st::block_sparse_attention_forward(q.view(), k.view(), v.view(), b.mask);
      EXPECT_TRUE(st::testing::bytes_equal(fa.o.view(), fb.o.view()));
      EXPECT_TRUE(st::testing::bytes_equal(fa.lse.view(), fb.lse.view()));
      const st::AttentionGrads ga = st::block_sparse_attention_backward(q.view(), k.view(), v.view(), fa.o.view(),
                                                                        fa.lse.view(), dout.view(), a.mask);
      const st::AttentionGrads gb = st::block_sparse_attention_backward(q.view(), k.view(), v.view(), fb.o.view(),
                                                                        fb.lse.view(), dout.view(), b.mask);
      EXPECT_TRUE(st::testing::bytes_equal(ga.dq.view(), gb.dq.view()));
      EXPECT_TRUE(st::testing::bytes_equal(ga.dk.view(), gb.dk.view()));
      EXPECT_TRUE(st::testing::bytes_equal(ga.dv.view(), gb.dv.view()));
      // Padded query rows (past cu_seqlens_q[-1]) see no key: o = 0, lse = -inf.
      const float* lse = fa.lse.view().data_as<const float>();
      for (int64_t h = 0; h < H; ++h)
        for (int64_t i = p.cu_q.back(); i < p.seq_q; ++i) EXPECT_TRUE(std::isinf(lse[h * p.seq_q + i])) << i;
    }
}

// FlashAttention's varlen masks, per document i with local positions a = q - cu_q[i] and
// b = kv - cu_k[i]: non-causal allows every (a, b); causal allows b <= a + len_k - len_q
// (bottom-right). Ours: kDocument for any lengths; kDocumentCausal when cu_q == cu_k.
bool flash_allows(const Packed& p, bool causal, int64_t q, int64_t kv) {
  const int32_t i = scan(p.cu_q, q, -1), j = scan(p.cu_k, kv, -2);
  if (i != j) return false;
  if (!causal) return true;
  const int64_t a = q - p.cu_q[size_t(i)], b = kv - p.cu_k[size_t(j)];
  const int64_t len_q = p.cu_q[size_t(i) + 1] - p.cu_q[size_t(i)], len_k = p.cu_k[size_t(i) + 1] - p.cu_k[size_t(i)];
  return b <= a + len_k - len_q;
}

TEST(CuSeqlens, SemanticsAgainstFlashAttentionVarlen) {
  for (const Packed& p : packings()) {
    const HostTensor cq = offsets(p.cu_q), ck = offsets(p.cu_k);
    const st::DocumentIds ids = st::document_ids_from_cu_seqlens(cq.view(), ck.view(), p.seq_q, p.seq_kv);
    const int32_t* dq = ids.doc_q.view().data_as<const int32_t>();
    const int32_t* dk = ids.doc_kv.view().data_as<const int32_t>();
    const bool self = p.cu_q == p.cu_k;
    int64_t causal_differs = 0;
    for (int64_t q = 0; q < p.seq_q; ++q)
      for (int64_t kv = 0; kv < p.seq_kv; ++kv) {
        ASSERT_EQ(dq[q] == dk[kv], flash_allows(p, false, q, kv)) << q << ", " << kv;
        const bool ours = dq[q] == dk[kv] && kv <= q;
        if (self) {
          ASSERT_EQ(ours, flash_allows(p, true, q, kv)) << q << ", " << kv;
        } else {
          causal_differs += ours != flash_allows(p, true, q, kv);
        }
      }
    if (!self) {
      EXPECT_GT(causal_differs, 0) << "the cross packing should show the documented difference";
    }
  }
}

TEST(CuSeqlens, BadArgumentsAreRefused) {
  const HostTensor good = offsets({0, 3, 7}), three = offsets({0, 3, 7, 9});
  HostTensor wide(DType::kInt64, {3});
  HostTensor two_d(DType::kInt32, {1, 3});
  const HostTensor not_zero = offsets({1, 3, 7}), decreasing = offsets({0, 5, 4}), too_long = offsets({0, 3, 12});
  HostTensor strided_storage = offsets({0, 9, 3, 9, 7, 9});
  const int64_t shape[1] = {3}, stride[1] = {2};
  const st::TensorView strided(strided_storage.data(), DType::kInt32, shape, stride, 1);
  struct BadCase {
    const char* what;
    st::TensorView q, k;
    int64_t seq_q, seq_kv;
    const char* message;
  };
  const BadCase bad[] = {
      {"no tensor", st::TensorView(), good.view(), 10, 10, "cu_seqlens_q: expected int32 cumulative"},
      {"int64", good.view(), wide.view(), 10, 10, "cu_seqlens_k: expected dtype int32"},
      {"2-d", two_d.view(), good.view(), 10, 10, "cu_seqlens_q: expected a 1-d tensor"},
      {"strided", strided, good.view(), 10, 10, "cu_seqlens_q: expected a unit stride"},
      {"document counts", good.view(), three.view(), 10, 10, "cu_seqlens_k: expected as many documents"},
      {"seq_q", good.view(), good.view(), 0, 10, "seq_q: expected >= 1"},
      {"cu[0]", not_zero.view(), good.view(), 10, 10, "cu_seqlens_q[0]: expected 0"},
      {"decreasing", good.view(), decreasing.view(), 10, 10, "cu_seqlens_k[2]: expected >= the previous offset 5"},
      {"past seq", too_long.view(), good.view(), 10, 10, "cu_seqlens_q[-1]: expected <= seq_q = 10"},
  };
  for (const BadCase& b : bad) {
    try {
      st::document_ids_from_cu_seqlens(b.q, b.k, b.seq_q, b.seq_kv);
      ADD_FAILURE() << b.what << ": no error";
    } catch (const st::Error& e) {
      EXPECT_NE(std::string(e.what()).find(b.message), std::string::npos) << b.what << ": " << e.what();
    }
  }
  const st::DocumentIds ids = st::document_ids_from_cu_seqlens(good.view(), good.view(), 10, 10);
  EXPECT_THROW(ids.spec(MaskKind::kCausal), st::Error);
}

}  // namespace

// The backward's padded document mask (build_doc_padded_mask, BlockMask::backward_padded): its
// lists are the brute-force classes of the padded ids, real_rows places every token
// once and in order, the CPU reference run on the physically padded problem with the padded mask
// gives the original problem's results (the padded mask is the same mask: up to the rounding of
// the reference's per-block sums, whose blocks now start elsewhere), attaching it
// changes nothing on the CPU, and bad padded masks are refused naming the argument.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "block_mask_testing.h"
#include "common/attention/doc_padding.h"
#include "expect_error.h"
#include "host_tensor.h"
#include "sparsetrain/attention.h"
#include "sparsetrain/block_mask.h"

namespace st = sparsetrain;
using st::DType;
using st::MaskKind;
using st::testing::expect_error;
using st::testing::HostTensor;

namespace {

st::MaskSpec causal_spec() {
  st::MaskSpec s;
  s.kind = MaskKind::kCausal;
  return s;
}

// B rows of document ids over seq tokens: lengths drawn from [1, 60] or, one in three, [128, 400]
// (long documents at min_length 128), different per row.
HostTensor documents(int64_t B, int64_t seq, std::mt19937_64& rng) {
  HostTensor ids(DType::kInt32, {B, seq});
  for (int64_t b = 0; b < B; ++b) {
    int32_t doc = 0;
    for (int64_t s = 0; s < seq; ++doc) {
      const int64_t len = rng() % 3 == 0 ? 128 + int64_t(rng() % 273) : 1 + int64_t(rng() % 60);
      for (int64_t i = 0; i < len && s < seq; ++i, ++s) ids.set(b * seq + s, doc);
    }
  }
  return ids;
}

// A document mask and its padded form. same_ids false: the key side's ids differ (every third
// document's key id moved past the query ids, as cu_seqlens gives each side its own id past the
// last document); the layout is the query side's.
struct Padded {
  HostTensor ids, kv_ids;
  st::MaskSpec spec;
  st::BlockMaskTensors mask, padded;
  Padded(MaskKind kind, int64_t B, int64_t seq, uint64_t seed, bool same_ids = true) {
    std::mt19937_64 rng(seed);
    ids = documents(B, seq, rng);
    kv_ids = HostTensor::copy_of(ids.view());
    if (!same_ids)
      for (int64_t i = 0; i < kv_ids.numel(); ++i)
        kv_ids.set(i, kv_ids.get(i) + (int64_t(kv_ids.get(i)) % 3 == 2 ? 10000 : 0));
    spec.kind = kind;
    spec.doc_q = ids.view();
    spec.doc_kv = kv_ids.view();
    mask = st::build_block_mask(spec, seq, seq);
    padded = st::build_doc_padded_mask(spec, seq, 128);
    mask.mask.backward_padded = &padded.mask;
  }
};

TEST(DocPaddedMask, ListsAreThePaddedIdsClassesAndRealRowsEveryToken) {
  for (const MaskKind kind : {MaskKind::kDocumentCausal, MaskKind::kDocument})
    for (const bool same_ids : {true, false}) {
      SCOPED_TRACE(std::string(st::mask_kind_name(kind)) + (same_ids ? "" : ", other key ids"));
      const int64_t B = 2, seq = 777;
      Padded t(kind, B, seq, 7, same_ids);
      const st::BlockMask& pm = t.padded.mask;
      st::validate_block_mask(pm, B, 1);
      const int64_t P = pm.seq_q;
      EXPECT_EQ(P % 128, 0);
      EXPECT_EQ(pm.seq_kv, P);
      for (int64_t b = 0; b < B; ++b) {
        const int32_t* ids = t.ids.view().data_as<int32_t>() + b * seq;
        const int32_t* kids = t.kv_ids.view().data_as<int32_t>() + b * seq;
        int64_t length = 0;
        const std::vector<int64_t> pos = st::doc_padded_positions(ids, seq, 128, &length);
        EXPECT_LE(length, P);
        EXPECT_GT(length, P - 128) << "P is the longest row's padded length";
        const int32_t* rows = pm.real_rows.data_as<int32_t>() + b * P;
        const int32_t* dq = pm.spec.doc_q.data_as<int32_t>() + b * P;
        const int32_t* dkv = pm.spec.doc_kv.data_as<int32_t>() + b * P;
        int64_t tokens = 0;
        for (int64_t p = 0; p < P; ++p) {
          if (rows[p] < 0) {
            EXPECT_EQ(rows[p], -1);
            continue;
          }
          ASSERT_EQ(rows[p], tokens) << "position " << p;
          EXPECT_EQ(pos[size_t(tokens)], p);
          EXPECT_EQ(dq[p], ids[tokens]);
          EXPECT_EQ(dkv[p], kids[tokens]);
          ++tokens;
        }
        EXPECT_EQ(tokens, seq);
        // The lists, both sides, against the classes of the padded ids (a test-side predicate).
        const std::vector<uint8_t> want = st::testing::brute_force_classes(pm.spec, dq, dkv, P, P, 128, 128);
        EXPECT_EQ(st::testing::classes_of(pm, b, 0, false), want) << "forward lists, batch " << b;
        EXPECT_EQ(st::testing::classes_of(pm, b, 0, true), want) << "transposes, batch " << b;
        // The padded mask at the tokens' positions is the original mask; padding allows nothing.
        for (int64_t p = 0; p < P; ++p)
          for (int64_t x = 0; x < P; ++x) {
            const bool got = st::testing::spec_allows(pm.spec, dq, dkv, P, P, p, x);
            const bool want_pair =
                rows[p] >= 0 && rows[x] >= 0 && st::testing::spec_allows(t.spec, ids, kids, seq, seq, rows[p], rows[x]);
            ASSERT_EQ(got, want_pair) << "positions " << p << ", " << x;
          }
      }
    }
}

// q, k, v and dout of the original problem, and the same tokens at their padded positions with
// random values at the padding positions (which the padded mask must keep out).
struct Problem {
  int64_t B, S, P, H = 2, D = 16;
  HostTensor q, k, v, dout, pq, pk, pv, pdout;
  Problem(const st::BlockMask& pm, int64_t batch, int64_t seq, std::mt19937_64& rng)
      : B(batch), S(seq), P(pm.seq_q) {
    for (HostTensor* t : {&q, &k, &v, &dout}) {
      *t = HostTensor(DType::kFP32, {B, S, H, D});
      t->fill_random(rng);
    }
    for (auto [t, src] : {std::pair{&pq, &q}, {&pk, &k}, {&pv, &v}, {&pdout, &dout}}) {
      *t = HostTensor(DType::kFP32, {B, P, H, D});
      t->fill_random(rng);
      for (int64_t b = 0; b < B; ++b)
        for (int64_t p = 0; p < P; ++p) {
          const int32_t r = pm.real_rows.data_as<int32_t>()[b * P + p];
          if (r < 0) continue;
          for (int64_t i = 0; i < H * D; ++i) t->set((b * P + p) * H * D + i, src->get((b * S + r) * H * D + i));
        }
    }
  }
};

// [B, S or P, H, D] rows (or [B, H, S or P] for lse) of the padded result at the tokens' positions
// against the original's: fp32 sums over the same terms grouped in other blocks (a few hundred
// terms of size ~1: within 1e-5 relative; a padding row or column let in would be off by O(1)).
void expect_rows_equal(const st::TensorView& padded, const st::TensorView& original, const st::BlockMask& pm,
                       bool lse, const std::string& name) {
  const HostTensor a = HostTensor::copy_of(padded), o = HostTensor::copy_of(original);
  const int64_t B = original.size(0), P = pm.seq_q;
  const int64_t S = lse ? original.size(2) : original.size(1), H = lse ? original.size(1) : original.size(2);
  const int64_t D = lse ? 1 : original.size(3);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t p = 0; p < P; ++p) {
      const int32_t r = pm.real_rows.data_as<int32_t>()[b * P + p];
      if (r < 0) continue;
      for (int64_t h = 0; h < H; ++h)
        for (int64_t d = 0; d < D; ++d) {
          const int64_t ip = lse ? (b * H + h) * P + p : ((b * P + p) * H + h) * D + d;
          const int64_t io = lse ? (b * H + h) * S + r : ((b * S + r) * H + h) * D + d;
          if (a.get(ip) == o.get(io)) continue;  // also lse = -inf of a row with no key (NaN never equals)
          ASSERT_NEAR(a.get(ip), o.get(io), 1e-5 * (1 + std::fabs(o.get(io)))) << name << " batch " << b << " token " << r << " head " << h << " d " << d;
        }
    }
}

TEST(DocPaddedMask, ReferenceOnThePaddedProblemIsTheOriginal) {
  for (const MaskKind kind : {MaskKind::kDocumentCausal, MaskKind::kDocument})
    for (const bool same_ids : {true, false}) {
      SCOPED_TRACE(std::string(st::mask_kind_name(kind)) + (same_ids ? "" : ", other key ids"));
      const int64_t B = 2, seq = 530;
      Padded t(kind, B, seq, 11, same_ids);
      std::mt19937_64 rng(3);
      Problem pr(t.padded.mask, B, seq, rng);
      st::BlockMask original = t.mask.mask;
      original.backward_padded = nullptr;
      st::BlockMask plain = t.padded.mask;  // the padded mask as a mask of its own: no real_rows
      plain.real_rows = {};
      const st::AttentionForward fo = st::block_sparse_attention_forward(pr.q.view(), pr.k.view(), pr.v.view(), original);
      const st::AttentionForward fp = st::block_sparse_attention_forward(pr.pq.view(), pr.pk.view(), pr.pv.view(), plain);
      expect_rows_equal(fp.o.view(), fo.o.view(), t.padded.mask, false, "o");
      expect_rows_equal(fp.lse.view(), fo.lse.view(), t.padded.mask, true, "lse");
      const st::AttentionGrads go = st::block_sparse_attention_backward(pr.q.view(), pr.k.view(), pr.v.view(), fo.o.view(),
                                                                        fo.lse.view(), pr.dout.view(), original);
      const st::AttentionGrads gp = st::block_sparse_attention_backward(
          pr.pq.view(), pr.pk.view(), pr.pv.view(), fp.o.view(), fp.lse.view(), pr.pdout.view(), plain);
      expect_rows_equal(gp.dq.view(), go.dq.view(), t.padded.mask, false, "dq");
      expect_rows_equal(gp.dk.view(), go.dk.view(), t.padded.mask, false, "dk");
      expect_rows_equal(gp.dv.view(), go.dv.view(), t.padded.mask, false, "dv");
      // Attached as backward_padded, the CPU reference (which reads the mask itself) is unchanged.
      const st::AttentionGrads ga = st::block_sparse_attention_backward(pr.q.view(), pr.k.view(), pr.v.view(), fo.o.view(),
                                                                        fo.lse.view(), pr.dout.view(), t.mask.mask);
      for (const auto& [x, y] : {std::pair{&ga.dq, &go.dq}, {&ga.dk, &go.dk}, {&ga.dv, &go.dv}})
        EXPECT_TRUE(st::testing::bytes_equal(x->view(), y->view()));
    }
}

TEST(DocPaddedMask, BadPaddedMasksAreRefusedNamingThem) {
  const int64_t B = 2, seq = 300;
  Padded t(MaskKind::kDocumentCausal, B, seq, 5);
  std::mt19937_64 rng(1);
  Problem pr(t.padded.mask, B, seq, rng);
  const st::AttentionForward f = st::block_sparse_attention_forward(pr.q.view(), pr.k.view(), pr.v.view(), t.mask.mask);
  auto backward = [&](const st::BlockMask& m) {
    return [&pr, &f, m] {
      st::block_sparse_attention_backward(pr.q.view(), pr.k.view(), pr.v.view(), f.o.view(), f.lse.view(),
                                          pr.dout.view(), m);
    };
  };
  {  // a padded mask of another kind
    st::BlockMaskTensors causal = st::build_block_mask(causal_spec(), 384, 384);
    st::BlockMask m = t.mask.mask;
    m.backward_padded = &causal.mask;
    expect_error(backward(m), {"mask.backward_padded", "document", "causal"});
  }
  {  // a token twice
    HostTensor rows = HostTensor::copy_of(t.padded.mask.real_rows);
    for (int64_t p = 1; p < rows.numel(); ++p)
      if (rows.get(p) > 0) {
        rows.set(p, rows.get(p) - 1);
        break;
      }
    st::BlockMask pm = t.padded.mask;
    pm.real_rows = rows.view();
    st::BlockMask m = t.mask.mask;
    m.backward_padded = &pm;
    expect_error(backward(m), {"mask.backward_padded.real_rows", "in order"});
  }
  {  // real_rows of the wrong length, or none
    st::BlockMask pm = t.padded.mask;
    const int64_t shape[2] = {B, pm.seq_q - 1}, strides[2] = {pm.seq_q, 1};
    pm.real_rows = st::TensorView(pm.real_rows.data(), DType::kInt32, shape, strides, 2);
    st::BlockMask m = t.mask.mask;
    m.backward_padded = &pm;
    expect_error(backward(m), {"mask.backward_padded.real_rows", "shape"});
    pm.real_rows = {};
    expect_error(backward(m), {"mask.backward_padded.real_rows"});
  }
  // A padded mask passed as the mask itself.
  expect_error([&] { st::block_sparse_attention_forward(pr.pq.view(), pr.pk.view(), pr.pv.view(), t.padded.mask); },
               {"mask.real_rows", "backward_padded"});
  // The builder's own refusals.
  expect_error([&] { st::build_doc_padded_mask(t.spec, seq, 64); }, {"min_length", ">= 128", "64"});
  expect_error([&] { st::build_doc_padded_mask(causal_spec(), seq, 128); }, {"spec.kind", "document"});
  HostTensor big = HostTensor::copy_of(t.ids.view());
  big.set(5, double(INT32_MAX - 1));  // no room for the padding ids
  st::MaskSpec too_big = t.spec;
  too_big.doc_kv = big.view();
  expect_error([&] { st::build_doc_padded_mask(too_big, seq, 128); }, {"spec.doc_kv", "2^31 - 2", "2147483646"});
}

}  // namespace

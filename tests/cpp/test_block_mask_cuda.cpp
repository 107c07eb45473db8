// GPU tests of build_block_mask on a CUDA device (skipped, visibly, without a GPU): for every
// built-in kind, odd geometries (rows and columns longer than one CTA's threads included),
// per-batch, broadcast and unsorted document ids, each schedule kind and sub-tile factors, the
// device-built tensors (forward lists, transposes, write orders) equal the host builder's bit for
// bit; the device mask passes validation and the write-order check once copied back; document ids
// converted from cu_seqlens on the device equal the host conversion. (The build time is a
// bench: bench/bench_block_mask_build.cpp.)
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "device_tensor.h"
#include "common/attention/cu_seqlens.h"
#include "common/attention/doc_padding.h"
#include "sparsetrain/block_mask.h"
#include "sparsetrain/cu_seqlens.h"

namespace st = sparsetrain;
using st::testing::DeviceTensor;
using st::testing::HostTensor;
using st::testing::to_host;

namespace {

struct Case {
  st::MaskKind kind;
  int64_t seq_q, seq_kv, block_q, block_kv, batch;
  int64_t left = -1, right = -1, prefix = 0;
};

HostTensor documents(int64_t batch, int64_t seq, std::mt19937& rng) {
  HostTensor d(st::DType::kInt32, {batch, seq});
  std::uniform_int_distribution<int64_t> len(1, std::max<int64_t>(2, seq / 3));
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t s = 0, id = 0; s < seq; ++id)
      for (int64_t n = len(rng); n > 0 && s < seq; --n) d.set(b * seq + s++, double(id));
  return d;
}

std::vector<std::pair<const char*, st::TensorView*>> tensors(st::BlockMask& m) {
  return {{"kv_num_blocks", &m.kv_num_blocks},       {"kv_indices", &m.kv_indices},
          {"full_kv_num_blocks", &m.full_kv_num_blocks}, {"full_kv_indices", &m.full_kv_indices},
          {"q_num_blocks", &m.q_num_blocks},         {"q_indices", &m.q_indices},
          {"full_q_num_blocks", &m.full_q_num_blocks}, {"full_q_indices", &m.full_q_indices},
          {"dq_write_order", &m.dq_write_order},     {"dq_write_order_full", &m.dq_write_order_full}};
}

// Builds spec on the host (document ids: host_q / host_kv) and on the device (dev_q / dev_kv)
// with options o and expects the same tensors bit for bit, a valid mask and a valid write order.
void expect_device_build_equals_host(st::MaskSpec spec, int64_t seq_q, int64_t seq_kv, st::BlockMaskOptions o,
                                     const HostTensor* host_q, const HostTensor* host_kv, const DeviceTensor* dev_q,
                                     const DeviceTensor* dev_kv) {
  const bool doc = host_q != nullptr;
  if (doc) spec.doc_q = host_q->view(), spec.doc_kv = host_kv->view();
  o.device = st::Device::cpu();
  const st::BlockMaskTensors host = st::build_block_mask(spec, seq_q, seq_kv, o);
  o.device = st::Device::cuda(0);
  if (doc) spec.doc_q = dev_q->view(), spec.doc_kv = dev_kv->view();
  const st::BlockMaskTensors dev = st::build_block_mask(spec, seq_q, seq_kv, o);
  st::BlockMask expected = host.mask, back = dev.mask;  // back: the device mask copied to the host
  const auto h = tensors(expected), d = tensors(back);
  std::vector<HostTensor> keep;
  keep.reserve(d.size());
  for (size_t i = 0; i < h.size(); ++i) {
    keep.push_back(to_host(*d[i].second));
    EXPECT_TRUE(keep.back().bytes_equal(HostTensor::copy_of(*h[i].second))) << d[i].first;
    *d[i].second = keep.back().view();
  }
  if (doc) back.spec.doc_q = host_q->view(), back.spec.doc_kv = host_kv->view();
  EXPECT_NO_THROW(st::validate_block_mask(back));
  EXPECT_EQ(st::check_write_order(back), "");
}

std::vector<st::ColumnSchedule> every_schedule_kind(int64_t Nk, std::mt19937& rng) {
  std::vector<st::ColumnSchedule> schedules(3);
  schedules[1].kind = st::ScheduleKind::kShortestFirst;
  schedules[2].kind = st::ScheduleKind::kPermutation;
  for (int64_t n = 0; n < Nk; ++n) schedules[2].permutation.push_back(int32_t(n));
  std::shuffle(schedules[2].permutation.begin(), schedules[2].permutation.end(), rng);
  return schedules;
}

}  // namespace

TEST(BlockMaskCuda, DeviceBuildEqualsTheHostBuildForEveryKindAndSchedule) {
  REQUIRE_GPU();
  std::mt19937 rng(7);
  const Case cases[] = {
      {st::MaskKind::kFull, 300, 300, 128, 128, 1},
      {st::MaskKind::kCausal, 1000, 1000, 128, 128, 1},
      {st::MaskKind::kCausalBottomRight, 333, 700, 64, 128, 1},
      {st::MaskKind::kSlidingWindow, 900, 900, 128, 64, 1, 200, 0},
      {st::MaskKind::kSlidingWindow, 513, 777, 64, 64, 1, 100, 50},
      {st::MaskKind::kDocument, 611, 611, 128, 128, 3},
      {st::MaskKind::kDocumentCausal, 1031, 1031, 128, 128, 2},
      {st::MaskKind::kPrefixLM, 800, 800, 128, 128, 1, -1, -1, 300},
      // Rows and columns longer than one CTA's threads (the builder's kernels loop over chunks).
      {st::MaskKind::kCausal, 40000, 40000, 128, 64, 1},
      {st::MaskKind::kSlidingWindow, 20000, 33000, 64, 128, 1, 3000, 500},
      {st::MaskKind::kDocumentCausal, 20000, 20000, 64, 64, 2},
  };
  for (const Case& c : cases) {
    st::MaskSpec spec;
    spec.kind = c.kind;
    spec.window_left = c.left;
    spec.window_right = c.right;
    spec.prefix_length = c.prefix;
    HostTensor doc_q, doc_kv;
    DeviceTensor ddoc_q, ddoc_kv;
    const bool doc = c.kind == st::MaskKind::kDocument || c.kind == st::MaskKind::kDocumentCausal;
    if (doc) {
      doc_q = documents(c.batch, c.seq_q, rng);
      doc_kv = doc_q;
      ddoc_q = DeviceTensor(doc_q);
      ddoc_kv = DeviceTensor(doc_kv);
    }
    const int64_t Nk = (c.seq_kv + c.block_kv - 1) / c.block_kv;
    for (const st::ColumnSchedule& schedule : every_schedule_kind(Nk, rng)) {
        SCOPED_TRACE(spec.str() + " Sq " + std::to_string(c.seq_q) + " Skv " + std::to_string(c.seq_kv) + " " +
                     schedule.str());
        st::BlockMaskOptions o;
        o.block_q = c.block_q;
        o.block_kv = c.block_kv;
        o.auto_schedule = false;
        o.schedule = schedule;
        expect_device_build_equals_host(spec, c.seq_q, c.seq_kv, o, doc ? &doc_q : nullptr, doc ? &doc_kv : nullptr,
                                        doc ? &ddoc_q : nullptr, doc ? &ddoc_kv : nullptr);
      }
  }
}

// The backward's padded document mask built on the device (build_doc_padded_mask: the layout at
// the length bound, doc_pad_token_step scanned per batch row, then the device lists) against the
// host build: the same ids and real rows up to the host's padded length (the longest row's) and
// padding after it, and lists equal bit for bit to the host builder's over the copied-back padded
// ids; rows longer than the layout kernel's 1024 threads, documents of 1 to 3000 tokens, min
// lengths 128 and 1024; key ids the query ids or (the last case) other ones (every third
// document's moved past the query ids, as cu_seqlens' own ids past the last document).
// Cases over one and many 2048-token chunks of the device layout (a document across several), ids
// that come back later in the row (id % 2: each run is its own document), other key ids, and a
// row of over 256 chunks (the chunks before a chunk composed in more than one round; its lists
// are not compared: the host build of them alone would take seconds).
TEST(BlockMaskCuda, DocPaddedMaskOnTheDeviceEqualsTheHostOne) {
  REQUIRE_GPU();
  std::mt19937 rng(28);
  struct Case {
    int64_t batch, seq, min_length;
    bool same_ids;
    int recur;  // ids modulo this, if not 0
  };
  for (const Case& c : {Case{2, 1031, 128, true, 0}, Case{3, 9000, 128, true, 0}, Case{1, 20000, 1024, true, 0},
                        Case{1, 5000, 128, true, 0}, Case{2, 4000, 128, false, 0}, Case{2, 30000, 128, true, 2},
                        Case{1, 600000, 1024, true, 0}}) {
    const auto [batch, seq, min_length, same_ids, recur] = c;
    SCOPED_TRACE("B " + std::to_string(batch) + " S " + std::to_string(seq) + " min " + std::to_string(min_length) +
                 (same_ids ? "" : ", other key ids") + (recur ? ", ids modulo " + std::to_string(recur) : ""));
    HostTensor ids(st::DType::kInt32, {batch, seq}), kv_ids(st::DType::kInt32, {batch, seq});
    for (int64_t b = 0; b < batch; ++b)
      for (int64_t s = 0, id = 0; s < seq; ++id)
        for (int64_t n = 1 + int64_t(rng() % 3000); n > 0 && s < seq; --n, ++s) {
          const int64_t q_id = recur ? id % recur : id;
          ids.set(b * seq + s, double(q_id));
          kv_ids.set(b * seq + s, double(q_id + (!same_ids && id % 3 == 2 ? 10000 : 0)));
        }
    const DeviceTensor dids(ids), dkv_ids(kv_ids);
    st::MaskSpec spec;
    spec.kind = st::MaskKind::kDocumentCausal;
    spec.doc_q = ids.view();
    spec.doc_kv = same_ids ? ids.view() : kv_ids.view();
    st::BlockMaskOptions o;
    o.auto_schedule = false;
    st::MaskSpec dspec = spec;
    dspec.doc_q = dids.view();
    dspec.doc_kv = same_ids ? dids.view() : dkv_ids.view();
    o.device = st::Device::cuda(0);
    const st::BlockMaskTensors dev = st::build_doc_padded_mask(dspec, seq, min_length, o);
    const int64_t P = dev.mask.seq_q;
    EXPECT_EQ(P, st::doc_padded_length_bound(seq, min_length));
    const HostTensor rows = to_host(dev.real_rows.view()), q = to_host(dev.doc_q.view()), kv = to_host(dev.doc_kv.view());
    // Each row against the host builder's layout functions (its rows past its own padded length:
    // padding, as in a mask padded to the longest row's length).
    for (int64_t b = 0; b < batch; ++b) {
      const int32_t* row_q = ids.view().data_as<const int32_t>() + b * seq;
      const int32_t* row_kv = (same_ids ? ids : kv_ids).view().data_as<const int32_t>() + b * seq;
      int64_t length = 0;
      const std::vector<int64_t> pos = st::doc_padded_positions(row_q, seq, min_length, &length);
      ASSERT_LE(length, P);
      std::vector<int32_t> want_q, want_kv, want_rows(size_t(P), -1);
      st::doc_padded_ids(row_q, row_kv, seq, pos, P, &want_q, &want_kv);
      for (int64_t s = 0; s < seq; ++s) want_rows[size_t(pos[size_t(s)])] = int32_t(s);
      for (int64_t p = 0; p < P; ++p) {
        const int64_t i = b * P + p;
        ASSERT_EQ(rows.get(i), want_rows[size_t(p)]) << "real row, batch " << b << " position " << p;
        ASSERT_EQ(q.get(i), want_q[size_t(p)]) << "query id, batch " << b << " position " << p;
        ASSERT_EQ(kv.get(i), want_kv[size_t(p)]) << "key id, batch " << b << " position " << p;
      }
    }
    if (seq > 100000) continue;
    // The device lists against the host builder over the same padded ids.
    st::MaskSpec back = spec;
    back.doc_q = q.view();
    back.doc_kv = kv.view();
    o.device = st::Device::cpu();
    const st::BlockMaskTensors want = st::build_block_mask(back, P, P, o);
    st::BlockMask expected = want.mask, got = dev.mask;
    const auto w = tensors(expected), g = tensors(got);
    for (size_t t = 0; t < w.size(); ++t)
      EXPECT_TRUE(to_host(*g[t].second).bytes_equal(HostTensor::copy_of(*w[t].second))) << g[t].first;
  }
}

TEST(BlockMaskCuda, DeviceBuildEqualsTheHostBuildForBroadcastAndUnsortedDocumentIds) {
  REQUIRE_GPU();
  std::mt19937 rng(11);
  const int64_t Sq = 700, Skv = 900;
  // Per-batch q ids, one kv row for both (broadcast); then random small ids (not sorted: the
  // element fallback) on both sides.
  const HostTensor sorted_q = documents(2, Sq, rng), sorted_kv = documents(1, Skv, rng);
  HostTensor random_q(st::DType::kInt32, {2, Sq}), random_kv(st::DType::kInt32, {2, Skv});
  for (int64_t i = 0; i < random_q.numel(); ++i) random_q.set(i, double(rng() % 3));
  for (int64_t i = 0; i < random_kv.numel(); ++i) random_kv.set(i, double(rng() % 4));
  using Ids = std::pair<const HostTensor*, const HostTensor*>;
  for (const auto& [hq, hkv] : {Ids(&sorted_q, &sorted_kv), Ids(&random_q, &random_kv)}) {
    const DeviceTensor dq(*hq), dkv(*hkv);
    for (st::MaskKind kind : {st::MaskKind::kDocument, st::MaskKind::kDocumentCausal}) {
      st::MaskSpec spec;
      spec.kind = kind;
      st::BlockMaskOptions o;
      o.block_q = 64;
      o.block_kv = 128;
      o.auto_schedule = false;
      for (const st::ColumnSchedule& schedule : every_schedule_kind((Skv + 127) / 128, rng)) {
        SCOPED_TRACE(spec.str() + " kv batch " + std::to_string(hkv->view().size(0)) + " " + schedule.str());
        o.schedule = schedule;
        expect_device_build_equals_host(spec, Sq, Skv, o, hq, hkv, &dq, &dkv);
      }
    }
  }
}

// FlashAttention's cu_seqlens converted on the device (src/cuda/block_mask/cu_seqlens_cuda.cu) give
// the host conversion's ids bit for bit: documents of lengths 1 .. 3000 with empty ones, padding
// past the last offset, Sq != Skv, more positions than one grid has threads, and
// decreasing offsets (invalid, unchecked on the device: the same ids as the host function, no
// out-of-range read); then the device mask from them equals the host one.
TEST(BlockMaskCuda, CuSeqlensOnTheDeviceGiveTheHostIds) {
  REQUIRE_GPU();
  struct Packing {
    std::vector<int32_t> q_lengths, k_lengths;
    int64_t seq_q, seq_kv;
  };
  // 40000 documents of 0..1199 positions (~24M): more positions than the kernel's largest grid
  // has threads (65535 x 256), so the grid-stride loop takes a second turn.
  std::vector<int32_t> many(40000, 0);
  std::mt19937 rng(5);
  for (int32_t& l : many) l = int32_t(rng() % 1200);
  int64_t many_total = 0;
  for (int32_t l : many) many_total += l;
  const std::vector<Packing> packings = {
      {{1, 2, 63, 64, 0, 65, 127, 128, 129, 3000}, {1, 2, 63, 64, 0, 65, 127, 128, 129, 3000}, 3579, 3579},
      {{1, 2, 63, 64, 0, 65, 127, 128, 129, 3000}, {1, 2, 63, 64, 0, 65, 127, 128, 129, 3000}, 3700, 3700},
      {{129, 1, 3000, 2, 65}, {64, 700, 1, 127, 128}, 3300, 1100},
      {many, many, many_total + 17, many_total + 17},
  };
  auto offsets = [](const std::vector<int32_t>& lengths) {
    HostTensor t(st::DType::kInt32, {int64_t(lengths.size()) + 1});
    int64_t sum = 0;
    t.set(0, 0.0);
    for (size_t i = 0; i < lengths.size(); ++i) t.set(int64_t(i) + 1, double(sum += lengths[i]));
    return t;
  };
  ASSERT_GT(many_total, int64_t(65535) * 256);
  for (const Packing& p : packings) {
    SCOPED_TRACE("Sq " + std::to_string(p.seq_q) + " Skv " + std::to_string(p.seq_kv));
    const HostTensor hq = offsets(p.q_lengths), hk = offsets(p.k_lengths);
    const DeviceTensor dq(hq), dk(hk);
    const st::DocumentIds host = st::document_ids_from_cu_seqlens(hq.view(), hk.view(), p.seq_q, p.seq_kv);
    const st::DocumentIds dev = st::document_ids_from_cu_seqlens(dq.view(), dk.view(), p.seq_q, p.seq_kv);
    ASSERT_TRUE(dev.doc_q.view().device().is_cuda());
    EXPECT_TRUE(HostTensor::copy_of(host.doc_q.view()).bytes_equal(to_host(dev.doc_q.view())));
    EXPECT_TRUE(HostTensor::copy_of(host.doc_kv.view()).bytes_equal(to_host(dev.doc_kv.view())));
    if (p.seq_q > 100000) continue;  // the ids were the point; masks of short packings below
    st::BlockMaskOptions o;
    o.auto_schedule = false;
    o.schedule.kind = st::ScheduleKind::kShortestFirst;
    DeviceTensor ddq, ddk;  // the device conversion's ids: the device build reads them
    ddq.t = dev.doc_q;
    ddk.t = dev.doc_kv;
    const HostTensor hdq = HostTensor::copy_of(host.doc_q.view()), hdk = HostTensor::copy_of(host.doc_kv.view());
    for (st::MaskKind kind : {st::MaskKind::kDocument, st::MaskKind::kDocumentCausal}) {
      st::MaskSpec spec;
      spec.kind = kind;
      expect_device_build_equals_host(spec, p.seq_q, p.seq_kv, o, &hdq, &hdk, &ddq, &ddk);
    }
  }
  // Decreasing (invalid) offsets: not checked on the device; the kernel's ids are the host function's.
  const std::vector<int32_t> bad = {0, 50, 10, 30, 5, 40};
  HostTensor hbad(st::DType::kInt32, {6});
  for (int64_t i = 0; i < 6; ++i) hbad.set(i, bad[size_t(i)]);
  const DeviceTensor dbad(hbad);
  const st::DocumentIds ids = st::document_ids_from_cu_seqlens(dbad.view(), dbad.view(), 64, 64);
  const HostTensor got = to_host(ids.doc_q.view());
  for (int64_t p = 0; p < 64; ++p)
    EXPECT_EQ(got.get(p), double(st::document_of_position(bad.data(), 5, p, 5))) << p;
}

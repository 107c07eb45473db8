// The backward kernel's index math on the CPU (common/attention/attention_bwd_walk.h): a kv column's walk
// for one query head visits exactly the kernel q tiles (64 rows) of the q blocks it touches, partial
// and full merged in ascending q-block order (descending: the same visits reversed); an item's walk
// visits the same (q tile, head) set under both WalkOrders, descending with the heads innermost (or,
// per-head masks, one head after the other), each with its stored dQ turn and (bitmask masks) its
// partial block's entry in the forward list, against a naive oracle on random block matrices and
// mask functions (broadcast leading dims, GQA, Sq not a multiple of the tiles, 128 / 256 blocks,
// every schedule kind); compact index tensors walk the same; a bad device mask (counts outside
// [0, width], ids outside [0, Mq), unsorted lists, missing forward entries) is clamped or skipped
// and never read past; the walks' turns are deadlock- and race-free per q-tile semaphore in the
// scheduler model at any worker count; and q tiles map one to one onto semaphores.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <numeric>
#include <ostream>
#include <random>
#include <set>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

#include "common/attention/attention_bwd_walk.h"
#include "common/attention/dq_schedule_model.h"
#include "host_tensor.h"
#include "sparsetrain/block_mask.h"

namespace st = sparsetrain;
using st::testing::HostTensor;

namespace {

constexpr int32_t kTileQ = 64;  // the backward kernel's q tile (rows)

// The lists as the kernel reads them; the column walks ascending unless told (the oracle's order).
st::MaskColumnLists column_lists(const st::BlockMask& m, st::BwdWalkShape walk = {false, false}) {
  st::MaskColumnLists l;
  l.walk = walk;
  l.partial_count = st::mask_index_view(m.q_num_blocks);
  l.partial_index = st::mask_index_view(m.q_indices);
  l.full_count = st::mask_index_view(m.full_q_num_blocks);
  l.full_index = st::mask_index_view(m.full_q_indices);
  l.partial_turn = st::mask_index_view(m.dq_write_order);
  l.full_turn = st::mask_index_view(m.dq_write_order_full);
  l.kv_count = st::mask_index_view(m.kv_num_blocks);
  l.kv_index = st::mask_index_view(m.kv_indices);
  l.find_bit_entry = m.spec.kind == st::MaskKind::kBitmask;
  l.num_q_blocks = int32_t(m.num_q_blocks());
  l.q_tiles_per_block = int32_t(m.block_q / kTileQ);
  l.num_q_tiles = int32_t((m.seq_q + kTileQ - 1) / kTileQ);
  return l;
}

struct Visit {
  int32_t q_block, q_tile, turn, bit_entry;
  bool partial;
  bool operator==(const Visit& o) const {
    return std::tie(q_block, q_tile, turn, bit_entry, partial) ==
           std::tie(o.q_block, o.q_tile, o.turn, o.bit_entry, o.partial);
  }
};
[[maybe_unused]] std::ostream& operator<<(std::ostream& os, const Visit& v) {
  return os << "{block " << v.q_block << ", tile " << v.q_tile << ", turn " << v.turn << ", bit " << v.bit_entry
            << (v.partial ? ", partial}" : ", full}");
}

// The whole walk of column n for (b, h); stops (and fails) after `cap` visits.
std::vector<Visit> walk(const st::MaskColumnLists& l, int64_t b, int64_t h, int32_t n, size_t cap = 1u << 20) {
  std::vector<Visit> out;
  st::BwdColumnCursor c = st::bwd_column_begin(l, b, h, n);
  st::BwdVisit v{};
  while (st::bwd_column_next(l, b, h, n, c, &v)) {
    out.push_back({v.q_block, v.q_tile, v.turn, v.bit_entry, v.partial});
    if (out.size() > cap) {
      ADD_FAILURE() << "the walk of column " << n << " does not end";
      return out;
    }
  }
  EXPECT_FALSE(st::bwd_column_next(l, b, h, n, c, &v)) << "a finished walk stays finished";
  return out;
}

// Hand-out positions of the columns under a schedule, computed here (not by the library).
std::vector<int64_t> positions_of(const st::ColumnSchedule& s, int64_t Nk) {
  std::vector<int64_t> pos(static_cast<size_t>(Nk));
  for (int64_t n = 0; n < Nk; ++n) {
    switch (s.kind) {
      case st::ScheduleKind::kLeftToRight: pos[size_t(n)] = n; break;
      case st::ScheduleKind::kShortestFirst: pos[size_t(n)] = Nk - 1 - n; break;
      case st::ScheduleKind::kPermutation: pos[size_t(s.permutation[size_t(n)])] = n; break;
    }
  }
  return pos;
}

// The naive walk of column n over a dense class matrix [Mq, Nk] (0 skipped, 1 partial, 2 full):
// the touched q blocks ascending, each as its kernel q tiles (clipped to the sequence); the turn
// is n's rank among the columns touching m in hand-out order (block units); bit_entry (bitmask
// masks) is n's position among row m's partial blocks.
std::vector<Visit> oracle_walk(const std::vector<uint8_t>& cls, int64_t Mq, int64_t Nk, int32_t n,
                               const std::vector<int64_t>& pos, int32_t tiles_per_block,
                               int32_t num_q_tiles, bool bitmask) {
  std::vector<Visit> out;
  for (int32_t m = 0; m < Mq; ++m) {
    const uint8_t c = cls[size_t(m * Nk + n)];
    if (c == 0) continue;
    int32_t rank = 0, entry = 0;
    for (int64_t k = 0; k < Nk; ++k) {
      const uint8_t ck = cls[size_t(m * Nk + k)];
      if (ck != 0 && pos[size_t(k)] < pos[size_t(n)]) ++rank;
      if (ck == 1 && k < n) ++entry;
    }
    const int32_t end = std::min((m + 1) * tiles_per_block, num_q_tiles);
    for (int32_t t = m * tiles_per_block; t < end; ++t)
      out.push_back({m, t, rank, bitmask && c == 1 ? entry : -1, c == 1});
  }
  return out;
}

st::ColumnSchedule schedule_of(st::ScheduleKind k, std::vector<int32_t> perm = {}) {
  st::ColumnSchedule s;
  s.kind = k;
  s.permutation = std::move(perm);
  return s;
}

// A schedule of each kind in turn (kind % 3), the permutation random.
st::ColumnSchedule pick_schedule(int kind, int64_t Nk, std::mt19937& rng) {
  if (kind % 3 == 0) return schedule_of(st::ScheduleKind::kLeftToRight);
  if (kind % 3 == 1) return schedule_of(st::ScheduleKind::kShortestFirst);
  std::vector<int32_t> p(static_cast<size_t>(Nk));
  std::iota(p.begin(), p.end(), 0);
  std::shuffle(p.begin(), p.end(), rng);
  return schedule_of(st::ScheduleKind::kPermutation, p);
}

// A sequence length in [lo, hi] that is not a multiple of 64 (so neither of 128 nor 256).
int64_t ragged_length(std::mt19937& rng, int64_t lo, int64_t hi) {
  int64_t s = lo + int64_t(rng() % uint32_t(hi - lo + 1));
  if (s % kTileQ == 0) s += 1 + int64_t(rng() % 63);
  return s;
}

// A random block matrix case: the attention's batch / query heads, the mask's (broadcast) ones.
struct BlocksCase {
  int64_t B, Hq, mb, mh, Sq, Skv, block_q, block_kv;
  HostTensor blocks;
  st::BlockMaskTensors t;
  std::string what;
};

BlocksCase random_blocks_case(std::mt19937& rng, int64_t max_seq, int64_t gqa = 0) {
  BlocksCase c;
  const int64_t hq_choices[] = {1, 2, 4, 8};
  c.B = 1 + int64_t(rng() % 3);
  c.Hq = gqa > 0 ? gqa * (1 + int64_t(rng() % 2)) : hq_choices[rng() % 4];
  const int bcast = int(rng() % 4);  // which leading dims the mask has: none, B, H, both
  c.mb = bcast & 1 ? c.B : 1;
  c.mh = bcast & 2 ? c.Hq : 1;
  c.block_q = rng() % 2 ? 128 : 256;
  c.block_kv = rng() % 2 ? 128 : 256;
  c.Sq = ragged_length(rng, 1, max_seq);
  c.Skv = 1 + int64_t(rng() % uint32_t(max_seq));
  const int64_t Mq = (c.Sq + c.block_q - 1) / c.block_q, Nk = (c.Skv + c.block_kv - 1) / c.block_kv;
  c.blocks = HostTensor(st::DType::kUInt8, {c.mb, c.mh, Mq, Nk});
  std::uniform_real_distribution<double> u(0, 1);
  const double density = u(rng), full_share = u(rng);
  for (int64_t i = 0; i < c.blocks.numel(); ++i) c.blocks.set(i, u(rng) < density ? (u(rng) < full_share ? 2 : 1) : 0);
  st::BlockMaskOptions o;
  o.block_q = c.block_q;
  o.block_kv = c.block_kv;
  const int kind = int(rng() % 4);
  o.auto_schedule = kind == 3;
  if (kind < 3) o.schedule = pick_schedule(kind, Nk, rng);
  c.t = st::build_block_mask_from_blocks(c.blocks.view(), c.Sq, c.Skv, o);
  c.what = "B " + std::to_string(c.B) + " Hq " + std::to_string(c.Hq) + " mask [" + std::to_string(c.mb) + ", " +
           std::to_string(c.mh) + "] Sq " + std::to_string(c.Sq) + " Skv " + std::to_string(c.Skv) + " blocks " +
           std::to_string(c.block_q) + "x" + std::to_string(c.block_kv) + " density " + std::to_string(density) +
           " " + c.t.mask.schedule.str();
  return c;
}

// The class matrix [Mq, Nk] of slice (b, h) of the attention in a [mb, mh, Mq, Nk] block matrix.
std::vector<uint8_t> classes_at(const HostTensor& blocks, int64_t mb, int64_t mh, int64_t Mq, int64_t Nk, int64_t b,
                                int64_t h) {
  const int64_t bb = mb == 1 ? 0 : b, hh = mh == 1 ? 0 : h;
  const auto* p = static_cast<const uint8_t*>(blocks.data()) + (bb * mh + hh) * Mq * Nk;
  return std::vector<uint8_t>(p, p + Mq * Nk);
}

// A compact copy of an index tensor [B, H, R, W] (and its parallel ones): width `w`, contiguous.
HostTensor compact_copy(const st::TensorView& t, int64_t w) {
  HostTensor out(st::DType::kInt32, {t.size(0), t.size(1), t.size(2), w});
  int32_t* dst = static_cast<int32_t*>(out.data());
  for (int64_t b = 0; b < t.size(0); ++b)
    for (int64_t h = 0; h < t.size(1); ++h)
      for (int64_t r = 0; r < t.size(2); ++r)
        for (int64_t i = 0; i < w; ++i)
          *dst++ = *reinterpret_cast<const int32_t*>(
              t.byte_ptr(b * t.stride(0) + h * t.stride(1) + r * t.stride(2) + i * t.stride(3)));
  return out;
}

// A view of the first w entries of the last dim (same strides).
st::TensorView sliced(const st::TensorView& t, int64_t w) {
  const int64_t shape[4] = {t.size(0), t.size(1), t.size(2), w};
  const int64_t strides[4] = {t.stride(0), t.stride(1), t.stride(2), t.stride(3)};
  return st::TensorView(t.data(), t.dtype(), shape, strides, 4, t.device());
}

int64_t max_count(const st::TensorView& counts) {
  if (!counts.defined()) return 0;
  const HostTensor c = HostTensor::copy_of(counts);
  int64_t m = 0;
  for (int64_t i = 0; i < c.numel(); ++i) m = std::max(m, int64_t(c.get(i)));
  return m;
}

// ---- 1. the walk against the naive oracle --------------------------------------------------

TEST(AttentionBwdWalk, RandomBlockMatricesWalkLikeTheOracle) {
  std::mt19937 rng(20240611);
  int64_t visits = 0, multi_tile_blocks = 0, clipped_blocks = 0;
  std::set<std::tuple<int64_t, int64_t, int>> seen_geo;  // (block_q, block_kv, schedule kind)
  for (int i = 0; i < 1000; ++i) {
    BlocksCase c = random_blocks_case(rng, 1500);
    SCOPED_TRACE("case " + std::to_string(i) + ": " + c.what);
    const st::BlockMask& m = c.t.mask;
    ASSERT_NO_THROW(st::validate_block_mask(m, c.B, c.Hq));
    seen_geo.insert({c.block_q, c.block_kv, int(m.schedule.kind)});
    const st::MaskColumnLists l = column_lists(m);
    ASSERT_EQ(l.q_tiles_per_block, c.block_q / 64);
    const int64_t Mq = m.num_q_blocks(), Nk = m.num_kv_blocks();
    const std::vector<int64_t> pos = positions_of(m.schedule, Nk);
    for (int64_t b = 0; b < c.B; ++b)
      for (int64_t h = 0; h < c.Hq; ++h) {
        const std::vector<uint8_t> cls = classes_at(c.blocks, c.mb, c.mh, Mq, Nk, b, h);
        for (int32_t n = 0; n < Nk; ++n) {
          const std::vector<Visit> got = walk(l, b, h, n);
          const std::vector<Visit> want =
              oracle_walk(cls, Mq, Nk, n, pos, l.q_tiles_per_block, l.num_q_tiles, false);
          ASSERT_EQ(got, want) << "b " << b << " h " << h << " column " << n;
          visits += int64_t(got.size());
        }
        for (int32_t q = 0; q < Mq; ++q)
          for (int32_t n = 0; n < Nk; ++n)
            if (cls[size_t(q * Nk + n)] != 0) {
              multi_tile_blocks += l.q_tiles_per_block > 1;
              clipped_blocks += (q + 1) * l.q_tiles_per_block > l.num_q_tiles;
            }
      }
  }
  EXPECT_EQ(seen_geo.size(), 2u * 2u * 3u) << "every block size pair under every schedule kind";
  EXPECT_GT(multi_tile_blocks, 0);
  EXPECT_GT(clipped_blocks, 0) << "some last q blocks are cut short";
  std::printf("%lld q-tile visits checked\n", (long long)visits);
}

// A mask function (bitmask mask): a causal band per head with holes per batch row.
struct FnCtx {
  int64_t window, period;
};
bool band_with_holes(void* p, int64_t b, int64_t h, int64_t q, int64_t kv) {
  const FnCtx& x = *static_cast<const FnCtx*>(p);
  return (kv <= q && q - kv <= x.window + 97 * h) || (kv + 3 * b) % x.period == 0;
}

TEST(AttentionBwdWalk, BitmaskMasksFindEachPartialBlocksForwardEntry) {
  std::mt19937 rng(77);
  int64_t partial_visits = 0;
  for (int i = 0; i < 24; ++i) {
    const int64_t B = 1 + int64_t(rng() % 2), Hq = rng() % 2 ? 1 : 3;
    const int64_t mb = rng() % 2 ? B : 1, mh = rng() % 2 ? Hq : 1;
    st::BlockMaskOptions o;
    o.block_q = rng() % 2 ? 128 : 256;
    o.block_kv = rng() % 2 ? 128 : 256;
    const int64_t Sq = ragged_length(rng, 1, 700), Skv = 1 + int64_t(rng() % 700);
    const int64_t Nk = (Skv + o.block_kv - 1) / o.block_kv;
    o.auto_schedule = false;
    o.schedule = pick_schedule(i, Nk, rng);
    FnCtx ctx{int64_t(rng() % 300), 40 + int64_t(rng() % 400)};
    const st::BlockMaskTensors t = st::build_block_mask_from_function(band_with_holes, &ctx, mb, mh, Sq, Skv, o);
    const st::BlockMask& m = t.mask;
    SCOPED_TRACE("case " + std::to_string(i) + ": Sq " + std::to_string(Sq) + " Skv " + std::to_string(Skv) +
                 " blocks " + std::to_string(o.block_q) + "x" + std::to_string(o.block_kv) + " " + m.schedule.str());
    ASSERT_NO_THROW(st::validate_block_mask(m, B, Hq));
    ASSERT_EQ(m.spec.kind, st::MaskKind::kBitmask);
    const st::MaskColumnLists l = column_lists(m);
    ASSERT_TRUE(l.find_bit_entry);
    const int64_t Mq = m.num_q_blocks();
    const std::vector<int64_t> pos = positions_of(m.schedule, Nk);
    const st::TensorView& bits = m.partial_bitmasks;
    const int64_t bytes = bits.size(4);
    for (int64_t b = 0; b < B; ++b)
      for (int64_t h = 0; h < Hq; ++h) {
        const int64_t fb = mb == 1 ? 0 : b, fh = mh == 1 ? 0 : h;  // the mask function's (b, h)
        // Dense classes by brute force over the elements inside the sequences.
        std::vector<uint8_t> cls(size_t(Mq * Nk));
        for (int64_t q0 = 0; q0 < Mq; ++q0)
          for (int64_t n = 0; n < Nk; ++n) {
            int64_t allowed = 0, total = 0;
            for (int64_t q = q0 * o.block_q; q < std::min((q0 + 1) * o.block_q, Sq); ++q)
              for (int64_t kv = n * o.block_kv; kv < std::min((n + 1) * o.block_kv, Skv); ++kv, ++total)
                allowed += band_with_holes(&ctx, fb, fh, q, kv);
            cls[size_t(q0 * Nk + n)] = allowed == 0 ? 0 : allowed == total ? 2 : 1;
          }
        for (int32_t n = 0; n < Nk; ++n) {
          const std::vector<Visit> got = walk(l, b, h, n);
          ASSERT_EQ(got, oracle_walk(cls, Mq, Nk, n, pos, l.q_tiles_per_block, l.num_q_tiles, true))
              << "b " << b << " h " << h << " column " << n;
          // The entry's bitmask is this block's: bit (i * block_kv + j) = element (q0 + i, kv0 + j).
          for (const Visit& v : got) {
            if (!v.partial || v.q_tile != v.q_block * l.q_tiles_per_block) continue;
            ++partial_visits;
            ASSERT_GE(v.bit_entry, 0);
            ASSERT_LT(v.bit_entry, bits.size(3));
            const auto* blk = reinterpret_cast<const uint8_t*>(bits.byte_ptr(
                fb * bits.stride(0) + fh * bits.stride(1) + v.q_block * bits.stride(2) + v.bit_entry * bits.stride(3)));
            for (int64_t bit = 0; bit < bytes * 8; ++bit) {
              const int64_t q = v.q_block * o.block_q + bit / o.block_kv, kv = n * o.block_kv + bit % o.block_kv;
              const bool want = q < Sq && kv < Skv && band_with_holes(&ctx, fb, fh, q, kv);
              ASSERT_EQ(bool((blk[bit / 8] >> (bit % 8)) & 1), want) << "block " << v.q_block << " bit " << bit;
            }
          }
        }
      }
  }
  EXPECT_GT(partial_visits, 100);
}

// ---- 2. compact index tensors ----------------------------------------------------------------

TEST(AttentionBwdWalk, CompactIndexTensorsWalkLikeFullWidthOnes) {
  std::mt19937 rng(5150);
  int narrowed = 0;
  for (int i = 0; i < 300; ++i) {
    BlocksCase c = random_blocks_case(rng, 1200);
    SCOPED_TRACE("case " + std::to_string(i) + ": " + c.what);
    const st::BlockMask& full = c.t.mask;
    // Widths: the largest count of each list (at least 1: a zero-width tensor has nothing to view).
    const int64_t wq = std::max<int64_t>(1, max_count(full.q_num_blocks));
    const int64_t wfq = std::max<int64_t>(1, max_count(full.full_q_num_blocks));
    const int64_t wkv = std::max<int64_t>(1, max_count(full.kv_num_blocks));
    narrowed += wq < full.q_indices.size(3) || wfq < full.full_q_indices.size(3);
    // Sliced views (strides of the full-width tensors) and exactly sized compact copies.
    st::BlockMask s = full;
    s.q_indices = sliced(full.q_indices, wq);
    s.dq_write_order = sliced(full.dq_write_order, wq);
    s.full_q_indices = sliced(full.full_q_indices, wfq);
    s.dq_write_order_full = sliced(full.dq_write_order_full, wfq);
    s.kv_indices = sliced(full.kv_indices, wkv);
    s.spec.kind = st::MaskKind::kBitmask;  // exercise the forward-entry look-up through the compact kv list
    const HostTensor q = compact_copy(full.q_indices, wq), wo = compact_copy(full.dq_write_order, wq);
    const HostTensor fq = compact_copy(full.full_q_indices, wfq), fwo = compact_copy(full.dq_write_order_full, wfq);
    const HostTensor kv = compact_copy(full.kv_indices, wkv);
    st::BlockMask k = s;
    k.q_indices = q.view();
    k.dq_write_order = wo.view();
    k.full_q_indices = fq.view();
    k.dq_write_order_full = fwo.view();
    k.kv_indices = kv.view();
    st::BlockMask ref = full;
    ref.spec.kind = st::MaskKind::kBitmask;
    const st::MaskColumnLists lr = column_lists(ref), ls = column_lists(s), lk = column_lists(k);
    ASSERT_EQ(ls.partial_index.width, wq);
    ASSERT_EQ(lk.full_index.width, wfq);
    for (int64_t b = 0; b < c.B; ++b)
      for (int64_t h = 0; h < c.Hq; ++h)
        for (int32_t n = 0; n < full.num_kv_blocks(); ++n) {
          const std::vector<Visit> want = walk(lr, b, h, n);
          ASSERT_EQ(walk(ls, b, h, n), want) << "sliced: b " << b << " h " << h << " column " << n;
          ASSERT_EQ(walk(lk, b, h, n), want) << "compact: b " << b << " h " << h << " column " << n;
        }
  }
  EXPECT_GT(narrowed, 100);
}

// ---- 3. corrupt device masks -----------------------------------------------------------------

// One (b, h) slice of hand-made column lists, each array allocated to its exact size (so that a
// sanitizer sees any read past it), with views over them.
struct HandLists {
  int32_t Nk, Mq, wq, wfq, wkv;
  std::unique_ptr<int32_t[]> pc, pi, pt, fc, fi, ft, kc, ki;
  st::MaskColumnLists l;

  HandLists(int32_t nk, int32_t mq, int32_t w_partial, int32_t w_full, int32_t w_kv, int32_t tiles_per_block,
            int32_t num_q_tiles)
      : Nk(nk), Mq(mq), wq(w_partial), wfq(w_full), wkv(w_kv),
        pc(new int32_t[size_t(nk)]()), pi(new int32_t[size_t(nk * w_partial)]()), pt(new int32_t[size_t(nk * w_partial)]()),
        fc(new int32_t[size_t(nk)]()), fi(new int32_t[size_t(nk * w_full)]()), ft(new int32_t[size_t(nk * w_full)]()),
        kc(new int32_t[size_t(mq)]()), ki(new int32_t[size_t(mq * w_kv)]()) {
    l.partial_count = {pc.get(), 0, 0, 1, 0, 0};
    l.partial_index = {pi.get(), 0, 0, w_partial, 1, w_partial};
    l.partial_turn = {pt.get(), 0, 0, w_partial, 1, w_partial};
    l.full_count = {fc.get(), 0, 0, 1, 0, 0};
    l.full_index = {fi.get(), 0, 0, w_full, 1, w_full};
    l.full_turn = {ft.get(), 0, 0, w_full, 1, w_full};
    l.kv_count = {kc.get(), 0, 0, 1, 0, 0};
    l.kv_index = {ki.get(), 0, 0, w_kv, 1, w_kv};
    l.find_bit_entry = true;
    l.num_q_blocks = mq;
    l.q_tiles_per_block = tiles_per_block;
    l.num_q_tiles = num_q_tiles;
  }
  void set_partial(int32_t n, int32_t count, std::vector<int32_t> ids, std::vector<int32_t> turns = {}) {
    pc[size_t(n)] = count;
    for (size_t i = 0; i < ids.size(); ++i) pi[size_t(n) * size_t(wq) + i] = ids[i];
    for (size_t i = 0; i < turns.size(); ++i) pt[size_t(n) * size_t(wq) + i] = turns[i];
  }
  void set_full(int32_t n, int32_t count, std::vector<int32_t> ids, std::vector<int32_t> turns = {}) {
    fc[size_t(n)] = count;
    for (size_t i = 0; i < ids.size(); ++i) fi[size_t(n) * size_t(wfq) + i] = ids[i];
    for (size_t i = 0; i < turns.size(); ++i) ft[size_t(n) * size_t(wfq) + i] = turns[i];
  }
  void set_kv(int32_t m, int32_t count, std::vector<int32_t> ids) {
    kc[size_t(m)] = count;
    for (size_t i = 0; i < ids.size(); ++i) ki[size_t(m) * size_t(wkv) + i] = ids[i];
  }
};

std::vector<int32_t> blocks_of(const std::vector<Visit>& w) {
  std::vector<int32_t> out;
  for (const Visit& v : w)
    if (out.empty() || out.back() != v.q_block) out.push_back(v.q_block);
  return out;
}

TEST(AttentionBwdWalk, BadCountsAndIdsAreClampedOrSkipped) {
  // Mq = 4 q blocks of 2 tiles each, Sq = 7 tiles (the last block has one); widths 3 / 2 / 3.
  HandLists hl(4, 4, 3, 2, 3, 2, 7);
  const st::MaskColumnLists& l = hl.l;
  // Column 0: partial count 9 > width 3 reads 3 entries; full count -4 reads none.
  hl.set_partial(0, 9, {0, 2, 3}, {5, 6, 7});
  hl.set_full(0, -4, {1, 1}, {9, 9});
  hl.set_kv(0, 1, {0});
  hl.set_kv(2, 2, {0, 1});
  hl.set_kv(3, 3, {1, 2, 3});  // no entry for column 0: bit_entry -1
  std::vector<Visit> w = walk(l, 0, 0, 0);
  const std::vector<Visit> want0 = {{0, 0, 5, 0, true}, {0, 1, 5, 0, true}, {2, 4, 6, 0, true},
                                    {2, 5, 6, 0, true}, {3, 6, 7, -1, true}};
  EXPECT_EQ(w, want0);
  // Column 1: ids -1, 4 (= Mq) and 1000 skipped; the valid ones keep their own turns.
  hl.set_partial(1, 3, {-1, 1, 4}, {11, 12, 13});
  hl.set_full(1, 2, {3, 1000}, {21, 22});
  hl.set_kv(1, 2, {1, 3});
  hl.set_kv(3, 3, {1, 2, 3});
  w = walk(l, 0, 0, 1);
  const std::vector<Visit> want1 = {{1, 2, 12, 0, true}, {1, 3, 12, 0, true}, {3, 6, 21, -1, false}};
  EXPECT_EQ(w, want1);
  // Column 2: every id out of range, and a negative count on the other list: nothing to visit.
  hl.set_partial(2, 3, {-7, 4, 99});
  hl.set_full(2, INT32_MIN, {0, 0});
  EXPECT_TRUE(walk(l, 0, 0, 2).empty());
  // Column 3: counts 0: nothing; count INT32_MAX clamps to the width.
  hl.set_partial(3, 0, {0, 1, 2});
  hl.set_full(3, 0, {0, 1});
  EXPECT_TRUE(walk(l, 0, 0, 3).empty());
  hl.set_full(3, INT32_MAX, {0, 2}, {1, 2});
  EXPECT_EQ(blocks_of(walk(l, 0, 0, 3)), (std::vector<int32_t>{0, 2}));

  // bit_entry look-ups on a corrupt forward list: a count above the width reads the width; a
  // negative count finds nothing; ids past the count are not seen.
  hl.set_partial(0, 1, {2});
  hl.set_kv(2, 50, {1, 2, 0});  // clamped to 3 entries; the list holds 0 at entry 2 but is unsorted
  w = walk(l, 0, 0, 0);
  ASSERT_EQ(w.size(), 2u);
  for (const Visit& v : w) EXPECT_TRUE(v.bit_entry == -1 || v.bit_entry == 2) << v;
  hl.set_kv(2, -1, {0, 1, 2});
  w = walk(l, 0, 0, 0);
  ASSERT_EQ(w.size(), 2u);
  EXPECT_EQ(w[0].bit_entry, -1);
  hl.set_kv(2, 1, {1, 0, 0});  // column 0 sits at entry 1, past the count
  EXPECT_EQ(walk(l, 0, 0, 0)[0].bit_entry, -1);
  hl.set_kv(2, 3, {0, 1, 2});
  EXPECT_EQ(walk(l, 0, 0, 0)[0].bit_entry, 0);

  // Without the bitmask look-up, every bit_entry is -1; absent turns read as turn 0; an absent
  // full list (and an absent forward list) counts 0.
  st::MaskColumnLists l2 = l;
  l2.find_bit_entry = false;
  l2.partial_turn = {};
  l2.full_turn = {};
  hl.set_full(0, 1, {1});
  w = walk(l2, 0, 0, 0);
  const std::vector<Visit> want2 = {{1, 2, 0, -1, false}, {1, 3, 0, -1, false}, {2, 4, 0, -1, true},
                                    {2, 5, 0, -1, true}};
  EXPECT_EQ(w, want2);
  l2.full_count = {};
  l2.find_bit_entry = true;
  l2.kv_index = {};
  w = walk(l2, 0, 0, 0);
  ASSERT_EQ(w.size(), 2u);
  EXPECT_EQ(w[0].q_block, 2);
  EXPECT_EQ(w[0].bit_entry, -1);
  l2.partial_index = {};  // counts without an index tensor: nothing
  EXPECT_TRUE(walk(l2, 0, 0, 0).empty());
}

TEST(AttentionBwdWalk, UnsortedListsStillEndAndVisitAtMostTheirCounts) {
  HandLists hl(1, 6, 4, 3, 4, 1, 6);
  hl.set_partial(0, 4, {3, 1, 5, 1}, {30, 10, 50, 11});
  hl.set_full(0, 3, {2, 0, 4}, {20, 0, 40});
  hl.set_kv(1, 1, {0});
  const std::vector<Visit> w = walk(hl.l, 0, 0, 0);
  // One visit per list entry (blocks of one tile), each carrying its own entry's turn.
  ASSERT_EQ(w.size(), 7u);
  std::multiset<std::pair<int32_t, int32_t>> got, want = {{3, 30}, {1, 10}, {5, 50}, {1, 11}, {2, 20}, {0, 0}, {4, 40}};
  for (const Visit& v : w) {
    got.insert({v.q_block, v.turn});
    EXPECT_EQ(v.q_tile, v.q_block);
  }
  EXPECT_EQ(got, want);
  // Each list's entries come in list order.
  std::vector<int32_t> partial_order, full_order;
  for (const Visit& v : w) (v.partial ? partial_order : full_order).push_back(v.q_block);
  EXPECT_EQ(partial_order, (std::vector<int32_t>{3, 1, 5, 1}));
  EXPECT_EQ(full_order, (std::vector<int32_t>{2, 0, 4}));
}

TEST(AttentionBwdWalk, RandomGarbageMasksStayInBounds) {
  // Fuzz: garbage counts, ids, turns and forward lists in exactly sized arrays. Every visit lies
  // in range, comes from an entry inside the clamped counts (and carries that entry's turn), the
  // look-up returns -1 or an entry of row m holding n, and no walk visits more blocks than its
  // clamped counts.
  std::mt19937 rng(99);
  int64_t visits = 0, found = 0;
  for (int i = 0; i < 20000; ++i) {
    const int32_t Nk = 1 + int32_t(rng() % 6), Mq = 1 + int32_t(rng() % 6);
    const int32_t wq = 1 + int32_t(rng() % 5), wfq = 1 + int32_t(rng() % 5), wkv = 1 + int32_t(rng() % 5);
    const int32_t tpb = rng() % 2 ? 2 : 4;
    const int32_t num_q_tiles = std::max<int32_t>(1, Mq * tpb - int32_t(rng() % uint32_t(tpb)));
    HandLists hl(Nk, Mq, wq, wfq, wkv, tpb, num_q_tiles);
    auto garbage_count = [&](int32_t w) {
      switch (rng() % 5) {
        case 0: return -1 - int32_t(rng() % 100);
        case 1: return w + 1 + int32_t(rng() % 100);
        default: return int32_t(rng() % uint32_t(w + 1));
      }
    };
    auto garbage_id = [&](int32_t range) { return int32_t(rng() % uint32_t(range + 6)) - 3; };
    for (int32_t n = 0; n < Nk; ++n) {
      std::vector<int32_t> ids(static_cast<size_t>(wq)), turns(static_cast<size_t>(wq)), fids(static_cast<size_t>(wfq)),
          fturns(static_cast<size_t>(wfq));
      for (auto& x : ids) x = garbage_id(Mq);
      for (auto& x : fids) x = garbage_id(Mq);
      if (rng() % 2) std::sort(ids.begin(), ids.end());
      if (rng() % 2) std::sort(fids.begin(), fids.end());
      for (auto& x : turns) x = int32_t(rng());
      for (auto& x : fturns) x = int32_t(rng());
      hl.set_partial(n, garbage_count(wq), ids, turns);
      hl.set_full(n, garbage_count(wfq), fids, fturns);
    }
    for (int32_t m = 0; m < Mq; ++m) {
      std::vector<int32_t> ids(static_cast<size_t>(wkv));
      for (auto& x : ids) x = garbage_id(Nk);
      if (rng() % 2) std::sort(ids.begin(), ids.end());
      hl.set_kv(m, garbage_count(wkv), ids);
    }
    auto clamp = [](int32_t c, int32_t w) { return c < 0 ? 0 : std::min(c, w); };
    for (int32_t n = 0; n < Nk; ++n) {
      const int32_t np = clamp(hl.pc[size_t(n)], wq), nf = clamp(hl.fc[size_t(n)], wfq);
      const std::vector<Visit> w = walk(hl.l, 0, 0, n, size_t((wq + wfq) * tpb));
      std::multiset<std::tuple<int32_t, int32_t, bool>> entries;  // (block, turn, partial) the lists hold
      for (int32_t e = 0; e < np; ++e) entries.insert({hl.pi[size_t(n * wq + e)], hl.pt[size_t(n * wq + e)], true});
      for (int32_t e = 0; e < nf; ++e) entries.insert({hl.fi[size_t(n * wfq + e)], hl.ft[size_t(n * wfq + e)], false});
      int32_t blocks = 0;
      for (size_t k = 0; k < w.size(); ++k) {
        const Visit& v = w[k];
        ++visits;
        ASSERT_GE(v.q_block, 0);
        ASSERT_LT(v.q_block, Mq);
        ASSERT_GE(v.q_tile, v.q_block * tpb);
        ASSERT_LT(v.q_tile, std::min((v.q_block + 1) * tpb, num_q_tiles));
        const bool first = k == 0 || w[k - 1].q_tile + 1 != v.q_tile || w[k - 1].q_block != v.q_block ||
                           w[k - 1].turn != v.turn || w[k - 1].partial != v.partial;
        if (first) {
          ++blocks;
          ASSERT_EQ(v.q_tile, v.q_block * tpb) << "a block's tiles start at its first";
          auto it = entries.find({v.q_block, v.turn, v.partial});
          ASSERT_NE(it, entries.end()) << "visit " << v << " of column " << n << " is no entry of its lists";
          entries.erase(it);
        }
        if (!v.partial) {
          ASSERT_EQ(v.bit_entry, -1);
        } else if (v.bit_entry >= 0) {
          ++found;
          ASSERT_LT(v.bit_entry, clamp(hl.kc[size_t(v.q_block)], wkv));
          ASSERT_EQ(hl.ki[size_t(v.q_block * wkv + v.bit_entry)], n);
        } else {  // not found: then a sorted row does not hold n
          const int32_t* row = &hl.ki[size_t(v.q_block * wkv)];
          const int32_t c = clamp(hl.kc[size_t(v.q_block)], wkv);
          if (std::is_sorted(row, row + c)) {
            ASSERT_EQ(std::count(row, row + c, n), 0) << "missed in a sorted row";
          }
        }
      }
      ASSERT_LE(blocks, np + nf);
      // Every valid entry was visited: what is left is out of range.
      for (const auto& e : entries) ASSERT_TRUE(std::get<0>(e) < 0 || std::get<0>(e) >= Mq) << std::get<0>(e);
    }
  }
  EXPECT_GT(visits, 10000);
  EXPECT_GT(found, 100);
}

// A turn tensor narrower than its index tensor (block_mask.h allows compact write orders whose
// width is only checked against the counts on the host, which a device mask never gets): a count
// above the turn tensor's width must not read past it (the walk clamps each count to the turn
// tensor's width as well as the index tensor's; a read past the turn row would see the guard).
TEST(AttentionBwdWalk, TurnTensorsNarrowerThanTheIndexAreNotReadPast) {
  constexpr int32_t kGuard = 0x7eadbeef;
  const int32_t count = 4, index[4] = {0, 1, 2, 3};
  const int32_t turns[4] = {0, 0, kGuard, kGuard};  // a 1-row turn tensor of width 2, then a guard
  st::MaskColumnLists l;
  l.partial_count = {&count, 0, 0, 1, 0, 0};
  l.partial_index = {index, 0, 0, 4, 1, 4};
  l.partial_turn = {turns, 0, 0, 2, 1, 2};
  l.num_q_blocks = 4;
  l.q_tiles_per_block = 1;
  l.num_q_tiles = 4;
  for (const Visit& v : walk(l, 0, 0, 0)) EXPECT_NE(v.turn, kGuard) << "read past the turn row at block " << v.q_block;
}

// ---- 3b. the item walk: the same visits in the new order ------------------------------------

struct HeadVisit {
  int32_t q_head;
  Visit v;
  bool operator==(const HeadVisit& o) const { return q_head == o.q_head && v == o.v; }
  bool operator<(const HeadVisit& o) const {
    return std::tie(q_head, v.q_block, v.q_tile, v.turn, v.bit_entry, v.partial) <
           std::tie(o.q_head, o.v.q_block, o.v.q_tile, o.v.turn, o.v.bit_entry, o.v.partial);
  }
};
[[maybe_unused]] std::ostream& operator<<(std::ostream& os, const HeadVisit& v) {
  return os << "{head " << v.q_head << " " << v.v << "}";
}

std::vector<HeadVisit> item_walk(const st::MaskColumnLists& l, int64_t b, int32_t hkv, int32_t group, int32_t n) {
  std::vector<HeadVisit> out;
  st::BwdItemCursor c = st::bwd_item_begin(l, b, hkv, group, n);
  st::BwdVisit v{};
  while (st::bwd_item_next(l, b, n, c, &v)) {
    out.push_back({v.q_head, {v.q_block, v.q_tile, v.turn, v.bit_entry, v.partial}});
    if (out.size() > (1u << 22)) {
      ADD_FAILURE() << "the walk of item (" << hkv << ", " << n << ") does not end";
      return out;
    }
  }
  EXPECT_FALSE(st::bwd_item_next(l, b, n, c, &v)) << "a finished item stays finished";
  // The kernel's roles read fewer fields (kFields): the same visits, the others left at turn 0 /
  // bit_entry -1.
  auto fewer = [&](auto fields) {
    constexpr int kFields = decltype(fields)::value;
    std::vector<HeadVisit> got;
    st::BwdItemCursor cf = st::bwd_item_begin(l, b, hkv, group, n);
    st::BwdVisit vf{};
    while (got.size() <= out.size() && st::bwd_item_next<kFields>(l, b, n, cf, &vf))
      got.push_back({vf.q_head, {vf.q_block, vf.q_tile, vf.turn, vf.bit_entry, vf.partial}});
    std::vector<HeadVisit> want = out;
    for (HeadVisit& h : want) {
      if ((kFields & st::kVisitTurn) == 0) h.v.turn = 0;
      if ((kFields & st::kVisitBitEntry) == 0) h.v.bit_entry = -1;
    }
    EXPECT_EQ(got, want) << "kFields " << kFields;
  };
  fewer(std::integral_constant<int, 0>{});
  fewer(std::integral_constant<int, st::kVisitTurn>{});
  fewer(std::integral_constant<int, st::kVisitBitEntry>{});
  return out;
}

TEST(AttentionBwdWalk, ItemWalksVisitTheSameSetAscendingOrDescendingWithHeadsInner) {
  std::mt19937 rng(9150);
  int64_t visits = 0, heads_inner_cases = 0, per_head_cases = 0;
  for (int i = 0; i < 400; ++i) {
    const int64_t group = int64_t(1) << (rng() % 3);  // 1, 2, 4 query heads per kv head
    BlocksCase c = random_blocks_case(rng, 1200, group);
    SCOPED_TRACE("case " + std::to_string(i) + ": " + c.what + " group " + std::to_string(group));
    const st::BlockMask& m = c.t.mask;
    const int64_t Hkv = c.Hq / group, Mq = m.num_q_blocks(), Nk = m.num_kv_blocks();
    const bool per_head = c.mh > 1;
    const st::MaskColumnLists old_l = column_lists(m, st::bwd_walk_shape(st::WalkOrder::kAscendingHeadsOuter, per_head));
    const st::MaskColumnLists new_l = column_lists(m, st::bwd_walk_shape(st::WalkOrder::kDescendingHeadsInner, per_head));
    const st::MaskColumnLists asc_l = column_lists(m, st::bwd_walk_shape(st::WalkOrder::kAscendingHeadsInner, per_head));
    ASSERT_EQ(new_l.walk.heads_inner, !per_head);
    ASSERT_TRUE(new_l.walk.descending);
    ASSERT_EQ(asc_l.walk.heads_inner, !per_head);
    ASSERT_FALSE(asc_l.walk.descending);
    (per_head ? per_head_cases : heads_inner_cases) += 1;
    const std::vector<int64_t> pos = positions_of(m.schedule, Nk);
    for (int64_t b = 0; b < c.B; ++b)
      for (int32_t hkv = 0; hkv < Hkv; ++hkv)
        for (int32_t n = 0; n < Nk; ++n) {
          // The oracle per head (ascending), then the two orders built from it.
          std::vector<std::vector<Visit>> per;
          for (int32_t g = 0; g < group; ++g)
            per.push_back(oracle_walk(classes_at(c.blocks, c.mb, c.mh, Mq, Nk, b, hkv * group + g), Mq, Nk, n, pos,
                                      new_l.q_tiles_per_block, new_l.num_q_tiles, false));
          std::vector<HeadVisit> want_old, want_new, want_asc;
          for (int32_t g = 0; g < group; ++g)
            for (const Visit& v : per[size_t(g)]) want_old.push_back({int32_t(hkv * group + g), v});
          if (!per_head) {
            for (size_t k = per[0].size(); k-- > 0;)
              for (int32_t g = 0; g < group; ++g) want_new.push_back({int32_t(hkv * group + g), per[size_t(g)][k]});
            for (size_t k = 0; k < per[0].size(); ++k)
              for (int32_t g = 0; g < group; ++g) want_asc.push_back({int32_t(hkv * group + g), per[size_t(g)][k]});
          } else {
            for (int32_t g = 0; g < group; ++g)
              for (size_t k = per[size_t(g)].size(); k-- > 0;) want_new.push_back({int32_t(hkv * group + g), per[size_t(g)][k]});
            want_asc = want_old;  // a per-head mask: one head after the other
          }
          const std::vector<HeadVisit> got_old = item_walk(old_l, b, hkv, int32_t(group), n);
          const std::vector<HeadVisit> got_new = item_walk(new_l, b, hkv, int32_t(group), n);
          const std::vector<HeadVisit> got_asc = item_walk(asc_l, b, hkv, int32_t(group), n);
          ASSERT_EQ(got_old, want_old) << "b " << b << " kv head " << hkv << " column " << n;
          ASSERT_EQ(got_new, want_new) << "b " << b << " kv head " << hkv << " column " << n;
          ASSERT_EQ(got_asc, want_asc) << "b " << b << " kv head " << hkv << " column " << n;
          std::vector<HeadVisit> a = got_old, d = got_new;  // the same set of (tile, head) visits
          std::sort(a.begin(), a.end());
          std::sort(d.begin(), d.end());
          ASSERT_EQ(a, d);
          visits += int64_t(got_new.size());
        }
  }
  EXPECT_GT(heads_inner_cases, 50);
  EXPECT_GT(per_head_cases, 50);
  std::printf("%lld item visits checked in both orders\n", (long long)visits);
}

TEST(AttentionBwdWalk, DescendingColumnWalkIsTheAscendingOneReversedOnBadMasksToo) {
  // Unsorted or garbage lists: the descending merge visits what the ascending one does, in bounds.
  std::mt19937 rng(31337);
  for (int i = 0; i < 2000; ++i) {
    const int32_t width = 1 + int32_t(rng() % 6), Mq = 1 + int32_t(rng() % 8);
    std::vector<int32_t> pc{int32_t(rng() % 9) - 1}, fc{int32_t(rng() % 9) - 1}, pi(static_cast<size_t>(width)), fi(static_cast<size_t>(width));
    for (auto& x : pi) x = int32_t(rng() % uint32_t(Mq + 3)) - 1;
    for (auto& x : fi) x = int32_t(rng() % uint32_t(Mq + 3)) - 1;
    if (rng() % 2) {  // mostly sorted, disjoint lists: the walks are then exact mirrors
      std::sort(pi.begin(), pi.end());
      std::sort(fi.begin(), fi.end());
    }
    st::MaskColumnLists l;
    l.partial_count = {pc.data(), 0, 0, 1, 0, 0};
    l.partial_index = {pi.data(), 0, 0, width, 1, width};
    l.full_count = {fc.data(), 0, 0, 1, 0, 0};
    l.full_index = {fi.data(), 0, 0, width, 1, width};
    l.num_q_blocks = Mq;
    l.q_tiles_per_block = 1 + int32_t(rng() % 2);
    l.num_q_tiles = Mq * l.q_tiles_per_block - int32_t(rng() % 2);
    l.walk = {false, false};
    std::vector<Visit> up = walk(l, 0, 0, 0, 4096);
    l.walk = {true, false};
    const std::vector<Visit> down = walk(l, 0, 0, 0, 4096);
    ASSERT_EQ(up.size(), down.size()) << "case " << i;
    for (const Visit& v : down) {
      ASSERT_GE(v.q_block, 0);
      ASSERT_LT(v.q_block, Mq);
      ASSERT_GE(v.q_tile, 0);
      ASSERT_LT(v.q_tile, l.num_q_tiles);
    }
    const bool sorted = std::is_sorted(pi.begin(), pi.begin() + std::clamp(pc[0], 0, width)) &&
                        std::is_sorted(fi.begin(), fi.begin() + std::clamp(fc[0], 0, width));
    bool disjoint = true;
    for (int32_t a = 0; a < std::clamp(pc[0], 0, width); ++a)
      for (int32_t b = 0; b < std::clamp(fc[0], 0, width); ++b) disjoint = disjoint && pi[size_t(a)] != fi[size_t(b)];
    const std::vector<int32_t> pids(static_cast<size_t>(std::clamp(pc[0], 0, width)));
    if (sorted && disjoint && std::adjacent_find(pi.begin(), pi.begin() + pids.size()) == pi.begin() + pids.size()) {
      std::reverse(up.begin(), up.end());
      ASSERT_EQ(up, down) << "case " << i;
    }
  }
}

// ---- 4. deterministic mode: q-tile semaphores in the scheduler model ------------------------

// The model's problem with q tiles for q blocks: each (b, query head, q tile) a semaphore; the
// walks are the header's.
st::DqModelProblem tile_problem(const st::MaskColumnLists& l, int64_t B, int64_t Hq, int64_t Hkv, int64_t Nk,
                                int64_t sub_tiles, st::BwdWalkShape shape = {false, false}) {
  EXPECT_FALSE(l.walk.descending) << "the model's walks are stored ascending";
  st::DqModelProblem pb;
  pb.walk = shape;
  pb.batch = B;
  pb.q_heads = Hq;
  pb.kv_heads = Hkv;
  pb.num_q_blocks = l.num_q_tiles;
  pb.num_columns = Nk;
  pb.sub_tiles = sub_tiles;
  pb.walk_begin.push_back(0);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < Hq; ++h)
      for (int32_t n = 0; n < Nk; ++n) {
        EXPECT_EQ(pb.walk_index(b, h, n) + 1, int64_t(pb.walk_begin.size()));
        for (const Visit& v : walk(l, b, h, n)) {
          pb.walk_q_block.push_back(v.q_tile);
          pb.walk_turn.push_back(v.turn);
        }
        pb.walk_begin.push_back(int64_t(pb.walk_q_block.size()));
      }
  return pb;
}

st::DqColumnHandout handout_of(const st::BlockMask& m, int64_t B, int64_t Hkv, const st::ColumnSchedule* s = nullptr) {
  const st::ColumnSchedule& sch = s != nullptr ? *s : m.schedule;
  st::DqColumnHandout h;
  h.batch = B;
  h.kv_heads = Hkv;
  h.num_columns = m.num_kv_blocks();
  h.sub_tiles = st::dq_sub_tiles(m.block_kv);  // the kernel's split
  h.kind = sch.kind;
  h.permutation = sch.permutation.data();
  return h;
}

TEST(AttentionBwdWalk, TileSemaphoresFollowTheWriteOrderWithoutDeadlockOrRace) {
  std::mt19937 rng(4242);
  const int64_t worker_counts[] = {1, 7, 61, 132, 5000};
  int cases = 0;
  std::set<int> kinds_seen;
  auto check = [&](const st::BlockMask& m, int64_t B, int64_t Hq, const std::string& what) {
    const int64_t sub_tiles = st::dq_sub_tiles(m.block_kv);
    SCOPED_TRACE(what + " " + m.schedule.str() + " sub " + std::to_string(sub_tiles));
    ASSERT_EQ(st::check_write_order(m), "");
    const int64_t Hkv = Hq / 4;
    const st::MaskColumnLists l = column_lists(m);
    const st::DqColumnHandout h = handout_of(m, B, Hkv);
    // Every walk (the mask's own, and the others), each as the kernel shapes it for this mask.
    for (const st::WalkOrder wo : {st::WalkOrder::kDescendingHeadsInner, st::WalkOrder::kAscendingHeadsOuter,
                                   st::WalkOrder::kAscendingHeadsInner}) {
      const st::DqModelProblem pb = tile_problem(l, B, Hq, Hkv, m.num_kv_blocks(), sub_tiles,
                                                 st::bwd_walk_shape(wo, m.q_indices.size(1) > 1));
      const int64_t tile_visits = int64_t(pb.walk_q_block.size());
      for (int64_t workers : worker_counts) {
        const st::DqModelResult r = st::simulate_dq_backward(pb, h, workers);
        ASSERT_TRUE(r.ok) << workers << " workers, walk " << st::walk_order_name(wo) << ": " << r.str();
        ASSERT_EQ(r.total_work, tile_visits * sub_tiles);
        ASSERT_EQ(r.items_not_handed_out, 0);
      }
    }
    kinds_seen.insert(int(m.schedule.kind));
    ++cases;
  };
  // Random block matrices with GQA (Hq = 4 * Hkv, Hkv 1 or 2), block_kv 256: 2 sub-columns.
  for (int i = 0; i < 200; ++i) {
    BlocksCase c = random_blocks_case(rng, 1400, 4);
    if (c.block_kv != 256) continue;
    check(c.t.mask, c.B, c.Hq, "blocks " + std::to_string(i) + ": " + c.what);
  }
  // Built-in specs (block_kv 256: 2 sub-columns) under every schedule kind.
  const st::MaskKind kinds[] = {st::MaskKind::kCausal, st::MaskKind::kSlidingWindow, st::MaskKind::kFull,
                                st::MaskKind::kCausalBottomRight, st::MaskKind::kPrefixLM};
  for (int i = 0; i < 30; ++i) {
    st::MaskSpec s;
    s.kind = kinds[i % 5];
    s.window_left = 300;
    s.window_right = 0;
    s.prefix_length = 333;
    st::BlockMaskOptions o;
    o.block_q = i % 2 ? 256 : 128;
    o.block_kv = 256;
    const int64_t Sq = ragged_length(rng, 100, 2500), Skv = rng() % 2 ? Sq : ragged_length(rng, 100, 2500);
    o.auto_schedule = i % 4 == 3;
    if (!o.auto_schedule) o.schedule = pick_schedule(i % 3, (Skv + 255) / 256, rng);
    const st::BlockMaskTensors t = st::build_block_mask(s, Sq, Skv, o);
    check(t.mask, 1 + i % 2, 4 * (1 + i % 2), s.str() + " Sq " + std::to_string(Sq) + " Skv " + std::to_string(Skv));
  }
  // Bitmask masks, per head (GQA: one mask per query head).
  for (int i = 0; i < 6; ++i) {
    st::BlockMaskOptions o;
    o.block_q = 128;
    o.block_kv = 256;
    o.auto_schedule = false;
    const int64_t Sq = ragged_length(rng, 50, 900), Skv = ragged_length(rng, 50, 900);
    o.schedule = pick_schedule(i, (Skv + 255) / 256, rng);
    FnCtx ctx{int64_t(rng() % 300), 50 + int64_t(rng() % 300)};
    const st::BlockMaskTensors t = st::build_block_mask_from_function(band_with_holes, &ctx, 1, 4, Sq, Skv, o);
    check(t.mask, 1, 4, "function " + std::to_string(i));
  }
  EXPECT_GT(cases, 100);
  EXPECT_EQ(kinds_seen.size(), 3u);
}

TEST(AttentionBwdWalk, TileSemaphoresStarveUnderAHandOutTheOrderWasNotBuiltFor) {
  // Not vacuous: a causal mask's turns built left to right, columns handed out shortest first.
  st::MaskSpec s;
  s.kind = st::MaskKind::kCausal;
  st::BlockMaskOptions o;
  o.block_q = 256;
  o.block_kv = 256;
  o.auto_schedule = false;
  o.schedule = schedule_of(st::ScheduleKind::kLeftToRight);
  const st::BlockMaskTensors t = st::build_block_mask(s, 1000, 1000, o);
  const st::MaskColumnLists l = column_lists(t.mask);
  const st::DqModelProblem pb = tile_problem(l, 1, 4, 1, t.mask.num_kv_blocks(), 2);
  const st::ColumnSchedule spt = schedule_of(st::ScheduleKind::kShortestFirst);
  const st::DqModelResult r = st::simulate_dq_backward(pb, handout_of(t.mask, 1, 1, &spt), 1);
  EXPECT_FALSE(r.ok);
  EXPECT_FALSE(r.blocked.empty());
  EXPECT_TRUE(st::simulate_dq_backward(pb, handout_of(t.mask, 1, 1), 1).ok);
}

// ---- 5. semaphore / accumulator index --------------------------------------------------------

TEST(AttentionBwdWalk, QTileIndexIsABijection) {
  for (int64_t B : {1, 2, 3})
    for (int64_t Hq : {1, 4, 7})
      for (int32_t tiles : {1, 5, 16}) {
        std::vector<int> hits(size_t(B * Hq * tiles), 0);
        for (int64_t b = 0; b < B; ++b)
          for (int64_t h = 0; h < Hq; ++h)
            for (int32_t t = 0; t < tiles; ++t) {
              const int64_t i = st::bwd_q_tile_index(b, h, Hq, tiles, t);
              ASSERT_GE(i, 0);
              ASSERT_LT(i, B * Hq * tiles);
              ++hits[size_t(i)];
            }
        EXPECT_TRUE(std::all_of(hits.begin(), hits.end(), [](int x) { return x == 1; }))
            << "B " << B << " Hq " << Hq << " tiles " << tiles;
      }
  // 64-bit: large sizes do not wrap.
  EXPECT_EQ(st::bwd_q_tile_index(7, 63, 64, 1 << 20, (1 << 20) - 1), int64_t(8) * 64 * (1 << 20) - 1);
}

}  // namespace

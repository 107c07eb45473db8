// The deterministic backward's scheduling: the dynamic column hand-out, the CPU model of the
// persistent kernel (success, blocked sets, critical paths), check_write_order, and "auto".
// The property test builds >= 10,000 random masks (built-in specs, documents, windows, random block
// matrices, GQA, schedules incl. random permutations, models splitting block columns into 1/2/4
// writers, 1..132 workers) and shows that every order the library builds passes both the checker
// and the model, and that inconsistent orders are caught by both.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <numeric>
#include <random>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "block_mask_testing.h"
#include "common/attention/dq_schedule_model.h"
#include "host_tensor.h"
#include "ops/block_mask_internal.h"
#include "sparsetrain/block_mask.h"

namespace st = sparsetrain;
using st::testing::HostTensor;

namespace {

st::ColumnSchedule schedule_of(st::ScheduleKind k, std::vector<int32_t> perm = {}) {
  st::ColumnSchedule s;
  s.kind = k;
  s.permutation = std::move(perm);
  return s;
}
// The default walk (q blocks descending, heads innermost) and the old one (ascending, heads outer).
const st::ColumnSchedule kLTR = schedule_of(st::ScheduleKind::kLeftToRight);
const st::ColumnSchedule kSPT = schedule_of(st::ScheduleKind::kShortestFirst);
st::ColumnSchedule ascending(st::ColumnSchedule s) {
  s.walk = st::WalkOrder::kAscendingHeadsOuter;
  return s;
}
const st::ColumnSchedule kLTRasc = ascending(kLTR);
const st::ColumnSchedule kSPTasc = ascending(kSPT);

st::BlockMaskTensors spec_mask(st::MaskKind kind, int64_t seq, const st::ColumnSchedule* schedule) {
  st::MaskSpec s;
  s.kind = kind;
  st::BlockMaskOptions o;
  if (schedule != nullptr) {
    o.auto_schedule = false;
    o.schedule = *schedule;
  }
  return st::build_block_mask(s, seq, seq, o);
}

// The model of a kernel that runs each block column as `sub_tiles` writers (a kv tile of
// block_kv / sub_tiles), on the mask's stored write orders.
st::DqModelResult run_model(const st::BlockMask& m, int64_t workers, const st::ColumnSchedule* handout = nullptr,
                            int64_t batch = 1, int64_t q_heads = 1, int64_t kv_heads = 1, int64_t sub_tiles = 1) {
  const st::ColumnSchedule& h = handout != nullptr ? *handout : m.schedule;
  return st::simulate_dq_backward(st::dq_model_problem(m, sub_tiles, batch, q_heads, kv_heads),
                                  st::dq_handout(h, batch, kv_heads, m.num_kv_blocks(), sub_tiles), workers);
}

// The turn rule (common/attention/dq_turn.h): the mask stores ranks in block units; a kernel with kv tile
// block_kv / s expands rank r to turns r * s .. r * s + s - 1, so the ranks 0..k-1 of a q block's
// columns become exactly the turns 0..k*s-1, each once, increasing with (rank, sub-column): the
// hand-out order of the sub-columns.
TEST(DqTurn, RanksExpandToConsecutiveTurnsPerSubColumn) {
  static_assert(st::dq_visit_turn(3, 2, 1) == 7, "rank 3, 2 sub-columns, the second: turn 7");
  EXPECT_EQ(st::dq_sub_tiles(st::kBwdTileKv), 1);
  EXPECT_EQ(st::dq_sub_tiles(2 * st::kBwdTileKv), 2);
  EXPECT_EQ(st::dq_sub_tiles(4 * st::kBwdTileKv), 4);
  // Not a multiple of the CUDA tile (CPU-only masks): the block itself is the writer.
  for (int64_t block_kv : {1, 16, 64, 127, 192, 200}) EXPECT_EQ(st::dq_sub_tiles(block_kv), 1) << block_kv;
  for (int32_t s : {1, 2, 3, 4}) {
    std::vector<int32_t> turns;
    for (int32_t rank = 0; rank < 5; ++rank)
      for (int32_t t = 0; t < s; ++t) turns.push_back(st::dq_visit_turn(rank, s, t));
    for (size_t i = 0; i < turns.size(); ++i) EXPECT_EQ(turns[i], int32_t(i)) << "s " << s;
  }
}

TEST(DqHandout, TicketsCoverEveryItemOnceInScheduleOrder) {
  const std::vector<int32_t> perm = {2, 0, 3, 1};
  for (const auto& s : {kLTR, kSPT, schedule_of(st::ScheduleKind::kPermutation, perm)}) {
    for (int64_t sub : {1, 2, 4}) {
      st::DqColumnHandout h = st::dq_handout(s, 2, 3, 4, sub);
      ASSERT_EQ(h.num_items(), 2 * 3 * 4 * sub);
      std::set<std::tuple<int64_t, int64_t, int64_t, int64_t>> seen;
      int64_t last_pos = -1;
      for (int64_t t = 0; t < h.num_items(); ++t) {
        const st::DqWorkItem it = h.item(t);
        EXPECT_TRUE(seen.insert({it.batch, it.kv_head, it.column, it.sub_tile}).second);
        // Sub-column position = position(column) * sub + t: non-decreasing in ticket order, and
        // every (batch, kv head) gets position p before anyone gets p + 1.
        const int64_t pos = s.position(it.column, 4) * sub + it.sub_tile;
        EXPECT_EQ(pos, t / 6) << s.str() << " ticket " << t;
        EXPECT_GE(pos, last_pos);
        last_pos = pos;
      }
    }
  }
  // Left to right, one head: tickets are the sub-columns in order.
  st::DqColumnHandout h = st::dq_handout(kLTR, 1, 1, 3, 2);
  EXPECT_EQ(h.item(3).column, 1);
  EXPECT_EQ(h.item(3).sub_tile, 1);
}

TEST(DqHandout, SectionsHandOutWholeGroupsAndKeepEachGroupsOrder) {
  const std::vector<int32_t> perm = {2, 0, 3, 1};
  for (const auto& s : {kLTR, kSPT, schedule_of(st::ScheduleKind::kPermutation, perm)}) {
    for (int64_t sub : {1, 2}) {
      for (int64_t section : {1, 2, 4, 5, 6, 9}) {  // 6 groups: uneven last sections, one section
        st::DqColumnHandout h = st::dq_handout(s, 2, 3, 4, sub);
        h.section_groups = section;
        std::set<std::tuple<int64_t, int64_t, int64_t, int64_t>> seen;
        std::vector<int64_t> next_pos(6, 0);
        int64_t last_section = 0;
        for (int64_t t = 0; t < h.num_items(); ++t) {
          const st::DqWorkItem it = h.item(t);
          ASSERT_TRUE(seen.insert({it.batch, it.kv_head, it.column, it.sub_tile}).second) << "ticket " << t;
          const int64_t g = it.batch * 3 + it.kv_head;
          // Each group meets its sub-column positions in schedule order, as without sections.
          EXPECT_EQ(s.position(it.column, 4) * sub + it.sub_tile, next_pos[g]++) << s.str() << " ticket " << t;
          // Sections of consecutive groups, one after the other.
          EXPECT_GE(g / std::min<int64_t>(section, 6), last_section) << "ticket " << t;
          last_section = g / std::min<int64_t>(section, 6);
        }
        EXPECT_EQ(int64_t(seen.size()), h.num_items());
      }
    }
  }
}

TEST(DqModel, CausalCriticalPathsLeftToRightVersusShortestFirst) {
  // 8 x 8 causal blocks, enough workers for every column. Left to right with the old ascending
  // walk, column n does q block m at step m + n + 1 (it waits for column n - 1 there): 2N - 1 = 15
  // steps. Shortest first, column n's turn at m is m - n, so it never waits after its first block:
  // N = 8 steps. Left to right walking down from the bottom block: column n reaches block 7 at
  // step n + 1, one step behind column n - 1 at every block after, and ends at step 8 too.
  const auto ltr = spec_mask(st::MaskKind::kCausal, 1024, &kLTRasc);
  const auto spt = spec_mask(st::MaskKind::kCausal, 1024, &kSPTasc);
  const auto fix = spec_mask(st::MaskKind::kCausal, 1024, &kLTR);
  const auto a = run_model(ltr.mask, 132), b = run_model(spt.mask, 132), f = run_model(fix.mask, 132);
  ASSERT_TRUE(a.ok) << a.str();
  ASSERT_TRUE(b.ok) << b.str();
  ASSERT_TRUE(f.ok) << f.str();
  EXPECT_EQ(a.critical_path, 15);
  EXPECT_EQ(b.critical_path, 8);
  EXPECT_EQ(f.critical_path, 8);
  EXPECT_EQ(a.total_work, 36);
  EXPECT_EQ(b.total_work, 36);
  EXPECT_EQ(f.total_work, 36);
  // One worker: everything in series, 36 steps either way.
  EXPECT_EQ(run_model(ltr.mask, 1).critical_path, 36);
  EXPECT_EQ(run_model(spt.mask, 1).critical_path, 36);
  EXPECT_EQ(run_model(fix.mask, 1).critical_path, 36);
  // Two sub-tiles per block column: 16 writers; each sub-column pair serialises at every block.
  // The mask is the same (turns in block units); the model splits its columns.
  const auto c = run_model(spt.mask, 132, nullptr, 1, 1, 1, 2);
  ASSERT_TRUE(c.ok) << c.str();
  EXPECT_EQ(c.total_work, 72);
  // Each q block's writers take turns one at a time, so the bottom q block's 8 x 2 writers bound
  // the critical path from below; shortest first reaches that bound (at s = 1 too: 8 writers),
  // and so does left to right walking down.
  EXPECT_EQ(c.critical_path, 16);
  const auto d = run_model(ltr.mask, 132, nullptr, 1, 1, 1, 2);
  ASSERT_TRUE(d.ok) << d.str();
  EXPECT_GT(d.critical_path, c.critical_path);
  EXPECT_EQ(run_model(fix.mask, 132, nullptr, 1, 1, 1, 2).critical_path, 16);
}

TEST(DqModel, AutoWeighsEveryHandOutAndWalkAndTiesGoToTheDefault) {
  // One head, 132 workers: on a causal mask left to right walking down and shortest first both
  // take N steps (8 x 8 blocks: 8; the old left-to-right ascending walk 2N - 1), and ties go to
  // the first candidate, left to right walking down. On a full mask every column touches every q
  // block and every candidate takes Mq + Nk - 1 steps.
  const auto causal = spec_mask(st::MaskKind::kCausal, 8 * 128, nullptr);
  EXPECT_EQ(causal.mask.schedule.kind, st::ScheduleKind::kLeftToRight);
  EXPECT_EQ(causal.mask.schedule.walk, st::WalkOrder::kDescendingHeadsInner);
  EXPECT_EQ(run_model(causal.mask, 132).critical_path, 8);
  const auto cands = st::schedule_candidates(causal.mask);
  ASSERT_EQ(cands.size(), 5u);
  EXPECT_EQ(cands[0].schedule.str(), "left-to-right");
  EXPECT_EQ(cands[1].schedule.str(), "left-to-right + ascending heads outer");
  EXPECT_EQ(cands[2].schedule.str(), "shortest-first + ascending heads outer");
  EXPECT_EQ(cands[3].schedule.str(), "shortest-first");
  EXPECT_EQ(cands[4].schedule.str(), "left-to-right + ascending heads inner");
  EXPECT_EQ(cands[0].critical_path, 8);
  EXPECT_EQ(cands[1].critical_path, 15);
  EXPECT_EQ(cands[2].critical_path, 8);
  EXPECT_EQ(cands[4].critical_path, 15);  // one head: the heads-outer walk's visits
  for (const auto& c : cands) EXPECT_EQ(c.nondeterministic_critical_path, 8) << c.schedule.str();

  const auto full = spec_mask(st::MaskKind::kFull, 8 * 128, nullptr);
  EXPECT_EQ(full.mask.schedule.kind, st::ScheduleKind::kLeftToRight);
  EXPECT_EQ(run_model(full.mask, 132).critical_path, 15);
  const auto full_spt = spec_mask(st::MaskKind::kFull, 8 * 128, &kSPTasc);
  EXPECT_EQ(run_model(full_spt.mask, 132).critical_path, 15);

  // The problem matters: 16 query heads on 2 kv heads, batch 2 (the note's case 2) at S = 8192.
  const auto long_causal = spec_mask(st::MaskKind::kCausal, 8192, nullptr);
  st::ScheduleProblem p;
  p.batch = 2, p.heads_q = 16, p.heads_kv = 2, p.workers = 132;
  const st::ColumnSchedule chosen = st::choose_schedule(long_causal.mask, p);
  EXPECT_EQ(chosen.kind, st::ScheduleKind::kLeftToRight);
  EXPECT_EQ(chosen.walk, st::WalkOrder::kDescendingHeadsInner);
}

// Attention sinks beside a causal window, given by blocks as a flex BlockMask arrives: kv column 0
// (the sinks) reaches every q block, the window's columns 9 blocks each. Walking bottom-up, the
// sink column reaches the window columns' blocks last, and their turns wait for it; "auto" takes
// the ascending walk where the model says so for the real problem (bench_attention's
// flexmod_sinks_window_1024: B2 H16 S8192, 30 % faster on an H100), and the descending walk on a
// mask of the same blocks without the sinks, on the sinks mask with one head (the model: the
// descending walk 2x ahead), and on a built-in causal mask.
TEST(DqModel, AutoWalksAscendingBehindALongFirstColumn) {
  const int64_t S = 8192, M = S / 128;
  auto blocks_of = [&](bool sinks, uint8_t edge_class = 1) {
    HostTensor blocks(st::DType::kUInt8, {1, 1, M, M});
    for (int64_t m = 0; m < M; ++m)
      for (int64_t n = 0; n < M; ++n) {
        const bool edge = n == m || n == m - 8, inside = n < m && n > m - 8;
        blocks.set(m * M + n, inside ? 2 : edge || (sinks && n == 0) ? edge_class : 0);
      }
    return blocks;
  };
  st::ScheduleProblem big;
  big.batch = 2, big.heads_q = big.heads_kv = 16, big.workers = 132;
  st::ScheduleProblem one;
  one.batch = one.heads_q = one.heads_kv = 1, one.workers = 132;
  const HostTensor with = blocks_of(true), without = blocks_of(false);
  const auto sinks = st::build_block_mask_from_blocks(with.view(), S, S);
  const auto window = st::build_block_mask_from_blocks(without.view(), S, S);
  const auto cands = st::schedule_candidates(sinks.mask, big);  // [0] descending, [4] ascending heads inner
  ASSERT_LE(10 * cands[4].critical_path, 9 * cands[0].critical_path)
      << "the model: ascending " << cands[4].critical_path << " vs descending " << cands[0].critical_path;
  ASSERT_EQ(cands[4].critical_path, cands[1].critical_path) << "one query head a kv head: heads inner = outer";
  EXPECT_EQ(st::choose_schedule(sinks.mask, big).walk, st::WalkOrder::kAscendingHeadsInner);
  // GQA 8:1: walking every head of the group at each tile follows the long column once, not once
  // per head; the heads-outer ascending walk models behind the descending one there.
  st::ScheduleProblem gqa;
  gqa.batch = 2, gqa.heads_q = 32, gqa.heads_kv = 4, gqa.workers = 132;
  const auto g = st::schedule_candidates(sinks.mask, gqa);
  EXPECT_GT(g[1].critical_path, g[0].critical_path) << "ascending heads outer";
  EXPECT_LE(10 * g[4].critical_path, 9 * g[0].critical_path) << "ascending heads inner";
  EXPECT_EQ(st::choose_schedule(sinks.mask, gqa).walk, st::WalkOrder::kAscendingHeadsInner);
  EXPECT_EQ(st::choose_schedule(sinks.mask, one).walk, st::WalkOrder::kDescendingHeadsInner);
  EXPECT_EQ(st::choose_schedule(window.mask, big).walk, st::WalkOrder::kDescendingHeadsInner);
  // Through the builder: "auto" with the problem in the options writes the ascending walk's order.
  st::BlockMaskOptions o;
  o.problem = big;
  const auto built = st::build_block_mask_from_blocks(with.view(), S, S, o);
  EXPECT_EQ(built.mask.schedule.walk, st::WalkOrder::kAscendingHeadsInner);
  EXPECT_EQ(st::check_write_order(built.mask), "");
  const auto causal = spec_mask(st::MaskKind::kCausal, S, nullptr);
  EXPECT_EQ(st::choose_schedule(causal.mask, big).walk, st::WalkOrder::kDescendingHeadsInner);
  // What decides is how the columns nest, not whether blocks are partial: the same blocks all full.
  const HostTensor full_only = blocks_of(true, 2);
  const auto sinks_full = st::build_block_mask_from_blocks(full_only.view(), S, S);
  EXPECT_EQ(st::choose_schedule(sinks_full.mask, big).walk, st::WalkOrder::kAscendingHeadsInner);
}

TEST(DqModel, OrdersAgainstTheHandOutStarve) {
  // Seed 004's failure: causal orders built for left to right, columns handed out right to left.
  // With fewer workers than columns the first workers wait on columns never handed out.
  const auto m = spec_mask(st::MaskKind::kCausal, 5 * 128, &kLTR);
  const auto r = run_model(m.mask, 2, &kSPT);
  ASSERT_FALSE(r.ok);
  ASSERT_EQ(r.blocked.size(), 2u);
  EXPECT_EQ(r.blocked[0].item.column, 4);  // waits at q block 4 for turn 4; the semaphore is at 0
  EXPECT_EQ(r.blocked[0].q_block, 4);
  EXPECT_EQ(r.blocked[0].turn, 4);
  EXPECT_EQ(r.blocked[0].semaphore, 0);
  EXPECT_EQ(r.items_not_handed_out, 3);
  EXPECT_NE(r.str().find("blocked"), std::string::npos);
  // The checker sees it without running anything.
  st::BlockMask claimed = m.mask;
  claimed.schedule = kSPT;
  EXPECT_NE(st::check_write_order(claimed).find("expected turn"), std::string::npos);
  // With a worker per column there is no starvation (the model is exact; the checker is the
  // sufficient condition for every worker count).
  EXPECT_TRUE(run_model(m.mask, 5, &kSPT).ok);
}

TEST(DqModel, DuplicateAndPassedTurnsBlock) {
  // Two writers with the same turn at a block: the semaphore passes the other turn by, so one of
  // them waits forever for a value already gone.
  auto m = spec_mask(st::MaskKind::kFull, 3 * 128, &kLTRasc);  // ascending: both reach q block 0 first
  int32_t* wo = m.dq_write_order_full.view().data_as<int32_t>();  // full mask: all blocks are full
  const int64_t W = m.mask.dq_write_order_full.size(3);
  wo[1 * W + 0] = 0;  // column 1 at q block 0: turn 0, like column 0
  EXPECT_NE(st::check_write_order(m.mask), "");
  // Three workers: columns 0 and 1 both add at q block 0 in step 1 (a race in the kernel).
  const auto r = run_model(m.mask, 3);
  EXPECT_FALSE(r.ok) << r.str();
  EXPECT_EQ(r.races, 1);
  EXPECT_TRUE(r.blocked.empty());
  // One worker: column 1 arrives after the semaphore has passed turn 0 and waits forever.
  const auto one = run_model(m.mask, 1);
  EXPECT_FALSE(one.ok);
  ASSERT_EQ(one.blocked.size(), 1u);
  EXPECT_EQ(one.blocked[0].item.column, 1);
  EXPECT_EQ(one.blocked[0].turn, 0);
  EXPECT_EQ(one.blocked[0].semaphore, 1);
}

// ---- property test -------------------------------------------------------------------------

struct Case {
  st::BlockMaskTensors t;
  std::vector<HostTensor> keep;  // document ids the spec points at
  int64_t batch = 1, q_heads = 1, kv_heads = 1;
  int64_t sub_tiles = 1;  // writers per block column in the model (a kernel kv tile of block_kv / sub_tiles)
  std::string what;
};

HostTensor random_docs(std::mt19937& rng, int64_t batch, int64_t len) {
  HostTensor t(st::DType::kInt32, {batch, len});
  const int64_t max_doc = 1 + int64_t(rng() % 600);
  for (int64_t b = 0; b < batch; ++b) {
    int32_t doc = 0;
    int64_t left = 1 + int64_t(rng() % uint32_t(max_doc));
    for (int64_t i = 0; i < len; ++i) {
      if (left-- == 0) {
        ++doc;
        left = int64_t(rng() % uint32_t(max_doc));
      }
      static_cast<int32_t*>(t.data())[b * len + i] = doc;
    }
  }
  return t;
}

Case random_case(std::mt19937& rng) {
  Case c;
  const int64_t bq = rng() % 2 ? 64 : 128, bk = rng() % 2 ? 64 : 128;
  const int64_t Sq = 1 + int64_t(rng() % 1700), Skv = 1 + int64_t(rng() % 1700);
  st::BlockMaskOptions o;
  o.block_q = bq;
  o.block_kv = bk;
  const int64_t subs[] = {1, 2, 4};
  c.sub_tiles = subs[rng() % 3];
  const int64_t Nk = (Skv + bk - 1) / bk, Mq = (Sq + bq - 1) / bq;
  switch (rng() % 4) {
    case 0: o.auto_schedule = true; break;
    case 1: o.auto_schedule = false; o.schedule = kLTR; break;
    case 2: o.auto_schedule = false; o.schedule = kSPT; break;
    default: {
      o.auto_schedule = false;
      std::vector<int32_t> p(static_cast<size_t>(Nk));
      std::iota(p.begin(), p.end(), 0);
      std::shuffle(p.begin(), p.end(), rng);
      o.schedule = schedule_of(st::ScheduleKind::kPermutation, p);
    }
  }
  const int64_t hq_choices[] = {1, 2, 4, 8};
  c.q_heads = hq_choices[rng() % 4];
  c.kv_heads = c.q_heads >> (rng() % 4);
  if (c.kv_heads < 1) c.kv_heads = 1;
  const int kind = int(rng() % 9);
  if (kind < 7) {
    st::MaskSpec s;
    const st::MaskKind kinds[] = {st::MaskKind::kFull, st::MaskKind::kCausal, st::MaskKind::kCausalBottomRight,
                                  st::MaskKind::kSlidingWindow, st::MaskKind::kDocument, st::MaskKind::kDocumentCausal,
                                  st::MaskKind::kPrefixLM};
    s.kind = kinds[kind];
    s.window_left = rng() % 4 == 0 ? -1 : int64_t(rng() % 900);
    s.window_right = rng() % 3 == 0 ? -1 : rng() % 2 ? 0 : int64_t(rng() % 400);
    s.prefix_length = int64_t(rng() % 1000);
    if (s.kind == st::MaskKind::kDocument || s.kind == st::MaskKind::kDocumentCausal) {
      c.batch = 1 + int64_t(rng() % 3);
      c.keep.push_back(random_docs(rng, c.batch, Sq));
      c.keep.push_back(random_docs(rng, c.batch, Skv));
      s.doc_q = c.keep[0].view();
      s.doc_kv = c.keep[1].view();
    }
    c.what = s.str();
    c.t = st::build_block_mask(s, Sq, Skv, o);
  } else if (kind == 7) {  // random block matrix, per head (GQA: a mask per query head)
    const int64_t B = 1 + int64_t(rng() % 2), H = rng() % 2 ? c.q_heads : 1;
    HostTensor blocks(st::DType::kUInt8, {B, H, Mq, Nk});
    const double density = double(rng() % 101) / 100.0, full_share = double(rng() % 101) / 100.0;
    std::uniform_real_distribution<double> u(0, 1);
    for (int64_t i = 0; i < blocks.numel(); ++i) blocks.set(i, u(rng) < density ? (u(rng) < full_share ? 2 : 1) : 0);
    c.batch = B;
    c.what = "blocks(density " + std::to_string(density) + ")";
    c.t = st::build_block_mask_from_blocks(blocks.view(), Sq, Skv, o);
  } else {  // a mask function on small sizes (every element is evaluated)
    o.block_q = o.block_kv = 16;
    struct Ctx { int64_t w, period; };
    static thread_local Ctx ctx;
    ctx = {int64_t(rng() % 60), 2 + int64_t(rng() % 30)};
    auto f = [](void* p, int64_t b, int64_t h, int64_t q, int64_t kv) {
      const Ctx& x = *static_cast<Ctx*>(p);
      return (kv <= q && q - kv <= x.w + 7 * h) || (kv + b) % x.period == 0;
    };
    c.batch = 1;
    if (o.schedule.kind == st::ScheduleKind::kPermutation) {
      o.auto_schedule = true;  // the permutation was drawn for another block size
    }
    c.what = "function";
    c.t = st::build_block_mask_from_function(+f, &ctx, 1, c.q_heads, 1 + int64_t(rng() % 200), 1 + int64_t(rng() % 200), o);
  }
  return c;
}

// Whether the mask's columns nest for the descending walk (block_mask.h choose_schedule), from the
// dense block classes: in no (b, h) and q block row does a column sit right of a column that
// reaches a lower q block than it does.
bool columns_nest_dense(const st::BlockMask& m) {
  int64_t B = 1, H = 1;
  st::mask_leading_dims(m, &B, &H);
  const int64_t Mq = m.num_q_blocks(), Nk = m.num_kv_blocks();
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h) {
      const auto cls = st::testing::classes_of(m, b, h, false);
      std::vector<int64_t> lowest(static_cast<size_t>(Nk), -1);
      for (int64_t r = 0; r < Mq; ++r)
        for (int64_t n = 0; n < Nk; ++n)
          if (cls[size_t(r * Nk + n)] != 0) lowest[size_t(n)] = r;
      for (int64_t r = 0; r < Mq; ++r)
        for (int64_t n = 0; n < Nk; ++n)
          for (int64_t e = 0; e < n; ++e)
            if (cls[size_t(r * Nk + n)] != 0 && cls[size_t(r * Nk + e)] != 0 && lowest[size_t(e)] > lowest[size_t(n)])
              return false;
    }
  return true;
}

// Whether writers of some q block come in a different order under schedule a than under b.
bool orders_disagree(const st::BlockMask& m, const st::ColumnSchedule& a, const st::ColumnSchedule& b) {
  int64_t B = 1, H = 1;
  st::mask_leading_dims(m, &B, &H);
  const int64_t Nk = m.num_kv_blocks();
  for (int64_t bi = 0; bi < B; ++bi)
    for (int64_t h = 0; h < H; ++h) {
      const auto cls = st::testing::classes_of(m, bi, h, true);
      for (int64_t q = 0; q < m.num_q_blocks(); ++q) {
        std::vector<std::pair<int64_t, int64_t>> w;
        for (int64_t n = 0; n < Nk; ++n)
          if (cls[size_t(q * Nk + n)] != 0) w.push_back({a.position(n, Nk), b.position(n, Nk)});
        std::sort(w.begin(), w.end());
        for (size_t i = 1; i < w.size(); ++i)
          if (w[i].second < w[i - 1].second) return true;
      }
    }
  return false;
}

// Swaps the stored turns of two writers of one q block; false when no q block has two writers.
bool swap_two_turns(st::BlockMask& m, std::mt19937& rng) {
  int64_t B = 1, H = 1;
  st::mask_leading_dims(m, &B, &H);
  const int64_t Nk = m.num_kv_blocks();
  std::vector<int32_t*> cells;
  for (int tries = 0; tries < 8 && cells.size() < 2; ++tries) {
    const int64_t b = int64_t(rng() % uint32_t(B)), h = int64_t(rng() % uint32_t(H));
    const int32_t q = int32_t(rng() % uint32_t(m.num_q_blocks()));
    cells.clear();
    const st::IndexRows p = st::mask_rows(m.q_num_blocks, m.q_indices, b, h);
    const st::IndexRows f = st::mask_rows(m.full_q_num_blocks, m.full_q_indices, b, h);
    const st::MaskIndexOut wp = st::mask_write_order(m.dq_write_order, b, h);
    const st::MaskIndexOut wf = st::mask_write_order(m.dq_write_order_full, b, h);
    for (int64_t n = 0; n < Nk; ++n) {
      int64_t i = p.find(n, q);
      if (i >= 0) cells.push_back(&wp.at(0, 0, n, i));
      i = f.present() ? f.find(n, q) : -1;
      if (i >= 0) cells.push_back(&wf.at(0, 0, n, i));
    }
  }
  if (cells.size() < 2) return false;
  std::shuffle(cells.begin(), cells.end(), rng);
  std::swap(*cells[0], *cells[1]);
  return true;
}

TEST(DqScheduleProperty, BuiltOrdersPassCheckerAndModelInconsistentOnesAreCaught) {
  const auto start = std::chrono::steady_clock::now();
  std::mt19937 rng(2024);
  constexpr int kCases = 10000;
  int swapped = 0, swapped_blocked_random_w = 0, mismatched = 0, mismatched_blocked_random_w = 0;
  int ascending_chosen = 0;
  int64_t max_nk = 0;
  for (int i = 0; i < kCases; ++i) {
    Case c = random_case(rng);
    st::BlockMask& m = c.t.mask;
    const int64_t workers = 1 + int64_t(rng() % 132), Nk = m.num_kv_blocks();
    max_nk = std::max(max_nk, Nk);
    SCOPED_TRACE("case " + std::to_string(i) + ": " + c.what + " Sq " + std::to_string(m.seq_q) + " Skv " +
                 std::to_string(m.seq_kv) + " blocks " + std::to_string(m.block_q) + "x" + std::to_string(m.block_kv) +
                 " " + m.schedule.str() + " sub " + std::to_string(c.sub_tiles) + " heads " +
                 std::to_string(c.q_heads) + "/" + std::to_string(c.kv_heads) + " workers " + std::to_string(workers));
    ASSERT_NO_THROW(st::validate_block_mask(m, c.batch, c.q_heads));
    ASSERT_EQ(st::check_write_order(m), "");
    const auto ok = run_model(m, workers, nullptr, c.batch, c.q_heads, c.kv_heads, c.sub_tiles);
    ASSERT_TRUE(ok.ok) << ok.str();
    // Every block visited once per sub-column.
    int64_t blocks = 0;
    for (int64_t b = 0; b < c.batch; ++b)
      for (int64_t h = 0; h < c.q_heads; ++h) {
        const auto cls = st::testing::classes_of(m, m.q_indices.size(0) == 1 ? 0 : b, m.q_indices.size(1) == 1 ? 0 : h, true);
        blocks += std::count_if(cls.begin(), cls.end(), [](uint8_t v) { return v != 0; });
      }
    ASSERT_EQ(ok.total_work, blocks * c.sub_tiles);
    ASSERT_GE(ok.critical_path, (blocks * c.sub_tiles + workers - 1) / workers);
    if (i % 10 == 0) {  // "auto" (block_mask.h): left to right, deadlock-free
      st::ScheduleProblem p;
      p.batch = c.batch, p.heads_q = c.q_heads, p.heads_kv = c.kv_heads, p.workers = workers;
      const st::ColumnSchedule chosen = st::choose_schedule(m, p);
      const int64_t s = st::dq_sub_tiles(m.block_kv);  // the CUDA kernel's split
      ASSERT_EQ(chosen.kind, st::ScheduleKind::kLeftToRight) << chosen.str();
      // The descending walk, unless the mask came by blocks, its columns do not nest, and the model
      // puts the ascending walk at <= 0.9x its deterministic critical path (these masks are far
      // below the model's size bound).
      const auto cands = st::schedule_candidates(m, p);  // [0]: LTR descending, [4]: LTR ascending heads inner
      const bool by_blocks = (m.spec.kind == st::MaskKind::kFull || m.spec.kind == st::MaskKind::kBitmask) &&
                             !columns_nest_dense(m);
      const bool ascending_wins = 10 * cands[4].critical_path <= 9 * cands[0].critical_path;
      ASSERT_EQ(chosen.walk, by_blocks && ascending_wins ? st::WalkOrder::kAscendingHeadsInner
                                                         : st::WalkOrder::kDescendingHeadsInner)
          << chosen.str() << ", modelled " << cands[0].critical_path << " / " << cands[1].critical_path;
      ascending_chosen += chosen.walk == st::WalkOrder::kAscendingHeadsInner;
      const auto r = st::simulate_dq_backward(st::dq_model_problem(m, chosen, s, c.batch, c.q_heads, c.kv_heads),
                                              st::dq_handout(chosen, c.batch, c.kv_heads, Nk, s), workers);
      EXPECT_TRUE(r.ok) << chosen.str() << ": " << r.str();
    }
    // A hand-out order the turns were not built for: the checker flags it exactly when some q
    // block's writers come in another order, and then one worker starves.
    std::vector<int32_t> perm(static_cast<size_t>(Nk));
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), rng);
    const st::ColumnSchedule other = schedule_of(st::ScheduleKind::kPermutation, perm);
    const bool disagree = orders_disagree(m, m.schedule, other);
    {
      st::BlockMask claimed = m;
      claimed.schedule = other;
      ASSERT_EQ(st::check_write_order(claimed).empty(), !disagree);
      const auto one = run_model(m, 1, &other, c.batch, c.q_heads, c.kv_heads, c.sub_tiles);
      ASSERT_EQ(one.ok, !disagree) << one.str();
      if (disagree) {
        ++mismatched;
        ASSERT_FALSE(one.blocked.empty());
        mismatched_blocked_random_w += !run_model(m, workers, &other, c.batch, c.q_heads, c.kv_heads, c.sub_tiles).ok;
      }
    }
    // Two turns swapped at one q block: the checker names it, and one worker blocks.
    if (swap_two_turns(m, rng)) {
      ++swapped;
      ASSERT_NE(st::check_write_order(m), "");
      const auto one = run_model(m, 1, nullptr, c.batch, c.q_heads, c.kv_heads, c.sub_tiles);
      ASSERT_FALSE(one.ok) << "a swapped pair must starve a single worker";
      ASSERT_FALSE(one.blocked.empty());
      swapped_blocked_random_w += !run_model(m, workers, nullptr, c.batch, c.q_heads, c.kv_heads, c.sub_tiles).ok;
    }
  }
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::printf("%d cases (Nk up to %lld) in %.2f s: %d swapped turns (all caught; %d also block at the random "
              "worker count), %d mismatched hand-outs (all caught; %d block at the random worker count), auto "
              "took the ascending walk %d times\n",
              kCases, (long long)max_nk, secs, swapped, swapped_blocked_random_w, mismatched,
              mismatched_blocked_random_w, ascending_chosen);
  EXPECT_GT(swapped, kCases / 2);
  EXPECT_GT(mismatched, kCases / 4);
  EXPECT_GT(ascending_chosen, 0) << "auto never took the ascending walk: its branch went untested";
}

// ---- five measured cases of the deterministic walk's analysis ----------------------------------

// Document ids [1, S]: lengths drawn uniformly from [lo, hi] (the bench's document_ids).
HostTensor doc_ids(int64_t S, int64_t lo, int64_t hi, uint32_t seed) {
  std::mt19937 rng(seed);
  HostTensor t(st::DType::kInt32, {1, S});
  int32_t doc = 0;
  for (int64_t i = 0; i < S;) {
    const int64_t len = lo + int64_t(rng() % uint32_t(hi - lo + 1));
    for (int64_t j = 0; j < len && i < S; ++j, ++i) static_cast<int32_t*>(t.data())[i] = doc;
    ++doc;
  }
  return t;
}

struct NoteCase {
  const char* name;
  st::MaskKind kind;
  int64_t S, B, Hq, Hkv, window, doc_lo, doc_hi;
};

// det / nondet critical paths of the default walk (FIX) and the old one, left to right, with the
// case's batch, heads and 132 workers, over document seeds 0..seeds-1 (the largest ratio).
struct NoteRatios {
  double fix = 0, ltr_old = 0, spt_old = 0, chosen_ratio = 0;
  st::ColumnSchedule chosen;
};
NoteRatios note_ratios(const NoteCase& nc, int seeds) {
  NoteRatios r;
  for (int seed = 0; seed < seeds; ++seed) {
    st::MaskSpec spec;
    spec.kind = nc.kind;
    spec.window_left = nc.window;
    spec.window_right = 0;
    HostTensor docs;
    if (nc.kind == st::MaskKind::kDocumentCausal) {
      docs = doc_ids(nc.S, nc.doc_lo, nc.doc_hi, uint32_t(seed));
      spec.doc_q = spec.doc_kv = docs.view();
    }
    st::BlockMaskOptions o;
    o.auto_schedule = false;
    const st::BlockMaskTensors t = st::build_block_mask(spec, nc.S, nc.S, o);
    st::ScheduleProblem p;
    p.batch = nc.B, p.heads_q = nc.Hq, p.heads_kv = nc.Hkv, p.workers = 132;
    const auto cands = st::schedule_candidates(t.mask, p);
    auto ratio = [](const st::ScheduleCandidate& c) {
      return double(c.critical_path) / double(c.nondeterministic_critical_path);
    };
    r.fix = std::max(r.fix, ratio(cands[0]));
    r.ltr_old = std::max(r.ltr_old, ratio(cands[1]));
    r.spt_old = std::max(r.spt_old, ratio(cands[2]));
    r.chosen = st::choose_schedule(t.mask, p);
    for (const auto& c : cands)
      if (c.schedule.kind == r.chosen.kind && c.schedule.walk == r.chosen.walk)
        r.chosen_ratio = std::max(r.chosen_ratio, ratio(c));
    std::printf("%-22s seed %d: det/nondet  LTR-desc-inner %.3f  LTR-asc-outer %.3f  SPT-asc-outer %.3f  "
                "SPT-desc-inner %.3f  (nondet LTR-desc %lld steps)  auto: %s\n",
                nc.name, seed, ratio(cands[0]), ratio(cands[1]), ratio(cands[2]), ratio(cands[3]),
                (long long)cands[0].nondeterministic_critical_path, r.chosen.str().c_str());
  }
  return r;
}

// A separate simulation (the note) of the five measured cases gives: the left-to-right ascending
// walk 1.79 / 1.49 / 1.34 / 1.00 / 1.02 det / nondet, the fix (descending, heads innermost) 1.00
// on all five. The repository's model (unit cost per q block, free hand-offs) agrees on four: the
// fix within 5 % of nondet, the old order >= 1.3 on the two GQA cases. It disagrees on short
// documents (16k, lengths 1..3000, H16): it models the fix at 1.19-1.25 and the old order at
// 1.66-1.96, where the GPU measured 1.06 and 1.08. Auto takes the fix on both GQA cases, and its
// choice models within 6 % of nondet on the four where model and note agree.
TEST(DqModelNote, DescendingHeadsInnerRemovesTheChainWasteOfTheNotesCases) {
  const NoteCase doc128k{"doc-causal 128k 8:2", st::MaskKind::kDocumentCausal, 131072, 1, 8, 2, 0, 1, 8192};
  const NoteCase gqa16{"causal 16:2 B2 S8192", st::MaskKind::kCausal, 8192, 2, 16, 2, 0, 0, 0};
  const NoteCase doc16k{"doc-causal 16k H16", st::MaskKind::kDocumentCausal, 16384, 1, 16, 16, 0, 1, 3000};
  const NoteCase causal4k{"causal B4 H16 S4096", st::MaskKind::kCausal, 4096, 4, 16, 16, 0, 0, 0};
  const NoteCase window{"window 1024 B2 H16", st::MaskKind::kSlidingWindow, 8192, 2, 16, 16, 1024, 0, 0};
  const NoteRatios a = note_ratios(doc128k, 2), b = note_ratios(gqa16, 1), c = note_ratios(doc16k, 3),
                   d = note_ratios(causal4k, 1), e = note_ratios(window, 1);
  for (const NoteRatios* r : {&a, &b, &d, &e}) EXPECT_LE(r->fix, 1.05);
  for (const NoteRatios* r : {&a, &b, &d, &e}) EXPECT_LE(r->chosen_ratio, 1.06) << r->chosen.str();
  for (const NoteRatios* r : {&a, &b}) EXPECT_EQ(r->chosen.walk, st::WalkOrder::kDescendingHeadsInner);
  EXPECT_LT(c.fix, c.ltr_old) << "doc-causal 16k: the fix still beats the old walk";
  EXPECT_GE(a.ltr_old, 1.3) << "doc-causal 128k 8:2: the old walk's chains";
  EXPECT_GE(b.ltr_old, 1.3) << "causal 16:2: the old walk's chains";
  EXPECT_GT(c.ltr_old, 1.1) << "doc-causal 16k: the old walk's chains";
}

TEST(DqModelNote, AutoTakesTheMeasuredWalkOnTheBenchMasks) {
  // The bench's cases (bench/bench_attention.py CASES) with their batch and heads, and the walk
  // that ran faster on the GPU with the backward's L2 sections: the
  // descending one on every case, 1-23 % (before the sections the ascending walk won by 0-3 % on
  // causal MHA and windows, where the model ranks the two walks within 3 %). Each time
  // auto's choice is what the model gives for the chosen schedule.
  using W = st::WalkOrder;
  struct Measured {
    NoteCase c;
    W faster;
  };
  const Measured cases[] = {
      {{"causal", st::MaskKind::kCausal, 8192, 2, 16, 16, 0, 0, 0}, W::kDescendingHeadsInner},
      {{"document_causal", st::MaskKind::kDocumentCausal, 8192, 1, 16, 16, 0, 256, 3072}, W::kDescendingHeadsInner},
      {{"document_causal_1to3000", st::MaskKind::kDocumentCausal, 16384, 1, 16, 16, 0, 1, 3000}, W::kDescendingHeadsInner},
      {{"gqa_causal", st::MaskKind::kCausal, 8192, 2, 32, 4, 0, 0, 0}, W::kDescendingHeadsInner},
      {{"sliding_window_1024", st::MaskKind::kSlidingWindow, 8192, 2, 16, 16, 1024, 0, 0}, W::kDescendingHeadsInner},
      {{"causal_s4096_b8", st::MaskKind::kCausal, 4096, 8, 16, 16, 0, 0, 0}, W::kDescendingHeadsInner},
  };
  for (const Measured& m : cases) {
    const NoteCase& nc = m.c;
    SCOPED_TRACE(nc.name);
    st::MaskSpec spec;
    spec.kind = nc.kind;
    spec.window_left = nc.window;
    spec.window_right = 0;
    HostTensor docs;
    if (nc.kind == st::MaskKind::kDocumentCausal) {
      docs = doc_ids(nc.S, nc.doc_lo, nc.doc_hi, 0);
      spec.doc_q = spec.doc_kv = docs.view();
    }
    st::BlockMaskOptions o;
    o.problem.batch = nc.B, o.problem.heads_q = nc.Hq, o.problem.heads_kv = nc.Hkv, o.problem.workers = 132;
    const st::BlockMaskTensors t = st::build_block_mask(spec, nc.S, nc.S, o);  // auto
    EXPECT_EQ(t.mask.schedule.kind, st::ScheduleKind::kLeftToRight);
    EXPECT_EQ(t.mask.schedule.walk, m.faster) << t.mask.schedule.str();
    const int64_t s = st::dq_sub_tiles(t.mask.block_kv);
    const auto got = st::simulate_dq_backward(st::dq_model_problem(t.mask, s, nc.B, nc.Hq, nc.Hkv),
                                              st::dq_handout(t.mask.schedule, nc.B, nc.Hkv, t.mask.num_kv_blocks(), s),
                                              132);
    ASSERT_TRUE(got.ok) << got.str();
    const auto cands = st::schedule_candidates(t.mask, o.problem);
    EXPECT_EQ(got.critical_path, cands[m.faster == W::kDescendingHeadsInner ? 0 : 1].critical_path);
  }
}

TEST(DqModelNote, EveryCandidateIsDeadlockFreeOnRandomMasksAtAnyWorkerCount) {
  // Random masks (built-in specs, documents, block matrices, GQA) under every hand-out x walk,
  // workers 1, 7, 61 and 132: no wait cycle, no race, every visit done.
  std::mt19937 rng(61132);
  int checked = 0;
  for (int i = 0; i < 300; ++i) {
    Case c = random_case(rng);
    const st::BlockMask& m = c.t.mask;
    const int64_t Nk = m.num_kv_blocks(), s = c.sub_tiles;
    for (const auto& sch : {kLTR, kSPT, kLTRasc, kSPTasc}) {
      const st::DqModelProblem pb = st::dq_model_problem(m, sch, s, c.batch, c.q_heads, c.kv_heads);
      for (int64_t workers : {1, 7, 61, 132}) {
        const auto r = st::simulate_dq_backward(pb, st::dq_handout(sch, c.batch, c.kv_heads, Nk, s), workers);
        ASSERT_TRUE(r.ok) << c.what << " " << sch.str() << " workers " << workers << ": " << r.str();
        ASSERT_EQ(r.total_work, int64_t(pb.walk_q_block.size()) * s);
        ++checked;
      }
    }
  }
  EXPECT_GT(checked, 4000);
}

TEST(DqModel, VisitAndHandOffStepsByHand) {
  // Causal, two block columns: column 0 touches q blocks 0 and 1, column 1 q block 1 (rank 1
  // there). Two workers, adds of 2 steps, an increment visible 1 step after its add completes.
  for (const auto& sch : {kLTR, kLTRasc}) {
    const st::BlockMaskTensors t = spec_mask(st::MaskKind::kCausal, 256, &sch);
    const st::DqModelProblem pb = st::dq_model_problem(t.mask, 1, 1, 1, 1);
    const st::DqColumnHandout h = st::dq_handout(sch, 1, 1, 2, 1);
    const auto det = st::simulate_dq_backward(pb, h, 2, true, 2, 1);
    ASSERT_TRUE(det.ok) << det.str();
    // Descending: column 0 adds to q block 1 in steps 1-2 (visible at 4), column 1's add there
    // runs 4-5. Ascending: column 0 reaches q block 1 only in steps 3-4 (visible at 6): 6-7.
    EXPECT_EQ(det.critical_path, pb.walk.descending ? 5 : 7) << sch.str();
    EXPECT_EQ(det.total_work, 3);
    // Without turns: column 0's two adds, 1-2 and 3-4; the hand-off costs nothing.
    EXPECT_EQ(st::simulate_dq_backward(pb, h, 2, false, 2, 1).critical_path, 4);
    EXPECT_EQ(st::simulate_dq_backward(pb, h, 2, false, 2, 0).critical_path, 4);
  }
}

TEST(DqModel, PartialVisitStepsByHand) {
  // The same two columns with a partial block's visit 3 steps longer (the diagonal blocks are
  // partial, column 0's q block 1 full): adds of 2 steps, 5 for a partial one, hand-off 1.
  for (const auto& sch : {kLTR, kLTRasc}) {
    const st::BlockMaskTensors t = spec_mask(st::MaskKind::kCausal, 256, &sch);
    const st::DqModelProblem pb = st::dq_model_problem(t.mask, 1, 1, 1, 1);
    ASSERT_EQ(pb.walk_partial, (std::vector<uint8_t>{1, 0, 1}));  // column 0: q blocks 0, 1; column 1: 1
    const st::DqColumnHandout h = st::dq_handout(sch, 1, 1, 2, 1);
    const auto det = st::simulate_dq_backward(pb, h, 2, true, 2, 1, 3);
    ASSERT_TRUE(det.ok) << det.str();
    // Descending: column 0 adds to q block 1 in steps 1-2 (visible at 4), to q block 0 in 3-7;
    // column 1's (partial) add to q block 1 runs 4-8. Ascending: column 0's partial add to q
    // block 0 runs 1-5, to q block 1 6-7 (visible at 9), column 1's 9-13.
    EXPECT_EQ(det.critical_path, pb.walk.descending ? 8 : 13) << sch.str();
    EXPECT_EQ(det.total_work, 3);
    // Without turns: column 0's adds take 7 steps either way, column 1's 5.
    EXPECT_EQ(st::simulate_dq_backward(pb, h, 2, false, 2, 1, 3).critical_path, 7);
    // Without partial flags the extra steps do not apply.
    st::DqModelProblem unflagged = pb;
    unflagged.walk_partial.clear();
    EXPECT_EQ(st::simulate_dq_backward(unflagged, h, 2, true, 2, 1, 3).critical_path, pb.walk.descending ? 5 : 7);
  }
}

TEST(DqModelNote, LongerVisitsScaleTheCriticalPathWithoutHandOffs) {
  // With no hand-off latency, adds of k steps are the unit model slowed down k times: the same
  // schedule, every critical path times k (deterministic or not).
  std::mt19937 rng(977);
  for (int i = 0; i < 60; ++i) {
    Case c = random_case(rng);
    const int64_t Nk = c.t.mask.num_kv_blocks(), s = c.sub_tiles;
    for (const auto& sch : {kLTR, kSPTasc}) {
      const st::DqModelProblem pb = st::dq_model_problem(c.t.mask, sch, s, c.batch, c.q_heads, c.kv_heads);
      const st::DqColumnHandout h = st::dq_handout(sch, c.batch, c.kv_heads, Nk, s);
      for (bool det : {true, false}) {
        const auto unit = st::simulate_dq_backward(pb, h, 7, det);
        const auto slow = st::simulate_dq_backward(pb, h, 7, det, 3, 0);
        ASSERT_TRUE(unit.ok && slow.ok) << c.what;
        EXPECT_EQ(slow.critical_path, 3 * unit.critical_path) << c.what << " " << sch.str() << " det " << det;
        EXPECT_EQ(slow.total_work, unit.total_work);
        // A hand-off latency delays only the deterministic mode, and never breaks it.
        const auto late = st::simulate_dq_backward(pb, h, 7, det, 3, 2);
        ASSERT_TRUE(late.ok) << c.what << ": " << late.str();
        if (!det) {
          EXPECT_EQ(late.critical_path, slow.critical_path) << c.what;
        }
      }
    }
  }
}

TEST(DqModelNote, SectionedHandOutsAreDeadlockFree) {
  // The kernel's L2 sections of (batch, kv head) groups (a sweep switch for now): the same random
  // masks, every hand-out x walk, sections of 1 and 3 groups, workers 1, 7 and 61.
  std::mt19937 rng(4211);
  int checked = 0;
  for (int i = 0; i < 120; ++i) {
    Case c = random_case(rng);
    const int64_t Nk = c.t.mask.num_kv_blocks(), s = c.sub_tiles;
    for (const auto& sch : {kLTR, kSPT, kLTRasc, kSPTasc}) {
      const st::DqModelProblem pb = st::dq_model_problem(c.t.mask, sch, s, c.batch, c.q_heads, c.kv_heads);
      for (int64_t section : {1, 3}) {
        st::DqColumnHandout h = st::dq_handout(sch, c.batch, c.kv_heads, Nk, s);
        h.section_groups = section;
        for (int64_t workers : {1, 7, 61}) {
          const auto r = st::simulate_dq_backward(pb, h, workers);
          ASSERT_TRUE(r.ok) << c.what << " " << sch.str() << " section " << section << " workers " << workers << ": "
                            << r.str();
          ASSERT_EQ(r.total_work, int64_t(pb.walk_q_block.size()) * s);
          ++checked;
        }
      }
    }
  }
  EXPECT_GT(checked, 2000);
}

}  // namespace

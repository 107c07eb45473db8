// The deterministic backward's scheduler model (common/attention/dq_schedule_model.h) on bench-like masks:
// det / nondet critical paths with adds of 4 steps and a hand-off latency of 0..4 steps (a dQ
// partial landing and its release reaching the next writer), for both schedules (left to right,
// shortest first) and both walks, with and without L2 sections of 8 (batch, kv head) groups, 132
// workers. CPU only; what the model says before device time is spent on a hand-out change (its
// shortest-first + ascending rows on documents were contradicted on the GPU). The document cases
// (lengths drawn uniformly from a range, fixed seed) stand for the bench's packed sequences; for
// them also packed tiles against document-start tiles, with partial blocks' visits 1, 2 or 4
// steps longer (the in-tile mask: +1 step, 25 %, reproduced the GPU's padded-documents
// measurement).
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <random>
#include <vector>

#include "common/attention/doc_padding.h"
#include "common/attention/dq_schedule_model.h"
#include "ops/block_mask_internal.h"
#include "sparsetrain/block_mask.h"

namespace st = sparsetrain;

namespace {

struct Case {
  const char* name;
  st::MaskKind kind;
  int64_t seq, batch, q_heads, kv_heads, window;
  int64_t doc_min = 0, doc_max = 0;  // document-causal: lengths uniform in [doc_min, doc_max]
};

// Document ids [1, seq] of lengths drawn from [lo, hi] (the model reads batch 0's for every batch).
std::vector<int32_t> document_ids(int64_t seq, int64_t lo, int64_t hi) {
  std::mt19937_64 rng(7);
  std::uniform_int_distribution<int64_t> length(lo, hi);
  std::vector<int32_t> ids(static_cast<size_t>(seq));
  for (int64_t s = 0, doc = 0; s < seq; ++doc)
    for (int64_t end = std::min(seq, s + length(rng)); s < end; ++s) ids[static_cast<size_t>(s)] = int32_t(doc);
  return ids;
}

constexpr int64_t kWorkers = 132, kVisitSteps = 4;

double critical_path(const st::DqModelProblem& pb, const st::DqColumnHandout& h, bool det, int64_t handoff,
                     int64_t partial = 0) {
  return static_cast<double>(
      st::simulate_dq_backward(pb, h, kWorkers, det, kVisitSteps, handoff, partial).critical_path);
}


// The model's problem and hand-out for `c` over `spec` (sequence `seq`) under `sch`.
struct Modelled {
  st::DqModelProblem problem;
  st::DqColumnHandout handout;
};
Modelled model_of(const Case& c, const st::MaskSpec& spec, int64_t seq, const st::ColumnSchedule& sch) {
  st::BlockMaskOptions o;
  o.auto_schedule = false;
  o.schedule = sch;
  const st::BlockMaskTensors t = st::build_block_mask(spec, seq, seq, o);
  return {st::dq_model_problem(t.mask, sch, 1, c.batch, c.q_heads, c.kv_heads),
          st::dq_handout(sch, c.batch, c.kv_heads, t.mask.num_kv_blocks(), 1)};
}

// The same documents in the padded layout (common/attention/doc_padding.h: documents of at least
// `min_length` tokens start and end on 128-token boundaries; min_length 1, every document: the
// document-start tiles, documents as ranges). The padding repeats the id before it (as the GPU
// measurement's padded documents did: it costs work like real tokens).
std::vector<int32_t> padded_to_tiles(const std::vector<int32_t>& ids, size_t min_length = 1) {
  int64_t length = 0;
  const std::vector<int64_t> pos = st::doc_padded_positions(ids.data(), int64_t(ids.size()), int64_t(min_length), &length);
  std::vector<int32_t> out(static_cast<size_t>(length), -1);
  for (size_t s = 0; s < ids.size(); ++s) out[static_cast<size_t>(pos[s])] = ids[s];
  for (size_t p = 1; p < out.size(); ++p)
    if (out[p] < 0) out[p] = out[p - 1];
  return out;
}

// The critical paths of a modelled problem: nondet, det at a hand-off of 2 steps, with partial
// blocks' visits `partial` steps longer.
struct Paths {
  double nondet, det;
};
Paths paths(const Modelled& m, int64_t partial) {
  return {critical_path(m.problem, m.handout, false, 0, partial), critical_path(m.problem, m.handout, true, 2, partial)};
}

// `spec` over `ids` padded (padded_to_tiles), left to right descending; the padded ids are kept in
// `storage` (the spec views them).
Modelled padded_model(const Case& c, const st::MaskSpec& spec, const std::vector<int32_t>& ids, size_t min_length,
                      std::vector<int32_t>& storage) {
  storage = padded_to_tiles(ids, min_length);
  st::MaskSpec padded = spec;
  padded.doc_q = padded.doc_kv = st::TensorView(storage.data(), st::DType::kInt32, {1, int64_t(storage.size())});
  return model_of(c, padded, int64_t(storage.size()), {});
}
}  // namespace

int main() {
  const Case cases[] = {{"causal B2 H16 S8192", st::MaskKind::kCausal, 8192, 2, 16, 16, -1},
                        {"causal GQA 32:4 B2 S8192", st::MaskKind::kCausal, 8192, 2, 32, 4, -1},
                        {"causal B8 H16 S2048", st::MaskKind::kCausal, 2048, 8, 16, 16, -1},
                        {"causal B8 H16 S4096", st::MaskKind::kCausal, 4096, 8, 16, 16, -1},
                        {"window 1024 B2 H16 S8192", st::MaskKind::kSlidingWindow, 8192, 2, 16, 16, 1024},
                        {"docs 1..3000 B2 H16 S16384", st::MaskKind::kDocumentCausal, 16384, 2, 16, 16, -1, 1, 3000},
                        {"docs 1..8192 GQA 8:2 S128k", st::MaskKind::kDocumentCausal, 131072, 1, 8, 2, -1, 1, 8192}};
  std::printf("%-26s %-3s %-5s %-8s %8s   det / nondet at a hand-off of 0, 1, 2, 4 steps (adds of %lld)\n", "case",
              "sch", "walk", "sections", "nondet", static_cast<long long>(kVisitSteps));
  for (const Case& c : cases) {
    st::MaskSpec spec;
    spec.kind = c.kind;
    if (c.window >= 0) {
      spec.window_left = c.window;
      spec.window_right = 0;
    }
    std::vector<int32_t> ids;
    if (c.doc_max > 0) {
      ids = document_ids(c.seq, c.doc_min, c.doc_max);
      spec.doc_q = spec.doc_kv = st::TensorView(ids.data(), st::DType::kInt32, {1, c.seq});
    }
    for (const st::ScheduleKind kind : {st::ScheduleKind::kLeftToRight, st::ScheduleKind::kShortestFirst})
    for (const st::WalkOrder walk : {st::WalkOrder::kDescendingHeadsInner, st::WalkOrder::kAscendingHeadsOuter}) {
      st::ColumnSchedule sch;
      sch.kind = kind;
      sch.walk = walk;
      const Modelled m = model_of(c, spec, c.seq, sch);
      const st::DqModelProblem& pb = m.problem;
      for (const int64_t sections : {int64_t(0), int64_t(8)}) {
        st::DqColumnHandout h = m.handout;
        h.section_groups = sections;
        const double nondet = critical_path(pb, h, false, 0);
        std::printf("%-26s %-3s %-5s %-8s %8.0f  ", c.name, kind == st::ScheduleKind::kLeftToRight ? "ltr" : "sf",
                    walk == st::WalkOrder::kDescendingHeadsInner ? "desc" : "asc",
                    sections > 0 ? "8 groups" : "none", nondet);
        for (const int64_t handoff : {0, 1, 2, 4}) std::printf(" %6.3f", critical_path(pb, h, true, handoff) / nondet);
        std::printf("\n");
      }
    }
    if (!ids.empty()) {
      // Document-start tiles against today's tiles, both left to right descending: the model's
      // unit visits (a partial tile's mask costs nothing at +0, so this is the visit / item count
      // alone); nondet, and det at a hand-off of 2.
      const Modelled today = model_of(c, spec, c.seq, {});
      std::vector<int32_t> all_ids;
      const Modelled tiles = padded_model(c, spec, ids, 1, all_ids);
      const Paths a0 = paths(today, 0), d0 = paths(tiles, 0);
      std::printf("%-26s document-start tiles / today's: nondet %.0f / %.0f = %.3f, det (hand-off 2) %.0f / %.0f = %.3f\n",
                  c.name, d0.nondet, a0.nondet, d0.nondet / a0.nondet, d0.det, a0.det, d0.det / a0.det);
      // With a partial block's visit P steps longer (its in-tile mask; 4 steps a visit): det / nondet
      // of today's tiles and of the document-start tiles.
      for (const int64_t p : {1, 2, 4}) {
        const Paths a = paths(today, p), d = paths(tiles, p);
        std::printf("%-26s partial visits +%lld steps: today det / nondet %.0f / %.0f = %.3f, document-start tiles "
                    "%.0f / %.0f = %.3f (det %.3f of today's)\n",
                    c.name, static_cast<long long>(p), a.det, a.nondet, a.det / a.nondet, d.det, d.nondet,
                    d.det / d.nondet, d.det / a.det);
      }
      // Only documents of at least L tokens padded (runs of shorter ones packed): how much of the
      // gain stays (partial visits +1 step, as calibrated on the GPU before the ids moved to shared
      // memory, and +0).
      for (const size_t min_length : {size_t(256), size_t(512), size_t(1024), size_t(2048)}) {
        std::vector<int32_t> some_ids;
        const Modelled some = padded_model(c, spec, ids, min_length, some_ids);
        std::printf("%-26s documents >= %4zu padded: length %.3f of S (all padded %.3f);", c.name, min_length,
                    double(some_ids.size()) / double(c.seq), double(all_ids.size()) / double(c.seq));
        for (const int64_t p : {0, 1}) {
          const Paths a = paths(today, p), d = paths(some, p), f = paths(tiles, p);
          std::printf("  +%lld: nondet %.3f det %.3f of today's (all padded %.3f / %.3f)", static_cast<long long>(p),
                      d.nondet / a.nondet, d.det / a.det, f.nondet / a.nondet, f.det / a.det);
        }
        std::printf("\n");
      }
    }
  }
  return 0;
}

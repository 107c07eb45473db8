// The deterministic backward's scheduler model (common/dq_schedule_model.h) on bench-like masks:
// det / nondet critical paths with adds of 4 steps and a hand-off latency of 0..4 steps (a dQ
// partial landing and its release reaching the next writer), for both walks, with and without L2
// sections of 8 (batch, kv head) groups, 132 workers. CPU only; what the model says before device
// time is spent on a hand-out change (docs/PERF.md, 2026-11-25, third session).
#include <cstdint>
#include <cstdio>

#include "common/dq_schedule_model.h"
#include "ops/block_mask_internal.h"
#include "sparsetrain/block_mask.h"

namespace st = sparsetrain;

namespace {

struct Case {
  const char* name;
  st::MaskKind kind;
  int64_t seq, batch, q_heads, kv_heads, window;
};

constexpr int64_t kWorkers = 132, kVisitSteps = 4;

double critical_path(const st::DqModelProblem& pb, const st::DqColumnHandout& h, bool det, int64_t handoff) {
  return static_cast<double>(st::simulate_dq_backward(pb, h, kWorkers, det, kVisitSteps, handoff).critical_path);
}

}  // namespace

int main() {
  const Case cases[] = {{"causal B2 H16 S8192", st::MaskKind::kCausal, 8192, 2, 16, 16, -1},
                        {"causal GQA 32:4 B2 S8192", st::MaskKind::kCausal, 8192, 2, 32, 4, -1},
                        {"causal B8 H16 S2048", st::MaskKind::kCausal, 2048, 8, 16, 16, -1},
                        {"causal B8 H16 S4096", st::MaskKind::kCausal, 4096, 8, 16, 16, -1},
                        {"window 1024 B2 H16 S8192", st::MaskKind::kSlidingWindow, 8192, 2, 16, 16, 1024}};
  std::printf("%-26s %-5s %-8s %8s   det / nondet at a hand-off of 0, 1, 2, 4 steps (adds of %lld)\n", "case",
              "walk", "sections", "nondet", static_cast<long long>(kVisitSteps));
  for (const Case& c : cases) {
    st::MaskSpec spec;
    spec.kind = c.kind;
    if (c.window >= 0) {
      spec.window_left = c.window;
      spec.window_right = 0;
    }
    for (const st::WalkOrder walk : {st::WalkOrder::kDescendingHeadsInner, st::WalkOrder::kAscendingHeadsOuter}) {
      st::ColumnSchedule sch;
      sch.kind = st::ScheduleKind::kLeftToRight;
      sch.walk = walk;
      st::BlockMaskOptions o;
      o.auto_schedule = false;
      o.schedule = sch;
      const st::BlockMaskTensors t = st::build_block_mask(spec, c.seq, c.seq, o);
      const st::DqModelProblem pb = st::dq_model_problem(t.mask, sch, 1, c.batch, c.q_heads, c.kv_heads);
      for (const int64_t sections : {int64_t(0), int64_t(8)}) {
        st::DqColumnHandout h = st::dq_handout(sch, c.batch, c.kv_heads, t.mask.num_kv_blocks(), 1);
        h.section_groups = sections;
        const double nondet = critical_path(pb, h, false, 0);
        std::printf("%-26s %-5s %-8s %8.0f  ", c.name, walk == st::WalkOrder::kDescendingHeadsInner ? "desc" : "asc",
                    sections > 0 ? "8 groups" : "none", nondet);
        for (const int64_t handoff : {0, 1, 2, 4}) std::printf(" %6.3f", critical_path(pb, h, true, handoff) / nondet);
        std::printf("\n");
      }
    }
  }
  return 0;
}

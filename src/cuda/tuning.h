// Every tuning switch of the CUDA backends, in one place, with its default: the defaults are what
// the library runs. A switch can be overridden by an environment variable, read by the functions
// below and nowhere else in src/, at every call: the benches A/B the settings in one process
// (bench_fwd_order.py, bench_grouped_linear.py --sweep, bench_gemm_paths.py,
// bench_main_grad_add.py), tests pin a path or shorten the dQ wait (scripts/gpu-check,
// test_attention_cuda, test_grouped_linear_cuda). Plain host code, tested on the CPU
// (test_sm90_tuning).
#pragma once

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>

#include "common/gpu_arch.h"                  // arch::kSimtMaxMacs
#include "cuda/grouped_linear/grouped_gemm_tuning_sm90.h"  // sm90::Tuning
#include "sparsetrain/error.h"

namespace sparsetrain::cuda::tuning {

// ---- grouped GEMMs ------------------------------------------------------------------------------

// SPARSETRAIN_SM90_RASTER=m|n and SPARSETRAIN_SM90_SWIZZLE=1|2|4|8 override the heuristic's
// choice (sm90::pick_tuning; bench/bench_grouped_linear.py --sweep). Other values are ignored.
inline sm90::Tuning sm90_override(sm90::Tuning t) {
  if (const char* e = std::getenv("SPARSETRAIN_SM90_RASTER")) {
    if (std::strcmp(e, "m") == 0) t.raster = sm90::Raster::kAlongM;
    if (std::strcmp(e, "n") == 0) t.raster = sm90::Raster::kAlongN;
  }
  if (const char* e = std::getenv("SPARSETRAIN_SM90_SWIZZLE")) {
    const int w = std::atoi(e);
    if (w == 1 || w == 2 || w == 4 || w == 8) t.swizzle = w;
  }
  return t;
}

// The size rule's threshold (arch::simt_by_size): arch::kSimtMaxMacs, or
// SPARSETRAIN_GEMM_SIMT_MAX_MACS where set (0: every size may take sm90), so that
// bench/bench_gemm_paths.py can time both paths in one process and tests can pin a path.
inline int64_t gemm_simt_max_macs() {
  const char* e = std::getenv("SPARSETRAIN_GEMM_SIMT_MAX_MACS");
  return e != nullptr ? std::atoll(e) : arch::kSimtMaxMacs;
}

// A two-way switch: `pays` unless the environment variable `name` is set to `on` (true) or `off`
// (false); other values are refused.
inline bool forced_or(const char* name, bool pays, const char* on, const char* off) {
  const char* e = std::getenv(name);
  if (e == nullptr) return pays;
  const std::string v(e);
  ST_CHECK_ARG(v == on || v == off, name, std::string(on) + " or " + off, v);
  return v == on;
}

// How the sm90 wgrad adds into an aligned fp32 main_grad: the TMA store's reduce-add
// (sm90::Variant::kWgradF32Add) where sm90::reduce_add_pays, else the register epilogue reading
// main_grad (kWgradF32); SPARSETRAIN_MAIN_GRAD_ADD=reduce|epilogue forces one (same bits either
// way; bench_main_grad_add.py and bench_grouped_linear.py --sweep A / B them).
inline bool main_grad_reduce_add(bool pays) { return forced_or("SPARSETRAIN_MAIN_GRAD_ADD", pays, "reduce", "epilogue"); }

// Whether an fprop or dgrad runs its one-CTA-cluster twin (sm90::kNoClusterTwins, where built):
// where sm90::no_cluster_pays, or as SPARSETRAIN_SM90_CLUSTER=1 (always) / 2 (never) forces (same
// bits either way; bench_grouped_linear.py --sweep A / B them).
inline bool sm90_no_cluster(bool pays) { return forced_or("SPARSETRAIN_SM90_CLUSTER", pays, "1", "2"); }

// ---- attention ----------------------------------------------------------------------------------

// The L2 both attention walks' sections fill: 2/3 of it (FlashAttention-3 budgets 32 MB of the
// H100's 50).
inline int64_t attention_l2_budget(int64_t l2_bytes) { return l2_bytes * 2 / 3; }

// The forward's work order (cuda/attention/attention_fwd_order.cu). SPARSETRAIN_ATTN_FWD_ORDER =
// sections (the default: L2 sections of heads, longest first inside each), lpt (longest first over
// the whole problem), natural (numbered order); SPARSETRAIN_ATTN_FWD_STATIC=1 hands the order out
// statically (CTA c takes c, c + grid, ...) instead of by the atomic counter
// (bench/bench_fwd_order.py).
struct AttentionFwdOrder {
  bool sections = true, natural = false, dynamic = true;
};
inline AttentionFwdOrder attention_fwd_order() {
  AttentionFwdOrder o;
  if (const char* v = std::getenv("SPARSETRAIN_ATTN_FWD_ORDER")) {
    const std::string order(v);
    ST_CHECK_ARG(order == "sections" || order == "lpt" || order == "natural", "SPARSETRAIN_ATTN_FWD_ORDER",
                 "sections, lpt or natural", order);
    o.sections = order == "sections";
    o.natural = order == "natural";
  }
  const char* st = std::getenv("SPARSETRAIN_ATTN_FWD_STATIC");
  o.dynamic = st == nullptr || std::string(st) != "1";
  return o;
}

// The backward's hand-out order (common/attention/bwd_sections.h says why, and how many groups a section).
// SPARSETRAIN_ATTN_BWD_ORDER = auto (the default: that rule), columns (one section: every group's
// column before the next column), sections (the L2 budget alone, in both modes) or sections:N
// (N groups a section).
struct AttentionBwdOrder {
  enum How { kAuto, kColumns, kBudget, kFixed } how = kAuto;
  int64_t groups = 0;  // kFixed
};
inline AttentionBwdOrder attention_bwd_order() {
  const char* v = std::getenv("SPARSETRAIN_ATTN_BWD_ORDER");
  if (v == nullptr) return {};
  const std::string order(v);
  if (order.rfind("sections:", 0) == 0) {
    const int64_t n = std::atoll(order.c_str() + 9);
    ST_CHECK_ARG(n > 0, "SPARSETRAIN_ATTN_BWD_ORDER", "sections:N with N > 0", order);
    return {AttentionBwdOrder::kFixed, n};
  }
  ST_CHECK_ARG(order == "auto" || order == "sections" || order == "columns", "SPARSETRAIN_ATTN_BWD_ORDER",
               "auto, columns, sections or sections:N", order);
  return {order == "auto"      ? AttentionBwdOrder::kAuto
          : order == "columns" ? AttentionBwdOrder::kColumns
                               : AttentionBwdOrder::kBudget};
}

// A dQ wait longer than this reports and gives up (a corrupt write order must not hang the GPU):
// 10 s, or SPARSETRAIN_ATTN_SPIN_LIMIT_MS milliseconds where set above 0 (scripts/gpu-check runs
// the tests at 5000; test_attention_cuda's abandoned-wait case at 100).
inline int64_t attention_spin_limit_ns() {
  const char* v = std::getenv("SPARSETRAIN_ATTN_SPIN_LIMIT_MS");
  const int64_t ms = v != nullptr ? std::atoll(v) : 0;
  return (ms > 0 ? ms : 10000) * 1000000;
}

}  // namespace sparsetrain::cuda::tuning

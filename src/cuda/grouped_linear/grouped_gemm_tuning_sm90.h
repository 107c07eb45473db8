// How an sm90 grouped GEMM is launched: a host heuristic from the shapes (G, T, in, out) only —
// never from split values, so a captured graph stays valid when the splits change. Plain host
// code (no CUDA), tested on the CPU (tests/cpp/test_sm90_tuning.cpp).
#pragma once

#include <cstdint>

namespace sparsetrain::cuda::sm90 {

enum class Variant {
  kFprop,      // y = x W^T
  kFpropBias,  // y = x W^T + b (bias broadcast in the epilogue)
  kDgrad,      // dx = dy W
  kWgrad,      // dW = dy^T x in the element type
  kWgradF32,   // fp32 main_grad (+)= dy^T x
  // fp32 main_grad += dy^T x through a TMA reduce-add store: the SMs never read main_grad (no
  // source load, no shared memory for it: 4 mainloop stages, kWgradF32's 3), with kWgradF32's bits
  // (tma_reduce_add_sm90.cuh). No direct-store twin: a misaligned main_grad takes kWgradF32Direct.
  kWgradF32Add,
  // The same GEMMs storing straight from the accumulator registers (no TMA store): for caller
  // outputs (out, grad_input, main_grad) whose base is off a 16-byte boundary. Same tiles, same
  // mainloop, same k order: bit-identical to the TMA-store kernel. dW in the element type is
  // always the library's (aligned), so kWgrad has no direct-store twin.
  kFpropDirect,
  kFpropBiasDirect,
  kDgradDirect,
  kWgradF32Direct,
  // fprop (and its biased form) and dgrad on clusters of one CTA, where an expert's weight is
  // small (no_cluster_pays): the same tiles, k order and TMA store, without the cluster's shared
  // weight loads: bit-identical to kFprop / kFpropBias / kDgrad.
  kFpropNoCluster,
  kFpropBiasNoCluster,
  kDgradNoCluster,
};

// Each variant with a direct-store twin, and the twin: the one table both directions read.
struct DirectStoreTwin {
  Variant tma, direct;
};
constexpr DirectStoreTwin kDirectStoreTwins[] = {{Variant::kFprop, Variant::kFpropDirect},
                                                 {Variant::kFpropBias, Variant::kFpropBiasDirect},
                                                 {Variant::kDgrad, Variant::kDgradDirect},
                                                 {Variant::kWgradF32, Variant::kWgradF32Direct}};

// Each variant with a one-CTA-cluster twin, and the twin.
struct NoClusterTwin {
  Variant cluster, single;
};
constexpr NoClusterTwin kNoClusterTwins[] = {{Variant::kFprop, Variant::kFpropNoCluster},
                                             {Variant::kFpropBias, Variant::kFpropBiasNoCluster},
                                             {Variant::kDgrad, Variant::kDgradNoCluster}};

// The direct-store twin of a variant (itself if it has none), its one-CTA-cluster twin (itself
// if it has none), and the variant a twin computes (itself for the others).
constexpr Variant direct_store(Variant v) {
  for (const DirectStoreTwin& t : kDirectStoreTwins)
    if (t.tma == v) return t.direct;
  return v;
}
constexpr Variant no_cluster(Variant v) {
  for (const NoClusterTwin& t : kNoClusterTwins)
    if (t.cluster == v) return t.single;
  return v;
}
constexpr Variant computed_by(Variant v) {
  for (const DirectStoreTwin& t : kDirectStoreTwins)
    if (t.direct == v) return t.tma;
  for (const NoClusterTwin& t : kNoClusterTwins)
    if (t.single == v) return t.cluster;
  return v;
}
constexpr bool is_direct_store(Variant v) { return direct_store(computed_by(v)) == v && computed_by(v) != v; }
constexpr bool is_no_cluster(Variant v) { return no_cluster(computed_by(v)) == v && computed_by(v) != v; }
// The weight-gradient GEMMs (M = out, N = in, K = an expert's rows), whatever they store.
constexpr bool is_wgrad(Variant v) {
  const Variant c = computed_by(v);
  return c == Variant::kWgrad || c == Variant::kWgradF32 || c == Variant::kWgradF32Add;
}

// Every variant runs 128x256x64 tiles with the cooperative schedule (both consumer warpgroups on
// one tile), on clusters of 2x1 (the pair shares each weight tile's load) but for the no-cluster
// twins. Other shapes measured against it on the fprop (H200; 128x128 ping-pong and cooperative,
// 64x128x128 and 64x256 ping-pong, 128x192, 256x128 on 1x2 clusters): none faster on any MoE
// shape class, 256x128 tying it on the large ones (docs/PERF.md, GroupedLinear).
constexpr int kTileM = 128, kTileN = 256;

// One-CTA clusters for the fprop and the dgrad (both stream an expert's whole weight past its row
// tiles) where the weight holds at most kNoClusterMaxWeight elements (8 MiB in bf16): the L2 then
// serves the CTAs that re-read it, so a 2x1 cluster's shared weight load saves little DRAM traffic
// while the pair's lockstep over shared stages, and the idle partner on a group's odd last row
// tile, still cost. H200, against the 2x1 kernel: the fprop 1.04-1.25x at 768 x 2048, 1024 x 4096,
// 2048 x 768 and 2048 x 1536 (in x out) from 8 to 128 experts; even at 4096 x 1024 and 2048 x 4096;
// 0.86-0.97x at 2048 x 7168, 7168 x 2048 and above; the dgrad 1.00-1.08x at the same small weights
// (docs/PERF.md, GroupedLinear). A shape rule: a captured graph stays valid.
constexpr int64_t kNoClusterMaxWeight = int64_t(4) << 20;
constexpr bool no_cluster_pays(Variant v, int64_t in, int64_t out) {
  return (no_cluster(v) != v || is_no_cluster(v)) && in * out <= kNoClusterMaxWeight;
}

enum class Raster { kAlongM, kAlongN };  // the order the persistent scheduler walks a group's tiles

// The persistent tile scheduler's runtime arguments.
struct Tuning {
  Raster raster = Raster::kAlongM;
  int swizzle = 1;  // 1, 2, 4 or 8 tiles
};

// wgrad's M is out and N is in, both whole per expert. When M has many more tiles than N,
// walking along M puts a whole wave on one or two N columns: every wave re-reads its dy panels
// from DRAM while x's panel is shared. Walking along N shares both (5 % faster on mixtral fc1's
// wgrad, 7 % with the fp32 main_grad). fprop and dgrad (M = the ragged rows)
// measured best or tied along M.
inline Tuning pick_tuning(Variant v, int64_t in, int64_t out) {
  Tuning t;
  const int64_t m_tiles = (out + kTileM - 1) / kTileM, n_tiles = (in + kTileN - 1) / kTileN;
  if (is_wgrad(v) && m_tiles >= 2 * n_tiles) t.raster = Raster::kAlongN;
  return t;
}

// main_grad accumulation: the reduce-add (kWgradF32Add) reads no C but ends each tile with the
// L2's read-modify-write of it, which a short mainloop (an expert's rows are the wgrad's K) does
// not hide; kWgradF32's C load is prefetched under the mainloop. The threshold is the measured
// crossover (bench/bench_main_grad_add.py; the numbers in docs/PERF.md, GroupedLinear). Decided
// by the mean rows an expert (T / G), a shape, so a graph stays valid.
constexpr int64_t kReduceAddMinRowsPerGroup = 1024;
constexpr bool reduce_add_pays(int64_t rows, int64_t groups) {
  return groups > 0 && rows >= kReduceAddMinRowsPerGroup * groups;
}

}  // namespace sparsetrain::cuda::sm90

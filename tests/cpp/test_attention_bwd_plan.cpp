// The attention backward's scratch plan (cuda/attention/attention_bwd_plan.h), without a GPU: every
// region lies inside its memory (the workspace, or dq's bytes for the regions only the kernel
// reads) and no two overlap; the regions that go into dq are exactly lse_log2, delta, the document
// rows and the transposed bitmask, and they go there only when all of them fit; the workspace
// size does not depend on the addresses.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "cuda/attention/attention_bwd_plan.h"
#include "host_tensor.h"
#include "sparsetrain/block_mask.h"
#include "sparsetrain/dtype.h"

namespace st = sparsetrain;
using st::DType;
using st::cuda::attn::BwdScratch;

namespace {

struct Region {
  std::string name;
  uintptr_t begin;
  size_t bytes;
};

// The regions of `ws` with their sizes, computed here from the problem (not from the plan).
std::vector<Region> regions(const BwdScratch& ws, const st::backend::AttentionProblem& p, const st::BlockMask& m,
                            int64_t bit_words) {
  const int64_t tile = p.head_dim <= 64 ? 128 : 64;  // the backward's q tile rows
  const int64_t rows = (m.seq_q + tile - 1) / tile * tile, bh = p.batch * p.heads_q;
  const size_t row_bytes = size_t(bh * rows) * 4;
  std::vector<Region> r = {
      {"dq_accum", uintptr_t(ws.dq_accum), row_bytes * size_t(p.head_dim)},
      {"lse_log2", uintptr_t(ws.lse_log2), row_bytes},
      {"delta", uintptr_t(ws.delta), row_bytes},
      {"semaphores", uintptr_t(ws.semaphores), size_t(bh * (rows / tile)) * 4 + 5 * 4},
      {"permutation", uintptr_t(ws.permutation), size_t((m.seq_kv + 127) / 128) * 4},
      {"sections", uintptr_t(ws.sections), 4},
  };
  if (ws.doc_q_rows != nullptr) r.push_back({"doc_q_rows", uintptr_t(ws.doc_q_rows), size_t(p.batch * rows) * 4});
  if (ws.bits_t != nullptr) r.push_back({"bits_t", uintptr_t(ws.bits_t), size_t(bit_words) * 4});
  return r;
}

bool kernel_only(const std::string& name) {
  return name == "lse_log2" || name == "delta" || name == "doc_q_rows" || name == "bits_t";
}

// Lays out the plan at two distant fake addresses and checks it; returns whether the kernel-only
// regions went into dq.
bool check_plan(const st::backend::AttentionProblem& p, const st::BlockMask& m) {
  const uintptr_t base = uintptr_t(1) << 32, dq = uintptr_t(1) << 40;  // 256-byte aligned, far apart
  const size_t dq_bytes = size_t(p.batch * p.seq_q * p.heads_q * p.head_dim) * st::dtype_size(p.dtype);
  const BwdScratch sizes(p, m, nullptr, nullptr);
  const BwdScratch ws(p, m, reinterpret_cast<void*>(base), reinterpret_cast<void*>(dq));
  EXPECT_EQ(ws.bytes, sizes.bytes) << "the workspace size depends on the addresses";
  EXPECT_EQ(ws.in_dq, sizes.in_dq);
  const int64_t bit_words = st::cuda::attn::bwd_bitmask_blocks(m).words();
  std::vector<Region> r = regions(ws, p, m, bit_words);
  size_t moved = 0;
  for (const Region& x : r) {
    const bool there = ws.in_dq && kernel_only(x.name);
    const uintptr_t lo = there ? dq : base;
    const size_t limit = there ? dq_bytes : ws.bytes;
    EXPECT_EQ(x.begin % 256, 0u) << x.name;
    EXPECT_GE(x.begin, lo) << x.name << (there ? " should be in dq" : " should be in the workspace");
    EXPECT_LE(x.begin + x.bytes, lo + limit) << x.name << " runs past " << (there ? "dq" : "the workspace");
    if (there) moved += (x.bytes + 255) / 256 * 256;
  }
  std::sort(r.begin(), r.end(), [](const Region& a, const Region& b) { return a.begin < b.begin; });
  for (size_t i = 1; i < r.size(); ++i)
    EXPECT_LE(r[i - 1].begin + r[i - 1].bytes, r[i].begin) << r[i - 1].name << " overlaps " << r[i].name;
  // Whatever did not go into dq is in the workspace: the rule is "all of them fit", nothing else.
  EXPECT_EQ(ws.in_dq, moved > 0 && moved <= dq_bytes);
  return ws.in_dq;
}

st::backend::AttentionProblem problem(int64_t batch, int64_t seq, int64_t heads_q, int64_t heads_kv, int64_t d) {
  return {DType::kBF16, batch, seq, seq, heads_q, heads_kv, d, 0.125f};
}

// One query: its rows padded to a whole tile (64 or 128 rows of lse_log2 and delta) are more
// bytes than dq's single row, and stay in the workspace.
TEST(AttentionBwdPlan, BuiltInMasksKeepTheirRowScratchInDq) {
  for (int64_t d : {64, 128}) {
    for (int64_t seq : {1, 127, 1000, 4096}) {
      st::MaskSpec causal;
      causal.kind = st::MaskKind::kCausal;
      const st::BlockMaskTensors m = st::build_block_mask(causal, seq, seq);
      EXPECT_EQ(check_plan(problem(2, seq, 8, 2, d), m.mask), seq > 1) << "D = " << d << ", S = " << seq;
    }
  }
}

TEST(AttentionBwdPlan, DocumentRowsGoWithThem) {
  const int64_t seq = 777;
  st::testing::HostTensor ids(DType::kInt32, {1, seq});
  for (int64_t i = 0; i < seq; ++i) static_cast<int32_t*>(ids.data())[i] = int32_t(i / 100);
  st::MaskSpec docs;
  docs.kind = st::MaskKind::kDocumentCausal;
  docs.doc_q = docs.doc_kv = ids.view();
  const st::BlockMaskTensors m = st::build_block_mask(docs, seq, seq);
  const BwdScratch ws(problem(1, seq, 4, 4, 64), m.mask, nullptr, nullptr);
  ASSERT_TRUE(ws.in_dq);
  EXPECT_TRUE(check_plan(problem(1, seq, 4, 4, 64), m.mask));
}

// Random bits in every block of a per-head mask: its transposed copy is 2 KiB a block, 128 KiB a
// (b, h) at S = 1024 against dq's 128 KiB at D = 64 (no room beside lse_log2 and delta) and
// 256 KiB at D = 128 (room).
TEST(AttentionBwdPlan, ABitmaskLargerThanDqStaysInTheWorkspace) {
  const int64_t seq = 1024, heads = 2;
  std::mt19937 rng(7);
  std::vector<uint8_t> bits(size_t(heads * seq * seq));
  for (auto& b : bits) b = rng() % 2;
  auto allowed = [](void* ctx, int64_t, int64_t h, int64_t q, int64_t kv) {
    return static_cast<const uint8_t*>(ctx)[(h * 1024 + q) * 1024 + kv] != 0;
  };
  const st::BlockMaskTensors m = st::build_block_mask_from_function(allowed, bits.data(), 1, heads, seq, seq);
  ASSERT_EQ(m.mask.spec.kind, st::MaskKind::kBitmask);
  EXPECT_FALSE(check_plan(problem(1, seq, heads, heads, 64), m.mask));
  EXPECT_TRUE(check_plan(problem(1, seq, heads, heads, 128), m.mask));
}

}  // namespace

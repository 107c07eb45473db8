// The CPU reference of block-sparse attention: plain loops in fp32, inputs read with load_float
// (exact) and outputs rounded once with store_float. Forward: each query row walks its q block's
// partial kv blocks then its full ones, in list order, and takes a two-pass softmax over the
// allowed keys. Backward: the FlashAttention math (delta = rowsum(dO * O), P = exp(S - lse),
// dS = P * (dP - delta)) walked the way the deterministic kernel walks it: per kv head and kv
// column, the query heads of the group in ascending order, each over the column's q blocks
// (partial and full merged, ascending); dQ gathers the columns' partials in ascending column
// order. Every reduction runs in one fixed order, so results are bitwise reproducible.
//
// Non-finite inputs (docs/DESIGN.md section 6) follow the block rule the tiled kernels follow:
// every (query, key) pair of a visited block enters the arithmetic, a masked one with weight 0,
// and 0 * inf or 0 * NaN is NaN. Forward: o gets 0 * v of a masked key of a visited block; a NaN
// score or a +inf one makes the row's sum NaN, so its o and lse are NaN; only an exact zero sum
// (no allowed key, or every allowed score -inf) gives o = 0 and lse = -inf. Backward: every pair
// of a visited block, rows without an allowed key included (P = 0 there), adds P * dO to dV,
// dS * Q to dK and dS * K to dQ, with dS = P * (dP - delta) also where P = 0. For finite inputs
// the masked pairs add exact zeros and change no bit, so they are computed only where a
// non-finite value could come out of them.
#include <cmath>
#include <cstring>
#include <limits>
#include <algorithm>
#include <cstdint>
#include <vector>

#include "common/attention/mask_index_view.h"
#include "common/attention/mask_predicate.h"
#include "ops/attention_backend.h"
#include "sparsetrain/error.h"

namespace sparsetrain::backend {
namespace {

// Element (i0, i1, i2, i3) of a 4-d view of any strides.
int64_t offset4(const TensorView& t, int64_t i0, int64_t i1, int64_t i2, int64_t i3) {
  return i0 * t.stride(0) + i1 * t.stride(1) + i2 * t.stride(2) + i3 * t.stride(3);
}

// The element mask of one head's attention inside partial blocks: a built-in spec or the
// per-partial-block bitmasks (bit (i * block_kv + j) of the block at slot `w` of q block m).
class ElementMask {
 public:
  ElementMask(const BlockMask& mask, int64_t b, int64_t h) : mask_(mask), b_(b), h_(h) {
    const MaskSpec& s = mask.spec;
    if (mask_has_documents(s.kind)) {
      doc_q_ = s.doc_q.data_as<const int32_t>() + b * s.doc_q.broadcast_stride(0);
      doc_kv_ = s.doc_kv.data_as<const int32_t>() + b * s.doc_kv.broadcast_stride(0);
    }
  }
  bool allows(int64_t m, int64_t w, int64_t q, int64_t kv) const {
    const MaskSpec& s = mask_.spec;
    if (s.kind != MaskKind::kBitmask)
      return mask_allows(s.kind, s.window_left, s.window_right, s.prefix_length, doc_q_, doc_kv_, mask_.seq_q,
                         mask_.seq_kv, q, kv);
    const TensorView& bits = mask_.partial_bitmasks;
    const int64_t bit = (q - m * mask_.block_q) * mask_.block_kv + (kv % mask_.block_kv);
    const int64_t off = b_ * bits.broadcast_stride(0) + h_ * bits.broadcast_stride(1) +
                        m * bits.stride(2) + w * bits.stride(3) + (bit / 8) * bits.stride(4);
    return (static_cast<const uint8_t*>(bits.data())[off] >> (bit % 8)) & 1u;
  }

 private:
  const BlockMask& mask_;
  int64_t b_, h_;
  const int32_t* doc_q_ = nullptr;
  const int32_t* doc_kv_ = nullptr;
};

// Rows [n * block, min((n + 1) * block, seq)) of block n.
int64_t block_end(int64_t n, int64_t block, int64_t seq) { return std::min((n + 1) * block, seq); }

// Whether every element of a row of n is finite.
bool finite_row(const float* a, int64_t n) {
  for (int64_t d = 0; d < n; ++d)
    if (!std::isfinite(a[d])) return false;
  return true;
}

float dot(const float* a, const float* b, int64_t n) {
  float s = 0.f;
  for (int64_t d = 0; d < n; ++d) s += a[d] * b[d];
  return s;
}

// Rows [0, rows) of head h of batch b of a [B, S, H, D] view, as fp32 [rows, D].
void load_head(const TensorView& t, DType dt, int64_t b, int64_t h, int64_t rows, int64_t D, float* out) {
  for (int64_t r = 0; r < rows; ++r) {
    const void* src = t.byte_ptr(offset4(t, b, r, h, 0));
    for (int64_t d = 0; d < D; ++d) out[r * D + d] = load_float(src, dt, d);
  }
}

// Scratch carving: 4-byte arrays one after the other.
struct Arena {
  char* next;
  template <typename T = float> T* take(int64_t n) {
    static_assert(sizeof(T) == 4, "the scratch plans count 4-byte elements");
    T* p = reinterpret_cast<T*>(next);
    next += n * 4;
    return p;
  }
};

class ReferenceAttentionBackend final : public AttentionBackend {
 public:
  size_t forward_scratch_bytes(const AttentionProblem& p) const override {
    const int64_t floats = 2 * p.seq_kv * p.head_dim  // k, v of one (b, hk)
                           + 2 * p.head_dim           // a q row, o's accumulators
                           + 3 * p.seq_kv;            // a row's scores and their keys, v's finite rows
    return size_t(floats) * 4;
  }

  size_t backward_scratch_bytes(const AttentionProblem& p, const BlockMask&) const override {
    const int64_t D = p.head_dim;
    const int64_t floats = p.batch * p.seq_q * p.heads_q * D  // dq accumulators
                           + p.seq_q                            // delta of one (b, hq)
                           + 4 * p.seq_kv * D                   // k, v, dk, dv of one (b, hk)
                           + 2 * p.seq_q * D                    // q, dout of one (b, hq)
                           + p.seq_kv + 2 * p.seq_q;            // their rows' finiteness
    return size_t(floats) * sizeof(float);
  }

  void forward(const AttentionForwardParams& p, void* scratch, Stream) override {
    const AttentionProblem& pr = p.problem;
    const BlockMask& mask = *p.mask;
    const DType dt = pr.dtype;
    const int64_t D = pr.head_dim, group = pr.heads_q / pr.heads_kv, Mq = mask.num_q_blocks();
    const bool has_full = mask.full_kv_num_blocks.defined();
    const MaskIndexView kv_num = mask_index_view(mask.kv_num_blocks), kv_idx = mask_index_view(mask.kv_indices);
    const MaskIndexView full_num = mask_index_view(mask.full_kv_num_blocks);
    const MaskIndexView full_idx = mask_index_view(mask.full_kv_indices);
    Arena arena{static_cast<char*>(scratch)};
    float* k = arena.take(pr.seq_kv * D);
    float* v = arena.take(pr.seq_kv * D);
    float* q = arena.take(D);
    float* acc = arena.take(D);
    float* scores = arena.take(pr.seq_kv);  // the row's allowed scores, in walk order
    int32_t* keys = arena.take<int32_t>(pr.seq_kv);
    int32_t* v_finite = arena.take<int32_t>(pr.seq_kv);  // per key: every element of its v finite
    float* lse = p.lse.data_as<float>();
    for (int64_t b = 0; b < pr.batch; ++b) {
      for (int64_t hq = 0; hq < pr.heads_q; ++hq) {
        const int64_t hk = hq / group;
        if (hq % group == 0) {
          load_head(p.k, dt, b, hk, pr.seq_kv, D, k);
          load_head(p.v, dt, b, hk, pr.seq_kv, D, v);
          for (int64_t j = 0; j < pr.seq_kv; ++j) v_finite[j] = finite_row(v + j * D, D);
        }
        const ElementMask elem(mask, b, hq);
        for (int64_t m = 0; m < Mq; ++m) {
          const int64_t num_partial = kv_num.at(b, hq, m), num_full = has_full ? full_num.at(b, hq, m) : 0;
          for (int64_t i = m * mask.block_q; i < block_end(m, mask.block_q, pr.seq_q); ++i) {
            const void* qrow = p.q.byte_ptr(offset4(p.q, b, i, hq, 0));
            for (int64_t d = 0; d < D; ++d) q[d] = load_float(qrow, dt, d);
            int64_t count = 0;
            std::fill(acc, acc + D, 0.f);
            for (int64_t w = 0; w < num_partial + num_full; ++w) {
              const bool partial = w < num_partial;
              const int64_t n = partial ? kv_idx.at(b, hq, m, w) : full_idx.at(b, hq, m, w - num_partial);
              for (int64_t j = n * mask.block_kv; j < block_end(n, mask.block_kv, pr.seq_kv); ++j) {
                if (partial && !elem.allows(m, w, i, j)) {
                  // A masked key of a visited block: weight 0 (the block rule, top of the file).
                  if (!v_finite[j])
                    for (int64_t d = 0; d < D; ++d) acc[d] += 0.f * v[j * D + d];
                  continue;
                }
                scores[count] = pr.scale * dot(q, k + j * D, D);
                keys[count++] = int32_t(j);
              }
            }
            // The max over the allowed scores, NaN skipped (the kernels' fmaxf): a NaN score
            // reaches the sum through its own exp instead. -inf (none, or all -inf): offset 0.
            float mx = -std::numeric_limits<float>::infinity();
            for (int64_t t = 0; t < count; ++t)
              if (scores[t] > mx) mx = scores[t];
            const float offset = mx == -std::numeric_limits<float>::infinity() ? 0.f : mx;
            float sum = 0.f;
            for (int64_t t = 0; t < count; ++t) {
              const float e = std::exp(scores[t] - offset);
              sum += e;
              const float* vj = v + int64_t(keys[t]) * D;
              for (int64_t d = 0; d < D; ++d) acc[d] += e * vj[d];
            }
            void* orow = p.o.byte_ptr(offset4(p.o, b, i, hq, 0));
            float* lse_out = lse + (b * pr.heads_q + hq) * pr.seq_q + i;
            if (sum == 0.f) {  // no allowed key (or every allowed score -inf): o = 0, lse = -inf
              for (int64_t d = 0; d < D; ++d) store_float(orow, dt, d, 0.f);
              *lse_out = -std::numeric_limits<float>::infinity();
              continue;
            }
            for (int64_t d = 0; d < D; ++d) store_float(orow, dt, d, acc[d] / sum);
            *lse_out = mx + std::log(sum);
          }
        }
      }
    }
  }

  void backward(const AttentionBackwardParams& p, void* scratch, Stream) override {
    const AttentionProblem& pr = p.problem;
    const BlockMask& mask = *p.mask;
    const DType dt = pr.dtype;
    const int64_t D = pr.head_dim, group = pr.heads_q / pr.heads_kv, Nk = mask.num_kv_blocks();
    const int64_t Sq = pr.seq_q, Skv = pr.seq_kv;
    const bool has_full = mask.full_q_num_blocks.defined();
    const MaskIndexView q_num = mask_index_view(mask.q_num_blocks), q_idx = mask_index_view(mask.q_indices);
    const MaskIndexView full_num = mask_index_view(mask.full_q_num_blocks);
    const MaskIndexView full_idx = mask_index_view(mask.full_q_indices);
    const MaskIndexView kv_num = mask_index_view(mask.kv_num_blocks), kv_idx = mask_index_view(mask.kv_indices);

    Arena arena{static_cast<char*>(scratch)};
    float* dq_acc = arena.take(pr.batch * Sq * pr.heads_q * D);  // [B, Sq, Hq, D]
    float* delta = arena.take(Sq);
    float* k = arena.take(Skv * D);
    float* v = arena.take(Skv * D);
    float* dk = arena.take(Skv * D);
    float* dv = arena.take(Skv * D);
    float* q = arena.take(Sq * D);
    float* dout = arena.take(Sq * D);
    int32_t* k_finite = arena.take<int32_t>(Skv);  // per row: every element finite
    int32_t* q_finite = arena.take<int32_t>(Sq);
    int32_t* dout_finite = arena.take<int32_t>(Sq);
    std::fill(dq_acc, dq_acc + pr.batch * Sq * pr.heads_q * D, 0.f);
    std::vector<int64_t> walk;  // the column's q blocks, ascending; < 0: -1 - m for a full block

    for (int64_t b = 0; b < pr.batch; ++b) {
      for (int64_t hk = 0; hk < pr.heads_kv; ++hk) {
        load_head(p.k, dt, b, hk, Skv, D, k);
        load_head(p.v, dt, b, hk, Skv, D, v);
        for (int64_t j = 0; j < Skv; ++j) k_finite[j] = finite_row(k + j * D, D);
        std::fill(dk, dk + Skv * D, 0.f);
        std::fill(dv, dv + Skv * D, 0.f);
        for (int64_t hq = hk * group; hq < (hk + 1) * group; ++hq) {
          load_head(p.q, dt, b, hq, Sq, D, q);
          load_head(p.dout, dt, b, hq, Sq, D, dout);
          for (int64_t i = 0; i < Sq; ++i) {
            q_finite[i] = finite_row(q + i * D, D);
            dout_finite[i] = finite_row(dout + i * D, D);
            const void* orow = p.o.byte_ptr(offset4(p.o, b, i, hq, 0));
            float s = 0.f;
            for (int64_t d = 0; d < D; ++d) s += dout[i * D + d] * load_float(orow, dt, d);
            delta[i] = s;
          }
          const ElementMask elem(mask, b, hq);
          for (int64_t n = 0; n < Nk; ++n) {
            // Merge the column's partial and full q blocks (each list ascending).
            walk.clear();
            const int64_t np = q_num.at(b, hq, n), nf = has_full ? full_num.at(b, hq, n) : 0;
            for (int64_t a = 0, c = 0; a < np || c < nf;) {
              const int64_t mp = a < np ? q_idx.at(b, hq, n, a) : INT64_MAX;
              const int64_t mf = c < nf ? full_idx.at(b, hq, n, c) : INT64_MAX;
              if (mp < mf) {
                walk.push_back(mp);
                ++a;
              } else {
                walk.push_back(-1 - mf);
                ++c;
              }
            }
            for (int64_t entry : walk) {
              const bool partial = entry >= 0;
              const int64_t m = partial ? entry : -1 - entry;
              const int64_t w = partial ? partial_slot(kv_num, kv_idx, b, hq, m, n) : -1;
              for (int64_t i = m * mask.block_q; i < block_end(m, mask.block_q, Sq); ++i) {
                const float row_lse = p.lse.data_as<const float>()[b * p.lse.stride(0) + hq * p.lse.stride(1) +
                                                                   i * p.lse.stride(2)];
                // A row with no allowed key (lse -inf) takes P = exp(S - inf) = 0, as the kernels.
                const float lse = row_lse == -std::numeric_limits<float>::infinity()
                                      ? std::numeric_limits<float>::infinity()
                                      : row_lse;
                const float* qi = q + i * D;
                const float* doi = dout + i * D;
                float* dqi = dq_acc + ((b * Sq + i) * pr.heads_q + hq) * D;
                for (int64_t j = n * mask.block_kv; j < block_end(n, mask.block_kv, Skv); ++j) {
                  const float* kj = k + j * D;
                  const float* vj = v + j * D;
                  float* dkj = dk + j * D;
                  float* dvj = dv + j * D;
                  const bool allowed = !partial || elem.allows(m, w, i, j);
                  const float s = allowed ? pr.scale * dot(qi, kj, D) : -std::numeric_limits<float>::infinity();
                  const float pij = s == -std::numeric_limits<float>::infinity() ? 0.f : std::exp(s - lse);
                  const float ds = pij * (dot(doi, vj, D) - delta[i]) * pr.scale;
                  if (pij == 0.f && std::isfinite(ds)) {
                    // Weight 0 (masked, or an empty row): only non-finite values come out, where
                    // the row it multiplies has them (the block rule, top of the file).
                    if (!dout_finite[i])
                      for (int64_t d = 0; d < D; ++d) dvj[d] += 0.f * doi[d];
                    if (!q_finite[i])
                      for (int64_t d = 0; d < D; ++d) dkj[d] += ds * qi[d];
                    if (!k_finite[j])
                      for (int64_t d = 0; d < D; ++d) dqi[d] += ds * kj[d];
                    continue;
                  }
                  for (int64_t d = 0; d < D; ++d) {
                    dvj[d] += pij * doi[d];
                    dkj[d] += ds * qi[d];
                    dqi[d] += ds * kj[d];
                  }
                }
              }
            }
          }
        }
        for (int64_t j = 0; j < Skv; ++j) {
          void* dkrow = p.dk.byte_ptr(offset4(p.dk, b, j, hk, 0));
          void* dvrow = p.dv.byte_ptr(offset4(p.dv, b, j, hk, 0));
          for (int64_t d = 0; d < D; ++d) {
            store_float(dkrow, dt, d, dk[j * D + d]);
            store_float(dvrow, dt, d, dv[j * D + d]);
          }
        }
      }
    }
    for (int64_t b = 0; b < pr.batch; ++b)
      for (int64_t i = 0; i < Sq; ++i)
        for (int64_t hq = 0; hq < pr.heads_q; ++hq) {
          void* dqrow = p.dq.byte_ptr(offset4(p.dq, b, i, hq, 0));
          const float* acc = dq_acc + ((b * Sq + i) * pr.heads_q + hq) * D;
          for (int64_t d = 0; d < D; ++d) store_float(dqrow, dt, d, acc[d]);
        }
  }

 private:
  // The slot of kv block n in q block m's partial list (where its bitmask sits). Validation has
  // checked the transposes against the forward lists, so it is there.
  static int64_t partial_slot(const MaskIndexView& kv_num, const MaskIndexView& kv_idx, int64_t b, int64_t h, int64_t m,
                              int64_t n) {
    const int64_t count = kv_num.at(b, h, m);
    for (int64_t w = 0; w < count; ++w)
      if (kv_idx.at(b, h, m, w) == n) return w;
    ST_FAIL("block mask: partial block (q block ", m, ", kv block ", n,
            ") is in q_indices but not in kv_indices (inconsistent transposes)");
  }
};

}  // namespace

AttentionBackend& attention_reference_backend() {
  static ReferenceAttentionBackend backend;
  return backend;
}

}  // namespace sparsetrain::backend

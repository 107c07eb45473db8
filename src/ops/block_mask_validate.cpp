// validate_block_mask and check_write_order: every rule of block_mask.h checked on host memory,
// each failure a sparsetrain::Error "name: expected X, got Y" naming the tensor and the entry.
#include <algorithm>
#include <tuple>
#include <sstream>
#include <vector>

#include "common/attention/block_mask_rows.h"
#include "common/attention/mask_predicate.h"
#include "ops/block_mask_internal.h"
#include "ops/checks.h"
#include "sparsetrain/block_mask.h"
#include "sparsetrain/error.h"

namespace sparsetrain {

namespace {

std::string entry(const char* name, int64_t b, int64_t h, const char* row_kind, int64_t r) {
  std::ostringstream os;
  os << name << "[b=" << b << ", h=" << h << ", " << row_kind << " " << r << "]";
  return os.str();
}

// Structure of one tensor: dtype, device, rank, the row count, and leading dims [B, H]
// broadcastable to the mask's.
void check_tensor(const TensorView& t, const char* name, int dim, int64_t rows, const char* rows_name, DType dtype,
                  int64_t B, int64_t H, Device device) {
  checks::dtype(t, name, dtype);
  ST_CHECK_ARG(t.device() == device, name,
               device.is_cpu() ? std::string("a host tensor (validate_block_mask reads host memory)")
                               : "a tensor on " + device.str() + " (q's device)",
               t.device().str());
  ST_CHECK_ARG(t.dim() == dim, name, std::to_string(dim) + " dimensions", t.dim(), " (shape ", t.shape_str(), ")");
  ST_CHECK_ARG(t.size(2) == rows, name, std::string("size ") + std::to_string(rows) + " (" + rows_name + ") in dim 2",
               t.size(2), " (shape ", t.shape_str(), ")");
  ST_CHECK_ARG((t.size(0) == 1 || t.size(0) == B) && (t.size(1) == 1 || t.size(1) == H), name,
               "leading dims broadcastable to [B=" + std::to_string(B) + ", H=" + std::to_string(H) + "]",
               t.shape_str());
  for (int d = 3; d < dim; ++d) ST_CHECK_ARG(t.size(d) >= 0, name, "sizes >= 0", t.shape_str());
  checks::non_null(t, name);
}

void check_pair(const TensorView& counts, const TensorView& idx, const char* cname, const char* iname) {
  ST_CHECK_ARG(counts.defined() == idx.defined(), counts.defined() ? iname : cname,
               std::string("a tensor (") + cname + " and " + iname + " come together)", "none");
}

// One (b, h) list of rows: counts within the width and the other side's block count, entries in
// range and strictly increasing.
void check_rows(const IndexRows& r, int64_t rows, int64_t width, int64_t range, const char* cname, const char* iname,
                const char* row_kind, const char* entry_kind, int64_t b, int64_t h) {
  for (int64_t i = 0; i < rows; ++i) {
    const int32_t c = r.count(i);
    ST_CHECK_ARG(c >= 0, entry(cname, b, h, row_kind, i).c_str(), "a count >= 0", c);
    ST_CHECK_ARG(c <= width, entry(cname, b, h, row_kind, i).c_str(),
                 "a count <= the width of " + std::string(iname) + " (" + std::to_string(width) + ")", c);
    ST_CHECK_ARG(c <= range, entry(cname, b, h, row_kind, i).c_str(),
                 "a count <= the number of " + std::string(entry_kind) + "s (" + std::to_string(range) + ")", c);
    for (int32_t k = 0; k < c; ++k) {
      const int32_t v = r.at(i, k);
      // The entry's name is built only for a failure: this loop visits every index of the mask.
      const auto where = [&] { return entry(iname, b, h, row_kind, i) + " entry " + std::to_string(k); };
      ST_CHECK_ARG(v >= 0 && v < range, where().c_str(),
                   std::string("a ") + entry_kind + " in [0, " + std::to_string(range) + ")", v);
      if (k > 0) {
        const int32_t prev = r.at(i, k - 1);
        ST_CHECK_ARG(v != prev, where().c_str(), std::string("no duplicate ") + entry_kind + "s", v, " twice");
        ST_CHECK_ARG(v > prev, where().c_str(),
                     std::string("ascending ") + entry_kind + "s (the walk order), after " + std::to_string(prev), v);
      }
    }
  }
}

}  // namespace

void check_block_mask_structure(const BlockMask& mask, int64_t batch, int64_t heads, Device device) {
  ST_CHECK_ARG(mask.seq_q >= 1, "BlockMask seq_q", ">= 1", mask.seq_q);
  ST_CHECK_ARG(mask.seq_kv >= 1, "BlockMask seq_kv", ">= 1", mask.seq_kv);
  ST_CHECK_ARG(mask.block_q >= 1, "BlockMask block_q", ">= 1", mask.block_q);
  ST_CHECK_ARG(mask.block_kv >= 1, "BlockMask block_kv", ">= 1", mask.block_kv);
  ST_CHECK_ARG(batch >= 0 && heads >= 0, "validate_block_mask batch / heads", "sizes >= 0 (0: any)", batch, ", ",
               heads);
  const int64_t Mq = mask.num_q_blocks(), Nk = mask.num_kv_blocks();
  const std::string mq = "Mq = " + std::to_string(Mq), nk = "Nk = " + std::to_string(Nk);

  checks::defined(mask.kv_num_blocks, "kv_num_blocks", "int32 [B, H, Mq]");
  checks::defined(mask.kv_indices, "kv_indices", "int32 [B, H, Mq, W]");
  check_pair(mask.full_kv_num_blocks, mask.full_kv_indices, "full_kv_num_blocks", "full_kv_indices");
  check_pair(mask.q_num_blocks, mask.q_indices, "q_num_blocks", "q_indices");
  check_pair(mask.full_q_num_blocks, mask.full_q_indices, "full_q_num_blocks", "full_q_indices");
  const bool has_full = mask.full_kv_indices.defined(), has_q = mask.q_indices.defined();
  if (has_q)
    ST_CHECK_ARG(mask.full_q_indices.defined() == has_full, has_full ? "full_q_indices" : "full_kv_indices",
                 "full lists on both sides or on neither", "them on one side only");
  ST_CHECK_ARG(!mask.dq_write_order.defined() || has_q, "dq_write_order", "the transposes it is parallel to (q_indices)",
               "no q_indices");
  ST_CHECK_ARG(mask.dq_write_order_full.defined() == (mask.dq_write_order.defined() && mask.full_q_indices.defined()),
               "dq_write_order_full", "a tensor exactly when dq_write_order and full_q_indices are given",
               mask.dq_write_order_full.defined() ? "a tensor" : "none");

  // The mask's leading dims: the given batch / heads, or the largest over its tensors.
  int64_t B = batch, H = heads, mb = 1, mh = 1;
  mask_leading_dims(mask, &mb, &mh);
  if (B == 0) B = mb;
  if (H == 0) H = mh;
  check_tensor(mask.kv_num_blocks, "kv_num_blocks", 3, Mq, mq.c_str(), DType::kInt32, B, H, device);
  check_tensor(mask.kv_indices, "kv_indices", 4, Mq, mq.c_str(), DType::kInt32, B, H, device);
  if (has_full) {
    check_tensor(mask.full_kv_num_blocks, "full_kv_num_blocks", 3, Mq, mq.c_str(), DType::kInt32, B, H, device);
    check_tensor(mask.full_kv_indices, "full_kv_indices", 4, Mq, mq.c_str(), DType::kInt32, B, H, device);
  }
  if (has_q) {
    check_tensor(mask.q_num_blocks, "q_num_blocks", 3, Nk, nk.c_str(), DType::kInt32, B, H, device);
    check_tensor(mask.q_indices, "q_indices", 4, Nk, nk.c_str(), DType::kInt32, B, H, device);
    if (has_full) {
      check_tensor(mask.full_q_num_blocks, "full_q_num_blocks", 3, Nk, nk.c_str(), DType::kInt32, B, H, device);
      check_tensor(mask.full_q_indices, "full_q_indices", 4, Nk, nk.c_str(), DType::kInt32, B, H, device);
    }
  }
  if (mask.dq_write_order.defined()) {
    check_tensor(mask.dq_write_order, "dq_write_order", 4, Nk, nk.c_str(), DType::kInt32, B, H, device);
    if (mask.dq_write_order_full.defined())
      check_tensor(mask.dq_write_order_full, "dq_write_order_full", 4, Nk, nk.c_str(), DType::kInt32, B, H, device);
    if (mask.schedule.kind == ScheduleKind::kPermutation) {
      std::vector<char> seen(size_t(Nk), 0);
      bool ok = int64_t(mask.schedule.permutation.size()) == Nk;
      for (size_t i = 0; ok && i < mask.schedule.permutation.size(); ++i) {
        const int32_t c = mask.schedule.permutation[i];
        ok = c >= 0 && c < Nk && !seen[size_t(c)];
        if (ok) seen[size_t(c)] = 1;
      }
      ST_CHECK_ARG(ok, "BlockMask schedule.permutation", "a permutation of the " + std::to_string(Nk) + " kv block columns",
                   mask.schedule.str());
    }
  }

  // The mask inside partial blocks.
  const MaskSpec& spec = mask.spec;
  if (spec.kind == MaskKind::kBitmask) {
    checks::defined(mask.partial_bitmasks, "partial_bitmasks", "uint8 bitmasks (spec.kind is bitmask)");
    check_tensor(mask.partial_bitmasks, "partial_bitmasks", 5, Mq, mq.c_str(), DType::kUInt8, B, H, device);
    const int64_t bytes = (mask.block_q * mask.block_kv + 7) / 8;
    ST_CHECK_ARG(mask.partial_bitmasks.size(4) == bytes, "partial_bitmasks",
                 "a last dim of " + std::to_string(bytes) + " bytes (block_q * block_kv bits)",
                 mask.partial_bitmasks.shape_str());
  } else if (mask_has_documents(spec.kind)) {
    for (const auto& [t, name, len] : {std::make_tuple(&spec.doc_q, "spec.doc_q", mask.seq_q),
                                       std::make_tuple(&spec.doc_kv, "spec.doc_kv", mask.seq_kv)}) {
      checks::defined(*t, name, "int32 document ids [B or 1, S]");
      checks::dtype(*t, name, DType::kInt32);
      ST_CHECK_ARG(t->device() == device, name, device.is_cpu() ? "a host tensor" : "a tensor on " + device.str(),
                   t->device().str());
      checks::shape(*t, name, {-1, len}, "[B or 1, " + std::to_string(len) + "]");
      ST_CHECK_ARG(t->size(0) == 1 || t->size(0) == B, name,
                   "a batch of 1 or " + std::to_string(B), t->shape_str());
      checks::unit_last_stride(*t, name);
      checks::non_null(*t, name);
    }
  }

}

void validate_block_mask(const BlockMask& mask, int64_t batch, int64_t heads) {
  check_block_mask_structure(mask, batch, heads, Device::cpu());
  const int64_t Mq = mask.num_q_blocks(), Nk = mask.num_kv_blocks();
  const MaskSpec& spec = mask.spec;
  const bool has_full = mask.full_kv_indices.defined(), has_q = mask.q_indices.defined();
  int64_t mb = 1, mh = 1;
  mask_leading_dims(mask, &mb, &mh);

  // Contents, slice by slice (over the tensors' own leading dims: broadcasting repeats nothing).
  const int64_t W = mask.kv_indices.size(3), FW = has_full ? mask.full_kv_indices.size(3) : 0;
  const int64_t QW = has_q ? mask.q_indices.size(3) : 0, FQW = has_q && has_full ? mask.full_q_indices.size(3) : 0;
  std::vector<uint8_t> cls(static_cast<size_t>(Mq * Nk));
  for (int64_t b = 0; b < mb; ++b)
    for (int64_t h = 0; h < mh; ++h) {
      const IndexRows kv = mask_rows(mask.kv_num_blocks, mask.kv_indices, b, h);
      const IndexRows fkv = mask_rows(mask.full_kv_num_blocks, mask.full_kv_indices, b, h);
      check_rows(kv, Mq, W, Nk, "kv_num_blocks", "kv_indices", "q block", "kv block", b, h);
      if (has_full) check_rows(fkv, Mq, FW, Nk, "full_kv_num_blocks", "full_kv_indices", "q block", "kv block", b, h);
      std::fill(cls.begin(), cls.end(), uint8_t(kBlockSkipped));
      int64_t partial_total = 0, full_total = 0;
      for (int64_t m = 0; m < Mq; ++m) {
        for (int32_t i = 0; i < kv.count(m); ++i) cls[size_t(m * Nk + kv.at(m, i))] = kBlockPartial;
        partial_total += kv.count(m);
        for (int32_t i = 0; i < fkv.count(m); ++i) {
          uint8_t& c = cls[size_t(m * Nk + fkv.at(m, i))];
          ST_CHECK_ARG(c == kBlockSkipped, entry("full_kv_indices", b, h, "q block", m).c_str(),
                       "kv blocks that are not also partial (in kv_indices)", "kv block ", fkv.at(m, i), " in both");
          c = kBlockFull;
        }
        full_total += fkv.count(m);
        if (spec.kind == MaskKind::kBitmask)
          ST_CHECK_ARG(kv.count(m) <= mask.partial_bitmasks.size(3), entry("partial_bitmasks", b, h, "q block", m).c_str(),
                       "a width >= the partial count " + std::to_string(kv.count(m)),
                       mask.partial_bitmasks.size(3));
      }
      if (!has_q) continue;
      const IndexRows q = mask_rows(mask.q_num_blocks, mask.q_indices, b, h);
      const IndexRows fq = mask_rows(mask.full_q_num_blocks, mask.full_q_indices, b, h);
      check_rows(q, Nk, QW, Mq, "q_num_blocks", "q_indices", "kv block", "q block", b, h);
      if (has_full) check_rows(fq, Nk, FQW, Mq, "full_q_num_blocks", "full_q_indices", "kv block", "q block", b, h);
      int64_t q_partial_total = 0, q_full_total = 0;
      for (int64_t n = 0; n < Nk; ++n) {
        for (int32_t i = 0; i < q.count(n); ++i)
          ST_CHECK_ARG(cls[size_t(q.at(n, i) * Nk + n)] == kBlockPartial, entry("q_indices", b, h, "kv block", n).c_str(),
                       "the transpose of kv_indices", "q block ", q.at(n, i), ", which kv_indices does not list as partial");
        for (int32_t i = 0; i < fq.count(n); ++i)
          ST_CHECK_ARG(cls[size_t(fq.at(n, i) * Nk + n)] == kBlockFull, entry("full_q_indices", b, h, "kv block", n).c_str(),
                       "the transpose of full_kv_indices", "q block ", fq.at(n, i),
                       ", which full_kv_indices does not list");
        q_partial_total += q.count(n);
        q_full_total += fq.count(n);
        // A write order parallel to a compact list needs at least the count's width too.
        if (mask.dq_write_order.defined()) {
          ST_CHECK_ARG(q.count(n) <= mask.dq_write_order.size(3), entry("dq_write_order", b, h, "kv block", n).c_str(),
                       "a width >= the q_num_blocks count " + std::to_string(q.count(n)), mask.dq_write_order.size(3));
          if (has_full)
            ST_CHECK_ARG(fq.count(n) <= mask.dq_write_order_full.size(3),
                         entry("dq_write_order_full", b, h, "kv block", n).c_str(),
                         "a width >= the full_q_num_blocks count " + std::to_string(fq.count(n)),
                         mask.dq_write_order_full.size(3));
        }
      }
      ST_CHECK_ARG(q_partial_total == partial_total, entry("q_num_blocks", b, h, "all", Nk).c_str(),
                   "the transpose of kv_indices (" + std::to_string(partial_total) + " partial blocks)", q_partial_total);
      ST_CHECK_ARG(q_full_total == full_total, entry("full_q_num_blocks", b, h, "all", Nk).c_str(),
                   "the transpose of full_kv_indices (" + std::to_string(full_total) + " full blocks)", q_full_total);
    }
  if (mask.dq_write_order.defined()) {
    const std::string why = check_write_order(mask);
    if (!why.empty()) throw Error(Error::Kind::kInvalidArgument, why);
  }
}

std::string check_write_order(const BlockMask& mask) {
  if (!mask.q_indices.defined() || !mask.q_num_blocks.defined()) return "q_indices: expected the transposes, got none";
  if (!mask.dq_write_order.defined()) return "dq_write_order: expected a tensor, got none";
  const bool has_full = mask.full_q_indices.defined();
  if (has_full && !mask.dq_write_order_full.defined()) return "dq_write_order_full: expected a tensor, got none";
  const int64_t Mq = mask.num_q_blocks(), Nk = mask.num_kv_blocks();
  const ColumnSchedule& sch = mask.schedule;
  if (sch.kind == ScheduleKind::kPermutation && int64_t(sch.permutation.size()) != Nk)
    return "schedule.permutation: expected " + std::to_string(Nk) + " columns, got " +
           std::to_string(sch.permutation.size());
  int64_t B = 1, H = 1;
  mask_leading_dims(mask, &B, &H);
  std::vector<int64_t> writers(static_cast<size_t>(Mq));  // columns seen so far at each q block
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h) {
      const IndexRows q = mask_rows(mask.q_num_blocks, mask.q_indices, b, h);
      const IndexRows fq = mask_rows(mask.full_q_num_blocks, mask.full_q_indices, b, h);
      const MaskIndexOut wo = mask_write_order(mask.dq_write_order, b, h);
      const MaskIndexOut fwo = mask_write_order(mask.dq_write_order_full, b, h);
      std::fill(writers.begin(), writers.end(), 0);
      // Columns in hand-out order: at each q block the next rank must go to the next column
      // touching it (common/attention/dq_turn.h). Ranks are in block units: any split of the columns into
      // consecutive sub-columns (dq_visit_turn) keeps them increasing with hand-out position.
      for (int64_t p = 0; p < Nk; ++p) {
        const int64_t n = schedule_column(sch.kind, sch.permutation.data(), p, Nk);
        if (n < 0 || n >= Nk) return "schedule.permutation: expected column ids in [0, Nk), got " + sch.str();
        for (int pass = 0; pass < 2; ++pass) {
          const IndexRows& rows = pass == 0 ? q : fq;
          const MaskIndexOut& order = pass == 0 ? wo : fwo;
          const TensorView& ot = pass == 0 ? mask.dq_write_order : mask.dq_write_order_full;
          const int32_t c = rows.count(n);
          if (c > 0 && c > ot.size(3)) {
            std::ostringstream os;
            os << (pass == 0 ? "dq_write_order" : "dq_write_order_full") << "[b=" << b << ", h=" << h << ", column "
               << n << "]: expected a width >= " << c << ", got " << ot.size(3);
            return os.str();
          }
          for (int32_t i = 0; i < c; ++i) {
            const int32_t m = rows.at(n, i);
            if (m < 0 || m >= Mq) return "q_indices: expected q blocks in [0, Mq), got " + std::to_string(m);
            const int64_t got = order.at(0, 0, n, i), want = writers[size_t(m)];
            if (got != want) {
              std::ostringstream os;
              os << (pass == 0 ? "dq_write_order" : "dq_write_order_full") << "[b=" << b << ", h=" << h << ", column "
                 << n << ", q block " << m << "]: expected turn " << want << " (column " << n << " is writer "
                 << writers[size_t(m)] << " of q block " << m << " in " << sch.str() << " order), got " << got;
              return os.str();
            }
            ++writers[size_t(m)];
          }
        }
      }
    }
  return "";
}

}  // namespace sparsetrain

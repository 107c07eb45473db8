// Block-mask builders (built-in spec, dense block matrix, mask function), the transposes and the dQ
// write orders. Each builder is a plain loop over rows of blocks calling the host/device row
// functions of src/common/attention/block_mask_rows.h, so a CUDA kernel can run the same steps per row;
// tensors are full width (Nk / Mq), sized by shapes alone — except the function builder's
// bitmasks, whose width is the largest partial count (a host-only builder: the function is host code).
#include <algorithm>
#include <array>
#include <climits>
#include <tuple>
#include <sstream>
#include <vector>

#include "common/attention/block_mask_rows.h"
#include "common/attention/doc_padding.h"
#include "common/attention/dq_schedule_model.h"
#include "common/attention/mask_predicate.h"
#include "ops/block_mask_internal.h"
#include "ops/checks.h"
#include "sparsetrain/block_mask.h"
#include "sparsetrain/error.h"
#if SPARSETRAIN_WITH_CUDA
#include "cuda/block_mask/block_mask_cuda.h"
#endif

namespace sparsetrain {

// ---- ColumnSchedule / MaskSpec --------------------------------------------------------------

int64_t ColumnSchedule::position(int64_t n, int64_t num_columns) const {
  ST_CHECK_ARG(n >= 0 && n < num_columns, "ColumnSchedule::position column",
               "0 <= column < " + std::to_string(num_columns), n);
  if (kind != ScheduleKind::kPermutation) return schedule_position(kind, nullptr, n, num_columns);
  // A permutation has no inverse at hand here: found by search (and checked to hold n).
  for (size_t p = 0; p < permutation.size(); ++p)
    if (permutation[p] == n) return int64_t(p);
  ST_CHECK_ARG(false, "ColumnSchedule permutation", "a permutation holding column " + std::to_string(n), str());
  return n;
}

const char* block_mask_tensor_name(int i) {
  static const char* const names[kBlockMaskTensors] = {
      "kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices", "q_num_blocks", "q_indices",
      "full_q_num_blocks", "full_q_indices", "dq_write_order", "dq_write_order_full", "partial_bitmasks"};
  return names[i];
}

TensorView& block_mask_tensor(BlockMask& m, int i) {
  TensorView* fields[kBlockMaskTensors] = {&m.kv_num_blocks,  &m.kv_indices,        &m.full_kv_num_blocks,
                                           &m.full_kv_indices, &m.q_num_blocks,     &m.q_indices,
                                           &m.full_q_num_blocks, &m.full_q_indices, &m.dq_write_order,
                                           &m.dq_write_order_full, &m.partial_bitmasks};
  return *fields[i];
}

const Tensor& block_mask_tensor(const BlockMaskTensors& t, int i) {
  const Tensor* fields[kBlockMaskTensors] = {&t.kv_num_blocks,  &t.kv_indices,        &t.full_kv_num_blocks,
                                             &t.full_kv_indices, &t.q_num_blocks,     &t.q_indices,
                                             &t.full_q_num_blocks, &t.full_q_indices, &t.dq_write_order,
                                             &t.dq_write_order_full, &t.partial_bitmasks};
  return *fields[i];
}

const char* walk_order_name(WalkOrder w) {
  switch (w) {
    case WalkOrder::kAscendingHeadsOuter: return "ascending_heads_outer";
    case WalkOrder::kAscendingHeadsInner: return "ascending_heads_inner";
    default: return "descending_heads_inner";
  }
}

WalkOrder parse_walk_order(const std::string& name) {
  for (WalkOrder w : {WalkOrder::kDescendingHeadsInner, WalkOrder::kAscendingHeadsOuter, WalkOrder::kAscendingHeadsInner})
    if (name == walk_order_name(w)) return w;
  detail::throw_arg_error("walk", "\"descending_heads_inner\", \"ascending_heads_outer\" or \"ascending_heads_inner\"",
                          name);
}

const char* schedule_kind_name(ScheduleKind k) {
  switch (k) {
    case ScheduleKind::kLeftToRight: return "left_to_right";
    case ScheduleKind::kShortestFirst: return "shortest_first";
    case ScheduleKind::kPermutation: return "permutation";
  }
  return "?";
}

ScheduleKind parse_schedule_kind(const std::string& name) {
  for (ScheduleKind k : {ScheduleKind::kLeftToRight, ScheduleKind::kShortestFirst, ScheduleKind::kPermutation})
    if (name == schedule_kind_name(k)) return k;
  detail::throw_arg_error("schedule", "\"left_to_right\", \"shortest_first\" or \"permutation\"", name);
}

const char* mask_kind_name(MaskKind k) {
  switch (k) {
    case MaskKind::kFull: return "full";
    case MaskKind::kCausal: return "causal";
    case MaskKind::kCausalBottomRight: return "causal_bottom_right";
    case MaskKind::kSlidingWindow: return "sliding_window";
    case MaskKind::kDocument: return "document";
    case MaskKind::kDocumentCausal: return "document_causal";
    case MaskKind::kPrefixLM: return "prefix_lm";
    case MaskKind::kBitmask: return "bitmask";
  }
  return "?";
}

MaskKind parse_mask_kind(const std::string& name) {
  for (MaskKind k : {MaskKind::kFull, MaskKind::kCausal, MaskKind::kCausalBottomRight, MaskKind::kSlidingWindow,
                     MaskKind::kDocument, MaskKind::kDocumentCausal, MaskKind::kPrefixLM, MaskKind::kBitmask})
    if (name == mask_kind_name(k)) return k;
  detail::throw_arg_error("kind",
                          "one of full, causal, causal_bottom_right, sliding_window, document, document_causal, "
                          "prefix_lm, bitmask",
                          name);
}

std::string ColumnSchedule::str() const {
  const std::string walk_text = walk == WalkOrder::kDescendingHeadsInner   ? ""
                                : walk == WalkOrder::kAscendingHeadsOuter ? " + ascending heads outer"
                                                                          : " + ascending heads inner";
  switch (kind) {
    case ScheduleKind::kLeftToRight: return "left-to-right" + walk_text;
    case ScheduleKind::kShortestFirst: return "shortest-first" + walk_text;
    case ScheduleKind::kPermutation: {
      std::ostringstream os;
      os << "permutation[";
      for (size_t i = 0; i < permutation.size() && i < 32; ++i) os << (i ? ", " : "") << permutation[i];
      if (permutation.size() > 32) os << ", ... (" << permutation.size() << " columns)";
      os << "]" << walk_text;
      return os.str();
    }
  }
  return "?";
}

std::string MaskSpec::str() const {
  std::ostringstream os;
  os << mask_kind_name(kind);
  if (kind == MaskKind::kSlidingWindow) os << "(left=" << window_left << ", right=" << window_right << ")";
  if (kind == MaskKind::kPrefixLM) os << "(prefix_length=" << prefix_length << ")";
  return os.str();
}

// ---- slices --------------------------------------------------------------------------------

IndexRows mask_rows(const TensorView& counts, const TensorView& indices, int64_t b, int64_t h) {
  if (!counts.defined() || !indices.defined()) return {};
  return {mask_index_view(counts).slice(b, h), mask_index_view(indices).slice(b, h)};
}

MaskIndexOut mask_write_order(const TensorView& order, int64_t b, int64_t h) {
  return mask_index_view<int32_t>(order).slice(b, h);
}

void mask_leading_dims(const BlockMask& mask, int64_t* batch, int64_t* heads) {
  int64_t b = 1, h = 1;
  for (const TensorView* t : {&mask.kv_num_blocks, &mask.kv_indices, &mask.full_kv_num_blocks, &mask.full_kv_indices,
                              &mask.q_num_blocks, &mask.q_indices, &mask.full_q_num_blocks, &mask.full_q_indices,
                              &mask.dq_write_order, &mask.dq_write_order_full, &mask.partial_bitmasks}) {
    if (!t->defined() || t->dim() < 2) continue;
    b = std::max(b, t->size(0));
    h = std::max(h, t->size(1));
  }
  *batch = b;
  *heads = h;
}

BwdWalkShape mask_walk_shape(const BlockMask& mask, WalkOrder walk) {
  int64_t B = 1, H = 1;
  mask_leading_dims(mask, &B, &H);
  return bwd_walk_shape(walk, H > 1);
}

DqColumnHandout dq_handout(const ColumnSchedule& schedule, int64_t batch, int64_t kv_heads, int64_t num_columns,
                           int64_t sub_tiles) {
  DqColumnHandout d;
  d.batch = batch;
  d.kv_heads = kv_heads;
  d.num_columns = num_columns;
  d.sub_tiles = sub_tiles;
  d.kind = schedule.kind;
  d.permutation = schedule.permutation.data();
  return d;
}

namespace {

void check_model_shape(const BlockMask& mask, int64_t batch, int64_t q_heads, int64_t kv_heads) {
  ST_CHECK_ARG(mask.q_num_blocks.defined() && mask.q_indices.defined(), "BlockMask q_indices",
               "the transposes (transpose_block_mask)", "none");
  ST_CHECK_ARG(batch >= 1 && q_heads >= 1 && kv_heads >= 1 && q_heads % kv_heads == 0, "model heads",
               "batch >= 1 and q_heads a multiple of kv_heads", "batch ", batch, ", q_heads ", q_heads,
               ", kv_heads ", kv_heads);
  int64_t B = 1, H = 1;
  mask_leading_dims(mask, &B, &H);
  ST_CHECK_ARG((B == 1 || B == batch) && (H == 1 || H == q_heads), "model batch / heads",
               "the mask's leading dims [" + std::to_string(B) + ", " + std::to_string(H) + "] broadcastable to them",
               "batch ", batch, ", q_heads ", q_heads);
}



// Merged walk of column n (partial and full lists ascending) with a turn per entry.
template <typename TurnOf>
void append_walk(const IndexRows& q, const IndexRows& fq, int64_t n, DqModelProblem& pb, TurnOf turn_of) {
  const int32_t np = q.count(n), nf = fq.count(n);
  int32_t i = 0, j = 0;
  while (i < np || j < nf) {
    const bool take_partial = j >= nf || (i < np && q.at(n, i) < fq.at(n, j));
    const int32_t m = take_partial ? q.at(n, i) : fq.at(n, j);
    pb.walk_q_block.push_back(m);
    pb.walk_turn.push_back(turn_of(take_partial, take_partial ? i : j, m));
    pb.walk_partial.push_back(take_partial ? 1 : 0);
    if (take_partial) ++i;
    else ++j;
  }
}

DqModelProblem empty_problem(const BlockMask& mask, int64_t sub_tiles, int64_t batch, int64_t q_heads,
                             int64_t kv_heads) {
  DqModelProblem pb;
  pb.batch = batch;
  pb.q_heads = q_heads;
  pb.kv_heads = kv_heads;
  pb.num_q_blocks = mask.num_q_blocks();
  pb.num_columns = mask.num_kv_blocks();
  pb.sub_tiles = sub_tiles;
  pb.walk_begin.reserve(size_t(batch * q_heads * pb.num_columns + 1));
  pb.walk_begin.push_back(0);
  return pb;
}

}  // namespace

DqModelProblem dq_model_problem(const BlockMask& mask, int64_t sub_tiles, int64_t batch, int64_t q_heads,
                                int64_t kv_heads) {
  check_model_shape(mask, batch, q_heads, kv_heads);
  ST_CHECK_ARG(mask.dq_write_order.defined(), "BlockMask dq_write_order", "the write orders (compute_dq_write_order)",
               "none");
  DqModelProblem pb = empty_problem(mask, sub_tiles, batch, q_heads, kv_heads);
  pb.walk = mask_walk_shape(mask, mask.schedule.walk);
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t h = 0; h < q_heads; ++h) {
      const IndexRows q = mask_rows(mask.q_num_blocks, mask.q_indices, b, h);
      const IndexRows fq = mask_rows(mask.full_q_num_blocks, mask.full_q_indices, b, h);
      const MaskIndexOut wo = mask_write_order(mask.dq_write_order, b, h);
      const MaskIndexOut fwo = mask_write_order(mask.dq_write_order_full, b, h);
      for (int64_t n = 0; n < pb.num_columns; ++n) {
        append_walk(q, fq, n, pb,
                    [&](bool partial, int32_t i, int32_t) { return partial ? wo.at(0, 0, n, i) : fwo.at(0, 0, n, i); });
        pb.walk_begin.push_back(int64_t(pb.walk_q_block.size()));
      }
    }
  return pb;
}

DqModelProblem dq_model_problem(const BlockMask& mask, const ColumnSchedule& schedule, int64_t sub_tiles,
                                int64_t batch, int64_t q_heads, int64_t kv_heads) {
  check_model_shape(mask, batch, q_heads, kv_heads);
  DqModelProblem pb = empty_problem(mask, sub_tiles, batch, q_heads, kv_heads);
  pb.walk = mask_walk_shape(mask, schedule.walk);
  const int64_t Nk = pb.num_columns, Mq = pb.num_q_blocks;
  std::vector<int32_t> next_turn(static_cast<size_t>(Mq));
  std::vector<int32_t> turns;
  std::vector<int64_t> turn_begin(static_cast<size_t>(Nk + 1));
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t h = 0; h < q_heads; ++h) {
      const IndexRows q = mask_rows(mask.q_num_blocks, mask.q_indices, b, h);
      const IndexRows fq = mask_rows(mask.full_q_num_blocks, mask.full_q_indices, b, h);
      // Ranks by walking the columns in hand-out order: each q block's next rank goes to the next
      // column touching it.
      std::fill(next_turn.begin(), next_turn.end(), 0);
      turn_begin[0] = 0;
      for (int64_t n = 0; n < Nk; ++n) turn_begin[size_t(n + 1)] = turn_begin[size_t(n)] + q.count(n) + fq.count(n);
      turns.assign(size_t(turn_begin[size_t(Nk)]), 0);
      for (int64_t p = 0; p < Nk; ++p) {
        const int64_t n = schedule_column(schedule.kind, schedule.permutation.data(), p, Nk);
        int64_t k = turn_begin[size_t(n)];
        for (int32_t i = 0; i < q.count(n); ++i, ++k) {
          turns[size_t(k)] = next_turn[size_t(q.at(n, i))];
          ++next_turn[size_t(q.at(n, i))];
        }
        for (int32_t i = 0; i < fq.count(n); ++i, ++k) {
          turns[size_t(k)] = next_turn[size_t(fq.at(n, i))];
          ++next_turn[size_t(fq.at(n, i))];
        }
      }
      for (int64_t n = 0; n < Nk; ++n) {
        const int64_t base = turn_begin[size_t(n)], np = q.count(n);
        append_walk(q, fq, n, pb, [&](bool partial, int32_t i, int32_t) {
          return turns[size_t(base + (partial ? i : np + i))];
        });
        pb.walk_begin.push_back(int64_t(pb.walk_q_block.size()));
      }
    }
  return pb;
}

// ---- builders ------------------------------------------------------------------------------

namespace {

Allocator& alloc_or_default(Allocator* a) { return a != nullptr ? *a : default_allocator(); }

Tensor new_tensor(DType dtype, std::initializer_list<int64_t> shape, Allocator& alloc) {
  return Tensor::empty(dtype, shape, Device::cpu(), alloc, Stream{});
}

// Contiguous int32 tensors of the given shapes carved from one allocation, each on a 256-byte
// boundary. A device build's host time is mostly per-allocation cost in the bindings (under torch
// a Python callback, a stream lookup and torch.empty each), so a build's outputs share one.
template <size_t N>
std::array<Tensor, N> int32_tensors(const std::array<std::vector<int64_t>, N>& shapes, Device device,
                                    Allocator& alloc, Stream stream) {
  constexpr int64_t kAlignWords = 256 / int64_t(sizeof(int32_t));
  std::array<int64_t, N> at{};
  int64_t words = 0;
  for (size_t i = 0; i < N; ++i) {
    at[i] = words;
    int64_t n = 1;
    for (int64_t d : shapes[i]) n *= d;
    words += (n + kAlignWords - 1) / kAlignWords * kAlignWords;
  }
  const Tensor all = Tensor::empty(DType::kInt32, {std::max<int64_t>(words, 1)}, device, alloc, stream);
  std::array<Tensor, N> out;
  for (size_t i = 0; i < N; ++i)
    out[i] = all.with_view(TensorView::contiguous(all.view().data_as<int32_t>() + at[i], DType::kInt32,
                                                  shapes[i].data(), int(shapes[i].size()), device));
  return out;
}

void check_options(const BlockMaskOptions& o, int64_t seq_q, int64_t seq_kv) {
  ST_CHECK_ARG(seq_q >= 1, "seq_q", ">= 1", seq_q);
  ST_CHECK_ARG(seq_kv >= 1, "seq_kv", ">= 1", seq_kv);
  ST_CHECK_ARG(o.block_q >= 1, "BlockMaskOptions block_q", ">= 1", o.block_q);
  ST_CHECK_ARG(o.block_kv >= 1, "BlockMaskOptions block_kv", ">= 1", o.block_kv);
}

// Empty forward lists [B, H, Mq(, Nk)] (full width), with the mask's geometry filled in.
BlockMaskTensors new_forward(int64_t B, int64_t H, int64_t seq_q, int64_t seq_kv, const BlockMaskOptions& o) {
  BlockMaskTensors t;
  BlockMask& m = t.mask;
  m.seq_q = seq_q;
  m.seq_kv = seq_kv;
  m.block_q = o.block_q;
  m.block_kv = o.block_kv;
  const int64_t Mq = m.num_q_blocks(), Nk = m.num_kv_blocks();
  Allocator& a = alloc_or_default(o.allocator);
  t.kv_num_blocks = new_tensor(DType::kInt32, {B, H, Mq}, a);
  t.kv_indices = new_tensor(DType::kInt32, {B, H, Mq, Nk}, a);
  t.full_kv_num_blocks = new_tensor(DType::kInt32, {B, H, Mq}, a);
  t.full_kv_indices = new_tensor(DType::kInt32, {B, H, Mq, Nk}, a);
  // Entries past the counts are padding: zero them so that nothing reads as garbage.
  std::fill_n(t.kv_indices.view().data_as<int32_t>(), B * H * Mq * Nk, 0);
  std::fill_n(t.full_kv_indices.view().data_as<int32_t>(), B * H * Mq * Nk, 0);
  m.kv_num_blocks = t.kv_num_blocks.view();
  m.kv_indices = t.kv_indices.view();
  m.full_kv_num_blocks = t.full_kv_num_blocks.view();
  m.full_kv_indices = t.full_kv_indices.view();
  return t;
}

// Transposes, then the write orders for the chosen (or given) schedule.
void finish(BlockMaskTensors& t, const BlockMaskOptions& o) {
  transpose_block_mask(t, o.allocator);
  const ColumnSchedule schedule = o.auto_schedule ? choose_schedule(t.mask, o.problem) : o.schedule;
  compute_dq_write_order(t, schedule, o.allocator);
}

int32_t* row_ptr(const Tensor& t, int64_t b, int64_t h, int64_t r) {
  const TensorView& v = t.view();
  return v.data_as<int32_t>() + (b * v.size(1) + h) * v.size(2) * (v.dim() > 3 ? v.size(3) : 1) +
         r * (v.dim() > 3 ? v.size(3) : 1);
}

void check_schedule(const ColumnSchedule& s, int64_t Nk);

// build_block_mask on a CUDA device (options.device): the same tensors, full width, built there
// by src/cuda/block_mask/block_mask_cuda.cu on options.stream.
BlockMaskTensors build_on_device(const MaskSpec& spec, int64_t B, int64_t seq_q, int64_t seq_kv,
                                 const BlockMaskOptions& o) {
#if SPARSETRAIN_WITH_CUDA
  BlockMaskTensors t;
  BlockMask& m = t.mask;
  m.seq_q = seq_q;
  m.seq_kv = seq_kv;
  m.block_q = o.block_q;
  m.block_kv = o.block_kv;
  m.spec = spec;
  const int64_t Mq = m.num_q_blocks(), Nk = m.num_kv_blocks();
  const ColumnSchedule schedule = o.auto_schedule ? choose_schedule(m, o.problem) : o.schedule;
  check_schedule(schedule, Nk);
  checks::device_runs(o.device, checks::Kernels::kGeneric, "BlockMaskOptions device");
  Allocator& a = alloc_or_default(o.allocator);
  const std::vector<int64_t> rows{B, 1, Mq}, lists{B, 1, Mq, Nk}, cols{B, 1, Nk}, transposed{B, 1, Nk, Mq};
  std::tie(t.kv_num_blocks, t.kv_indices, t.full_kv_num_blocks, t.full_kv_indices, t.q_num_blocks, t.q_indices,
           t.full_q_num_blocks, t.full_q_indices, t.dq_write_order, t.dq_write_order_full) =
      std::tuple_cat(int32_tensors<10>({rows, lists, rows, lists, cols, transposed, cols, transposed, transposed,
                                        transposed},
                                       o.device, a, o.stream));
  const bool doc = mask_has_documents(spec.kind);
  const int64_t doc_q_batch = doc ? spec.doc_q.size(0) : 1, doc_kv_batch = doc ? spec.doc_kv.size(0) : 1;
  // The permutation, the per-block records, the document-id spans (block_mask_internal.h): apart
  // from the outputs, so that the mask does not keep it.
  const Tensor scratch = Tensor::empty(
      DType::kInt32, {device_mask_build_scratch(B, Mq, Nk, doc_q_batch, doc_kv_batch, doc)}, o.device, a, o.stream);
  m.kv_num_blocks = t.kv_num_blocks.view();
  m.kv_indices = t.kv_indices.view();
  m.full_kv_num_blocks = t.full_kv_num_blocks.view();
  m.full_kv_indices = t.full_kv_indices.view();
  m.q_num_blocks = t.q_num_blocks.view();
  m.q_indices = t.q_indices.view();
  m.full_q_num_blocks = t.full_q_num_blocks.view();
  m.full_q_indices = t.full_q_indices.view();
  m.dq_write_order = t.dq_write_order.view();
  m.dq_write_order_full = t.dq_write_order_full.view();
  m.schedule = schedule;
  t.schedule_permutation = schedule.permutation;
  int32_t* scratch_begin = scratch.view().data_as<int32_t>();
  DeviceMaskBuild p{spec.kind,
                    spec.window_left,
                    spec.window_right,
                    spec.prefix_length,
                    doc ? spec.doc_q.data_as<const int32_t>() : nullptr,
                    doc ? spec.doc_kv.data_as<const int32_t>() : nullptr,
                    doc_q_batch,
                    doc ? spec.doc_q.stride(0) : 0,
                    doc_kv_batch,
                    doc ? spec.doc_kv.stride(0) : 0,
                    B,
                    seq_q,
                    seq_kv,
                    o.block_q,
                    o.block_kv,
                    schedule.kind,
                    schedule.kind == ScheduleKind::kPermutation ? schedule.permutation.data() : nullptr,
                    scratch_begin,
                    scratch_begin + Nk,
                    doc ? reinterpret_cast<DocIdSpan*>(scratch_begin + Nk + B * Mq * Nk) : nullptr};
  build_block_mask_cuda(p, t, o.stream);
  return t;
#else
  (void)spec, (void)B, (void)seq_q, (void)seq_kv;
  detail::throw_arg_error("BlockMaskOptions device", "cpu (this build has no CUDA backend)", o.device.str());
#endif
}

// A document spec's ids: int32 [B or 1, S] on `device` with a unit last stride, the two batches
// broadcastable; returns the batch.
int64_t checked_doc_batch(const MaskSpec& spec, int64_t seq_q, int64_t seq_kv, Device device) {
  for (const auto& [t, name, len] : {std::make_tuple(&spec.doc_q, "spec.doc_q", seq_q),
                                     std::make_tuple(&spec.doc_kv, "spec.doc_kv", seq_kv)}) {
    checks::defined(*t, name, "int32 document ids [B or 1, S]");
    checks::dtype(*t, name, DType::kInt32);
    checks::device(*t, name, device);
    checks::shape(*t, name, {-1, len}, "[B or 1, " + std::to_string(len) + "]");
    checks::non_null(*t, name);
    checks::unit_last_stride(*t, name);
  }
  const int64_t bq = spec.doc_q.size(0), bk = spec.doc_kv.size(0);
  ST_CHECK_ARG(bq == bk || bq == 1 || bk == 1, "spec.doc_kv", "a batch broadcastable with doc_q's " + std::to_string(bq),
               bk);
  return std::max(bq, bk);
}

// The padded mask over its layout (ids and real_rows [B, padded], which it keeps): spec's kind
// over the padded ids at the padded length, built where options say.
BlockMaskTensors padded_mask_over(const MaskSpec& spec, Tensor doc_q, Tensor doc_kv, Tensor real_rows,
                                  const BlockMaskOptions& options) {
  const int64_t padded = doc_q.view().size(1);
  MaskSpec padded_spec = spec;
  padded_spec.doc_q = doc_q.view();
  padded_spec.doc_kv = doc_kv.view();
  BlockMaskTensors t = build_block_mask(padded_spec, padded, padded, options);
  t.doc_q = std::move(doc_q);
  t.doc_kv = std::move(doc_kv);
  t.real_rows = std::move(real_rows);
  t.mask.real_rows = t.real_rows.view();
  return t;
}

// build_doc_padded_mask on a CUDA device: the layout at the length bound (known on the host, so
// nothing waits for the device), built by doc_padded_layout_cuda, then the padded mask's lists
// by build_on_device; all on options.stream. The ids are not read on the host.
BlockMaskTensors build_doc_padded_on_device(const MaskSpec& spec, int64_t B, int64_t seq, int64_t min_length,
                                            const BlockMaskOptions& o) {
#if SPARSETRAIN_WITH_CUDA
  const TensorView &q = spec.doc_q, &kv = spec.doc_kv;
  checks::device_runs(o.device, checks::Kernels::kGeneric, "BlockMaskOptions device");
  const int64_t padded = doc_padded_length_bound(seq, min_length);
  Allocator& a = alloc_or_default(o.allocator);
  auto [doc_q, doc_kv, real_rows] = int32_tensors<3>({{{B, padded}, {B, padded}, {B, padded}}}, o.device, a, o.stream);
  const Tensor scratch = Tensor::empty(DType::kInt64, {doc_pad_layout_scratch_words(B, seq)}, o.device, a, o.stream);
  DocPadLayoutArgs args{};
  args.ids_q = q.data_as<const int32_t>(), args.ids_kv = kv.data_as<const int32_t>();
  args.ids_q_stride_b = q.broadcast_stride(0), args.ids_kv_stride_b = kv.broadcast_stride(0);
  args.batch = B, args.seq = seq, args.min_length = min_length, args.padded = padded;
  args.doc_q = doc_q.view().data_as<int32_t>(), args.doc_kv = doc_kv.view().data_as<int32_t>();
  args.real_rows = real_rows.view().data_as<int32_t>();
  doc_pad_layout_scratch(scratch.view().data_as<int64_t>(), &args);
  doc_padded_layout_cuda(args, o.device.index, o.stream);
  return padded_mask_over(spec, std::move(doc_q), std::move(doc_kv), std::move(real_rows), o);
#else
  (void)spec, (void)B, (void)seq, (void)min_length;
  detail::throw_arg_error("BlockMaskOptions device", "cpu (this build has no CUDA backend)", o.device.str());
#endif
}

}  // namespace

BlockMaskTensors build_block_mask(const MaskSpec& spec, int64_t seq_q, int64_t seq_kv,
                                  const BlockMaskOptions& options) {
  check_options(options, seq_q, seq_kv);
  ST_CHECK_ARG(spec.kind != MaskKind::kBitmask, "spec.kind", "a built-in mask kind (build_block_mask_from_function "
               "makes bitmasks)", spec.str());
  const bool doc = mask_has_documents(spec.kind);
  const int64_t B = doc ? checked_doc_batch(spec, seq_q, seq_kv, options.device) : 1;
  if (options.device.is_cuda()) return build_on_device(spec, B, seq_q, seq_kv, options);
  ST_CHECK_ARG(options.device.is_cpu(), "BlockMaskOptions device", "cpu or cuda", options.device.str());
  BlockMaskTensors t = new_forward(B, 1, seq_q, seq_kv, options);
  t.mask.spec = spec;
  const int64_t Mq = t.mask.num_q_blocks(), Nk = t.mask.num_kv_blocks();
  // Document kinds: every block's id span once (as the device build's spans_kernel), not once per
  // block pair.
  std::vector<DocIdSpan> q_spans(doc ? size_t(Mq) : 0), kv_spans(doc ? size_t(Nk) : 0);
  auto spans = [](const int32_t* ids, int64_t seq, int64_t block, std::vector<DocIdSpan>& out) {
    for (size_t i = 0; i < out.size(); ++i)
      out[i] = doc_id_span(ids, int64_t(i) * block, std::min(seq, int64_t(i + 1) * block));
  };
  for (int64_t b = 0; b < B; ++b) {
    MaskRowParams p{spec.kind, spec.window_left, spec.window_right, spec.prefix_length, seq_q, seq_kv, nullptr, nullptr};
    if (doc) {
      p.doc_q = reinterpret_cast<const int32_t*>(spec.doc_q.byte_ptr(b * spec.doc_q.broadcast_stride(0)));
      p.doc_kv = reinterpret_cast<const int32_t*>(spec.doc_kv.byte_ptr(b * spec.doc_kv.broadcast_stride(0)));
      spans(p.doc_q, seq_q, options.block_q, q_spans);
      spans(p.doc_kv, seq_kv, options.block_kv, kv_spans);
    }
    for (int64_t m = 0; m < Mq; ++m)
      build_block_row(p, options.block_q, options.block_kv, m, Nk, row_ptr(t.kv_indices, b, 0, m),
                      row_ptr(t.kv_num_blocks, b, 0, m), row_ptr(t.full_kv_indices, b, 0, m),
                      row_ptr(t.full_kv_num_blocks, b, 0, m), doc ? &q_spans[size_t(m)] : nullptr,
                      doc ? kv_spans.data() : nullptr);
  }
  finish(t, options);
  return t;
}

BlockMaskTensors build_doc_padded_mask(const MaskSpec& spec, int64_t seq, int64_t min_length,
                                       const BlockMaskOptions& options) {
  ST_CHECK_ARG(mask_has_documents(spec.kind), "spec.kind",
               "document or document_causal", spec.str());
  ST_CHECK_ARG(seq >= 1, "seq", ">= 1", seq);
  ST_CHECK_ARG(min_length >= kDocPadAlign, "min_length", ">= " + std::to_string(kDocPadAlign), min_length);
  const int64_t B = checked_doc_batch(spec, seq, seq, options.device);
  if (options.device.is_cuda()) return build_doc_padded_on_device(spec, B, seq, min_length, options);
  ST_CHECK_ARG(options.device.is_cpu(), "BlockMaskOptions device", "cpu or cuda", options.device.str());
  auto ids_of = [&](const TensorView& t, int64_t b) {
    return reinterpret_cast<const int32_t*>(t.byte_ptr(b * t.broadcast_stride(0)));
  };
  // One layout, from the query side's documents, serves both sides (any key ids keep their meaning
  // under it: doc_padded_ids).
  std::vector<std::vector<int64_t>> pos(static_cast<size_t>(B));
  int64_t padded = kDocPadAlign;
  for (int64_t b = 0; b < B; ++b) {
    const int32_t *q = ids_of(spec.doc_q, b), *kv = ids_of(spec.doc_kv, b);
    for (int64_t s = 0; s < seq; ++s)
      ST_CHECK_ARG(q[s] < INT32_MAX - 1 && kv[s] < INT32_MAX - 1, "spec.doc_q / spec.doc_kv",
                   "ids below 2^31 - 2 (padding takes the next two)", "batch ", b, " position ", s, ": doc_q ", q[s],
                   ", doc_kv ", kv[s]);
    int64_t length = 0;
    pos[size_t(b)] = doc_padded_positions(q, seq, min_length, &length);
    padded = std::max(padded, length);
  }
  Allocator& a = alloc_or_default(options.allocator);
  Tensor doc_q = new_tensor(DType::kInt32, {B, padded}, a), doc_kv = new_tensor(DType::kInt32, {B, padded}, a);
  Tensor real_rows = new_tensor(DType::kInt32, {B, padded}, a);
  for (int64_t b = 0; b < B; ++b) {
    std::vector<int32_t> q_ids, kv_ids;
    doc_padded_ids(ids_of(spec.doc_q, b), ids_of(spec.doc_kv, b), seq, pos[size_t(b)], padded, &q_ids, &kv_ids);
    std::copy(q_ids.begin(), q_ids.end(), doc_q.view().data_as<int32_t>() + b * padded);
    std::copy(kv_ids.begin(), kv_ids.end(), doc_kv.view().data_as<int32_t>() + b * padded);
    int32_t* rows = real_rows.view().data_as<int32_t>() + b * padded;
    std::fill_n(rows, padded, -1);
    for (int64_t s = 0; s < seq; ++s) rows[pos[size_t(b)][size_t(s)]] = int32_t(s);
  }
  return padded_mask_over(spec, std::move(doc_q), std::move(doc_kv), std::move(real_rows), options);
}

BlockMaskTensors build_block_mask_from_blocks(const TensorView& blocks, int64_t seq_q, int64_t seq_kv,
                                              const BlockMaskOptions& options) {
  check_options(options, seq_q, seq_kv);
  const int64_t Mq = (seq_q + options.block_q - 1) / options.block_q;
  const int64_t Nk = (seq_kv + options.block_kv - 1) / options.block_kv;
  checks::defined(blocks, "blocks", "a uint8 block matrix [B, H, Mq, Nk]");
  checks::dtype(blocks, "blocks", DType::kUInt8);
  checks::device(blocks, "blocks", Device::cpu());
  checks::shape(blocks, "blocks", {-1, -1, Mq, Nk},
                "[B, H, Mq=" + std::to_string(Mq) + ", Nk=" + std::to_string(Nk) + "]");
  checks::non_null(blocks, "blocks");
  const int64_t B = blocks.size(0), H = blocks.size(1);
  ST_CHECK_ARG(B >= 1 && H >= 1, "blocks", "leading dims >= 1", blocks.shape_str());
  auto at = [&](int64_t b, int64_t h, int64_t m, int64_t n) {
    return *reinterpret_cast<const uint8_t*>(
        blocks.byte_ptr(b * blocks.stride(0) + h * blocks.stride(1) + m * blocks.stride(2) + n * blocks.stride(3)));
  };
  for (int64_t b = 0; b < B; ++b)  // validate everything before allocating
    for (int64_t h = 0; h < H; ++h)
      for (int64_t m = 0; m < Mq; ++m)
        for (int64_t n = 0; n < Nk; ++n) {
          const uint8_t v = at(b, h, m, n);
          if (v > 2) {
            std::ostringstream where;
            where << "blocks[" << b << ", " << h << ", " << m << ", " << n << "]";
            ST_CHECK_ARG(false, where.str().c_str(), "0 (skipped), 1 (partial) or 2 (full)", int(v));
          }
        }
  BlockMaskTensors t = new_forward(B, H, seq_q, seq_kv, options);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t m = 0; m < Mq; ++m) {
        int32_t *pi = row_ptr(t.kv_indices, b, h, m), *fi = row_ptr(t.full_kv_indices, b, h, m);
        int32_t np = 0, nf = 0;
        for (int64_t n = 0; n < Nk; ++n) {
          const uint8_t v = at(b, h, m, n);
          if (v == kBlockPartial) pi[np++] = int32_t(n);
          else if (v == kBlockFull) fi[nf++] = int32_t(n);
        }
        *row_ptr(t.kv_num_blocks, b, h, m) = np;
        *row_ptr(t.full_kv_num_blocks, b, h, m) = nf;
      }
  finish(t, options);
  return t;
}

namespace {
// Entry (b, h, m, k) of a flex list tensor (int32 or int64), its leading dims broadcast.
int64_t flex_entry(const TensorView& t, int64_t b, int64_t h, int64_t m, int64_t k = 0) {
  const int64_t off = (t.size(0) == 1 ? 0 : b * t.stride(0)) + (t.size(1) == 1 ? 0 : h * t.stride(1)) +
                      m * t.stride(2) + (t.dim() > 3 ? k * t.stride(3) : 0);
  const char* p = t.byte_ptr(off);
  return t.dtype() == DType::kInt32 ? int64_t(*reinterpret_cast<const int32_t*>(p))
                                    : *reinterpret_cast<const int64_t*>(p);
}

std::string flex_row(const char* name, int64_t b, int64_t h, int64_t m) {
  std::ostringstream os;
  os << name << "[b=" << b << ", h=" << h << ", q block " << m << "]";
  return os.str();
}

void check_flex_list(const TensorView& t, const char* name, int dim, int64_t batch, int64_t heads,
                     const TensorView& rows_like) {
  checks::device(t, name, Device::cpu());
  ST_CHECK_ARG(t.dtype() == DType::kInt32 || t.dtype() == DType::kInt64, name, "int32 or int64",
               dtype_name(t.dtype()));
  ST_CHECK_ARG(t.dim() == dim, name, std::to_string(dim) + " dimensions", t.dim(), " (shape ", t.shape_str(), ")");
  ST_CHECK_ARG((t.size(0) == 1 || t.size(0) == batch) && (t.size(1) == 1 || t.size(1) == heads), name,
               "leading dims broadcastable to [B=" + std::to_string(batch) + ", H=" + std::to_string(heads) + "]",
               t.shape_str());
  ST_CHECK_ARG(t.size(2) == rows_like.size(2), name, "as many rows of q blocks as kv_num_blocks (" +
               std::to_string(rows_like.size(2)) + ")", t.size(2));
  checks::non_null(t, name);
}
}  // namespace

Tensor block_matrix_from_flex(const FlexBlockLists& l, int64_t batch, int64_t heads, int64_t num_kv_blocks,
                              Allocator* allocator) {
  ST_CHECK_ARG(batch >= 1 && heads >= 1, "batch / heads", "sizes >= 1", batch, ", ", heads);
  ST_CHECK_ARG(num_kv_blocks >= 1, "num_kv_blocks", ">= 1", num_kv_blocks);
  checks::defined(l.kv_num_blocks, "kv_num_blocks", "int32 [B, H, Mq]");
  checks::defined(l.kv_indices, "kv_indices", "int32 [B, H, Mq, W]");
  const bool full = l.full_kv_num_blocks.defined() || l.full_kv_indices.defined();
  if (full) {
    checks::defined(l.full_kv_num_blocks, "full_kv_num_blocks", "int32 [B, H, Mq] (with full_kv_indices)");
    checks::defined(l.full_kv_indices, "full_kv_indices", "int32 [B, H, Mq, W] (with full_kv_num_blocks)");
  }
  const TensorView& rows = l.kv_num_blocks;
  check_flex_list(l.kv_num_blocks, "kv_num_blocks", 3, batch, heads, rows);
  check_flex_list(l.kv_indices, "kv_indices", 4, batch, heads, rows);
  if (full) {
    check_flex_list(l.full_kv_num_blocks, "full_kv_num_blocks", 3, batch, heads, rows);
    check_flex_list(l.full_kv_indices, "full_kv_indices", 4, batch, heads, rows);
  }
  const int64_t Mq = rows.size(2), Nk = num_kv_blocks;
  // Validated and filled in one pass into a scratch matrix: the result is allocated only after.
  std::vector<uint8_t> dense(size_t(batch * heads * Mq * Nk), 0);
  const struct {
    const TensorView *counts, *ids;
    const char *cname, *iname;
    uint8_t cls;
  } lists[2] = {{&l.kv_num_blocks, &l.kv_indices, "kv_num_blocks", "kv_indices", uint8_t(kBlockPartial)},
                {&l.full_kv_num_blocks, &l.full_kv_indices, "full_kv_num_blocks", "full_kv_indices",
                 uint8_t(kBlockFull)}};
  for (const auto& list : lists) {
    if (!list.counts->defined()) continue;
    const int64_t width = list.ids->size(3);
    for (int64_t b = 0; b < batch; ++b)
      for (int64_t h = 0; h < heads; ++h)
        for (int64_t m = 0; m < Mq; ++m) {
          uint8_t* row = dense.data() + ((b * heads + h) * Mq + m) * Nk;
          const int64_t c = flex_entry(*list.counts, b, h, m);
          ST_CHECK_ARG(c >= 0 && c <= width, flex_row(list.cname, b, h, m).c_str(),
                       "a count in [0, " + std::to_string(width) + "] (the width of " + list.iname + ")", c);
          for (int64_t k = 0; k < c; ++k) {
            const int64_t n = flex_entry(*list.ids, b, h, m, k);
            const auto where = [&] { return flex_row(list.iname, b, h, m) + " entry " + std::to_string(k); };
            ST_CHECK_ARG(n >= 0 && n < Nk, where().c_str(), "a kv block in [0, " + std::to_string(Nk) + ")", n);
            ST_CHECK_ARG(row[n] == 0, where().c_str(),
                         row[n] == list.cls ? "no duplicate kv blocks in a row"
                                            : "kv blocks that are not also partial (in kv_indices)",
                         "kv block ", n, row[n] == list.cls ? " twice" : " in both");
            row[n] = list.cls;
          }
        }
  }
  Tensor out = new_tensor(DType::kUInt8, {batch, heads, Mq, Nk}, alloc_or_default(allocator));
  std::copy(dense.begin(), dense.end(), out.view().data_as<uint8_t>());
  return out;
}

Tensor partial_block_places(const TensorView& blocks, int64_t block_q, int64_t block_kv, int64_t* width,
                            Allocator* allocator) {
  checks::defined(blocks, "blocks", "a uint8 block matrix [B, H, Mq, Nk]");
  checks::dtype(blocks, "blocks", DType::kUInt8);
  checks::device(blocks, "blocks", Device::cpu());
  ST_CHECK_ARG(blocks.dim() == 4, "blocks", "4 dimensions [B, H, Mq, Nk]", blocks.shape_str());
  ST_CHECK_ARG(block_q >= 1 && block_kv >= 1, "block_q / block_kv", ">= 1", block_q, ", ", block_kv);
  const int64_t B = blocks.size(0), H = blocks.size(1), Mq = blocks.size(2), Nk = blocks.size(3);
  const int64_t rows = B * H * Mq, sn = blocks.stride(3);
  const auto row = [&](int64_t r) {  // r = (b * H + h) * Mq + m
    return reinterpret_cast<const uint8_t*>(
        blocks.byte_ptr(r / (H * Mq) * blocks.stride(0) + r / Mq % H * blocks.stride(1) + r % Mq * blocks.stride(2)));
  };
  int64_t total = 0, w = 1;
  for (int64_t r = 0; r < rows; ++r) {
    const uint8_t* v = row(r);
    int64_t c = 0;
    for (int64_t n = 0; n < Nk; ++n) c += v[n * sn] == kBlockPartial;
    total += c;
    w = std::max(w, c);
  }
  Tensor out = new_tensor(DType::kInt64, {5, total}, alloc_or_default(allocator));
  int64_t* p = out.view().data_as<int64_t>();
  for (int64_t r = 0, i = 0; r < rows; ++r) {
    const uint8_t* v = row(r);
    for (int64_t n = 0, k = 0; n < Nk; ++n)
      if (v[n * sn] == kBlockPartial) {
        p[i] = r * w + k++;
        p[total + i] = r / (H * Mq);
        p[2 * total + i] = r / Mq % H;
        p[3 * total + i] = r % Mq * block_q;
        p[4 * total + i] = n * block_kv;
        ++i;
      }
  }
  *width = w;
  return out;
}

BlockMaskTensors build_block_mask_from_function(MaskFunction allowed, void* context, int64_t batch, int64_t heads,
                                                int64_t seq_q, int64_t seq_kv, const BlockMaskOptions& options) {
  check_options(options, seq_q, seq_kv);
  ST_CHECK_ARG(allowed != nullptr, "allowed", "a mask function", "null");
  ST_CHECK_ARG(batch >= 1, "batch", ">= 1", batch);
  ST_CHECK_ARG(heads >= 1, "heads", ">= 1", heads);
  const int64_t bq = options.block_q, bk = options.block_kv;
  const int64_t bytes_per_block = (bq * bk + 7) / 8;
  BlockMaskTensors t = new_forward(batch, heads, seq_q, seq_kv, options);
  t.mask.spec = MaskSpec{};
  t.mask.spec.kind = MaskKind::kBitmask;
  const int64_t Mq = t.mask.num_q_blocks(), Nk = t.mask.num_kv_blocks();
  // Bitmasks of the partial blocks, row by row, until the widest row is known.
  std::vector<uint8_t> bits;
  std::vector<int64_t> row_bits(static_cast<size_t>(batch * heads * Mq));
  std::vector<uint8_t> block(static_cast<size_t>(bytes_per_block));
  int32_t width = 1;
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t h = 0; h < heads; ++h)
      for (int64_t m = 0; m < Mq; ++m) {
        row_bits[size_t((b * heads + h) * Mq + m)] = int64_t(bits.size());
        int32_t *pi = row_ptr(t.kv_indices, b, h, m), *fi = row_ptr(t.full_kv_indices, b, h, m);
        int32_t np = 0, nf = 0;
        const int64_t q0 = m * bq, q1 = std::min(q0 + bq, seq_q);
        for (int64_t n = 0; n < Nk; ++n) {
          const int64_t kv0 = n * bk, kv1 = std::min(kv0 + bk, seq_kv);
          std::fill(block.begin(), block.end(), uint8_t(0));
          int64_t count = 0;
          for (int64_t q = q0; q < q1; ++q)
            for (int64_t kv = kv0; kv < kv1; ++kv)
              if (allowed(context, b, h, q, kv)) {
                const int64_t bit = (q - q0) * bk + (kv - kv0);
                block[size_t(bit / 8)] = uint8_t(block[size_t(bit / 8)] | (1u << (bit % 8)));
                ++count;
              }
          if (count == 0) continue;
          if (count == (q1 - q0) * (kv1 - kv0)) {
            fi[nf++] = int32_t(n);
          } else {
            pi[np++] = int32_t(n);
            bits.insert(bits.end(), block.begin(), block.end());
          }
        }
        *row_ptr(t.kv_num_blocks, b, h, m) = np;
        *row_ptr(t.full_kv_num_blocks, b, h, m) = nf;
        width = std::max(width, np);
      }
  Allocator& a = alloc_or_default(options.allocator);
  t.partial_bitmasks = new_tensor(DType::kUInt8, {batch, heads, Mq, width, bytes_per_block}, a);
  uint8_t* dst = t.partial_bitmasks.view().data_as<uint8_t>();
  std::fill_n(dst, batch * heads * Mq * width * bytes_per_block, uint8_t(0));
  for (int64_t r = 0; r < batch * heads * Mq; ++r) {
    const int64_t np = t.kv_num_blocks.view().data_as<int32_t>()[r];
    std::copy_n(bits.begin() + row_bits[size_t(r)], np * bytes_per_block, dst + r * width * bytes_per_block);
  }
  t.mask.partial_bitmasks = t.partial_bitmasks.view();
  finish(t, options);
  return t;
}

// ---- transposes and write orders -----------------------------------------------------------

void transpose_block_mask(BlockMaskTensors& out, Allocator* allocator) {
  BlockMask& m = out.mask;
  ST_CHECK_ARG(m.kv_num_blocks.defined() && m.kv_indices.defined(), "BlockMask kv_indices",
               "the forward lists (kv_num_blocks, kv_indices)", "none");
  ST_CHECK_ARG(m.kv_num_blocks.device().is_cpu() && m.kv_indices.device().is_cpu(), "BlockMask kv_indices",
               "host tensors (transpose_block_mask runs on the host)", m.kv_indices.device().str());
  const bool has_full = m.full_kv_num_blocks.defined() && m.full_kv_indices.defined();
  int64_t B = 1, H = 1;
  for (const TensorView* v : {&m.kv_num_blocks, &m.kv_indices, &m.full_kv_num_blocks, &m.full_kv_indices}) {
    if (!v->defined() || v->dim() < 2) continue;
    B = std::max(B, v->size(0));
    H = std::max(H, v->size(1));
  }
  const int64_t Mq = m.num_q_blocks(), Nk = m.num_kv_blocks();
  Allocator& a = alloc_or_default(allocator);
  out.q_num_blocks = new_tensor(DType::kInt32, {B, H, Nk}, a);
  out.q_indices = new_tensor(DType::kInt32, {B, H, Nk, Mq}, a);
  std::fill_n(out.q_indices.view().data_as<int32_t>(), B * H * Nk * Mq, 0);
  if (has_full) {
    out.full_q_num_blocks = new_tensor(DType::kInt32, {B, H, Nk}, a);
    out.full_q_indices = new_tensor(DType::kInt32, {B, H, Nk, Mq}, a);
    std::fill_n(out.full_q_indices.view().data_as<int32_t>(), B * H * Nk * Mq, 0);
  } else {
    out.full_q_num_blocks = Tensor();
    out.full_q_indices = Tensor();
  }
  // Column n of the transpose: the rows whose list holds n, ascending. One pass over the rows
  // appends each row to the columns its list holds: O(entries), where searching every row for
  // every column (O(Mq Nk log W)) was most of a host build from blocks. Ids outside [0, Nk) are
  // skipped and a repeated id counts once.
  auto transpose = [&](const IndexRows& rows, const Tensor& counts, const Tensor& indices, int64_t b, int64_t h) {
    int32_t* count = row_ptr(counts, b, h, 0);
    std::fill_n(count, Nk, 0);
    for (int64_t r = 0; r < Mq; ++r)
      for (int32_t i = 0, n_i = std::min(rows.count(r), rows.indices.width); i < n_i; ++i) {
        const int32_t n = rows.at(r, i);
        if (n < 0 || n >= Nk) continue;
        int32_t* column = row_ptr(indices, b, h, n);
        if (count[n] == 0 || column[count[n] - 1] != int32_t(r)) column[count[n]++] = int32_t(r);
      }
  };
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h) {
      transpose(mask_rows(m.kv_num_blocks, m.kv_indices, b, h), out.q_num_blocks, out.q_indices, b, h);
      if (has_full)
        transpose(mask_rows(m.full_kv_num_blocks, m.full_kv_indices, b, h), out.full_q_num_blocks,
                  out.full_q_indices, b, h);
    }
  m.q_num_blocks = out.q_num_blocks.view();
  m.q_indices = out.q_indices.view();
  m.full_q_num_blocks = out.full_q_num_blocks.view();
  m.full_q_indices = out.full_q_indices.view();
  // Write orders of the old lists no longer apply.
  out.dq_write_order = Tensor();
  out.dq_write_order_full = Tensor();
  m.dq_write_order = TensorView();
  m.dq_write_order_full = TensorView();
}

namespace {
void check_schedule(const ColumnSchedule& s, int64_t Nk) {
  if (s.kind != ScheduleKind::kPermutation) return;
  std::vector<char> seen(size_t(Nk), 0);
  bool ok = int64_t(s.permutation.size()) == Nk;
  for (size_t i = 0; ok && i < s.permutation.size(); ++i) {
    const int32_t c = s.permutation[i];
    ok = c >= 0 && c < Nk && !seen[size_t(c)];
    if (ok) seen[size_t(c)] = 1;
  }
  ST_CHECK_ARG(ok, "schedule.permutation", "a permutation of the " + std::to_string(Nk) + " kv block columns",
               s.str());
}
}  // namespace

void compute_dq_write_order(BlockMaskTensors& out, const ColumnSchedule& schedule, Allocator* allocator) {
  BlockMask& m = out.mask;
  ST_CHECK_ARG(m.q_num_blocks.defined() && m.q_indices.defined(), "BlockMask q_indices",
               "the transposes (transpose_block_mask)", "none");
  ST_CHECK_ARG(m.kv_num_blocks.defined() && m.kv_indices.defined(), "BlockMask kv_indices",
               "the forward lists (kv_num_blocks, kv_indices)", "none");
  const int64_t Mq = m.num_q_blocks(), Nk = m.num_kv_blocks();
  check_schedule(schedule, Nk);
  const bool has_full = m.full_q_num_blocks.defined() && m.full_q_indices.defined();
  Allocator& a = alloc_or_default(allocator);
  // Parallel to q_indices / full_q_indices: same shape, compact widths included.
  auto parallel = [&](const TensorView& like) {
    Tensor t = new_tensor(DType::kInt32, {like.size(0), like.size(1), like.size(2), like.size(3)}, a);
    std::fill_n(t.view().data_as<int32_t>(), t.view().numel(), 0);
    return t;
  };
  out.dq_write_order = parallel(m.q_indices);
  out.dq_write_order_full = has_full ? parallel(m.full_q_indices) : Tensor();
  out.schedule_permutation = schedule.permutation;
  m.schedule = schedule;
  m.dq_write_order = out.dq_write_order.view();
  m.dq_write_order_full = out.dq_write_order_full.view();
  std::vector<int32_t> inverse(size_t(Nk), 0), scratch(size_t(Nk), 0);
  if (schedule.kind == ScheduleKind::kPermutation)
    for (int64_t p = 0; p < Nk; ++p) inverse[size_t(schedule.permutation[size_t(p)])] = int32_t(p);
  int64_t B = 1, H = 1;
  mask_leading_dims(m, &B, &H);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h) {
      const IndexRows kv = mask_rows(m.kv_num_blocks, m.kv_indices, b, h);
      const IndexRows fkv = mask_rows(m.full_kv_num_blocks, m.full_kv_indices, b, h);
      const IndexRows q = mask_rows(m.q_num_blocks, m.q_indices, b, h);
      const IndexRows fq = mask_rows(m.full_q_num_blocks, m.full_q_indices, b, h);
      const MaskIndexOut wo = mask_write_order(m.dq_write_order, b, h);
      const MaskIndexOut fwo = mask_write_order(m.dq_write_order_full, b, h);
      for (int64_t row = 0; row < Mq; ++row)
        write_order_row(kv, fkv, row, q, fq, wo, fwo, schedule.kind, inverse.data(), Nk, scratch.data());
    }
}

namespace {
void check_problem(const ScheduleProblem& problem) {
  ST_CHECK_ARG(problem.batch >= 0 && problem.heads_q >= 0 && problem.heads_kv >= 0 && problem.workers >= 0,
               "ScheduleProblem", "sizes >= 0 (0: from the mask / the default)", "batch ", problem.batch,
               ", heads_q ", problem.heads_q, ", heads_kv ", problem.heads_kv, ", workers ", problem.workers);
}

// The problem's zeros filled in: the mask's leading dims, heads_kv = heads_q, and one persistent
// CTA per SM of an H100 SXM or an H200 (132).
ScheduleProblem resolved_problem(const BlockMask& mask, const ScheduleProblem& problem) {
  int64_t B = 1, H = 1;
  mask_leading_dims(mask, &B, &H);
  ScheduleProblem p;
  p.batch = problem.batch > 0 ? problem.batch : B;
  p.heads_q = problem.heads_q > 0 ? problem.heads_q : H;
  p.heads_kv = problem.heads_kv > 0 ? problem.heads_kv : p.heads_q;
  p.workers = problem.workers > 0 ? problem.workers : 132;
  return p;
}

// Whether the columns nest for the descending walk under the left-to-right hand-out: no column
// shares a q block with an earlier column that reaches further down (its last q block, the
// first its walk visits, is lower). Then every column's turns come as soon as it reaches them,
// one hand-off behind the earlier column; an earlier, longer column instead reaches the later
// columns' blocks only at the end of its walk, and they wait (attention sinks, global or strided
// tokens). Host lists; out-of-range ids are skipped, counts clamped.
bool columns_nest(const BlockMask& mask) {
  int64_t B = 1, H = 1;
  mask_leading_dims(mask, &B, &H);
  const int64_t Mq = mask.num_q_blocks(), Nk = mask.num_kv_blocks();
  const MaskIndexView qn = mask_index_view(mask.q_num_blocks), qi = mask_index_view(mask.q_indices);
  const MaskIndexView fqn = mask_index_view(mask.full_q_num_blocks), fqi = mask_index_view(mask.full_q_indices);
  const MaskIndexView kn = mask_index_view(mask.kv_num_blocks), ki = mask_index_view(mask.kv_indices);
  const MaskIndexView fkn = mask_index_view(mask.full_kv_num_blocks), fki = mask_index_view(mask.full_kv_indices);
  std::vector<int32_t> last(static_cast<size_t>(Nk)), row;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h) {
      for (int64_t n = 0; n < Nk; ++n) {  // the transposes are sorted ascending: the last entry
        const int32_t cp = clamp_count(qn, qi, b, h, n), cf = clamp_count(fqn, fqi, b, h, n);
        last[size_t(n)] = std::max(cp > 0 ? qi.at(b, h, n, cp - 1) : -1, cf > 0 ? fqi.at(b, h, n, cf - 1) : -1);
      }
      for (int64_t m = 0; m < Mq; ++m) {  // row m's columns, left to right
        row.clear();
        for (int32_t i = 0, c = clamp_count(kn, ki, b, h, m); i < c; ++i) row.push_back(ki.at(b, h, m, i));
        for (int32_t i = 0, c = clamp_count(fkn, fki, b, h, m); i < c; ++i) row.push_back(fki.at(b, h, m, i));
        std::sort(row.begin(), row.end());
        int32_t reach = -1;  // the furthest-down q block (largest id) an earlier column reaches
        for (const int32_t n : row) {
          if (n < 0 || n >= Nk) continue;
          if (reach > last[size_t(n)]) return false;
          reach = std::max(reach, last[size_t(n)]);
        }
      }
    }
  return true;
}

// The model's size for `problem`: visits of every (batch, query head) walk, kernel sub-columns
// included. It simulates ~1.3 * 10^7 visits a second on this project's CPU.
int64_t modelled_visits(const BlockMask& mask, const ScheduleProblem& p) {
  int64_t B = 1, H = 1;
  mask_leading_dims(mask, &B, &H);
  int64_t blocks = 0;
  for (const auto& [counts, index] : {std::make_pair(&mask.q_num_blocks, &mask.q_indices),
                                      std::make_pair(&mask.full_q_num_blocks, &mask.full_q_indices)}) {
    const MaskIndexView c = mask_index_view(*counts), i = mask_index_view(*index);
    for (int64_t b = 0; b < B; ++b)
      for (int64_t h = 0; h < H; ++h)
        for (int64_t n = 0; n < mask.num_kv_blocks(); ++n) blocks += clamp_count(c, i, b, h, n);
  }
  return blocks * (p.batch * p.heads_q) / (B * H) * dq_sub_tiles(mask.block_kv);
}

// Beyond this many modelled visits a walk "auto" keeps the descending walk rather than spend
// over ~0.3 s of host time on two simulations (a sinks + window mask at B2 H32 S8192 models
// ~4 * 10^4; a causal one of 256 x 256 blocks at B8 H64 ~1.7 * 10^7, 2.5 s).
constexpr int64_t kModelMaxVisits = int64_t(1) << 21;

// "auto" runs the model for masks given block by block (from blocks, a function or a flex
// BlockMask: spec kFull or kBitmask) with their lists on the host whose columns do not nest, at
// a bounded size. Built-in band and document masks nest, and the kernel hands them out in L2
// sections under the descending walk only, which the model does not see.
bool walk_needs_the_model(const BlockMask& mask, const ScheduleProblem& p) {
  if (mask.spec.kind != MaskKind::kBitmask && mask.spec.kind != MaskKind::kFull) return false;
  for (const TensorView* t : {&mask.kv_num_blocks, &mask.q_num_blocks})
    if (!t->defined() || !t->device().is_cpu()) return false;
  return !columns_nest(mask) && modelled_visits(mask, p) <= kModelMaxVisits;
}

// The ascending walk's (heads innermost: with one query head a kv head, the same visits as
// kAscendingHeadsOuter; with GQA groups the model puts it at or ahead of the heads-outer one)
// modelled deterministic critical path must be at most this fraction of the descending walk's.
// The model has no per-item, hand-off or L2 cost, and those favour the descending walk (it won by
// 1-23 % where the model ranked the walks within 3 %); where the model put the ascending walk 19 %
// ahead (attention sinks + a 1024 window, B2 H16 S8192) it ran 30 % faster.
constexpr double kAscendingWalkGain = 0.9;

// The model's critical path of `schedule` on the resolved problem, deterministic or not. The
// kernel splits block columns into writers of its own kv tile: modelled so.
int64_t modelled_critical_path(const BlockMask& mask, const ColumnSchedule& schedule, const ScheduleProblem& p,
                               bool deterministic) {
  const int64_t s = dq_sub_tiles(mask.block_kv);
  return simulate_dq_backward(dq_model_problem(mask, schedule, s, p.batch, p.heads_q, p.heads_kv),
                              dq_handout(schedule, p.batch, p.heads_kv, mask.num_kv_blocks(), s), p.workers,
                              deterministic)
      .critical_path;
}
}  // namespace

std::vector<ScheduleCandidate> schedule_candidates(const BlockMask& mask, const ScheduleProblem& problem) {
  check_problem(problem);
  const ScheduleProblem p = resolved_problem(mask, problem);
  // Every hand-out x walk the kernel runs.
  std::vector<ScheduleCandidate> out;
  for (const auto& [kind, walk] : {std::make_pair(ScheduleKind::kLeftToRight, WalkOrder::kDescendingHeadsInner),
                                   std::make_pair(ScheduleKind::kLeftToRight, WalkOrder::kAscendingHeadsOuter),
                                   std::make_pair(ScheduleKind::kShortestFirst, WalkOrder::kAscendingHeadsOuter),
                                   std::make_pair(ScheduleKind::kShortestFirst, WalkOrder::kDescendingHeadsInner),
                                   std::make_pair(ScheduleKind::kLeftToRight, WalkOrder::kAscendingHeadsInner)}) {
    ScheduleCandidate c;
    c.schedule.kind = kind;
    c.schedule.walk = walk;
    c.critical_path = modelled_critical_path(mask, c.schedule, p, true);
    c.nondeterministic_critical_path = modelled_critical_path(mask, c.schedule, p, false);
    out.push_back(std::move(c));
  }
  return out;
}

ColumnSchedule choose_schedule(const BlockMask& mask, const ScheduleProblem& problem) {
  check_problem(problem);
  ColumnSchedule s;
  s.kind = ScheduleKind::kLeftToRight;
  s.walk = WalkOrder::kDescendingHeadsInner;
  // Both walks modelled on the real problem (block_mask.h says when and why); the ascending one
  // only where the model puts it clearly ahead, since the model lacks the per-item and L2 costs
  // that favour the descending walk.
  const ScheduleProblem p = resolved_problem(mask, problem);
  if (!walk_needs_the_model(mask, p)) return s;
  ColumnSchedule ascending = s;
  ascending.walk = WalkOrder::kAscendingHeadsInner;
  if (double(modelled_critical_path(mask, ascending, p, true)) <=
      kAscendingWalkGain * double(modelled_critical_path(mask, s, p, true)))
    return ascending;
  return s;
}

}  // namespace sparsetrain

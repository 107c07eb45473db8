// document_ids_from_cu_seqlens (cu_seqlens.h): every check that needs no value of a device tensor,
// then one id per position by document_of_position (src/common/attention/cu_seqlens.h), on the host or by
// the CUDA kernel on the offsets' device. Host offsets are also checked by value, before anything
// is allocated.
#include <string>

#include "common/attention/cu_seqlens.h"
#include "common/attention/mask_predicate.h"
#include "ops/checks.h"
#include "sparsetrain/cu_seqlens.h"
#include "sparsetrain/error.h"
#include "sparsetrain/runtime.h"
#if SPARSETRAIN_WITH_CUDA
#include "cuda/block_mask/block_mask_cuda.h"
#endif

namespace sparsetrain {

MaskSpec DocumentIds::spec(MaskKind kind) const {
  ST_CHECK_ARG(mask_has_documents(kind), "DocumentIds::spec kind",
               "kDocument or kDocumentCausal", int(kind));
  MaskSpec s;
  s.kind = kind;
  s.doc_q = doc_q.view();
  s.doc_kv = doc_kv.view();
  return s;
}

namespace {

void check_offsets(const TensorView& cu, const char* name) {
  checks::defined(cu, name, "int32 cumulative document offsets [n + 1]");
  checks::dtype(cu, name, DType::kInt32, " (FlashAttention's cu_seqlens)");
  ST_CHECK_ARG(cu.dim() == 1, name, "a 1-d tensor [n + 1] (n documents)", cu.shape_str());
  ST_CHECK_ARG(cu.size(0) >= 1, name, "at least one offset ([n + 1] for n documents)", cu.shape_str());
  ST_CHECK_ARG(cu.stride(0) == 1 || cu.size(0) == 1, name, "a unit stride", cu.stride(0));
  checks::non_null(cu, name);
}

// Host offsets: cu[0] == 0, never decreasing, the last one inside the sequence.
void check_offset_values(const TensorView& cu, const char* name, int64_t seq, const char* seq_name) {
  const int32_t* c = cu.data_as<const int32_t>();
  ST_CHECK_ARG(c[0] == 0, (std::string(name) + "[0]").c_str(), "0 (cumulative offsets start at 0)", c[0]);
  for (int64_t i = 1; i < cu.size(0); ++i)
    ST_CHECK_ARG(c[i] >= c[i - 1], (std::string(name) + "[" + std::to_string(i) + "]").c_str(),
                 ">= the previous offset " + std::to_string(c[i - 1]) + " (document lengths >= 0)", c[i]);
  const int64_t last = c[cu.size(0) - 1];
  ST_CHECK_ARG(last <= seq, (std::string(name) + "[-1]").c_str(),
               std::string("<= ") + seq_name + " = " + std::to_string(seq) + " (the packed length)", last);
}

Tensor convert(const TensorView& cu, int64_t seq, CuSeqlensSide side, Allocator& alloc, Stream stream) {
  const int64_t n = cu.size(0) - 1;
  const int32_t pad = cu_seqlens_padding_id(n, side);
  checks::device_runs(cu.device(), checks::Kernels::kGeneric, "cu_seqlens");
  Tensor ids = Tensor::empty(DType::kInt32, {1, seq}, cu.device(), alloc, stream);
  int32_t* out = ids.view().data_as<int32_t>();
  if (cu.device().is_cuda()) {
#if SPARSETRAIN_WITH_CUDA
    document_ids_from_cu_seqlens_cuda(cu.data_as<const int32_t>(), n, pad, out, seq, cu.device().index, stream);
#endif
  } else {
    const int32_t* c = cu.data_as<const int32_t>();
    for (int64_t p = 0; p < seq; ++p) out[p] = document_of_position(c, n, p, pad);
  }
  return ids;
}

}  // namespace

DocumentIds document_ids_from_cu_seqlens(const TensorView& cu_seqlens_q, const TensorView& cu_seqlens_k,
                                         int64_t seq_q, int64_t seq_kv, Allocator* allocator, Stream stream) {
  check_offsets(cu_seqlens_q, "cu_seqlens_q");
  check_offsets(cu_seqlens_k, "cu_seqlens_k");
  ST_CHECK_ARG(cu_seqlens_k.size(0) == cu_seqlens_q.size(0), "cu_seqlens_k",
               "as many documents as cu_seqlens_q (shape " + cu_seqlens_q.shape_str() + ")",
               cu_seqlens_k.shape_str());
  ST_CHECK_ARG(cu_seqlens_k.device() == cu_seqlens_q.device(), "cu_seqlens_k",
               "a tensor on " + cu_seqlens_q.device().str() + " (cu_seqlens_q's device)", cu_seqlens_k.device().str());
  ST_CHECK_ARG(seq_q >= 1, "seq_q", ">= 1", seq_q);
  ST_CHECK_ARG(seq_kv >= 1, "seq_kv", ">= 1", seq_kv);
  const Device device = cu_seqlens_q.device();
  if (device.is_cpu()) {
    check_offset_values(cu_seqlens_q, "cu_seqlens_q", seq_q, "seq_q");
    check_offset_values(cu_seqlens_k, "cu_seqlens_k", seq_kv, "seq_kv");
  } else {
    ST_CHECK_ARG(device.is_cuda() && built_with_cuda(), "cu_seqlens_q",
                 "a tensor on the CPU or a CUDA device (with a CUDA build)", device.str());
  }
  Allocator& alloc = allocator != nullptr ? *allocator : default_allocator();
  DocumentIds ids;
  ids.doc_q = convert(cu_seqlens_q, seq_q, CuSeqlensSide::kQuery, alloc, stream);
  ids.doc_kv = convert(cu_seqlens_k, seq_kv, CuSeqlensSide::kKey, alloc, stream);
  return ids;
}

}  // namespace sparsetrain

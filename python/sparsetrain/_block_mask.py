"""sparsetrain.BlockMask (block_mask.h in Python) and block-sparse attention over arrays.

A BlockMask holds its index tensors as numpy arrays or as torch tensors (`framework`; torch
tensors on the CPU or on one CUDA device), all int32 in FlexAttention's layout with leading dims
[B, H] (size 1 broadcasts), plus the sizes, the mask inside partial blocks (`spec`) and the column
schedule its dQ write order was built for. The builders run in C++ (`build` on the host or on a
CUDA device, `from_blocks`, `with_schedule`; `from_cu_seqlens` for documents given as
FlashAttention's cu_seqlens); `from_torch` converts torch's flex_attention
BlockMask as it is: its lists, and its mask_mod evaluated once per partial block into per-block
bitmasks. `to(device)` moves a mask (torch tensors).
"""

from __future__ import annotations

import functools
import math
import operator
from typing import Any, Dict, List, NamedTuple, Optional, Sequence, Tuple, Union

import numpy as np

from . import _C, _mask_mod
from ._arrays import Framework, _is_torch, name_of_dtype, to_core

__all__ = ["BlockMask", "MaskSpec", "MASK_KINDS", "document_ids_from_cu_seqlens", "block_sparse_attention_forward",
           "block_sparse_attention_backward"]

MASK_KINDS = ("full", "causal", "causal_bottom_right", "sliding_window", "document", "document_causal",
              "prefix_lm")
_DOC_KINDS = ("document", "document_causal")
# build()'s doc_padding for document masks built on a CUDA device (build's docstring says why).
_AUTO_DOC_PADDING = 1024
# The index tensors of a mask, in block_mask.h's order (None where absent).
TENSOR_NAMES = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices", "q_num_blocks",
                "q_indices", "full_q_num_blocks", "full_q_indices", "dq_write_order", "dq_write_order_full",
                "partial_bitmasks")


# The padded backward form's tensors on the wire: a document mask's lists, no partial bitmasks.
_PADDED_LISTS = TENSOR_NAMES[:10]
# Where the wire holds the schedule permutation: a host array whatever the mask's device.
WIRE_PERMUTATION = len(TENSOR_NAMES) + 3
# What a mask's wire is read from, in one C call: a wire cached on a mask is valid while the mask
# still holds these same objects (its spec, a tuple, fixes the document ids).
WIRE_PARTS = operator.attrgetter(*TENSOR_NAMES, "spec", "schedule_permutation", "real_rows", "seq_q", "seq_kv",
                                 "block_q", "block_kv", "schedule", "walk", "backward_padded")


def wire(mask: "BlockMask") -> Tuple[List[Any], List[int], str]:
    """A mask as both bindings read it (python/src/mask_wire.h): its arrays (TENSOR_NAMES, doc_q,
    doc_kv, real_rows, the schedule permutation, then the padded backward form's 10 lists, doc_q,
    doc_kv and real_rows; None where absent), its sizes (seq_q, seq_kv, block_q, block_kv,
    window_left, window_right, prefix_length, the padded form's length or 0) and
    "kind,schedule,walk". Flat, so that torch's operators take it and torch.compile sees every
    tensor they read."""
    tensors = [getattr(mask, n) for n in TENSOR_NAMES]
    tensors += [mask.spec.doc_q, mask.spec.doc_kv, mask.real_rows, mask.schedule_permutation]
    p = mask.backward_padded
    tensors += [None] * 13 if p is None else [*(getattr(p, n) for n in _PADDED_LISTS), p.spec.doc_q, p.spec.doc_kv,
                                              p.real_rows]
    s = mask.spec
    sizes = [mask.seq_q, mask.seq_kv, mask.block_q, mask.block_kv, int(s.window_left), int(s.window_right),
             int(s.prefix_length), 0 if p is None else p.seq_q]
    return tensors, sizes, f"{s.kind},{mask.schedule},{mask.walk}"


class MaskSpec(NamedTuple):
    """The mask inside partial blocks (mask_spec.h): a built-in kind with its parameters, or
    "bitmask" (the mask's partial_bitmasks). doc_q / doc_kv: int32 document ids [B or 1, S]."""

    kind: str = "full"
    window_left: int = -1    # sliding_window: q - window_left <= kv (negative: unbounded)
    window_right: int = -1   # sliding_window: kv <= q + window_right (0: causal)
    prefix_length: int = 0   # prefix_lm: kv <= q or kv < prefix_length
    doc_q: Any = None
    doc_kv: Any = None

    def _core(self) -> dict:
        return {"kind": self.kind, "window_left": int(self.window_left), "window_right": int(self.window_right),
                "prefix_length": int(self.prefix_length), "doc_q": to_core(self.doc_q),
                "doc_kv": to_core(self.doc_kv)}


def _framework(name: Optional[str], *arrays: Any) -> Framework:
    if name is None:
        name = "torch" if any(a is not None and _is_torch(a) for a in arrays) else "numpy"
    if name == "numpy":
        return Framework(None)
    if name == "torch":
        import torch  # noqa: PLC0415

        return Framework(torch)
    raise ValueError(f"framework: expected 'numpy', 'torch' or None (from the inputs), got {name!r}")


_TORCH_LIBRARY: List[Any] = []


def _torch_library() -> Any:
    """The C++ torch library (sparsetrain._torch_ops) when it is in the install and loads, else None
    (torch masks are then built through `_C`)."""
    if not _TORCH_LIBRARY:
        try:
            from .torch import native  # noqa: PLC0415  (imports torch; the library registers its operators)
            _TORCH_LIBRARY.append(native.TORCH_OPS)
        except ImportError:
            _TORCH_LIBRARY.append(None)
    return _TORCH_LIBRARY[0]


def _block_size(block_size: Union[int, Sequence[int]]) -> Tuple[int, int]:
    if isinstance(block_size, (int, np.integer)):
        return int(block_size), int(block_size)
    bs = tuple(int(b) for b in block_size)
    if len(bs) != 2:
        raise ValueError(f"block_size: expected an int or (block_q, block_kv), got {block_size!r}")
    return bs


def _schedule_arg(schedule: Any) -> Any:
    """"auto", "left_to_right", "shortest_first", or a permutation of the kv block columns."""
    if isinstance(schedule, str):
        if schedule not in ("auto", "left_to_right", "shortest_first"):
            raise ValueError("schedule: expected 'auto', 'left_to_right', 'shortest_first' or a permutation of "
                             f"the kv block columns, got {schedule!r}")
        return schedule
    try:
        return [int(c) for c in (schedule.tolist() if hasattr(schedule, "tolist") else schedule)]
    except (TypeError, ValueError):
        raise ValueError("schedule: expected 'auto', 'left_to_right', 'shortest_first' or a permutation of the kv "
                         f"block columns, got {schedule!r}") from None


def _problem_arg(problem: Any) -> Any:
    """None, or (batch, heads_q, heads_kv, workers) for "auto" (0: the default)."""
    if problem is None:
        return None
    p = [int(x) for x in problem]
    if len(p) != 4 or any(x < 0 for x in p):
        raise ValueError(f"auto_problem: expected (batch, heads_q, heads_kv, workers) >= 0, got {problem!r}")
    return p


def _device_arg(device: Any, framework: Optional[str]) -> Any:
    """A build's device: None or "cpu" for the host, else a torch.device of type cuda with its
    index (the current device for a bare "cuda"); a ValueError for anything else."""
    if device is None or (isinstance(device, str) and device == "cpu"):
        return None
    if framework == "numpy":
        raise ValueError(f"device: expected 'cpu' for framework 'numpy' (a mask on a CUDA device holds torch "
                         f"tensors), got {device!r}")
    import torch  # noqa: PLC0415

    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"device: expected 'cpu', 'cuda', 'cuda:N' or a torch.device, got {device!r}") from None
    if dev.type == "cpu":
        return None
    if dev.type != "cuda":
        raise ValueError(f"device: expected 'cpu' or a CUDA device, got {dev}")
    if not torch.cuda.is_available():
        raise ValueError(f"device: expected an available CUDA device, got {dev} (torch.cuda.is_available() "
                         "is False)")
    return torch.device("cuda", torch.cuda.current_device() if dev.index is None else dev.index)


def _cuda_device_of(*arrays: Any) -> Any:
    """The device of the first given array when it is a torch tensor on a CUDA device, else None
    (a build's default device: ids on a GPU are built on, never copied to the host)."""
    first = next((a for a in arrays if a is not None), None)
    return first.device if _is_torch(first) and first.device.type != "cpu" else None


def _doc_ids(a: Any, fw: Framework, arg: str, device: Any = None) -> Any:
    """Document ids as int32 [B or 1, S] arrays of the framework (int64 ids are converted), on
    the host or, for a build on a CUDA device, on that device."""
    if fw.torch is not None:
        torch = fw.torch
        t = a if _is_torch(a) else torch.as_tensor(np.asarray(a))
        if t.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{arg}: expected integer document ids (int32 or int64), got {name_of_dtype(t.dtype)}")
        t = t.detach().to("cpu" if device is None else device, torch.int32)
        return (t.unsqueeze(0) if t.dim() == 1 else t).contiguous()
    arr = a.detach().cpu().numpy() if _is_torch(a) else np.asarray(a)
    if arr.dtype.kind not in "iu":
        raise ValueError(f"{arg}: expected integer document ids (int32 or int64), got {name_of_dtype(arr.dtype)}")
    arr = np.ascontiguousarray(arr, dtype=np.int32)
    return arr[None] if arr.ndim == 1 else arr


def _cu_seqlens_arg(a: Any, fw: Framework, device: Any = "keep") -> Any:
    """FlashAttention's cumulative offsets as an array of the framework: torch tensors and numpy
    arrays as they are (the core checks int32, 1-d; a list becomes int32), moved to `device` (a
    torch.device, None for the host) unless "keep"."""
    if isinstance(a, (list, tuple)):
        a = np.asarray(a, dtype=np.int32)
    if fw.torch is not None:
        t = a if _is_torch(a) else fw.torch.as_tensor(np.asarray(a))
        return t if isinstance(device, str) and device == "keep" else t.to("cpu" if device is None else device)
    return a.detach().cpu().numpy() if _is_torch(a) else np.asarray(a)


def _host_last(a: Any) -> Optional[int]:
    """cu[-1] of offsets in host memory (None for a CUDA tensor: reading it would synchronise)."""
    if _is_torch(a) and a.device.type != "cpu":
        return None
    return int(a[-1]) if len(a) > 0 else None


def _packed_length(seq: Optional[int], cu: Any, arg: str) -> int:
    """A packed length (seq_q or seq_kv) as given, else cu[-1] of host offsets; for CUDA offsets
    an error naming the argument (reading the last offset would synchronise)."""
    if seq is not None:
        return int(seq)
    last = _host_last(cu)
    if last is None:
        side, t = ("query", "q") if arg == "seq_q" else ("key", "k")
        raise ValueError(f"{arg}: expected the packed {side} length ({t}'s sequence size) for offsets on "
                         f"{cu.device} (reading cu_seqlens_{t}[-1] would synchronise), got None")
    return last


def _max_seqlen_arg(value: Any, arg: str) -> None:
    """FlashAttention's max_seqlen_q / max_seqlen_k: accepted (so a flash_attn_varlen_func call
    passes its arguments unchanged) and checked, not needed."""
    if value is None:
        return
    try:
        n = None if isinstance(value, bool) else operator.index(value)
    except TypeError:
        n = None
    if n is None or n < 0:
        raise ValueError(f"{arg}: expected an int >= 0 or None (not needed: the mask comes from the offsets), "
                         f"got {value!r}")


def document_ids_from_cu_seqlens(cu_seqlens_q: Any, cu_seqlens_k: Any = None, seq_q: Optional[int] = None,
                                 seq_kv: Optional[int] = None, *, framework: Optional[str] = None) -> Tuple[Any, Any]:
    """FlashAttention's packed documents -> (doc_q int32 [1, seq_q], doc_kv int32 [1, seq_kv]), the
    document ids that BlockMask.build's document kinds take (include/sparsetrain/cu_seqlens.h).
    cu_seqlens_q / cu_seqlens_k: int32 [n + 1] cumulative offsets (cu[0] = 0) of one packed batch
    row, as flash_attn_varlen_func takes them; cu_seqlens_k defaults to cu_seqlens_q. Document i
    gets id i; positions past the last offset get n (query side) and n + 1 (key side), which match
    nothing. The ids are made where the offsets are: on a CUDA device by a kernel on torch's
    current stream, without a host synchronisation (seq_q is then required: q's packed length);
    on the host by plain code, which also checks the values (cu[0] = 0, non-decreasing, cu[-1] <=
    seq). seq_q defaults to cu_seqlens_q[-1] for host offsets; seq_kv to seq_q when the key offsets
    are the query's, else to cu_seqlens_k[-1] (host offsets)."""
    same = cu_seqlens_k is None or cu_seqlens_k is cu_seqlens_q
    cu_seqlens_k = cu_seqlens_q if cu_seqlens_k is None else cu_seqlens_k
    fw = _framework(framework, cu_seqlens_q, cu_seqlens_k)
    cu_q, cu_k = _cu_seqlens_arg(cu_seqlens_q, fw), _cu_seqlens_arg(cu_seqlens_k, fw)
    seq_q = _packed_length(seq_q, cu_q, "seq_q")
    seq_kv = seq_q if seq_kv is None and same else _packed_length(seq_kv, cu_k, "seq_kv")
    stream = fw.stream_of(cu_q) if fw.torch is not None else 0
    dq, dkv = _C.document_ids_from_cu_seqlens(to_core(cu_q), to_core(cu_k),
                                              int(seq_q), int(seq_kv), fw.allocate, stream)
    return fw.view(dq), fw.view(dkv)


class BlockMask:
    """Which (query block, key block) pairs an attention computes, in FlexAttention's layout
    (include/sparsetrain/block_mask.h): kv_num_blocks [B, H, Mq], kv_indices [B, H, Mq, W] (partial
    blocks: `spec` or the bitmasks apply inside), full_kv_* (no mask inside; may be None), the
    transposes q_* for backward, and dq_write_order(_full), the deterministic backward's dQ turns
    for `schedule` ("left_to_right", "shortest_first" or "permutation" with `schedule_permutation`;
    a column's turns in the mask's own block units), and `walk`, the order in which the backward
    visits one kv column's q tiles and query heads ("descending_heads_inner", the default,
    "ascending_heads_outer" or "ascending_heads_inner"; block_mask.h WalkOrder): the schedule and walk fix the backward's
    bits. Leading dims broadcast over the batch and the query heads.

    Build one with `BlockMask.build(kind, seq_q, seq_kv, ...)` (on the host or, with device=, on
    a CUDA device), `BlockMask.from_cu_seqlens(cu_seqlens_q, cu_seqlens_k, ...)` (FlashAttention's
    packed documents), `BlockMask.from_blocks(blocks, ...)` or `BlockMask.from_torch(flex_block_mask)`.
    The arrays are numpy arrays or torch tensors (`framework`; `to_torch()` / `to_numpy()` convert
    host masks without copies), on the host or one CUDA device (`device`; `to(device)`, `cuda()`
    and `cpu()` move them). Treat them as read-only.
    """

    def __init__(self, *, seq_q: int, seq_kv: int, block_q: int, block_kv: int, tensors: Dict[str, Any],
                 spec: MaskSpec, schedule: str, schedule_permutation: Any, framework: Framework,
                 walk: str = "descending_heads_inner", real_rows: Any = None,
                 backward_padded: Optional["BlockMask"] = None):
        self.seq_q, self.seq_kv = int(seq_q), int(seq_kv)
        self.block_q, self.block_kv = int(block_q), int(block_kv)
        for name in TENSOR_NAMES:
            setattr(self, name, tensors.get(name))
        self.spec = spec
        self.schedule = schedule
        self.schedule_permutation = schedule_permutation
        self.walk = walk
        # Documents as ranges in the backward (block_mask.h BlockMask::backward_padded): the padded
        # form of a document mask (build(..., doc_padding=)), and in that form each position's
        # token (real_rows, -1 for padding).
        self.real_rows = real_rows
        self.backward_padded = backward_padded
        self._fw = framework
        self._other: Optional[BlockMask] = None  # the cached to_torch() / to_numpy() twin
        self._core_cache: Optional[tuple] = None  # _core_mask()'s
        self._torch_cache: Optional[tuple] = None  # sparsetrain.torch's (_mask_args_of)

    # -- builders ------------------------------------------------------------------------------
    @classmethod
    def build(cls, kind: str, seq_q: int, seq_kv: Optional[int] = None, *, window_left: int = -1,
              window_right: int = -1, prefix_length: int = 0, document_ids: Any = None, doc_q: Any = None,
              doc_kv: Any = None, block_size: Union[int, Sequence[int]] = 128, schedule: Any = None,
              framework: Optional[str] = None, device: Any = None, cu_seqlens_q: Any = None,
              cu_seqlens_k: Any = None, max_seqlen_q: Optional[int] = None,
              max_seqlen_k: Optional[int] = None, walk: Optional[str] = None,
              auto_problem: Optional[Sequence[int]] = None, doc_padding: Optional[int] = None) -> "BlockMask":
        """A mask from a built-in kind (mask_spec.h), seq_kv = seq_q by default:
        "full"; "causal" (kv <= q, FlexAttention's top-left convention); "causal_bottom_right"
        (kv <= q + seq_kv - seq_q, FlashAttention's); "sliding_window" (q - window_left <= kv <=
        q + window_right, a negative bound is unbounded); "document" / "document_causal"
        (document_ids [B or 1, S] or [S] for both sides, or doc_q and doc_kv; int32 or int64);
        "prefix_lm" (kv <= q or kv < prefix_length). block_size: 128 or (block_q, block_kv).
        schedule: "auto" (the default: what measured fastest, left to right with the descending
        walk; masks given by blocks may take the ascending one, block_mask.h choose_schedule), "left_to_right", "shortest_first", or a permutation
        of the kv block columns. walk (with an explicit schedule): "descending_heads_inner" (the
        default), "ascending_heads_outer" or "ascending_heads_inner". auto_problem: (batch, heads_q, heads_kv, workers) of
        the attention and the GPU (workers: its SM count, or the sm_limit used), 0 for the
        defaults (the mask's leading dims, 132 workers); checked, and what the scheduler model's
        candidates (_C.schedule_candidates) are computed for. framework: "numpy", "torch", or None (torch when the document ids are
        torch tensors or the device is CUDA). device: "cpu" builds on the host; a CUDA device
        ("cuda", "cuda:1", a torch.device) builds the same tensors there, on torch's current
        stream, without a host synchronisation (torch tensors from torch's allocator; document ids
        are moved there first); None (the default): where the document ids (or cu_seqlens_q) are
        when they are CUDA tensors, so that ids on a GPU never take a copy to the host and a sync,
        else the host (and always the host for framework "numpy").
        cu_seqlens_q / cu_seqlens_k (document kinds, instead of document ids): FlashAttention's
        packed documents, int32 [n + 1] cumulative offsets of one packed batch row (cu_seqlens_k
        defaults to cu_seqlens_q); moved to the build's device like document ids, then turned into
        ids there (document_ids_from_cu_seqlens: on a CUDA device without a host synchronisation).
        "document_causal" is kv <= q in packed positions within a document: FlashAttention's varlen
        causal (bottom-right per document) when cu_seqlens_q == cu_seqlens_k, not otherwise;
        "document" is FlashAttention's non-causal varlen for any lengths. max_seqlen_q /
        max_seqlen_k are accepted as FlashAttention takes them, and not needed.
        doc_padding (document kinds, seq_q == seq_kv; cu_seqlens too): also build the mask's padded
        backward form (`backward_padded`; block_mask.h build_doc_padded_mask): documents (of the
        query side's ids) of at least doc_padding tokens (>= 128) start and end on 128-token
        boundaries there, and the CUDA backward runs on it (its tiles never straddle those
        documents' edges; the results are the same up to rounding, and as repeatable); 0: none;
        None (the default): 1024 for a document mask built on a CUDA device with seq_q == seq_kv >=
        1024 and a schedule that is not a permutation (its device build costs less than it saves in
        one layer's backward), else none (on the CPU the form is unused; its host build takes about
        as long again as the mask's own)."""
        seq_kv = seq_q if seq_kv is None else seq_kv
        if kind not in MASK_KINDS:
            raise ValueError(f"kind: expected one of {', '.join(MASK_KINDS)}, got {kind!r}")
        explicit_padding = doc_padding is not None
        if doc_padding and (kind not in _DOC_KINDS or seq_q != seq_kv):
            raise ValueError(f"doc_padding: expected 0 for kind {kind!r} with seq_q {seq_q}, seq_kv {seq_kv} (a "
                             f"document kind with seq_q == seq_kv takes it), got {doc_padding}")
        _max_seqlen_arg(max_seqlen_q, "max_seqlen_q")
        _max_seqlen_arg(max_seqlen_k, "max_seqlen_k")
        if device is None and framework != "numpy":
            device = _cuda_device_of(document_ids, doc_q, cu_seqlens_q)
        if cu_seqlens_q is None and cu_seqlens_k is not None:
            raise ValueError("cu_seqlens_q: expected the query offsets with cu_seqlens_k, got None")
        if cu_seqlens_q is not None:
            if kind not in _DOC_KINDS:
                raise ValueError(f"cu_seqlens_q: expected none for kind {kind!r} (only document kinds take them)")
            if document_ids is not None or doc_q is not None or doc_kv is not None:
                raise ValueError("cu_seqlens_q: expected either cu_seqlens or document ids, got both")
        if document_ids is not None:
            if doc_q is not None or doc_kv is not None:
                raise ValueError("document_ids: expected either document_ids or doc_q / doc_kv, got both")
            doc_q = doc_kv = document_ids
        dev = _device_arg(device, framework)
        fw = _framework("torch" if dev is not None and framework is None else framework, doc_q, doc_kv,
                        cu_seqlens_q, cu_seqlens_k)
        if schedule is None:
            schedule = "auto"
        if cu_seqlens_q is not None:  # converted on the build's device, then the document-id path
            same = cu_seqlens_k is None or cu_seqlens_k is cu_seqlens_q
            cu_q = _cu_seqlens_arg(cu_seqlens_q, fw, dev)
            cu_k = cu_q if same else _cu_seqlens_arg(cu_seqlens_k, fw, dev)
            doc_q, doc_kv = document_ids_from_cu_seqlens(cu_q, cu_k, int(seq_q), int(seq_kv),
                                                         framework="numpy" if fw.torch is None else "torch")
        if kind in _DOC_KINDS:
            if doc_q is None or doc_kv is None:
                raise ValueError(f"document_ids: expected document ids [B or 1, S] for kind {kind!r}, got none")
            same = doc_kv is doc_q  # converted once: one tensor for both sides
            doc_q = _doc_ids(doc_q, fw, "doc_q", dev)
            doc_kv = doc_q if same else _doc_ids(doc_kv, fw, "doc_kv", dev)
        elif doc_q is not None or doc_kv is not None:
            raise ValueError(f"document_ids: expected none for kind {kind!r} (only document kinds take them)")
        spec = MaskSpec(kind, int(window_left), int(window_right), int(prefix_length), doc_q, doc_kv)
        bq, bkv = _block_size(block_size)
        sched = _schedule_arg(schedule)
        problem = _problem_arg(auto_problem)
        permutation = isinstance(sched, list)  # "auto" never resolves to one
        if not explicit_padding:
            doc_padding = (_AUTO_DOC_PADDING if dev is not None and kind in _DOC_KINDS and seq_q == seq_kv
                           and seq_q >= _AUTO_DOC_PADDING and not permutation else 0)
        elif doc_padding and permutation:
            raise ValueError("doc_padding: expected the left_to_right or shortest_first schedule (a permutation "
                             "names the unpadded mask's columns), got a permutation")
        doc_padding = int(doc_padding or 0)
        lib = _torch_library() if fw.torch is not None else None
        if lib is not None:  # torch tensors straight from C++ (torch_block_mask.cpp), the padded form with them
            d = lib.build_block_mask(kind, int(seq_q), int(seq_kv), int(window_left), int(window_right),
                                     int(prefix_length), doc_q, doc_kv, bq, bkv, "" if permutation else sched,
                                     sched if permutation else [], walk or "", problem or [],
                                     -1 if dev is None else dev.index, doc_padding)
            return cls._from_core(d, fw, spec, view=lambda t: t)
        args = (spec._core(), int(seq_q), int(seq_kv), bq, bkv, sched, fw.allocate)
        if dev is None:
            d = _C.build_block_mask(*args, walk=walk, problem=problem)
        else:
            stream = fw.torch.cuda.current_stream(dev).cuda_stream
            d = _C.build_block_mask(*args, "cuda", dev.index, stream, walk=walk, problem=problem)
        if doc_padding:  # for the schedule and walk the mask resolved to
            args = (spec._core(), int(seq_q), doc_padding, bq, bkv, d["schedule"], fw.allocate)
            if dev is None:
                d["padded"] = _C.build_doc_padded_mask(*args, walk=d["schedule_walk"])
            else:
                d["padded"] = _C.build_doc_padded_mask(*args, "cuda", dev.index, stream, walk=d["schedule_walk"])
        return cls._from_core(d, fw, spec)

    @classmethod
    def from_cu_seqlens(cls, cu_seqlens_q: Any, cu_seqlens_k: Any = None, max_seqlen_q: Optional[int] = None,
                        max_seqlen_k: Optional[int] = None, *, seq_q: Optional[int] = None,
                        seq_kv: Optional[int] = None, causal: bool = False,
                        block_size: Union[int, Sequence[int]] = 128, schedule: Any = None,
                        framework: Optional[str] = None, device: Any = None,
                        doc_padding: Optional[int] = None) -> "BlockMask":
        """A document mask from FlashAttention's packed form, with the arguments
        flash_attn_varlen_func takes (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
        causal): "document_causal" if causal else "document", over one packed batch row (q
        [1, H, seq_q, D] in the torch front). seq_q / seq_kv: the packed lengths (q's and k's
        sequence sizes; required for CUDA offsets, by default cu[-1] for host offsets). device: by
        default where cu_seqlens_q is, so that CUDA offsets give a CUDA mask built without a host
        synchronisation ("cpu" builds on the host). Causal semantics: kv <= q in packed positions
        within a document, which is FlashAttention's (bottom-right per document) exactly when
        cu_seqlens_q == cu_seqlens_k; see build() (also for doc_padding, seq_q == seq_kv)."""
        same = cu_seqlens_k is None or cu_seqlens_k is cu_seqlens_q
        seq_q = _packed_length(seq_q, cu_seqlens_q, "seq_q")
        seq_kv = seq_q if seq_kv is None and same else _packed_length(seq_kv, cu_seqlens_k, "seq_kv")
        return cls.build("document_causal" if causal else "document", seq_q, seq_kv,
                         cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
                         max_seqlen_k=max_seqlen_k, block_size=block_size, schedule=schedule,
                         framework=framework, device=device, doc_padding=doc_padding)

    @classmethod
    def from_blocks(cls, blocks: Any, seq_q: int, seq_kv: int, *, block_size: Union[int, Sequence[int]] = 128,
                    schedule: Any = "auto", spec: Optional[MaskSpec] = None,
                    framework: Optional[str] = None, auto_problem: Optional[Sequence[int]] = None) -> "BlockMask":
        """A mask from a dense block matrix, uint8 (or bool) [B, H, Mq, Nk]: 0 skipped, 1 partial,
        2 full (bool: True = full). `spec` is what applies inside partial blocks (default
        MaskSpec("full"): nothing; partial then computes like full). schedule and auto_problem
        as in build: "auto" runs the scheduler model on auto_problem to pick the walk."""
        fw = _framework(framework, blocks)
        blocks = _uint8_blocks(blocks, fw)
        bq, bkv = _block_size(block_size)
        spec = MaskSpec() if spec is None else spec
        if spec.kind == "bitmask":
            raise ValueError("spec: expected a built-in kind (bitmasks come from from_torch), got 'bitmask'")
        if spec.kind in _DOC_KINDS:
            spec = spec._replace(doc_q=_doc_ids(spec.doc_q, fw, "spec.doc_q"),
                                 doc_kv=_doc_ids(spec.doc_kv, fw, "spec.doc_kv"))
        d = _C.build_block_mask_from_blocks(to_core(blocks), int(seq_q), int(seq_kv), bq, bkv,
                                            _schedule_arg(schedule), fw.allocate, problem=_problem_arg(auto_problem))
        return cls._from_core(d, fw, spec)

    @classmethod
    def from_torch(cls, block_mask: Any, *, batch: Optional[int] = None, heads: Optional[int] = None,
                   schedule: Any = "auto", device: Any = None,
                   auto_problem: Optional[Sequence[int]] = None) -> "BlockMask":
        """torch.nn.attention.flex_attention.BlockMask as it is: its partial and full blocks
        (full_kv_* may be None: every listed block is then partial), BLOCK_SIZE and seq_lengths,
        and its mask_mod evaluated once per partial block into bitmasks, with flex's meaning
        (create_mask's: vmapped over 0-d indices; on broadcast index tensors where one watched call
        shows the mask_mod elementwise, sparsetrain/_mask_mod.py). The lists are checked before
        anything is built (counts, ids, duplicates, a block both partial and full: ValueErrors
        naming the entry). torch's q_* are not used: the
        transposes and dQ write orders are ours (for `schedule`). mask_mod sees the block mask's own
        batch / head indices; one that depends on b or h under a mask built with B or H = 1 (flex
        then broadcasts it) needs `batch` / `heads` here to be evaluated per batch row / head.
        The result holds torch tensors on `device`: by default the flex mask's own device (the
        lists, transposes and write orders are built on the host and copied there in one copy; mask_mod always
        runs on the flex mask's device, where the tensors it captures live). schedule and
        auto_problem as in build: "auto" runs the scheduler model on auto_problem (batch, heads_q,
        heads_kv, workers of the attention this mask serves; by default the mask's own leading
        dims, often 1 x 1 for a flex mask) to pick the walk, so pass it for the backward's best
        deterministic order."""
        import torch  # noqa: PLC0415

        return _from_flex(cls, torch, block_mask, batch, heads, schedule, device, auto_problem)

    def with_schedule(self, schedule: Any = "auto", *, walk: Optional[str] = None,
                      auto_problem: Optional[Sequence[int]] = None) -> "BlockMask":
        """The same mask with the transposes and dQ write orders rebuilt for another schedule
        (or walk; "auto" for auto_problem as in build); the forward lists and
        bitmasks are shared. On a CUDA mask they are rebuilt on a host copy and copied back (a
        synchronising debug/setup path). The padded backward form (doc_padding) follows a
        left-to-right or shortest-first schedule and is dropped for a permutation."""
        if self._on_device():
            return self.cpu().with_schedule(schedule, walk=walk, auto_problem=auto_problem).to(self.device)
        d = _C.complete_block_mask(self._core_mask(), _schedule_arg(schedule), self._fw.allocate,
                                   walk=walk, problem=_problem_arg(auto_problem))
        tensors = {n: getattr(self, n) for n in TENSOR_NAMES}
        for n in ("q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices", "dq_write_order",
                  "dq_write_order_full"):
            tensors[n] = self._fw.view(d[n])
        m = BlockMask(seq_q=self.seq_q, seq_kv=self.seq_kv, block_q=self.block_q, block_kv=self.block_kv,
                      tensors=tensors, spec=self.spec, schedule=d["schedule"],
                      schedule_permutation=self._permutation(d["schedule_permutation"], self._fw),
                      framework=self._fw, walk=d["schedule_walk"], real_rows=self.real_rows)
        # The padded form follows (the same schedule and walk); a permutation names the unpadded
        # mask's columns, so under one the backward runs on the mask itself (build refuses
        # doc_padding with a permutation; here the form may have come by default).
        if self.backward_padded is not None and m.schedule != "permutation":
            m.backward_padded = self.backward_padded.with_schedule(m.schedule, walk=m.walk)
        return m

    @classmethod
    def _from_core(cls, d: dict, fw: Framework, spec: MaskSpec, view: Any = None) -> "BlockMask":
        """A built mask (the dict of `_C`'s export_mask, or of the torch library's build_block_mask
        with torch tensors: `view` the identity), with its padded form under "padded" if any."""
        view = fw.view if view is None else view
        tensors = {n: view(d[n]) for n in TENSOR_NAMES}
        mask = cls(seq_q=d["seq_q"], seq_kv=d["seq_kv"], block_q=d["block_q"], block_kv=d["block_kv"],
                   tensors=tensors, spec=spec, schedule=d["schedule"],
                   schedule_permutation=cls._permutation(d["schedule_permutation"], fw),
                   framework=fw, walk=d["schedule_walk"])
        if d.get("padded") is not None:
            mask.backward_padded = cls._padded_of(d["padded"], fw, spec, view)
        return mask

    @classmethod
    def _padded_of(cls, d: dict, fw: Framework, spec: MaskSpec, view: Any) -> "BlockMask":
        """The padded backward form (build_doc_padded_mask's dict) of a document mask of `spec`."""
        padded = cls._from_core(d, fw, spec._replace(doc_q=view(d["doc_q"]), doc_kv=view(d["doc_kv"])), view)
        padded.real_rows = view(d["real_rows"])
        return padded

    @staticmethod
    def _permutation(perm: Optional[list], fw: Framework) -> Any:
        if perm is None:
            return None
        if fw.torch is not None:
            return fw.torch.tensor(perm, dtype=fw.torch.int32)
        return np.asarray(perm, dtype=np.int32)

    # -- checks --------------------------------------------------------------------------------
    def validate(self, batch: int = 0, heads: int = 0) -> None:
        """Every rule of block_mask.h (shapes, ranges, duplicates, sorted walks, transposes, write
        orders; leading dims against batch / heads when > 0); ValueError naming the tensor. A
        mask on a CUDA device is checked on a host copy (synchronises: a debug path)."""
        m = self.cpu() if self._on_device() else self
        _C.validate_block_mask(m._core_mask(), int(batch), int(heads))

    def check_write_order(self) -> str:
        """The deadlock-freedom invariant of the dQ write order for the mask's schedule: "" when
        it holds, else the first violation (a CUDA mask: on a host copy)."""
        m = self.cpu() if self._on_device() else self
        return _C.check_write_order(m._core_mask())

    # -- sizes and conversions -----------------------------------------------------------------
    @property
    def num_q_blocks(self) -> int:
        return -(-self.seq_q // self.block_q)

    @property
    def num_kv_blocks(self) -> int:
        return -(-self.seq_kv // self.block_kv)

    @property
    def framework(self) -> str:
        return "numpy" if self._fw.torch is None else "torch"

    @property
    def device(self) -> Any:
        """Where the tensors are: "cpu" for a numpy mask, the torch.device of a torch mask."""
        return "cpu" if self._fw.torch is None else self.kv_num_blocks.device

    def _on_device(self) -> bool:
        return self._fw.torch is not None and self.kv_num_blocks.device.type != "cpu"

    def tensors(self) -> Dict[str, Any]:
        """Every array of the mask by name (TENSOR_NAMES, then spec.doc_q / spec.doc_kv, then
        real_rows and its padded backward form's as "backward_padded.<name>" where present); None
        where absent. The schedule permutation stays a host array on every device."""
        d = {n: getattr(self, n) for n in TENSOR_NAMES}
        d["doc_q"], d["doc_kv"] = self.spec.doc_q, self.spec.doc_kv
        if self.real_rows is not None:
            d["real_rows"] = self.real_rows
        if self.backward_padded is not None:
            d.update({f"backward_padded.{n}": t for n, t in self.backward_padded.tensors().items()})
        return d

    def to(self, device: Any) -> "BlockMask":
        """This mask with every tensor (the document ids and bitmasks included) on `device` ("cpu",
        "cuda", "cuda:N" or a torch.device): itself when they are already there, else a copy in
        torch tensors (a numpy mask becomes torch first). The schedule permutation stays on the
        host (the library reads it there)."""
        import torch  # noqa: PLC0415

        dev = torch.device(device)
        if dev.type == "cuda" and dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        m = self.to_torch()
        tensors = [t for t in m.tensors().values() if t is not None]
        if all(t.device == dev for t in tensors):
            return m
        moved = dict(zip(map(id, tensors), _packed_to(torch, tensors, dev)))
        return m._convert(Framework(torch), lambda t: moved[id(t)], convert_permutation=False)

    def cuda(self, device: Any = None) -> "BlockMask":
        """to() the current CUDA device (or `device`)."""
        return self.to("cuda" if device is None else device)

    def cpu(self) -> "BlockMask":
        """A host mask: itself if it is one, else a torch CPU copy."""
        return self if not self._on_device() else self.to("cpu")

    def to_torch(self) -> "BlockMask":
        """This mask over torch CPU tensors sharing the arrays' memory (itself if it already is
        torch, on any device)."""
        if self._fw.torch is not None:
            return self
        if self._other is None:
            import torch  # noqa: PLC0415

            other = self._convert(Framework(torch), torch.from_numpy)
            if torch.compiler.is_compiling():
                # Not kept: torch.compile replays an attribute set during its trace after the call, and
                # rebuilt this way the copy's MaskSpec came back empty (seen with torch 2.11), which
                # broke the mask's next eager use.
                return other
            self._other = other
            self._other._other = self
        return self._other

    def to_numpy(self) -> "BlockMask":
        """This mask over numpy arrays sharing the tensors' memory (itself if it already is); a
        CUDA mask is copied to the host first."""
        if self._fw.torch is None:
            return self
        if self._on_device():
            return self.cpu().to_numpy()
        if self._other is None:
            self._other = self._convert(Framework(None), lambda t: t.detach().cpu().numpy())
            self._other._other = self
        return self._other

    def _convert(self, fw: Framework, conv, convert_permutation: bool = True) -> "BlockMask":
        def c(a):
            return None if a is None else conv(a)

        spec = self.spec._replace(doc_q=c(self.spec.doc_q), doc_kv=c(self.spec.doc_kv))
        perm = c(self.schedule_permutation) if convert_permutation else self.schedule_permutation
        padded = self.backward_padded
        return BlockMask(seq_q=self.seq_q, seq_kv=self.seq_kv, block_q=self.block_q, block_kv=self.block_kv,
                         tensors={n: c(getattr(self, n)) for n in TENSOR_NAMES}, spec=spec,
                         schedule=self.schedule, schedule_permutation=perm,
                         framework=fw, walk=self.walk, real_rows=c(self.real_rows),
                         backward_padded=None if padded is None else padded._convert(fw, conv, convert_permutation))

    def _for(self, fw: Framework) -> "BlockMask":
        return self.to_numpy() if fw.torch is None else self.to_torch()

    def _core_mask(self) -> tuple:
        """The mask's wire (wire()) as the extension reads it (views of this mask's arrays). Built
        once and reused while the mask holds the same tensor objects at the same addresses (every
        call reads it; the cache keeps those tensors, so their addresses cannot be reused by others
        meanwhile)."""
        parts = (*WIRE_PARTS(self), self.spec.doc_q, self.spec.doc_kv)  # the ids: their addresses checked too
        ptrs = tuple(p.data_ptr() if hasattr(p, "data_ptr") else None for p in parts)
        cached = self._core_cache
        if cached is not None and cached[1] == ptrs and all(a is b for a, b in zip(cached[0], parts)):
            return cached[2]
        tensors, sizes, kinds = wire(self)
        w = ([to_core(t) for t in tensors], sizes, kinds)
        self._core_cache = (parts, ptrs, w)
        return w

    def __repr__(self) -> str:
        lead = list(self.kv_num_blocks.shape[:2])
        sched = self.schedule if self.schedule != "permutation" else f"permutation{list(self.schedule_permutation.tolist())}"
        return (f"BlockMask(seq_q={self.seq_q}, seq_kv={self.seq_kv}, block_size=({self.block_q}, {self.block_kv}), "
                f"leading_dims={lead}, spec={self.spec.kind}, schedule={sched}, walk={self.walk}, "
                f"framework={self.framework}, device={self.device})")


def _uint8_blocks(blocks: Any, fw: Framework) -> Any:
    """A block matrix as uint8 in the framework: bool becomes 0 / 2 (skipped / full)."""
    if fw.torch is not None:
        torch = fw.torch
        t = blocks if _is_torch(blocks) else torch.as_tensor(np.asarray(blocks))
        t = t.detach().cpu()
        if t.dtype == torch.bool:
            t = t.to(torch.uint8) * 2
        elif t.dtype != torch.uint8:
            raise ValueError("blocks: expected a uint8 (or bool) block matrix [B, H, Mq, Nk], got "
                             f"{name_of_dtype(t.dtype)}")
        return t
    a = blocks.detach().cpu().numpy() if _is_torch(blocks) else np.asarray(blocks)
    if a.dtype == np.bool_:
        a = a.astype(np.uint8) * 2
    elif a.dtype != np.uint8:
        raise ValueError("blocks: expected a uint8 (or bool) block matrix [B, H, Mq, Nk], got "
                         f"{name_of_dtype(a.dtype)}")
    return a


def _packed_to(torch, tensors: List[Any], dev: Any) -> List[Any]:
    """`tensors` on `dev` through one copy per source device: a mask is a dozen small tensors, and
    each copy between the host and a GPU is a synchronisation (pageable host memory) and a call
    of ~10-40 us. Packed as bytes into one buffer where they are (each at a 256-byte boundary, as
    an allocation of its own would be), the buffer copied, each result a view of the copy; a
    tensor already on `dev` is returned as it is, as Tensor.to does."""
    out: List[Any] = [t if t.device == dev else None for t in tensors]
    by_source: Dict[Any, List[int]] = {}
    for i, t in enumerate(tensors):
        if out[i] is None:
            by_source.setdefault(t.device, []).append(i)
    for source, idx in by_source.items():
        spans, total = [], 0
        for i in idx:
            spans.append(total)
            total += -(-tensors[i].numel() * tensors[i].element_size() // 256) * 256
        if source.type == "cpu":  # numpy's copies: ~1 us each, torch's slice assignments ~10
            host = np.empty(total, dtype=np.uint8)
            for i, start in zip(idx, spans):
                a = tensors[i].detach().contiguous().reshape(-1).view(torch.uint8).numpy()
                host[start:start + a.size] = a
            buf = torch.from_numpy(host)
        else:
            buf = torch.empty(total, dtype=torch.uint8, device=source)
            for i, start in zip(idx, spans):
                t = tensors[i].detach().contiguous().reshape(-1).view(torch.uint8)
                buf[start:start + t.numel()] = t
        buf = buf.to(dev)
        for i, start in zip(idx, spans):
            t = tensors[i]
            out[i] = buf[start:start + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
    return out


# -- torch's flex_attention BlockMask --------------------------------------------------------------

def _from_flex(cls, torch, m: Any, batch: Optional[int], heads: Optional[int], schedule: Any,
               device: Any, auto_problem: Optional[Sequence[int]]) -> BlockMask:
    needed = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices", "BLOCK_SIZE", "seq_lengths",
              "mask_mod")
    if not all(hasattr(m, a) for a in needed):
        raise ValueError("block_mask: expected a torch.nn.attention.flex_attention.BlockMask, got "
                         f"{type(m).__module__}.{type(m).__qualname__}")
    bs = m.BLOCK_SIZE
    bq, bkv = (int(bs), int(bs)) if isinstance(bs, int) else (int(bs[0]), int(bs[1]))
    sq, skv = (int(s) for s in m.seq_lengths)
    mq = -(-sq // bq)
    names = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices")
    flex = [getattr(m, n) for n in names]  # None for absent full lists (one of the pair alone: refused in C++)
    for j, t in enumerate(flex):  # the rows here (leading dims may be missing), the rest in block_matrix_from_flex
        dim = 3 if j % 2 == 0 else 4  # counts [B, H, Mq], ids [B, H, Mq, W]
        if t is None:
            continue
        if not dim - 2 <= t.dim() <= dim or t.shape[t.dim() - dim + 2] != mq:
            raise ValueError(f"block_mask.{names[j]}: expected [B, H, Mq={mq}{', W' if dim == 4 else ''}] "
                             f"(Mq = ceil(seq_lengths[0] / BLOCK_SIZE[0])), got {list(t.shape)}")
        flex[j] = t.reshape((1,) * (dim - t.dim()) + tuple(t.shape))
    given = [t for t in flex if t is not None]
    B, H = max(t.shape[0] for t in given), max(t.shape[1] for t in given)
    for arg, want, have in (("batch", batch, B), ("heads", heads, H)):
        if want is not None and (int(want) < 1 or (have != 1 and have != int(want))):
            raise ValueError(f"{arg}: expected a size the block mask's leading dim {have} broadcasts to, got {want}")
    B, H = (B if batch is None else int(batch)), (H if heads is None else int(heads))
    # The lists are read on the host: one concatenation and one copy (a copy to the host waits for the GPU).
    parts = iter(torch.cat([t.detach().reshape(-1) for t in given]).cpu().split([t.numel() for t in given]))
    host = [None if t is None else next(parts).view(t.shape) for t in flex]
    target = m.kv_indices.device if device is None else _device_arg(device, "torch")
    target = torch.device("cpu") if target is None else target
    fw = Framework(torch)
    sched, problem, lib = _schedule_arg(schedule), _problem_arg(auto_problem), _torch_library()
    if lib is not None:  # built on the host and moved with the partial blocks' places in one copy, in C++
        permutation = isinstance(sched, list)
        d = lib.build_block_mask_from_flex(*host, B, H, sq, skv, bq, bkv, "" if permutation else sched,
                                           sched if permutation else [], "", problem or [],
                                           -1 if target.type == "cpu" else target.index)
        mask = cls._from_core(d, fw, MaskSpec("bitmask"), view=lambda t: t)
        width, places = d["partial_width"], d["partial_blocks"]
    else:  # the same functions through `_C` (a wheel without the torch library)
        blocks = fw.view(_C.block_matrix_from_flex(*map(to_core, host), B, H, -(-skv // bkv), fw.allocate))
        d = _C.build_block_mask_from_blocks(to_core(blocks), sq, skv, bq, bkv, sched, fw.allocate, problem=problem)
        mask = cls._from_core(d, fw, MaskSpec("bitmask")).to(target)
        width, places = _C.partial_block_places(to_core(blocks), bq, bkv, fw.allocate)
        places = fw.view(places)
    mask.partial_bitmasks = _evaluate_bitmasks(torch, m.mask_mod, width, places, (B, H, mq), bq, bkv, sq,
                                               skv, m.kv_indices.device, target)
    return mask


@functools.lru_cache(maxsize=16)
def _block_offsets(torch, device: Any, bq: int, bkv: int) -> Tuple[Any, Any, Any]:
    """(arange(bq), arange(bkv), the 8 bit weights) on `device`: made once, not three launches a call."""
    return (torch.arange(bq, device=device), torch.arange(bkv, device=device),
            (1 << torch.arange(8, device=device)).to(torch.uint8))


def _evaluate_bitmasks(torch, mask_mod, width: int, blocks: Any, leading: Tuple[int, int, int], bq: int, bkv: int,
                       sq: int, skv: int, device, out_device) -> Any:
    """uint8 [B, H, Mq, width, ceil(bq * bkv / 8)] on `out_device`, the partial blocks `blocks`
    (partial_block_places) at their rows: bit i * bkv + j (LSB first) = mask_mod at row i, column
    j of the block; positions past the sequences are 0; other rows 0. mask_mod runs on `device`
    (where its captured tensors live), over as many blocks a step as a bounded number of
    elements allows."""
    nbytes = (bq * bkv + 7) // 8
    out = torch.zeros(*leading, width, nbytes, dtype=torch.uint8, device=out_device)
    if blocks.shape[1] == 0:
        return out
    blocks = blocks.to(device)
    rq, rk, weights = _block_offsets(torch, device, bq, bkv)
    elementwise = _mask_mod.is_elementwise(torch, mask_mod, device)
    pad = nbytes * 8 - bq * bkv
    ragged = sq % bq != 0 or skv % bkv != 0  # positions past the sequences to clear
    # Elements evaluated a step: mask_mod's temporaries are [blocks, bq, bkv] (int64 ones included).
    # 2^25 on a GPU: each step's launches cost host time (~0.3 ms), and a few thousand blocks is one step.
    chunk = max(1, (1 << (25 if torch.device(device).type == "cuda" else 22)) // (bq * bkv))
    rows = out.view(-1, nbytes)
    for s in range(0, blocks.shape[1], chunk):
        slot, b, h, q0, kv0 = blocks[:, s:s + chunk]
        q, kv = q0[:, None] + rq, kv0[:, None] + rk
        if ragged:
            q, kv = q.clamp(max=sq - 1), kv.clamp(max=skv - 1)
        allowed = _mask_mod.evaluate(torch, mask_mod, b, h, q, kv, elementwise)
        if ragged:
            allowed = allowed & (q0[:, None] + rq < sq)[:, :, None] & (kv0[:, None] + rk < skv)[:, None, :]
        flat = allowed.reshape(allowed.shape[0], -1).contiguous().view(torch.uint8)
        if pad:
            flat = torch.nn.functional.pad(flat, (0, pad))
        packed = (flat.view(-1, nbytes, 8) * weights).sum(-1, dtype=torch.uint8)
        rows.index_copy_(0, slot.to(out_device), packed.to(out_device))
    return out


# -- attention over arrays --------------------------------------------------------------------------

def scale_arg(scale: Optional[float]) -> float:
    if scale is None:
        return 0.0  # the core's default: 1 / sqrt(D)
    s = float(scale)
    # Negative scales are refused by the core on every backend (the CUDA kernels' softmax assumes
    # scale > 0).
    if not s > 0.0 or not math.isfinite(s):
        raise ValueError(f"scale: expected a finite positive number or None (1 / sqrt(D)), got {scale}")
    return s


def sm_limit_arg(sm_limit: Any) -> int:
    """AttentionOptions::sm_limit: a cap on the SMs the CUDA kernels' persistent CTAs use (0:
    every SM); results never depend on it."""
    try:
        n = None if isinstance(sm_limit, bool) else operator.index(sm_limit)
    except TypeError:
        n = None
    if n is None or not 0 <= n <= 2**31 - 1:
        raise ValueError(f"sm_limit: expected an int >= 0 (0: every SM), got {sm_limit!r}")
    return n


def check_mask(block_mask: Any) -> BlockMask:
    if isinstance(block_mask, BlockMask):
        return block_mask
    if type(block_mask).__name__ == "BlockMask" and hasattr(block_mask, "mask_mod"):
        raise ValueError("block_mask: expected a sparsetrain.BlockMask, got torch's flex_attention BlockMask "
                         "(convert it once with sparsetrain.BlockMask.from_torch(block_mask))")
    raise ValueError(f"block_mask: expected a sparsetrain.BlockMask, got {type(block_mask).__name__}")


def block_sparse_attention_forward(q: Any, k: Any, v: Any, block_mask: BlockMask, *, scale: Optional[float] = None,
                                   deterministic: bool = True, stream: Optional[int] = None,
                                   sm_limit: int = 0) -> Tuple[Any, Any]:
    """attention.h's forward over arrays (numpy, torch CPU or CUDA tensors; the mask on their
    device): q [B, Sq, Hq, D], k and v [B, Skv, Hkv, D] (any strides, last dim contiguous; fp32,
    bf16 or fp16; on CUDA bf16 / fp16 with 16-byte aligned strides). Returns (o
    [B, Sq, Hq, D] in q's dtype, lse fp32 [B, Hq, Sq]); a row with no allowed key gives o = 0 and
    lse = -inf. sm_limit: on CUDA, at most this many SMs' worth of persistent CTAs (0: every SM;
    e.g. to leave SMs to communication kernels); results never depend on it."""
    fw = Framework.of(q)
    mask = check_mask(block_mask)._for(fw)
    o, lse = _C.attention_forward(to_core(q), to_core(k), to_core(v), mask._core_mask(),
                                  scale_arg(scale), bool(deterministic), sm_limit_arg(sm_limit),
                                  fw.stream_of(q) if stream is None else int(stream), fw.allocate)
    return fw.view(o), fw.view(lse)


def block_sparse_attention_backward(q: Any, k: Any, v: Any, o: Any, lse: Any, dout: Any, block_mask: BlockMask, *,
                                    scale: Optional[float] = None, deterministic: bool = True,
                                    stream: Optional[int] = None, sm_limit: int = 0) -> Tuple[Any, Any, Any]:
    """attention.h's backward: (dq [B, Sq, Hq, D], dk, dv [B, Skv, Hkv, D]) from the forward's o and
    lse and the output gradient dout [B, Sq, Hq, D]. The mask needs its transposes (every builder
    makes them). deterministic: dq, dk, dv bitwise the same from run to run and for any grid size
    or sm_limit (False: atomic dQ adds, the speed reference). sm_limit: as for the forward."""
    fw = Framework.of(q)
    mask = check_mask(block_mask)._for(fw)
    dq, dk, dv = _C.attention_backward(to_core(q), to_core(k), to_core(v), to_core(o),
                                       to_core(lse), to_core(dout), mask._core_mask(),
                                       scale_arg(scale), bool(deterministic), sm_limit_arg(sm_limit),
                                       fw.stream_of(q) if stream is None else int(stream), fw.allocate)
    return fw.view(dq), fw.view(dk), fw.view(dv)

"""sparsetrain.torch.block_sparse_attention: block-sparse attention in FlexAttention's layout over a
sparsetrain.BlockMask, with autograd: the C++ torch library's operators
sparsetrain::block_sparse_attention and _backward (autograd in C++), eager and under
torch.compile alike, and their fake implementations."""

from __future__ import annotations

import operator
from typing import Any, Optional, Tuple

import torch
from torch import Tensor

from .._arrays import name_of_dtype as _name_of_dtype
from .._block_mask import WIRE_PARTS, WIRE_PERMUTATION, wire
from .._block_mask import BlockMask
from .._block_mask import check_mask, scale_arg, sm_limit_arg

from . import native  # loads the C++ torch library, which defines the operators

# --- block-sparse attention -------------------------------------------------------------------
# FlexAttention's layout [B, H, S, D] outside and at the operators; the core takes [B, S, H, D],
# so their kernels view q, k and v transposed (no copies) and return [B, H, S, D] views of the
# core's [B, S, H, D] outputs. A BlockMask crosses the op boundary as its wire
# (sparsetrain._block_mask.wire: flat tensors, sizes and kind names), so that the compiler sees
# every tensor the op reads.


class _MaskArgs:
    """One BlockMask's arguments to the attention op (its wire) and the devices of its tensors
    (the permutation, a host array, aside). Built once per mask (_mask_args_of)."""

    __slots__ = ("tensors", "sizes", "kinds", "devices")

    def __init__(self, mask: BlockMask):
        self.tensors, self.sizes, self.kinds = wire(mask)
        while self.tensors[-1] is None:  # the op takes absent tensors at the end as left off: fewer to convert
            self.tensors.pop()
        on_device = [t for i, t in enumerate(self.tensors) if t is not None and i != WIRE_PERMUTATION]
        self.devices = tuple({t.device for t in on_device})


def _mask_args_of(mask: BlockMask) -> _MaskArgs:
    """mask's _MaskArgs, cached on it while it holds the same tensor objects, sizes and kinds
    (building them costs ~3 us a call; a tensor moved in place keeps its object, and the op reads
    its address anew each call). Under torch.compile they are built for each trace."""
    if torch.compiler.is_compiling():
        return _MaskArgs(mask)
    parts = WIRE_PARTS(mask)
    cached = mask._torch_cache
    if cached is not None and all(map(operator.is_, cached[0], parts)):
        return cached[1]
    args = _MaskArgs(mask)
    mask._torch_cache = (parts, args)
    return args


def _bshd(t: Tensor) -> Tensor:
    return t.transpose(1, 2)


# The operator (python/src/torch_ops.cpp; autograd in C++), its OpOverload bound once: a call
# through it skips the packet's overload resolution.
_ATTENTION = torch.ops.sparsetrain.block_sparse_attention.default


# Shapes only, for FakeTensorMode, meta tensors and torch.compile: Python rather than C++ Meta
# kernels, so that symbolic shapes (dynamic=True) pass through as they are. The outputs' strides
# are the real kernels': o and the gradients [B, H, S, D] views of [B, S, H, D] tensors.
@torch.library.register_fake("sparsetrain::block_sparse_attention")
def _(q, k, v, mask_tensors, mask_sizes, mask_kinds, scale, deterministic, sm_limit):
    B, H, S, D = q.shape
    return _bshd(q.new_empty((B, S, H, D))), q.new_empty((B, H, S), dtype=torch.float32)


@torch.library.register_fake("sparsetrain::block_sparse_attention_backward")
def _(q, k, v, o, lse, dout, mask_tensors, mask_sizes, mask_kinds, scale, deterministic, sm_limit):
    def like(t):
        B, H, S, D = t.shape
        return _bshd(t.new_empty((B, S, H, D)))

    return like(q), like(k), like(v)


_ATTENTION_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _check_attention_inputs(q: Any, k: Any, v: Any, mask: BlockMask, mask_devices: Tuple[torch.device, ...]) -> None:
    """The [B, H, S, D] contract in the caller's terms (the core would name [B, S, H, D] dims);
    the rules of the CUDA kernels (dtypes, head dims, alignment) are the core's to check.
    mask_devices: those of the mask's tensors (_MaskArgs.devices)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor):
            raise ValueError(f"{name}: expected a torch.Tensor [B, H, S, D], got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name}: expected a 4-d tensor [B, H, S, D], got shape {list(t.shape)}")
    device = q.device
    if device.type not in ("cpu", "cuda"):
        raise NotImplementedError(f"block_sparse_attention: q is on {device}; expected CPU or CUDA tensors")
    for name, t in (("k", k), ("v", v)):
        if t.device != device:
            raise ValueError(f"{name}: expected a tensor on {device} (q's device), got {t.device}")
    if mask_devices != (device,):
        for name, t in mask.tensors().items():
            if t is not None and t.device != device:
                where = "spec." + name if name.startswith("doc_") else name
                raise ValueError(f"block_mask.{where}: expected a tensor on {device} (q's device), got {t.device} "
                                 "(move the mask once with block_mask.to(q.device), or build it there with "
                                 "BlockMask.build(..., device=q.device))")
    dtype = q.dtype
    if dtype not in _ATTENTION_DTYPES:
        raise ValueError(f"q: expected dtype fp32, bf16 or fp16, got {_name_of_dtype(dtype)}")
    for name, t in (("k", k), ("v", v)):
        if t.dtype != dtype:
            raise ValueError(f"{name}: expected dtype {_name_of_dtype(dtype)} (q's dtype), "
                             f"got {_name_of_dtype(t.dtype)}")
    B, Hq, Sq, D = q.shape
    ks = k.shape
    seqs = (mask.seq_q, mask.seq_kv)
    if seqs != (Sq, ks[2]) and seqs == (q.shape[1], ks[1]):  # before the head checks, which it would trip
        raise ValueError(f"q: expected FlexAttention's layout [B, H, S, D], got shape {list(q.shape)}, whose dim 1 "
                         f"holds the block mask's seq length {mask.seq_q} (k's dim 1 its {mask.seq_kv}): [B, S, H, D] "
                         "tensors? pass q.transpose(1, 2), k.transpose(1, 2) and v.transpose(1, 2) (views, no copies)")
    if ks[0] != B or ks[3] != D:
        raise ValueError(f"k: expected shape [{B} (q's B), Hkv, Skv, {D} (q's D)], got {list(ks)}")
    if ks[1] < 1 or Hq % ks[1] != 0:
        raise ValueError(f"k: expected a head count Hkv that divides q's Hq = {Hq} (GQA / MQA), got {ks[1]}")
    if v.shape != ks:
        raise ValueError(f"v: expected shape {list(ks)} (k's shape), got {list(v.shape)}")
    if mask.seq_q != Sq or mask.seq_kv != ks[2]:
        raise ValueError(f"block_mask: expected seq lengths ({Sq}, {k.shape[2]}) (q's and k's S), got "
                         f"({mask.seq_q}, {mask.seq_kv})")


def _deterministic_arg(deterministic: Optional[bool]) -> bool:
    """The backward's mode: True unless set; always True under
    torch.use_deterministic_algorithms(True). Resolved here, outside the operator: under
    torch.compile the mode is a constant of the trace (dynamo guards on it)."""
    if torch.are_deterministic_algorithms_enabled():
        return True
    return True if deterministic is None else bool(deterministic)


def block_sparse_attention(q: Tensor, k: Tensor, v: Tensor, block_mask: BlockMask, scale: Optional[float] = None,
                           deterministic: Optional[bool] = None, return_lse: bool = False, *, sm_limit: int = 0):
    """Block-sparse attention in FlexAttention's layout: q [B, Hq, Sq, D], k and v [B, Hkv, Skv, D]
    (Hq a multiple of Hkv: GQA / MQA; fp32, bf16 or fp16; any strides with the last dim
    contiguous), block_mask a sparsetrain.BlockMask (convert flex's once with
    BlockMask.from_torch). scale: default 1 / sqrt(D). Returns o [B, Hq, Sq, D] (and the fp32
    natural-log log-sum-exp [B, Hq, Sq] with return_lse=True; it has no gradient). A query row
    with no allowed key gives o = 0, lse = -inf and zero gradients. Autograd through q, k and v.
    CPU or CUDA tensors; the mask's tensors must be on q's device (`block_mask.to(q.device)`, or
    `BlockMask.build(..., device=...)`). On CUDA: bf16 / fp16, D 64, 96 or 128, mask blocks
    multiples of 128, forward and backward.

    deterministic: the backward's dQ reduction order. None (the default) means True. True: dq, dk
    and dv are bitwise reproducible from run to run, and independent of the grid size (the GPU's
    SM count, sm_limit); False: atomic dQ adds (faster, not reproducible). The CPU reference is
    deterministic either way. Under torch.use_deterministic_algorithms(True) the backward is
    deterministic whatever `deterministic` says (deterministic=False is overridden, as torch's own
    ops do; the mode is read at the forward and again when the backward runs).

    sm_limit: on CUDA, at most this many SMs' worth of persistent CTAs (0: every SM), e.g. to
    leave SMs to communication kernels running beside it; results never depend on it."""
    mask = check_mask(block_mask).to_torch()
    args = _mask_args_of(mask)
    _check_attention_inputs(q, k, v, mask, args.devices)
    scale, deterministic, sm_limit = scale_arg(scale), _deterministic_arg(deterministic), sm_limit_arg(sm_limit)
    # Eager on plain tensors, the operator through its C++ entry (no torch.ops argument conversion:
    # the same dispatcher call); elsewhere through torch.ops, which torch.compile and modes see.
    op = native.TORCH_OPS.attention if native.direct(q, k, v) else _ATTENTION
    o, lse = op(q, k, v, args.tensors, args.sizes, args.kinds, scale, deterministic, sm_limit)
    return (o, lse) if return_lse else o

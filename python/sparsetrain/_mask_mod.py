"""A flex mask_mod evaluated over the elements of many blocks at once (BlockMask.from_torch).

FlexAttention calls mask_mod(b, h, q, kv) on 0-d index tensors, vectorised with torch.vmap, one level
per index: that is what a mask_mod means. vmap costs host time for every operation at every level
(measured on an H200's host: 0.16-0.21 ms a call of two to seven comparisons, over half of it), so
where a mask_mod is shown to be elementwise in its indices, the same values come from one plain
call on broadcast index tensors (b, h [P, 1, 1], q [P, bq, 1], kv [P, 1, bkv]).

Shown by one call on 0-d indices under a dispatch mode and a function mode that watch every
operation on a value derived from an index: each must be a pointwise aten operation (or an
elementwise one without the tag), not in place, or an index into a tensor that does not derive from
an index; its results 0-d; its other tensor operands 0-d and of an index-derived operand's dtype
(then type promotion gives the same dtype with broadcast operands); and no index-derived tensor's
shape may be read. Anything else (a reduction, a shape query, Python control flow on a value, a
constant of another dtype) keeps vmap. The verdict is kept per mask_mod object (weakly): a
mask_mod whose code path changes between calls of one object is not supported."""

from __future__ import annotations

import contextlib
import weakref
from typing import Any, Callable, Dict

_VERDICTS: "weakref.WeakKeyDictionary[Any, bool]" = weakref.WeakKeyDictionary()


def _index_context() -> Any:
    """flex's create_mask evaluates under this: tensor[idx] with a tensor idx becomes aten.index."""
    try:
        from torch._dynamo._trace_wrapped_higher_order_op import TransformGetItemToIndex  # noqa: PLC0415
        return TransformGetItemToIndex()
    except ImportError:  # pragma: no cover - older torch
        return contextlib.nullcontext()


def _vmap_blocks(torch, mask_mod: Callable) -> Callable:
    """mask_mod over b [P], h [P], q [P, bq], kv [P, bkv] -> [P, bq, bkv]: one vmap level per index
    as in flex's create_mask, the outer one over the blocks."""
    fn = torch.vmap(mask_mod, in_dims=(None, None, None, 0))
    fn = torch.vmap(fn, in_dims=(None, None, 0, None))
    return torch.vmap(fn, in_dims=(0, 0, 0, 0))


def is_elementwise(torch, mask_mod: Callable, device: Any) -> bool:
    """Whether mask_mod is shown elementwise in its indices (the module docstring's rules), by one
    call on 0-d int64 indices on `device`; kept per mask_mod object."""
    try:
        return _VERDICTS[mask_mod]
    except (KeyError, TypeError):  # not seen, or not weakly referable
        pass
    verdict = _watch(torch, mask_mod, device)
    with contextlib.suppress(TypeError):
        _VERDICTS[mask_mod] = verdict
    return verdict


def _watch(torch, mask_mod: Callable, device: Any) -> bool:
    from torch.overrides import TorchFunctionMode  # noqa: PLC0415
    from torch.utils._python_dispatch import TorchDispatchMode  # noqa: PLC0415
    from torch.utils._pytree import tree_leaves  # noqa: PLC0415

    aten = torch.ops.aten
    untagged = (aten.floor_divide.default, aten.floor_divide.Scalar, aten._to_copy.default, aten.detach.default,
                aten.alias.default)
    shape_queries = (torch.Tensor.shape.__get__, torch.Tensor.ndim.__get__, torch.Tensor.dim, torch.Tensor.size,
                     torch.Tensor.numel, torch.Tensor.nelement, torch.Tensor.ndimension, torch.Tensor.__len__,
                     torch.Tensor.stride)
    derived: Dict[int, Any] = {}  # id -> tensor (held, so that ids are not reused while watching)
    ok = [True]

    def is_derived(x: Any) -> bool:
        return isinstance(x, torch.Tensor) and derived.get(id(x)) is x

    class Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            out = func(*args, **kwargs)
            operands = [x for x in tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)]
            if not any(map(is_derived, operands)):
                return out
            results = tree_leaves(out)
            if func is aten.index.Tensor:
                allowed = not is_derived(args[0]) and all(x is None or x.dim() == 0 for x in args[1])
            else:
                dtypes = {x.dtype for x in operands if is_derived(x)}
                allowed = ((torch.Tag.pointwise in func.tags or func in untagged) and not func._schema.is_mutable
                           and all(x.dim() == 0 and x.dtype in dtypes for x in operands if not is_derived(x)))
            if not (allowed and all(isinstance(r, torch.Tensor) and r.dim() == 0 for r in results)):
                ok[0] = False
            for r in results:
                if isinstance(r, torch.Tensor):
                    derived[id(r)] = r
            return out

    class Shapes(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            if func in shape_queries and any(map(is_derived, args)):
                ok[0] = False
            return func(*args, **(kwargs or {}))

    idx = [torch.zeros((), dtype=torch.int64, device=device) for _ in range(4)]
    derived.update((id(t), t) for t in idx)
    try:
        with Shapes(), Ops(), _index_context():
            result = mask_mod(*idx)
    except Exception:  # noqa: BLE001  (whatever fails on 0-d indices is left to vmap, which reports it)
        return False
    return ok[0] and isinstance(result, torch.Tensor) and result.dim() == 0


def evaluate(torch, mask_mod: Callable, b: Any, h: Any, q: Any, kv: Any, elementwise: bool) -> Any:
    """mask_mod at every element of P blocks: b, h [P], q [P, bq], kv [P, bkv] (int64) -> bool
    [P, bq, bkv]; by broadcasting where `elementwise` (is_elementwise), else through vmap."""
    with _index_context():
        if elementwise:
            allowed = mask_mod(b[:, None, None], h[:, None, None], q[:, :, None], kv[:, None, :])
            return allowed.to(torch.bool).expand(q.shape[0], q.shape[1], kv.shape[1])
        return _vmap_blocks(torch, mask_mod)(b, h, q, kv).to(torch.bool)

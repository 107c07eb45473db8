"""The PyTorch front: `GroupedLinear(torch.nn.Module)` with TransformerEngine's options and
semantics (main_grad accumulation, delayed wgrad with backward_dw, caller out / grad_input
buffers, device splits), on top of `torch.library` custom ops with fake implementations so that
models compile with torch.compile(fullgraph=True).

Memory: every tensor the library allocates comes from torch's caching allocator on the current
stream (torch.empty through the allocator callback) and is handed back as a view of that tensor.
What backward returns for a weight follows the one rule in C++ (`weight_grad_disposition`).
"""

from __future__ import annotations

import itertools
import math
import weakref
from typing import Any, Callable, List, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor, nn

from . import GroupedLinear as _CoreGroupedLinear
from . import weight_grad_disposition as _weight_grad_disposition
from ._arrays import DeviceSplits

__all__ = ["GroupedLinear"]

_ALIGN = 256
_LAYERS: "dict[int, weakref.ReferenceType[GroupedLinear]]" = {}
_NEXT_ID = itertools.count()


def _layer(layer_id: int) -> "GroupedLinear":
    module = _LAYERS[layer_id]()
    if module is None:
        raise RuntimeError(f"sparsetrain GroupedLinear {layer_id} no longer exists")
    return module


def _splits_arg(splits: Tensor) -> Any:
    # CUDA splits stay on the device (capturable); CPU splits are host splits, validated at once.
    return DeviceSplits(splits) if splits.is_cuda else splits


def _packed_wgrad_stride(out_features: int, in_features: int, dtype: torch.dtype) -> int:
    """Per-group stride (elements) of the packed wgrad buffer: each group on a 256-byte boundary."""
    size = dtype.itemsize
    return -(-out_features * in_features * size // _ALIGN) * _ALIGN // size


# --- custom ops -----------------------------------------------------------------------------
# The layer's state (its C++ core, pending delayed wgrads, main_grad) is found through layer_id at
# run time; `params` are passed so that the compiler orders the ops after parameter updates.
# Two ops per direction: a functional one, and one that writes a caller buffer (`out`,
# `grad_input`), so that neither has an optional mutated argument (Inductor lowers those poorly).


@torch.library.custom_op("sparsetrain::grouped_linear_forward", mutates_args=())
def _forward_op(layer_id: int, x: Tensor, splits: Tensor, params: List[Tensor]) -> Tensor:
    return _layer(layer_id)._core().forward(x, _splits_arg(splits))


@_forward_op.register_fake
def _(layer_id, x, splits, params):
    return x.new_empty((x.shape[0], params[0].shape[-2]))


@torch.library.custom_op("sparsetrain::grouped_linear_forward_into", mutates_args=("out",))
def _forward_into_op(layer_id: int, x: Tensor, splits: Tensor, params: List[Tensor], out: Tensor) -> None:
    _layer(layer_id)._core().forward(x, _splits_arg(splits), out)


@_forward_into_op.register_fake
def _(layer_id, x, splits, params, out):
    return None


def _backward_impl(layer_id, x, dy, splits, grad_input):
    """(dx, packed weight grad or dummy, bias grad [G, out]); an empty tensor stands for none."""
    g = _layer(layer_id)._core().backward(x, dy, _splits_arg(splits), grad_input)
    if g.weight_kind == "none":
        dw = x.new_empty(0)
    elif g.weight_grad_packed is not None:
        dw = g.weight_grad_packed
    else:  # the dummy of per-expert weights: one [out, in] zero tensor
        dw = g.weight_grads[0]
    return g.grad_input, dw, x.new_empty(0) if g.bias_grad is None else g.bias_grad


def _backward_fake(layer_id, x):
    m = _layer(layer_id)
    kind, bias_now = m._disposition()
    G, out_f, in_f = m.num_gemms, m.out_features, m.in_features
    if kind == "none":
        dw = x.new_empty(0)
    elif kind == "wgrad":
        dw = x.new_empty_strided((G, out_f, in_f), (_packed_wgrad_stride(out_f, in_f, x.dtype), in_f, 1))
    else:
        dw = x.new_empty((G, out_f, in_f) if m.single_grouped_weight else (out_f, in_f))
    db = x.new_empty((G, out_f)) if (m.use_bias and bias_now) else x.new_empty(0)
    return dw, db


@torch.library.custom_op("sparsetrain::grouped_linear_backward", mutates_args=())
def _backward_op(layer_id: int, x: Tensor, dy: Tensor, splits: Tensor,
                 params: List[Tensor]) -> Tuple[Tensor, Tensor, Tensor]:
    return _backward_impl(layer_id, x, dy, splits, None)


@_backward_op.register_fake
def _(layer_id, x, dy, splits, params):
    return (x.new_empty(x.shape), *_backward_fake(layer_id, x))


@torch.library.custom_op("sparsetrain::grouped_linear_backward_into", mutates_args=("grad_input",))
def _backward_into_op(layer_id: int, x: Tensor, dy: Tensor, splits: Tensor, params: List[Tensor],
                      grad_input: Tensor) -> Tuple[Tensor, Tensor]:
    return _backward_impl(layer_id, x, dy, splits, grad_input)[1:]


@_backward_into_op.register_fake
def _(layer_id, x, dy, splits, params, grad_input):
    return _backward_fake(layer_id, x)


class _GroupedLinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, layer_id: int, disposition: Tuple[str, bool], packed: bool, x: Tensor, splits: Tensor,
                out: Optional[Tensor], grad_input: Optional[Tensor], num_weights: int, *params: Tensor):
        if out is None:
            y = torch.ops.sparsetrain.grouped_linear_forward(layer_id, x, splits, list(params))
        else:
            torch.ops.sparsetrain.grouped_linear_forward_into(layer_id, x, splits, list(params), out)
            ctx.mark_dirty(out)
            y = out
        ctx.save_for_backward(x, splits, *params)
        ctx.layer_id, ctx.disposition, ctx.packed = layer_id, disposition, packed
        ctx.grad_input, ctx.num_weights = grad_input, num_weights
        return y

    @staticmethod
    def backward(ctx, dy: Tensor):
        x, splits, *params = ctx.saved_tensors
        dy = dy[:x.shape[0]]  # a caller `out` buffer may have more rows than x
        if dy.stride(-1) != 1:
            dy = dy.contiguous()
        if ctx.grad_input is None:
            dx, dw, db = torch.ops.sparsetrain.grouped_linear_backward(ctx.layer_id, x, dy, splits, params)
        else:
            dw, db = torch.ops.sparsetrain.grouped_linear_backward_into(
                ctx.layer_id, x, dy, splits, params, ctx.grad_input)
            dx = ctx.grad_input[:x.shape[0]]
        kind, bias_now = ctx.disposition
        weights, biases = params[:ctx.num_weights], params[ctx.num_weights:]
        if kind == "none":
            w_grads: Sequence[Optional[Tensor]] = [None] * len(weights)
        elif kind == "wgrad":
            w_grads = [dw] if ctx.packed else list(dw.unbind(0))
        else:  # dummy: a cached zero tensor; Megatron reads the flag and skips its own accumulation
            w_grads = [dw] * len(weights)
            for w in weights:
                w.grad_added_to_main_grad = True
        if biases and bias_now:
            b_grads: Sequence[Optional[Tensor]] = [db] if ctx.packed else list(db.unbind(0))
        else:
            b_grads = [None] * len(biases)
        return (None, None, None, dx, None, None, None, None, *w_grads, *b_grads)


@torch.compiler.assume_constant_result
def _disposition_constant(delay: bool, fuse: bool, has_attr: bool) -> Tuple[str, bool]:
    return tuple(_weight_grad_disposition(delay, fuse, has_attr))


# --- the module -----------------------------------------------------------------------------


class GroupedLinear(nn.Module):
    """num_gemms linear layers (experts) applied to the row groups of one input.

    Options as in TransformerEngine's GroupedLinear. Parameters: weight0..weight{G-1} [out, in]
    (and bias0..) or, with single_grouped_weight, one weight [G, out, in] (and bias [G, out]).
    With fuse_wgrad_accumulation the weight grads go into each weight's fp32 `main_grad`
    (overwritten instead when the weight has `overwrite_main_grad = True`); what autograd then
    sees is None, or a cached zero "dummy" when the weight has Megatron's
    `grad_added_to_main_grad` attribute (set to True). With delay_wgrad_compute, backward computes
    dgrad only; `backward_dw()` computes the oldest pending wgrad and then runs the hooks given to
    `register_wgrad_accumulation_and_reduce_hooks`.
    """

    def __init__(self, num_gemms: int, in_features: int, out_features: int, bias: bool = True, *,
                 params_dtype: Optional[torch.dtype] = None, device: Union[torch.device, str, None] = None,
                 single_grouped_weight: bool = False, fuse_wgrad_accumulation: bool = False,
                 delay_wgrad_compute: bool = False, check_device_splits: bool = False):
        super().__init__()
        if num_gemms < 1:
            raise ValueError(f"num_gemms: expected >= 1, got {num_gemms}")
        self.num_gemms, self.in_features, self.out_features = num_gemms, in_features, out_features
        self.use_bias = bias
        self.single_grouped_weight = single_grouped_weight
        self.fuse_wgrad_accumulation = fuse_wgrad_accumulation
        self.delay_wgrad_compute = delay_wgrad_compute
        self.check_device_splits = check_device_splits
        dtype = params_dtype or torch.get_default_dtype()
        kw = dict(dtype=dtype, device=device)
        bound = 1.0 / math.sqrt(in_features)  # nn.Linear's default init, per expert
        if single_grouped_weight:
            self.weight = nn.Parameter(torch.empty(num_gemms, out_features, in_features, **kw).uniform_(-bound, bound))
            if bias:
                self.bias = nn.Parameter(torch.empty(num_gemms, out_features, **kw).uniform_(-bound, bound))
        else:
            for i in range(num_gemms):
                self.register_parameter(f"weight{i}", nn.Parameter(
                    torch.empty(out_features, in_features, **kw).uniform_(-bound, bound)))
                if bias:
                    self.register_parameter(f"bias{i}", nn.Parameter(
                        torch.empty(out_features, **kw).uniform_(-bound, bound)))
        self._hooks: List[Callable[[], None]] = []
        self._core_layer: Optional[_CoreGroupedLinear] = None
        self._core_key: Any = None
        self._id = next(_NEXT_ID)
        _LAYERS[self._id] = weakref.ref(self)
        weakref.finalize(self, _LAYERS.pop, self._id, None)

    # -- parameters ------------------------------------------------------------------------
    def weights(self) -> List[Tensor]:
        if self.single_grouped_weight:
            return [self.weight]
        return [getattr(self, f"weight{i}") for i in range(self.num_gemms)]

    def biases(self) -> List[Tensor]:
        if not self.use_bias:
            return []
        if self.single_grouped_weight:
            return [self.bias]
        return [getattr(self, f"bias{i}") for i in range(self.num_gemms)]

    def _names(self) -> List[str]:
        return ["weight"] if self.single_grouped_weight else [f"weight{i}" for i in range(self.num_gemms)]

    def _has_grad_added_attr(self) -> bool:
        return all(hasattr(w, "grad_added_to_main_grad") for w in self.weights())

    def _disposition(self) -> Tuple[str, bool]:
        return tuple(_weight_grad_disposition(self.delay_wgrad_compute, self.fuse_wgrad_accumulation,
                                              self._has_grad_added_attr()))

    def _main_grads(self) -> Optional[List[Tensor]]:
        if not self.fuse_wgrad_accumulation:
            return None
        grads = []
        for name, w in zip(self._names(), self.weights()):
            mg = getattr(w, "main_grad", None)
            if mg is None:
                raise ValueError(f"{name}.main_grad: expected an fp32 tensor of shape {list(w.shape)} "
                                 "(fuse_wgrad_accumulation=True), got none")
            grads.append(mg)
        return grads

    def _core(self) -> _CoreGroupedLinear:
        """The C++ layer over the current parameters, rebuilt when they (or main_grad) move."""
        weights, biases, main_grads = self.weights(), self.biases(), self._main_grads()
        overwrite = bool(self.fuse_wgrad_accumulation and getattr(weights[0], "overwrite_main_grad", False))
        has_attr = self._has_grad_added_attr()
        key = tuple((t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.dtype, t.device)
                    for t in [*weights, *biases, *(main_grads or [])]) + (overwrite, has_attr)
        if key != self._core_key:
            if self._core_layer is not None and self._core_layer.pending_wgrads:
                raise RuntimeError("GroupedLinear: parameters or main_grad changed while "
                                   f"{self._core_layer.pending_wgrads} delayed wgrad(s) are pending; "
                                   "call backward_dw() first")

            def packed_or_list(ts):
                if ts is None or not ts:
                    return None
                return ts[0] if self.single_grouped_weight else list(ts)

            self._core_layer = _CoreGroupedLinear(
                packed_or_list(weights), packed_or_list(biases), packed_or_list(main_grads),
                fuse_wgrad_accumulation=self.fuse_wgrad_accumulation, overwrite_main_grad=overwrite,
                delay_wgrad_compute=self.delay_wgrad_compute, has_grad_added_to_main_grad=has_attr,
                check_device_splits=self.check_device_splits)
            self._core_key = key
        return self._core_layer

    # -- forward / backward_dw -------------------------------------------------------------
    def _normalize_splits(self, m_splits: Any) -> Tensor:
        if isinstance(m_splits, Tensor):
            splits = m_splits if m_splits.dtype == torch.int64 else m_splits.to(torch.int64)
        else:
            splits = torch.tensor([int(s) for s in m_splits], dtype=torch.int64)
        if tuple(splits.shape) != (self.num_gemms,):
            raise ValueError(f"m_splits: expected shape ({self.num_gemms},) (num_gemms), "
                             f"got {tuple(splits.shape)}")
        return splits

    def forward(self, x: Tensor, m_splits: Union[Sequence[int], Tensor], out: Optional[Tensor] = None,
                grad_input: Optional[Tensor] = None) -> Tensor:
        """x [T, in] grouped by expert; m_splits: list of ints, CPU tensor or CUDA tensor [G].
        out: optional [>= T, out] buffer the result is written into (rows >= S untouched);
        grad_input: optional [>= T, in] buffer backward writes dx into."""
        splits = self._normalize_splits(m_splits)
        weights, biases = self.weights(), self.biases()
        disposition = _disposition_constant(self.delay_wgrad_compute, self.fuse_wgrad_accumulation,
                                            self._has_grad_added_attr())
        return _GroupedLinearFunction.apply(self._id, disposition, self.single_grouped_weight, x, splits,
                                            out, grad_input, len(weights), *weights, *biases)

    def backward_dw(self) -> None:
        """Computes the oldest pending delayed wgrad (into main_grad when fused, else into the
        parameters' .grad), the bias grads, then runs the wgrad-accumulation-and-reduce hooks."""
        with torch.no_grad():
            g = self._core().backward_dw()
            if g.weight_kind == "wgrad":
                grads = [g.weight_grad_packed] if self.single_grouped_weight else g.weight_grads
                for p, grad in zip(self.weights(), grads):
                    _accumulate_grad(p, grad)
            if g.bias_grad is not None:
                grads = [g.bias_grad] if self.single_grouped_weight else list(g.bias_grad.unbind(0))
                for p, grad in zip(self.biases(), grads):
                    _accumulate_grad(p, grad)
        for hook in self._hooks:
            hook()

    def register_wgrad_accumulation_and_reduce_hooks(self, hook: Callable[[], None]) -> None:
        """`hook()` runs after each backward_dw(): with delayed wgrad, a gradient reduce must not
        start before the wgrad exists."""
        self._hooks.append(hook)

    def need_backward_dw(self) -> bool:
        return self.delay_wgrad_compute

    @property
    def pending_wgrads(self) -> int:
        return 0 if self._core_layer is None else self._core_layer.pending_wgrads

    def extra_repr(self) -> str:
        return (f"num_gemms={self.num_gemms}, in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.use_bias}, single_grouped_weight={self.single_grouped_weight}, "
                f"fuse_wgrad_accumulation={self.fuse_wgrad_accumulation}, "
                f"delay_wgrad_compute={self.delay_wgrad_compute}")


def _accumulate_grad(p: Tensor, grad: Tensor) -> None:
    if p.grad is None:
        p.grad = grad
    else:
        p.grad += grad

"""sparsetrain.torch.GroupedLinear: TransformerEngine's GroupedLinear options and semantics
(main_grad accumulation, delayed wgrad with backward_dw, caller out / grad_input buffers, device
splits) over the C++ torch library's operators sparsetrain::grouped_linear_* (autograd in C++),
with their fake implementations; and what GroupedMLP shares with it (the layer registry the fakes
find a module's shapes through, the delayed-wgrad surface). What backward returns for a weight
follows the one rule in C++ (`weight_grad_disposition`)."""

from __future__ import annotations

import atexit
import copy
import itertools
import math
import operator
import weakref
from operator import attrgetter
from typing import Any, Callable, List, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor, nn

from .. import _C
from .. import weight_grad_disposition as _weight_grad_disposition
from .._arrays import dtype_name as _dtype_name
from .._arrays import host_split_values as _host_split_values
from .._arrays import name_of_dtype as _name_of_dtype

from . import native
from .fp8 import FP8_FLAG, fp8_enabled

_requires_grad = attrgetter("requires_grad")

# Every layer module by id: the fakes find a module's shapes through it (the C++ operators find its
# C++ layer, made with the same id, in the library's own registry).
_LAYERS: "dict[int, weakref.ReferenceType[nn.Module]]" = {}
_NEXT_ID = itertools.count()


def _register_layer(module: nn.Module) -> int:
    layer_id = next(_NEXT_ID)
    _LAYERS[layer_id] = weakref.ref(module)
    weakref.finalize(module, _LAYERS.pop, layer_id, None)
    return layer_id


@atexit.register
def _release_cores_at_exit() -> None:
    """torch.compile's caches keep a compiled module alive past interpreter shutdown, later than
    the C++ torch library's layers that the modules hold: they hold torch tensors, better freed
    while torch is whole. Nothing can run a layer after exit: drop them here. (Registered at
    import, so it runs after atexit hooks added later.)"""
    for ref in list(_LAYERS.values()):
        module = ref()
        if module is not None:
            module._native_layer = None


def _current_stream_key(t: Tensor) -> Any:
    """Which stream is current on t's device (a CUDA stream's (id, device, type); None on the
    CPU), cheaply: torch.cuda.current_stream() builds a Stream object per call."""
    return torch._C._cuda_getCurrentStream(t.device.index) if t.is_cuda else None


def layer_of(layer_id: int) -> Any:
    ref = _LAYERS.get(layer_id)  # popped when the module is freed
    module = None if ref is None else ref()
    if module is None:
        raise RuntimeError(f"sparsetrain layer {layer_id} no longer exists")
    return module


def status_for(splits: Tensor, m: nn.Module) -> Optional[Tensor]:
    """Module m's sticky status word (`splits_status`) where invalid `splits` OR bits into it:
    CUDA splits stay on the device (capturable) and report there, when the word is on their
    device. CPU splits are host splits, validated at once (None)."""
    if not splits.is_cuda:
        return None
    status = m._splits_status()
    return status if status.device == splits.device else None


def check_buffer_args(x: Tensor, out: Optional[Tensor], grad_input: Optional[Tensor]) -> None:
    """The caller buffers' torch rules (the C++ core checks the rest): the library writes them in
    place, outside autograd; and they are on x's device, because torch's dispatcher picks the op's
    kernel from its arguments' devices (a meta buffer would run the fake implementation) and the
    core's own device check would never see the call."""
    for name, buf in (("out", out), ("grad_input", grad_input)):
        if buf is None:
            continue
        if buf.requires_grad:
            raise ValueError(f"{name}: expected a tensor that does not require grad (the library writes it in "
                             f"place), got requires_grad=True (a buffer an earlier call returned: pass {name}.detach(), "
                             "the same memory)")
        if buf.device != x.device:
            raise ValueError(f"{name}: expected a tensor on {x.device} (x's device), got {buf.device}")


# --- the operators' fakes ---------------------------------------------------------------------
# The operators are C++ (python/src/torch_grouped.cpp: sparsetrain::grouped_linear_forward, _into,
# _backward, _backward_into; autograd in C++); these are their shapes for FakeTensorMode, meta
# tensors and torch.compile. A module's state is found through layer_id; `params` (weights, then
# biases), `main_grads` and `flags` (op_args) are what the module holds now.


def fake_check_devices(layer_id: int, x: Tensor, params: Sequence[Tensor], main_grads: Sequence[Tensor],
                       **named: Optional[Tensor]) -> None:
    """The device rule, in the grouped ops' fake implementations: every tensor argument but splits
    (host splits stay on the CPU) on x's device, else a ValueError naming it. torch's dispatcher
    picks an op's kernel from its arguments' devices, so one meta tensor among real ones (a dy, a
    bias) runs the fake, which would hand back uninitialised outputs, and the C++ checks that refuse
    it never see the call."""
    for name, t in named.items():
        if t is not None and t.device != x.device:
            raise ValueError(f"{name}: expected a tensor on {x.device} (x's device), got {t.device}")
    for names, tensors in ((layer_of(layer_id)._op_param_names, params),
                           (layer_of(layer_id)._op_main_grad_names, main_grads)):
        for i, t in enumerate(tensors):
            if t.device != x.device:
                raise ValueError(f"{names()[i]}: expected a tensor on {x.device} (x's device), got {t.device}")


def has_grad_added_flag(flags: int, layer: int) -> bool:
    """Bit 1 + layer of an op's flags: that layer's weights have grad_added_to_main_grad."""
    return bool((flags >> (1 + layer)) & 1)


def layer_grads_fake(m: "GroupedLinear", x: Tensor, has_attr: bool) -> Tuple[Tensor, Tensor]:
    """The fake of one layer's grads as the ops hand them back, for the GroupedLinear module `m`
    (its shapes, and the weight-grad rule under has_attr): (packed weight grad or dummy, bias grad
    [G, out]); an empty tensor (x's dtype) stands for none."""
    kind, bias_now = _weight_grad_disposition(m.delay_wgrad_compute, m.fuse_wgrad_accumulation, has_attr)
    G, out_f, in_f = m.num_gemms, m.out_features, m.in_features
    if kind == "none":
        dw = x.new_empty(0)
    elif kind == "wgrad":
        stride = _C.packed_wgrad_group_stride(out_f, in_f, _dtype_name(x))
        dw = x.new_empty_strided((G, out_f, in_f), (stride, in_f, 1))
    else:
        dw = x.new_empty((G, out_f, in_f) if m.single_grouped_weight else (out_f, in_f))
    db = x.new_empty((G, out_f)) if (m.use_bias and bias_now) else x.new_empty(0)
    return dw, db


@torch.library.register_fake("sparsetrain::grouped_linear_forward")
def _(layer_id, x, splits, params, main_grads, flags, status=None, grad_input=None):
    fake_check_devices(layer_id, x, params, main_grads, grad_input=grad_input)
    return x.new_empty((x.shape[0], layer_of(layer_id).out_features))


@torch.library.register_fake("sparsetrain::grouped_linear_forward_into")
def _(layer_id, x, splits, params, main_grads, flags, out, status=None, grad_input=None):
    fake_check_devices(layer_id, x, params, main_grads, out=out, grad_input=grad_input)


@torch.library.register_fake("sparsetrain::grouped_linear_backward")
def _(layer_id, x, dy, splits, params, main_grads, flags, status=None):
    fake_check_devices(layer_id, x, params, main_grads, dy=dy)
    return (x.new_empty(x.shape), *layer_grads_fake(layer_of(layer_id), x, has_grad_added_flag(flags, 0)))


@torch.library.register_fake("sparsetrain::grouped_linear_backward_into")
def _(layer_id, x, dy, splits, params, main_grads, flags, grad_input, status=None):
    fake_check_devices(layer_id, x, params, main_grads, dy=dy, grad_input=grad_input)
    return layer_grads_fake(layer_of(layer_id), x, has_grad_added_flag(flags, 0))


# The operators, their OpOverloads bound once (a call through one skips the packet's overload
# resolution): what calls under torch.compile, fake tensors and dispatch modes go through.
OPS = torch.ops.sparsetrain


def call(name: str, *args: Any) -> Any:
    """The operator `name` with `args`: eager on plain tensors through the C++ torch library's entry
    (the same operator without torch.ops' argument conversion, ~10 us a call), elsewhere through
    torch.ops, which torch.compile and modes see (native.direct tells which)."""
    if native.direct(*(a for a in args if isinstance(a, Tensor))):
        return getattr(native.TORCH_OPS, name)(*args)
    return getattr(OPS, name).default(*args)


# --- the module -----------------------------------------------------------------------------


class DelayedWgrad:
    """TransformerEngine's delayed-wgrad surface and the C++ layer, shared by GroupedLinear and
    GroupedMLP: the module keeps `_hooks`, `_native_layer` (the C++ torch library's layer, which
    the operators find by the module's `_id`) and `delay_wgrad_compute`, and defines
    `_accumulate_backward_dw()` (its pending wgrads into main_grad or .grad, and bias grads),
    `_make_native()` and `_op_args()` (params, main_grads, flags: what the operators take)."""

    def _init_layer_state(self) -> None:
        """The state the methods below keep, empty, and the module's registration and C++ layer
        (last: both read the module's options)."""
        self._hooks: List[Callable[[], None]] = []
        self._grad_accumulators: Any = None  # (parameters, their AccumulateGrad nodes, stream): _hold_grad_accumulators
        self._id = _register_layer(self)
        self._native_layer: Any = self._make_native()

    def _record(self, inputs: Sequence[Tensor], params: List[Tensor]) -> None:
        """Before an eager call that autograd records: the parameters' AccumulateGrad nodes held."""
        if (torch.is_grad_enabled() and not torch.compiler.is_compiling()
                and (any(map(_requires_grad, inputs)) or any(map(_requires_grad, params)))):
            self._hold_grad_accumulators(params)

    def _hold_grad_accumulators(self, params: List[Tensor]) -> None:
        """Keeps the AccumulateGrad nodes of `params` alive between steps, as DDP's reducer does:
        autograd frees them with each graph, and a recorded call then makes each anew (~0.25 us a
        parameter: ~25 us with 64 experts). Taken again when the parameter objects change; eager
        recorded calls only (never under torch.compile, which cannot trace grad_fn).

        A node runs on the stream that was current when it was made. Held across a change of
        stream (a warm-up on a side stream, then torch.cuda.graph capturing on its own), backward
        would order the node's stream after the producer's: outside a capture a needless wait,
        inside one a dependency on uncaptured work (cudaErrorStreamCaptureIsolation). So the nodes
        are also taken again when the current stream changes: ours are dropped first, so that
        autograd makes them anew on the current stream (unless something else still holds them,
        e.g. a graph kept for a second backward, or, seen under compute-sanitizer, the last step's
        graph still alive a moment after its backward returned; torch then warns of the mismatch). Nodes still on another stream are not
        held, and taken again at the next call: holding them would keep the mismatch for good."""
        stream = _current_stream_key(params[0]) if params else None
        held = self._grad_accumulators
        if (held is not None and held[2] == stream and len(held[0]) == len(params)
                and all(map(operator.is_, held[0], params))):
            return
        held = self._grad_accumulators = None  # no reference left: the old nodes go now
        with torch.enable_grad():
            nodes = [p.view_as(p).grad_fn.next_functions[0][0] for p in params if p.requires_grad and p.is_leaf]
        if native.TORCH_OPS.grad_accumulators_on_current_stream(params):
            self._grad_accumulators = (tuple(params), nodes, stream)

    def backward_dw(self) -> None:
        """Computes the oldest pending delayed wgrad (into main_grad when fused, else into the
        parameters' .grad), the bias grads, then runs the wgrad-accumulation-and-reduce hooks.
        Without delay_wgrad_compute a no-op (hooks included), as TransformerEngine's: backward
        already computed the wgrad."""
        if not self.delay_wgrad_compute:
            return
        with torch.no_grad():
            self._accumulate_backward_dw()
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
        layer = self._native_layer
        return 0 if layer is None else layer.pending_wgrads

    # What a copy or a pickle does not take: the C++ layer (it cannot be copied: the copy makes its
    # own), what it cached, and the module's registration (a copy registers anew).
    _NOT_COPIED = {"_native_layer": None, "_grad_accumulators": None, "_host_splits": None}

    def __deepcopy__(self, memo: dict) -> Any:
        """copy.deepcopy (an EMA or reference copy of a model): parameters, options and hooks copied,
        the C++ layer made anew by the copy's first call. Refused while delayed wgrads are pending:
        their queue lives in the C++ layer."""
        if self.pending_wgrads:
            raise RuntimeError(f"copy.deepcopy of a {type(self).__name__}: {self.pending_wgrads} delayed wgrad(s) "
                               "pending; run backward_dw() first")
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        for key, value in self.__dict__.items():
            if key in self._NOT_COPIED:
                new.__dict__[key] = self._NOT_COPIED[key]
            elif key != "_id":
                new.__dict__[key] = copy.deepcopy(value, memo)
        new._id = _register_layer(new)
        new._native_layer = new._make_native()
        return new

    def __getstate__(self) -> dict:
        """pickle (torch.save of a whole module): as a copy, without the C++ layer."""
        if self.pending_wgrads:
            raise RuntimeError(f"pickling a {type(self).__name__}: {self.pending_wgrads} delayed wgrad(s) pending; "
                               "run backward_dw() first")
        return {k: (self._NOT_COPIED[k] if k in self._NOT_COPIED else v) for k, v in self.__dict__.items()
                if k != "_id"}

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        self._id = _register_layer(self)
        self._native_layer = self._make_native()


class GroupedLinear(DelayedWgrad, nn.Module):
    """num_gemms linear layers (experts) applied to the row groups of one input.

    Options as in TransformerEngine's GroupedLinear. Parameters: weight0..weight{G-1} [out, in]
    (and bias0..) or, with single_grouped_weight, one weight [G, out, in] (and bias [G, out]).
    With fuse_wgrad_accumulation the weight grads go into each weight's fp32 `main_grad`
    (overwritten instead when the weight has `overwrite_main_grad = True`); what autograd then
    sees is None, or a zero "dummy" when the weight has Megatron's `grad_added_to_main_grad`
    attribute (set to True; the dummy is cached in eager calls, a new one each step in a compiled
    graph, whose outputs CUDA graphs may reuse). With delay_wgrad_compute, backward computes
    dgrad only; `backward_dw()` computes the oldest pending wgrad and then runs the hooks given to
    `register_wgrad_accumulation_and_reduce_hooks` (without it backward_dw is a no-op).

    `splits_status`: an int32 [1] buffer on the module's device, the sticky status word of CUDA
    m_splits. Device splits are never read by the host, so invalid ones (a negative entry, a sum
    above the rows of x) cannot raise: every group is made empty (outputs zero) and the bits
    sparsetrain.SPLITS_NEGATIVE / SPLITS_SUM_EXCEEDS_ROWS are ORed into this word, which the
    library never clears. Read it when you choose (e.g. after a CUDA-graph replay; reading it
    syncs) and clear it with `splits_status.zero_()`. Its address is fixed while the module stays
    on one device, so graphs capture it. check_device_splits=True raises instead (it syncs).
    """

    def __init__(self, num_gemms: int, in_features: int, out_features: int, bias: bool = True, *,
                 params_dtype: Optional[torch.dtype] = None, device: Union[torch.device, str, None] = None,
                 single_grouped_weight: bool = False, fuse_wgrad_accumulation: bool = False,
                 delay_wgrad_compute: bool = False, check_device_splits: bool = False, fp8: Optional[bool] = None):
        super().__init__()
        if num_gemms < 1:
            raise ValueError(f"num_gemms: expected >= 1, got {num_gemms}")
        self.num_gemms, self.in_features, self.out_features = num_gemms, in_features, out_features
        self.use_bias = bias
        self.single_grouped_weight = single_grouped_weight
        self.fuse_wgrad_accumulation = fuse_wgrad_accumulation
        self.delay_wgrad_compute = delay_wgrad_compute
        self.check_device_splits = check_device_splits
        self.fp8 = fp8
        self._fp8_active = False  # the last forward's choice (fp8.py), which its backward_dw follows
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
        self._weight_names = ["weight"] if single_grouped_weight else [f"weight{i}" for i in range(num_gemms)]
        self._bias_names = ([] if not bias else ["bias"] if single_grouped_weight
                            else [f"bias{i}" for i in range(num_gemms)])
        # Not in the state dict (persistent=False); moves with the module (.to / .cuda).
        self.register_buffer("splits_status", torch.zeros(1, dtype=torch.int32, device=device), persistent=False)
        self._host_splits: Optional[Tuple[tuple, Tensor]] = None  # (values, tensor) of the last list
        self._init_layer_state()

    def _splits_status(self) -> Tensor:
        return self.splits_status

    def weights(self) -> List[Tensor]:
        """The weight parameters: [weight] ([G, out, in]) with single_grouped_weight, else
        weight0 .. weight{G-1} ([out, in] each)."""
        # Read from _parameters by precomputed names: nn.Module's attribute lookup costs ~1 us a
        # parameter, and a forward reads the lists more than once (64 experts: ~0.3 ms a call).
        params = self._parameters
        return [params[n] for n in self._weight_names]

    def biases(self) -> List[Tensor]:
        """The bias parameters (none without bias), laid out as weights()."""
        params = self._parameters
        return [params[n] for n in self._bias_names]

    def _op_param_names(self, prefix: str = "") -> List[str]:
        """The names of the parameters the ops take, in their order (weights, then biases)."""
        return [prefix + n for n in (*self._weight_names, *self._bias_names)]

    def _op_main_grad_names(self, prefix: str = "") -> List[str]:
        """The names of the main_grads the ops take (none without fusion)."""
        return [f"{prefix}{n}.main_grad" for n in self._weight_names] if self.fuse_wgrad_accumulation else []

    def _has_grad_added_attr(self, weights: Optional[List[Tensor]] = None) -> bool:
        return all(hasattr(w, "grad_added_to_main_grad") for w in (self.weights() if weights is None else weights))

    def _main_grads(self, prefix: str, weights: List[Tensor]) -> List[Tensor]:
        grads = []
        for name, w in zip(self._weight_names, weights):
            mg = getattr(w, "main_grad", None)
            if mg is None:
                raise ValueError(f"{prefix}{name}.main_grad: expected an fp32 tensor of shape {list(w.shape)} "
                                 "(fuse_wgrad_accumulation=True), got none")
            grads.append(mg)
        return grads

    def _layer_args(self, prefix: str = "") -> Tuple[List[Tensor], List[Tensor], bool, bool]:
        """This layer's part of the operators' arguments, as the module holds them now: (weights and
        biases, main_grads, overwrite_main_grad, has_grad_added_to_main_grad); the last three only
        with fuse_wgrad_accumulation (the weight-grad rule reads the flags then alone). `prefix`
        names the layer inside a GroupedMLP in errors."""
        weights = self.weights()
        params = weights + self.biases()
        if not self.fuse_wgrad_accumulation:
            return params, [], False, False
        overwrite = bool(getattr(weights[0], "overwrite_main_grad", False))
        return params, self._main_grads(prefix, weights), overwrite, self._has_grad_added_attr(weights)

    def _op_args(self) -> Tuple[List[Tensor], List[Tensor], int]:
        """(params, main_grads, flags) as the operators take them: flags bit 0 overwrite_main_grad,
        bit 1 grad_added_to_main_grad, FP8_FLAG the last forward's FP8 choice."""
        params, main_grads, overwrite, has_attr = self._layer_args()
        return params, main_grads, int(overwrite) | int(has_attr) << 1 | (FP8_FLAG if self._fp8_active else 0)

    def _make_native(self) -> Any:
        return native.TORCH_OPS.GroupedLinear(
            self._id, self.num_gemms, self.in_features, self.out_features, self.single_grouped_weight,
            self.use_bias, self.fuse_wgrad_accumulation, self.delay_wgrad_compute, self.check_device_splits)

    # -- forward / backward_dw -------------------------------------------------------------
    def _normalize_splits(self, m_splits: Any) -> Tensor:
        """m_splits as an int64 tensor [G] (GroupedMLP's too): a list by host_split_values' rule
        (whole numbers), a tensor by its dtype alone (any integer dtype, converted; never float,
        bool or complex: a CUDA tensor's values cannot be read without a sync, and a CPU tensor
        follows the same rule)."""
        if isinstance(m_splits, Tensor):
            if m_splits.dtype == torch.int64:
                splits = m_splits
            else:
                dt = m_splits.dtype
                if dt.is_floating_point or dt.is_complex or dt == torch.bool:
                    raise ValueError(f"m_splits: expected an integer tensor (int64, or another integer dtype, "
                                     f"converted), got {_name_of_dtype(dt)} (judged by its dtype, its values "
                                     "unread; if they are whole numbers, pass m_splits.long())")
                splits = m_splits.to(torch.int64)
        elif torch.compiler.is_compiling():
            splits = torch.tensor(_host_split_values(m_splits, "m_splits"), dtype=torch.int64)
        else:
            # Eager host splits: the tensor of the last call's values is reused (torch.tensor costs
            # ~4 us); nothing writes it. A list equal in value is the same splits by the rule.
            values = tuple(m_splits)
            last = self._host_splits
            if last is not None and last[0] == values:
                return last[1]
            splits = torch.tensor(_host_split_values(values, "m_splits"), dtype=torch.int64)
            if tuple(splits.shape) == (self.num_gemms,):
                self._host_splits = (values, splits)
        if tuple(splits.shape) != (self.num_gemms,):
            raise ValueError(f"m_splits: expected shape ({self.num_gemms},) (num_gemms), "
                             f"got {tuple(splits.shape)}")
        return splits

    def forward(self, x: Tensor, m_splits: Union[Sequence[int], Tensor], out: Optional[Tensor] = None,
                grad_input: Optional[Tensor] = None) -> Tensor:
        """x [T, in] grouped by expert; m_splits: the rows of each expert, [G]: a list of whole
        numbers (30 or 30.0; 30.5 is refused, never truncated), or a CPU or CUDA tensor of an
        integer dtype (a float or bool tensor is refused by its dtype, its values unread).
        out: optional [>= T, out] buffer the result is written into (rows >= S untouched);
        grad_input: optional [>= T, in] buffer backward writes dx into. Both may have as few as S
        rows with host splits; neither may require grad. dx is grad_input's first T rows (rows
        >= S as the buffer holds them; zeros below a buffer of fewer than T rows).

        What a leaf x gets as .grad from its first backward with grad_input (x.grad None; autograd
        adds later ones into it in place), by the buffer's rows: more than T, a view of its first
        T rows, the buffer's own storage (so the next backward into that buffer overwrites x.grad
        before adding to it: set x.grad = None between such steps, or pass T rows); exactly T,
        torch's copy of the buffer (AccumulateGrad copies a gradient that the caller still holds:
        other storage, the same bytes, rows >= S included); S < T (host splits), a new [T, in]
        tensor, the buffer's rows then zeros. A non-leaf x hands dx to its producer's backward."""
        check_buffer_args(x, out, grad_input)
        splits = self._normalize_splits(m_splits)
        self._fp8_active = fp8_enabled(self.fp8)
        params, main_grads, flags = self._op_args()
        self._record((x,), params)
        status = status_for(splits, self)
        if out is None:
            return call("grouped_linear_forward", self._id, x, splits, params, main_grads, flags, status, grad_input)
        call("grouped_linear_forward_into", self._id, x, splits, params, main_grads, flags, out, status, grad_input)
        return out

    def _accumulate_backward_dw(self) -> None:
        dw, db = self._native_layer.backward_dw(*self._op_args())
        accumulate_layer_grads(self, dw, db)

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


def accumulate_layer_grads(m: GroupedLinear, dw: Tensor, db: Tensor) -> None:
    """A delayed wgrad, (packed wgrad, bias grad) as the C++ layer's backward_dw gives them (empty: none),
    into the .grad of m's parameters; with main_grad fusion the core has already written
    main_grad and there is no wgrad to add."""
    for params, grad in ((m.weights(), dw), (m.biases(), db)):
        if grad.numel():
            for p, g in zip(params, [grad] if m.single_grouped_weight else grad.unbind(0)):
                _accumulate_grad(p, g)



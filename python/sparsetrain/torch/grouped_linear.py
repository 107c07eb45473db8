"""sparsetrain.torch.GroupedLinear: TransformerEngine's GroupedLinear options and semantics
(main_grad accumulation, delayed wgrad with backward_dw, caller out / grad_input buffers, device
splits) over torch.library custom ops with fake implementations; and what GroupedMLP shares with
it (the layer registry the ops find a module's state through, the weight-grad rule's application,
the delayed-wgrad surface). What backward returns for a weight follows the one rule in C++
(`weight_grad_disposition`)."""

from __future__ import annotations

import atexit
import copy
import functools
import itertools
import math
import operator
import weakref
from operator import attrgetter
from typing import Any, Callable, List, NamedTuple, Optional, Sequence, Tuple, Union

import torch
import torch.autograd.forward_ad as _fwad
from torch import Tensor, nn

from .. import _C
from .. import weight_grad_disposition as _weight_grad_disposition
from .._arrays import dtype_name as _dtype_name
from .._arrays import host_split_values as _host_split_values
from .._arrays import name_of_dtype as _name_of_dtype

from . import native

_requires_grad = attrgetter("requires_grad")

# Every layer module by id: the custom ops find their layer's state through it.
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
            module._native_layer, module._native_methods = None, None


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


def with_rows(t: Tensor, T: int) -> Tensor:
    """`t` with exactly T rows: a caller `out` buffer may have more rows than x, or (host splits)
    as few as S; the rows >= S of a gradient are never read, the missing ones are zeros."""
    n = t.shape[0]
    if n > T:
        return t[:T]
    if n < T:
        return torch.cat([t, t.new_zeros((T - n, *t.shape[1:]))])
    return t


# --- custom ops -----------------------------------------------------------------------------
# The layer's state (its C++ core, pending delayed wgrads, main_grad) is found through layer_id at
# run time; `params` are passed so that the compiler orders the ops after parameter updates.
# Two ops per direction: a functional one, and one that writes a caller buffer (`out`,
# `grad_input`), so that neither has an optional mutated argument (Inductor lowers those poorly).


# The forward ops also take the grad_input buffer that backward will write, only to check it
# with the C++ rule before anything runs (an error at backward time would come too late).



def fake_check_devices(layer_id: int, x: Tensor, params: Sequence[Tensor], **named: Optional[Tensor]) -> None:
    """The device rule, in the grouped ops' fake implementations: every tensor argument but splits
    (host splits stay on the CPU) on x's device, else a ValueError naming it. torch's dispatcher
    picks an op's kernel from its arguments' devices, so one meta tensor among real ones (a dy, a
    bias) runs the fake, which would hand back uninitialised outputs, and the C++ checks that refuse
    it never see the call. Only fakes pay for it: eager calls reach C++ directly."""
    for name, t in named.items():
        if t is not None and t.device != x.device:
            raise ValueError(f"{name}: expected a tensor on {x.device} (x's device), got {t.device}")
    for i, p in enumerate(params):
        if p.device != x.device:
            raise ValueError(f"{layer_of(layer_id)._op_param_names()[i]}: expected a tensor on {x.device} (x's device), got {p.device}")


def without_autograd(inputs: Sequence[Tensor], buffers: Sequence[Optional[Tensor]],
                      params: Sequence[Tensor]) -> bool:
    """Whether an eager module call may skip its autograd.Function (~15 us a call with 4 experts,
    ~80 us with 64, even under no_grad) and call the op implementation itself: autograd would record nothing (grad mode
    off, or neither an input nor a parameter requires grad; no forward-mode AD level) and
    native.direct's conditions hold (so never under torch.compile, fake tensors or dispatch modes)."""
    if torch.compiler.is_compiling() or _fwad._current_level >= 0:
        return False
    if torch.is_grad_enabled() and (any(map(_requires_grad, inputs)) or any(map(_requires_grad, params))):
        return False
    return native.direct(*inputs, *buffers)


def written(out: Optional[Tensor], y: Tensor) -> Tensor:
    """An op's result without its autograd.Function: the caller's buffer `out` (its version
    bumped, as mark_dirty does) or the new tensor y."""
    if out is None:
        return y
    torch.autograd.graph.increment_version(out)
    return out


def _forward_impl(layer_id: int, x: Tensor, splits: Tensor, grad_input: Optional[Tensor],
                  out: Optional[Tensor] = None, params: Any = None) -> Tensor:
    """params: the module's `_native_params()` where the caller has them already."""
    m = layer_of(layer_id)
    return m._native("forward", x, splits, status_for(splits, m), out, grad_input, params=params)


@torch.library.custom_op("sparsetrain::grouped_linear_forward", mutates_args=())
def _forward_op(layer_id: int, x: Tensor, splits: Tensor, params: List[Tensor],
                grad_input: Optional[Tensor] = None) -> Tensor:
    return _forward_impl(layer_id, x, splits, grad_input)


@_forward_op.register_fake
def _(layer_id, x, splits, params, grad_input=None):
    fake_check_devices(layer_id, x, params, grad_input=grad_input)
    return x.new_empty((x.shape[0], params[0].shape[-2]))


@torch.library.custom_op("sparsetrain::grouped_linear_forward_into", mutates_args=("out",))
def _forward_into_op(layer_id: int, x: Tensor, splits: Tensor, params: List[Tensor], out: Tensor,
                     grad_input: Optional[Tensor] = None) -> None:
    _forward_impl(layer_id, x, splits, grad_input, out)


@_forward_into_op.register_fake
def _(layer_id, x, splits, params, out, grad_input=None):
    fake_check_devices(layer_id, x, params, out=out, grad_input=grad_input)
    return None


def layer_grads_fake(m: "GroupedLinear", x: Tensor) -> Tuple[Tensor, Tensor]:
    """The fake of one layer's grads as the ops hand them back, for the GroupedLinear module `m`
    (its shapes and rule): (packed weight grad or dummy, bias grad [G, out]); an empty tensor
    (x's dtype) stands for none."""
    kind, bias_now = m._disposition()
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


def _backward_impl(layer_id, x, dy, splits, grad_input):
    """(dx, packed weight grad or dummy, bias grad [G, out])."""
    m = layer_of(layer_id)
    return m._native("backward", x, dy, splits, status_for(splits, m), grad_input)


def _backward_fake(layer_id, x):
    return layer_grads_fake(layer_of(layer_id), x)


@torch.library.custom_op("sparsetrain::grouped_linear_backward", mutates_args=())
def _backward_op(layer_id: int, x: Tensor, dy: Tensor, splits: Tensor,
                 params: List[Tensor]) -> Tuple[Tensor, Tensor, Tensor]:
    return _backward_impl(layer_id, x, dy, splits, None)


@_backward_op.register_fake
def _(layer_id, x, dy, splits, params):
    fake_check_devices(layer_id, x, params, dy=dy)
    return (x.new_empty(x.shape), *_backward_fake(layer_id, x))


@torch.library.custom_op("sparsetrain::grouped_linear_backward_into", mutates_args=("grad_input",))
def _backward_into_op(layer_id: int, x: Tensor, dy: Tensor, splits: Tensor, params: List[Tensor],
                      grad_input: Tensor) -> Tuple[Tensor, Tensor]:
    return _backward_impl(layer_id, x, dy, splits, grad_input)[1:]


@_backward_into_op.register_fake
def _(layer_id, x, dy, splits, params, grad_input):
    fake_check_devices(layer_id, x, params, dy=dy, grad_input=grad_input)
    return _backward_fake(layer_id, x)


# `out`, the tensor the autograd Functions below mark dirty, is their first tensor input: where it is a
# view (rows of a larger buffer), autograd rewrites the graph through CopySlices, which hands the
# gradient of the Function's first input to the buffer's base; with x first, dx went there and x got
# none (pytorch/pytorch#5871).
class _GroupedLinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, layer_id: int, disposition: Tuple[str, bool], packed: bool, out: Optional[Tensor], x: Tensor,
                splits: Tensor, grad_input: Optional[Tensor], num_weights: int, *params: Tensor):
        direct = native.direct(x, splits, out, grad_input)
        if out is None:
            y = (_forward_impl(layer_id, x, splits, grad_input) if direct
                 else torch.ops.sparsetrain.grouped_linear_forward(layer_id, x, splits, list(params), grad_input))
        else:
            if direct:
                _forward_impl(layer_id, x, splits, grad_input, out)
            else:
                torch.ops.sparsetrain.grouped_linear_forward_into(layer_id, x, splits, list(params), out, grad_input)
            ctx.mark_dirty(out)
            y = out
        ctx.save_for_backward(x, splits, *params)
        ctx.layer_id, ctx.disposition, ctx.packed = layer_id, disposition, packed
        ctx.grad_input, ctx.num_weights = grad_input, num_weights
        return y

    @staticmethod
    def backward(ctx, dy: Tensor):
        x, splits, *params = ctx.saved_tensors
        grads = _grouped_linear_grads(ctx.layer_id, ctx.disposition, ctx.packed, ctx.grad_input, ctx.num_weights,
                                      [x, splits, *params], dy)
        return (None, None, None, None, grads[0], None, None, None, *grads[1:])


def _grouped_linear_grads(layer_id: int, disposition: Tuple[str, bool], packed: bool, grad_input: Optional[Tensor],
                          num_weights: int, saved: Sequence[Tensor], dy: Optional[Tensor],
                          last_use: bool = False) -> List[Optional[Tensor]]:
    """[dx, weight grads, bias grads] of one recorded GroupedLinear forward, whose saved tensors
    were [x, splits, weights, biases]: the backward of _GroupedLinearFunction and of the node the
    C++ torch library records (native.TORCH_OPS.record; dy None: zeros, as autograd.Function's).
    last_use (the recorded node's: no backward reads the saved tensors again) changes nothing
    here: a GroupedLinear saves no intermediate of its own."""
    x, splits, *params = saved
    if dy is None:
        dy = x.new_zeros((x.shape[0], params[0].shape[-2]))
    dy = with_rows(dy, x.shape[0])
    if dy.stride(-1) != 1:
        dy = dy.contiguous()
    if native.direct(x, dy, splits, grad_input):
        dx, dw, db = _backward_impl(layer_id, x, dy, splits, grad_input)
    elif grad_input is None:
        dx, dw, db = torch.ops.sparsetrain.grouped_linear_backward(layer_id, x, dy, splits, params)
    else:
        dw, db = torch.ops.sparsetrain.grouped_linear_backward_into(layer_id, x, dy, splits, params, grad_input)
    if grad_input is not None:
        dx = with_rows(grad_input, x.shape[0])
    return [dx, *param_grads(disposition, packed, params[:num_weights], params[num_weights:], dw, db)]


def recorded(out: Optional[Tensor], x: Tensor, splits: Tensor, grad_input: Optional[Tensor]) -> bool:
    """Whether an eager module call that autograd records may skip its autograd.Function (~18 us
    a call with 4 experts, ~200 us with 64) and record the C++ torch library's node over the op
    implementation instead (native.TORCH_OPS.record; same backward): no caller `out` (which
    autograd.Function marks dirty), no forward-mode AD level, and native.direct's conditions
    (never under torch.compile, fake tensors or dispatch modes)."""
    return out is None and _fwad._current_level < 0 and native.direct(x, splits, grad_input)


def param_grads(disposition: Tuple[str, bool], packed: bool, weights: Sequence[Tensor], biases: Sequence[Tensor],
                 dw: Tensor, db: Tensor) -> List[Optional[Tensor]]:
    """What autograd gets for one layer's weights then biases, from the op's (dw, db)."""
    kind, bias_now = disposition
    if kind == "none":
        w_grads: List[Optional[Tensor]] = [None] * len(weights)
    elif kind == "wgrad":
        w_grads = [dw] if packed else list(dw.unbind(0))
    else:  # dummy: a cached zero tensor; Megatron reads the flag and skips its own accumulation
        w_grads = [dw] * len(weights)
        for w in weights:
            w.grad_added_to_main_grad = True
    if biases and bias_now:
        b_grads: List[Optional[Tensor]] = [db] if packed else list(db.unbind(0))
    else:
        b_grads = [None] * len(biases)
    return w_grads + b_grads


@torch.compiler.assume_constant_result
def disposition_constant(delay: bool, fuse: bool, has_attr: bool) -> Tuple[str, bool]:
    return tuple(_weight_grad_disposition(delay, fuse, has_attr))


# --- the module -----------------------------------------------------------------------------


class DelayedWgrad:
    """TransformerEngine's delayed-wgrad surface and the C++ layer, shared by GroupedLinear and
    GroupedMLP: the module keeps `_hooks`, `_native_layer` (the C++ torch library's layer) and
    `delay_wgrad_compute`, and defines
    `_accumulate_backward_dw()` (its pending wgrads into main_grad or .grad, and bias grads),
    `_make_native()` and `_native_params()`."""

    def _init_layer_state(self) -> None:
        """The state the methods below keep, empty, and the module's registration (last: the
        layer's custom ops find the module through it)."""
        self._hooks: List[Callable[[], None]] = []
        self._native_layer: Any = None
        self._native_methods: Any = None
        self._grad_accumulators: Any = None  # (parameters, their AccumulateGrad nodes, stream): _hold_grad_accumulators
        self._id = _register_layer(self)

    def _native(self, method: str, *args: Any, params: Any = None) -> Any:
        """`method` of the module's C++ layer in the C++ torch library (made once), called with
        `args` and the module's current parameters and flags (`params`, else `_native_params()`);
        the layer compares them with the last call's and rebuilds its views when one moved."""
        methods = self._native_methods
        if methods is None:  # bound once
            layer = self._native_layer = self._make_native()
            methods = self._native_methods = {n: getattr(layer, n) for n in ("forward", "backward", "backward_dw")}
        return methods[method](*args, *(self._native_params() if params is None else params))

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

    # What a copy does not take: the C++ layers (they cannot be copied; a copy makes its own at its
    # first call), what they cached, and the module's registration (a copy registers anew).
    _NOT_COPIED = {"_native_layer": None, "_native_methods": None,
                   "_grad_accumulators": None, "_host_splits": None}

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
        return new


class GroupedLinear(DelayedWgrad, nn.Module):
    """num_gemms linear layers (experts) applied to the row groups of one input.

    Options as in TransformerEngine's GroupedLinear. Parameters: weight0..weight{G-1} [out, in]
    (and bias0..) or, with single_grouped_weight, one weight [G, out, in] (and bias [G, out]).
    With fuse_wgrad_accumulation the weight grads go into each weight's fp32 `main_grad`
    (overwritten instead when the weight has `overwrite_main_grad = True`); what autograd then
    sees is None, or a cached zero "dummy" when the weight has Megatron's
    `grad_added_to_main_grad` attribute (set to True). With delay_wgrad_compute, backward computes
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

    def _has_grad_added_attr(self, weights: Optional[List[Tensor]] = None) -> bool:
        return all(hasattr(w, "grad_added_to_main_grad") for w in (self.weights() if weights is None else weights))

    def _disposition(self) -> Tuple[str, bool]:
        return tuple(_weight_grad_disposition(self.delay_wgrad_compute, self.fuse_wgrad_accumulation,
                                              self._has_grad_added_attr()))

    def _main_grads(self, prefix: str = "") -> Optional[List[Tensor]]:
        if not self.fuse_wgrad_accumulation:
            return None
        grads = []
        for name, w in zip(self._weight_names, self.weights()):
            mg = getattr(w, "main_grad", None)
            if mg is None:
                raise ValueError(f"{prefix}{name}.main_grad: expected an fp32 tensor of shape {list(w.shape)} "
                                 "(fuse_wgrad_accumulation=True), got none")
            grads.append(mg)
        return grads

    def _param_tensors(self, prefix: str = "", weights: Optional[List[Tensor]] = None,
                       biases: Optional[List[Tensor]] = None) -> "_ParamTensors":
        """The parameters, main_grads and flags as they are now; `prefix` names this layer inside
        a GroupedMLP in errors; `weights` and `biases` where the caller has listed them already."""
        weights = self.weights() if weights is None else weights
        biases = self.biases() if biases is None else biases
        main_grads = self._main_grads(prefix)
        overwrite = bool(self.fuse_wgrad_accumulation and getattr(weights[0], "overwrite_main_grad", False))
        return _ParamTensors(weights, biases, main_grads, overwrite, self._has_grad_added_attr(weights))

    def _make_native(self) -> Any:
        from .. import _torch_ops  # noqa: PLC0415  (loaded by _load_native)

        return _torch_ops.GroupedLinear(
            self.num_gemms, self.in_features, self.out_features, self.single_grouped_weight, self.use_bias,
            self.fuse_wgrad_accumulation, self.delay_wgrad_compute, self.check_device_splits)

    def _native_params(self, weights: Optional[List[Tensor]] = None,
                       biases: Optional[List[Tensor]] = None) -> Tuple[List[Tensor], List[bool]]:
        """`_param_tensors` as the C++ torch library takes them (a forward passes the lists it
        has made already: this runs every call)."""
        if not self.fuse_wgrad_accumulation:
            return unfused_native_params(self, weights, biases)
        p = self._param_tensors("", weights, biases)
        return p.tensors(), [p.overwrite, p.has_attr]

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
        weights, biases = self.weights(), self.biases()
        if without_autograd((x,), (splits, out, grad_input), weights + biases):
            return written(out, _forward_impl(self._id, x, splits, grad_input, out,
                                              self._native_params(weights, biases)))
        disposition = disposition_constant(self.delay_wgrad_compute, self.fuse_wgrad_accumulation,
                                            self._has_grad_added_attr(weights))
        if recorded(out, x, splits, grad_input):
            params = [*weights, *biases]
            self._hold_grad_accumulators(params)
            y = _forward_impl(self._id, x, splits, grad_input, None, self._native_params(weights, biases))
            native.TORCH_OPS.record(y, [x, *params], [x, splits, *params],
                              functools.partial(_grouped_linear_grads, self._id, disposition,
                                                self.single_grouped_weight, grad_input, len(weights)))
            return y
        return _GroupedLinearFunction.apply(self._id, disposition, self.single_grouped_weight, out, x, splits,
                                            grad_input, len(weights), *weights, *biases)

    def _accumulate_backward_dw(self) -> None:
        dw, db = self._native("backward_dw")
        accumulate_layer_grads(self, dw, db)

    def extra_repr(self) -> str:
        return (f"num_gemms={self.num_gemms}, in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.use_bias}, single_grouped_weight={self.single_grouped_weight}, "
                f"fuse_wgrad_accumulation={self.fuse_wgrad_accumulation}, "
                f"delay_wgrad_compute={self.delay_wgrad_compute}")


def unfused_native_params(layer: "GroupedLinear", weights: Optional[List[Tensor]] = None,
                           biases: Optional[List[Tensor]] = None) -> Tuple[List[Tensor], List[bool]]:
    """A layer's `_native_params` without fused wgrad accumulation: no main_grads, and both flags
    False (overwrite_main_grad and has_grad_added_to_main_grad only matter when fusing: the
    disposition rule reads them then alone), so the per-call flag and attribute reads are skipped."""
    weights = layer.weights() if weights is None else weights
    return weights + (layer.biases() if biases is None else biases), [False, False]


class _ParamTensors(NamedTuple):
    weights: List[Tensor]
    biases: List[Tensor]
    main_grads: Optional[List[Tensor]]  # None without fuse_wgrad_accumulation
    overwrite: bool
    has_attr: bool

    def tensors(self) -> List[Tensor]:
        """In the order the C++ torch library takes them: weights, biases, main_grads."""
        return [*self.weights, *self.biases, *(self.main_grads or [])]


def check_same_overwrite(p1: _ParamTensors, p2: _ParamTensors) -> None:
    """A GroupedMLP's two layers share overwrite_main_grad."""
    if p1.overwrite != p2.overwrite:
        raise ValueError(f"fc2 weights' overwrite_main_grad: expected {p1.overwrite} (as fc1's), got {p2.overwrite}")


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



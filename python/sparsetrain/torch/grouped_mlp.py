"""sparsetrain.torch.GroupedMLP: fc1 -> SwiGLU x probs -> fc2 over the experts' row groups, one
fused op per direction (two GroupedLinear layers' parameters and options)."""

from __future__ import annotations

import functools
from typing import Any, List, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor, nn

from . import native
from .grouped_linear import (DelayedWgrad, GroupedLinear, accumulate_layer_grads, check_buffer_args,
                             check_same_overwrite, disposition_constant, fake_check_devices, layer_grads_fake,
                             layer_of, param_grads, recorded, status_for, unfused_native_params, with_rows,
                             without_autograd, written)

# --- GroupedMLP ------------------------------------------------------------------------------
# The same scheme as GroupedLinear's ops: `params` is [fc1 weights, fc1 biases, fc2 weights, fc2
# biases]; each layer's weight grad comes back as (dw, db) under that layer's disposition.


def _mlp_forward_impl(layer_id: int, x: Tensor, splits: Tensor, probs: Tensor, grad_input: Optional[Tensor],
                      out: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
    m = layer_of(layer_id)
    return m._native("forward", x, splits, status_for(splits, m), probs, out, grad_input)


@torch.library.custom_op("sparsetrain::grouped_mlp_forward", mutates_args=())
def _mlp_forward_op(layer_id: int, x: Tensor, splits: Tensor, probs: Tensor,
                    params: List[Tensor], grad_input: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
    return _mlp_forward_impl(layer_id, x, splits, probs, grad_input)


@_mlp_forward_op.register_fake
def _(layer_id, x, splits, probs, params, grad_input=None):
    fake_check_devices(layer_id, x, params, probs=probs, grad_input=grad_input)
    m = layer_of(layer_id)
    return x.new_empty((x.shape[0], m.out_features)), x.new_empty((x.shape[0], 2 * m.ffn_hidden_size))


@torch.library.custom_op("sparsetrain::grouped_mlp_forward_into", mutates_args=("out",))
def _mlp_forward_into_op(layer_id: int, x: Tensor, splits: Tensor, probs: Tensor, params: List[Tensor],
                         out: Tensor, grad_input: Optional[Tensor] = None) -> Tensor:
    return _mlp_forward_impl(layer_id, x, splits, probs, grad_input, out)[1]


@_mlp_forward_into_op.register_fake
def _(layer_id, x, splits, probs, params, out, grad_input=None):
    fake_check_devices(layer_id, x, params, probs=probs, out=out, grad_input=grad_input)
    return x.new_empty((x.shape[0], 2 * layer_of(layer_id).ffn_hidden_size))


def _mlp_backward_impl(layer_id, x, fc1_out, probs, dy, splits, grad_input, last_use=False):
    """(dx, dprobs, fc1's dw, db, fc2's dw, db). last_use: fc1_out is read by no other backward,
    so its gradient may be written over it (one [T, 2F] tensor less at the step's peak)."""
    m = layer_of(layer_id)
    return m._native("backward", x, fc1_out, probs, dy, splits, status_for(splits, m), grad_input, last_use)


def _mlp_backward_fake(layer_id, x, probs):
    m = layer_of(layer_id)
    return (probs.new_empty((x.shape[0],), dtype=torch.float32), *layer_grads_fake(m.fc1, x),
            *layer_grads_fake(m.fc2, x))


@torch.library.custom_op("sparsetrain::grouped_mlp_backward", mutates_args=())
def _mlp_backward_op(layer_id: int, x: Tensor, fc1_out: Tensor, probs: Tensor, dy: Tensor, splits: Tensor,
                     params: List[Tensor]) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    return _mlp_backward_impl(layer_id, x, fc1_out, probs, dy, splits, None)


@_mlp_backward_op.register_fake
def _(layer_id, x, fc1_out, probs, dy, splits, params):
    fake_check_devices(layer_id, x, params, fc1_out=fc1_out, probs=probs, dy=dy)
    return (x.new_empty(x.shape), *_mlp_backward_fake(layer_id, x, probs))


@torch.library.custom_op("sparsetrain::grouped_mlp_backward_into", mutates_args=("grad_input",))
def _mlp_backward_into_op(layer_id: int, x: Tensor, fc1_out: Tensor, probs: Tensor, dy: Tensor, splits: Tensor,
                          params: List[Tensor], grad_input: Tensor) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    return _mlp_backward_impl(layer_id, x, fc1_out, probs, dy, splits, grad_input)[1:]


@_mlp_backward_into_op.register_fake
def _(layer_id, x, fc1_out, probs, dy, splits, params, grad_input):
    fake_check_devices(layer_id, x, params, fc1_out=fc1_out, probs=probs, dy=dy, grad_input=grad_input)
    return _mlp_backward_fake(layer_id, x, probs)


class _GroupedMLPFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, layer_id: int, dispositions: Tuple[Tuple[str, bool], Tuple[str, bool]], packed: bool,
                out: Optional[Tensor], x: Tensor, splits: Tensor, probs: Tensor, grad_input: Optional[Tensor],
                counts: Tuple[int, int, int, int], *params: Tensor):  # out first: see _GroupedLinearFunction
        if native.direct(x, splits, probs, out, grad_input):
            y, fc1_out = _mlp_forward_impl(layer_id, x, splits, probs, grad_input, out)
        elif out is None:
            y, fc1_out = torch.ops.sparsetrain.grouped_mlp_forward(layer_id, x, splits, probs, list(params),
                                                                   grad_input)
        else:
            fc1_out = torch.ops.sparsetrain.grouped_mlp_forward_into(layer_id, x, splits, probs, list(params), out,
                                                                     grad_input)
        if out is not None:
            ctx.mark_dirty(out)
            y = out
        # Saved activations: x, fc1's pre-activation output and probs (the activation is recomputed).
        ctx.save_for_backward(x, fc1_out, probs, splits, *params)
        ctx.layer_id, ctx.dispositions, ctx.packed = layer_id, dispositions, packed
        ctx.grad_input, ctx.counts = grad_input, counts
        return y

    @staticmethod
    def backward(ctx, dy: Tensor):
        grads = _grouped_mlp_grads(ctx.layer_id, ctx.dispositions, ctx.packed, ctx.grad_input, ctx.counts,
                                   ctx.saved_tensors, dy)
        return (None, None, None, None, grads[0], None, grads[1], None, None, *grads[2:])


def _grouped_mlp_grads(layer_id: int, dispositions: Tuple[Tuple[str, bool], Tuple[str, bool]], packed: bool,
                       grad_input: Optional[Tensor], counts: Tuple[int, int, int, int], saved: Sequence[Tensor],
                       dy: Optional[Tensor], last_use: bool = False) -> List[Optional[Tensor]]:
    """[dx, dprobs, parameter grads] of one recorded GroupedMLP forward, whose saved tensors were
    [x, fc1_out, probs, splits, parameters]: as _grouped_linear_grads. last_use (the recorded
    node's, where the graph is not retained): fc1_out's gradient is written over it (the
    autograd.Function and the custom ops cannot tell, and keep it)."""
    x, fc1_out, probs, splits, *params = saved
    nw1, nb1, nw2, nb2 = counts
    if dy is None:
        dy = x.new_zeros((x.shape[0], params[nw1 + nb1].shape[-2]))
    dy = with_rows(dy, x.shape[0])
    if dy.stride(-1) != 1:
        dy = dy.contiguous()
    if native.direct(x, fc1_out, probs, dy, splits, grad_input):
        dx, dprobs, dw1, db1, dw2, db2 = _mlp_backward_impl(layer_id, x, fc1_out, probs, dy, splits, grad_input,
                                                            last_use)
    elif grad_input is None:
        dx, dprobs, dw1, db1, dw2, db2 = torch.ops.sparsetrain.grouped_mlp_backward(
            layer_id, x, fc1_out, probs, dy, splits, params)
    else:
        dprobs, dw1, db1, dw2, db2 = torch.ops.sparsetrain.grouped_mlp_backward_into(
            layer_id, x, fc1_out, probs, dy, splits, params, grad_input)
    if grad_input is not None:
        dx = with_rows(grad_input, x.shape[0])
    w1, b1 = params[:nw1], params[nw1:nw1 + nb1]
    w2, b2 = params[nw1 + nb1:nw1 + nb1 + nw2], params[nw1 + nb1 + nw2:]
    return [dx, dprobs, *param_grads(dispositions[0], packed, w1, b1, dw1, db1),
            *param_grads(dispositions[1], packed, w2, b2, dw2, db2)]


class GroupedMLP(DelayedWgrad, nn.Module):
    """An MoE expert MLP over the row groups of one input: per expert,
    y = probs * (silu(a) * b) fc2.W^T + probs * fc2.b, with a, b the two halves of fc1's output
    (fc1: in -> 2 * ffn_hidden_size) or, with glu_interleave_size = k > 0, alternating blocks of
    k columns (columns [2jk, 2jk + k) are a's block j, the next k are b's).

    Parameters live in two GroupedLinear submodules, `fc1` and `fc2`, and are named like theirs:
    fc1.weight0..fc1.weight{G-1} [2F, in], fc2.weight0.. [out, F] (fc1.bias0.., fc2.bias0.. with
    bias=True), or with single_grouped_weight fc1.weight [G, 2F, in], fc2.weight [G, out, F] (and
    fc1.bias, fc2.bias). Options apply to both layers, and each weight takes Megatron's
    attributes as in GroupedLinear (main_grad, grad_added_to_main_grad, overwrite_main_grad; the
    last must agree across the two layers). Call the MLP's own forward and backward_dw, not the
    submodules': the MLP runs one fused C++ GroupedMLP over their parameters. backward_dw()
    computes both layers' oldest pending wgrads, then runs the registered hooks.
    """

    def __init__(self, num_gemms: int, in_features: int, ffn_hidden_size: int,
                 out_features: Optional[int] = None, bias: bool = False, *,
                 params_dtype: Optional[torch.dtype] = None, device: Union[torch.device, str, None] = None,
                 glu_interleave_size: int = 0, single_grouped_weight: bool = False,
                 fuse_wgrad_accumulation: bool = False, delay_wgrad_compute: bool = False,
                 check_device_splits: bool = False):
        super().__init__()
        out_features = in_features if out_features is None else out_features
        kw = dict(bias=bias, params_dtype=params_dtype, device=device, single_grouped_weight=single_grouped_weight,
                  fuse_wgrad_accumulation=fuse_wgrad_accumulation, delay_wgrad_compute=delay_wgrad_compute,
                  check_device_splits=check_device_splits)
        self.fc1 = GroupedLinear(num_gemms, in_features, 2 * ffn_hidden_size, **kw)
        self.fc2 = GroupedLinear(num_gemms, ffn_hidden_size, out_features, **kw)
        self.num_gemms, self.in_features, self.out_features = num_gemms, in_features, out_features
        self.ffn_hidden_size, self.glu_interleave_size = ffn_hidden_size, glu_interleave_size
        self.use_bias, self.single_grouped_weight = bias, single_grouped_weight
        self.fuse_wgrad_accumulation, self.delay_wgrad_compute = fuse_wgrad_accumulation, delay_wgrad_compute
        self.check_device_splits = check_device_splits
        self._init_layer_state()

    @property
    def splits_status(self) -> Tensor:
        """The sticky status word of CUDA m_splits (GroupedLinear.splits_status): fc1's, which
        the fused MLP uses for both layers."""
        return self.fc1.splits_status

    def _splits_status(self) -> Tensor:
        return self.fc1.splits_status

    def _layers(self) -> Tuple[GroupedLinear, GroupedLinear]:
        """(fc1, fc2), read from _modules: nn.Module's attribute lookup costs ~0.7 us each."""
        modules = self._modules
        return modules["fc1"], modules["fc2"]

    def _op_param_names(self) -> List[str]:
        return self.fc1._op_param_names("fc1.") + self.fc2._op_param_names("fc2.")

    def _make_native(self) -> Any:
        from .. import _torch_ops  # noqa: PLC0415  (loaded by _load_native)

        return _torch_ops.GroupedMLP(
            self.num_gemms, self.in_features, self.ffn_hidden_size, self.out_features, self.glu_interleave_size,
            self.single_grouped_weight, self.use_bias, self.fuse_wgrad_accumulation, self.delay_wgrad_compute,
            self.check_device_splits)

    def _native_params(self) -> Tuple[List[Tensor], List[bool]]:
        fc1, fc2 = self._layers()
        if not self.fuse_wgrad_accumulation:
            (t1, _), (t2, _) = unfused_native_params(fc1), unfused_native_params(fc2)
            return t1 + t2, [False, False, False]
        p1, p2 = fc1._param_tensors("fc1."), fc2._param_tensors("fc2.")
        check_same_overwrite(p1, p2)
        return p1.tensors() + p2.tensors(), [p1.overwrite, p1.has_attr, p2.has_attr]

    def forward(self, x: Tensor, m_splits: Union[Sequence[int], Tensor], probs: Tensor,
                out: Optional[Tensor] = None, grad_input: Optional[Tensor] = None) -> Tensor:
        """x [T, in] grouped by expert; m_splits as for GroupedLinear; probs fp32 [T] (the router
        probability of each row; it gets a gradient, fp32). out: optional [>= T, out] buffer
        written in place (rows >= S untouched); grad_input: optional [>= T, in] buffer for dx;
        as GroupedLinear's (>= S rows with host splits, neither requiring grad), and so is what a
        leaf x gets as .grad from it (GroupedLinear.forward: a view of the buffer above T rows,
        torch's copy at exactly T, a new tensor at S)."""
        check_buffer_args(x, out, grad_input)
        layers = self._layers()
        splits = layers[0]._normalize_splits(m_splits)
        params, counts, weight_lists = [], [], []
        for layer in layers:
            weights = layer.weights()
            weight_lists.append(weights)
            for group in (weights, layer.biases()):
                params += group
                counts.append(len(group))
        if without_autograd((x, probs), (splits, out, grad_input), params):
            return written(out, _mlp_forward_impl(self._id, x, splits, probs, grad_input, out)[0])
        dispositions = tuple(disposition_constant(self.delay_wgrad_compute, self.fuse_wgrad_accumulation,
                                                   layer._has_grad_added_attr(weights))
                             for layer, weights in zip(layers, weight_lists))
        if recorded(out, x, splits, grad_input) and native.direct(probs):
            self._hold_grad_accumulators(params)
            y, fc1_out = _mlp_forward_impl(self._id, x, splits, probs, grad_input)
            native.TORCH_OPS.record(y, [x, probs, *params], [x, fc1_out, probs, splits, *params],
                              functools.partial(_grouped_mlp_grads, self._id, dispositions, self.single_grouped_weight,
                                                grad_input, tuple(counts)))
            return y
        return _GroupedMLPFunction.apply(self._id, dispositions, self.single_grouped_weight, out, x, splits, probs,
                                         grad_input, tuple(counts), *params)

    def _accumulate_backward_dw(self) -> None:  # both layers' oldest pending wgrads
        dw1, db1, dw2, db2 = self._native("backward_dw")
        accumulate_layer_grads(self.fc1, dw1, db1)
        accumulate_layer_grads(self.fc2, dw2, db2)

    def extra_repr(self) -> str:
        return (f"num_gemms={self.num_gemms}, in_features={self.in_features}, "
                f"ffn_hidden_size={self.ffn_hidden_size}, out_features={self.out_features}, bias={self.use_bias}, "
                f"glu_interleave_size={self.glu_interleave_size}, single_grouped_weight={self.single_grouped_weight}, "
                f"fuse_wgrad_accumulation={self.fuse_wgrad_accumulation}, "
                f"delay_wgrad_compute={self.delay_wgrad_compute}")



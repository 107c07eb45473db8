"""sparsetrain.torch.GroupedMLP: fc1 -> SwiGLU x probs -> fc2 over the experts' row groups, one
fused C++ operator per direction (sparsetrain::grouped_mlp_*, autograd in C++) over two
GroupedLinear layers' parameters and options."""

from __future__ import annotations

from typing import Any, List, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor, nn

from . import native
from .fp8 import FP8_FLAG, fp8_enabled
from .grouped_linear import (DelayedWgrad, GroupedLinear, accumulate_layer_grads, call, check_buffer_args,
                             fake_check_devices, has_grad_added_flag, layer_grads_fake, layer_of, status_for)

# --- the operators' fakes ---------------------------------------------------------------------
# The same scheme as GroupedLinear's (grouped_linear.py): `params` is [fc1 weights, fc1 biases, fc2
# weights, fc2 biases], `main_grads` fc1's then fc2's; each layer's weight grad comes back as
# (dw, db) under that layer's weight-grad rule.


@torch.library.register_fake("sparsetrain::grouped_mlp_forward")
def _(layer_id, x, splits, probs, params, main_grads, flags, status=None, grad_input=None):
    fake_check_devices(layer_id, x, params, main_grads, probs=probs, grad_input=grad_input)
    m = layer_of(layer_id)
    return x.new_empty((x.shape[0], m.out_features)), x.new_empty((x.shape[0], 2 * m.ffn_hidden_size))


@torch.library.register_fake("sparsetrain::grouped_mlp_forward_into")
def _(layer_id, x, splits, probs, params, main_grads, flags, out, status=None, grad_input=None):
    fake_check_devices(layer_id, x, params, main_grads, probs=probs, out=out, grad_input=grad_input)
    return x.new_empty((x.shape[0], 2 * layer_of(layer_id).ffn_hidden_size))


def _mlp_grads_fake(layer_id, x, probs, flags):
    m = layer_of(layer_id)
    return (probs.new_empty((x.shape[0],), dtype=torch.float32),
            *layer_grads_fake(m.fc1, x, has_grad_added_flag(flags, 0)),
            *layer_grads_fake(m.fc2, x, has_grad_added_flag(flags, 1)))


@torch.library.register_fake("sparsetrain::grouped_mlp_backward")
def _(layer_id, x, fc1_out, probs, dy, splits, params, main_grads, flags, status=None, last_use=False):
    fake_check_devices(layer_id, x, params, main_grads, fc1_out=fc1_out, probs=probs, dy=dy)
    return (x.new_empty(x.shape), *_mlp_grads_fake(layer_id, x, probs, flags))


@torch.library.register_fake("sparsetrain::grouped_mlp_backward_into")
def _(layer_id, x, fc1_out, probs, dy, splits, params, main_grads, flags, grad_input, status=None, last_use=False):
    fake_check_devices(layer_id, x, params, main_grads, fc1_out=fc1_out, probs=probs, dy=dy, grad_input=grad_input)
    return _mlp_grads_fake(layer_id, x, probs, flags)


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
                 check_device_splits: bool = False, fp8: Optional[bool] = None):
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
        self.fp8 = fp8
        self._fp8_active = False  # the last forward's choice (fp8.py), which its backward_dw follows
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

    def _op_main_grad_names(self) -> List[str]:
        return self.fc1._op_main_grad_names("fc1.") + self.fc2._op_main_grad_names("fc2.")

    def _make_native(self) -> Any:
        return native.TORCH_OPS.GroupedMLP(
            self._id, self.num_gemms, self.in_features, self.ffn_hidden_size, self.out_features,
            self.glu_interleave_size, self.single_grouped_weight, self.use_bias, self.fuse_wgrad_accumulation,
            self.delay_wgrad_compute, self.check_device_splits)

    def _op_args(self) -> Tuple[List[Tensor], List[Tensor], int]:
        """(params, main_grads, flags) as the operators take them: flags bit 0 overwrite_main_grad
        (the two layers' must agree), bits 1 and 2 each layer's grad_added_to_main_grad, FP8_FLAG
        the last forward's FP8 choice (both layers)."""
        fc1, fc2 = self._layers()
        p1, m1, overwrite1, has1 = fc1._layer_args("fc1.")
        p2, m2, overwrite2, has2 = fc2._layer_args("fc2.")
        if overwrite1 != overwrite2:
            raise ValueError(f"fc2 weights' overwrite_main_grad: expected {overwrite1} (as fc1's), got {overwrite2}")
        fp8 = FP8_FLAG if self._fp8_active else 0
        return p1 + p2, m1 + m2, int(overwrite1) | int(has1) << 1 | int(has2) << 2 | fp8

    def forward(self, x: Tensor, m_splits: Union[Sequence[int], Tensor], probs: Tensor,
                out: Optional[Tensor] = None, grad_input: Optional[Tensor] = None) -> Tensor:
        """x [T, in] grouped by expert; m_splits as for GroupedLinear; probs fp32 [T] (the router
        probability of each row; it gets a gradient, fp32). out: optional [>= T, out] buffer
        written in place (rows >= S untouched); grad_input: optional [>= T, in] buffer for dx;
        as GroupedLinear's (>= S rows with host splits, neither requiring grad), and so is what a
        leaf x gets as .grad from it (GroupedLinear.forward: a view of the buffer above T rows,
        torch's copy at exactly T, a new tensor at S)."""
        check_buffer_args(x, out, grad_input)
        splits = self._layers()[0]._normalize_splits(m_splits)
        self._fp8_active = fp8_enabled(self.fp8)
        params, main_grads, flags = self._op_args()
        self._record((x, probs), params)
        status = status_for(splits, self)
        if out is None:
            return call("grouped_mlp_forward", self._id, x, splits, probs, params, main_grads, flags, status,
                        grad_input)[0]
        call("grouped_mlp_forward_into", self._id, x, splits, probs, params, main_grads, flags, out, status,
             grad_input)
        return out

    def _accumulate_backward_dw(self) -> None:  # both layers' oldest pending wgrads
        dw1, db1, dw2, db2 = self._native_layer.backward_dw(*self._op_args())
        accumulate_layer_grads(self.fc1, dw1, db1)
        accumulate_layer_grads(self.fc2, dw2, db2)

    def extra_repr(self) -> str:
        return (f"num_gemms={self.num_gemms}, in_features={self.in_features}, "
                f"ffn_hidden_size={self.ffn_hidden_size}, out_features={self.out_features}, bias={self.use_bias}, "
                f"glu_interleave_size={self.glu_interleave_size}, single_grouped_weight={self.single_grouped_weight}, "
                f"fuse_wgrad_accumulation={self.fuse_wgrad_accumulation}, "
                f"delay_wgrad_compute={self.delay_wgrad_compute}")



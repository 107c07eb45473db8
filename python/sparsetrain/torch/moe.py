"""The MoE layer's torch front (sparsetrain.torch.MoELayer, sparsetrain.torch.moe_route): the layer
as the C++ torch library's operators sparsetrain::moe_layer_forward / _backward (moe_layer.h's
MoELayer: the router, the tokens' rows moved by gathers in both directions, the experts' fused MLP,
the deterministic combine; autograd in C++), the router alone as moe_route / _backward, and their
fake implementations here, for torch.compile. The experts' parameters live in a
sparsetrain.torch.GroupedMLP. CPU or CUDA tensors (on CUDA the counts reach the experts as device
splits: no host synchronisation)."""

from __future__ import annotations

from typing import Any, Callable, List, NamedTuple, Optional, Tuple, Union

import torch
from torch import Tensor, nn

from .._moe import ROUTER_SCORES
from . import native
from .fp8 import FP8_FLAG, fp8_enabled
from .grouped_linear import DelayedWgrad, accumulate_layer_grads, call, fake_check_devices, has_grad_added_flag, \
    layer_grads_fake, layer_of
from .grouped_mlp import GroupedMLP


# The router's operators (python/src/torch_moe.cpp; autograd in C++: the gradients of probs and
# score_sum reach the logits through sparsetrain::moe_route_backward), the forward's OpOverload
# bound once.
_ROUTE = torch.ops.sparsetrain.moe_route.default


# Shapes only, for FakeTensorMode, meta tensors and torch.compile (Python, so that symbolic shapes
# pass through): route()'s outputs, each contiguous.
@torch.library.register_fake("sparsetrain::moe_route")
def _(logits, expert_bias, top_k, score, normalize):
    N, E = logits.shape
    i32 = torch.int32
    return (logits.new_empty((N, top_k), dtype=i32), logits.new_empty((N, top_k), dtype=torch.float32),
            logits.new_empty((E,), dtype=torch.int64), logits.new_empty((N, top_k), dtype=i32),
            logits.new_empty((N * top_k,), dtype=i32), logits.new_empty((E,), dtype=torch.float32))


@torch.library.register_fake("sparsetrain::moe_route_backward")
def _(logits, experts, dprobs, dscore_sum, top_k, score, normalize):
    return logits.new_empty(logits.shape, dtype=torch.float32)


@torch.library.register_fake("sparsetrain::moe_layer_forward")
def _(layer_id, x, logits, expert_bias, params, main_grads, flags):
    """(out, experts, probs, counts, row_of, token_of_row, score_sum, rows, row_probs, fc1_out,
    fc1_out_scales)."""
    fake_check_devices(layer_id, x, params, main_grads, logits=logits, expert_bias=expert_bias)
    m = layer_of(layer_id)
    N, k, E, i32 = x.shape[0], m.top_k, m.num_experts, torch.int32
    f32 = dict(dtype=torch.float32)
    rows = x.new_empty(0) if m.recompute_expert_input else x.new_empty((N * k, x.shape[1]))
    width = 2 * m.experts.ffn_hidden_size
    if m.fp8_saved_activations and flags & FP8_FLAG:  # e4m3 codes, a scale per row and 128 columns
        fc1_out = x.new_empty((N * k, width), dtype=torch.uint8)
        scales = x.new_empty((N * k * (-(-width // 128)),), **f32)
    else:
        fc1_out, scales = x.new_empty((N * k, width)), x.new_empty((0,), **f32)
    return (x.new_empty(x.shape), x.new_empty((N, k), dtype=i32), x.new_empty((N, k), **f32),
            x.new_empty((E,), dtype=torch.int64), x.new_empty((N, k), dtype=i32), x.new_empty((N * k,), dtype=i32),
            x.new_empty((E,), **f32), rows, x.new_empty((N * k,), **f32), fc1_out, scales)


@torch.library.register_fake("sparsetrain::moe_layer_backward")
def _(layer_id, x, logits, experts, counts, row_of, token_of_row, rows, row_probs, fc1_out, fc1_out_scales, dout,
      dscore_sum, params, main_grads, flags):
    """(dx, dlogits, fc1's dw, db, fc2's dw, db)."""
    fake_check_devices(layer_id, x, params, main_grads, logits=logits, dout=dout)
    m = layer_of(layer_id).experts
    return (x.new_empty(x.shape), logits.new_empty(logits.shape, dtype=torch.float32),
            *layer_grads_fake(m.fc1, x, has_grad_added_flag(flags, 0)),
            *layer_grads_fake(m.fc2, x, has_grad_added_flag(flags, 1)))


class RoutedTokens(NamedTuple):
    """moe_route's result (sparsetrain.RoutedTokens' fields, as torch tensors): probs and
    score_sum carry gradients to the logits."""
    experts: Tensor
    probs: Tensor
    counts: Tensor
    row_of: Tensor
    token_of_row: Tensor
    score_sum: Tensor


def moe_route(logits: Tensor, top_k: int, *, score: str = "softmax", normalize: bool = False,
              expert_bias: Optional[Tensor] = None) -> RoutedTokens:
    """sparsetrain.route for torch under autograd and torch.compile: fp32 logits [N, E] ->
    RoutedTokens (see sparsetrain.route for the rules: choice, ties, normalisation, layout). The
    gradient of probs and of score_sum flows back to the logits; expert_bias gets none."""
    return RoutedTokens(*_ROUTE(logits, expert_bias, int(top_k), score, bool(normalize)))


def check_layer_inputs(layer: nn.Module, x: Tensor, logits: Tensor) -> None:
    if x.dim() != 2 or x.shape[1] != layer.hidden_size:
        raise ValueError(f"x: expected shape [N, hidden = {layer.hidden_size}], got {list(x.shape)}")
    if logits.dim() != 2 or tuple(logits.shape) != (x.shape[0], layer.num_experts):
        raise ValueError(f"logits: expected shape [N = {x.shape[0]}, E = {layer.num_experts}], "
                         f"got {list(logits.shape)}")



class MoEOutput(NamedTuple):
    """MoELayer's result: out [N, hidden]; score_sum fp32 [E] (each expert's router score summed
    over the tokens, differentiable: the statistic of an auxiliary load-balancing loss); counts
    int64 [E] (tokens per expert)."""
    out: Tensor
    score_sum: Tensor
    counts: Tensor


class MoELayer(DelayedWgrad, nn.Module):
    """A dropless MoE block after the router's own linear layer: each token's top_k experts by
    the router logits (moe_route: softmax or sigmoid scores, optional normalisation and
    choice-only expert bias), the tokens' rows laid out by expert, the experts' MLPs (`experts`, a
    sparsetrain.torch.GroupedMLP holding their parameters, with its options: main_grad, delayed
    wgrad), each row scaled by its probability, and each token's top_k rows summed (in slot order,
    by gathers: deterministic). Gradients reach x, the logits (through the probs and, if used,
    score_sum) and the experts' parameters. One C++ operator per direction, sparsetrain's C++
    MoELayer (moe_layer.h). With delay_wgrad_compute, the layer's own backward_dw() computes the
    experts' pending wgrads and then runs the hooks registered on it or on `experts`.
    recompute_expert_input (default True): backward gathers x's rows for the experts again rather
    than holding them from the forward (N x top_k x hidden elements less held between forward and
    backward, for one more gather: 0.1-1.3 % of the layer's fwd + bwd on an H200; the same
    results, bitwise); False keeps the rows. fp8_saved_activations (default False): in the calls
    that run FP8 (`fp8`, or fp8_autocast), the experts' fc1 output is held for backward as e4m3
    codes with a power-of-two scale per row and 128 columns (0.53x its bytes; restored exactly in
    backward), for a quantizing pass in forward and a restoring one in backward."""

    def __init__(self, num_experts: int, hidden_size: int, ffn_hidden_size: int, top_k: int, *,
                 score: str = "softmax", normalize: bool = False, bias: bool = False,
                 params_dtype: Optional[torch.dtype] = None, device: Union[torch.device, str, None] = None,
                 glu_interleave_size: int = 0, single_grouped_weight: bool = False,
                 fuse_wgrad_accumulation: bool = False, delay_wgrad_compute: bool = False,
                 recompute_expert_input: bool = True, fp8: Optional[bool] = None,
                 fp8_saved_activations: bool = False):
        super().__init__()
        if score not in ROUTER_SCORES:
            raise ValueError(f"score: expected one of {', '.join(ROUTER_SCORES)}, got {score}")
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k: expected 1 <= top_k <= num_experts = {num_experts}, got {top_k}")
        self.num_experts, self.hidden_size, self.top_k = num_experts, hidden_size, top_k
        self.score, self.normalize = score, normalize
        self.recompute_expert_input = bool(recompute_expert_input)
        self.fp8_saved_activations = bool(fp8_saved_activations)
        self.delay_wgrad_compute = delay_wgrad_compute
        self.experts = GroupedMLP(num_experts, hidden_size, ffn_hidden_size, hidden_size, bias=bias,
                                  params_dtype=params_dtype, device=device, glu_interleave_size=glu_interleave_size,
                                  single_grouped_weight=single_grouped_weight,
                                  fuse_wgrad_accumulation=fuse_wgrad_accumulation,
                                  delay_wgrad_compute=delay_wgrad_compute, fp8=fp8)
        self._init_layer_state()

    def _make_native(self) -> Any:
        e = self.experts
        return native.TORCH_OPS.MoELayer(
            self._id, self.num_experts, self.hidden_size, e.ffn_hidden_size, self.top_k, self.score,
            self.normalize, e.glu_interleave_size, e.single_grouped_weight, e.use_bias, e.fuse_wgrad_accumulation,
            e.delay_wgrad_compute, self.recompute_expert_input, self.fp8_saved_activations)

    def _op_args(self) -> Tuple[List[Tensor], List[Tensor], int]:
        return self.experts._op_args()

    def _op_param_names(self) -> List[str]:
        return ["experts." + n for n in self.experts._op_param_names()]

    def _op_main_grad_names(self) -> List[str]:
        return ["experts." + n for n in self.experts._op_main_grad_names()]

    def forward(self, x: Tensor, logits: Tensor, expert_bias: Optional[Tensor] = None) -> MoEOutput:
        """x [N, hidden] (the experts' dtype), logits fp32 [N, E], expert_bias optional fp32 [E]."""
        check_layer_inputs(self, x, logits)
        self.experts._fp8_active = fp8_enabled(self.experts.fp8)  # the experts' fp8 argument is the layer's
        params, main_grads, flags = self._op_args()
        self._record((x, logits), params)
        r = call("moe_layer_forward", self._id, x, logits, expert_bias, params, main_grads, flags)
        return MoEOutput(r[0], r[6], r[3])

    def register_wgrad_accumulation_and_reduce_hooks(self, hook: Callable[[], None]) -> None:
        """`hook()` runs after each backward_dw() (as one registered on `experts` does)."""
        self.experts.register_wgrad_accumulation_and_reduce_hooks(hook)

    def backward_dw(self) -> None:
        """The experts' oldest pending delayed wgrads (into main_grad when fused, else into their
        .grad, and bias grads), then the hooks registered on the layer or on `experts`."""
        if not self.delay_wgrad_compute:
            return
        with torch.no_grad():
            dw1, db1, dw2, db2 = self._native_layer.backward_dw(*self._op_args())
            accumulate_layer_grads(self.experts.fc1, dw1, db1)
            accumulate_layer_grads(self.experts.fc2, dw2, db2)
        for hook in self.experts._hooks:
            hook()

"""The MoE layer's torch front (sparsetrain.torch.MoELayer, sparsetrain.torch.moe_route): the router
as the C++ torch library's operators (the rules of moe_router.h, autograd in C++; fake
implementations here, for torch.compile), the tokens' rows moved by gathers in both directions (no
scatter, no atomics: deterministic on every device), and the experts as a
sparsetrain.torch.GroupedMLP. CPU or CUDA tensors (on CUDA the counts reach the experts as device
splits: no host synchronisation)."""

from __future__ import annotations

from typing import NamedTuple, Optional, Union

import torch
from torch import Tensor, nn

from .._moe import ROUTER_SCORES
from . import native  # noqa: F401  (loads the C++ torch library, which defines the router's operators)
from .token_rows import combine, expert_rows, regathered_in_backward
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


class MoELayer(nn.Module):
    """A dropless MoE block after the router's own linear layer: each token's top_k experts by
    the router logits (moe_route: softmax or sigmoid scores, optional normalisation and
    choice-only expert bias), the tokens' rows laid out by expert, the experts' MLPs (`experts`, a
    sparsetrain.torch.GroupedMLP: its options, main_grad and delayed wgrad with backward_dw), each
    row scaled by its probability, and each token's top_k rows summed (in slot order, by gathers:
    deterministic). Gradients reach x, the logits (through the probs and, if used, score_sum) and
    the experts' parameters. The same as sparsetrain's C++ MoELayer (moe_layer.h).
    recompute_expert_input (default True): the experts save x's gathered rows for backward as x and
    the row map, and backward gathers them again (N x top_k x hidden elements less held between
    forward and backward, for one more gather: 0.1-1.3 % of the layer's fwd + bwd on an H200; the
    same results, bitwise); False keeps the rows. Eager mode (saved-tensor hooks): under
    torch.compile, and with delay_wgrad_compute (the pending wgrad keeps its own reference), the
    rows are kept as without it."""

    def __init__(self, num_experts: int, hidden_size: int, ffn_hidden_size: int, top_k: int, *,
                 score: str = "softmax", normalize: bool = False, bias: bool = False,
                 params_dtype: Optional[torch.dtype] = None, device: Union[torch.device, str, None] = None,
                 glu_interleave_size: int = 0, single_grouped_weight: bool = False,
                 fuse_wgrad_accumulation: bool = False, delay_wgrad_compute: bool = False,
                 recompute_expert_input: bool = True):
        super().__init__()
        if score not in ROUTER_SCORES:
            raise ValueError(f"score: expected one of {', '.join(ROUTER_SCORES)}, got {score}")
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k: expected 1 <= top_k <= num_experts = {num_experts}, got {top_k}")
        self.num_experts, self.hidden_size, self.top_k = num_experts, hidden_size, top_k
        self.score, self.normalize = score, normalize
        self.recompute_expert_input = bool(recompute_expert_input)
        self.experts = GroupedMLP(num_experts, hidden_size, ffn_hidden_size, hidden_size, bias=bias,
                                  params_dtype=params_dtype, device=device, glu_interleave_size=glu_interleave_size,
                                  single_grouped_weight=single_grouped_weight,
                                  fuse_wgrad_accumulation=fuse_wgrad_accumulation,
                                  delay_wgrad_compute=delay_wgrad_compute)

    def forward(self, x: Tensor, logits: Tensor, expert_bias: Optional[Tensor] = None) -> MoEOutput:
        """x [N, hidden] (the experts' dtype), logits fp32 [N, E], expert_bias optional fp32 [E]."""
        check_layer_inputs(self, x, logits)
        r = moe_route(logits, self.top_k, score=self.score, normalize=self.normalize, expert_bias=expert_bias)
        rows = expert_rows(x, r)
        if self.recompute_expert_input and torch.is_grad_enabled() and not torch.compiler.is_compiling():
            with regathered_in_backward(rows, x):
                y = self.experts(rows.x, r.counts, rows.probs)
        else:
            y = self.experts(rows.x, r.counts, rows.probs)
        return MoEOutput(combine(y, rows), r.score_sum, r.counts)

    def backward_dw(self) -> None:
        """The experts' delayed wgrads (GroupedMLP.backward_dw)."""
        self.experts.backward_dw()

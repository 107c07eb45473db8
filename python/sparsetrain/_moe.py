"""The MoE router over arrays (moe_router.h): numpy arrays, torch CPU or CUDA tensors (on CUDA on
the current stream, without a host synchronisation)."""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

from . import _C
from ._arrays import Framework, to_core

ROUTER_SCORES = ("softmax", "sigmoid")


class RoutedTokens(NamedTuple):
    """route()'s result. experts int32 [N, top_k] (each token's experts in choice order), probs
    fp32 [N, top_k], counts int64 [E] (tokens per expert: the grouped layers' splits), row_of int32
    [N, top_k] (the row of each (token, slot) in the expert-major layout), token_of_row int32
    [N * top_k] (the token each row holds), score_sum fp32 [E] (each expert's score summed over the
    tokens: the statistic of an auxiliary load-balancing loss)."""
    experts: Any
    probs: Any
    counts: Any
    row_of: Any
    token_of_row: Any
    score_sum: Any


def _num_experts(logits: Any) -> int:
    shape = tuple(getattr(logits, "shape", ()))
    if len(shape) != 2:
        raise ValueError(f"logits: expected a 2-d array [N, E] (router logits), got shape {list(shape)}")
    return int(shape[1])


def route(logits: Any, top_k: int, *, score: str = "softmax", normalize: bool = False, expert_bias: Any = None,
          stream: Optional[int] = None) -> RoutedTokens:
    """Top-k routing of fp32 logits [N, E]: scores by softmax over the experts or sigmoid per
    expert; the top_k experts by score + expert_bias (optional fp32 [E], for the choice only),
    ties to the lower expert id, NaN last; probs their scores, divided by their sum with
    `normalize` (Mixtral's softmax over the chosen, DeepSeek-V3's sigmoid normalisation). The
    layout is a function of the choice alone: expert e's rows follow those of the experts before
    it and hold its tokens in token order."""
    fw = Framework.of(logits)
    num_experts = _num_experts(logits)
    out = _C.moe_route(to_core(logits), None if expert_bias is None else to_core(expert_bias),
                       num_experts, int(top_k), score, bool(normalize),
                       fw.stream_of(logits) if stream is None else int(stream), fw.allocate)
    return RoutedTokens(*(fw.view(t) for t in out))


def route_backward(logits: Any, experts: Any, dprobs: Any, top_k: int, *, score: str = "softmax",
                   normalize: bool = False, dscore_sum: Any = None, stream: Optional[int] = None) -> Any:
    """The gradient of the logits (fp32 [N, E]) from route()'s experts for the same logits and the
    gradients of its probs (fp32 [N, top_k]) and, optionally, of its score sums (fp32 [E]); the
    choice itself is a constant."""
    fw = Framework.of(logits)
    num_experts = _num_experts(logits)
    out = _C.moe_route_backward(to_core(logits), to_core(experts), to_core(dprobs),
                                None if dscore_sum is None else to_core(dscore_sum), num_experts,
                                int(top_k), score, bool(normalize),
                                fw.stream_of(logits) if stream is None else int(stream), fw.allocate)
    return fw.view(out)


def combine_rows(rows: Any, row_of: Any, *, stream: Optional[int] = None) -> Any:
    """The MoE layer's combine: out [N, H] with out[n] = the sum over slots i of rows[row_of[n, i]]
    (rows [R, H] bf16, fp16 or fp32; row_of int32 [N, K], route()'s), in fp32 from 0 in slot order,
    rounded once: also the gradient of gathering rows by token_of_row, without atomics (the same
    bits on every call). Entries of row_of must lie in [0, R) (checked for host arrays)."""
    fw = Framework.of(rows)
    return fw.view(_C.moe_combine_rows(to_core(rows), to_core(row_of),
                                       fw.stream_of(rows) if stream is None else int(stream), fw.allocate))

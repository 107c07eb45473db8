"""Hugging Face transformers (5.x) on sparsetrain's kernels: importing this module registers
`experts_implementation="sparsetrain"` in transformers' ExpertsInterface.

    import sparsetrain.integrations.transformers  # noqa: F401  (registers "sparsetrain")
    model = AutoModelForCausalLM.from_config(config, experts_implementation="sparsetrain")

The experts of a family decorated with `@use_experts_implementation` (Qwen3-MoE, Mixtral,
DeepSeek-V3 and most MoE families) then run as one sparsetrain GroupedMLP over the module's own
parameters (`gate_up_proj` [E, 2I, H] and `down_proj` [E, H, I], no copies; their biases where the
family has them): the tokens' rows laid out by expert and summed back by gathers (deterministic),
the router probability applied inside the fused SwiGLU, device splits (no host sync). The family's
router is its own (DeepSeek-V3's expert bias and group limits included): only the experts change.
Under `sparsetrain.torch.fp8_autocast()` the experts run the FP8 recipe (bf16 models, sizes
multiples of 16, no biases). What the kernels do not compute is refused with an error that names
it: an activation other than SiLU, a family's own gate (gpt-oss's clamped SwiGLU), transposed
weights, a post-expert norm, transformers' expert parallelism.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor, nn
from transformers.integrations.moe import ExpertsInterface, _default_apply_gate

from ..torch.grouped_mlp import GroupedMLP
from ..torch.token_rows import Rows

NAME = "sparsetrain"


class _ExpertRows(NamedTuple):
    """top_k_index [N, k]'s layout as the experts' rows, expert-major (token order inside an
    expert): row_of [N, k] (int32), token_of_row [N * k], flat_of_row [N * k] ((token, slot) of a
    row), flat_row (its inverse), counts [E] (int64, the splits)."""
    row_of: Tensor
    token_of_row: Tensor
    flat_of_row: Tensor
    flat_row: Tensor
    counts: Tensor


def _expert_rows(top_k_index: Tensor, num_experts: int) -> _ExpertRows:
    k = top_k_index.shape[1]
    experts = top_k_index.reshape(-1)
    flat_of_row = torch.argsort(experts, stable=True)
    flat_row = torch.empty_like(flat_of_row)
    flat_row[flat_of_row] = torch.arange(flat_of_row.numel(), device=flat_of_row.device)
    counts = torch.bincount(experts, minlength=num_experts)
    return _ExpertRows(flat_row.view(-1, k).to(torch.int32), flat_of_row // k, flat_of_row, flat_row, counts)


def _unsupported(experts: nn.Module) -> str | None:
    """What of `experts` the sparsetrain GroupedMLP does not compute, or None."""
    act = str(getattr(experts.config, "hidden_act", "silu")).lower()
    if act not in ("silu", "swish"):
        return f"the {act!r} activation (sparsetrain's experts are SwiGLU: silu)"
    if not getattr(experts, "has_gate", True):
        return "experts without a gate (sparsetrain's experts are SwiGLU)"
    if type(experts)._apply_gate is not _default_apply_gate:
        return (f"{type(experts).__name__}'s own gate (_apply_gate: e.g. gpt-oss's clamped SwiGLU), not "
                "silu(gate) * up")
    if getattr(experts, "is_transposed", False):
        return "transposed expert weights ([E, H, 2I]; sparsetrain takes [E, 2I, H] and [E, H, I])"
    if getattr(experts, "has_post_expert_norm", False):
        return "a post-expert norm"
    if getattr(experts, "_is_expert_parallel", False):
        return "transformers' expert parallelism (sparsetrain.torch.ExpertParallelMoELayer is sparsetrain's own)"
    return None


def _mlp_for(experts: nn.Module, x: Tensor) -> GroupedMLP:
    """The GroupedMLP that runs `experts` (made at its first call, again when its parameters or
    device change): its parameters are the module's own, shared, and it is not a submodule (the
    model's parameters and state dict are unchanged)."""
    w1, w2 = experts.gate_up_proj, experts.down_proj
    has_bias = bool(getattr(experts, "has_bias", False))
    mlp = experts.__dict__.get("_sparsetrain_mlp")
    if (mlp is not None and mlp.fc1.weight is w1 and mlp.fc2.weight is w2
            and mlp.fc1.splits_status.device == x.device):
        return mlp
    E, two_i, H = w1.shape
    if tuple(w2.shape) != (E, H, two_i // 2) or two_i % 2:
        raise ValueError(f"{type(experts).__name__}: expected gate_up_proj [E, 2I, H] and down_proj [E, H, I], "
                         f"got {list(w1.shape)} and {list(w2.shape)}")
    interleave = 0 if getattr(experts, "is_concatenated", True) else 1
    mlp = GroupedMLP(E, H, two_i // 2, H, bias=has_bias, params_dtype=w1.dtype, device="meta",
                     glu_interleave_size=interleave, single_grouped_weight=True)
    mlp.fc1.weight, mlp.fc2.weight = w1, w2
    if has_bias:
        mlp.fc1.bias, mlp.fc2.bias = experts.gate_up_proj_bias, experts.down_proj_bias
    for layer in (mlp.fc1, mlp.fc2):
        layer.splits_status = torch.zeros(1, dtype=torch.int32, device=x.device)
    experts.__dict__["_sparsetrain_mlp"] = mlp
    return mlp


def sparsetrain_experts_forward(self: nn.Module, hidden_states: Tensor, top_k_index: Tensor,
                                top_k_weights: Tensor) -> Tensor:
    """The experts' output [N, H] for hidden_states [N, H], each token's top_k experts
    (top_k_index [N, k]) and their weights (top_k_weights [N, k]): transformers' experts forward."""
    problem = _unsupported(self)
    if problem is not None:
        raise ValueError(f'experts_implementation="{NAME}": {type(self).__name__} has {problem}; '
                         'use another experts_implementation for this model')
    mlp = _mlp_for(self, hidden_states)
    r = _expert_rows(top_k_index, mlp.num_gemms)
    x = Rows.apply(hidden_states, r.token_of_row, r.row_of)
    probs = Rows.apply(top_k_weights.reshape(-1).float(), r.flat_of_row, r.flat_row)
    y = mlp(x, r.counts, probs)
    return Rows.apply(y, r.row_of, r.token_of_row)


ExpertsInterface.register(NAME, sparsetrain_experts_forward)

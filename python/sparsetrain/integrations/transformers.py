"""Hugging Face transformers (5.x) on sparsetrain's kernels: importing this module registers
`attn_implementation="sparsetrain"` (AttentionInterface, with its mask rule in
AttentionMaskInterface) and `experts_implementation="sparsetrain"` (ExpertsInterface).

    import sparsetrain.integrations.transformers  # noqa: F401  (registers "sparsetrain")
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sparsetrain",
                                             experts_implementation="sparsetrain")

Attention: sparsetrain.torch.block_sparse_attention over a BlockMask made from what the model
passes: causal (bottom-right when a cache makes the keys outnumber the queries), bidirectional, a
sliding window (`sliding_window` W: the last W keys, Mistral's and Gemma's layers), packed
documents (transformers' flash-attention kwargs cu_seq_lens_q / cu_seq_lens_k, or packed
position_ids as DataCollatorWithFlattening gives them, found by transformers' own rule, which reads
one flag back per forward as it does for its own masks), padding (the 2-D mask: padded keys
are a document of their own), GQA without repeating k and v; the backward deterministic (the
library's default). Masks are made once per shape and kept (documents: once per position_ids).
Refused with an error that names it: attention dropout, logit softcapping, attention sinks
(gpt-oss), a sliding window with documents or padding, or with a cache. Head dims and dtypes are
the kernels' (CUDA: bf16 / fp16, D 64, 96 or 128; the CPU reference: any).

Experts: those of a family decorated with `@use_experts_implementation` (Qwen3-MoE, Mixtral,
DeepSeek-V3 and most MoE families) run as one sparsetrain GroupedMLP over the module's own
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
from transformers.masking_utils import AttentionMaskInterface, find_packed_sequence_indices, flash_attention_mask
from transformers.modeling_utils import AttentionInterface

from .._block_mask import BlockMask
from ._masks import LastMade, shape_mask
from ..torch.attention import block_sparse_attention
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
    # The gate is transformers' default (_unsupported): silu of gate_up's first half times its second,
    # GroupedMLP's layout with no interleave (whatever the class's is_concatenated says).
    mlp = GroupedMLP(E, H, two_i // 2, H, bias=has_bias, params_dtype=w1.dtype, device="meta",
                     single_grouped_weight=True)
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


# --- attention ----------------------------------------------------------------------------------

_DOCUMENTS = LastMade()  # the last documents' mask, by (form, sizes) and the tensor it came from
_PACKED = LastMade()  # the last position_ids' documents (None: not packed)


def _packed_documents(position_ids: Tensor, seq: int) -> Tensor | None:
    """The documents [B, S] of packed rows, or None: transformers' rule (find_packed_sequence_indices:
    a new document where a position does not follow the previous one; it reads the result back,
    once per position_ids, i.e. once per forward, as transformers does for its own masks)."""
    return _PACKED.get(position_ids, lambda: find_packed_sequence_indices(position_ids.reshape(-1, seq)))


def _attention_mask(module: nn.Module, query: Tensor, key: Tensor, attention_mask: Tensor | None,
                    sliding_window: int | None, kwargs: dict) -> BlockMask:
    seq_q, seq_kv, dev = query.shape[2], key.shape[2], query.device
    causal = bool(getattr(module, "is_causal", True))
    cu_q = kwargs.get("cu_seq_lens_q")
    position_ids = kwargs.get("position_ids")
    packed = None
    if cu_q is None and attention_mask is None and position_ids is not None and seq_q == seq_kv:
        packed = _packed_documents(position_ids, seq_q)
    documents = cu_q is not None or attention_mask is not None or packed is not None
    if sliding_window is not None and (documents or seq_q != seq_kv or not causal):
        raise ValueError(f'attn_implementation="{NAME}": a sliding window is supported on causal, unpacked, '
                         "unpadded sequences without a cache (no sliding window within documents yet)")
    if sliding_window is not None:
        return shape_mask("sliding_window", seq_q, seq_kv, dev, window_left=int(sliding_window) - 1)
    kind = "document_causal" if causal else "document"
    if cu_q is not None:  # transformers' flash-attention kwargs: one packed row
        cu_k = kwargs.get("cu_seq_lens_k", cu_q)
        return _DOCUMENTS.get(cu_q, key=("cu", seq_q, seq_kv, causal), build=lambda: BlockMask.from_cu_seqlens(
            cu_q.to(torch.int32), cu_k.to(torch.int32), seq_q=seq_q, seq_kv=seq_kv, causal=causal, device=dev))
    if attention_mask is not None:  # flash_attention_mask's 2-D mask [B, seq_kv]: padded keys a document apart
        if attention_mask.dim() != 2 or seq_q != seq_kv:
            raise ValueError(f'attn_implementation="{NAME}": expected a 2-D padding mask and no cache, got a '
                             f"{attention_mask.dim()}-D mask with {seq_q} queries and {seq_kv} keys")
        return _DOCUMENTS.get(attention_mask, key=("pad", seq_q, causal), build=lambda: BlockMask.build(
            kind, seq_q, document_ids=(~attention_mask.bool()).to(torch.int32), device=dev))
    if packed is not None:  # DataCollatorWithFlattening's rows
        return _DOCUMENTS.get(position_ids, key=("pos", seq_q, causal), build=lambda: BlockMask.build(
            kind, seq_q, document_ids=packed.to(torch.int32), device=dev))
    if not causal:
        return shape_mask("full", seq_q, seq_kv, dev)
    return shape_mask("causal" if seq_q == seq_kv else "causal_bottom_right", seq_q, seq_kv, dev)


def sparsetrain_attention_forward(module: nn.Module, query: Tensor, key: Tensor, value: Tensor,
                                  attention_mask: Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                                  sliding_window: int | None = None, softcap: float | None = None,
                                  **kwargs) -> tuple[Tensor, None]:
    """transformers' attention function: query [B, Hq, Sq, D], key and value [B, Hkv, Skv, D] ->
    ([B, Sq, Hq, D], no weights)."""
    for what, present in (("attention dropout (set attention_dropout=0)", dropout and module.training),
                          ("logit softcapping", softcap is not None),
                          ("attention sinks (s_aux: gpt-oss)", kwargs.get("s_aux") is not None)):
        if present:
            raise ValueError(f'attn_implementation="{NAME}" does not support {what}; use another attn_implementation')
    mask = _attention_mask(module, query, key, attention_mask, sliding_window, kwargs)
    out = block_sparse_attention(query, key, value, mask, scale=scaling)
    return out.transpose(1, 2), None


AttentionInterface.register(NAME, sparsetrain_attention_forward)
# The mask transformers makes for us: flash-attention's (None, or the 2-D padding mask).
AttentionMaskInterface.register(NAME, flash_attention_mask)
ExpertsInterface.register(NAME, sparsetrain_experts_forward)

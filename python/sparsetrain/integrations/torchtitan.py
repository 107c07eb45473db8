"""torchtitan (0.2) on sparsetrain's kernels: model converters named "sparsetrain" (experts and
attention) and "sparsetrain_experts" (the experts alone), registered when this module is
imported, which torchtitan's job config selects:

    --experimental.custom_import sparsetrain.integrations.torchtitan --model.converters sparsetrain

(or `[experimental] custom_import` and `[model] converters` in a TOML config); in Python,
`sparsetrain.integrations.torchtitan.convert(model)` does the same to a torchtitan model.

Experts: each `GroupedExperts` (the MoE of llama4, qwen3, deepseek_v3, ...) runs as one
sparsetrain GroupedMLP over its rows, which torchtitan has already grouped by expert (and scaled
by the router's scores when score_before_experts; the MLP's probabilities are then 1), with its
counts as device splits: no host sync, and none of torchtitan's padding of each expert's rows to a
multiple of 8 (its indices_padding_wrapper). torchtitan keeps the gate and up weights apart (w1
and w3 [E, F, D]); sparsetrain's GroupedMLP reads them as one [E, 2F, D] tensor, so each forward
copies them into one (torch.cat: 2 E F D elements, its backward two views). The router, the
token reordering and the combine stay torchtitan's: only the experts' computation changes.

Attention: each inner attention module runs sparsetrain's block_sparse_attention (deterministic
backward) over a sparsetrain BlockMask made from what the model passes:
- ScaledDotProductAttentionWrapper (attn_type "sdpa"): causal (is_causal) or full;
- FlexAttentionWrapper ("flex"): the model's masks of attn_mask_type "causal" and "block_causal"
  (documents between eos tokens, torchtitan's rule) are built by sparsetrain on the device from
  the batch, beside the flex mask torchtitan makes (the converter wraps the model's
  get_attention_masks); any other flex BlockMask is converted with BlockMask.from_torch, once per
  mask object (it reads the mask back to the host);
- VarlenAttentionWrapper ("varlen"): the batch's cu_seqlens as packed documents (causal within
  each), once per batch.
torch.compile (torchtitan's compile.enable, fullgraph blocks): the experts, sdpa and flex
attention. Their masks are made outside the compiled blocks (sdpa's by a forward pre-hook of the
model, flex's in get_attention_masks) and reach them as inputs, so a new batch's documents do not
recompile them.
Refused with an error that names it: torchtitan's expert parallelism and context parallelism, a
flex score_mod, return_lse, under torch.compile varlen attention and a flex mask of another
attn_mask_type, query / key and value head dims that differ (deepseek_v3's MLA: its
experts convert alone with "sparsetrain_experts");
head dims and dtypes are the kernels' (CUDA: bf16 / fp16, D 64, 96 or 128; the CPU reference: any).
"""

from __future__ import annotations

import types

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from torch.nn.attention.flex_attention import BlockMask as FlexBlockMask
from torchtitan.models.attention import (FlexAttentionWrapper, ScaledDotProductAttentionWrapper,
                                         VarlenAttentionWrapper, VarlenMetadata)
from torchtitan.models.moe.moe import GroupedExperts
from torchtitan.protocols.model_converter import register_model_converter

from .._block_mask import BlockMask
from ._masks import LastMade, shape_mask
from ..torch.attention import block_sparse_attention
from ..torch.grouped_linear import call
from ..torch.grouped_mlp import GroupedMLP

NAME = "sparsetrain"


def _refuse(what: str) -> ValueError:
    return ValueError(f'model converter "{NAME}" does not support {what}; leave "{NAME}" out of model.converters '
                      "for this model")


# --- experts ------------------------------------------------------------------------------------


def _local(w: Tensor) -> Tensor:
    """A weight as this rank computes with it (torchtitan's own rule: a DTensor's local shard)."""
    if isinstance(w, DTensor):
        if "ep" in (w.device_mesh.mesh_dim_names or ()):
            raise _refuse("torchtitan's expert parallelism (sparsetrain.torch.ExpertParallelMoELayer is "
                          "sparsetrain's own)")
        return w.to_local()
    return w


def _holder(E: int, F: int, D: int, D_out: int, dtype: torch.dtype) -> GroupedMLP:
    """The GroupedMLP whose C++ layer runs a GroupedExperts (its id names the layer to the
    operator): parameters are meta placeholders, never read (each forward passes the experts' own
    weights to the operator), and it is not a submodule (the model's parameters and state dict are
    unchanged)."""
    mlp = GroupedMLP(E, D, F, D_out, params_dtype=dtype, device="meta", single_grouped_weight=True)
    mlp._sparsetrain_shape = (E, F, D, D_out)
    return mlp


def _experts_forward(self: GroupedExperts, x: Tensor, num_tokens_per_expert: Tensor) -> Tensor:
    """GroupedExperts.forward: x [T, D] grouped by expert (num_tokens_per_expert [E] rows each, any
    numeric dtype; rows past their sum, if any, are the caller's padding) -> [T, D]."""
    w1, w2, w3 = _local(self.w1), _local(self.w2), _local(self.w3)
    E, F, D = w1.shape
    if tuple(w3.shape) != (E, F, D) or tuple(w2.shape) != (E, w2.shape[1], F):
        raise ValueError(f"{type(self).__name__}: expected w1 and w3 [E, F, D] and w2 [E, D_out, F], got "
                         f"{list(w1.shape)}, {list(w3.shape)} and {list(w2.shape)}")
    mlp = self.__dict__["_sparsetrain_mlp"]
    if mlp._sparsetrain_shape != (E, F, D, w2.shape[1]):  # a tensor-parallel shard: its local shapes
        mlp = self.__dict__["_sparsetrain_mlp"] = _holder(E, F, D, w2.shape[1], w1.dtype)
    # The computation's dtype: the activations' when 16-bit (torchtitan's grouped_mm path computes
    # in bf16 whatever the parameters' dtype, e.g. fp32 parameters under autocast), else theirs.
    dtype = x.dtype if x.dtype in (torch.bfloat16, torch.float16) else w1.dtype
    # GroupedMLP's operator on the experts' weights: the gate and up halves as one [E, 2F, D]
    # tensor (a copy: torchtitan keeps them as two parameters); autograd takes the gradients
    # through the cat (and casts) back to w1 and w3, and to w2. The splits: torch.histc of int64
    # indices (int64 on CUDA), or EP's counts, converted on the device; the status word reports
    # invalid CUDA splits on the device (no sync).
    params = [torch.cat((w1, w3), dim=1).to(dtype), w2.to(dtype)]
    splits = num_tokens_per_expert.to(torch.int64)
    status = self._sparsetrain_status if splits.is_cuda and self._sparsetrain_status.device == splits.device else None
    probs = torch.ones(x.shape[0], dtype=torch.float32, device=x.device)
    return call("grouped_mlp_forward", mlp._id, x.to(dtype), splits, probs, params, [], 0, status, None)[0]


class SparsetrainGroupedExperts(GroupedExperts):
    """A GroupedExperts whose forward is sparsetrain's (convert() sets a module's class to this and
    gives it its GroupedMLP holder and a status word, a non-persistent buffer; its parameters and
    state dict are unchanged)."""

    forward = _experts_forward

    def init_weights(self, init_std: float):
        super().init_weights(init_std)
        with torch.no_grad():
            self._sparsetrain_status.zero_()  # after to_empty(): the word starts clear


def _convert_experts(module: GroupedExperts) -> None:
    E, F, D = module.w1.shape
    module.__class__ = SparsetrainGroupedExperts
    module.__dict__["_sparsetrain_mlp"] = _holder(E, F, D, module.w2.shape[1], module.w1.dtype)
    module.register_buffer("_sparsetrain_status", torch.zeros(1, dtype=torch.int32, device=module.w1.device),
                           persistent=False)


# --- attention ----------------------------------------------------------------------------------

_BATCH = LastMade()  # the last batch's mask, by the object it came from


def document_ids(tokens: Tensor, eos_id: int) -> Tensor:
    """torchtitan's documents of a batch [B, S] of token ids (get_document_mask_mod's rule): a
    document ends at each eos token and at the row's end; ids count documents from 0 per row."""
    ends = tokens == eos_id
    ends[:, -1] = True
    ids = torch.zeros_like(tokens, dtype=torch.int32)
    ids[:, 1:] = torch.cumsum(ends.to(torch.int32), dim=1, dtype=torch.int32)[:, :-1]
    return ids


def _check_heads(q: Tensor, k: Tensor, v: Tensor) -> None:
    if not (q.shape[-1] == k.shape[-1] == v.shape[-1]):
        raise ValueError(f'model converter "{NAME}" does not support query, key and value head dims that differ '
                         f"(got {q.shape[-1]}, {k.shape[-1]} and {v.shape[-1]}: e.g. deepseek_v3's MLA); the "
                         f'converter "{NAME}_experts" (convert(model, attention=False)) leaves the attention '
                         "torchtitan's")


class SparsetrainSDPA(ScaledDotProductAttentionWrapper):
    def forward(self, q: Tensor, k: Tensor, v: Tensor, *, scale: float | None = None, enable_gqa: bool = False,
                is_causal: bool = True) -> Tensor:
        _check_heads(q, k, v)
        seq_q, seq_kv = q.shape[2], k.shape[2]
        kind = ("causal" if seq_q == seq_kv else "causal_bottom_right") if is_causal else "full"
        return block_sparse_attention(q, k, v, shape_mask(kind, seq_q, seq_kv, q.device), scale=scale)


class SparsetrainFlex(FlexAttentionWrapper):
    def forward(self, q: Tensor, k: Tensor, v: Tensor, *, score_mod=None, block_mask: FlexBlockMask | None = None,
                scale: float | None = None, return_lse: bool = False, enable_gqa: bool = False) -> Tensor:
        if score_mod is not None:
            raise _refuse("a flex score_mod")
        if return_lse:
            raise _refuse("return_lse")
        _check_heads(q, k, v)
        if block_mask is None:
            mask = shape_mask("full", q.shape[2], k.shape[2], q.device)
        else:
            mask = getattr(block_mask, "_sparsetrain_mask", None)
            if mask is None:
                if torch.compiler.is_compiling():
                    raise _refuse("under torch.compile a flex mask of another attn_mask_type than causal or "
                                  "block_causal (converted by BlockMask.from_torch, which reads it back to the host)")
                b, h = q.shape[0], q.shape[1]
                mask = _BATCH.get(block_mask, lambda: BlockMask.from_torch(block_mask, batch=b, heads=h,
                                                                            device=q.device))
        return block_sparse_attention(q, k, v, mask, scale=scale)


# torchtitan's VarlenMetadata is a NamedTuple: a mask made beside it does not reach the compiled
# blocks (dynamo reads its fields only), and one made inside them cannot be traced.
_VARLEN_UNDER_COMPILE = 'attn_type "varlen" under torch.compile (use "flex" with attn_mask_type "block_causal")'


class SparsetrainVarlen(VarlenAttentionWrapper):
    def forward(self, xq: Tensor, xk: Tensor, xv: Tensor, attention_masks: VarlenMetadata,
                scale: float | None = None) -> Tensor:
        """[B, H, S, D] inputs packed as one row of B * S tokens (torchtitan's varlen form) ->
        [B * S, Hq, D], causal within each document of cu_seq_q / cu_seq_k."""
        _check_heads(xq, xk, xv)
        B, _, S, D = xq.shape

        def packed(t: Tensor) -> Tensor:  # [B, H, S, D] -> [1, H, B * S, D] (a view of [B, S, H, D] storage)
            return t.transpose(1, 2).reshape(1, B * S, t.shape[1], D).transpose(1, 2)

        if torch.compiler.is_compiling():
            raise _refuse(_VARLEN_UNDER_COMPILE)
        m = attention_masks
        mask = _BATCH.get(m.cu_seq_q, lambda: BlockMask.from_cu_seqlens(
            m.cu_seq_q.to(torch.int32), m.cu_seq_k.to(torch.int32), seq_q=B * S, seq_kv=B * S, causal=True,
            device=xq.device, framework="torch"))
        out = block_sparse_attention(packed(xq), packed(xk), packed(xv), mask, scale=scale)
        return out[0].transpose(0, 1)


_ATTENTION_CLASSES = {ScaledDotProductAttentionWrapper: SparsetrainSDPA, FlexAttentionWrapper: SparsetrainFlex,
                      VarlenAttentionWrapper: SparsetrainVarlen}


def _with_sparsetrain_masks(get_attention_masks):
    """The model's get_attention_masks, its flex masks of attn_mask_type "causal" / "block_causal"
    carrying sparsetrain's mask, built on the device from the batch here, outside the blocks
    torchtitan compiles (SparsetrainFlex reads it)."""

    def wrapped(self, input_batch: Tensor, tokenizer, extra_inputs=None):
        masks = get_attention_masks(input_batch, tokenizer, extra_inputs)
        args = getattr(self, "model_args", None)
        kind = getattr(args, "attn_mask_type", None)
        if isinstance(masks, FlexBlockMask) and kind in ("causal", "block_causal"):
            seq = input_batch.shape[1]
            if kind == "causal":
                mask = shape_mask("causal", seq, seq, input_batch.device)
            else:
                mask = BlockMask.build("document_causal", seq, document_ids=document_ids(input_batch, tokenizer.eos_id),
                                       device=input_batch.device, framework="torch")
            masks._sparsetrain_mask = mask
        return masks

    return wrapped


# --- the converter ------------------------------------------------------------------------------


def _causal_masks_before_forward(model: nn.Module, args: tuple, kwargs: dict) -> None:
    """A forward pre-hook of the model: the causal mask of its input's length, made (once) outside
    the blocks that torchtitan compiles, whose SparsetrainSDPA then finds it made."""
    t = args[0] if args else kwargs.get("tokens")
    if isinstance(t, Tensor) and t.dim() >= 2:
        shape_mask("causal", t.shape[1], t.shape[1], t.device)


def convert(model: nn.Module, *, experts: bool = True, attention: bool = True) -> nn.Module:
    """`model` (a torchtitan model, on any device, meta included, before parallelisation) with its
    experts and / or attention on sparsetrain (in place; returned for chaining): the module classes
    of GroupedExperts and of torchtitan's attention wrappers are set to sparsetrain's subclasses, so
    parameters, buffers, state dict keys and torchtitan's parallelisation plans are unchanged."""
    sdpa = False
    for module in model.modules():
        if experts and type(module) is GroupedExperts:
            _convert_experts(module)
        elif attention and type(module) in _ATTENTION_CLASSES:
            sdpa |= type(module) is ScaledDotProductAttentionWrapper
            module.__class__ = _ATTENTION_CLASSES[type(module)]
    if sdpa and not model.__dict__.get("_sparsetrain_causal_hook", False):
        model.register_forward_pre_hook(_causal_masks_before_forward, with_kwargs=True)
        model.__dict__["_sparsetrain_causal_hook"] = True
    get_masks = getattr(model, "get_attention_masks", None)
    if attention and get_masks is not None and not model.__dict__.get("_sparsetrain_masks", False):
        model.get_attention_masks = types.MethodType(_with_sparsetrain_masks(get_masks), model)
        model.__dict__["_sparsetrain_masks"] = True
    return model


class SparsetrainConverter:
    """torchtitan's ModelConverter protocol (torchtitan.protocols.model_converter): experts and
    attention."""

    parts = dict(experts=True, attention=True)

    def __init__(self, job_config, parallel_dims) -> None:
        for flag, what in (("ep_enabled", "torchtitan's expert parallelism"),
                           ("etp_enabled", "torchtitan's expert tensor parallelism"),
                           ("cp_enabled", "context parallelism")):
            if getattr(parallel_dims, flag, False):
                raise _refuse(f"{what} ({flag})")
        compile_cfg = getattr(job_config, "compile", None)
        self.compiled = bool(getattr(compile_cfg, "enable", False)) and "model" in getattr(compile_cfg, "components",
                                                                                           ["model"])

    def convert(self, model: nn.Module) -> None:
        attn_type = getattr(getattr(model, "model_args", None), "attn_type", "sdpa")
        if self.compiled and self.parts["attention"] and attn_type == "varlen":
            raise _refuse(f'{_VARLEN_UNDER_COMPILE}; "{NAME}_experts" converts the experts alone')
        convert(model, **self.parts)

    def post_optimizer_hook(self, model) -> None:
        pass


class SparsetrainExpertsConverter(SparsetrainConverter):
    """The experts alone (e.g. deepseek_v3, whose MLA attention has head dims that differ)."""

    parts = dict(experts=True, attention=False)


register_model_converter(SparsetrainConverter, NAME)
register_model_converter(SparsetrainExpertsConverter, f"{NAME}_experts")

"""The MoE layer's row movements (MoELayer, ExpertParallelMoELayer): a batch's tokens laid out as
the experts' rows and each token's rows summed back, both directions by gathers (no scatter, no
atomic adds: deterministic on every device)."""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple, Optional

import torch
from torch import Tensor

from . import native  # noqa: F401  (loads the C++ torch library, which defines the combine's operator)

if TYPE_CHECKING:
    from .moe import RoutedTokens

# The combine (python/src/torch_moe.cpp: moe_layer.h's combine_rows), its OpOverload bound once;
# its autograd is Rows below.
_COMBINE_ROWS = torch.ops.sparsetrain.moe_combine_rows.default


# Shapes only, for FakeTensorMode, meta tensors and torch.compile.
@torch.library.register_fake("sparsetrain::moe_combine_rows")
def _(rows, row_of):
    return rows.new_empty((row_of.shape[0], rows.shape[1]))


_COMBINED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def take(x: Tensor, index: Tensor) -> Tensor:
    """x's rows at `index`: [M] -> [M, ...]; [M, k] -> the k rows summed in fp32 in slot order,
    rounded once, [M, ...] (combine_rows for 2-d x: no [M * k, ...] copy in between)."""
    if index.dim() == 1:
        return x.index_select(0, index)
    if x.dim() == 2 and x.dtype in _COMBINED_DTYPES:
        return _COMBINE_ROWS(x if x.stride(-1) == 1 else x.contiguous(), index.to(torch.int32).contiguous())
    return x.index_select(0, index.reshape(-1)).view(*index.shape, *x.shape[1:]).sum(1)


class Rows(torch.autograd.Function):
    """take(x, index), whose adjoint is take(g, inverse): `index` and `inverse` describe the same
    row mapping from both sides (row_of [N, k] and token_of_row [N * k], or a permutation and its
    inverse), so both directions are gathers: no scatter, no atomic adds, deterministic."""

    @staticmethod
    def forward(ctx, x: Tensor, index: Tensor, inverse: Tensor) -> Tensor:
        ctx.save_for_backward(inverse)
        return take(x, index)

    @staticmethod
    def backward(ctx, g: Tensor):
        (inverse,) = ctx.saved_tensors
        return take(g, inverse), None, None


class ExpertRows(NamedTuple):
    """A batch's rows in expert-major order (token order inside an expert): x [N * k, hidden] and
    probs fp32 [N * k], both differentiable; row_of [N, k] (int32, as combine_rows takes it) and
    token_of_row [N * k] (int64) map between tokens and rows for the combine."""
    x: Tensor
    probs: Tensor
    row_of: Tensor
    token_of_row: Tensor


class RowMaps(NamedTuple):
    """r's layout as index maps: row_of [N, k] (int32: the combine's), token_of_row [N * k], flat_row
    [N * k] ((token, slot) -> row) and flat_of_row, its inverse (row -> (token, slot)), int64."""
    row_of: Tensor
    token_of_row: Tensor
    flat_row: Tensor
    flat_of_row: Tensor


def row_maps(r: RoutedTokens) -> RowMaps:
    row_of = r.row_of.to(torch.int32)
    flat_row = row_of.reshape(-1).long()
    flat_of_row = torch.empty_like(flat_row)
    flat_of_row[flat_row] = torch.arange(flat_row.numel(), device=flat_row.device)
    return RowMaps(row_of, r.token_of_row.long(), flat_row, flat_of_row)


def expert_rows(x: Tensor, r: RoutedTokens, order: Optional[Tensor] = None) -> ExpertRows:
    """The rows the experts take, gathered from x and the (token, slot) probs by r's layout; with
    `order` (a permutation of the rows: position i takes expert-major row order[i]) in that order
    instead, row_of renumbered to match, so that combine sums the same rows in the same slot order."""
    m = row_maps(r)
    if order is not None:
        position = torch.empty_like(order)
        position[order] = torch.arange(order.numel(), device=order.device)
        m = RowMaps(position[m.row_of.long()].to(torch.int32), m.token_of_row[order], position[m.flat_row],
                    m.flat_of_row[order])
    return ExpertRows(Rows.apply(x, m.token_of_row, m.row_of),
                       Rows.apply(r.probs.reshape(-1), m.flat_of_row, m.flat_row), m.row_of, m.token_of_row)


def combine(y: Tensor, rows: ExpertRows) -> Tensor:
    """Each token's top_k expert rows of y (expert-major, as expert_rows laid them out) summed in
    slot order: [N, out]."""
    return Rows.apply(y, rows.row_of, rows.token_of_row)



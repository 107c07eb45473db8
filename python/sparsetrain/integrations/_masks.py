"""The masks the training-stack integrations hand to block_sparse_attention, made once: masks of a
shape alone (causal, full, a window), kept by shape and device; masks of one batch (documents),
kept for the object they came from while the next layers pass the same one (LastMade)."""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from .._block_mask import BlockMask

_SHAPES: "dict[tuple, BlockMask]" = {}  # by (kind, seq_q, seq_kv, window_left, device)
_MAX_SHAPES = 64  # a bound on what varying shapes (generation, a changing seq len) leave behind


def shape_mask(kind: str, seq_q: int, seq_kv: int, device: torch.device, window_left: int = -1) -> BlockMask:
    """The mask of a built-in kind that depends on its shape alone (window_left: sliding_window's;
    the window ends at the query), as torch tensors on `device`."""
    key = (kind, seq_q, seq_kv, window_left, device)
    mask = _SHAPES.get(key)
    if mask is None:
        if len(_SHAPES) >= _MAX_SHAPES:
            _SHAPES.clear()
        mask = _SHAPES[key] = BlockMask.build(kind, seq_q, seq_kv, window_left=window_left, window_right=0,
                                              device=device, framework="torch")
    return mask


class LastMade:
    """A one-entry cache: what build() made for the last (key, source object), returned again while
    the same object (every layer of a forward passes the same) comes with the same key."""

    def __init__(self) -> None:
        self.entry: Optional[tuple] = None  # (key, source, value)

    def get(self, source: object, build: Callable[[], Any], key: Any = None) -> Any:
        e = self.entry
        if e is not None and e[0] == key and e[1] is source:
            return e[2]
        value = build()
        self.entry = (key, source, value)
        return value

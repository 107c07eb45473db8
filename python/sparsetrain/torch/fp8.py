"""FP8 for the grouped layers (GroupedLinear, GroupedMLP, MoELayer): e4m3 with blockwise scales,
docs/DESIGN.md section 12. A module's `fp8` argument (True or False) decides for it; None, the
default, follows `fp8_autocast` around its forward, as TransformerEngine's fp8_autocast does. A
forward's choice holds for its backward and its delayed wgrad (backward_dw)."""

import contextlib
from typing import Iterator, Optional

# The operators' flags bit of the recipe (python/src/torch_layers.h, kFp8Bit).
FP8_FLAG = 1 << 8

# A plain global (not thread-local): torch.compile guards on it like any global a forward reads.
_autocast = False


@contextlib.contextmanager
def fp8_autocast(enabled: bool = True) -> Iterator[None]:
    """The grouped layers whose `fp8` is None run their forward (and its backward) in FP8 inside
    the block when `enabled`, in their dtype when not; nested blocks restore the outer state."""
    global _autocast
    outer, _autocast = _autocast, bool(enabled)
    try:
        yield
    finally:
        _autocast = outer


def fp8_enabled(setting: Optional[bool]) -> bool:
    """The one rule: the module's own setting when it has one, else the innermost fp8_autocast."""
    return _autocast if setting is None else bool(setting)

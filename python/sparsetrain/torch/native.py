"""The C++ torch library (sparsetrain._torch_ops) where it was built and loads against this torch,
and when an op may call its implementation itself rather than through torch's dispatcher: what
every op module of sparsetrain.torch shares. The op modules read NATIVE and TORCH_OPS from here
at each call (`native.NATIVE`), so that one assignment switches every op's route."""

from __future__ import annotations

import os
import warnings
from typing import Any, Optional, Tuple

import torch
from torch import Tensor



def _load_native() -> Tuple[Any, Any]:
    """(torch.ops.sparsetrain_native, the Python module sparsetrain._torch_ops) where the C++ torch
    library was built and loads against this torch (python/src/torch_ops.cpp registers attention's
    operators, torch_grouped.cpp has the grouped layers' C++ layers; no Python per allocation or
    result); else (None, None), and every call runs through the extension `_C`.
    SPARSETRAIN_TORCH_OPS=0 chooses `_C`."""
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "_torch_ops.so")
    if os.environ.get("SPARSETRAIN_TORCH_OPS", "1") == "0" or not os.path.exists(path):
        return None, None
    try:
        from .. import _torch_ops  # noqa: PLC0415  (importing it registers the operators)
    except ImportError as e:  # built against another torch or Python
        warnings.warn(f"sparsetrain: {path} does not load here ({e}); calls run through sparsetrain._C")
        return None, None
    return torch.ops.sparsetrain_native, _torch_ops


# The operators, and the module with the layer classes and attention's eager entry.
NATIVE, TORCH_OPS = _load_native()


def direct(*tensors: Optional[Tensor]) -> bool:
    """Whether an autograd function may call an op's implementation itself instead of going
    through torch's dispatcher (~20 us a call): in eager mode on plain tensors with no dispatch
    mode active. Under torch.compile, make_fx / export (fake or proxy tensors) and dispatch modes
    (functionalization, FlopCounterMode, ...) the op is called, so they see it; and on meta
    tensors, so that they get the fake implementations' shapes."""
    return (not torch.compiler.is_compiling() and torch._C._len_torch_dispatch_stack() == 0
            and all(t is None or (type(t) is Tensor and not t.is_meta) for t in tensors))


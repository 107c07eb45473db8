"""The C++ torch library sparsetrain._torch_ops, whose operators every op of sparsetrain.torch runs
through, and when a call may enter an operator through the library's C++ entry rather than
torch.ops (`direct`): what every op module of sparsetrain.torch shares. Where the library is not in the install (a wheel
built without torch, SPARSETRAIN_TORCH_OPS=OFF) or does not load against this torch, importing
sparsetrain.torch raises an ImportError that says why and how to get it."""

from __future__ import annotations

import os
from typing import Any, Optional

import torch
from torch import Tensor

# How to get the library, in every error that says it is missing.
BUILD_HINT = ("build sparsetrain with `pip install --no-build-isolation .` where torch is installed (the build "
              "compiles the library against that torch), or with scripts/setup")


def _load_native() -> Any:
    """The Python module sparsetrain._torch_ops: the C++ torch library (python/src/torch_ops.cpp
    defines attention's operators, torch_grouped.cpp the grouped layers', with the C++ layers that
    hold a module's state; no Python per allocation or result). An ImportError where it was not
    built or does not load against this torch."""
    try:
        from .. import _torch_ops  # noqa: PLC0415  (importing it registers the operators)
    except ImportError as e:
        path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "_torch_ops.so")
        if os.path.exists(path):  # built against another torch or Python
            why = f"the C++ torch library {path} does not load with torch {torch.__version__} ({e})"
        else:
            why = "the C++ torch library (sparsetrain._torch_ops) is not in this install"
        raise ImportError(f"sparsetrain.torch: {why}; {BUILD_HINT}", name="sparsetrain._torch_ops") from e
    return _torch_ops


# The library's Python module: the operators' eager entries and the grouped layers' C++ layers.
TORCH_OPS = _load_native()


def direct(*tensors: Optional[Tensor]) -> bool:
    """Whether a call may enter its operator through the library's C++ entry (the same operator
    through the same dispatcher, without torch.ops' argument conversion: ~10 us a call): in eager
    mode on plain tensors with no dispatch mode active. Under torch.compile, make_fx / export (fake
    or proxy tensors) and dispatch modes (functionalization, FlopCounterMode, ...) torch.ops is
    called, so they see the operator; and on meta tensors, so that they get the fakes' shapes."""
    return (not torch.compiler.is_compiling() and torch._C._len_torch_dispatch_stack() == 0
            and all(t is None or (type(t) is Tensor and not t.is_meta) for t in tensors))


"""sparsetrain: training kernels for MoE layers and block-sparse attention.

This module is the framework-neutral API over DLPack arrays (numpy on the CPU, torch CPU and
CUDA tensors, any DLPack producer), zero-copy. `sparsetrain.torch` (where torch is installed)
has the torch.nn.Module front. Bad arguments raise ValueError, other failures RuntimeError, with
the C++ library's message (argument, what was expected, what came).
"""

from __future__ import annotations

from typing import Any, List, NamedTuple, Optional

from . import _C
from ._arrays import DeviceSplits, Framework, dtype_name, to_core, to_core_splits, workspace_to_core

__all__ = ["GroupedLinear", "GroupedLinearGrads", "DeviceSplits", "weight_grad_disposition",
           "SPLITS_NEGATIVE", "SPLITS_SUM_EXCEEDS_ROWS", "version", "built_with_cuda",
           "cuda_device_count"]

__version__ = _C.version()
version = _C.version
built_with_cuda = _C.built_with_cuda
cuda_device_count = _C.cuda_device_count
SPLITS_NEGATIVE = _C.SPLITS_NEGATIVE
SPLITS_SUM_EXCEEDS_ROWS = _C.SPLITS_SUM_EXCEEDS_ROWS


def weight_grad_disposition(delay_wgrad: bool, fuse_into_main_grad: bool,
                            has_grad_added_to_main_grad: bool):
    """What backward hands back for a weight (DESIGN.md section 4's table), the one rule every
    layer follows: ("wgrad" | "none" | "dummy", whether the bias grad comes now)."""
    return _C.weight_grad_disposition(delay_wgrad, fuse_into_main_grad, has_grad_added_to_main_grad)


class GroupedLinearGrads(NamedTuple):
    grad_input: Any                 # dx (the caller's grad_input buffer when one was given)
    weight_kind: str                # "wgrad", "none" or "dummy"
    weight_grads: Optional[List[Any]]  # per-group [out, in] views ("wgrad", "dummy"), else None
    weight_grad_packed: Any         # [G, out, in] view of the packed wgrad (or packed dummy), or None
    grad_added_to_main_grad: bool   # "dummy": set the weight's flag to True
    bias_grad: Any                  # [G, out] when the layer has a bias and it is due now, else None


class GroupedLinear:
    """G independent linear layers over one input whose rows are grouped by expert.

    weight: one packed array [G, out, in] or a list of G arrays [out, in]; bias likewise
    ([G, out] or G x [out]); main_grad (fp32, same layouts) when fuse_wgrad_accumulation.
    The layer keeps references to these arrays (no copies) and computes on their device.

    splits: a list of ints or a host array (validated at once: entries >= 0, sum <= rows of x),
    a CUDA tensor, or DeviceSplits(values, status) (never read by the host).
    """

    def __init__(self, weight: Any, bias: Any = None, main_grad: Any = None, *,
                 fuse_wgrad_accumulation: bool = False, overwrite_main_grad: bool = False,
                 delay_wgrad_compute: bool = False, has_grad_added_to_main_grad: bool = False,
                 check_device_splits: bool = False):
        packed = not isinstance(weight, (list, tuple))
        first = weight if packed else weight[0]
        self._fw = Framework.of(first)
        if packed:
            if len(first.shape) != 3:
                raise ValueError(f"weight: expected shape [G, out, in] or a list of [out, in], got {list(first.shape)}")
            groups, out_f, in_f = first.shape
        else:
            if len(first.shape) != 2:
                raise ValueError(f"weight[0]: expected shape [out, in], got {list(first.shape)}")
            groups, (out_f, in_f) = len(weight), first.shape
        self.num_groups, self.in_features, self.out_features = int(groups), int(in_f), int(out_f)
        self.dtype = dtype_name(first, "weight")

        def core(p):
            if p is None:
                return None
            return [to_core(v) for v in p] if isinstance(p, (list, tuple)) else to_core(p)

        # The core holds views: keep the arrays alive (torch tensors reach it as descriptors).
        self._params = (weight, bias, main_grad)
        self._pending: list = []  # (x, dy, splits) of each pending delayed wgrad, for the same reason
        self._delay = delay_wgrad_compute
        self._core = _C.GroupedLinear(
            self.num_groups, self.in_features, self.out_features, self.dtype,
            core(weight), core(bias), core(main_grad), fuse_wgrad_accumulation,
            overwrite_main_grad, delay_wgrad_compute, has_grad_added_to_main_grad,
            check_device_splits, self._fw.allocate)

    def forward(self, x: Any, splits: Any, out: Any = None, *, stream: Optional[int] = None,
                workspace: Any = None) -> Any:
        """y = x W^T + b per group. `out`: optional caller buffer [>= T (>= S with host splits),
        out], written in place for rows < S; otherwise a new [T, out] array with a zero tail."""
        y = self._core.forward(to_core(x), to_core_splits(splits), to_core(out),
                               self._stream(x, stream), workspace_to_core(workspace))
        return out if y is None else self._fw.view(y)

    def backward(self, x: Any, dy: Any, splits: Any, grad_input: Any = None, *,
                 stream: Optional[int] = None, workspace: Any = None) -> GroupedLinearGrads:
        """dgrad, and unless delayed, wgrad (or main_grad accumulation) and bias grad."""
        g = self._core.backward(to_core(x), to_core(dy), to_core_splits(splits), to_core(grad_input),
                                self._stream(x, stream), workspace_to_core(workspace))
        if self._delay:
            self._pending.append((x, dy, splits))
        return self._grads(g, grad_input)

    def backward_dw(self, *, stream: Optional[int] = None, workspace: Any = None) -> GroupedLinearGrads:
        """The oldest pending delayed wgrad (first in, first out). Error if none is pending."""
        if stream is None:
            stream = self._fw.stream_of(self._pending[0][0]) if self._pending else 0
        grads = self._grads(self._core.backward_dw(stream, workspace_to_core(workspace)), None)
        self._pending.pop(0)
        return grads

    @property
    def pending_wgrads(self) -> int:
        return self._core.pending_wgrads

    def workspace_size(self, num_rows: int) -> int:
        """Bytes of workspace a call with `num_rows` input rows needs (shapes only)."""
        return self._core.workspace_size(num_rows)

    def _stream(self, x: Any, stream: Optional[int]) -> int:
        return self._fw.stream_of(x) if stream is None else int(stream)

    def _grads(self, g: dict, grad_input: Any) -> GroupedLinearGrads:
        view = self._fw.view
        dx = view(g["grad_input"])
        per_group = [view(t) for t in g["weight_per_group"]]
        return GroupedLinearGrads(
            grad_input=grad_input if dx is None else dx,
            weight_kind=g["weight_kind"],
            weight_grads=per_group or None,
            weight_grad_packed=view(g["weight_packed"]),
            grad_added_to_main_grad=g["grad_added_to_main_grad"],
            bias_grad=view(g["bias_grad"]),
        )


"""sparsetrain: training kernels for MoE layers and block-sparse attention.

This module is the framework-neutral API over DLPack arrays (numpy on the CPU, torch CPU and
CUDA tensors, any DLPack producer), zero-copy: GroupedLinear, GroupedMLP, the MoE router (route,
route_backward), BlockMask (block-sparse attention masks: builders, torch's flex_attention
BlockMask) and the attention forward/backward. `sparsetrain.torch` (where torch is installed)
has the torch.nn.Module front. Bad arguments raise ValueError, other failures RuntimeError, with
the C++ library's message (argument, what was expected, what came).
"""

from __future__ import annotations

from typing import Any, List, NamedTuple, Optional

from . import _C
from ._arrays import DeviceSplits, Framework, dtype_name, to_core, to_core_splits, workspace_to_core
from ._block_mask import (MASK_KINDS, BlockMask, MaskSpec, block_sparse_attention_backward,
                          block_sparse_attention_forward, document_ids_from_cu_seqlens)
from ._moe import ROUTER_SCORES, RoutedTokens, combine_rows, route, route_backward

__all__ = ["GroupedLinear", "GroupedLinearGrads", "GroupedMLP", "GroupedMLPGrads", "LayerGrads",
           "DeviceSplits", "weight_grad_disposition", "BlockMask", "MaskSpec", "MASK_KINDS",
           "document_ids_from_cu_seqlens",
           "block_sparse_attention_forward", "block_sparse_attention_backward",
           "route", "route_backward", "combine_rows", "RoutedTokens", "ROUTER_SCORES",
           "SPLITS_NEGATIVE", "SPLITS_SUM_EXCEEDS_ROWS", "version", "built_with_cuda",
           "cuda_device_count", "build_info"]

__version__ = _C.version()
version = _C.version
built_with_cuda = _C.built_with_cuda
cuda_device_count = _C.cuda_device_count


def build_info() -> dict:
    """What this build holds: {"version", "cuda" (the CUDA backend compiled in), "cuda_archs" (the
    generic kernels' architectures), "sm90_kernels" (the Hopper kernels: "an ALL build", "a
    MINIMAL build" or "none: <why>")}. A wheel built where nvcc is holds an ALL build."""
    return {"version": _C.version(), "cuda": _C.built_with_cuda(), "cuda_archs": _C.cuda_archs(),
            "sm90_kernels": _C.sm90_kernel_set()}


SPLITS_NEGATIVE = _C.SPLITS_NEGATIVE
SPLITS_SUM_EXCEEDS_ROWS = _C.SPLITS_SUM_EXCEEDS_ROWS


def weight_grad_disposition(delay_wgrad: bool, fuse_into_main_grad: bool,
                            has_grad_added_to_main_grad: bool):
    """What backward hands back for a weight (docs/DESIGN.md section 4's table), the one rule every
    layer follows: ("wgrad" | "none" | "dummy", whether the bias grad comes now)."""
    return _C.weight_grad_disposition(delay_wgrad, fuse_into_main_grad, has_grad_added_to_main_grad)


class GroupedLinearGrads(NamedTuple):
    grad_input: Any                 # dx (the caller's grad_input buffer when one was given)
    weight_kind: str                # "wgrad", "none" or "dummy"
    weight_grads: Optional[List[Any]]  # per-group [out, in] views ("wgrad", "dummy"), else None
    weight_grad_packed: Any         # [G, out, in] view of the packed wgrad (or packed dummy), or None
    grad_added_to_main_grad: bool   # "dummy": set the weight's flag to True
    bias_grad: Any                  # [G, out] when the layer has a bias and it is due now, else None


class LayerGrads(NamedTuple):
    """One layer's parameter grads inside a GroupedMLP (fields as in GroupedLinearGrads)."""

    weight_kind: str
    weight_grads: Optional[List[Any]]
    weight_grad_packed: Any
    grad_added_to_main_grad: bool
    bias_grad: Any


class GroupedMLPGrads(NamedTuple):
    grad_input: Any   # dx (the caller's grad_input buffer when one was given); None from backward_dw
    dprobs: Any       # fp32 [T], rows >= S zero; None from backward_dw
    fc1: LayerGrads
    fc2: LayerGrads   # fc2's bias grad is d/d b2 of probs * b2


def _grouped_shape(weight: Any, arg: str):
    """(framework, G, rows, cols, dtype) of a packed [G, rows, cols] array or a list of [rows, cols]."""
    packed = not isinstance(weight, (list, tuple))
    first = weight if packed else weight[0]
    if packed:
        if len(first.shape) != 3:
            raise ValueError(f"{arg}: expected shape [G, out, in] or a list of [out, in], got {list(first.shape)}")
        groups, rows, cols = first.shape
    else:
        if len(first.shape) != 2:
            raise ValueError(f"{arg}[0]: expected shape [out, in], got {list(first.shape)}")
        groups, (rows, cols) = len(weight), first.shape
    return Framework.of(first), int(groups), int(rows), int(cols), dtype_name(first)


def _first(weight: Any) -> Any:
    return weight[0] if isinstance(weight, (list, tuple)) else weight


def _param_to_core(p: Any) -> Any:
    """A parameter (one array, a list of per-group arrays or None) in the form the core takes."""
    if p is None:
        return None
    return [to_core(v) for v in p] if isinstance(p, (list, tuple)) else to_core(p)


class _CoreLayer:
    """What GroupedLinear and GroupedMLP share: the framework of their parameters and the stream
    a call runs on. The pending delayed wgrads live in the C++ layer's queue only: backward hands
    it the arrays they refer to (`keep`), which it holds until backward_dw pops them (the core
    holds views; torch tensors reach it as descriptors)."""

    def __init__(self, fw: Framework, params: tuple, first_param: Any):
        self._fw = fw
        self._params = params
        self._first_param = first_param  # where the layer computes: its device's current stream
        self._core: Any = None

    @property
    def pending_wgrads(self) -> int:
        return self._core.pending_wgrads

    def check_grad_input(self, x: Any, splits: Any, grad_input: Any) -> None:
        """The checks backward makes of a grad_input buffer, without running anything: a front
        that takes the buffer at forward refuses it there (ValueError as backward's)."""
        self._core.check_grad_input(to_core(x), to_core_splits(splits), to_core(grad_input))

    def workspace_size(self, num_rows: int) -> int:
        """Bytes of workspace a call with `num_rows` input rows needs (shapes only)."""
        return self._core.workspace_size(num_rows)

    def _stream(self, x: Any, stream: Optional[int]) -> int:
        return self._fw.stream_of(x) if stream is None else int(stream)

    def _backward_dw(self, stream: Optional[int], workspace: Any) -> dict:
        return self._core.backward_dw(self._stream(self._first_param, stream), workspace_to_core(workspace))

    def _layer_grads(self, g: dict) -> LayerGrads:
        view = self._fw.view
        packed = view(g["weight_packed"])
        if packed is not None:  # the core exports no per-group views then: they are its slices
            per_group = list(packed)
        else:  # one the core exported for several groups (the dummy's) is viewed once
            per_group, last, v = [], object(), None
            for t in g["weight_per_group"]:
                if t is not last:
                    last, v = t, view(t)
                per_group.append(v)
        return LayerGrads(
            weight_kind=g["weight_kind"],
            weight_grads=per_group or None,
            weight_grad_packed=packed,
            grad_added_to_main_grad=g["grad_added_to_main_grad"],
            bias_grad=view(g["bias_grad"]),
        )

    def _grad_input(self, g: dict, grad_input: Any) -> Any:
        dx = self._fw.view(g["grad_input"])
        return grad_input if dx is None else dx


class GroupedLinear(_CoreLayer):
    """G independent linear layers over one input whose rows are grouped by expert.

    weight: one packed array [G, out, in] or a list of G arrays [out, in]; bias likewise
    ([G, out] or G x [out]); main_grad (fp32, same layouts) when fuse_wgrad_accumulation.
    The layer keeps references to these arrays (no copies) and computes on their device.
    fp8: the GEMMs in FP8 with blockwise scales (docs/DESIGN.md section 12: bf16 layers, in and
    out multiples of 16, no bias), quantizing the weights at every call.

    splits: a list of whole numbers (7 or 7.0; 7.5 is refused, never truncated) or an int32 /
    int64 host array (validated at once: entries >= 0, sum <= rows of x), a CUDA tensor, or
    DeviceSplits(values, status) (never read by the host).

    stream: a call's kernels run on `stream` (a raw CUDA stream handle; default: torch's current
    stream on the arrays' device), and so does everything the call allocates, its workspace
    included (torch's caching allocator on that stream): no other stream can reuse that memory
    while the kernels may still read it.
    """

    def __init__(self, weight: Any, bias: Any = None, main_grad: Any = None, *,
                 fuse_wgrad_accumulation: bool = False, overwrite_main_grad: bool = False,
                 delay_wgrad_compute: bool = False, has_grad_added_to_main_grad: bool = False,
                 check_device_splits: bool = False, fp8: bool = False):
        fw, groups, out_f, in_f, dtype = _grouped_shape(weight, "weight")
        super().__init__(fw, (weight, bias, main_grad), _first(weight))
        self.num_groups, self.in_features, self.out_features, self.dtype = groups, in_f, out_f, dtype
        self._core = _C.GroupedLinear(
            self.num_groups, self.in_features, self.out_features, self.dtype,
            _param_to_core(weight), _param_to_core(bias), _param_to_core(main_grad), fuse_wgrad_accumulation,
            overwrite_main_grad, delay_wgrad_compute, has_grad_added_to_main_grad,
            check_device_splits, bool(fp8), self._fw.allocate)

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
                                self._stream(x, stream), workspace_to_core(workspace), (x, dy, splits))
        return self._grads(g, grad_input)

    def backward_dw(self, *, stream: Optional[int] = None, workspace: Any = None) -> GroupedLinearGrads:
        """The oldest pending delayed wgrad (first in, first out). Error if none is pending; without
        delay_wgrad_compute a no-op (weight_kind "none", no bias grad), as TransformerEngine's."""
        return self._grads(self._backward_dw(stream, workspace), None)

    def _grads(self, g: dict, grad_input: Any) -> GroupedLinearGrads:
        return GroupedLinearGrads(self._grad_input(g, grad_input), *self._layer_grads(g))


class GroupedMLP(_CoreLayer):
    """An MoE expert MLP: fc1 (in -> 2F) -> SwiGLU -> x probs -> fc2 (F -> out), per expert:
    y = probs * (silu(a) * b) W2^T + probs * b2, with a, b the halves of fc1's output (or
    alternating blocks of glu_interleave_size columns).

    fc1_weight: [G, 2F, in] or G x [2F, in]; fc2_weight: [G, out, F] or G x [out, F]; biases
    [G, 2F] / [G, out] (or per-group lists); main_grads (fp32, the weights' layouts) when
    fuse_wgrad_accumulation. has_grad_added_to_main_grad: one bool for both layers or a pair
    (fc1, fc2). GroupedLinear's options apply to both layers. splits as for GroupedLinear;
    probs: fp32 [T], one router probability per row of x.
    """

    def __init__(self, fc1_weight: Any, fc2_weight: Any, *, fc1_bias: Any = None, fc2_bias: Any = None,
                 fc1_main_grad: Any = None, fc2_main_grad: Any = None, glu_interleave_size: int = 0,
                 fuse_wgrad_accumulation: bool = False, overwrite_main_grad: bool = False,
                 delay_wgrad_compute: bool = False, has_grad_added_to_main_grad: Any = False,
                 check_device_splits: bool = False, fp8: bool = False):
        fw, groups, two_f, in_f, dtype = _grouped_shape(fc1_weight, "fc1.weight")
        _, _, out_f, ffn, _ = _grouped_shape(fc2_weight, "fc2.weight")
        super().__init__(fw, (fc1_weight, fc2_weight, fc1_bias, fc2_bias, fc1_main_grad, fc2_main_grad),
                         _first(fc1_weight))
        self.num_groups, self.in_features, self.ffn_features, self.out_features = groups, in_f, ffn, out_f
        self.dtype, self.glu_interleave_size = dtype, int(glu_interleave_size)
        attr1, attr2 = (has_grad_added_to_main_grad if isinstance(has_grad_added_to_main_grad, (tuple, list))
                        else (has_grad_added_to_main_grad,) * 2)
        fc1 = (_param_to_core(fc1_weight), _param_to_core(fc1_bias), _param_to_core(fc1_main_grad), bool(attr1))
        fc2 = (_param_to_core(fc2_weight), _param_to_core(fc2_bias), _param_to_core(fc2_main_grad), bool(attr2))
        # The core checks fc1's width against 2 * ffn_features (taken from fc2) and every other size.
        self._core = _C.GroupedMLP(
            groups, in_f, ffn, out_f, dtype, self.glu_interleave_size, fc1, fc2, fuse_wgrad_accumulation,
            overwrite_main_grad, delay_wgrad_compute, check_device_splits, bool(fp8), self._fw.allocate)

    def forward(self, x: Any, splits: Any, probs: Any, out: Any = None, *, stream: Optional[int] = None,
                workspace: Any = None):
        """(y, fc1_out): y [T, out] (the caller's `out` buffer when given: rows < S written, the
        rest untouched; otherwise a new array with a zero tail) and fc1's pre-activation output
        [T, 2F], which backward takes back (save it with x and probs)."""
        y, fc1_out = self._core.forward(to_core(x), to_core_splits(splits), to_core(probs),
                                        to_core(out), self._stream(x, stream), workspace_to_core(workspace))
        return (out if y is None else self._fw.view(y)), self._fw.view(fc1_out)

    def backward(self, x: Any, fc1_out: Any, probs: Any, dy: Any, splits: Any, grad_input: Any = None, *,
                 stream: Optional[int] = None, workspace: Any = None) -> GroupedMLPGrads:
        """dx, dprobs and, unless delayed, both layers' weight (or main_grad) and bias grads. With
        delay_wgrad_compute, x, dy and probs must stay unchanged until the matching backward_dw."""
        g = self._core.backward(to_core(x), to_core(fc1_out), to_core(probs), to_core(dy),
                                to_core_splits(splits), to_core(grad_input), self._stream(x, stream),
                                workspace_to_core(workspace), (x, dy, probs, splits))
        return self._grads(g, grad_input)

    def backward_dw(self, *, stream: Optional[int] = None, workspace: Any = None) -> GroupedMLPGrads:
        """Both layers' oldest pending delayed wgrads and bias grads (first in, first out); error if
        none is pending; without delay_wgrad_compute a no-op. grad_input and dprobs are None."""
        return self._grads(self._backward_dw(stream, workspace), None)

    def _grads(self, g: dict, grad_input: Any) -> GroupedMLPGrads:
        return GroupedMLPGrads(self._grad_input(g, grad_input), self._fw.view(g["dprobs"]),
                               self._layer_grads(g["fc1"]), self._layer_grads(g["fc2"]))

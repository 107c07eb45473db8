"""Array frameworks as the C++ core sees them: how to hand an array over (DLPack), how to
allocate memory the library asks for (numpy.empty / torch.empty on the current stream), and how
to view a result inside such an allocation. Results are always views of framework-owned arrays,
never arrays built from raw pointers, so the framework keeps tracking streams and lifetimes."""

from __future__ import annotations

import contextlib
import math
import operator
from typing import Any, List, NamedTuple, Optional, Sequence

import numpy as np

from . import _C

_ALIGN = _C.ALLOC_ALIGNMENT


class DeviceSplits(NamedTuple):
    """Splits that stay on the compute device: never read by the host, so the call can be captured
    in a CUDA graph. Invalid values empty every group and OR SplitsStatus bits into `status`
    (an int32 array of one element) instead of raising."""

    values: Any
    status: Optional[Any] = None


def _is_torch(a: Any) -> bool:
    return type(a).__module__.startswith("torch")


def _numpy_bf16():
    try:
        import ml_dtypes  # noqa: PLC0415  (optional: only for bf16 numpy arrays)

        return np.dtype(ml_dtypes.bfloat16)
    except ImportError:  # pragma: no cover - ml_dtypes is a test dependency
        return None


_NP_DTYPES = {"fp16": np.dtype(np.float16), "fp32": np.dtype(np.float32),
              "int32": np.dtype(np.int32), "int64": np.dtype(np.int64),
              "uint8": np.dtype(np.uint8)}  # uint8: block matrices and bitmasks (block masks)


def numpy_dtype(name: str) -> np.dtype:
    if name == "bf16":
        dt = _numpy_bf16()
        if dt is None:
            raise ValueError("dtype: bf16 numpy arrays need the ml_dtypes package")
        return dt
    return _NP_DTYPES[name]


_NAMES: dict = {}  # a torch or numpy dtype -> its name, filled on first sight of each


def _element_type(dt: Any) -> Optional[tuple]:
    """(kind, bits) of a torch or numpy dtype, as the library's table of element types takes them
    (_C.dtype_name_of_element); None for a kind it has none of (numpy's strings, objects, ...)."""
    if type(dt).__module__ == "torch":
        name = str(dt)
        try:  # quantized and bits types have no sign or size
            kind = ("bfloat" if name == "torch.bfloat16" else "complex" if dt.is_complex else
                    "float" if dt.is_floating_point else "bool" if name == "torch.bool" else
                    "int" if dt.is_signed else "uint")
            bits = dt.itemsize * 8
        except RuntimeError:
            return None
        # Only the plain types, which torch names by kind and width: its sub-byte types (uint4, int2, ...)
        # take a byte each too but are not int8 / uint8.
        return (kind, bits) if name == f"torch.{kind}{'' if kind == 'bool' else bits}" else None
    if dt == _numpy_bf16():
        return "bfloat", 16
    kind = {"i": "int", "u": "uint", "f": "float", "c": "complex", "b": "bool"}.get(dt.kind)
    return None if kind is None else (kind, dt.itemsize * 8)


def name_of_dtype(dt: Any) -> str:
    """The library's name of a torch or numpy dtype, from the C++ table every front names types by:
    bf16, fp16, fp32, fp64, int8 ... int64, uint8 ... uint64, bool, complex64, complex128 (the
    extension takes them all as views, and each op's own check refuses those it does not compute
    with); the framework's own name for a type the library has none for (float8_e4m3fn, ...),
    which the extension refuses."""
    name = _NAMES.get(dt)
    if name is None:
        et = _element_type(dt)
        name = (_C.dtype_name_of_element(*et) if et else "") or str(dt).removeprefix("torch.")
        _NAMES[dt] = name
    return name


def dtype_name(a: Any) -> str:
    """name_of_dtype of an array's element type."""
    return name_of_dtype(a.dtype if _is_torch(a) else np.asarray(a).dtype)


def to_core(a: Any) -> Any:
    """An array in the form the extension takes: itself (DLPack / buffer protocol); for numpy
    bf16 (a dtype DLPack cannot describe) a (uint16 view, "bf16") pair; for a torch tensor a
    descriptor of its metadata, its dtype by name (torch's __dlpack__ synchronises streams, which
    CUDA-graph capture forbids). None stays None. The caller keeps the tensor alive; the extension
    names the argument in its errors."""
    if a is None:
        return a
    if _is_torch(a):
        return ("torch", a.data_ptr(), dtype_name(a), list(a.shape), list(a.stride()), a.device.type,
                a.device.index or 0)
    if isinstance(a, np.ndarray) and a.dtype == _numpy_bf16():
        return (a.view(np.uint16), "bf16")
    return a


def workspace_to_core(ws: Any) -> Any:
    """A workspace: any contiguous array; only its bytes matter."""
    if ws is not None and _is_torch(ws):
        return ("torch", ws.data_ptr(), "int32", [ws.numel() * ws.element_size() // 4], [1], ws.device.type,
                ws.device.index or 0)
    return ws


def host_split_values(values: Sequence[Any], arg: str) -> List[int]:
    """The one rule for splits given as a host sequence (the torch front's m_splits, the array
    front's splits), read by value: each entry a whole number of rows. Ints (numpy's and torch's
    integer scalars, and bools, as Python counts them) are taken as they are, a float only when it
    is whole (30.0 is 30); a fractional one (30.5), NaN, inf or a non-number is refused with a
    ValueError naming `arg`, the entry and its index (int() would truncate it without a word). By
    value, not by type: the torch front reuses the tensor of the last list whose values compare
    equal (30.0 == 30). A tensor or array of splits is judged by its dtype instead (integers)."""
    out = []
    for i, s in enumerate(values):
        try:
            out.append(operator.index(s))
            continue
        except TypeError:
            pass
        try:
            f = float(s)
            whole = bool(f == s) and math.isfinite(f) and f.is_integer()  # f == s: a number, not a string
        except (TypeError, ValueError):
            whole = False
        if not whole:
            raise ValueError(f"{arg}: expected whole numbers of rows (integers), got {s!r} at index {i}")
        out.append(int(f))
    return out


def to_core_splits(splits: Any) -> Any:
    if isinstance(splits, DeviceSplits):
        return ("device", to_core(splits.values), to_core(splits.status))
    if _is_torch(splits) and splits.is_cuda:
        return ("device", splits, None)
    if isinstance(splits, (list, tuple)):
        return host_split_values(splits, "splits")
    return to_core(splits)


_SHARED: dict = {}  # "torch" / "numpy" -> the Framework every array call of that kind uses


class Framework:
    """numpy or torch: allocation and result views for the C++ core."""

    def __init__(self, torch_module: Any = None):
        self.torch = torch_module
        self._streams: dict = {}  # (device index, stream handle) -> torch.cuda.ExternalStream

    @staticmethod
    def of(a: Any) -> "Framework":
        """The shared instance of a's framework (its stream wrappers are cached across calls)."""
        kind = "torch" if _is_torch(a) else "numpy"
        fw = _SHARED.get(kind)
        if fw is None:
            if kind == "torch":
                import torch  # noqa: PLC0415

                fw = Framework(torch)
            else:
                fw = Framework(None)
            _SHARED[kind] = fw
        return fw

    def stream_of(self, a: Any) -> int:
        """The stream a call on `a` runs on: torch's current stream for CUDA tensors, else 0."""
        if self.torch is not None and a.is_cuda:
            return self.torch.cuda.current_stream(a.device).cuda_stream
        return 0

    def _on_stream(self, device: Any, stream: int) -> Any:
        """A context that makes `stream` (a raw handle) torch's current stream on `device`; nothing
        when it already is."""
        torch = self.torch
        if torch.cuda.current_stream(device).cuda_stream == stream:
            return contextlib.nullcontext()
        key = (device.index, stream)
        s = self._streams.get(key)
        if s is None:  # handle 0 is the legacy default stream, torch's default stream
            s = torch.cuda.default_stream(device) if stream == 0 else torch.cuda.ExternalStream(stream, device=device)
            self._streams[key] = s
        return torch.cuda.stream(s)

    def allocate(self, nbytes: int, device_type: str, device_index: int, stream: int):
        """Allocator callback: (owner, 256-byte aligned address) of nbytes of fresh memory on
        `stream`, the stream the call's kernels run on."""
        if self.torch is not None:
            if device_type == "cuda":
                # torch's caching allocator on the kernels' stream, whichever is current: memory
                # the call frees (its workspace) goes back to that stream's pool, so no other
                # stream can reuse it while our kernels may still read it (seed 000's race).
                device = self.torch.device("cuda", device_index)
                with self._on_stream(device, stream):
                    owner = self.torch.empty(nbytes + _ALIGN, dtype=self.torch.uint8, device=device)
            else:
                owner = self.torch.empty(nbytes + _ALIGN, dtype=self.torch.uint8)
            addr = owner.data_ptr()
        else:
            if device_type != "cpu":
                raise ValueError(f"device: expected cpu for numpy arrays, got {device_type}")
            owner = np.empty(nbytes + _ALIGN, dtype=np.uint8)
            addr = owner.ctypes.data
        return owner, addr + (-addr) % _ALIGN

    def view(self, exported: Any) -> Any:
        """The array a core result describes: (owner, byte offset, dtype, shape, strides)."""
        if exported is None:
            return None
        owner, offset, dtype, shape, strides = exported
        extent = 0 if 0 in shape else 1 + sum((n - 1) * s for n, s in zip(shape, strides))
        if self.torch is not None:
            tdt = {"bf16": self.torch.bfloat16, "fp16": self.torch.float16, "fp32": self.torch.float32,
                   "int32": self.torch.int32, "int64": self.torch.int64, "uint8": self.torch.uint8}[dtype]
            itemsize = tdt.itemsize
            start = offset + (-owner.data_ptr()) % _ALIGN  # bytes from the owner's first one (uint8)
            at = owner.storage_offset() + start
            if at % itemsize == 0:  # one op over the owner's storage: half the host time of slice, view, as_strided
                return self.torch.empty(0, dtype=tdt, device=owner.device).set_(
                    owner.untyped_storage(), at // itemsize, shape, strides)
            flat = owner[start:start + extent * itemsize].view(tdt)
            return flat.as_strided(shape, strides)
        npdt = numpy_dtype(dtype)
        start = offset + (-owner.ctypes.data) % _ALIGN
        flat = owner[start:start + extent * npdt.itemsize].view(npdt)
        return np.lib.stride_tricks.as_strided(flat, shape, [s * npdt.itemsize for s in strides])

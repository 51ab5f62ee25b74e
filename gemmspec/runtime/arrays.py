"""Device tensors as gemmspec sees them: a pointer, a shape, element strides and a dtype.

`as_device_array` turns what a user passes (a torch CUDA tensor, a CuPy array, anything
with ``__cuda_array_interface__`` or ``__dlpack__``) into a `DeviceArray`, so the
argument checks and the launcher never deal with framework types. Torch is imported
only when a torch object is passed. `DeviceBuffer` is gemmspec's own allocation, for
leaf tables and for runs where neither torch nor CuPy is installed.
"""

from __future__ import annotations

import operator
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import ml_dtypes
import numpy as np
from cuda.bindings import driver
from cuda.core import Device
from cuda.core._utils.cuda_utils import CUDAError
from cuda.core.utils import StridedMemoryView

from gemmspec.errors import ArgumentError, DeviceUnavailableError, GemmspecError

__all__ = [
    "DTYPES",
    "DeviceArray",
    "DeviceBuffer",
    "as_device_array",
    "get_device",
    "numpy_dtype",
    "require_hopper",
]

# gemmspec dtype name -> host numpy dtype (FP8 and BF16 through ml_dtypes).
_NUMPY_DTYPES: dict[str, np.dtype] = {
    "e4m3": np.dtype(ml_dtypes.float8_e4m3fn),
    "e5m2": np.dtype(ml_dtypes.float8_e5m2),
    "bf16": np.dtype(ml_dtypes.bfloat16),
    "f16": np.dtype(np.float16),
    "f32": np.dtype(np.float32),
    "f64": np.dtype(np.float64),
    "i32": np.dtype(np.int32),
    "i64": np.dtype(np.int64),
    "u8": np.dtype(np.uint8),
}
DTYPES: tuple[str, ...] = tuple(_NUMPY_DTYPES)

# Untyped storage that only a dtype_hint can give meaning to: name -> itemsize.
_RAW = {"raw8": 1, "raw16": 2}
_FROM_NUMPY: dict[np.dtype, str] = {v: k for k, v in _NUMPY_DTYPES.items()}
_FROM_NUMPY.update({np.dtype("V1"): "raw8", np.dtype("V2"): "raw16", np.dtype("<u2"): "raw16"})
_FROM_TORCH = {
    "torch.float8_e4m3fn": "e4m3",
    "torch.float8_e5m2": "e5m2",
    "torch.bfloat16": "bf16",
    "torch.float16": "f16",
    "torch.float32": "f32",
    "torch.float64": "f64",
    "torch.int32": "i32",
    "torch.int64": "i64",
    "torch.uint8": "u8",
    "torch.uint16": "raw16",
}

_SUPPORTED_INPUTS = (
    "pass a torch CUDA tensor, a CuPy array, or an object with __cuda_array_interface__ "
    "or __dlpack__"
)


def numpy_dtype(dtype: str) -> np.dtype:
    """The host numpy dtype of a gemmspec dtype name ('e4m3' -> ml_dtypes.float8_e4m3fn)."""
    try:
        return _NUMPY_DTYPES[dtype]
    except KeyError:
        raise ArgumentError(f"unknown dtype {dtype!r}; expected one of {DTYPES}") from None


def get_device(ordinal: int = 0) -> Device:
    """The cuda.core Device `ordinal`, made current; DeviceUnavailableError if there is none.

    This is the one place where a missing driver or GPU is turned into a gemmspec error.
    """
    try:
        device = Device(ordinal)
        device.set_current()
    except (RuntimeError, OSError, CUDAError, ValueError) as e:
        raise DeviceUnavailableError(
            f"no usable CUDA device {ordinal} (is an NVIDIA GPU and driver present?): {e}"
        ) from e
    return device


def require_hopper(ordinal: int = 0) -> Device:
    """The device `ordinal` if it is a Hopper GPU (compute capability 9.0), made current;
    DeviceUnavailableError otherwise. Commands that would spend seconds on random inputs
    and compiling before their first launch call this first, to fail at once."""
    device = get_device(ordinal)
    cc = device.compute_capability
    if (cc.major, cc.minor) != (9, 0):
        name = getattr(device, "name", "")
        raise DeviceUnavailableError(
            f"CUDA device {ordinal}{f' ({name})' if name else ''} is sm_{cc.major}{cc.minor}; "
            "gemmspec's kernels are built for sm_90a and need a Hopper GPU (H100, H200, GH200)"
        )
    return device


@dataclass(frozen=True)
class DeviceArray:
    """A strided view of device memory; `owner` keeps that memory alive.

    `readonly` is what the exporter says (the CUDA array interface's read-only flag,
    DLPack's); gemmspec never writes to such an array.
    """

    ptr: int
    shape: tuple[int, ...]
    strides: tuple[int, ...]  # in elements
    dtype: str
    device: int
    owner: object = field(default=None, repr=False, compare=False)
    readonly: bool = False

    @property
    def itemsize(self) -> int:
        return _NUMPY_DTYPES[self.dtype].itemsize

    @property
    def size(self) -> int:
        """Number of elements."""
        n = 1
        for extent in self.shape:
            n *= extent
        return n

    def byte_extent(self) -> tuple[int, int] | None:
        """The bytes its elements occupy, [first, past the last); None when it has none.

        From the shape and strides alone (negative strides included): the smallest
        range holding every element, gaps between them counted in.
        """
        if self.size == 0:
            return None
        low = sum((n - 1) * s for n, s in zip(self.shape, self.strides) if s < 0)
        high = sum((n - 1) * s for n, s in zip(self.shape, self.strides) if s > 0)
        return self.ptr + low * self.itemsize, self.ptr + (high + 1) * self.itemsize


def as_device_array(obj: Any, *, name: str, dtype_hint: str | None = None) -> DeviceArray:
    """View a user's device tensor as a DeviceArray, or say clearly why it cannot be one.

    `dtype_hint` gives untyped storage its meaning: 1-byte data (uint8) as 'e4m3' or
    'e5m2', 2-byte data ('<u2', '<V2') as 'bf16' or 'f16'.
    """
    if dtype_hint is not None and dtype_hint not in _NUMPY_DTYPES:
        raise ArgumentError(f"dtype_hint {dtype_hint!r} for tensor {name!r} is not one of {DTYPES}")
    if obj is None:
        raise ArgumentError(f"tensor {name!r} is missing")
    if isinstance(obj, DeviceArray):
        arr = _retype(obj, obj.dtype, dtype_hint, name)
    elif isinstance(obj, (np.ndarray, np.generic)):
        raise ArgumentError(f"tensor {name!r} is on the host; pass a CUDA tensor")
    elif type(obj).__module__.startswith("torch"):
        arr = _from_torch(obj, name, dtype_hint)
    elif hasattr(obj, "__cuda_array_interface__"):
        arr = _from_cai(obj, name, dtype_hint)
    elif hasattr(obj, "__dlpack__"):
        arr = _from_dlpack(obj, name, dtype_hint)
    else:
        raise ArgumentError(
            f"tensor {name!r} has unsupported type {type(obj).__qualname__}; {_SUPPORTED_INPUTS}"
        )
    _check_geometry(arr, name)
    return arr


def _check_geometry(arr: DeviceArray, name: str) -> None:
    """What every array must satisfy, whoever exported it: one stride per dim, no
    negative extents, and a real address when there is data to address."""
    if len(arr.strides) != len(arr.shape):
        raise ArgumentError(
            f"tensor {name!r} has {len(arr.strides)} strides {list(arr.strides)} for "
            f"{len(arr.shape)} dims {list(arr.shape)}; expected one stride per dim"
        )
    if any(n < 0 for n in arr.shape):
        raise ArgumentError(f"tensor {name!r} has a negative extent in shape {list(arr.shape)}")
    if arr.ptr == 0 and arr.size:
        raise ArgumentError(f"tensor {name!r} has a null data pointer but {arr.size} elements")


def _resolve_dtype(source: str, hint: str | None, name: str) -> str:
    """The gemmspec dtype of data stored as `source` (a dtype name or a raw kind)."""
    if hint is None or hint == source:
        if source in _RAW:
            raise ArgumentError(
                f"tensor {name!r} holds untyped {8 * _RAW[source]}-bit data; pass "
                "dtype_hint= to say what it is (e.g. 'bf16')"
            )
        return source
    size = _RAW.get(source, 1 if source == "u8" else 0)
    if size == _NUMPY_DTYPES[hint].itemsize:
        return hint
    raise ArgumentError(
        f"tensor {name!r} holds {source} data, which cannot be read as {hint} (the type the "
        "spec declares, or the dtype_hint given)"
    )


def _retype(arr: DeviceArray, source: str, hint: str | None, name: str) -> DeviceArray:
    dtype = _resolve_dtype(source, hint, name)
    if dtype == arr.dtype:
        return arr
    return DeviceArray(arr.ptr, arr.shape, arr.strides, dtype, arr.device, arr.owner, arr.readonly)


def _numpy_source(dtype: np.dtype, what: str, name: str) -> str:
    source = _FROM_NUMPY.get(dtype)
    if source is None:
        raise ArgumentError(
            f"tensor {name!r} has unsupported element type {what}; gemmspec takes {DTYPES}"
        )
    return source


def _from_torch(obj: Any, name: str, hint: str | None) -> DeviceArray:
    import torch

    if not isinstance(obj, torch.Tensor):
        raise ArgumentError(
            f"tensor {name!r} is a {type(obj).__qualname__}, not a tensor; {_SUPPORTED_INPUTS}"
        )
    if not obj.is_cuda:
        raise ArgumentError(
            f"tensor {name!r} is on {obj.device}, not a CUDA device; pass a CUDA tensor"
        )
    source = _FROM_TORCH.get(str(obj.dtype))
    if source is None:
        raise ArgumentError(
            f"tensor {name!r} has unsupported element type {obj.dtype}; gemmspec takes {DTYPES}"
        )
    dtype = _resolve_dtype(source, hint, name)
    return DeviceArray(
        obj.data_ptr(), tuple(obj.shape), tuple(obj.stride()), dtype, obj.device.index, obj
    )


def _from_cai(obj: Any, name: str, hint: str | None) -> DeviceArray:
    cai = obj.__cuda_array_interface__
    what = f"tensor {name!r} has a malformed __cuda_array_interface__"
    if not isinstance(cai, Mapping):
        raise ArgumentError(f"{what}: a {type(cai).__qualname__}, not a dict")
    missing = [key for key in ("shape", "typestr", "data") if key not in cai]
    if missing:
        raise ArgumentError(f"{what}: no {', '.join(repr(k) for k in missing)}")
    typestr = cai["typestr"]
    if not isinstance(typestr, str):
        raise ArgumentError(f"{what}: 'typestr' is {typestr!r}, not a string")
    try:
        np_dtype = np.dtype(typestr)
    except TypeError:
        raise ArgumentError(f"tensor {name!r} has an invalid typestr {typestr!r}") from None
    dtype = _resolve_dtype(_numpy_source(np_dtype, repr(typestr), name), hint, name)
    if cai.get("mask") is not None:
        raise ArgumentError(f"tensor {name!r} is a masked array; gemmspec needs plain arrays")
    shape = _int_tuple(cai["shape"], f"{what}: 'shape'")
    ptr, readonly = _cai_data(cai["data"], what)
    itemsize = np_dtype.itemsize
    if cai.get("strides") is None:
        strides = _contiguous_strides(shape)
    else:
        byte_strides = _int_tuple(cai["strides"], f"{what}: 'strides'")
        if len(byte_strides) != len(shape):
            raise ArgumentError(
                f"tensor {name!r} has {len(byte_strides)} byte strides {list(byte_strides)} "
                f"for {len(shape)} dims {list(shape)}; expected one stride per dim"
            )
        if any(s % itemsize for s in byte_strides):
            raise ArgumentError(
                f"tensor {name!r} has byte strides {byte_strides} that are not multiples "
                f"of its {itemsize}-byte elements"
            )
        strides = tuple(s // itemsize for s in byte_strides)
    return DeviceArray(ptr, shape, strides, dtype, _cai_device(obj), obj, readonly)


def _int(value: Any) -> int | None:
    """`value` as an int if it is an integer (numpy's included, bool not), else None."""
    if isinstance(value, (bool, np.bool_)):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def _int_tuple(value: Any, what: str) -> tuple[int, ...]:
    """A shape or strides entry as ints; anything else is `what`'s error."""
    items = value if isinstance(value, (tuple, list)) else None
    ints = None if items is None else [_int(v) for v in items]
    if ints is None or None in ints:
        raise ArgumentError(f"{what} is {value!r}, not a tuple of integers")
    return tuple(ints)


def _cai_data(data: Any, what: str) -> tuple[int, bool]:
    """The (pointer, read-only flag) pair of the interface's 'data' entry."""
    if isinstance(data, (tuple, list)) and len(data) == 2:
        ptr, readonly = _int(data[0]), data[1]
        if ptr is not None and ptr >= 0 and isinstance(readonly, (bool, np.bool_)):
            return ptr, bool(readonly)
    raise ArgumentError(f"{what}: 'data' is {data!r}, not a (pointer, read-only flag) pair")


def _cai_device(obj: Any) -> int:
    """The CUDA array interface names no device: take CuPy's `.device.id`, else device 0."""
    device = getattr(obj, "device", None)
    ident = getattr(device, "id", device)
    return ident if isinstance(ident, int) else 0


def _from_dlpack(obj: Any, name: str, hint: str | None) -> DeviceArray:
    try:
        # stream_ptr=-1: no stream synchronisation; the caller orders its own streams.
        view = StridedMemoryView.from_dlpack(obj, stream_ptr=-1)
    except (BufferError, TypeError, ValueError, NotImplementedError) as e:
        raise ArgumentError(f"tensor {name!r} could not be read through DLPack: {e}") from e
    if not view.is_device_accessible or view.device_id < 0:
        raise ArgumentError(f"tensor {name!r} is on the host; pass a CUDA tensor")
    dtype = _resolve_dtype(_numpy_source(view.dtype, str(view.dtype), name), hint, name)
    shape = tuple(view.shape)
    strides = _contiguous_strides(shape) if view.strides is None else tuple(view.strides)
    readonly = bool(getattr(view, "readonly", False))
    return DeviceArray(int(view.ptr), shape, strides, dtype, int(view.device_id), view, readonly)


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for extent in reversed(shape):
        strides.append(step)
        step *= max(extent, 1)
    return tuple(reversed(strides))


def _check(result: tuple, what: str) -> None:
    err = result[0]
    if err != driver.CUresult.CUDA_SUCCESS:
        raise GemmspecError(f"{what} failed: {err.name}")


class DeviceBuffer:
    """An owned, contiguous device allocation (freed when the object is collected)."""

    def __init__(self, nbytes: int, *, device: int = 0, stream: object = None):
        """Allocate `nbytes`; with `stream`, ordered on that stream and usable there at
        once (no wait); without, usable by any stream after a wait on the default one."""
        dev = get_device(device)
        self.nbytes = nbytes
        self.device = dev.device_id
        self._host = None  # the host copy of an upload in flight
        try:
            self._buffer = dev.allocate(max(nbytes, 1), stream=stream or dev.default_stream)
            if stream is None:
                dev.default_stream.sync()
        except CUDAError as e:
            raise GemmspecError(f"cannot allocate {nbytes} bytes on device {device}: {e}") from e

    @property
    def ptr(self) -> int:
        return int(self._buffer.handle)

    @classmethod
    def from_numpy(cls, array: np.ndarray, *, device: int = 0, stream: object = None) -> DeviceBuffer:
        """Copy a host array (C order) to a new device buffer; with `stream`, the copy is
        ordered on that stream and the host never waits for the device."""
        host = np.ascontiguousarray(array)
        buf = cls(host.nbytes, device=device, stream=stream)
        if host.nbytes and stream is None:
            _check(driver.cuMemcpyHtoD(buf.ptr, host.ctypes.data, host.nbytes), "cuMemcpyHtoD")
        elif host.nbytes:
            buf._host = host  # must outlive the copy
            handle = driver.CUstream(int(stream.handle))
            _check(
                driver.cuMemcpyHtoDAsync(buf.ptr, host.ctypes.data, host.nbytes, handle),
                "cuMemcpyHtoDAsync",
            )
        return buf

    def to_numpy(self, shape: tuple[int, ...] | int, dtype: str | np.dtype) -> np.ndarray:
        """Copy the buffer's leading bytes back as a C-ordered host array, after all device work."""
        np_dtype = numpy_dtype(dtype) if isinstance(dtype, str) else np.dtype(dtype)
        host = np.empty(shape, dtype=np_dtype)
        if host.nbytes > self.nbytes:
            raise ArgumentError(
                f"cannot read {host.nbytes} bytes from a {self.nbytes}-byte device buffer"
            )
        return _read_back(self.ptr, self.device, host)

    def view(
        self,
        shape: tuple[int, ...],
        dtype: str,
        strides: tuple[int, ...] | None = None,
        offset: int = 0,
    ) -> DeviceArray:
        """A DeviceArray over this buffer (C-contiguous unless `strides` are given, in
        elements), its first element `offset` bytes into the buffer (a whole number of
        elements: a tensor between guard bytes, say)."""
        itemsize = numpy_dtype(dtype).itemsize
        strides = _contiguous_strides(shape) if strides is None else strides
        if len(strides) != len(shape):
            raise ArgumentError(f"strides {strides} do not match shape {shape}")
        if offset < 0 or offset % itemsize or offset > self.nbytes:
            raise ArgumentError(
                f"a {dtype} view cannot start {offset} bytes into a {self.nbytes}-byte buffer"
            )
        extent = 1 + sum((n - 1) * abs(s) for n, s in zip(shape, strides, strict=True) if n > 0)
        if 0 not in shape and offset + extent * itemsize > self.nbytes:
            raise ArgumentError(
                f"a {dtype}{list(shape)} view {offset} bytes in needs {offset + extent * itemsize} "
                f"bytes; the buffer has {self.nbytes}"
            )
        return DeviceArray(self.ptr + offset, tuple(shape), tuple(strides), dtype, self.device, self)


def copy_to_host(array: DeviceArray, shape: tuple[int, ...]) -> np.ndarray:
    """A contiguous device array's contents on the host, after all device work.

    Used for the small offsets/counts tensors that are validated before a launch.
    """
    return _read_back(array.ptr, array.device, np.empty(shape, dtype=numpy_dtype(array.dtype)))


def _read_back(ptr: int, device: int, host: np.ndarray) -> np.ndarray:
    """Fill `host` from device address `ptr` once the device has finished its work."""
    try:
        get_device(device).sync()
    except CUDAError as e:
        raise GemmspecError(f"device work before this read-back failed: {e}") from e
    if host.nbytes:
        _check(driver.cuMemcpyDtoH(host.ctypes.data, ptr, host.nbytes), "cuMemcpyDtoH")
    return host

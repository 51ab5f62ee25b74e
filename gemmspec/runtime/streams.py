"""Which stream and which device a call runs on, without waiting for either.

A call with no explicit stream runs on the caller's current stream: torch's when any
argument is a torch tensor, CuPy's when any is a CuPy array, else the device's
default stream. Work for device d is issued with d's primary context current and
the caller's context restored afterwards, so a torch program's current device never
changes under it.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable

from cuda.bindings import driver
from cuda.core import Stream

from .arrays import get_device
from .launch import _stream_handle, current_stream

__all__ = [
    "caller_stream",
    "is_capturing",
    "keep_context",
    "on_device",
    "stream_handle",
    "stream_key",
    "torch_stream",
]

_STREAMS: dict[tuple[int, int], Stream] = {}  # (device, handle) -> wrapper, built once
_CONTEXTS: dict[int, tuple[driver.CUcontext, int]] = {}


def _framework_stream(objects: Iterable[object], device: int) -> int | None:
    """The current stream of the framework the arguments come from, if any."""
    modules = {type(o).__module__.split(".", 1)[0] for o in objects}
    if "torch" in modules:
        return torch_stream(device)
    if "cupy" in modules:
        cupy = sys.modules["cupy"]
        with cupy.cuda.Device(device):
            return int(cupy.cuda.get_current_stream().ptr)
    return None


_torch_raw_stream = None  # torch's own query of the current stream, found once


def torch_stream(device: int) -> int:
    """Torch's current stream on `device`, as a handle (0: the default stream)."""
    global _torch_raw_stream
    raw = _torch_raw_stream
    if raw is None:
        torch = sys.modules["torch"]
        raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)  # no Stream object made
        if raw is None:
            return int(torch.cuda.current_stream(device).cuda_stream)
        _torch_raw_stream = raw
    return int(raw(device))


def stream_key(stream: object, objects: Iterable[object], device: int) -> int:
    """The handle of the stream a call runs on (0: the device's default stream).

    Touches no device when the call names no stream and no framework supplies one,
    so argument errors still come before any device work.
    """
    if stream is None:
        handle = _framework_stream(objects, device)
        return 0 if handle is None else handle
    if isinstance(stream, Stream):
        return int(stream.handle)
    return _stream_handle(stream)


def caller_stream(stream: object, objects: Iterable[object], device: int) -> Stream:
    """The stream a call runs on (see the module's docstring), as a cuda.core Stream."""
    if isinstance(stream, Stream):
        return stream
    handle = stream_key(stream, objects, device)
    key = (device, handle)
    cached = _STREAMS.get(key)
    if cached is None:
        cached = _STREAMS[key] = current_stream(handle, device=device)
    return cached


def stream_handle(stream: Stream) -> int:
    return int(stream.handle)


def is_capturing(stream: Stream) -> bool:
    """Whether `stream` is being captured into a CUDA graph right now."""
    err, status = driver.cuStreamIsCapturing(driver.CUstream(int(stream.handle)))
    if err != driver.CUresult.CUDA_SUCCESS:
        return False
    return status != driver.CUstreamCaptureStatus.CU_STREAM_CAPTURE_STATUS_NONE


def _primary(device: int) -> tuple[driver.CUcontext, int]:
    """`device`'s primary context and its handle as an int."""
    cached = _CONTEXTS.get(device)
    if cached is None:
        with keep_context():
            get_device(device)  # retains the primary context and makes it current
            _, ctx = driver.cuCtxGetCurrent()
        cached = _CONTEXTS[device] = (ctx, int(ctx))
    return cached


class keep_context:  # lower case: used like a function, `with keep_context():`
    """Make the caller's current context current again when the body ends, whatever the
    body made current: cuda.core makes a device's context current to use it and leaves it
    so, and the CUDA runtime reads the current context as the current device (torch's
    `current_device()`). A caller with no current context keeps what the body left, as
    `on_device` does. Without a driver there is nothing to restore."""

    __slots__ = ("_before",)

    def __enter__(self) -> None:
        try:
            _, before = driver.cuCtxGetCurrent()
        except (RuntimeError, OSError):  # no driver: the body says why it cannot run
            before = None
        self._before = before if before is not None and int(before) else None

    def __exit__(self, *exc: object) -> None:
        if self._before is not None:
            driver.cuCtxSetCurrent(self._before)


class on_device:  # lower case: used like a function, `with on_device(d):`
    """Run the body with `device`'s primary context current, then restore the caller's.

    A class rather than a generator: it is entered on every call of a spec, and a
    planned run keeps one to enter again and again. One entry at a time: the context to
    restore is the entry's own."""

    __slots__ = ("_target", "_handle", "_before")

    def __init__(self, device: int):
        self._target, self._handle = _primary(device)
        self._before = None

    def __enter__(self) -> None:
        _, before = driver.cuCtxGetCurrent()
        handle = 0 if before is None else int(before)
        if handle == self._handle:
            return
        driver.cuCtxSetCurrent(self._target)
        if handle:
            self._before = before

    def __exit__(self, *exc: object) -> None:
        if self._before is not None:
            driver.cuCtxSetCurrent(self._before)
            self._before = None

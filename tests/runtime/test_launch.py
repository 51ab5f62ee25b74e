"""The launch layer without a GPU: device-needing calls raise DeviceUnavailableError."""

from __future__ import annotations

import numpy as np
import pytest

from gemmspec.errors import ArgumentError, DeviceUnavailableError
from gemmspec.runtime.arrays import DeviceBuffer, get_device
from gemmspec.runtime.launch import LoadedKernel, current_stream, num_sms


def _has_gpu() -> bool:
    try:
        get_device(0)
    except DeviceUnavailableError:
        return False
    return True


no_gpu = pytest.mark.skipif(_has_gpu(), reason="a CUDA device is present")


@no_gpu
@pytest.mark.parametrize(
    "call",
    [
        lambda: get_device(0),
        lambda: num_sms(),
        lambda: current_stream(),
        lambda: current_stream(7),
        lambda: DeviceBuffer(256),
        lambda: DeviceBuffer.from_numpy(np.arange(4, dtype=np.float32)),
        lambda: LoadedKernel(b"\x7fELF", "k"),
    ],
    ids=[
        "get_device",
        "num_sms",
        "default_stream",
        "handle_stream",
        "buffer",
        "from_numpy",
        "load",
    ],
)
def test_device_calls_raise_device_unavailable(call) -> None:
    with pytest.raises(DeviceUnavailableError, match="no usable CUDA device"):
        call()


def test_unusable_stream_object_is_an_argument_error() -> None:
    with pytest.raises(ArgumentError, match="cannot use a str as a CUDA stream"):
        current_stream("default")

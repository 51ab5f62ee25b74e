"""Bad run-time arguments raise ArgumentError before anything touches a GPU.

Tensors here are fake `__cuda_array_interface__` objects: the executor checks
names, dtypes, shapes, strides and alignment from metadata alone.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import gemmspec
from gemmspec.errors import ArgumentError

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "moe_fp8_forward.gspec"
T, N, K, E = 512, 4096, 7168, 8


class FakeCuda:
    """Just enough of a CUDA array for metadata checks."""

    def __init__(self, shape, typestr, strides=None, ptr=1 << 30):
        self.__cuda_array_interface__ = {
            "shape": tuple(shape),
            "typestr": typestr,
            "data": (ptr, False),
            "strides": strides,
            "version": 3,
        }


def good_args():
    return {
        "x": FakeCuda((T, K), "|u1"),
        "x_scale": FakeCuda((T, K // 128), "<f4", strides=(4, T * 4)),  # MN-major
        "w": FakeCuda((E, N, K), "|u1"),
        "w_scale": FakeCuda((E, N // 128, K // 128), "<f4"),
        "y": FakeCuda((T, N), "<u2"),
        "expert_offsets": FakeCuda((E + 1,), "<i4"),
    }


@pytest.fixture(scope="module")
def exe():
    return gemmspec.build(EXAMPLE)


def call(exe, **changes):
    args = good_args()
    for k, v in changes.items():
        if v is None:
            del args[k]
        else:
            args[k] = v
    with pytest.raises(ArgumentError) as info:
        exe(**args)
    return str(info.value)


def test_argument_names(exe):
    assert exe.argument_names() == ["x", "x_scale", "w", "w_scale", "y", "expert_offsets"]


def test_missing_tensor(exe):
    assert "missing tensor(s): w_scale" in call(exe, w_scale=None)


def test_unknown_tensor(exe):
    assert "unknown argument(s) bias" in call(exe, bias=FakeCuda((N,), "<f4"))


def test_host_array_rejected(exe):
    assert "is on the host" in call(exe, x=np.zeros((T, K), np.uint8))


def test_wrong_dtype(exe):
    msg = call(exe, y=FakeCuda((T, N), "<f4"))
    assert "'y'" in msg and "bf16" in msg and "f32" in msg


def test_wrong_rank(exe):
    assert "tensor 'x' must have 2 dims" in call(exe, x=FakeCuda((T, K, 1), "|u1"))


def test_inconsistent_runtime_dim(exe):
    assert "dim T is 512" in call(exe, y=FakeCuda((T + 1, N), "<u2"))


def test_wrong_fixed_dim(exe):
    assert "tensor 'w' must have shape [8, 4096, 7168]" in call(exe, w=FakeCuda((E, N, K - 128), "|u1"))


def test_wrong_strides(exe):
    msg = call(exe, x_scale=FakeCuda((T, K // 128), "<f4"))  # row-major, but declared major(T)
    assert "scale 'x_scale' must have element strides [1, 512] (major(T))" in msg


def test_operand_strides(exe):
    msg = call(exe, x=FakeCuda((T, K), "|u1", strides=(1, T)))
    assert "tensor 'x' must have element strides [7168, 1]" in msg


def test_misaligned(exe):
    assert "16-byte aligned" in call(exe, w=FakeCuda((E, N, K), "|u1", ptr=(1 << 30) + 8))


def test_offsets_dtype_and_shape(exe):
    assert "'expert_offsets' must be int32" in call(exe, expert_offsets=FakeCuda((E + 1,), "<i8"))
    assert "must have shape [9]" in call(exe, expert_offsets=FakeCuda((E,), "<i4"))


def test_scale_dtype(exe):
    assert "scale 'w_scale' must be float32" in call(exe, w_scale=FakeCuda((E, 32, 56), "<f8"))
